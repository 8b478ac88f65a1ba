"""Width against depth under a token budget: admit another sequence, or deepen a speculating one?

A step has a budget of ``T`` positions, ``R`` running requests (each verifies its bonus position and may verify
``d_i`` draft tokens of its chain) and a queue of waiting requests (each admitted one verifies one position:
its first decode, no draft yet). The policy picks the admitted count ``a`` and the depths to maximise the
expected goodput ``(R + a + sum_i G_i(d_i)) / cost`` subject to ``R + a + sum_i d_i <= T``, on the same
separable MoE price as the allocator (:meth:`calib.cost.moe.MoECost.tangent_per_sequence`: a sequence of
``n`` positions costs ``phi[n]``, plus a constant). Exact for that price: Dinkelbach over the ratio, each
round a multiple-choice knapsack over the budget solved by dynamic programming (admissions are identical
items). The tangent is re-taken at the answer (majorise-minimise) from two starts, width first and depth
first, and the allocation with the best expected goodput under the actual shape cost is kept.

The founding toy is ``R = 1``, ``T = 2``: speculate one token (shape ``[2]``) or batch a second sequence
(``[1, 1]``); depth wins iff the draft's acceptance ``alpha > 2 cost([2]) / cost([1, 1]) - 1``
(:func:`break_even`).
"""

from __future__ import annotations

import numpy as np

from calib.cost.moe import MoECost, shape_counts


def break_even(cost: MoECost) -> float:
    """The acceptance at which one sequence verifying 2 positions matches two verifying 1 (goodput, roofline)."""
    return 2.0 * cost.shape_cost([2]) / cost.shape_cost([1, 1]) - 1.0


def gains(p: np.ndarray) -> np.ndarray:
    """[R, K + 1] expected accepted tokens of verifying d = 0..K drafts (survival sums; NaN ends a chain)."""
    surv = np.cumprod(np.clip(np.nan_to_num(p, nan=0.0), 0.0, 1.0), axis=1)
    return np.concatenate([np.zeros((p.shape[0], 1)), np.cumsum(surv, axis=1)], axis=1)


def _knapsack(values: np.ndarray, admit_value: float, n_waiting: int, spare: int) -> tuple[np.ndarray, int]:
    """max sum_i values[i, d_i] + a * admit_value with sum d_i + a <= spare, a <= n_waiting: (depths, a)."""
    R, width = values.shape
    best = np.zeros(spare + 1)  # best[c] over the requests so far using at most c positions
    choice = np.zeros((R, spare + 1), dtype=np.int64)
    for i in range(R):
        new = np.full(spare + 1, -np.inf)
        for d in range(min(width, spare + 1)):
            cand = np.full(spare + 1, -np.inf)
            cand[d:] = best[: spare + 1 - d] + values[i, d]
            take = cand > new  # ties: the shallower depth (tried first)
            new[take], choice[i, take] = cand[take], d
        best = new
    admits = np.arange(min(n_waiting, spare) + 1)
    totals = best[spare - admits] + admits * admit_value
    a = int(admits[np.argmax(totals)])  # ties: fewer admissions
    depth, c = np.zeros(R, dtype=np.int64), spare - a
    for i in range(R - 1, -1, -1):
        depth[i] = choice[i, c]
        c -= depth[i]
    return depth, a


def solve_priced(g: np.ndarray, const: float, phi: np.ndarray, n_waiting: int, budget: int,
                 max_rounds: int = 64) -> tuple[np.ndarray, int]:
    """Exact best (depths [R], admitted) for gains ``g`` [R, K + 1] under the price ``const + sum phi[n]``."""
    R, width = g.shape
    spare = budget - R
    if spare < 0:
        raise ValueError(f"budget={budget} positions cannot hold the {R} running requests' bonus positions")
    depth, a = np.zeros(R, dtype=np.int64), 0

    def ratio(depth, a):
        return (R + a + g[np.arange(R), depth].sum()) / (const + phi[1 + depth].sum() + a * phi[1])

    lam = ratio(depth, a)
    for _ in range(max_rounds):
        values = g - lam * phi[1: width + 1][None, :]
        new_depth, new_a = _knapsack(values, 1.0 - lam * phi[1], n_waiting, spare)
        new = ratio(new_depth, new_a)
        if not new > lam:
            break
        depth, a, lam = new_depth, new_a, new
    return depth, a


def actual_cost(cost: MoECost, depth: np.ndarray, a: int) -> float:
    """The roofline cost of running requests at ``depth`` draft tokens plus ``a`` admitted sequences."""
    return float(cost.shape_cost([*(1 + np.asarray(depth)).tolist(), *([1] * a)]))


def decide(cost: MoECost, p: np.ndarray, n_waiting: int, budget: int, rounds: int = 3) -> tuple[np.ndarray, int]:
    """The width-against-depth policy for one step: running requests' acceptance ``p`` [R, K] (NaN: no token),
    ``n_waiting`` queued requests, ``budget`` positions. Returns (depths [R], admitted count)."""
    g = gains(np.asarray(p, dtype=np.float64))
    R, width = g.shape[0], g.shape[1] - 1
    spare = max(budget - R, 0)
    width_first = (np.zeros(R, dtype=np.int64), min(n_waiting, spare))
    deep = np.minimum(np.full(R, width), spare // max(R, 1))
    starts = [width_first, (deep, min(n_waiting, spare - int(deep.sum())))]
    best, best_value = width_first, -np.inf
    for depth, a in starts:
        for _ in range(rounds):
            positions = np.concatenate([1 + depth, np.ones(a, dtype=np.int64)])
            const, phi = cost.tangent_per_sequence(positions, width + 1)
            new_depth, new_a = solve_priced(g, const, phi, n_waiting, budget)
            value = (R + new_a + g[np.arange(R), new_depth].sum()) / actual_cost(cost, new_depth, new_a)
            if value > best_value:
                best, best_value = (new_depth, new_a), value
            if np.array_equal(new_depth, depth) and new_a == a:
                break
            depth, a = new_depth, new_a
    return best


def replay_budget(cost: MoECost, p: np.ndarray, accepted: np.ndarray, running: int, budget: int, steps: int,
                  seed: int = 0) -> dict:
    """Steps of ``running`` requests drawn from rounds with calibrated ``p`` [N, K] and accepted prefix lengths
    ``accepted`` [N], a queue that never empties, ``budget`` positions. Goodput (tokens per second) of the
    policy, of width first (admit to fill the budget, no drafts) and of depth first (deepen the running
    requests as far as their chains and the budget go, admit with what is left)."""
    rng = np.random.default_rng(seed)
    K = p.shape[1]
    lengths = (~np.isnan(p)).cumprod(axis=1).sum(axis=1)
    totals = {k: [0.0, 0.0] for k in ("policy", "width_first", "depth_first")}
    spare = budget - running
    for _ in range(steps):
        rows = rng.choice(p.shape[0], size=running, replace=p.shape[0] < running)
        deep = np.minimum(lengths[rows], K)  # deepen in request order while the budget lasts
        deep = np.minimum(deep, np.maximum(spare - (np.cumsum(deep) - deep), 0))
        plans = {"policy": decide(cost, p[rows], spare, budget), "width_first": (np.zeros(running, np.int64), spare),
                 "depth_first": (deep, spare - int(deep.sum()))}
        for name, (depth, a) in plans.items():
            totals[name][0] += running + a + np.minimum(depth, accepted[rows]).sum()
            totals[name][1] += actual_cost(cost, depth, a)
    return {k: {"tokens": t, "cost": c, "goodput": t / c} for k, (t, c) in totals.items()}


def shape_experts(cost: MoECost, shapes) -> np.ndarray:
    """Expected distinct experts (summed over layers) of each shape (lists of positions per sequence)."""
    return cost.experts_read(shape_counts(shapes))
