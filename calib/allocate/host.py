"""The reference allocator's price mode in numpy, for a serving step's few requests on a CPU host.

:mod:`calib.allocate.reference` is written for any device and no host synchronisation: a step of a few
requests costs it some forty torch calls, whose fixed cost on a CPU (microseconds each) is most of calib's
time inside vLLM's step (bench/hot_path.py). This module takes the same decisions with the same integer
arithmetic (gains on the ``2**24`` grid, exact integer sums, float64 goodput, ties broken alike) in numpy,
whose calls cost a fraction of torch's on small arrays. Its decisions equal the reference's bit for bit and
its expected accepted lengths to float32 rounding (tests/allocate/test_host_matches_reference.py); budget
mode is left to the reference (serving prices steps, it does not budget them).
"""

from __future__ import annotations

import numpy as np
import torch

from calib.allocate.reference import SCALE
from calib.chains import NO_CHAIN


def survival(p: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """:func:`calib.allocate.reference.survival` in numpy: float32 ``S [B, K]`` (a column product, left to
    right) and its fixed-point gains ``q`` (int32)."""
    surv = np.clip(np.nan_to_num(p.astype(np.float32), nan=0.0, posinf=1.0, neginf=0.0), 0.0, 1.0)
    for k in range(1, surv.shape[1]):
        surv[:, k] *= surv[:, k - 1]
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
    return above.sum(axis=1) + np.minimum(np.clip(left - ties_before, 0, None), ties_per_row)


def choose(q: np.ndarray, price: int) -> tuple[np.ndarray, np.ndarray]:
    """:meth:`calib.allocate.reference.TwoChains.choose` on ``q [2, B, W]``: ``(use_second, depth)``."""
    depth = (q > price).sum(axis=2)
    surplus = np.clip(q.astype(np.int64) - price, 0, None).sum(axis=2)
    use_second = (surplus[1] > surplus[0]) | ((surplus[1] == surplus[0]) & (depth[1] < depth[0]))
    return use_second, np.where(use_second, depth[1], depth[0])


def allocate_host(first_p: torch.Tensor, second_p: torch.Tensor | None, cost: torch.Tensor,
                  ids: tuple[int, int] = (1, 2)) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`calib.allocate.reference.allocate_reference` in price mode, on the host: ``(drafter int8 [B],
    depth int32 [B], expected_accepted float32 [B])`` from ``first_p [B, K]``, ``second_p [B, L]`` or None
    and the verify-cost curve (checked by the caller, as :func:`calib.allocate.allocate_probs` does)."""
    B = first_p.shape[0]
    width = max(first_p.shape[1], 0 if second_p is None else second_p.shape[1], 1)
    c = cost.detach().cpu().numpy().astype(np.float64)

    def padded(p):
        out = np.full((B, width), np.nan, dtype=np.float32)
        out[:, : p.shape[1]] = p.detach().cpu().numpy()
        return out

    if second_p is None:
        surv, q = survival(padded(first_p))
        price, bad = price_table(c, B, q.size)
        m, _, threshold = best_sorted_prefix(-np.sort(-q, axis=None), price, bad, B)
        depth, use_second = take_top(q, threshold, m), np.zeros(B, dtype=bool)
    else:
        surv_both, q_both = survival(np.concatenate([padded(first_p), padded(second_p)]))
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
    expected = np.where(np.arange(width)[None, :] < depth[:, None], surv, np.float32(0)).sum(axis=1, dtype=np.float32)
    drafter = np.where(depth > 0, np.where(use_second, ids[1], ids[0]), NO_CHAIN).astype(np.int8)
    return (torch.from_numpy(drafter), torch.from_numpy(depth.astype(np.int32)),
            torch.from_numpy(np.asarray(expected, dtype=np.float32)))
