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

    def _fit_one_counts(self, x, k, n):
        """Edges: quantiles of the bins' mean confidences weighted by their counts (inverted CDF: an edge
        falls on a bin's mean where the row fit's falls inside that bin); values from the counts."""
        levels = np.linspace(0, 1, self.n_bins + 1)[1:-1]
        edges = np.unique(np.quantile(x, levels, weights=n, method="inverted_cdf")) if levels.size else np.zeros(0)
        b = np.searchsorted(edges, x, side="right")
        nb = np.bincount(b, weights=n, minlength=edges.size + 1)
        kb = np.bincount(b, weights=k, minlength=edges.size + 1)
        values = (kb + 2 * self.prior * k.sum() / n.sum()) / (nb + 2 * self.prior)
        return edges, values

    def _predict_one(self, model, conf):
        edges, values = model
        return values[np.searchsorted(edges, conf, side="right")]
