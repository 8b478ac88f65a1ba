"""The reference allocator's price mode in numpy, for a serving step's few requests on a CPU host.

:mod:`calib.allocate.reference` is written for any device and no host synchronisation: a step of a few
requests costs it some forty torch calls, whose fixed cost on a CPU (microseconds each) is most of calib's
time inside vLLM's step (bench/hot_path.py). This module takes the same decisions with the same integer
arithmetic (gains on the ``2**24`` grid, exact integer sums, float64 goodput, ties broken alike) in numpy,
whose calls cost a fraction of torch's on small arrays. Its decisions equal the reference's bit for bit and
its expected accepted lengths to float32 rounding (tests/allocate/test_host_matches_reference.py); budget
mode is left to the reference (serving prices steps, it does not budget them). The shape-aware price mode
(:mod:`calib.allocate.shape`, a sampled step's price) has its numpy twin here too (:func:`allocate_shape_host`:
the same int64 sums and float64 ratios, so the same Dinkelbach rounds and decisions).

:func:`allocate_chains_host` is the serving decider's entry (calib/serve/decide.py): one or two chains'
probabilities as looked up this step, the cost curve checked once at construction, and back the decision
with the chosen chain's probabilities per verified token, all without a torch call per request.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from calib.allocate.compiled import kernels
from calib.allocate.reference import SCALE, check_cost
from calib.allocate.shape import MAX_ITERS, PRICE_SCALE, ShapePrice
from calib.chains import NO_CHAIN, chain


def survival(p: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """:func:`calib.allocate.reference.survival` in numpy: float32 ``S [B, K]`` (a column product, left to
    right) and its fixed-point gains ``q`` (int32)."""
    # fmax: NaN -> 0, -inf -> 0; fmin: +inf -> 1 (np.nan_to_num then np.clip, without their wrappers)
    surv = np.fmin(np.fmax(p.astype(np.float32, copy=False), np.float32(0)), np.float32(1))
    surv = np.multiply.accumulate(surv, axis=1, dtype=np.float32)  # the column product, left to right
    return surv, (surv * np.float32(SCALE)).astype(np.int32)


def best_sorted_prefix(ordered: np.ndarray, price: np.ndarray, bad: np.ndarray, n_requests: int):
    """:func:`calib.allocate.reference.best_sorted_prefix` of one chain's gains sorted non-increasing:
    ``(m*, goodput*, threshold)``."""
    gained = np.empty(ordered.size + 1)
    gained[0] = n_requests * SCALE
    gained[1:] = ordered
    infeasible = bad.copy()
    infeasible[1:] |= ordered <= 0
    with np.errstate(invalid="ignore", divide="ignore"):
        goodput = np.cumsum(gained) / price
    goodput[infeasible] = -np.inf
    best = int(np.argmax(goodput))  # the first maximum: the fewest tokens
    return best, float(goodput[best]), (int(ordered[best - 1]) if best > 0 else SCALE + 1)


def price_table(cost: np.ndarray, n_requests: int, size: int) -> tuple[np.ndarray, np.ndarray]:
    """:func:`calib.allocate.reference.price_table`: ``price[m]`` (float64) and where it is infeasible."""
    price = np.full(size + 1, np.nan)
    available = cost[n_requests: n_requests + size + 1]
    price[: available.size] = available
    with np.errstate(invalid="ignore"):
        return price, ~((price > 0) & (price < np.inf))


def take_top(q: np.ndarray, threshold: int, n: int) -> np.ndarray:
    """:func:`calib.allocate.reference.take_top`: per-row counts of the ``n`` largest positive gains."""
    above = q > threshold
    ties = (q == threshold) & (threshold > 0)
    left = max(n - int(above.sum()), 0)
    ties_per_row = ties.sum(axis=1)
    ties_before = np.cumsum(ties_per_row) - ties_per_row
    return above.sum(axis=1) + np.minimum(np.maximum(left - ties_before, 0), ties_per_row)


def choose(q: np.ndarray, price: int) -> tuple[np.ndarray, np.ndarray]:
    """:meth:`calib.allocate.reference.TwoChains.choose` on ``q [2, B, W]``: ``(use_second, depth)``."""
    depth = (q > price).sum(axis=2)
    surplus = np.maximum(q.astype(np.int64) - price, 0).sum(axis=2)
    use_second = (surplus[1] > surplus[0]) | ((surplus[1] == surplus[0]) & (depth[1] < depth[0]))
    return use_second, np.where(use_second, depth[1], depth[0])


def allocate_host(first_p: torch.Tensor, second_p: torch.Tensor | None, cost: torch.Tensor,
                  ids: tuple[int, int] = (1, 2)) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`calib.allocate.reference.allocate_reference` in price mode, on the host: ``(drafter int8 [B],
    depth int32 [B], expected_accepted float32 [B])`` from ``first_p [B, K]``, ``second_p [B, L]`` or None
    and the verify-cost curve (checked by the caller, as :func:`calib.allocate.allocate_probs` does)."""
    c = cost.detach().cpu().numpy().astype(np.float64)
    first = first_p.detach().cpu().numpy()
    second = None if second_p is None else second_p.detach().cpu().numpy()
    return _as_tensors(*_price_mode(first, second, c, ids)[:3])


def _padded(p: np.ndarray, width: int) -> np.ndarray:
    """float32 ``[B, width]``: ``p`` right-padded with NaN (no token)."""
    out = np.full((p.shape[0], width), np.nan, dtype=np.float32)
    out[:, : p.shape[1]] = p
    return out


def _as_tensors(drafter: np.ndarray, depth: np.ndarray, expected: np.ndarray):
    return torch.from_numpy(drafter), torch.from_numpy(depth), torch.from_numpy(expected)


def _price_mode(first: np.ndarray, second: np.ndarray | None, c: np.ndarray, ids: tuple[int, int]):
    """:func:`allocate_host` on numpy arrays (``c`` float64): ``(drafter int8, depth int32, expected float32,
    use_second bool)``, each ``[B]``."""
    B = first.shape[0]
    width = max(first.shape[1], 0 if second is None else second.shape[1], 1)
    compiled = kernels()
    if compiled is not None:  # the same decision in loops (calib/allocate/compiled.py)
        stacked = _padded(first, width) if second is None else np.concatenate([_padded(first, width),
                                                                                _padded(second, width)])
        surv_all, q_all = survival(stacked)
        q_all = q_all.astype(np.int64)
        use_second, depth = compiled["allocate_loops"](q_all[:B], q_all[B:] if second is not None else q_all, second
                                                       is not None, np.ascontiguousarray(c, dtype=np.float64))
        surv = np.where(use_second[:, None], surv_all[B:], surv_all[:B]) if second is not None else surv_all
        return _outcome(surv, depth, use_second, ids) + (use_second,)
    if second is None:
        surv, q = survival(_padded(first, width))
        price, bad = price_table(c, B, q.size)
        m, _, threshold = best_sorted_prefix(-np.sort(-q, axis=None), price, bad, B)
        depth, use_second = take_top(q, threshold, m), np.zeros(B, dtype=bool)
    else:
        surv_both, q_both = survival(np.concatenate([_padded(first, width), _padded(second, width)]))
        q = q_both.reshape(2, B, width)
        price, bad = price_table(c, B, q[0].size)
        m_f, good_f, thr_f = best_sorted_prefix(-np.sort(-q[0], axis=None), price, bad, B)
        m_s, good_s, thr_s = best_sorted_prefix(-np.sort(-q[1], axis=None), price, bad, B)
        # the slot price is where the better single drafter's goodput rule stopped adding tokens
        use_second, depth = choose(q, thr_s if good_s > good_f else thr_f)
        use_second = np.where(depth > 0, use_second, q[1, :, 0] > q[0, :, 0])
        chain = np.where(use_second[:, None], q[1], q[0])
        m_c, good_c, thr_c = best_sorted_prefix(-np.sort(-chain, axis=None), price, bad, B)
        winner = int(np.argmax([good_c, good_f, good_s]))  # the first maximum
        if winner == 0:
            depth = take_top(chain, thr_c, m_c)
        else:
            use_second = np.full(B, winner == 2)
            depth = take_top(q[winner - 1], (thr_f, thr_s)[winner - 1], (m_f, m_s)[winner - 1])
        surv = np.where(use_second[:, None], surv_both[B:], surv_both[:B])
    return _outcome(surv, depth, use_second, ids) + (use_second,)


def _outcome(surv: np.ndarray, depth: np.ndarray, use_second: np.ndarray, ids: tuple[int, int]):
    """``(drafter int8, depth int32, expected float32)`` from the chosen chain's survival ``[B, W]``."""
    width = surv.shape[1]
    expected = np.where(np.arange(width)[None, :] < depth[:, None], surv, np.float32(0)).sum(axis=1, dtype=np.float32)
    drafter = np.where(depth > 0, np.where(use_second, ids[1], ids[0]), NO_CHAIN).astype(np.int8)
    return drafter, depth.astype(np.int32), np.asarray(expected, dtype=np.float32)


# -- shape-aware price mode (calib/allocate/shape.py) -------------------------------------------------
def quantized_host(price: ShapePrice, n_requests: int, width: int) -> np.ndarray:
    """:func:`calib.allocate.shape.quantized` in numpy: int64 ``[B, W + 1]`` prices on the ``base / 2**30``
    grid, -1 (infeasible) beyond the table's width and where an entry is +inf."""
    t = price.table.detach().cpu().numpy().astype(np.float64)
    t = np.broadcast_to(t, (n_requests, t.shape[-1]))
    out = np.full((n_requests, width + 1), -1, dtype=np.int64)
    cols = min(width + 1, t.shape[1])
    scaled = np.round(t[:, :cols] * (PRICE_SCALE / float(price.base)))
    out[:, :cols] = np.where(np.isfinite(scaled), scaled, -1.0).astype(np.int64)
    return out


def dinkelbach_host(q: np.ndarray, price_q: np.ndarray, n_requests: int) -> tuple[np.ndarray, np.ndarray]:
    """:func:`calib.allocate.shape.dinkelbach` in numpy (the same int64 sums and float64 ratios, so the same
    rounds): ``(chain index int64 [B], depth int64 [B])`` from gains ``q`` int32 ``[C, B, W]``."""
    C, B, W = q.shape
    gained = np.add.accumulate(q, axis=2, dtype=np.int64)  # [C, B, W]: G at depth d = 1..W
    prices = np.broadcast_to(price_q[None, :, 1:], (C, B, W))
    feasible = (q > 0) & (prices >= 0)
    # -inf where infeasible: a score there stays -inf whatever the ratio (prices are finite), and elsewhere it is
    # the same float64 difference, so each round's scores are np.where(feasible, G - lam P, -inf)'s
    g64 = np.where(feasible, gained.astype(np.float64), -np.inf)
    p64 = prices.astype(np.float64)
    rows = np.arange(B)
    flat = np.arange(C * B)
    base_n = n_requests * SCALE
    choice = np.zeros(B, dtype=np.int64)
    depth = np.zeros(B, dtype=np.int64)
    lam = float(base_n) / float(PRICE_SCALE)
    for _ in range(MAX_ITERS):
        score = (g64 - lam * p64).reshape(C * B, W)
        d = score.argmax(axis=1)  # [C B]: the first maximum, the fewest tokens
        best = score[flat, d].reshape(C, B)
        d = np.where(best > 0, d.reshape(C, B) + 1, 0)  # ties with verifying nothing: fewer tokens
        if C > 1:
            surplus = np.maximum(best, 0)
            take = (surplus[1] > surplus[0]) | ((surplus[1] == surplus[0]) & (d[1] < d[0]))
            new_choice = take.astype(np.int64)
            new_depth = d[new_choice, rows]
        else:  # one chain: its own depths
            new_choice, new_depth = choice, d[0]
        at = np.maximum(new_depth - 1, 0)
        num = base_n + int(np.where(new_depth > 0, gained[new_choice, rows, at], 0).sum())
        den = PRICE_SCALE + int(price_q[rows, new_depth].sum())
        lam_new = float(num) / float(den)
        if not lam_new > lam:
            break
        choice, depth, lam = new_choice, new_depth, lam_new
    return choice, depth


def _shape_mode(first: np.ndarray, second: np.ndarray | None, price_q: np.ndarray, ids: tuple[int, int]):
    """:func:`allocate_shape_host` on numpy arrays and quantized prices ``[B, >= W + 1]``: as :func:`_price_mode`."""
    B = first.shape[0]
    width = max(first.shape[1], 0 if second is None else second.shape[1], 1)
    stacked = [_padded(first, width)] + ([] if second is None else [_padded(second, width)])
    surv, q = survival(np.concatenate(stacked))
    C = len(stacked)
    if price_q.shape[1] < width + 1:  # deeper than the price: not allowed
        price_q = np.pad(price_q, ((0, 0), (0, width + 1 - price_q.shape[1])), constant_values=-1)
    compiled = kernels()
    if compiled is not None:  # the same rounds in loops (calib/allocate/compiled.py)
        choice, depth = compiled["dinkelbach_loops"](q.reshape(C, B, width).astype(np.int64),
                                                     np.ascontiguousarray(price_q[:, : width + 1], dtype=np.int64), B)
    else:
        choice, depth = dinkelbach_host(q.reshape(C, B, width), price_q[:, : width + 1], B)
    surv = surv.reshape(C, B, width)[choice, np.arange(B)]
    use_second = choice > 0
    return _outcome(surv, depth, use_second, ids) + (use_second,)


def allocate_shape_host(first_p: torch.Tensor, second_p: torch.Tensor | None, price: ShapePrice,
                        ids: tuple[int, int] = (1, 2)) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`calib.allocate.shape.allocate_shape_reference` on the host (price checked by the caller)."""
    first = first_p.detach().cpu().numpy()
    second = None if second_p is None else second_p.detach().cpu().numpy()
    width = max(first.shape[1], 0 if second is None else second.shape[1], 1)
    return _as_tensors(*_shape_mode(first, second, quantized_host(price, first.shape[0], width), ids)[:3])


# -- the serving decider's entry ------------------------------------------------------------------------
def allocate_chains_host(probs: dict, *, cost: np.ndarray | None = None, price_q: np.ndarray | None = None):
    """One serving step's allocation from ``{chain name: float32 [B, L] probabilities}`` (one or two chains,
    as looked up this step; NaN = no token) under the flat curve ``cost`` (float64 ``[T_max + 1]``, checked
    once by the caller: :func:`calib.allocate.check_cost`) or the quantized shape price ``price_q`` (int64
    ``[B, >= W + 1]``, :func:`quantized_host`). Returns numpy ``(drafter int8 [B], depth int32 [B], expected
    float32 [B], chosen float32 [B, max(1, max depth)])``, ``chosen`` the verified prefix's probabilities
    (NaN past each request's depth); the decisions are :func:`calib.allocate.allocate_probs`'."""
    kinds = sorted((chain(n) for n in probs), key=lambda k: k.id)  # the allocator's tie order
    if not 1 <= len(kinds) <= 2:
        raise ValueError(f"one or two chains per step, got {[k.name for k in kinds]}")
    first = np.asarray(probs[kinds[0].name], dtype=np.float32)
    second = np.asarray(probs[kinds[1].name], dtype=np.float32) if len(kinds) > 1 else None
    B = first.shape[0]
    if second is not None and second.shape[0] != B:
        raise ValueError(f"the chains have different batch sizes B: {first.shape[0]} and {second.shape[0]}")
    ids = (kinds[0].id, kinds[-1].id)
    if B == 0:
        return (np.zeros(0, np.int8), np.zeros(0, np.int32), np.zeros(0, np.float32), np.zeros((0, 1), np.float32))
    if price_q is not None:
        drafter, depth, expected, use_second = _shape_mode(first, second, price_q, ids)
    else:
        if cost.shape[0] < B + 1 or not (math.isfinite(cost[B]) and cost[B] > 0):
            check_cost(torch.from_numpy(cost), B)
        compiled = kernels()
        if compiled is not None:  # the decision, its outcome and the chosen probabilities in one call
            return compiled["decide_loops"](first, first if second is None else second, second is not None,
                                            np.ascontiguousarray(cost, dtype=np.float64), ids[0], ids[1], NO_CHAIN)
        drafter, depth, expected, use_second = _price_mode(first, second, cost, ids)
    width = max(1, int(depth.max()))
    taken = _padded(first[:, :width], width)
    if second is not None:
        taken = np.where(use_second[:, None], _padded(second[:, :width], width), taken)
    chosen = np.where(np.arange(width)[None, :] < depth[:, None], taken, np.float32(np.nan)).astype(np.float32)
    return drafter, depth, expected, chosen
