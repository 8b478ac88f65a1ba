"""Base class and input checks shared by the calibrators (scikit-learn conventions).

Constructors store parameters only; ``fit`` validates its parameters (against the class's
declarative ``_parameter_constraints``) and its inputs, learns state in attributes ending in ``_``
and returns ``self``; ``predict_proba`` returns P(accept at depth | reached depth).

One protocol for every chain kind (:mod:`calib.chains`)::

    est.fit(X, depth, y, *, val=None) -> est        # val = (X_val, depth_val, y_val)
    est.predict_proba(X, depth) -> float64 [n]

``X`` is the chain's feature matrix ``[n, F]`` (a DataFrame with the chain's feature names, or an
array in that column order). For a chain with a raw confidence (the model chain) it is column 0,
then context features (netcal's convention); a 1-D ``X`` is the confidence alone.
"""

from __future__ import annotations

import inspect
from typing import ClassVar

import numpy as np

from calib.params import Boolean, Interval, Options, Subset, validate_params  # noqa: F401 - re-exported


class NotFittedError(RuntimeError):
    pass


class Calibrator:
    """A per-depth map from a drafter's raw confidence to a calibrated acceptance probability.

    ``_parameter_constraints`` maps every constructor parameter to the constraints it may satisfy
    (:class:`Options`, :class:`Interval`, :class:`Subset`, :class:`Boolean`); ``fit`` checks them
    through :meth:`_validate_params` before touching the data.
    """

    name = "calibrator"
    _parameter_constraints: ClassVar[dict] = {}
    # Whether the estimator reads X's context columns (after the confidence); those that do not
    # are functions of the confidence alone, and their table needs no marginalising over context.
    uses_context: ClassVar[bool] = False

    @classmethod
    def _get_param_names(cls) -> list[str]:
        """The constructor's parameters (none for a class without its own ``__init__``)."""
        init = cls.__init__
        if init is object.__init__:
            return []
        params = [p for p in inspect.signature(init).parameters.values() if p.name != "self"]
        varargs = [p.name for p in params if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        if varargs:
            raise TypeError(f"{cls.__name__}.__init__ takes *{varargs[0]}: calibrators list their "
                            "parameters explicitly (scikit-learn convention)")
        return [p.name for p in params]

    def get_params(self) -> dict:
        return {k: getattr(self, k) for k in self._get_param_names()}

    def _validate_params(self) -> None:
        names = set(self._get_param_names())
        unconstrained = names - set(self._parameter_constraints)
        if unconstrained:
            raise TypeError(f"{type(self).__name__}._parameter_constraints lacks {sorted(unconstrained)}")
        validate_params(type(self).__name__, self.get_params(), self._parameter_constraints)

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.get_params().items())
        return f"{type(self).__name__}({args})"

    def fit(self, X, depth, y, *, val=None) -> Calibrator:
        raise NotImplementedError

    def predict_proba(self, X, depth) -> np.ndarray:
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

    def fit(self, X, depth, y, *, val=None):
        self._validate_params()
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
        return self

    def predict_proba(self, X, depth) -> np.ndarray:
        self._check_fitted()
        conf, depth, _, _ = check_inputs(X, depth)
        out = np.empty_like(conf)
        for d in np.unique(depth):
            m = depth == d
            model = self.per_depth_.get(min(int(d), self.n_depths_ - 1), self.pooled_)
            out[m] = self._predict_one(model, conf[m])
        return out
