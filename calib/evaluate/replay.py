"""Replay banks as a stream of decode steps and score serving policies by goodput.

A *step* draws ``B`` rounds of one category from the evaluation split (without replacement within
a step; the same steps are shown to every policy and every cost curve). A policy decides, per
request, which chain to verify (none / the bank's primary chain / the n-gram chain) and how deep.
Accounting, exact by construction:

* a round verified at depth ``d`` commits ``min(d, accepted) + 1`` tokens (the accepted draft
  prefix it verified plus the bonus/correction token the verify pass always yields);
* the step costs ``C(B + Σ d)`` (shape-dependent curves, e.g. MoE: the cost of the actual depths,
  :meth:`CostCurve.charge`) (one verify pass over every request's bonus position and its draft
  tokens) plus the drafting cost: ``draft_cost[drafter] · passes · C(B)``, one draft forward pass
  over the batch per drafted depth, priced as a fraction of the target's pass over the batch;
* goodput = Σ committed / Σ cost over all steps (a stream's tokens per unit of time).

Policies are registered in :mod:`calib.evaluate.policies` (the built-ins below, at the end of this
module; every decision through :func:`calib.allocate.allocate_probs`, the serve-time code):

=====================  ==============================================================================
``no_spec``            verify nothing; one token per request per pass
``fixed_<γ>``          every request verifies ``min(γ, drafted)`` tokens; γ draft passes
``best_fixed``         the fixed γ (0 = no_spec included) with the best goodput in hindsight, per
                       bank/category/B/curve: the best static policy
``vllm_dsd``           vLLM's Dynamic SD: one K per batch size, the best in hindsight over both
                       categories pooled (= ``best_fixed`` on category ``all``)
``homogeneous``        one γ for all steps, from the primary chain's mean acceptance curve on the
                       training split (the goodput rule on one representative request)
``gated_uniform``      one γ per step from this step's mean calibrated survival curve
``ragged_raw``         allocator on raw confidences (model drafter only: n-gram chains have none)
``ragged_calibrated``  draft-aware allocator on calibrated tables (:func:`draft_aware`)
``two_drafter``        draft-aware allocator on calibrated model + n-gram chains (banks that have both)
``oracle``             allocator on the actual accept masks; it also picks in hindsight how many
                       draft passes to pay for (0..K), so it bounds every policy step by step
=====================  ==============================================================================

``gated_uniform`` and ``ragged_raw`` draft the full K-deep chain before they decide; that cost is
sunk and is added to the price curve the allocator sees. ``ragged_calibrated`` and ``two_drafter``
decide before each model draft pass whether it pays (:func:`calib.allocate.plan_draft`, from the
tables' forecast) and are charged the passes they run. A pass costs the same however many rows
draft. ``mode: budget`` swaps the goodput rule for a token budget per request (and K passes).
"""

from __future__ import annotations

import functools
import math
import numbers
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import ClassVar

import numpy as np
import torch

from calib.allocate import allocate_probs, plan_draft
from calib.allocate.api import IMPLEMENTATIONS
from calib.calibrators.base import Interval, Options, validate_params
from calib.chains import chain, chain_names
from calib.cost import CostCurve
from calib.evaluate.data import EvalBank
from calib.evaluate.policies import (
    BASE_TOTALS,
    Policy,
    PolicyResult,
    closure,
    policy,
    policy_names,
    policy_of_row,
    register_policy,
)
from calib.labels import censored

UNIFORM = ("homogeneous", "gated_uniform")
MODES = ("price", "budget")  # price: goodput rule on the cost curve; budget: tokens per request
DRAFTERS = chain_names()  # the chains a draft cost can be given for (calib.chains, at import)
EVAL_YAML = Path(__file__).resolve().parents[2] / "conf" / "eval.yaml"


@functools.cache
def yaml_defaults() -> dict:
    """ReplayConfig's defaults: ``conf/eval.yaml``'s ``replay:`` block and its ``draft_cost:`` (the one
    place they are written; ``eval.py`` passes the composed values, overrides included)."""
    from omegaconf import OmegaConf

    if not EVAL_YAML.exists():
        raise FileNotFoundError(f"{EVAL_YAML} not found: ReplayConfig takes its defaults from it; pass "
                                "every field explicitly when calib runs outside its repository")
    cfg = OmegaConf.load(EVAL_YAML)
    replay = OmegaConf.to_container(cfg.replay, resolve=True)
    return {**{f.name: replay[f.name] for f in fields(ReplayConfig) if f.name in replay},
            "draft_cost": OmegaConf.to_container(cfg.draft_cost, resolve=True)}


def _from_yaml(name: str):
    """A ``default_factory`` reading field ``name`` from :func:`yaml_defaults` at construction."""
    return lambda: yaml_defaults()[name]


@dataclass
class ReplayConfig:
    """How the replay runs; fields not given take their value from ``conf/eval.yaml`` (``replay:``
    and ``draft_cost:``), so the YAML is the one source of every default. Checked on construction:
    an unknown policy, mode or implementation is a ``ValueError`` listing the valid ones.

    Attributes:
        batch_sizes: the B of each replayed setting.
        policies: registered policy names (:func:`calib.evaluate.policies.policy_names`; ``fixed`` =
            every ``fixed_<γ>``); checked against the registry when the config is built.
        mode: from :data:`MODES`; ``price``: the allocator's goodput rule on the cost curve,
            ``budget``: a batch budget of ``round(budget_per_request * B)`` draft tokens.
        min_steps, max_steps, passes: steps per setting ≈ ``passes · rounds / B``, clipped.
        seed: of the step draws.
        draft_cost: ``{drafter: cost of one draft pass as a fraction of the target's pass over B}``,
            drafters from :data:`DRAFTERS`.
        impl: the allocator implementation (``calib.allocate``'s ``IMPLEMENTATIONS``).
    """

    batch_sizes: tuple[int, ...] = field(default_factory=_from_yaml("batch_sizes"))
    policies: tuple[str, ...] = field(default_factory=_from_yaml("policies"))
    mode: str = field(default_factory=_from_yaml("mode"))
    budget_per_request: float = field(default_factory=_from_yaml("budget_per_request"))
    min_steps: int = field(default_factory=_from_yaml("min_steps"))
    max_steps: int = field(default_factory=_from_yaml("max_steps"))
    passes: float = field(default_factory=_from_yaml("passes"))
    seed: int = field(default_factory=_from_yaml("seed"))
    draft_cost: dict = field(default_factory=_from_yaml("draft_cost"))
    impl: str = field(default_factory=_from_yaml("impl"))

    _constraints: ClassVar[dict] = {  # declarative checks (calib.calibrators.base), batch_sizes below
        "mode": [Options(MODES)],
        "budget_per_request": [Interval(numbers.Real, 0, None)],
        "min_steps": [Interval(numbers.Integral, 1, None)],
        "max_steps": [Interval(numbers.Integral, 1, None)],
        "passes": [Interval(numbers.Real, 0, None, closed="neither")],
        "seed": [Interval(numbers.Integral, 0, None)],
        "impl": [Options(IMPLEMENTATIONS)],
    }

    def __post_init__(self) -> None:
        self.batch_sizes = tuple(self.batch_sizes)
        self.policies = tuple(self.policies)
        self.draft_cost = dict(self.draft_cost)
        params = {f.name: getattr(self, f.name) for f in fields(self)}
        validate_params("ReplayConfig", {k: params[k] for k in self._constraints}, self._constraints)
        known = policy_names()
        pols = list(self.policies)
        if not pols or len(set(pols)) != len(pols) or not all(isinstance(p, str) for p in pols):
            raise ValueError(f"ReplayConfig: policies={pols} is invalid; it must be a non-empty list of distinct "
                             f"policy names; the registered policies are {list(known)}")
        unknown = [p for p in pols if p not in known]
        if unknown:
            raise ValueError(f"ReplayConfig: unknown policies {unknown}; the registered policies are "
                             f"{list(known)} (calib.evaluate.policies)")
        positive = Interval(numbers.Integral, 1, None)
        if not self.batch_sizes or not all(positive.accepts(b) for b in self.batch_sizes):
            raise ValueError(f"ReplayConfig: batch_sizes={list(self.batch_sizes)} is invalid; it must be a "
                             "non-empty list of integers >= 1")
        if self.min_steps > self.max_steps:
            raise ValueError(f"ReplayConfig: min_steps={self.min_steps} > max_steps={self.max_steps}")
        unknown = sorted(set(self.draft_cost) - set(chain_names()))
        if unknown:
            raise ValueError(f"ReplayConfig: draft_cost names {unknown}; the drafters are {list(chain_names())}")
        for name, cost in self.draft_cost.items():
            if not Interval(numbers.Real, 0, None).accepts(cost):
                raise ValueError(f"ReplayConfig: draft_cost[{name!r}]={cost!r} is invalid; it must be a "
                                 "finite number >= 0 (a fraction of the target's verify pass over the batch)")


def train_mean_curve(bank: EvalBank) -> np.ndarray:
    """Primary chain's P(accept k | reached k) pooled over the training split (NaN: never reached)."""
    chain = bank.chains[bank.primary]
    acc = chain.acc[bank.split == "train"]
    if acc.shape[0] == 0:
        acc = chain.acc
    reached, label = censored(acc)
    n = reached.sum(axis=0)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(n > 0, (reached & label).sum(axis=0) / np.maximum(n, 1), np.nan)


def draw_steps(n_rounds: int, batch: int, cfg: ReplayConfig, rng: np.random.Generator) -> np.ndarray:
    """[S, B] row indices; rows are distinct within a step when the pool allows it."""
    steps = int(np.clip(math.ceil(cfg.passes * n_rounds / batch), cfg.min_steps, cfg.max_steps))
    if n_rounds >= batch:
        return np.stack([rng.choice(n_rounds, size=batch, replace=False) for _ in range(steps)])
    return rng.integers(0, n_rounds, size=(steps, batch))


class StepBatch:
    """The arrays of one (bank, category, B) setting, gathered once for every policy.

    Per-chain arrays are keyed by chain registry id (:mod:`calib.chains`, the allocator's ``drafter``
    values): ``ids = (primary, second)``, the bank's verified chain and the other chain it labels (e.g.
    the n-gram chain of a model-drafter bank; None if there is none); ``names`` are their names.
    """

    def __init__(self, bank: EvalBank, rows: np.ndarray, idx: np.ndarray):
        self.bank, self.idx = bank, idx
        self.S, self.B = idx.shape
        others = [name for name in bank.chains if name != bank.primary]
        self.names = (bank.primary, others[0] if others else None)
        self.ids = tuple(None if n is None else chain(n).id for n in self.names)
        self.second = bool(others)
        sel = rows[idx]  # [S, B] -> bank row
        self.acc, self.length, self.p_cal, self.p_forecast, self.oracle = {}, {}, {}, {}, {}
        for name, cid in zip(self.names, self.ids):
            if name is None:
                continue
            c = bank.chains[name]
            self.acc[cid], self.length[cid] = c.accept[sel], c.length[sel]
            self.p_cal[cid] = None if c.p_cal is None else c.p_cal[sel]
            self.p_forecast[cid] = None if c.p_forecast is None else c.p_forecast[sel]
            self.oracle[cid] = c.oracle_p()[sel]
        prim = bank.chains[bank.primary]
        self.p_raw = None if prim.p_raw is None else prim.p_raw[sel]
        self.K = prim.acc.shape[1]


def _committed(sb: StepBatch, drafter: np.ndarray, depth: np.ndarray) -> np.ndarray:
    """Σ_i min(depth_i, accepted of the chosen chain) + 1, per step. depth is 0 where drafter is 0.
    ``drafter`` holds chain ids (the primary chain's for fixed-depth policies)."""
    first, second = sb.ids
    acc = np.where(drafter == second, sb.acc[second], sb.acc[first]) if sb.second else sb.acc[first]
    return (np.minimum(depth, acc) + 1).sum(axis=-1)


def _alloc(p1, p2, cost: torch.Tensor, budget: int | None, impl: str, names: tuple):
    """Allocate over the chain ``names[0]`` (probabilities ``p1``) and, if given, ``names[1]`` (``p2``);
    returns (chain id [B], 0 = none; depth [B])."""
    probs = {names[0]: torch.from_numpy(np.ascontiguousarray(p1, dtype=np.float32))}
    if p2 is not None:
        probs[names[1]] = torch.from_numpy(np.ascontiguousarray(p2, dtype=np.float32))
    out = (allocate_probs(probs, budget=budget, impl=impl) if budget is not None
           else allocate_probs(probs, cost=cost, impl=impl))
    return out.drafter.numpy().astype(np.int64), out.depth.numpy().astype(np.int64)


def _uniform_gamma(p_row: np.ndarray, batch: int, curve: CostCurve, draft: np.ndarray, impl: str) -> int:
    """Best batch-uniform γ for a batch of ``batch`` requests that all follow the curve ``p_row``.

    One representative request with a rescaled price curve ``cost1[1 + d] = C(B(1 + d)) + draft[d]``
    has goodput ``(1 + E_d) / cost1[1 + d]`` = the batch's goodput / B, so the allocator's exact
    goodput rule on it returns the batch-uniform optimum.
    """
    K = p_row.shape[0]
    cost1 = np.empty(K + 2)
    cost1[0] = np.inf
    for d in range(K + 1):
        cost1[1 + d] = curve.values[batch * (1 + d)] + draft[d]
    _, depth = _alloc(p_row[None, :], None, torch.from_numpy(cost1), None, impl, (chain_names()[0], None))
    return int(depth[0])


def _mean_conditional(p: np.ndarray) -> np.ndarray:
    """Batch-mean survival curve as conditional probabilities [K] (NaN once the mean survival is 0)."""
    present = ~np.isnan(p)
    in_chain = np.cumprod(present, axis=-1).astype(bool)
    surv = np.cumprod(np.where(in_chain, np.clip(np.nan_to_num(p), 0, 1), 0.0), axis=-1).mean(axis=0)
    prev = np.concatenate([[1.0], surv[:-1]])
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(prev > 0, surv / prev, np.nan)


class Setting:
    """One (bank, category, B) setting under one cost curve: what a step policy's ``compute`` receives.

    ``sb`` the gathered arrays, ``curve`` (already :meth:`CostCurve.for_batch`), ``cfg``, ``train_curve``
    (:func:`train_mean_curve`), ``budget`` (None in price mode), ``sunk`` (the price of K primary draft
    passes), and the helpers :meth:`draft`, :meth:`uniform` and :meth:`ragged` the built-ins share.
    """

    def __init__(self, sb: StepBatch, curve: CostCurve, cfg: ReplayConfig, train_curve: np.ndarray):
        self.sb, self.curve, self.cfg, self.train_curve = sb, curve, cfg, train_curve
        self.S, self.B, self.K = sb.S, sb.B, sb.K
        self.c_b = curve.values[self.B]
        self.P, self.Q = sb.ids  # the primary chain's id and the second chain's (None: there is none)
        self.frac_p = float(cfg.draft_cost.get(sb.names[0], 0.0))
        self.frac_q = float(cfg.draft_cost.get(sb.names[1], 0.0))
        self.budget = None if cfg.mode == "price" else max(round(cfg.budget_per_request * self.B), 0)
        self.one = np.full((self.S, self.B), self.P, dtype=np.int64)  # fixed-depth policies verify the primary
        self.sunk = self.draft(self.K)
        self.second_cost = self.draft(self.K, second=True) - self.draft(self.K)  # the second chain's drafting

    def draft(self, passes, second=False):
        """Drafting cost of ``passes`` draft passes over the batch (both chains' if ``second``)."""
        return (self.frac_p + (self.frac_q if second else 0.0)) * passes * self.c_b

    def uniform(self, gamma_per_step, draft_cost):
        """(tokens, cost, positions) of verifying γ_s on every request of step s (capped by its chain)."""
        sb = self.sb
        depth = np.minimum(np.asarray(gamma_per_step)[:, None], sb.length[self.P])  # cannot verify past the chain
        tokens = _committed(sb, self.one, depth)
        positions = depth.sum(axis=1)
        return tokens, self.curve.charge(depth) + draft_cost, positions

    def ragged(self, p1, p2, extra_cost) -> PolicyResult:
        """The allocator per step on probabilities ``p1`` (primary) and ``p2`` (second chain, or None)."""
        sb, S, B, curve = self.sb, self.S, self.B, self.curve
        dr = np.zeros((S, B), np.int64)
        de = np.zeros((S, B), np.int64)
        for s in range(S):
            dr[s], de[s] = _alloc(p1[s], None if p2 is None else p2[s], curve.tensor(extra=extra_cost),
                                  self.budget, self.cfg.impl, sb.names)
        return self.allocated(dr, de, extra_cost)

    def allocated(self, dr, de, extra_cost, **extra) -> PolicyResult:
        """The :class:`PolicyResult` of allocator decisions ``dr`` (chain id) / ``de`` (depth) [S, B] charged
        the verify pass plus ``extra_cost`` (drafting, scalar or [S]); ``extra`` joins the row's extras."""
        tok = _committed(self.sb, dr, de)
        pos = de.sum(axis=1)
        share2 = float((dr == self.Q).mean()) if self.Q is not None else 0.0
        charged = self.curve.charge(de) + extra_cost
        # What the allocator priced (a curve over T for this B) vs the shape's actual cost.
        seen = self.curve(self.B + pos) + extra_cost
        return PolicyResult(tok, charged, pos, {"ngram_share": share2,
                                                "charged_vs_priced": float(charged.sum() / seen.sum()), **extra})


def draft_aware(s: Setting, p1: np.ndarray, forecast: np.ndarray, p2: np.ndarray | None) -> PolicyResult:
    """The draft-aware allocator per step (:func:`calib.allocate.plan_draft`): before each primary-chain
    draft pass the plan decides from the calibrated tokens drafted so far, the tables' forecast of
    the later depths and the second chain (free to know: drafted before the primary), whether the
    pass pays; the passes run are charged (one ``draft_cost[primary] · C(B)`` each, however many rows
    draft), then the allocator verifies what was drafted. Requests the plan does not draft for end
    their chain there. In budget mode there is no price to weigh a pass against: K passes, as before.
    """
    sb, S, B, K = s.sb, s.S, s.B, s.K
    if s.budget is not None:
        return s.ragged(p1, p2, s.draft(K, second=p2 is not None))
    first, second = sb.names
    pass_cost = s.draft(1)
    free_cost = s.second_cost if p2 is not None else 0.0
    verify = s.curve.tensor()
    dr = np.zeros((S, B), np.int64)
    de = np.zeros((S, B), np.int64)
    passes = np.zeros(S)
    for i in range(S):
        known = np.full((B, K), np.nan, dtype=np.float32)
        others = {} if p2 is None else {second: torch.from_numpy(np.ascontiguousarray(p2[i], dtype=np.float32))}
        fc = torch.from_numpy(np.ascontiguousarray(forecast[i], dtype=np.float32))
        done = 0
        while done < K:
            plan = plan_draft({first: torch.from_numpy(known[:, :done].copy()), **others}, fc, cost=verify,
                              pass_cost=pass_cost, sunk=free_cost + done * pass_cost, chain=first,
                              impl=s.cfg.impl)
            if not plan.run_pass:
                break
            rows = plan.drafting.numpy()
            known[rows, done] = p1[i, rows, done]  # the pass drafts these rows' next token (NaN: chain ended)
            done += 1
        passes[i] = done
        extra = free_cost + done * pass_cost
        dr[i], de[i] = _alloc(known, None if p2 is None else p2[i], s.curve.tensor(extra=extra), None,
                              s.cfg.impl, sb.names)
    return s.allocated(dr, de, free_cost + passes * pass_cost, draft_passes=float(passes.mean()))


def replay_setting(sb: StepBatch, curve: CostCurve, cfg: ReplayConfig, train_curve: np.ndarray) -> dict:
    """{row name: :class:`PolicyResult`} of every step policy ``cfg.policies`` asks for, what they and the
    reference ``best_fixed`` need (``no_spec``, ``fixed``), for one setting and one cost curve."""
    s = Setting(sb, curve, cfg, train_curve)
    out: dict[str, PolicyResult] = {}
    for name in closure([*cfg.policies, REFERENCE]):
        p = policy(name)
        if p.kind != "step":
            continue
        res = p.compute(s)
        if res is None:
            continue
        if p.family:
            for row, r in res.items():
                if not p.owns(row):
                    raise ValueError(f"policy {p.name!r} returned row {row!r}; a family's rows are {p.name}_<x>")
                out[row] = PolicyResult(*r)
        else:
            out[p.name] = PolicyResult(*res)
    return out


# ---- the built-in policies (registration order = computation order = row order within a setting) ----

def _no_spec(s: Setting) -> PolicyResult:
    return PolicyResult(np.full(s.S, float(s.B)), np.full(s.S, s.curve.values[s.B]), np.zeros(s.S), {})


def _fixed(s: Setting) -> dict:
    out = {}
    for g in range(1, s.K + 1):
        tok, cost, pos = s.uniform(np.full(s.S, g), s.draft(g))
        out[f"fixed_{g}"] = PolicyResult(tok, cost, pos, {"gamma": g})
    return out


def _homogeneous(s: Setting) -> PolicyResult:
    g = _uniform_gamma(s.train_curve, s.B, s.curve, np.array([s.draft(d) for d in range(s.K + 1)]), s.cfg.impl)
    tok, cost, pos = s.uniform(np.full(s.S, g), s.draft(g))
    return PolicyResult(tok, cost, pos, {"gamma": g})


def _gated_uniform(s: Setting) -> PolicyResult | None:
    p_cal = s.sb.p_cal[s.P]
    if p_cal is None:
        return None
    gammas = np.array([_uniform_gamma(_mean_conditional(p_cal[i]), s.B, s.curve, np.full(s.K + 1, s.sunk),
                                      s.cfg.impl) for i in range(s.S)])
    tok, cost, pos = s.uniform(gammas, s.sunk)
    return PolicyResult(tok, cost, pos, {"gamma_mean": float(gammas.mean())})


def _ragged_raw(s: Setting) -> PolicyResult | None:
    return None if s.sb.p_raw is None else s.ragged(s.sb.p_raw, None, s.sunk)


def _ragged_calibrated(s: Setting) -> PolicyResult | None:
    p_cal, fc = s.sb.p_cal[s.P], s.sb.p_forecast[s.P]
    if p_cal is None:
        return None
    return s.ragged(p_cal, None, s.sunk) if fc is None else draft_aware(s, p_cal, fc, None)


def _two_drafter(s: Setting) -> PolicyResult | None:
    sb = s.sb
    if not (sb.second and sb.p_cal[s.P] is not None and sb.p_cal[s.Q] is not None):
        return None
    fc = sb.p_forecast[s.P]
    if fc is None:  # tables without a forecast: draft K, then allocate
        return s.ragged(sb.p_cal[s.P], sb.p_cal[s.Q], s.draft(s.K, second=True))
    return draft_aware(s, sb.p_cal[s.P], fc, sb.p_cal[s.Q])


def _oracle(s: Setting) -> PolicyResult:
    """Allocator on the actual accept masks; per step it also chooses in hindsight how many primary
    draft passes to pay (0..K; with a free drafter always K). A second chain (the n-gram chain of a
    model-drafter bank) is drafted without a model pass, so it is available in full whatever the
    number of passes (its own drafting, ``draft_cost[ngram]``, is paid once). The best per-step goodput
    is kept."""
    sb, curve, cfg, budget = s.sb, s.curve, s.cfg, s.budget
    S, B, K = sb.S, sb.B, sb.K
    free = s.draft(1) == 0
    depths_to_try = [K] if (free or budget is not None) else list(range(K + 1))
    first, second = sb.ids
    second_cost = s.second_cost if sb.second else 0.0
    best = (np.full(S, float(B)), np.full(S, curve.values[B]), np.zeros(S))  # no drafting at all
    best_gp = best[0] / best[1]
    for gmax in depths_to_try:
        if gmax == 0 and not sb.second:
            continue  # no chain to verify: that is the no-drafting start
        extra = s.draft(gmax) + second_cost
        cost_t = curve.tensor(extra=extra)
        p1 = sb.oracle[first].copy()
        p1[..., gmax:] = np.nan
        p2 = sb.oracle[second] if sb.second else None
        dr = np.zeros((S, B), np.int64)
        de = np.zeros((S, B), np.int64)
        for i in range(S):
            dr[i], de[i] = _alloc(p1[i], None if p2 is None else p2[i], cost_t, budget, cfg.impl, sb.names)
        tok = _committed(sb, dr, de)
        pos = de.sum(axis=1)
        cost = curve.charge(de) + extra
        gp = tok / cost
        better = gp > best_gp if budget is None else np.ones(S, bool)
        best = tuple(np.where(better, new, old) for new, old in zip((tok, cost, pos), best))
        best_gp = np.where(better, gp, best_gp)
    return PolicyResult(*best, {})


def _best_fixed(rows: dict, pooled: dict | None = None) -> dict:
    """The best fixed γ in hindsight, γ = 0 (no_spec) included: the best static policy."""
    fixed = {k: v for k, v in rows.items() if k.startswith("fixed_")}
    if "no_spec" in rows:
        fixed["no_spec"] = {**rows["no_spec"], "gamma": 0}
    name = max(fixed, key=lambda k: (fixed[k]["tokens"] / fixed[k]["cost"], -fixed[k]["gamma"]))
    return dict(fixed[name])


def _vllm_dsd(rows: dict, pooled: dict) -> dict:
    """vLLM's Dynamic SD (vLLM 0.32, ``vllm/v1/spec_decode/dynamic/utils.py``: the
    ``num_speculative_tokens_per_batch_size`` schedule, ``[(range_start, range_end, K), ...]`` expanded by
    ``build_dynamic_sd_schedule_lookup`` into a dense batch size -> K table the scheduler looks up each
    step; every request of the batch drafts and verifies K, K = 0 included). Here: the best such table
    in hindsight, one K per (bank, B, cost curve), chosen on the steps of every category pooled (a
    deployment keys the table on batch size only; it does not know the category), then served to every
    category at that B.

    Versus ``best_fixed``: that one picks γ per (bank, category, B, curve), i.e. per ladder slice. Read
    literally per slice ("per setting, the K maximising goodput over that setting's rounds"), vLLM's
    table would coincide with ``best_fixed`` exactly, because the ladder is already per B. So the
    difference is only the category: on a category row ``vllm_dsd`` serves the pooled K (≤ best_fixed
    there, equal where both categories prefer the same K); on the ``all`` row it *is* ``best_fixed``
    (same K, same steps, same goodput). Drafting is charged K passes, as ``fixed_K``.
    """
    table_k = _best_fixed(pooled)["gamma"]
    chosen = rows["no_spec"] if table_k == 0 else rows[f"fixed_{table_k}"]
    return {**chosen, "gamma": table_k}


register_policy(Policy("no_spec", 10, "0.6", "verify nothing; one token per request per pass", _no_spec,
                       camp="reference"))
register_policy(Policy(
    "fixed", 90, None, "every request verifies min(γ, drafted) tokens and pays γ draft passes (rows fixed_<γ>)",
    _fixed, family=True, plot=False, pooled_extra=("gamma",), camp="reference",
    below_no_spec="verifies γ tokens for every request whatever its odds: where acceptance is low or the "
                  "per-position cost is high, the extra positions cost more than the tokens they bring "
                  "(`best_fixed` includes γ = 0, i.e. no_spec)"))
register_policy(Policy(
    "homogeneous", 30, "tab:olive", "one γ for every step, from the primary chain's mean acceptance curve on the "
    "training split (the goodput rule on one representative request)", _homogeneous, camp="peer",
    below_no_spec="γ comes from the training split's pooled acceptance curve (both categories), not this "
                  "category's"))
register_policy(Policy(
    "gated_uniform", 40, "tab:cyan", "one γ per step from that step's mean calibrated survival curve; pays K "
    "draft passes first", _gated_uniform, camp="calib",
    below_no_spec="pays for K draft passes to read the signal before choosing a uniform γ"))
register_policy(Policy(
    "ragged_raw", 50, "tab:red", "allocator (goodput rule) per request on the drafter's raw confidences (model "
    "chain only); pays K draft passes first", _ragged_raw, camp="calib",
    below_no_spec="raw confidences are mis-calibrated, so the goodput rule buys positions that do not pay; it "
                  "also pays for K draft passes"))
register_policy(Policy(
    "ragged_calibrated", 60, "tab:blue", "draft-aware allocator on the calibrated tables: before each draft "
    "pass, runs it only if the forecast goodput says it pays; then allocates per request", _ragged_calibrated,
    camp="calib",
    below_no_spec="a pass the forecast said would pay can draft tokens the target then rejects; the drafting "
                  "is not refunded"))
register_policy(Policy(
    "two_drafter", 70, "tab:purple", "draft-aware allocator over the calibrated model and n-gram chains (banks "
    "that have both): the n-gram chain is known first, each model pass runs only if it pays", _two_drafter,
    camp="calib", below_no_spec="a model pass the forecast said would pay can draft tokens the target rejects"))
register_policy(Policy(
    "oracle", 80, "k", "allocator on the actual accept masks, also choosing per step in hindsight how many draft "
    "passes to pay (0..K): a bound on every policy, step by step", _oracle, camp="reference",
    below_no_spec="pays drafting it cannot avoid"))
REFERENCE = register_policy(Policy(
    "best_fixed", 20, "0.35", "the fixed γ (0 = no_spec included) with the best goodput in hindsight per (bank, "
    "category, B, cost curve): the best static policy, and every row's reference", _best_fixed,
    kind="hindsight", needs=("no_spec", "fixed"), camp="peer")).name
register_policy(Policy(
    "vllm_dsd", 25, "tab:green", "vLLM Dynamic SD (num_speculative_tokens_per_batch_size): one K per batch size, "
    "the best in hindsight over both categories pooled (a deployment does not know the category) — on "
    "category `all` it is best_fixed; on a category row it is at most best_fixed, which picks γ per category",
    _vllm_dsd, kind="hindsight", needs=("no_spec", "fixed"), camp="peer",
    below_no_spec="one K per batch size for every category: a K that pays on the pooled stream can lose on "
                  "the category with the lower acceptance"))


def summarise(results: dict, B: int, S: int) -> dict:
    """Totals per step-policy row (hindsight policies are added by :func:`replay`)."""
    rows = {}
    for name, (tok, cost, pos, extra) in results.items():
        rows[name] = {"tokens": float(np.sum(tok)), "cost": float(np.sum(cost)), "positions": float(np.sum(pos)),
                      "steps": S, "rounds": S * B, **extra}
    return rows


def add_hindsight(totals: dict, pooled: dict, wanted) -> dict:
    """``totals`` with every hindsight policy of ``wanted`` (registration order) appended."""
    for name in wanted:
        p = policy(name)
        if p.kind == "hindsight":
            row = p.compute(totals, pooled)
            if row is not None:
                totals[name] = dict(row)
    return totals


def ladder_rows(totals: dict, meta: dict, policies) -> list[dict]:
    """Goodput, ratio to best_fixed and headroom captured for one setting's totals; the rows of the
    policies named in ``policies`` (a family's rows first), in ``totals`` order."""
    gp = {k: v["tokens"] / v["cost"] for k, v in totals.items()}
    g_bf, g_or = gp.get(REFERENCE), gp.get("oracle")
    owner = {k: policy_of_row(k) for k in totals}
    asked = set(policies)
    keep = [k for k in totals if owner[k] is not None and owner[k].family and owner[k].name in asked] + \
           [k for k in totals if owner[k] is not None and not owner[k].family and k in asked]
    rows = []
    for k in keep:
        v = totals[k]
        head = ((gp[k] - g_bf) / (g_or - g_bf)
                if g_bf is not None and g_or is not None and g_or - g_bf > 1e-12 * abs(g_bf) else float("nan"))
        rows.append({**meta, "policy": k, "goodput": gp[k],
                     "vs_best_fixed": gp[k] / g_bf if g_bf else float("nan"),
                     "headroom_captured": head,
                     "tokens_per_round": v["tokens"] / v["rounds"],
                     "verified_per_round": v["positions"] / v["rounds"],
                     "steps": v["steps"], "rounds": v["rounds"],
                     **{x: y for x, y in v.items() if x not in BASE_TOTALS},
                     "_tokens": v["tokens"], "_cost": v["cost"], "_positions": v["positions"]})
    return rows


def replay(banks, curves: dict[str, CostCurve], cfg: ReplayConfig, progress: bool = True) -> list[dict]:
    """Every (bank, category, B, cost curve) setting; also category "all" (the sum over categories).
    Step policies are replayed setting by setting; hindsight policies are added once every category of a
    (bank, B, cost curve) is in (``vllm_dsd`` needs them all)."""
    from tqdm.auto import tqdm

    settings = []
    for bank in banks:
        test = np.nonzero(bank.split == "test")[0]
        for cat in sorted(set(bank.category[test].tolist())):
            rows = test[bank.category[test] == cat]
            for b in cfg.batch_sizes:
                settings.append((bank, cat, rows, b))
    wanted = closure([*cfg.policies, REFERENCE])
    rng = np.random.default_rng(cfg.seed)
    bar = tqdm(settings, desc="replay", unit="setting", disable=not progress)
    pooled: dict = {}
    done: list[tuple[dict, dict, tuple]] = []  # (meta, totals, pooled key) per replayed setting, in order
    for bank, cat, rows, b in bar:
        bar.set_postfix_str(f"{bank.name} {cat} B={b}")
        idx = draw_steps(len(rows), b, cfg, rng)
        sb = StepBatch(bank, rows, idx)
        train_curve = train_mean_curve(bank)
        for cname, curve in curves.items():
            res = replay_setting(sb, curve.for_batch(b), cfg, train_curve)
            totals = summarise(res, b, sb.S)
            meta = {"bank": bank.name, "batch_size": b, "category": cat, "cost_model": cname, "unit": curve.unit}
            key = (bank.name, b, cname, curve.unit)
            done.append((meta, totals, key))
            for pol, v in totals.items():
                acc = pooled.setdefault(key, {}).setdefault(pol, {"tokens": 0.0, "cost": 0.0, "positions": 0.0,
                                                                   "steps": 0, "rounds": 0})
                for f in BASE_TOTALS:
                    acc[f] += v[f]
                for x in policy_of_row(pol).pooled_extra:
                    if x in v:
                        acc[x] = v[x]
    ladder: list[dict] = []
    for meta, totals, key in done:
        ladder.extend(ladder_rows(add_hindsight(totals, pooled[key], wanted), meta, cfg.policies))
    for (bname, b, cname, unit), totals in pooled.items():
        add_hindsight(totals, totals, wanted)
        meta = {"bank": bname, "batch_size": b, "category": "all", "cost_model": cname, "unit": unit}
        ladder.extend(ladder_rows(totals, meta, cfg.policies))
    return ladder
