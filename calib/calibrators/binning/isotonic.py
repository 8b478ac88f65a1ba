"""Isotonic regression per depth (scikit-learn), pooled over depths where a depth is too thin."""

from __future__ import annotations

from sklearn.isotonic import IsotonicRegression

from calib.calibrators.base import PerDepthCalibrator


class IsotonicPerDepth(PerDepthCalibrator):
    """Monotone and non-parametric: the usual choice when there are thousands of samples per depth."""

    name = "isotonic"

    def __init__(self, min_samples: int = 200):
        self.min_samples = min_samples

    def _fit_one(self, conf, y):
        return IsotonicRegression(y_min=0.0, y_max=1.0, increasing=True, out_of_bounds="clip").fit(conf, y)

    def _predict_one(self, model, conf):
        return model.predict(conf)
