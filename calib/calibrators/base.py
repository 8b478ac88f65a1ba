"""Base class and input checks shared by the calibrators (scikit-learn conventions).

Constructors store parameters only; ``fit`` validates its inputs, learns state in attributes ending
in ``_`` and returns ``self``; ``predict_proba`` returns P(accept at depth | reached depth).
"""

from __future__ import annotations

import inspect

import numpy as np


class NotFittedError(RuntimeError):
    pass


class Calibrator:
    """A per-depth map from a drafter's raw confidence to a calibrated acceptance probability."""

    name = "calibrator"

    def get_params(self) -> dict:
        sig = inspect.signature(type(self).__init__)
        return {k: getattr(self, k) for k in sig.parameters if k != "self"}

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.get_params().items())
        return f"{type(self).__name__}({args})"

    def fit(self, conf, depth, y, extra=None, val=None) -> Calibrator:
        raise NotImplementedError

    def predict_proba(self, conf, depth, extra=None) -> np.ndarray:
        raise NotImplementedError

    def _check_fitted(self) -> None:
        if not any(k.endswith("_") and not k.startswith("_") for k in vars(self)):
            raise NotFittedError(f"{type(self).__name__} is not fitted; call fit() first")


def check_inputs(conf, depth, y=None, extra=None) -> tuple:
    """Validate calibrator inputs at the boundary; return float/int numpy arrays."""
    conf = np.asarray(conf, dtype=np.float64).ravel()
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
    if extra is not None:
        extra = np.asarray(extra, dtype=np.float64)
        if extra.ndim == 1:
            extra = extra[:, None]
        if extra.shape[0] != conf.size:
            raise ValueError(f"extra has {extra.shape[0]} rows, conf has {conf.size}")
        if not np.isfinite(extra).all():
            raise ValueError("extra inputs must be finite")
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

    def fit(self, conf, depth, y, extra=None, val=None):
        conf, depth, y, _ = check_inputs(conf, depth, y)
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

    def predict_proba(self, conf, depth, extra=None) -> np.ndarray:
        self._check_fitted()
        conf, depth, _, _ = check_inputs(conf, depth)
        out = np.empty_like(conf)
        for d in np.unique(depth):
            m = depth == d
            model = self.per_depth_.get(min(int(d), self.n_depths_ - 1), self.pooled_)
            out[m] = self._predict_one(model, conf[m])
        return out
