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

Policies (every decision through :func:`calib.allocate.allocate_probs`, the serve-time code):

=====================  ==============================================================================
``no_spec``            verify nothing; one token per request per pass
``fixed_<γ>``          every request verifies ``min(γ, drafted)`` tokens; γ draft passes
``best_fixed``         the fixed γ (0 = no_spec included) with the best goodput in hindsight, per
                       bank/category/B/curve: the best static policy
``homogeneous``        one γ for all steps, from the primary chain's mean acceptance curve on the
                       training split (the goodput rule on one representative request)
``gated_uniform``      one γ per step from this step's mean calibrated survival curve
``ragged_raw``         allocator on raw confidences (model drafter only: n-gram chains have none)
``ragged_calibrated``  allocator on calibrated tables
``two_drafter``        allocator on calibrated model + n-gram chains (banks that have both)
``oracle``             allocator on the actual accept masks; it also picks in hindsight how many
                       draft passes to pay for (0..K), so it bounds every policy step by step
=====================  ==============================================================================

Signal-based policies (gated, ragged, two_drafter) must draft the full K-deep chain before they
can decide; that cost is sunk and is added to the price curve the allocator sees, so its goodput
rule accounts for it. ``mode: budget`` swaps the goodput rule for a token budget per request.
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

from calib.allocate import allocate_probs
from calib.allocate.api import IMPLEMENTATIONS
from calib.calibrators.base import Interval, Options, Subset, validate_params
from calib.chains import chain, chain_names
from calib.evaluate.cost import CostCurve
from calib.evaluate.data import EvalBank
from calib.labels import censored

UNIFORM = ("homogeneous", "gated_uniform")
POLICIES = ("no_spec", "fixed", "best_fixed", "homogeneous", "gated_uniform", "ragged_raw",
            "ragged_calibrated", "two_drafter", "oracle")
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
        policies: names from :data:`POLICIES` (``fixed`` = every ``fixed_<γ>``).
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
        "policies": [Subset(POLICIES)],
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
        self.acc, self.length, self.p_cal, self.oracle = {}, {}, {}, {}
        for name, cid in zip(self.names, self.ids):
            if name is None:
                continue
            c = bank.chains[name]
            self.acc[cid], self.length[cid] = c.accept[sel], c.length[sel]
            self.p_cal[cid] = None if c.p_cal is None else c.p_cal[sel]
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


def replay_setting(sb: StepBatch, curve: CostCurve, cfg: ReplayConfig, train_curve: np.ndarray) -> dict:
    """{policy: (tokens [S], cost [S], draft positions [S], extra)} for one setting and one cost curve."""
    S, B, K = sb.S, sb.B, sb.K
    c_b = curve.values[B]
    P, Q = sb.ids  # the primary chain's id and the second chain's (None: there is none)
    frac_p, frac_q = float(cfg.draft_cost.get(sb.names[0], 0.0)), float(cfg.draft_cost.get(sb.names[1], 0.0))
    draft = lambda passes, second=False: (frac_p + (frac_q if second else 0.0)) * passes * c_b
    budget = None if cfg.mode == "price" else max(int(round(cfg.budget_per_request * B)), 0)
    out: dict[str, tuple] = {}
    zeros = np.zeros(S)
    pol = set(cfg.policies)
    one = np.full((S, B), P, dtype=np.int64)  # fixed-depth policies verify the primary chain

    def uniform(gamma_per_step, draft_cost):
        depth = np.minimum(np.asarray(gamma_per_step)[:, None], sb.length[P])  # cannot verify past the chain
        tokens = _committed(sb, one, depth)
        positions = depth.sum(axis=1)
        return tokens, curve.charge(depth) + draft_cost, positions

    if pol & {"no_spec", "oracle", "best_fixed"}:
        out["no_spec"] = (np.full(S, float(B)), np.full(S, curve.values[B]), zeros, {})
    if pol & {"fixed", "best_fixed"}:
        for g in range(1, K + 1):
            tok, cost, pos = uniform(np.full(S, g), draft(g))
            out[f"fixed_{g}"] = (tok, cost, pos, {"gamma": g})
    if "homogeneous" in pol:
        g = _uniform_gamma(train_curve, B, curve, np.array([draft(d) for d in range(K + 1)]), cfg.impl)
        tok, cost, pos = uniform(np.full(S, g), draft(g))
        out["homogeneous"] = (tok, cost, pos, {"gamma": g})
    sunk = draft(K)
    if "gated_uniform" in pol and sb.p_cal[P] is not None:
        gammas = np.array([_uniform_gamma(_mean_conditional(sb.p_cal[P][s]), B, curve, np.full(K + 1, sunk),
                                          cfg.impl) for s in range(S)])
        tok, cost, pos = uniform(gammas, sunk)
        out["gated_uniform"] = (tok, cost, pos, {"gamma_mean": float(gammas.mean())})

    def ragged(p1, p2, extra_cost):
        dr = np.zeros((S, B), np.int64)
        de = np.zeros((S, B), np.int64)
        for s in range(S):
            dr[s], de[s] = _alloc(p1[s], None if p2 is None else p2[s], curve.tensor(extra=extra_cost),
                                  budget, cfg.impl, sb.names)
        tok = _committed(sb, dr, de)
        pos = de.sum(axis=1)
        share2 = float((dr == Q).mean()) if Q is not None else 0.0
        charged = curve.charge(de) + extra_cost
        # What the allocator priced (a curve over T for this B) vs the shape's actual cost.
        seen = curve(B + pos) + extra_cost
        return tok, charged, pos, {"ngram_share": share2, "charged_vs_priced": float(charged.sum() / seen.sum())}

    if "ragged_raw" in pol and sb.p_raw is not None:
        out["ragged_raw"] = ragged(sb.p_raw, None, sunk)
    if "ragged_calibrated" in pol and sb.p_cal[P] is not None:
        out["ragged_calibrated"] = ragged(sb.p_cal[P], None, sunk)
    if "two_drafter" in pol and sb.second and sb.p_cal[P] is not None and sb.p_cal[Q] is not None:
        out["two_drafter"] = ragged(sb.p_cal[P], sb.p_cal[Q], draft(K, second=True))
    if "oracle" in pol:
        out["oracle"] = _oracle(sb, curve, cfg, draft, budget)
    return out


def _oracle(sb: StepBatch, curve: CostCurve, cfg: ReplayConfig, draft, budget):
    """Allocator on the true masks; per step it also chooses in hindsight how many draft passes to
    pay (0..K) — with a free drafter that is always K. The best per-step goodput is kept."""
    S, B, K = sb.S, sb.B, sb.K
    free = draft(1, second=sb.second) == 0
    depths_to_try = [K] if (free or budget is not None) else list(range(K + 1))
    best = (np.full(S, float(B)), np.full(S, curve.values[B]), np.zeros(S))  # γmax = 0: no drafting
    best_gp = best[0] / best[1]
    for gmax in depths_to_try:
        if gmax == 0:
            continue
        extra = draft(gmax, second=sb.second)
        cost_t = curve.tensor(extra=extra)
        first, second = sb.ids
        p1 = sb.oracle[first].copy()
        p1[..., gmax:] = np.nan
        p2 = None
        if sb.second:
            p2 = sb.oracle[second].copy()
            p2[..., gmax:] = np.nan
        dr = np.zeros((S, B), np.int64)
        de = np.zeros((S, B), np.int64)
        for s in range(S):
            dr[s], de[s] = _alloc(p1[s], None if p2 is None else p2[s], cost_t, budget, cfg.impl, sb.names)
        tok = _committed(sb, dr, de)
        pos = de.sum(axis=1)
        cost = curve.charge(de) + extra
        gp = tok / cost
        better = gp > best_gp if budget is None else np.ones(S, bool)
        best = tuple(np.where(better, new, old) for new, old in zip((tok, cost, pos), best))
        best_gp = np.where(better, gp, best_gp)
    return (*best, {})


def summarise(results: dict, B: int, S: int) -> dict:
    """Totals per policy, plus best_fixed."""
    rows = {}
    for name, (tok, cost, pos, extra) in results.items():
        rows[name] = {"tokens": float(np.sum(tok)), "cost": float(np.sum(cost)), "positions": float(np.sum(pos)),
                      "steps": S, "rounds": S * B, **extra}
    rows["best_fixed"] = _best_fixed(rows)
    return rows


def _best_fixed(rows: dict) -> dict:
    """The best fixed γ in hindsight, γ = 0 (no_spec) included: the best static policy."""
    fixed = {k: v for k, v in rows.items() if k.startswith("fixed_")}
    if "no_spec" in rows:
        fixed["no_spec"] = {**rows["no_spec"], "gamma": 0}
    name = max(fixed, key=lambda k: (fixed[k]["tokens"] / fixed[k]["cost"], -fixed[k]["gamma"]))
    return dict(fixed[name])


def ladder_rows(totals: dict, meta: dict, policies) -> list[dict]:
    """Goodput, ratio to best_fixed and headroom captured for one setting's totals."""
    gp = {k: v["tokens"] / v["cost"] for k, v in totals.items()}
    g_bf, g_or = gp.get("best_fixed"), gp.get("oracle")
    keep = [k for k in totals if k.startswith("fixed_") and "fixed" in policies] + \
           [k for k in totals if not k.startswith("fixed_") and k in policies]
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
                     **{x: v[x] for x in ("gamma", "gamma_mean", "ngram_share", "charged_vs_priced") if x in v},
                     "_tokens": v["tokens"], "_cost": v["cost"], "_positions": v["positions"]})
    return rows


def replay(banks, curves: dict[str, CostCurve], cfg: ReplayConfig, progress: bool = True) -> list[dict]:
    """Every (bank, category, B, cost curve) setting; also category "all" (the sum over categories)."""
    from tqdm.auto import tqdm

    settings = []
    for bank in banks:
        test = np.nonzero(bank.split == "test")[0]
        for cat in sorted(set(bank.category[test].tolist())):
            rows = test[bank.category[test] == cat]
            for b in cfg.batch_sizes:
                settings.append((bank, cat, rows, b))
    ladder: list[dict] = []
    rng = np.random.default_rng(cfg.seed)
    bar = tqdm(settings, desc="replay", unit="setting", disable=not progress)
    pooled: dict = {}
    for bank, cat, rows, b in bar:
        bar.set_postfix_str(f"{bank.name} {cat} B={b}")
        idx = draw_steps(len(rows), b, cfg, rng)
        sb = StepBatch(bank, rows, idx)
        train_curve = train_mean_curve(bank)
        for cname, curve in curves.items():
            res = replay_setting(sb, curve.for_batch(b), cfg, train_curve)
            totals = summarise(res, b, sb.S)
            meta = {"bank": bank.name, "batch_size": b, "category": cat, "cost_model": cname, "unit": curve.unit}
            ladder.extend(ladder_rows(totals, meta, cfg.policies))
            key = (bank.name, b, cname, curve.unit)
            for pol, v in totals.items():
                if pol == "best_fixed":
                    continue
                acc = pooled.setdefault(key, {}).setdefault(pol, {"tokens": 0.0, "cost": 0.0, "positions": 0.0,
                                                                   "steps": 0, "rounds": 0})
                for f in ("tokens", "cost", "positions", "steps", "rounds"):
                    acc[f] += v[f]
                if "gamma" in v and pol.startswith("fixed_"):
                    acc["gamma"] = v["gamma"]
    for (bname, b, cname, unit), totals in pooled.items():
        totals["best_fixed"] = _best_fixed(totals)
        meta = {"bank": bname, "batch_size": b, "category": "all", "cost_model": cname, "unit": unit}
        ladder.extend(ladder_rows(totals, meta, cfg.policies))
    return ladder
