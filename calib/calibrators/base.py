"""Base class and input checks shared by the calibrators: scikit-learn estimators.

Every calibrator is a scikit-learn binary classifier of "accepted at this depth | depth reached"::

    est.fit(X, y, *, val=None, groups=None) -> est   # val = (X_val, y_val); groups: one id per row (prompt)
    est.predict_proba(X) -> float64 [n, 2]            # columns: rejected, accepted (classes_ = [0, 1])
    est.accept_proba(X) -> float64 [n]                 # predict_proba(X)[:, 1]

so ``sklearn.base.clone``, ``GroupKFold``, ``cross_validate`` and the ``neg_log_loss`` scorer work on
them as they are (:mod:`calib.calibrators.selection` selects candidates that way).

``X`` is the chain's feature matrix ``[n, 1 + F]`` plus the draft depth of each row: a DataFrame with
the chain's feature names and a ``depth`` column, or an array whose last column is the depth
(:func:`with_depth` adds it). For a chain with a raw confidence (the model chain) the confidence is
column 0, then context features (netcal's convention); a calibrator on the confidence alone reads a
1-column X. Constructors store parameters only; ``fit`` validates them (against the class's declarative
``_parameter_constraints``) and its inputs, learns state in attributes ending in ``_`` and returns
``self``. A subclass implements ``_fit(X, depth, y, *, val=None, groups=None)`` and ``_predict(X, depth)``
on X without the depth column.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np
import pandas as pd
from sklearn.base import BaseEstimator, ClassifierMixin

from calib.params import Boolean, Interval, Options, Subset, validate_params  # noqa: F401 - re-exported

DEPTH = "depth"  # X's column holding each row's draft depth (0 = the first drafted token)


class NotFittedError(RuntimeError):
    pass


def with_depth(X, depth):
    """``X`` (a DataFrame, an array ``[n, F]`` or 1-D confidences ``[n]``) with each row's ``depth`` added:
    a DataFrame gets (or has replaced) its ``depth`` column, an array gets it as its last column."""
    depth = np.asarray(depth).ravel()
    if isinstance(X, pd.DataFrame):
        if len(X) != depth.size:
            raise ValueError(f"X has {len(X)} rows but depth has {depth.size} values")
        return X.assign(**{DEPTH: depth})
    X = np.asarray(X, dtype=np.float64)
    if X.ndim == 1:
        X = X[:, None]
    if X.shape[0] != depth.size:
        raise ValueError(f"X has {X.shape[0]} rows but depth has {depth.size} values")
    return np.column_stack([X, depth.astype(np.float64)])


def split_depth(X):
    """``(X without its depth, depth [n] int64)``: the ``depth`` column of a DataFrame, or an array's last
    column; a clear error when there is none, or when a depth is negative or fractional."""
    if isinstance(X, pd.DataFrame):
        if DEPTH not in X.columns:
            raise ValueError(f"X has no {DEPTH!r} column (columns: {list(map(str, X.columns))}); "
                             "add it with calib.calibrators.base.with_depth(X, depth)")
        depth, X = X[DEPTH].to_numpy(), X.drop(columns=DEPTH)
    else:
        X = np.asarray(X, dtype=np.float64)
        if X.ndim != 2 or X.shape[1] < 2:
            raise ValueError(f"X must be [n, F + 1] with the depth in its last column, got shape {X.shape}; "
                             "build it with calib.calibrators.base.with_depth(X, depth)")
        depth, X = X[:, -1], X[:, :-1]
    depth = np.asarray(depth, dtype=np.float64)
    if not np.all(np.isfinite(depth)) or not np.all(np.equal(np.mod(depth, 1), 0)):
        raise ValueError("depth must hold integers")
    if np.any(depth < 0):
        raise ValueError("depth must be >= 0")
    return X, depth.astype(np.int64)


class Calibrator(ClassifierMixin, BaseEstimator):
    """A per-depth map from a chain's features to a calibrated acceptance probability.

    ``_parameter_constraints`` maps every constructor parameter to the constraints it may satisfy
    (:class:`Options`, :class:`Interval`, :class:`Subset`, :class:`Boolean`); ``fit`` checks them
    through :meth:`_validate_params` before touching the data.
    """

    name = "calibrator"
    _parameter_constraints: ClassVar[dict] = {}
    # Whether the estimator reads X's context columns (after the confidence); those that do not
    # are functions of the confidence alone, and their table needs no marginalising over context.
    uses_context: ClassVar[bool] = False

    def _validate_params(self) -> None:
        names = set(self._get_param_names())
        unconstrained = names - set(self._parameter_constraints)
        if unconstrained:
            raise TypeError(f"{type(self).__name__}._parameter_constraints lacks {sorted(unconstrained)}")
        checked = {k: v for k, v in self._parameter_constraints.items() if v}  # []: checked where it is used
        validate_params(type(self).__name__, {k: v for k, v in self.get_params(deep=False).items() if k in checked},
                        checked)

    def fit(self, X, y, *, val=None, groups=None) -> Calibrator:
        """Fit on ``X`` (with its depth column, :func:`with_depth`) and labels ``y`` (1 = accepted).
        ``val = (X_val, y_val)`` is for early stopping where an estimator uses it; ``groups`` (one id per
        row: the prompt) for those that cross-validate (:mod:`calib.calibrators.selection`)."""
        self._validate_params()
        X, depth = split_depth(X)
        if val is not None:
            vX, vd = split_depth(val[0])
            val = (vX, vd, np.asarray(val[1]))
        if groups is not None and len(groups) != len(depth):
            raise ValueError(f"groups has {len(groups)} values, X has {len(depth)} rows")
        self._fit(X, depth, np.asarray(y), val=val, groups=None if groups is None else np.asarray(groups))
        self.classes_ = np.array([0, 1])
        return self

    def accept_proba(self, X) -> np.ndarray:
        """P(accepted at the row's depth | depth reached) ``[n]`` for ``X`` with its depth column."""
        self._check_fitted()
        X, depth = split_depth(X)
        return self._predict(X, depth)

    def predict_proba(self, X) -> np.ndarray:
        """scikit-learn's ``[n, 2]``: P(rejected), P(accepted)."""
        p = self.accept_proba(X)
        return np.column_stack([1.0 - p, p])

    def predict(self, X) -> np.ndarray:
        return (self.accept_proba(X) >= 0.5).astype(np.int64)

    def _fit(self, X, depth, y, *, val=None, groups=None) -> None:
        raise NotImplementedError

    def _predict(self, X, depth) -> np.ndarray:
        raise NotImplementedError

    def _check_fitted(self) -> None:
        if not any(k.endswith("_") and not k.startswith("_") for k in vars(self)):
            raise NotFittedError(f"{type(self).__name__} is not fitted; call fit() first")


def split_confidence(X) -> tuple[np.ndarray, np.ndarray | None]:
    """``X [n, 1 + F]`` (array, DataFrame or 1-D confidences) -> (confidence [n], context [n, F] or None)."""
    X = np.asarray(X, dtype=np.float64)
    if X.ndim <= 1:
        return X.ravel(), None
    if X.ndim != 2 or X.shape[1] < 1:
        raise ValueError(f"X must be [n, 1 + F] with the confidence in column 0, got shape {X.shape}")
    return np.ascontiguousarray(X[:, 0]), (np.ascontiguousarray(X[:, 1:]) if X.shape[1] > 1 else None)


def check_inputs(X, depth, y=None) -> tuple:
    """Validate calibrator inputs at the boundary: ``(conf, depth, y, context)`` as numpy arrays,
    ``context`` = X's columns after the confidence (None when there are none)."""
    conf, extra = split_confidence(X)
    depth = np.asarray(depth).ravel()
    if depth.shape != conf.shape:
        raise ValueError(f"conf has {conf.size} values but depth has {depth.size}")
    if not np.issubdtype(depth.dtype, np.integer):
        if not np.all(np.equal(np.mod(depth, 1), 0)):
            raise ValueError("depth must hold integers")
        depth = depth.astype(np.int64)
    if np.any(depth < 0):
        raise ValueError("depth must be >= 0")
    bad = ~np.isfinite(conf) | (conf < 0) | (conf > 1)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise ValueError(f"confidence at sample {i} is {conf[i]!r}: expected a finite value in [0, 1]")
    if y is not None:
        y = np.asarray(y).ravel()
        if y.shape != conf.shape:
            raise ValueError(f"conf has {conf.size} values but labels have {y.size}")
        if not np.isin(y, (0, 1)).all():
            raise ValueError("labels must be 0 or 1")
        y = y.astype(np.float64)
    if extra is not None and not np.isfinite(extra).all():
        raise ValueError("context features (X's columns after the confidence) must be finite")
    return conf, depth.astype(np.int64), y, extra


def logit(p, eps: float = 1e-6) -> np.ndarray:
    p = np.clip(np.asarray(p, dtype=np.float64), eps, 1 - eps)
    return np.log(p) - np.log1p(-p)


class PerDepthCalibrator(Calibrator):
    """One map per depth; a depth with fewer than ``min_samples`` samples uses the map fitted on all
    depths pooled, and depths deeper than any seen use the deepest fitted map."""

    min_samples: int

    def _fit_one(self, conf: np.ndarray, y: np.ndarray):
        raise NotImplementedError

    def _predict_one(self, model, conf: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def _fit(self, X, depth, y, *, val=None, groups=None) -> None:
        conf, depth, y, _ = check_inputs(X, depth, y)  # a function of the confidence alone
        if conf.size == 0:
            raise ValueError("no samples to fit")
        self.pooled_ = self._fit_one(conf, y)
        self.n_depths_ = int(depth.max()) + 1
        self.per_depth_ = {}
        for d in range(self.n_depths_):
            m = depth == d
            if m.sum() >= self.min_samples:
                self.per_depth_[d] = self._fit_one(conf[m], y[m])

    def _fit_one_counts(self, x: np.ndarray, k: np.ndarray, n: np.ndarray):
        raise NotImplementedError

    def fit_counts(self, depth, x, z, k, n) -> PerDepthCalibrator:
        """Fit from binned counts instead of rows (:mod:`calib.training_stats`): per bin, its ``depth``,
        mean confidence ``x``, mean logit ``z``, accepts ``k`` and samples ``n``. The same per-depth and
        pooled rule as :meth:`fit`, ``min_samples`` counting samples; equal to the row fit up to the
        spread of the confidences inside a bin."""
        self._validate_params()
        depth, x, k, n = (np.asarray(a) for a in (depth, x, k, n))
        if n.sum() == 0:
            raise ValueError("no samples to fit")
        self.pooled_ = self._fit_one_counts(x, k, n)
        self.n_depths_ = int(depth.max()) + 1
        self.per_depth_ = {}
        for d in range(self.n_depths_):
            m = depth == d
            if n[m].sum() >= self.min_samples:
                self.per_depth_[d] = self._fit_one_counts(x[m], k[m], n[m])
        self.classes_ = np.array([0, 1])
        return self

    def _predict(self, X, depth) -> np.ndarray:
        conf, depth, _, _ = check_inputs(X, depth)
        out = np.empty_like(conf)
        for d in np.unique(depth):
            m = depth == d
            model = self.per_depth_.get(min(int(d), self.n_depths_ - 1), self.pooled_)
            out[m] = self._predict_one(model, conf[m])
        return out
