"""Histogram binning per depth: equal-mass bins, each predicting its (smoothed) accept rate."""

from __future__ import annotations

import numbers
from typing import ClassVar

import numpy as np

from calib.calibrators.base import Interval, PerDepthCalibrator


class HistogramBinning(PerDepthCalibrator):
    """A classic baseline (Zadrozny & Elkan). Bin edges are quantiles of the training confidences;
    a bin's value is (accepted + 2·prior·base) / (n + 2·prior), shrunk toward the depth's base rate."""

    name = "histogram"
    _parameter_constraints: ClassVar[dict] = {
        "n_bins": [Interval(numbers.Integral, 1, None)],
        "min_samples": [Interval(numbers.Integral, 1, None)],
        "prior": [Interval(numbers.Real, 0, None)],
    }

    def __init__(self, n_bins: int = 15, min_samples: int = 200, prior: float = 1.0):
        self.n_bins = n_bins
        self.min_samples = min_samples
        self.prior = prior

    def _fit_one(self, conf, y):
        edges = np.unique(np.quantile(conf, np.linspace(0, 1, self.n_bins + 1)[1:-1]))
        b = np.searchsorted(edges, conf, side="right")
        n = np.bincount(b, minlength=edges.size + 1)
        k = np.bincount(b, weights=y, minlength=edges.size + 1)
        values = (k + 2 * self.prior * y.mean()) / (n + 2 * self.prior)
        return edges, values

    def _predict_one(self, model, conf):
        edges, values = model
        return values[np.searchsorted(edges, conf, side="right")]
