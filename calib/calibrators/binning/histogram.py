"""Histogram binning per depth: equal-mass bins, each predicting its (smoothed) accept rate."""

from __future__ import annotations

import numpy as np

from calib.calibrators.base import Calibrator, check_inputs


class HistogramBinning(Calibrator):
    """A classic baseline (Zadrozny & Elkan). Bin edges are quantiles of the training confidences;
    a bin's value is (accepted + prior) / (n + 2·prior) toward the depth's base rate."""

    name = "histogram"

    def __init__(self, n_bins: int = 15, min_samples: int = 200, prior: float = 1.0):
        self.n_bins = n_bins
        self.min_samples = min_samples
        self.prior = prior

    def _fit_one(self, conf, y):
        qs = np.quantile(conf, np.linspace(0, 1, self.n_bins + 1)[1:-1])
        edges = np.unique(qs)
        b = np.searchsorted(edges, conf, side="right")
        n = np.bincount(b, minlength=edges.size + 1)
        k = np.bincount(b, weights=y, minlength=edges.size + 1)
        base = y.mean()
        values = (k + 2 * self.prior * base) / (n + 2 * self.prior)
        return edges, values

    def fit(self, conf, depth, y, extra=None, val=None) -> HistogramBinning:
        conf, depth, y, _ = check_inputs(conf, depth, y)
        if conf.size == 0:
            raise ValueError("no samples to fit")
        self.pooled_ = self._fit_one(conf, y)
        self.per_depth_ = {}
        for d in range(int(depth.max()) + 1):
            m = depth == d
            if m.sum() >= self.min_samples:
                self.per_depth_[d] = self._fit_one(conf[m], y[m])
        self.n_depths_ = int(depth.max()) + 1
        return self

    def predict_proba(self, conf, depth, extra=None) -> np.ndarray:
        self._check_fitted()
        conf, depth, _, _ = check_inputs(conf, depth)
        out = np.empty_like(conf)
        for d in np.unique(depth):
            m = depth == d
            edges, values = self.per_depth_.get(min(int(d), self.n_depths_ - 1), self.pooled_)
            out[m] = values[np.searchsorted(edges, conf[m], side="right")]
        return out
