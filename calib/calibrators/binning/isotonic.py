"""Isotonic regression per depth (scikit-learn), pooled over depths where a depth is too thin."""

from __future__ import annotations

import numbers
from typing import ClassVar

import numpy as np
from sklearn.isotonic import IsotonicRegression

from calib.calibrators.base import Interval, PerDepthCalibrator


class IsotonicPerDepth(PerDepthCalibrator):
    """Monotone and non-parametric: the usual choice when there are thousands of samples per depth.

    Its end blocks often hold only accepts or only rejects; ``clip`` keeps predictions inside
    [clip, 1 - clip] so that one surprise costs a bounded log-loss instead of ~16 nats.
    """

    name = "isotonic"
    _parameter_constraints: ClassVar[dict] = {
        "min_samples": [Interval(numbers.Integral, 1, None)],
        "clip": [Interval(numbers.Real, 0, 0.5, closed="left")],
    }

    def __init__(self, min_samples: int = 200, clip: float = 1e-3):
        self.min_samples = min_samples
        self.clip = clip

    def _fit_one(self, conf, y):
        return IsotonicRegression(y_min=self.clip, y_max=1.0 - self.clip, increasing=True,
                                  out_of_bounds="clip").fit(conf, y)

    def _fit_one_counts(self, x, k, n):
        """Weighted isotonic regression on the bins' mean confidences and accept rates (PAV on bins)."""
        order = np.argsort(x, kind="stable")
        return IsotonicRegression(y_min=self.clip, y_max=1.0 - self.clip, increasing=True,
                                  out_of_bounds="clip").fit(x[order], (k / n)[order], sample_weight=n[order])

    def _predict_one(self, model, conf):
        return model.predict(conf)
