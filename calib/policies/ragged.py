"""Per-request (ragged) allocator policies: ``ragged_raw``, ``ragged_calibrated`` and ``two_drafter``.

The last two are calib's served policies (calib/vllm/server.py decides each engine step the same way);
:func:`draft_aware` is their replay of the draft-pass plan.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from calib.policies.base import Arm, Policy, PolicyResult, Serving, register_policy
from calib.policies.setting import Setting, allocate_chains

if TYPE_CHECKING:  # loaded on first use (calib.policies.setting says why)
    import torch

# The chains a served calib policy may verify (registry names, calib.chains): the engine drafter's own
# chain, and beside a model drafter the n-gram chain recomputed from the request's tokens.
DRAFTER_CHAIN, NGRAM_CHAIN = "model", "ngram"


def draft_aware(s: Setting, p1: np.ndarray, forecast: np.ndarray, p2: np.ndarray | None) -> PolicyResult:
    """The draft-aware allocator per step (:func:`calib.allocate.plan_draft`): from the tables' forecast
    of the primary chain (``forecast`` [S, B, K]) and the second chain (``p2`` [S, B, K], free to know:
    drafted before the primary) the plan chooses the step's primary draft passes, once before drafting
    as served (``cfg.plan == "step"``), or before each pass from the calibrated tokens drafted so far
    (``p1`` [S, B, K], ``"pass"``); the passes run are charged (:meth:`Setting.draft`, however many rows
    draft), then the allocator verifies what was drafted. In budget mode there is no price to weigh a
    pass against: K passes, as before.
    """
    sb, S, B = s.sb, s.S, s.B
    if s.budget is not None:
        return s.ragged(p1, p2, s.draft(s.K, second=p2 is not None))
    pass_cost = s.pass_price()
    free_cost = s.second_cost if p2 is not None else 0.0
    verify = s.curve.tensor()
    dr = np.zeros((S, B), np.int64)
    de = np.zeros((S, B), np.int64)
    passes = np.zeros(S)
    for i in range(S):
        p2_i = None if p2 is None else p2[i]
        known, done = planned_drafts(s, p1[i], forecast[i], p2_i, verify, pass_cost, free_cost)
        passes[i] = done
        extra = free_cost + s.draft(done)
        dr[i], de[i] = allocate_chains(known, p2_i, s.curve.tensor(extra=extra), None, s.cfg.impl, sb.names)
    return s.allocated(dr, de, free_cost + s.draft(passes), draft_passes=float(passes.mean()))


def planned_drafts(s: Setting, p1: np.ndarray, forecast: np.ndarray, p2: np.ndarray | None, verify: torch.Tensor,
                   pass_cost: float, free_cost: float) -> tuple[np.ndarray, int]:
    """One step's draft passes as the plan runs them: (the primary chain's drafted probabilities [B, K],
    NaN where not drafted; the passes run). ``p1``, ``forecast``, ``p2`` [B, K]. Planned once per step
    every request drafts every pass (vLLM's drafter runs the batch); planned per pass, the requests the
    plan does not draft for end their chain there."""
    import torch

    from calib.allocate import plan_draft

    first, second = s.sb.names
    B, K = s.B, s.K
    known = np.full((B, K), np.nan, dtype=np.float32)
    others = {} if p2 is None else {second: torch.from_numpy(np.ascontiguousarray(p2, dtype=np.float32))}
    fc = torch.from_numpy(np.ascontiguousarray(forecast, dtype=np.float32))
    if s.cfg.plan == "step":
        plan = plan_draft({first: torch.zeros(B, 0), **others}, fc, cost=verify, pass_cost=pass_cost,
                          sunk=free_cost, chain=first, impl=s.cfg.impl)
        done = plan.passes if plan.run_pass else 0
        known[:, :done] = p1[:, :done]
        return known, done
    done = 0
    while done < K:
        plan = plan_draft({first: torch.from_numpy(known[:, :done].copy()), **others}, fc, cost=verify,
                          pass_cost=pass_cost, sunk=free_cost + done * pass_cost, chain=first,
                          impl=s.cfg.impl)
        if not plan.run_pass:
            break
        rows = plan.drafting.numpy()
        known[rows, done] = p1[rows, done]  # the pass drafts these rows' next token (NaN: chain ended)
        done += 1
    return known, done


def ragged_raw(s: Setting) -> PolicyResult | None:
    return None if s.sb.p_raw is None else s.ragged(s.sb.p_raw, None, s.sunk)


def ragged_calibrated(s: Setting) -> PolicyResult | None:
    p_cal, fc = s.sb.p_cal[s.P], s.sb.p_forecast[s.P]
    if p_cal is None:
        return None
    return s.ragged(p_cal, None, s.sunk) if fc is None else draft_aware(s, p_cal, fc, None)


def two_drafter(s: Setting) -> PolicyResult | None:
    sb = s.sb
    if not (sb.second and sb.p_cal[s.P] is not None and sb.p_cal[s.Q] is not None):
        return None
    fc = sb.p_forecast[s.P]
    if fc is None:  # tables without a forecast: draft K, then allocate
        return s.ragged(sb.p_cal[s.P], sb.p_cal[s.Q], s.draft(s.K, second=True))
    return draft_aware(s, sb.p_cal[s.P], fc, sb.p_cal[s.Q])


register_policy(Policy(
    "ragged_raw", 50, "tab:red", "allocator (goodput rule) per request on the drafter's raw confidences (model "
    "chain only); pays K draft passes first", ragged_raw, camp="reference",
    below_no_spec="raw confidences are mis-calibrated, so the goodput rule buys positions that do not pay; it "
                  "also pays for K draft passes"))
# Served: each request verifies a calibrated prefix of the engine drafter's own chain ([] when it does not
# pay); with a model drafter, plan_draft also picks the step's number of draft passes.
register_policy(Policy(
    "ragged_calibrated", 60, "tab:blue", "draft-aware allocator on the calibrated tables: before each draft "
    "pass, runs it only if the forecast goodput says it pays; then allocates per request", ragged_calibrated,
    camp="calib",
    below_no_spec="a pass the forecast said would pay can draft tokens the target then rejects; the drafting "
                  "is not refunded",
    serving=Serving(speculate=True, calib=True, chains=(DRAFTER_CHAIN,), plan=True,
                    arms=(Arm("calib_ragged", "eagle"),
                          Arm("calib_ngram", "ngram", default=False))),  # calib cuts vLLM's n-gram drafts
    aliases=("calib_ragged",)))
# Served: calib decides between two chains per request, the engine drafter's (EAGLE) and the n-gram chain
# recomputed from the request's tokens, verifying a calibrated prefix of one of them or nothing; with a
# model drafter, plan_draft picks the step's number of draft passes knowing the n-gram chains.
register_policy(Policy(
    "two_drafter", 70, "tab:purple", "draft-aware allocator over the calibrated model and n-gram chains (banks "
    "that have both): the n-gram chain is known first, each model pass runs only if it pays", two_drafter,
    camp="calib", below_no_spec="a model pass the forecast said would pay can draft tokens the target rejects",
    serving=Serving(speculate=True, calib=True, chains=(DRAFTER_CHAIN, NGRAM_CHAIN), plan=True,
                    arms=(Arm("calib_two_drafter", "eagle"),)),
    aliases=("calib_two_drafter",)))
