"""A chain's table lookup in one compiled call (:func:`calib.tables.layout.chain_lookup_host`).

A serving step looks up each chain once, between the target's forwards, where each numpy call starts with cold
caches (docs/profile.md, "Why inside costs 2–3× alone"); vectorised, a lookup through the online correction is some
thirty numpy calls (the context bucket by comparison, the interpolation, the correction's read). Here the same
operations run in loops numba compiles. The table's own values are the numpy lookup's bit for bit (the same float32
operations in the same order, no fused multiply-add); values read through the online correction agree to float32
rounding of the same float64 formula (numba's scalar ``exp`` and numpy's vector loop can differ in the last bit of
a float64, which a float32 rounding almost always hides; tests/tables/test_lookup_compiled.py). Without numba
:func:`lookup_kernel` is None and the numpy lookup runs.
"""

from __future__ import annotations

import math

import numpy as np

from calib.compiled import Kernels

# what the kernel reads where a table has no online correction (typed alike; never read)
NO_CORRECTION = (np.zeros((1, 1), dtype=np.float32), np.zeros((1, 1), dtype=np.bool_),
                 np.zeros((1, 1), dtype=np.float32), np.zeros((1, 1)), np.zeros(1), 1)


def _warm_up(compiled: dict) -> None:
    x = np.full((1, 1, 2), 0.5, dtype=np.float32)
    edges = np.full((1, 1), 0.5, dtype=np.float32)
    compiled["lookup_loops"](x, edges, np.ones((1, 1), dtype=np.bool_), np.ones(1, dtype=np.int64), True, 2,
                             np.zeros((1, 4), dtype=np.float32), False, *NO_CORRECTION)


def lookup_kernel():
    """The compiled :func:`lookup_loops`, or None where numba is not installed or cannot compile it (the numpy
    lookup then runs); compiled at the first call in a process (:class:`calib.compiled.Kernels`)."""
    compiled = _KERNELS.get()
    return None if compiled is None else compiled["lookup_loops"]


def lookup_loops(x, edges, finite, strides, interpolated, points, grid, corrected, logit, keep, prior, offsets,
                 scale, width):
    """``(p, bad)``: float32 ``[B, L]`` P(accept | reached) of float32 inputs ``x [B, L, A]`` (feature 0 NaN: no
    token, NaN out), as :func:`calib.tables.layout.chain_lookup_host` computes it; ``bad`` is True (``p`` then
    unfinished) where an interpolated confidence lies outside [0, 1], which the numpy lookup refuses by name.

    ``edges`` float32 ``[A_b, E]`` and ``finite`` bool ``[A_b, E]`` (padding never counts), ``strides`` int64
    ``[A_b]``, ``grid`` float32 ``[D, C]``. With ``corrected`` the values are the online correction's
    (:meth:`calib.tables.online_tables.OnlineTables.read_host`): ``σ(logit[r, c]·scale[r] + offsets[cell, r])`` in float64,
    ``prior[r, c]`` where ``keep``; the cell is the column's block of ``width``, the last row of ``offsets`` past
    them."""
    B, L = x.shape[0], x.shape[1]
    D = grid.shape[0]
    n_binned = strides.shape[0]
    first_binned = 1 if interpolated else 0
    p = np.empty((B, L), dtype=np.float32)
    zero, one = np.float32(0.0), np.float32(1.0)
    span = np.float32(points - 1)
    for b in range(B):
        for j in range(L):
            first = x[b, j, 0]
            if math.isnan(first):
                p[b, j] = np.float32(np.nan)
                continue
            if interpolated and (first < zero or first > one):
                return p, True
            cell = 0
            for a in range(n_binned):
                v = x[b, j, first_binned + a]
                count = 0
                for e in range(edges.shape[1]):
                    if finite[a, e] and edges[a, e] <= v:
                        count += 1
                cell += count * strides[a]
            row = min(j, D - 1)
            if interpolated and points > 1:
                c = min(max(first, zero), one)
                pos = np.float32(c * span)
                lo = min(np.int64(math.floor(pos)), points - 2)
                frac = np.float32(pos - np.float32(lo))
                g_lo = _value(grid, corrected, logit, keep, prior, offsets, scale, width, row, cell + lo)
                g_hi = _value(grid, corrected, logit, keep, prior, offsets, scale, width, row, cell + lo + 1)
                p[b, j] = np.float32(g_lo + np.float32(frac * np.float32(g_hi - g_lo)))
            else:
                p[b, j] = _value(grid, corrected, logit, keep, prior, offsets, scale, width, row, cell)
    return p, False


def _value(grid, corrected, logit, keep, prior, offsets, scale, width, row, col):
    """float32: the grid's entry, or the online correction's value there."""
    if not corrected:
        return grid[row, col]
    if keep[row, col]:
        return prior[row, col]
    cell = min(col // width, offsets.shape[0] - 1)
    u = np.float64(logit[row, col]) * scale[row] + offsets[cell, row]
    return np.float32(1.0 / (1.0 + math.exp(-u)))


_KERNELS = Kernels(globals(), ("lookup_loops",), (_value,), _warm_up, "the table lookup", "the numpy lookup runs",
                   boundscheck=True)  # an index past an array raises, as numpy would
