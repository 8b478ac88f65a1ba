"""The MoE replay: shape-aware against even-spread pricing of the same allocator, on a mixture-of-experts target.

Each (bank, batch size B, MoE cost) setting draws steps of B test rounds (:func:`draw_steps`) and runs, per
step and per chain set (the bank's primary chain alone; with the second chain where the bank labels one):

* ``even_<set>``: the allocator's flat price mode on :meth:`calib.cost.moe.MoECost.even_curve` (the step
  priced as if its T positions were spread evenly over the B requests: what calib did before);
* ``shape_<set>``: the shape-aware price mode (:class:`calib.allocate.ShapePrice`) on the expert-read
  count's tangent (:meth:`MoECost.tangent_price`), majorise-minimise from the even allocation: price at the
  reference shape, allocate exactly, re-price at the answer, at most ``mm_rounds`` times, keeping the best
  expected goodput under the model's actual shape cost (so never below the even allocation's, step by step);
* ``oracle_<set>``: the same on the actual accept masks (the ceiling of any calibrated policy);
* ``no_spec``: every request verifies its bonus position only.

Every step is charged the actual cost of its shape (:meth:`MoECost.step_cost`) plus its drafting (K passes of
a model chain's head, ``draft_head_params[cost]`` weights read per pass; the n-gram chain is free). Tokens are the
committed ones (accepted prefix + bonus), from the banks' labels.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from calib.allocate import ShapePrice, allocate_probs
from calib.chains import chain
from calib.cost.moe import MoECost, depth_counts
from calib.policies.setting import StepBatch, committed


@dataclass
class MoEReplayConfig:
    """How the MoE replay runs (defaults: conf/eval_moe.yaml ``replay:``)."""

    batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128)
    passes: float = 1.0  # steps per setting ≈ passes · rounds / B, clipped to [min_steps, max_steps]
    min_steps: int = 24
    max_steps: int = 48
    seed: int = 0
    mm_rounds: int = 3  # re-pricings of the shape-aware rule per step
    # parameters a model drafter's pass reads, per MoE cost (its head and the lm_head); 0 = free (n-gram)
    draft_head_params: dict = field(default_factory=dict)
    impl: str = "reference"

    def __post_init__(self) -> None:
        self.batch_sizes = tuple(int(b) for b in self.batch_sizes)
        if not self.batch_sizes or min(self.batch_sizes) < 1:
            raise ValueError(f"MoEReplayConfig: batch_sizes={list(self.batch_sizes)}; each must be an integer >= 1")
        if self.mm_rounds < 1 or self.min_steps < 1 or self.min_steps > self.max_steps:
            raise ValueError(f"MoEReplayConfig: mm_rounds={self.mm_rounds} (>= 1), min_steps={self.min_steps} <= "
                             f"max_steps={self.max_steps} (>= 1) required")


def _as_torch(p: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(p, dtype=np.float32))


class StepPricer:
    """One setting's pricing under one MoE cost: the flat even-spread curve and the shape price."""

    def __init__(self, cost: MoECost, batch: int, width: int, draft: float):
        self.cost, self.B, self.W, self.draft = cost, batch, width, draft
        self.curve = torch.from_numpy(cost.even_curve(batch, batch * (width + 1)) + draft)  # [T_max + 1]

    def actual(self, depth: np.ndarray) -> np.ndarray:
        """Cost [S] of steps verifying ``depth`` [S, B] draft tokens (+ bonus) per request, drafting included."""
        return self.cost.step_cost(depth_counts(np.atleast_2d(depth), self.W)) + self.draft

    def even(self, probs: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        out = allocate_probs({k: _as_torch(v) for k, v in probs.items()}, cost=self.curve)
        return out.drafter.numpy().astype(np.int64), out.depth.numpy().astype(np.int64), out.expected_accepted.numpy()

    def shaped(self, probs: dict, start, rounds: int, impl: str):
        """Majorise-minimise from ``start`` = (drafter, depth, expected): keep the best expected goodput under
        the actual shape cost; returns (drafter, depth, re-pricings that moved the allocation, expected tokens)."""
        best_dr, best_de, best_ex = start
        best_tokens = self.B + float(best_ex.sum())
        best = best_tokens / self.actual(best_de)[0]
        ref, moved = best_de, 0
        tensors = {k: _as_torch(v) for k, v in probs.items()}
        for _ in range(rounds):
            base, table = self.cost.tangent_price(ref, self.W)
            out = allocate_probs(tensors, price=ShapePrice(float(base + self.draft), torch.from_numpy(table)),
                                 impl=impl)
            de = out.depth.numpy().astype(np.int64)
            if np.array_equal(de, ref):
                break
            moved += 1
            tokens = self.B + float(out.expected_accepted.sum())
            value = tokens / self.actual(de)[0]
            if value > best:
                best, best_dr, best_de, best_tokens = value, out.drafter.numpy().astype(np.int64), de, tokens
            ref = de
        return best_dr, best_de, moved, best_tokens


def chain_sets(sb: StepBatch) -> list[tuple[str, tuple[str, ...]]]:
    """(label, chain names): the primary chain alone, and both where the bank labels a second chain."""
    first, second = sb.names
    sets = [("primary", (first,))]
    if sb.second and sb.p_cal[sb.ids[1]] is not None:
        sets.append(("both", (first, second)))
    return sets


def drafting(names, K: int, cost: MoECost, head_params: float) -> float:
    """Seconds of drafting a step of chains ``names`` pays: K passes of a model chain's head, each reading
    ``head_params`` weights (memory-bound, whatever the batch); a model-free chain (n-gram) is free."""
    per_pass = head_params * float(cost.cfg["bytes_per_param"])
    return sum(K * per_pass / cost.bandwidth for n in names if chain(n).confidence is not None)


def replay_setting(sb: StepBatch, cost: MoECost, cfg: MoEReplayConfig, cost_name: str = "") -> dict:
    """{policy row: {tokens, cost, positions, steps, rounds[, repriced]}} of one (bank, B) setting under ``cost``."""
    S, B, K = sb.S, sb.B, sb.K
    c_b = float(cost.step_cost(depth_counts(np.zeros((1, B), np.int64), K))[0])
    rows = {"no_spec": {"tokens": float(S * B), "cost": S * c_b, "positions": 0.0}}
    head = float(cfg.draft_head_params.get(cost_name, 0.0))
    for label, names in chain_sets(sb):
        ids = [chain(n).id for n in names]
        pricer = StepPricer(cost, B, K, drafting(names, K, cost, head))
        for kind, source in (("", sb.p_cal), ("oracle_", sb.oracle)):
            dr = {"even": np.zeros((S, B), np.int64), "shape": np.zeros((S, B), np.int64)}
            de = {"even": np.zeros((S, B), np.int64), "shape": np.zeros((S, B), np.int64)}
            moved, expected = 0, {"even": 0.0, "shape": 0.0}
            for s in range(S):
                probs = {n: source[i][s] for n, i in zip(names, ids)}
                start = pricer.even(probs)
                dr["even"][s], de["even"][s] = start[0], start[1]
                expected["even"] += B + float(start[2].sum())
                dr["shape"][s], de["shape"][s], m, tokens = pricer.shaped(probs, start, cfg.mm_rounds, cfg.impl)
                moved += m
                expected["shape"] += tokens
            for pol in ("even", "shape"):
                name = f"{kind}{pol}_{label}" if kind else f"{pol}_{label}"
                rows[name] = {"tokens": float(committed(sb, dr[pol], de[pol]).sum()),
                              "cost": float(pricer.actual(de[pol]).sum()), "positions": float(de[pol].sum()),
                              "expected_tokens": expected[pol]}
                if pol == "shape":
                    rows[name]["repriced_per_step"] = moved / S
    rows["no_spec"]["expected_tokens"] = rows["no_spec"]["tokens"]
    for r in rows.values():
        r.update(steps=S, rounds=S * B, goodput=r["tokens"] / r["cost"],
                 expected_goodput=r["expected_tokens"] / r["cost"])
    return rows


def draw(n_rounds: int, batch: int, cfg: MoEReplayConfig, rng: np.random.Generator) -> np.ndarray:
    """[S, B] row positions; distinct within a step where the pool allows it."""
    steps = int(np.clip(math.ceil(cfg.passes * n_rounds / batch), cfg.min_steps, cfg.max_steps))
    if n_rounds >= batch:
        return np.stack([rng.choice(n_rounds, size=batch, replace=False) for _ in range(steps)])
    return rng.integers(0, n_rounds, size=(steps, batch))


def replay_moe(banks, costs: dict[str, MoECost], cfg: MoEReplayConfig, progress=None) -> list[dict]:
    """Every (bank, B, MoE cost) setting over each bank's test rounds (all categories together): one row per
    policy with its goodput (tokens per second of the roofline), and ``gain`` = shape / even − 1 per chain set."""
    rng = np.random.default_rng(cfg.seed)
    out = []
    for bank in banks:
        rows_idx = np.nonzero(bank.split == "test")[0]
        for b in cfg.batch_sizes:
            sb = StepBatch(bank, rows_idx, draw(len(rows_idx), b, cfg, rng))
            for cname, cost in costs.items():
                res = replay_setting(sb, cost, cfg, cname)
                meta = {"bank": bank.name, "batch_size": b, "cost_model": cname}
                for pol, r in res.items():
                    even = res.get(pol.replace("shape_", "even_")) if "shape_" in pol else None
                    gain = r["goodput"] / even["goodput"] - 1 if even else None
                    expected_gain = r["expected_goodput"] / even["expected_goodput"] - 1 if even else None
                    out.append({**meta, "policy": pol, **r, "gain_vs_even": gain, "expected_gain_vs_even": expected_gain,
                                "vs_no_spec": r["goodput"] / res["no_spec"]["goodput"]})
                if progress:
                    progress(meta, res)
    return out
