"""Calibration metrics for binary outcomes (accept / reject at one depth), and accepted-length error.

Shared by train.py (model selection on NLL, the summary) and eval.py (the full report).

Conventions (chosen to agree with ``sklearn.calibration.calibration_curve``):

* Equal-width bins are right-closed ``(a, b]`` over ``[0, 1]``, except that a confidence of exactly
  0 lands in the first bin and exactly 1 in the last. Implementations that bin with
  ``floor(p * n)`` or ``np.digitize(p, edges)`` put ``p = 1`` into a non-existent bin ``n`` and
  drop or mis-count it — exactly the samples a saturated drafter produces most.
* Equal-mass bins take quantile edges of the confidences; tied confidences share a bin.
* ECE is the sample-weighted mean ``|mean label − mean confidence|`` over non-empty bins (L1);
  MCE the largest such gap. The *debiased* estimator (Kumar, Liang & Ma 2019) is the L2 version
  with each bin's sampling variance ``ȳ(1−ȳ)/(n_b−1)`` subtracted, reported as ``sqrt(max(·, 0))``:
  on a perfectly calibrated sample it is ≈ 0 where the plug-in ECE stays ≈ sqrt(bins / n) > 0.
* NLL uses ``xlogy`` so that ``0·log 0 = 0`` (a confidence of exactly 1 on an accepted token costs
  nothing instead of NaN) and clips confidences to ``[eps, 1 − eps]`` so that one confident miss
  costs ``−log eps`` instead of making the mean infinite.

All functions take 1-D arrays ``p`` (confidence of acceptance) and ``y`` (0/1 labels) and optional
per-sample ``weight`` (bootstrap counts).
"""

from __future__ import annotations

import numpy as np
from scipy.special import xlogy

NLL_EPS = 1e-7


def equal_width_bins(p: np.ndarray, n_bins: int) -> np.ndarray:
    """Bin index per sample, ``(a, b]`` bins on [0, 1]; 0 -> first bin, 1 -> last (as sklearn)."""
    inner = np.linspace(0.0, 1.0, n_bins + 1)[1:-1]
    return np.searchsorted(inner, np.clip(p, 0.0, 1.0), side="left")


def equal_mass_bins(p: np.ndarray, n_bins: int) -> np.ndarray:
    """Bin index per sample with quantile edges (about n / n_bins samples each; ties stay together)."""
    if p.size == 0:
        return np.zeros(0, dtype=np.int64)
    inner = np.unique(np.quantile(p, np.linspace(0.0, 1.0, n_bins + 1)[1:-1]))
    return np.searchsorted(inner, p, side="left")


def bin_stats(p, y, bins, n_bins, weight=None):
    """Per-bin (count, mean confidence, mean label); empty bins have count 0 and NaN means."""
    w = np.ones_like(p, dtype=np.float64) if weight is None else np.asarray(weight, np.float64)
    count = np.bincount(bins, weights=w, minlength=n_bins)
    s_p = np.bincount(bins, weights=w * p, minlength=n_bins)
    s_y = np.bincount(bins, weights=w * y, minlength=n_bins)
    with np.errstate(invalid="ignore", divide="ignore"):
        return count, s_p / count, s_y / count


def _ece_from_bins(p, y, bins, n_bins, weight=None) -> tuple[float, float]:
    count, conf, acc = bin_stats(p, y, bins, n_bins, weight)
    nz = count > 0
    if not nz.any():
        return float("nan"), float("nan")
    gap = np.abs(acc[nz] - conf[nz])
    return float(np.sum(count[nz] * gap) / np.sum(count[nz])), float(gap.max())


ECE_BINS = 15  # one binning convention: tables, report and figures (equal-width bins)


def ece(p, y, n_bins: int = ECE_BINS, weight=None) -> float:
    """Expected calibration error, equal-width bins (L1, sample-weighted)."""
    p, y = _arrays(p, y)
    return _ece_from_bins(p, y, equal_width_bins(p, n_bins), n_bins, weight)[0]


def ece_if_calibrated(p, n_bins: int = 15, n_sim: int = 200, seed: int = 0) -> tuple[float, float]:
    """(mean, 95th percentile) of :func:`ece` for a *perfectly calibrated* predictor with these
    predictions: labels drawn as Bernoulli(p) ``n_sim`` times. The plug-in ECE of a finite sample is
    biased upward; this is the level below which a measured ECE cannot be told from perfect
    calibration at this sample size and binning."""
    p = np.clip(np.asarray(p, dtype=np.float64).ravel(), 0.0, 1.0)
    if p.size == 0:
        return float("nan"), float("nan")
    bins = equal_width_bins(p, n_bins)
    s_p = np.bincount(bins, weights=p, minlength=n_bins)
    rng = np.random.default_rng(seed)
    out = np.empty(n_sim)
    chunk = max(1, int(2e7 // p.size))  # simulations per block: ~20M label draws in memory at once
    for a in range(0, n_sim, chunk):
        y = rng.random((min(chunk, n_sim - a), p.size)) < p  # [sims, n]
        s_y = np.stack([np.bincount(bins, weights=row, minlength=n_bins) for row in y])  # [sims, bins]
        out[a:a + len(y)] = np.abs(s_y - s_p).sum(axis=1) / p.size  # sum_b n_b |acc_b - conf_b| / n
    return float(out.mean()), float(np.quantile(out, 0.95))


def ece_equal_mass(p, y, n_bins: int = 15) -> float:
    p, y = _arrays(p, y)
    bins = equal_mass_bins(p, n_bins)
    return _ece_from_bins(p, y, bins, int(bins.max(initial=0)) + 1)[0]


def mce(p, y, n_bins: int = 15) -> float:
    """Maximum calibration error over non-empty equal-width bins."""
    p, y = _arrays(p, y)
    return _ece_from_bins(p, y, equal_width_bins(p, n_bins), n_bins)[1]


def ece_debiased(p, y, n_bins: int = 15) -> float:
    """Debiased L2 calibration error (Kumar et al. 2019), equal-mass bins, ``sqrt(max(·, 0))``."""
    p, y = _arrays(p, y)
    if p.size == 0:
        return float("nan")
    bins = equal_mass_bins(p, n_bins)
    count, conf, acc = bin_stats(p, y, bins, int(bins.max(initial=0)) + 1)
    nz = count > 1  # a one-sample bin has no variance estimate; it carries no debiased evidence
    if not nz.any():
        return float("nan")
    sq = (acc[nz] - conf[nz]) ** 2 - acc[nz] * (1.0 - acc[nz]) / (count[nz] - 1.0)
    return float(np.sqrt(max(np.sum(count[nz] * sq) / p.size, 0.0)))


def brier(p, y) -> float:
    p, y = _arrays(p, y)
    return float(np.mean((p - y) ** 2)) if p.size else float("nan")


def nll(p, y, eps: float = NLL_EPS) -> float:
    p, y = _arrays(p, y)
    if p.size == 0:
        return float("nan")
    q = np.clip(p, eps, 1.0 - eps)
    return float(-np.mean(xlogy(y, q) + xlogy(1.0 - y, 1.0 - q)))


def auroc(p, y) -> float:
    """Area under the ROC curve; NaN when only one class is present (it is undefined then)."""
    p, y = _arrays(p, y)
    if p.size == 0 or y.min() == y.max():
        return float("nan")
    from sklearn.metrics import roc_auc_score

    return float(roc_auc_score(y, p))


ECE_CI_METHODS = ("recentred", "percentile", "basic", "bc")
ECE_CI_DESCRIPTION = (
    "percentile bootstrap interval re-centred on the estimate (whole prompts resampled): the "
    "replicates' median shift above the estimate, which is the plug-in ECE's upward noise bias applied a "
    "second time by resampling, is removed, so the interval keeps the replicates' spread and contains the "
    "estimate by construction")


def ece_bootstrap_replicates(p, y, groups, n_bins: int = 15, n_boot: int = 200, seed: int = 0) -> np.ndarray:
    """Equal-width ECE of ``n_boot`` replicates that resample whole groups (prompts) with replacement.

    Samples of one prompt are correlated (same text, same drafter state), so resampling rows would
    understate the spread. Each replicate draws group multiplicities and re-weights the samples (bins
    are those of the original sample: a confidence never changes bin). Non-finite replicates dropped.
    """
    p, y = _arrays(p, y)
    if p.size == 0:
        return np.zeros(0)
    _, gid = np.unique(np.asarray(groups), return_inverse=True)
    n_groups = int(gid.max()) + 1
    rng = np.random.default_rng(seed)
    bins = equal_width_bins(p, n_bins)
    draws = rng.multinomial(n_groups, np.full(n_groups, 1.0 / n_groups), size=n_boot)
    vals = np.array([_ece_from_bins(p, y, bins, n_bins, weight=draws[b][gid])[0] for b in range(n_boot)])
    return vals[np.isfinite(vals)]


def ece_bootstrap_ci(p, y, groups, n_bins: int = 15, n_boot: int = 200, level: float = 0.95,
                     seed: int = 0, method: str = "recentred") -> tuple[float, float]:
    """Bootstrap CI of the equal-width ECE, resampling whole groups (prompts); see ``ECE_CI_METHODS``.

    Why not the plain percentile interval: the plug-in ECE sums ``|gap|`` per bin, so sampling noise
    only ever adds to it, and a resample (which duplicates some prompts and drops others) adds that
    noise again. The replicates therefore sit *above* the estimate by about the estimator's own bias;
    on a nearly calibrated slice all of them can, and the percentile interval ``[q_lo, q_hi]`` then
    excludes its estimate (4 of 120 rows of the shipped banks). The textbook corrections do not help:
    the basic interval ``[2θ̂ − q_hi, 2θ̂ − q_lo]`` and the bias-corrected (BC) percentile interval
    contain ``θ̂`` under exactly the same condition as the percentile one (``θ̂`` between ``q_lo`` and
    ``q_hi``, resp. ``z0 = Φ⁻¹(share below θ̂)`` within ±z): both correct for the bias *twice*, moving
    the interval towards the true (smaller) ECE and away from the estimate.

    ``method``:

    * ``"recentred"`` (default): ``[θ̂ − (m − q_lo), θ̂ + (q_hi − m)]`` with ``m`` the replicates'
      median, lower end clipped at 0. The resampling bias ``m − θ̂`` is removed once; the interval keeps
      the percentile interval's width and asymmetry and contains ``θ̂`` by construction (``q_lo ≤ m ≤
      q_hi``, ``θ̂ ≥ 0``). It describes the sampling spread of the reported ECE; where the true
      calibration error lies is what ``ece_debiased`` estimates.
    * ``"percentile"``: ``[q_lo, q_hi]`` (what ``ece_ci`` was before issue 13).
    * ``"basic"``: ``[2θ̂ − q_hi, 2θ̂ − q_lo]``, clipped at 0.
    * ``"bc"``: Efron's bias-corrected percentile interval, quantile levels ``Φ(2 z0 ± z)``.
    """
    if method not in ECE_CI_METHODS:
        raise ValueError(f"method={method!r}: expected one of {ECE_CI_METHODS}")
    p, y = _arrays(p, y)
    vals = ece_bootstrap_replicates(p, y, groups, n_bins, n_boot, seed)
    est = ece(p, y, n_bins)
    if vals.size == 0 or not np.isfinite(est):
        return float("nan"), float("nan")
    a = (1 - level) / 2
    lo, hi = np.quantile(vals, [a, 1 - a])
    if method == "percentile":
        return float(lo), float(hi)
    if method == "basic":
        return float(max(2 * est - hi, 0.0)), float(max(2 * est - lo, 0.0))
    if method == "bc":
        from scipy.stats import norm

        share = np.clip(np.mean(vals < est) + 0.5 * np.mean(vals == est), 0.5 / vals.size, 1 - 0.5 / vals.size)
        z0, z = norm.ppf(share), norm.ppf(1 - a)
        lo, hi = np.quantile(vals, norm.cdf([2 * z0 - z, 2 * z0 + z]))
        return float(lo), float(hi)
    m = float(np.median(vals))
    return float(max(est - (m - lo), 0.0)), float(est + (hi - m))


def reliability(p, y, n_bins: int = 15):
    """(bin centres, mean confidence, mean label, count) over equal-width bins, for plots."""
    p, y = _arrays(p, y)
    count, conf, acc = bin_stats(p, y, equal_width_bins(p, n_bins), n_bins)
    centres = (np.arange(n_bins) + 0.5) / n_bins
    return centres, conf, acc, count


def calibration_summary(p, y, groups=None, n_bins: int = 15, n_boot: int = 200, seed: int = 0) -> dict:
    """Every per-slice calibration number metrics.json reports."""
    p, y = _arrays(p, y)
    out = {"n": int(p.size), "ece": ece(p, y, n_bins), "ece_equal_mass": ece_equal_mass(p, y, n_bins),
           "ece_debiased": ece_debiased(p, y, n_bins), "mce": mce(p, y, n_bins), "brier": brier(p, y),
           "nll": nll(p, y), "auroc": auroc(p, y), "mean_conf": float(p.mean()) if p.size else float("nan"),
           "accept_rate": float(y.mean()) if y.size else float("nan")}
    ci = ece_bootstrap_ci(p, y, groups if groups is not None else np.arange(p.size), n_bins, n_boot,
                          seed=seed) if n_boot > 0 else (float("nan"), float("nan"))
    out["ece_ci"] = list(ci)
    return out


def expected_accepted_length(p: np.ndarray) -> np.ndarray:
    """Σ_k Π_{j≤k} p_j per row of conditional probabilities ``[R, K]``; a chain ends at its first NaN."""
    p = np.asarray(p, dtype=np.float64)
    present = ~np.isnan(p)
    in_chain = np.cumprod(present, axis=1).astype(bool)
    surv = np.cumprod(np.where(in_chain, np.clip(np.nan_to_num(p), 0.0, 1.0), 0.0), axis=1)
    return surv.sum(axis=1)


def accept_length_summary(predicted, actual) -> dict:
    predicted, actual = np.asarray(predicted, np.float64), np.asarray(actual, np.float64)
    if predicted.size == 0:
        return {"n": 0, "predicted_mean": float("nan"), "actual_mean": float("nan"), "bias": float("nan"),
                "mae": float("nan"), "pearson": float("nan")}
    pear = (float(np.corrcoef(predicted, actual)[0, 1])
            if predicted.size > 1 and predicted.std() > 0 and actual.std() > 0 else float("nan"))
    return {"n": int(predicted.size), "predicted_mean": float(predicted.mean()),
            "actual_mean": float(actual.mean()), "bias": float(predicted.mean() - actual.mean()),
            "mae": float(np.abs(predicted - actual).mean()), "pearson": pear}


def _arrays(p, y):
    p = np.asarray(p, dtype=np.float64).ravel()
    y = np.asarray(y, dtype=np.float64).ravel()
    if p.shape != y.shape:
        raise ValueError(f"p has {p.size} samples, y {y.size}")
    return p, y
