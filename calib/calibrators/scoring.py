"""Scores used to select and summarise calibrators (NLL for selection, ECE/Brier to report)."""

from __future__ import annotations

import numpy as np

EPS = 1e-12


def nll(p, y) -> float:
    """Mean negative log-likelihood; probabilities of exactly 0/1 are clipped, not dropped."""
    p = np.clip(np.asarray(p, dtype=np.float64), EPS, 1 - EPS)
    y = np.asarray(y, dtype=np.float64)
    return float(-np.mean(y * np.log(p) + (1 - y) * np.log1p(-p))) if p.size else float("nan")


def brier(p, y) -> float:
    p, y = np.asarray(p, dtype=np.float64), np.asarray(y, dtype=np.float64)
    return float(np.mean((p - y) ** 2)) if p.size else float("nan")


def ece(p, y, n_bins: int = 15) -> float:
    """Expected calibration error with equal-width bins on [0, 1]; p = 1.0 falls in the last bin."""
    p, y = np.asarray(p, dtype=np.float64), np.asarray(y, dtype=np.float64)
    if not p.size:
        return float("nan")
    bins = np.clip((p * n_bins).astype(np.int64), 0, n_bins - 1)
    count = np.bincount(bins, minlength=n_bins)
    gap = np.abs(np.bincount(bins, weights=p, minlength=n_bins) - np.bincount(bins, weights=y, minlength=n_bins))
    return float(gap.sum() / p.size)


def summary(p, y) -> dict:
    return {"n": int(np.size(p)), "nll": nll(p, y), "brier": brier(p, y), "ece": ece(p, y)}
