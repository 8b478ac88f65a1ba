"""Isotonic regression per depth (scikit-learn), pooled over depths where a depth is too thin."""

from __future__ import annotations

import numpy as np
from sklearn.isotonic import IsotonicRegression

from calib.calibrators.base import Calibrator, check_inputs


class IsotonicPerDepth(Calibrator):
    """Monotone, non-parametric; a depth with fewer than ``min_samples`` samples uses the pooled fit.

    Depths deeper than any seen in training use the deepest fitted map.
    """

    name = "isotonic"

    def __init__(self, min_samples: int = 200):
        self.min_samples = min_samples

    def fit(self, conf, depth, y, extra=None, val=None) -> IsotonicPerDepth:
        conf, depth, y, _ = check_inputs(conf, depth, y)
        if conf.size == 0:
            raise ValueError("no samples to fit")
        make = lambda: IsotonicRegression(y_min=0.0, y_max=1.0, increasing=True, out_of_bounds="clip")  # noqa: E731
        self.pooled_ = make().fit(conf, y)
        self.per_depth_ = {}
        for d in range(int(depth.max()) + 1):
            m = depth == d
            if m.sum() >= self.min_samples:
                self.per_depth_[d] = make().fit(conf[m], y[m])
        self.n_depths_ = int(depth.max()) + 1
        return self

    def _model(self, d: int):
        return self.per_depth_.get(min(d, self.n_depths_ - 1), self.pooled_)

    def predict_proba(self, conf, depth, extra=None) -> np.ndarray:
        self._check_fitted()
        conf, depth, _, _ = check_inputs(conf, depth)
        out = np.empty_like(conf)
        for d in np.unique(depth):
            m = depth == d
            out[m] = self._model(int(d)).predict(conf[m])
        return out
