"""The host allocator's rules in loops numba compiles: the draft-aware plan (:func:`plan_all_loops`, as
:func:`calib.allocate.draft._plan_all`), the price mode (:func:`allocate_loops`, as
:func:`calib.allocate.host._price_mode`) and the shape price's Dinkelbach rounds (:func:`dinkelbach_loops`, as
:func:`calib.allocate.host.dinkelbach_host`).

A serving step decides for a few requests; vectorised, each rule takes tens of numpy calls whose fixed costs are
most of its time (the plan alone ~0.25 ms at any batch size, bench/hot_path.py); compiled, microseconds. The
arithmetic is the numpy rules': float32 survival products truncated to gains on the ``2**24`` grid, exact integer
sums, float64 goodputs and ratios, first maxima; the plan allocates each plan in turn as
:func:`calib.allocate.draft._plan_draft_loop` does. So every answer is the vectorised rule's bit for bit
(tests/allocate/test_compiled.py). Without numba :func:`kernels` is None and the numpy rules run.
"""

from __future__ import annotations

import numpy as np

from calib.allocate.reference import SCALE
from calib.allocate.shape import MAX_ITERS, PRICE_SCALE
from calib.compiled import Kernels

ENTRIES = ("plan_all_loops", "allocate_loops", "decide_loops", "dinkelbach_loops")  # what kernels() hands out


def _warm_up(compiled: dict) -> None:
    p = np.full((1, 1), 0.5, dtype=np.float32)
    compiled["plan_all_loops"](p, p.copy(), True, True, 0, np.ones(4), np.zeros(2))
    q = np.ones((1, 1), dtype=np.int64)
    compiled["allocate_loops"](q, q, True, np.ones(4))
    compiled["decide_loops"](p, p, True, np.ones(4), 1, 2, 0)
    compiled["dinkelbach_loops"](np.ones((2, 1, 1), dtype=np.int64), np.zeros((1, 2), dtype=np.int64), 1)


def kernels() -> dict | None:
    """``{name: compiled function}`` of :data:`ENTRIES`, or None where numba is not installed or cannot compile
    them (the numpy rules then run); compiled at the first call in a process (:class:`calib.compiled.Kernels`),
    the helpers they call with them."""
    return _KERNELS.get()


def plan_kernel():
    """The compiled :func:`plan_all_loops`, or None without numba."""
    k = kernels()
    return None if k is None else k["plan_all_loops"]


def warm() -> None:
    """Compile the rules now (engine start), not in the first step that uses them (:func:`kernels`)."""
    kernels()


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
    one, scale = np.float32(1.0), np.float32(SCALE)
    for b in range(B):
        s = one
        for k in range(cols):
            s = np.float32(s * _clamped(p[b, k]))
            q[b, k] = np.int64(np.int32(np.float32(s * scale)))
    return q


def _clamped(x):
    """:func:`calib.allocate.host.survival`'s clamp of one float32 probability: NaN, 0 and below (-inf included) -> 0,
    above 1 -> 1."""
    zero, one = np.float32(0.0), np.float32(1.0)
    if not x > zero:
        return zero
    return min(x, one)  # x is not NaN here


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


def allocate_loops(first, second, has_second, cost):
    """:func:`calib.allocate.host._price_mode`'s decision on gains int64 ``first``/``second`` ``[B, W]`` (``second``
    ignored without ``has_second``) under the float64 curve ``cost``: ``(use_second bool [B], depth int64 [B])``."""
    return _allocate(first, second, has_second, cost, 0.0)


def decide_loops(first, second, has_second, cost, first_id, second_id, no_chain):
    """:func:`calib.allocate.host.allocate_chains_host` under the curve ``cost`` (float64), whole: the chains'
    float32 probabilities ``first``/``second`` ``[B, W1]``/``[B, W2]`` (NaN: no token; ``second`` ignored without
    ``has_second``) -> ``(drafter int8 [B], depth int32 [B], expected float32 [B], chosen float32 [B, max(1, max
    depth)])``: :func:`allocate_loops`' decision, the chain ids ``first_id``/``second_id`` (``no_chain`` where a
    request verifies nothing), the chosen chain's survival summed over its verified tokens (float32, left to right)
    and its probabilities there (NaN past each request's depth). One call where the numpy entry makes some twenty."""
    B = first.shape[0]
    W = max(first.shape[1], second.shape[1] if has_second else 0, 1)
    q_first = _gains(first, first.shape[1], W)
    q_second = _gains(second, second.shape[1], W) if has_second else q_first
    use_second, depth = _allocate(q_first, q_second, has_second, cost, 0.0)
    width = 1
    for b in range(B):
        width = max(width, depth[b])
    drafter = np.empty(B, dtype=np.int8)
    depth32 = np.empty(B, dtype=np.int32)
    expected = np.zeros(B, dtype=np.float32)
    chosen = np.full((B, width), np.nan, dtype=np.float32)
    one, zero = np.float32(1.0), np.float32(0.0)
    for b in range(B):
        p = second if use_second[b] else first
        d = depth[b]
        drafter[b] = (second_id if use_second[b] else first_id) if d > 0 else no_chain
        depth32[b] = d
        s, total = one, zero
        for k in range(d):  # d <= the chosen chain's width: the allocator verifies only tokens it was given
            chosen[b, k] = p[b, k]
            s = np.float32(s * _clamped(p[b, k]))
            total = np.float32(total + s)
        expected[b] = total
    return drafter, depth32, expected, chosen


def dinkelbach_loops(q, price_q, n_requests):
    """:func:`calib.allocate.host.dinkelbach_host`: ``(chain index int64 [B], depth int64 [B])`` from gains int64
    ``q [C, B, W]`` and quantized prices int64 ``price_q [B, W + 1]`` (-1: infeasible)."""
    C, B, W = q.shape
    gained = np.zeros((C, B, W), dtype=np.int64)  # G at depth d = 1..W
    for c in range(C):
        for b in range(B):
            total = 0
            for k in range(W):
                total += q[c, b, k]
                gained[c, b, k] = total
    base_n = n_requests * SCALE
    choice = np.zeros(B, dtype=np.int64)
    depth = np.zeros(B, dtype=np.int64)
    best = np.zeros((C, B))
    d = np.zeros((C, B), dtype=np.int64)
    lam = float(base_n) / float(PRICE_SCALE)
    for _ in range(MAX_ITERS):
        for c in range(C):
            for b in range(B):
                top, at = -np.inf, 0
                for k in range(W):  # the first maximum of the feasible scores G - lam P: the fewest tokens
                    if q[c, b, k] > 0 and price_q[b, k + 1] >= 0:
                        score = float(gained[c, b, k]) - lam * float(price_q[b, k + 1])
                        if score > top:
                            top, at = score, k
                best[c, b] = top
                d[c, b] = at + 1 if top > 0 else 0  # ties with verifying nothing: fewer tokens
        new_choice = np.zeros(B, dtype=np.int64)
        new_depth = np.zeros(B, dtype=np.int64)
        num, den = base_n, PRICE_SCALE
        for b in range(B):
            if C > 1:
                s0, s1 = max(best[0, b], 0.0), max(best[1, b], 0.0)
                if s1 > s0 or (s1 == s0 and d[1, b] < d[0, b]):
                    new_choice[b] = 1
            new_depth[b] = d[new_choice[b], b]
            if new_depth[b] > 0:
                num += gained[new_choice[b], b, new_depth[b] - 1]
            den += price_q[b, new_depth[b]]
        lam_new = float(num) / float(den)
        if not lam_new > lam:
            break
        choice, depth, lam = new_choice, new_depth, lam_new
    return choice, depth


_KERNELS = Kernels(globals(), ENTRIES, (_clamped, _gains, _best_prefix, _take_top, _sorted_desc, _allocate, _plan_value),
                   _warm_up, "the allocator's rules", "the numpy rules run")
