"""The draft-aware plan (:func:`calib.allocate.draft._plan_all`) in loops numba compiles.

A serving step plans its draft passes before the drafter runs (calib/vllm/planning.py). The vectorised plan
takes some ninety numpy calls on a step's few requests, whose fixed costs are most of its time (~0.25 ms at any
batch size, bench/hot_path.py); compiled, the same rule costs microseconds. The rule here is the reference
allocator's price mode applied to each plan in turn (:func:`calib.allocate.draft._plan_draft_loop`, on
:func:`calib.allocate.host._price_mode`'s arithmetic): float32 survival products truncated to gains on the
``2**24`` grid, exact integer sums, float64 goodputs, first maxima; so its answer is :func:`_plan_all`'s bit for
bit (tests/allocate/test_draft_kernel.py). Without numba :func:`plan_kernel` is None and the vectorised plan runs.
"""

from __future__ import annotations

import numpy as np

from calib.allocate.reference import SCALE

_KERNEL: list = []  # [compiled plan or None], filled at first use


def plan_kernel():
    """The compiled :func:`plan_all_loops`, or None where numba is not installed (compiled once per process,
    cached on disk by numba)."""
    if not _KERNEL:
        try:
            from numba import njit
        except ImportError:
            _KERNEL.append(None)
        else:
            jit = njit(cache=True, nogil=True)
            for f in (_gains, _best_prefix, _take_top, _sorted_desc, _allocate, _plan_value):
                globals()[f.__name__] = jit(f)
            _KERNEL.append(jit(plan_all_loops))
    return _KERNEL[0]


def warm() -> None:
    """Compile the plan now (engine start), not in the first step that plans (numba: seconds the first time in a
    process without its disk cache); a no-op without numba."""
    kernel = plan_kernel()
    if kernel is not None:
        p = np.full((1, 1), 0.5, dtype=np.float32)
        kernel(p, p.copy(), True, True, 0, np.ones(4), np.zeros(2))


def plan_all_loops(p, other, has_other, chain_first, done, cost, extras):
    """:func:`calib.allocate.draft._plan_all` one plan at a time: plan ``g = done..K`` allocates the planned
    chain's first ``g`` columns of ``p`` float32 ``[B, K]`` (with the free chain ``other`` float32 ``[B, L]`` when
    ``has_other``; ``chain_first``: the planned chain has the lower registry id) at the curve ``cost`` float64
    plus ``extras[g - done]``. Returns ``(value, g, depth int64 [B], free int64 [B])`` of the best plan (first
    maximum: the fewest passes); ``free`` is zeros without a free chain."""
    B, K = p.shape
    best_value, best_g = -np.inf, -1
    best_depth = np.zeros(B, dtype=np.int64)
    best_free = np.zeros(B, dtype=np.int64)
    for g in range(done, K + 1):
        extra = extras[g - done]
        L = other.shape[1] if has_other else 0
        width = max(g, L, 1)  # the reference pads the chains to one width
        qm = _gains(p, g, width)
        qo = _gains(other, L, width)
        first, second = (qm, qo) if chain_first else (qo, qm)
        use_second, depth = _allocate(first, second, has_other, cost, extra)
        planned_second = not chain_first
        depth_plan = np.zeros(B, dtype=np.int64)
        depth_free = np.zeros(B, dtype=np.int64)
        for b in range(B):
            if use_second[b] == planned_second:
                depth_plan[b] = depth[b]
            else:
                depth_free[b] = depth[b]
        value = _plan_value(qm, qo, depth_plan, depth_free, cost, extra)
        if best_g < 0 or value > best_value:  # ties: the fewer passes
            best_value, best_g, best_depth, best_free = value, g, depth_plan, depth_free
    return best_value, best_g, best_depth, best_free


def _gains(p, cols, width):
    """int64 ``[B, width]``: :func:`calib.allocate.host.survival`'s gains of ``p``'s first ``cols`` columns
    (NaN -> 0, clamped to [0, 1], a float32 running product, times ``2**24`` truncated); 0 past them."""
    B = p.shape[0]
    q = np.zeros((B, width), dtype=np.int64)
    one, zero, scale = np.float32(1.0), np.float32(0.0), np.float32(SCALE)
    for b in range(B):
        s = one
        for k in range(cols):
            x = p[b, k]
            if not x > zero:  # NaN, 0 and below (-inf included)
                x = zero
            elif x > one:
                x = one
            s = np.float32(s * x)
            q[b, k] = np.int64(np.int32(np.float32(s * scale)))
    return q


def _sorted_desc(q):
    """``q``'s entries, largest first (int64 ``[B W]``)."""
    return np.sort(q.ravel())[::-1]


def _best_prefix(ordered, n_requests, cost, extra):
    """:func:`calib.allocate.host.best_sorted_prefix` on the price ``cost[n_requests + m] + extra``:
    ``(m, goodput, threshold)``."""
    n = ordered.size
    total = float(n_requests * SCALE)
    best, best_good = 0, -np.inf
    for m in range(n + 1):
        if m > 0:
            total += ordered[m - 1]
        at = n_requests + m
        price = cost[at] + extra if at < cost.size else np.nan
        feasible = price > 0 and price < np.inf and (m == 0 or ordered[m - 1] > 0)
        good = total / price if feasible else -np.inf
        if m == 0 or good > best_good:  # the first maximum: the fewest tokens
            best, best_good = m, good
    threshold = ordered[best - 1] if best > 0 else SCALE + 1
    return best, best_good, threshold


def _take_top(q, threshold, n):
    """:func:`calib.allocate.host.take_top`: per-row counts of the ``n`` largest positive gains."""
    B, W = q.shape
    above = np.zeros(B, dtype=np.int64)
    ties = np.zeros(B, dtype=np.int64)
    for b in range(B):
        for k in range(W):
            if q[b, k] > threshold:
                above[b] += 1
            elif q[b, k] == threshold and threshold > 0:
                ties[b] += 1
    left = max(n - above.sum(), 0)
    before = 0
    depth = np.zeros(B, dtype=np.int64)
    for b in range(B):
        depth[b] = above[b] + min(max(left - before, 0), ties[b])
        before += ties[b]
    return depth


def _allocate(first, second, has_second, cost, extra):
    """:func:`calib.allocate.host._price_mode` on gains ``first``/``second`` ``[B, W]`` at ``cost + extra``:
    ``(use_second bool [B], depth int64 [B])``."""
    B, W = first.shape
    use_second = np.zeros(B, dtype=np.bool_)
    if not has_second:
        m, _, threshold = _best_prefix(_sorted_desc(first), B, cost, extra)
        return use_second, _take_top(first, threshold, m)
    m_f, good_f, thr_f = _best_prefix(_sorted_desc(first), B, cost, extra)
    m_s, good_s, thr_s = _best_prefix(_sorted_desc(second), B, cost, extra)
    price = thr_s if good_s > good_f else thr_f  # the better single chain's slot price
    chain = np.empty((B, W), dtype=np.int64)
    for b in range(B):  # each request's Lagrangian choice at it (calib.allocate.host.choose)
        d_f = d_s = 0
        s_f = s_s = 0
        for k in range(W):
            if first[b, k] > price:
                d_f += 1
                s_f += first[b, k] - price
            if second[b, k] > price:
                d_s += 1
                s_s += second[b, k] - price
        take = s_s > s_f or (s_s == s_f and d_s < d_f)
        depth = d_s if take else d_f
        use_second[b] = take if depth > 0 else second[b, 0] > first[b, 0]
        for k in range(W):
            chain[b, k] = second[b, k] if use_second[b] else first[b, k]
    m_c, good_c, thr_c = _best_prefix(_sorted_desc(chain), B, cost, extra)
    if good_c >= good_f and good_c >= good_s:  # the first maximum of (chosen, first, second)
        return use_second, _take_top(chain, thr_c, m_c)
    if good_f >= good_s:
        use_second[:] = False
        return use_second, _take_top(first, thr_f, m_f)
    use_second[:] = True
    return use_second, _take_top(second, thr_s, m_s)


def _plan_value(qm, qo, depth_plan, depth_free, cost, extra):
    """:func:`calib.allocate.draft._plan_value`: ``(B 2**24 + gains verified) / 2**24 / (cost[T] + extra)``."""
    B = qm.shape[0]
    gained, taken = 0, 0
    for b in range(B):
        for k in range(depth_plan[b]):
            gained += qm[b, k]
        for k in range(depth_free[b]):
            gained += qo[b, k]
        taken += depth_plan[b] + depth_free[b]
    T = B + taken
    price = cost[T] + extra if T < cost.size else np.inf
    return (B * SCALE + gained) / SCALE / price
