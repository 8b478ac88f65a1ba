"""The online correction's elementwise kernels (:mod:`calib.tables.online`): logit and sigmoid, which
probabilities a correction moves, which positions verification judged, and the context cell cut. numpy in a
few ufunc calls each, on a step's small arrays: serving calls them every step, where a call's fixed cost
(numpy's Python wrappers: ``np.clip``, ``np.nan_to_num``, ``count_nonzero(axis=)``) outweighs the arithmetic.
Each gives the values of the plainer spelling it replaces, bit for bit (tests/tables/test_online_kernels.py).
"""

from __future__ import annotations

import numpy as np

EPS = 1e-6
FMAX = np.finfo(np.float64).max
MIN_SCALE = 0.1  # the slope's floor on 1 + β: a correction flattens the table, never reverses its order
colsum = np.add.reduce  # [B, K] -> [K] over axis 0: ndarray.sum's reduction, without its Python wrapper


def logit(p: np.ndarray) -> np.ndarray:
    q = np.minimum(np.maximum(p, EPS), 1 - EPS)  # np.clip's values (NaN kept), without its Python wrapper
    return np.log(q) - np.log1p(-q)


def verified(acc: np.ndarray) -> np.ndarray:
    """:func:`calib.tables.online.verified_mask` of float64 ``acc [B, K]`` in a few ufuncs: drafted, and
    accepted at every earlier depth."""
    reached = ~np.isnan(acc)  # [B, K]
    reached[:, 1:] &= np.logical_and.accumulate(acc[:, :-1] == 1, axis=1)
    return reached


def moved(p: np.ndarray) -> np.ndarray:
    """``~kept(p)``: a probability strictly inside (0, 1) (NaN compares false)."""
    return (p > 0) & (p < 1)


def sigmoid(u: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-u))


def kept(p: np.ndarray) -> np.ndarray:
    """Where a probability is never corrected: NaN (no token), 0 or 1 (a certainty the table states)."""
    return np.isnan(p) | (p <= 0) | (p >= 1)


def corrected(p: np.ndarray, scale: np.ndarray, offset: np.ndarray) -> np.ndarray:
    """``σ(scale·logit p + offset)`` where ``p`` is a probability strictly inside (0, 1); NaN, 0 and 1 kept."""
    return np.where(moved(p), sigmoid(logit(p) * scale + offset), p)


def edge_grid(edges) -> tuple[np.ndarray, np.ndarray]:
    """:func:`cut`'s precomputed axes of context ``edges`` (one list per axis): each axis's edges NaN-padded to
    one width ``[A, E]`` (``x >= NaN`` never holds: a pad counts for nothing) and each axis's stride in the
    cell index ``[A]`` (the last axis varies fastest, the table's strides)."""
    widest = max((len(e) for e in edges), default=0)
    grid = np.array([list(e) + [np.nan] * (widest - len(e)) for e in edges], dtype=np.float64)
    strides = [int(np.prod([len(f) + 1 for f in edges[a + 1:]])) for a in range(len(edges))]
    return grid.reshape(len(edges), widest), np.array(strides, dtype=np.int64)


def cut(values: np.ndarray, grid: np.ndarray, strides: np.ndarray) -> np.ndarray:
    """Context cell ``[B]`` (int64) of float64 context values ``[B, A]`` on :func:`edge_grid`'s axes: the cells
    of :func:`calib.calibrators.context.context_cells` (an axis's bucket is the number of its edges at or below
    the value) in one comparison instead of a loop over the axes."""
    # np.nan_to_num(values, nan=-inf)'s values, without its wrapper: ±inf to ±max first, then NaN to -inf
    values = np.fmax(np.maximum(np.minimum(values, FMAX), -FMAX), -np.inf)  # [B, A]
    bucket = np.add.reduce(values[:, :, None] >= grid, axis=2, dtype=np.int64)  # [B, A]
    return bucket @ strides
