"""The raw confidence, unchanged: the baseline every calibrator is compared with."""

from __future__ import annotations

import numpy as np

from calib.calibrators.base import Calibrator, check_inputs


class Identity(Calibrator):
    name = "identity"

    def _fit(self, X, depth, y, *, val=None, groups=None) -> None:
        check_inputs(X, depth, y)
        self.fitted_ = True

    def fit_counts(self, depth, x, z, k, n) -> Identity:
        """Nothing to learn from counts either (:mod:`calib.training_stats`)."""
        self.fitted_ = True
        self.classes_ = np.array([0, 1])
        return self

    def _predict(self, X, depth) -> np.ndarray:
        conf, _, _, _ = check_inputs(X, depth)
        return conf
