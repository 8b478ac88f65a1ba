"""What a step policy's ``compute`` receives: one (bank, category, B) setting's arrays under one cost curve.

:class:`StepBatch` gathers a setting's per-chain arrays once for every policy; :class:`Setting` adds the
curve, the drafting prices and the helpers the built-ins share. Accounting: docs/policies.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from calib.chains import chain
from calib.policies.base import PolicyResult

# torch, the allocator and the cost curves load on first use: serve.py stores this registry's `policy` group
# before composing its config, and its --help must answer without torch (issue 43)
if TYPE_CHECKING:
    import torch


class StepBatch:
    """The arrays of one (bank, category, B) setting, gathered once for every policy.

    Per-chain arrays are keyed by chain registry id (:mod:`calib.chains`, the allocator's ``drafter``
    values): ``ids = (primary, second)``, the bank's verified chain and the other chain it labels (e.g.
    the n-gram chain of a model-drafter bank; None if there is none); ``names`` are their names.
    ``bank`` is a :class:`calib.evaluate.data.EvalBank`; ``rows`` [R] its rows of the setting, ``idx``
    [S, B] the steps' positions in ``rows`` (:func:`calib.evaluate.replay.draw_steps`).
    """

    def __init__(self, bank, rows: np.ndarray, idx: np.ndarray):
        self.bank = bank
        self.idx = idx  # [S, B] positions in rows
        self.S, self.B = idx.shape
        others = [name for name in bank.chains if name != bank.primary]
        self.names = (bank.primary, others[0] if others else None)
        self.ids = tuple(None if n is None else chain(n).id for n in self.names)
        self.second = bool(others)
        sel = rows[idx]  # [S, B] -> bank row
        self.acc: dict[int, np.ndarray] = {}  # {chain id: [S, B] accepted prefix length}
        self.length: dict[int, np.ndarray] = {}  # {chain id: [S, B] drafted length}
        self.p_cal: dict[int, np.ndarray | None] = {}  # {chain id: [S, B, K] calibrated P(accept | reached)}
        self.p_forecast: dict[int, np.ndarray | None] = {}  # {chain id: [S, B, K] the tables' forecast}
        self.oracle: dict[int, np.ndarray] = {}  # {chain id: [S, B, K] the actual accept masks as probabilities}
        for name, cid in zip(self.names, self.ids):
            if name is None:
                continue
            c = bank.chains[name]
            self.acc[cid], self.length[cid] = c.accept[sel], c.length[sel]
            self.p_cal[cid] = None if c.p_cal is None else c.p_cal[sel]
            self.p_forecast[cid] = None if c.p_forecast is None else c.p_forecast[sel]
            self.oracle[cid] = c.oracle_p()[sel]
        prim = bank.chains[bank.primary]
        self.p_raw = None if prim.p_raw is None else prim.p_raw[sel]  # [S, B, K] the drafter's confidences
        self.K = prim.acc.shape[1]
        # [S, B] tokens the collecting engine committed in each round (its verified chain's accepted prefix + 1;
        # 1 in a step it drafted nothing): the stretch of the request's text the round stands for
        self.covered = self.acc[self.ids[0]] + 1
        # [S, B] tokens in each request's context at its round (None where the bank records none)
        self.cached = None if bank.cached is None else bank.cached[sel]


def committed(sb: StepBatch, drafter: np.ndarray, depth: np.ndarray) -> np.ndarray:
    """min(depth, accepted of the chosen chain) + 1 per round [S, B] (a step's tokens: ``.sum(-1)``).
    ``drafter``, ``depth`` [S, B]; depth is 0 where drafter is 0. ``drafter`` holds chain ids (the primary
    chain's for fixed-depth policies)."""
    first, second = sb.ids
    acc = np.where(drafter == second, sb.acc[second], sb.acc[first]) if sb.second else sb.acc[first]
    return np.minimum(depth, acc) + 1


# the weightings that count a recorded round for the text it covered (calib.evaluate.replay.config.WEIGHTINGS)
COVERED_WEIGHTINGS = ("positions", "throughput")


def step_weights(tokens: np.ndarray, covered: np.ndarray | None, weighting: str = "positions") -> np.ndarray:
    """How many times each step counts [S]: once each (``covered`` None, or weighting ``rounds``), or with
    ``covered`` [S, B] (the tokens the collecting engine committed in each round) the steps a policy committing
    ``tokens`` [S, B] needs to write the text its rounds stand for (:func:`calib.evaluate.replay.summarise`):
    ``mean_b covered / tokens``, each request crossing its own stretch (weighting ``positions``), or
    ``sum_b covered / sum_b tokens``, the batch writing all of them at its total rate (weighting ``throughput``: a
    request done with its stretch sooner makes room for another's, as a server keeping B requests in flight does)."""
    if covered is None or weighting not in COVERED_WEIGHTINGS:
        return np.ones(len(tokens))
    if weighting == "throughput":
        return covered.sum(axis=1) / tokens.sum(axis=1)
    return (covered / tokens).mean(axis=1)


def written(tokens: np.ndarray, covered: np.ndarray | None, weighting: str = "positions") -> np.ndarray:
    """[S, B] the text a step's rounds count for under ``weighting``: what the collector covered, or (``covered``
    None, weighting ``rounds``) what the policy committed."""
    return covered if covered is not None and weighting in COVERED_WEIGHTINGS else tokens


def allocate_chains(p1, p2, cost: torch.Tensor, budget: int | None, impl: str, names: tuple):
    """Allocate over the chain ``names[0]`` (probabilities ``p1`` [B, K]) and, if given, ``names[1]``
    (``p2`` [B, K]); returns (chain id [B], 0 = none; depth [B])."""
    import torch

    from calib.allocate import allocate_probs

    probs = {names[0]: torch.from_numpy(np.ascontiguousarray(p1, dtype=np.float32))}
    if p2 is not None:
        probs[names[1]] = torch.from_numpy(np.ascontiguousarray(p2, dtype=np.float32))
    out = (allocate_probs(probs, budget=budget, impl=impl) if budget is not None
           else allocate_probs(probs, cost=cost, impl=impl))
    return out.drafter.numpy().astype(np.int64), out.depth.numpy().astype(np.int64)


class Setting:
    """One (bank, category, B) setting under one cost curve: what a step policy's ``compute`` receives.

    ``sb`` the gathered arrays, ``curve`` (a :class:`calib.cost.CostCurve`, already ``for_batch``),
    ``cfg`` (a :class:`calib.evaluate.replay.ReplayConfig`), ``train_curve`` [K] (the primary chain's
    training acceptance curve), ``budget`` (None in price mode), ``sunk`` (the price of K primary draft
    passes), and the helpers :meth:`draft`, :meth:`uniform` and :meth:`ragged` the built-ins share.

    Two chains (``P`` the primary, ``Q`` the second or None): the draft-aware plan and the allocator's
    callers here offer one second chain beside the primary, and their drafting prices are summed in that
    order (``frac_p + frac_q``); docs/policies.md says what a per-chain mapping must keep.

    On an engine's measured step cost (:class:`calib.cost.step.EngineStepCurve`) drafting is priced as
    the engine spends it instead of ``draft_cost``: a bank whose primary chain is a model drafter's
    pays the loaded drafter's idle forward in every speculating step (``curve``; ``plain`` is the curve
    without it, for ``no_spec``), each draft pass at its measured price, and a model-free chain its
    proposer per step; calib's served policies also pay calib's hooks (:meth:`overhead`).
    """

    def __init__(self, sb: StepBatch, curve, cfg, train_curve: np.ndarray):
        from calib.cost.step import EngineStepCurve

        self.sb, self.cfg = sb, cfg
        self.engine = isinstance(curve, EngineStepCurve)
        self.model_primary = chain(sb.names[0]).confidence is not None  # its passes are model forwards
        if self.engine:  # a bank under sampling pays the sampled path's extra work wherever it verifies drafts
            t = sb.bank.temperature  # None or NaN: not recorded, priced as greedy
            curve = curve.with_sampling(t is not None and bool(np.isfinite(t)) and t > 0)
        self.plain = curve.with_drafter(False) if self.engine else curve  # no speculation: nothing loaded
        self.curve = curve.with_drafter(self.model_primary) if self.engine else curve
        self.train_curve = train_curve  # [K]
        self.S, self.B, self.K = sb.S, sb.B, sb.K
        self.c_b = self.curve.values[self.B]
        self.P, self.Q = sb.ids  # the primary chain's id and the second chain's (None: there is none)
        self.frac_p = float(cfg.draft_cost.get(sb.names[0], 0.0))
        self.frac_q = float(cfg.draft_cost.get(sb.names[1], 0.0))
        self.budget = None if cfg.mode == "price" else max(round(cfg.budget_per_request * self.B), 0)
        self.one = np.full((self.S, self.B), self.P, dtype=np.int64)  # [S, B] fixed-depth policies verify the primary
        self.sunk = self.draft(self.K)
        self.second_cost = self.draft(self.K, second=True) - self.draft(self.K)  # the second chain's drafting
        # a step of the lane replay (calib.evaluate.replay.lanes.LaneStep): which lane each row is, and the memory a
        # stateful policy keeps across that lane run's steps; None: the setting's steps all at once
        self.lanes = None

    def draft(self, passes, second=False):
        """Drafting cost of ``passes`` draft passes over the batch (both chains' if ``second``)."""
        if not self.engine:
            return (self.frac_p + (self.frac_q if second else 0.0)) * passes * self.c_b
        chain_step = self.curve.chain()  # a model-free chain's proposer: once per step, whatever its depth
        own = self.curve.draft(passes) if self.model_primary else np.where(np.asarray(passes) > 0, chain_step, 0.0)
        total = own + (chain_step if second else 0.0)
        return float(total) if np.ndim(total) == 0 else total

    def pass_price(self) -> float:
        """The price of one primary draft pass a plan weighs (the mean over K passes on an engine's step
        cost, whose first pass runs no extra forward)."""
        return self.draft(1) if not self.engine else float(self.draft(self.K)) / self.K

    def step_goodput(self, tokens: np.ndarray, cost: np.ndarray) -> np.ndarray:
        """Each step's goodput [S] as the replay's totals count it: ``tokens`` [S, B] per round over ``cost`` [S];
        weighted by positions (``cfg.weighting``), the text the step's rounds stand for over the cost of the
        steps this policy needs to write it (:func:`calib.evaluate.replay.summarise`)."""
        w = self.cfg.weighting
        return written(tokens, self.sb.covered, w).sum(axis=1) / (cost * step_weights(tokens, self.sb.covered, w))

    def overhead(self, served_by_calib: bool) -> float:
        """What calib's hooks cost a step of a policy calib serves (an engine's step cost only)."""
        return self.curve.calib() if (self.engine and served_by_calib) else 0.0

    def uniform(self, gamma_per_step, draft_cost):
        """(tokens [S, B], cost [S], positions [S]) of verifying γ_s [S] on every request of step s (capped by its chain)."""
        sb = self.sb
        depth = np.minimum(np.asarray(gamma_per_step)[:, None], sb.length[self.P])  # cannot verify past the chain
        tokens = committed(sb, self.one, depth)
        positions = depth.sum(axis=1)
        return tokens, self.curve.charge(depth) + draft_cost, positions

    def uniform_second(self, gamma_per_step):
        """(tokens [S, B], cost [S], positions [S]) of the second chain served alone at γ_s [S] (capped by its chain), as
        the engine that drafts only it would spend: no model drafter loaded (``plain``), the chain's own
        drafting (its proposer once per step on an engine's step cost, else ``draft_cost`` per pass)."""
        sb = self.sb
        depth = np.minimum(np.asarray(gamma_per_step)[:, None], sb.length[self.Q])
        ids = np.full((self.S, self.B), self.Q, dtype=np.int64)
        drafting = (self.plain.chain() if self.engine
                    else self.frac_q * np.asarray(gamma_per_step, dtype=np.float64) * self.plain.values[self.B])
        return committed(sb, ids, depth), self.plain.charge(depth) + drafting, depth.sum(axis=1)

    def ragged(self, p1, p2, extra_cost) -> PolicyResult:
        """The allocator per step on probabilities ``p1`` (primary) and ``p2`` (second chain, or None), [S, B, K]."""
        sb, S, B, curve = self.sb, self.S, self.B, self.curve
        dr = np.zeros((S, B), np.int64)
        de = np.zeros((S, B), np.int64)
        for s in range(S):
            dr[s], de[s] = allocate_chains(p1[s], None if p2 is None else p2[s], curve.tensor(extra=extra_cost),
                                           self.budget, self.cfg.impl, sb.names)
        return self.allocated(dr, de, extra_cost)

    def allocated(self, dr, de, extra_cost, **extra) -> PolicyResult:
        """The :class:`PolicyResult` of allocator decisions ``dr`` (chain id) / ``de`` (depth) [S, B] charged
        the verify pass plus ``extra_cost`` (drafting, scalar or [S]); ``extra`` joins the row's extras."""
        tok = committed(self.sb, dr, de)
        pos = de.sum(axis=1)
        share2 = float((dr == self.Q).mean()) if self.Q is not None else 0.0
        charged = self.curve.charge(de) + extra_cost
        # What the allocator priced (a curve over T for this B) vs the shape's actual cost.
        seen = self.curve(self.B + pos) + extra_cost
        return PolicyResult(tok, charged, pos, {"ngram_share": share2,
                                                "charged_vs_priced": float(charged.sum() / seen.sum()), **extra})
