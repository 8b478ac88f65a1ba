"""The raw confidence, unchanged: the baseline every calibrator is compared with."""

from __future__ import annotations

import numpy as np

from calib.calibrators.base import Calibrator, check_inputs


class Identity(Calibrator):
    name = "identity"

    def fit(self, conf, depth, y, extra=None, val=None) -> Identity:
        self._validate_params()
        check_inputs(conf, depth, y)
        self.fitted_ = True
        return self

    def predict_proba(self, conf, depth, extra=None) -> np.ndarray:
        conf, _, _, _ = check_inputs(conf, depth)
        return conf
