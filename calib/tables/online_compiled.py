"""The online correction's per-step work in compiled calls: its update (:meth:`calib.tables.online.OnlineCorrection.update`),
the table probabilities behind those served (:meth:`~calib.tables.online.OnlineCorrection.table_of`) and the context
cell cut (:meth:`calib.tables.online_tables.OnlineTables.cells`).

In serving the update runs once per engine step, between the target's forwards, where every numpy call starts with
cold caches (docs/profile.md, "Why inside costs 2–3× alone"): vectorised, one Newton step is some fifteen numpy
calls, and a step takes one for the pooled level and one per context cell its rounds fall in (0.2–0.6 ms a step
inside the engine). Here the same arithmetic runs in loops numba compiles: one call per step.

The formulas and their order are the numpy update's (sums over a level's rounds in round order, the pooled step
before the cells', the cells in ascending id, each cell's step on the logits the pooled step left). The values
agree with the numpy update to float64 rounding, not bit for bit: numpy's ``exp``/``log`` on SIMD hardware and
its pairwise sums over long single columns round differently from the scalar loops (tests/tables/
test_online_compiled.py bounds the difference; the cut is exact). Without numba :func:`kernels` is None and the
numpy versions run.
"""

from __future__ import annotations

import math

import numpy as np

from calib.compiled import Kernels
from calib.tables.online_kernels import EPS, FMAX, MIN_SCALE

ENTRIES = ("update_loops", "update_rounds_loops", "table_of_loops", "cut_loops", "remembered_loops")  # kernels()


def _warm_up(compiled: dict) -> None:
    p, one = np.full((1, 1), 0.5), np.ones(1)
    compiled["update_loops"](p, np.ones((1, 1)), np.zeros(1, dtype=np.int64), True, True, 0.99, 50.0,
                             np.zeros((3, 1)), np.zeros((3, 1)), np.zeros((3, 2, 1)))  # one cell held
    compiled["update_rounds_loops"](p, np.zeros(1, dtype=np.int64), np.ones(1, dtype=np.int64),
                                    np.ones(1, dtype=np.int64), np.zeros(1, dtype=np.int64), True, True, 0.99, 50.0,
                                    np.zeros((3, 1)), np.zeros((3, 1)), np.zeros((3, 2, 1)))
    compiled["table_of_loops"](p, np.zeros(1, dtype=np.int64), np.zeros((2, 1)), one)
    compiled["cut_loops"](p, p, np.ones(1, dtype=np.int64))
    compiled["remembered_loops"](p, np.zeros(1, dtype=np.int64), np.full((1, 1), 0.5, dtype=np.float32),
                                 np.ones(1, dtype=np.int64), p, np.ones(1, dtype=np.int64), True, np.zeros((2, 1)), one)


def kernels() -> dict | None:
    """``{name: compiled function}`` of :data:`ENTRIES`, or None where numba is not installed or cannot compile
    them (the numpy versions then run); compiled at the first call in a process (:class:`calib.compiled.Kernels`)."""
    return _KERNELS.get()


def table_of_loops(q, cells, offsets, scale):
    """:meth:`calib.tables.online.OnlineCorrection.table_of` of float64 ``q [B, W]`` in int64 ``cells [B]``:
    ``σ((logit q − δ) / (1 + β))`` where ``q`` is strictly inside (0, 1), ``q`` elsewhere; ``offsets [cells + 1, D]``
    (δ₀ + δ_c by cell, the last row for any cell past them), ``scale [D]``; depths past ``D`` take the deepest's."""
    B, W = q.shape
    out = np.empty((B, W))
    for b in range(B):
        for k in range(W):
            out[b, k] = _behind(q[b, k], cells[b], k, offsets, scale)
    return out


def _behind(x, cell, k, offsets, scale):
    """The table probability behind ``x`` served in context ``cell`` at column ``k`` (:func:`table_of_loops`'s
    entry): ``σ((logit x − δ) / (1 + β))`` where ``x`` is strictly inside (0, 1), ``x`` elsewhere."""
    if not (x > 0 and x < 1):
        return x
    last = offsets.shape[0] - 1
    row = last if cell < 0 or cell > last else cell  # numpy reads a negative id as unsigned: past the table
    d = min(k, scale.shape[0] - 1)
    return _sigmoid((_logit(x) - offsets[row, d]) / scale[d])


def cut_loops(values, grid, strides):
    """:func:`calib.tables.online_kernels.cut`: the context cell ``[B]`` of float64 context values ``[B, A]`` (an
    axis's bucket is the number of its edges at or below the value; NaN edges pad, a NaN value counts none)."""
    B = values.shape[0]
    out = np.zeros(B, dtype=np.int64)
    for b in range(B):
        out[b] = _cell_of(values, b, grid, strides)
    return out


def _cell_of(values, b, grid, strides):
    """Row ``b``'s context cell (:func:`cut_loops`)."""
    cell = 0
    for a in range(values.shape[1]):
        v = values[b, a]
        if not math.isnan(v):
            v = min(max(v, -FMAX), FMAX)  # ±inf read as ±max, as numpy's cut does (NaN: no edge at or below)
        count = 0
        for e in range(grid.shape[1]):
            if v >= grid[a, e]:
                count += 1
        cell += count * strides[a]
    return cell


def remembered_loops(values, rows, probs, depth, grid, strides, moved, offsets, scale):
    """What serving remembers of a step's ``rows`` (int64 ``[R]``) on one chain, in one call: their context cells
    ``[R]`` (:func:`cut_loops` of float64 ``values[rows]``) and the table probabilities behind the float32 ``probs
    [rows]`` served (:func:`table_of_loops` where the correction ``moved``, else the served values), NaN from each
    row's ``depth`` on (float64 ``[R, W]``)."""
    R, W = rows.shape[0], probs.shape[1]
    cells = np.zeros(R, dtype=np.int64)
    table = np.empty((R, W))
    for i in range(R):
        r = rows[i]
        c = _cell_of(values, r, grid, strides)
        cells[i] = c
        for k in range(W):
            x = np.float64(probs[r, k])
            if k >= depth[r]:
                table[i, k] = np.nan  # a round ends at its depth
            else:
                table[i, k] = _behind(x, c, k, offsets, scale) if moved else x
    return cells, table


def _sigmoid(u):
    return 1.0 / (1.0 + math.exp(-u))


def _logit(p):
    q = min(max(p, EPS), 1 - EPS)
    return math.log(q) - math.log1p(-q)


def update_rounds_loops(table, rows, accepted, depth, cells, pooled_on, sloped, decay, prior, pooled, slope,
                        cell_state):
    """:func:`update_loops` on rounds ``rows`` (int64 ``[R]``) of one remembered step, with their outcomes built here
    rather than in numpy: table probabilities ``table[rows, :width]`` (float64 ``[N, W]``, NaN past each round's
    depth), outcomes 1 for ``accepted [R]`` tokens, 0 at the first rejection, NaN after it (:func:`calib.tables.
    online.outcome_rows` of ``accepted`` and ``depth[rows]``), cells ``cells[rows]``; ``width`` the rounds' deepest
    draft, cut to the tracked depths (``pooled.shape[1]``). Returns what :func:`update_loops` returns."""
    R = rows.shape[0]
    width = 0
    for i in range(R):
        width = max(width, depth[rows[i]])
    K = min(width, pooled.shape[1])
    p = np.empty((R, K))
    acc = np.empty((R, K))
    at = np.empty(R, dtype=np.int64)
    for i in range(R):
        r = rows[i]
        at[i] = cells[r]
        a, d = accepted[i], depth[r]
        for k in range(K):
            p[i, k] = table[r, k]
            acc[i, k] = 1.0 if k < a else (0.0 if k == a and k < d else np.nan)
    return _update(p, acc, at, pooled_on, sloped, decay, prior, pooled, slope, cell_state)


def update_loops(p, acc, cells, pooled_on, sloped, decay, prior, pooled, slope, cell_state):
    """:func:`_update`: one update of the correction's state from table probabilities and outcomes (what
    :meth:`calib.tables.online.OnlineCorrection.update` does in numpy)."""
    return _update(p, acc, cells, pooled_on, sloped, decay, prior, pooled, slope, cell_state)


def _update(p, acc, cells, pooled_on, sloped, decay, prior, pooled, slope, cell_state):
    """One update of the correction's state, in place; returns the positions used (-1: see below).

    ``p`` float64 ``[B, K]`` table probabilities (K already cut to the tracked depths), ``acc`` float64 ``[B, K]``
    outcomes (1/0, NaN not drafted), ``cells`` int64 ``[B]`` context cells (each below ``cell_state``'s cell
    count), ``pooled`` / ``slope`` float64 ``[3, D]`` (δ₀, H, n / β, its information, the cross information),
    ``cell_state`` float64 ``[3, C + 1, D]`` (δ_c, H, n of every cell; the last stays 0). What
    :meth:`calib.tables.online.OnlineCorrection.update` does in numpy. Returns -1, having changed nothing, where a
    cell is negative or past ``C - 1``."""
    B, K = p.shape
    for b in range(B):
        if cells[b] < 0 or cells[b] >= cell_state.shape[1] - 1:
            return -1  # a cell past those held (or negative): nothing learnt; the caller grows and calls again
    seen = np.zeros((B, K), dtype=np.bool_)
    z = np.zeros((B, K))
    y = np.zeros((B, K))
    total = 0
    for b in range(B):
        reached = True  # accepted at every earlier depth
        for k in range(K):
            a = acc[b, k]
            x = p[b, k]
            seen[b, k] = reached and not math.isnan(a) and x > 0 and x < 1
            reached = reached and a == 1
            z[b, k] = _logit(0.5 if math.isnan(x) else x)
            y[b, k] = min(max(a, -FMAX), FMAX)
            if seen[b, k]:
                total += 1
    if total == 0:
        return 0
    info0 = prior / 4.0
    u = np.empty((B, K))
    if pooled_on:
        for b in range(B):
            c = cells[b]
            for k in range(K):
                u[b, k] = z[b, k] * (1.0 + slope[0, k]) + (pooled[0, k] + cell_state[0, c, k])
        rows = np.arange(B)
        _newton_loops(pooled, slope, sloped, rows, seen, y, u, z, K, False, decay, info0)
    # the cells learn what the pooled step left: z·(1 + β) + δ₀ (the new β and δ₀), each cell in ascending id
    order = np.argsort(cells, kind="mergesort")  # stable: a cell's rounds keep their order
    start = 0
    added = 0
    dummy = np.zeros((3, 1))
    while start < B:
        c = cells[order[start]]
        end = start
        while end < B and cells[order[end]] == c:
            end += 1
        rows = np.sort(order[start:end])
        n = 0
        for b in rows:
            for k in range(K):
                if seen[b, k]:
                    n += 1
        if n:
            added += n
            s = cell_state[:, c, :]
            for b in rows:
                for k in range(K):
                    base = z[b, k] * (1.0 + slope[0, k]) if pooled_on else z[b, k]
                    if pooled_on:
                        base = base + pooled[0, k]
                    u[b, k] = base + s[0, k]
            _newton_loops(s, dummy, False, rows, seen, y, u, z, K, pooled_on, decay, info0)
        start = end
    return added


def _newton_loops(s, b_state, with_slope, rows, seen, y, u, z, K, ridge, decay, info0):
    """:meth:`calib.tables.online.OnlineCorrection._newton` of level ``s`` ``[3, D]`` on ``rows`` of the step
    (with the pooled slope ``b_state`` when ``with_slope``)."""
    for k in range(K):
        cnt = 0
        g = 0.0
        h = 0.0
        g_b = 0.0
        h_zz = 0.0
        h_z = 0.0
        for b in rows:
            q = min(max(_sigmoid(u[b, k]), EPS), 1 - EPS)
            r, w = 0.0, 0.0
            if seen[b, k]:
                cnt += 1
                r = y[b, k] - q
                w = q * (1 - q)
            g += r
            h += w
            if with_slope:
                zz = z[b, k]
                h_zz += w * zz * zz
                h_z += w * zz
                g_b += r * zz
        fade = decay ** float(cnt)  # numpy's float64 ** int64 is pow(), not repeated products
        if ridge:
            g = g - (1.0 - fade) * info0 * s[0, k]
        s[1, k] = fade * s[1, k] + h
        s[2, k] += cnt
        if not with_slope:
            s[0, k] += g / (s[1, k] + info0)
            continue
        b_state[1, k] = fade * b_state[1, k] + h_zz
        b_state[2, k] = fade * b_state[2, k] + h_z
        h_aa, h_bb, h_ab = s[1, k] + info0, b_state[1, k] + info0, b_state[2, k]
        det = h_aa * h_bb - h_ab * h_ab
        s[0, k] += (h_bb * g - h_ab * g_b) / det
        b_state[0, k] = max(b_state[0, k] + (h_aa * g_b - h_ab * g) / det, MIN_SCALE - 1.0)


_KERNELS = Kernels(globals(), ENTRIES, (_sigmoid, _logit, _newton_loops, _update, _cell_of, _behind), _warm_up,
                   "the online correction's kernels", "the numpy versions run",
                   boundscheck=True)  # an index past an array raises, as numpy would
