"""The raw confidence, unchanged: the baseline every calibrator is compared with."""

from __future__ import annotations

import numpy as np

from calib.calibrators.base import Calibrator, check_inputs


class Identity(Calibrator):
    name = "identity"

    def fit(self, X, depth, y, *, val=None) -> Identity:
        self._validate_params()
        check_inputs(X, depth, y)
        self.fitted_ = True
        return self

    def predict_proba(self, X, depth) -> np.ndarray:
        conf, _, _, _ = check_inputs(X, depth)
        return conf
