"""One estimator per context cell: what a table cut by context axes (temperature, ...) holds.

:class:`PerContextCell` wraps any estimator of the one protocol (:mod:`calib.calibrators.base`). ``X``
holds the chain's own features (its first ``n_own`` columns), then one column per context axis, then
any other named feature; the wrapped estimator reads every column but the context ones; a sample's *cell* is the mixed-radix number of its context buckets
(bucket = number of edges <= value, NaN -> 0: the table lookup's rule, so the fit and the exported
table agree on every sample's cell). A clone of the estimator is fitted per cell holding at least
``min_samples`` training samples of both labels; thinner cells, and cells no training sample
reached, use the estimator fitted on every cell pooled (the shrinkage that keeps a thin cell from
being a noisy one). The exported table stays monotone in confidence per cell (the model chain's
grid is isotonic-projected cell by cell, :mod:`calib.tables.export`).
"""

from __future__ import annotations

import numbers
from typing import ClassVar

import numpy as np
from sklearn.base import clone

from calib.calibrators.base import Calibrator, Interval, with_depth


def context_cells(ctx: np.ndarray, edges) -> np.ndarray:
    """Cell index [n] of context values ``ctx [n, A]`` cut by ``edges`` (one list per axis); the last
    axis varies fastest (the table's strides)."""
    cell = np.zeros(len(ctx), dtype=np.int64)
    for a, e in enumerate(edges):
        e = np.asarray(e, dtype=np.float64)
        b = (np.nan_to_num(ctx[:, a], nan=-np.inf)[:, None] >= e[None, :]).sum(axis=1) if e.size else 0
        cell = cell * (e.size + 1) + b
    return cell


def _rows(X, m):
    return X[m] if not hasattr(X, "iloc") else X.iloc[np.flatnonzero(m)]


def _own(X, n_own: int, n_ctx: int):
    """X without its context columns (``n_ctx`` of them after the first ``n_own``): what the wrapped
    estimator reads (the chain's own features, then any named feature read after the context)."""
    if hasattr(X, "iloc"):
        return X.drop(columns=X.columns[n_own: n_own + n_ctx])
    X = np.asarray(X)
    return np.delete(X, np.s_[n_own: n_own + n_ctx], axis=1) if X.ndim == 2 else X


def _ctx(X, n_own: int, n_ctx: int) -> np.ndarray:
    a = X.to_numpy(np.float64) if hasattr(X, "to_numpy") else np.asarray(X, dtype=np.float64)
    return a[:, n_own: n_own + n_ctx] if a.ndim == 2 else np.zeros((len(a), 0))


class PerContextCell(Calibrator):
    """``estimator`` fitted per context cell (see the module docstring)."""

    name = "per_context_cell"
    _parameter_constraints: ClassVar[dict] = {
        "estimator": [],  # any estimator of the protocol; checked by duck typing in fit
        "n_own": [Interval(numbers.Integral, 1, None)],
        "edges": [],
        "min_samples": [Interval(numbers.Integral, 1, None)],
    }

    def __init__(self, estimator, n_own: int = 1, edges=(), min_samples: int = 500):
        self.estimator = estimator
        self.n_own = n_own
        self.edges = edges
        self.min_samples = min_samples

    @property
    def uses_context(self) -> bool:  # of the wrapped estimator: context the table marginalises over
        return bool(getattr(self.estimator, "uses_context", False))

    @property
    def n_cells(self) -> int:
        return int(np.prod([len(e) + 1 for e in self.edges])) if len(self.edges) else 1

    def _validate(self) -> None:
        for name in ("n_own", "min_samples"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 1:
                raise ValueError(f"PerContextCell: parameter {name}={v!r} is invalid; it must be an integer >= 1")
        if not (hasattr(self.estimator, "fit") and hasattr(self.estimator, "predict_proba")):
            raise ValueError(f"PerContextCell: estimator {self.estimator!r} has no fit/predict_proba")

    def _fit(self, X, depth, y, *, val=None, groups=None) -> None:
        self._validate()
        depth, y = np.asarray(depth), np.asarray(y)
        cell = context_cells(_ctx(X, self.n_own, len(self.edges)), self.edges)
        if val is not None:
            vX, vd, vy = val
            vcell = context_cells(_ctx(vX, self.n_own, len(self.edges)), self.edges)
        self.cells_ = {}
        self.cell_samples_ = np.bincount(cell, minlength=self.n_cells).tolist()
        thin = [c for c in range(self.n_cells)
                if self.cell_samples_[c] < self.min_samples or len(np.unique(y[cell == c])) < 2]
        # The pooled fit is only needed where a cell has none of its own (it costs a full fit).
        self.pooled_ = None if not thin else clone(self.estimator).fit(
            with_depth(_own(X, self.n_own, len(self.edges)), depth), y, groups=groups,
            val=None if val is None else (with_depth(_own(vX, self.n_own, len(self.edges)), vd), np.asarray(vy)))
        for c in range(self.n_cells):
            m = cell == c
            if c in thin:
                continue  # thin: the pooled fit stands for it
            cv = None
            if val is not None:
                vm = vcell == c
                if vm.any():
                    cv = (with_depth(_own(_rows(vX, vm), self.n_own, len(self.edges)), np.asarray(vd)[vm]), np.asarray(vy)[vm])
            self.cells_[c] = clone(self.estimator).fit(
                with_depth(_own(_rows(X, m), self.n_own, len(self.edges)), depth[m]), y[m], val=cv,
                groups=None if groups is None else groups[m])

    def cell_estimator(self, c: int):
        """The estimator standing for context cell ``c`` (its own, or the pooled one)."""
        self._check_fitted()
        return self.cells_.get(int(c), self.pooled_)

    def _predict(self, X, depth) -> np.ndarray:
        depth = np.asarray(depth)
        cell = context_cells(_ctx(X, self.n_own, len(self.edges)), self.edges)
        out = np.empty(len(depth), dtype=np.float64)
        for c in np.unique(cell):
            m = cell == c
            out[m] = self.cell_estimator(c).accept_proba(with_depth(_own(_rows(X, m), self.n_own, len(self.edges)), depth[m]))
        return out
