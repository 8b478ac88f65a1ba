"""Calibration metrics against known values (samples here are SYNTHETIC, drawn for the test)."""

import numpy as np
import pytest
from sklearn.calibration import calibration_curve

from calib import metrics as M


def test_perfectly_calibrated_sample_has_debiased_ece_near_zero():
    rng = np.random.default_rng(0)
    p = rng.uniform(size=20000)
    y = (rng.uniform(size=p.size) < p).astype(float)
    deb = M.ece_debiased(p, y, n_bins=15)
    assert deb < 0.01
    assert M.ece(p, y, 15) > deb  # the plug-in estimate is biased upwards by sampling noise


def test_miscalibrated_sample_is_detected():
    rng = np.random.default_rng(1)
    p = rng.uniform(size=20000)
    y = (rng.uniform(size=p.size) < p**2).astype(float)  # over-confident drafter
    assert M.ece_debiased(p, y) > 0.1
    assert M.ece(p, y) == pytest.approx(np.mean(p - p**2), abs=0.02)  # E|p - p^2| = 1/6


def test_hand_computed_small_case():
    p = np.array([0.1, 0.2, 0.9, 1.0])
    y = np.array([0, 0, 1, 1])
    # bins (0, .5] and (.5, 1]: gaps |0 - .15| and |1 - .95|, two samples each
    assert M.ece(p, y, n_bins=2) == pytest.approx(0.5 * 0.15 + 0.5 * 0.05)
    assert M.mce(p, y, n_bins=2) == pytest.approx(0.15)
    assert M.brier(p, y) == pytest.approx((0.01 + 0.04 + 0.01 + 0.0) / 4)
    assert M.nll(p, y) == pytest.approx(-(np.log(0.9) + np.log(0.8) + np.log(0.9) + np.log(1 - 1e-7)) / 4)
    assert M.auroc(p, y) == 1.0


def test_confidences_of_exactly_zero_and_one():
    p = np.array([0.0, 1.0, 1.0, 0.0])
    y = np.array([0, 1, 1, 0])
    assert M.ece(p, y, 10) == 0.0
    assert M.brier(p, y) == 0.0
    assert np.isfinite(M.nll(p, y)) and M.nll(p, y) < 1e-6  # 0·log 0 = 0, not NaN
    assert M.nll([1.0], [0]) == pytest.approx(-np.log(1e-7))  # a confident miss: large but finite
    bins = M.equal_width_bins(np.array([0.0, 0.1, 0.5, 0.999, 1.0]), 10)
    assert bins.tolist() == [0, 0, 4, 9, 9]  # 1.0 is in the last bin, not a bin past the end
    count, _, _ = M.bin_stats(p, y, M.equal_width_bins(p, 10), 10)
    assert count.sum() == 4


def test_bins_agree_with_sklearn_calibration_curve():
    rng = np.random.default_rng(2)
    p = np.concatenate([rng.uniform(size=500), [0.0, 1.0, 0.1, 0.2, 0.5, 0.7]])  # edges included
    y = (rng.uniform(size=p.size) < p).astype(int)
    prob_true, prob_pred = calibration_curve(y, p, n_bins=10, strategy="uniform")
    count, conf, acc = M.bin_stats(p, y.astype(float), M.equal_width_bins(p, 10), 10)
    nz = count > 0
    np.testing.assert_allclose(acc[nz], prob_true)
    np.testing.assert_allclose(conf[nz], prob_pred)


def test_equal_mass_bins_are_balanced():
    p = np.random.default_rng(3).beta(5, 1, size=3000)
    counts = np.bincount(M.equal_mass_bins(p, 10))
    assert len(counts) == 10 and counts.min() >= 290 and counts.max() <= 310


def test_bootstrap_ci_brackets_the_estimate_and_resamples_groups():
    rng = np.random.default_rng(4)
    p = rng.uniform(size=2000)
    y = (rng.uniform(size=p.size) < p).astype(float)
    groups = np.repeat(np.arange(40), 50)
    lo, hi = M.ece_bootstrap_ci(p, y, groups, n_bins=10, n_boot=100)
    assert lo <= M.ece(p, y, 10) <= hi + 0.01 and lo < hi


def test_expected_accepted_length_and_summary():
    p = np.array([[0.5, 0.5, np.nan, 0.9], [1.0, 1.0, 1.0, 1.0]])
    np.testing.assert_allclose(M.expected_accepted_length(p), [0.75, 4.0])  # chain ends at its first NaN
    s = M.accept_length_summary([1.0, 2.0, 3.0], [1, 3, 3])
    assert s["bias"] == pytest.approx(-1 / 3) and s["mae"] == pytest.approx(1 / 3)
    assert s["pearson"] == pytest.approx(np.corrcoef([1, 2, 3], [1, 3, 3])[0, 1])


def test_auroc_undefined_with_one_class():
    assert np.isnan(M.auroc([0.2, 0.8], [1, 1]))


# --- ece_ci contains its own estimate (issue 13 item 4) -------------------------------------------------


def _exactly_calibrated(per_bin=100, n_bins=10):
    """SYNTHETIC: confidences at the bin centres, each bin accepting exactly its confidence: ECE = 0."""
    p = np.repeat((np.arange(n_bins) + 0.5) / n_bins, per_bin)
    hits = np.rint((np.arange(n_bins) + 0.5) / n_bins * per_bin).astype(int)
    y = np.concatenate([np.r_[np.ones(h), np.zeros(per_bin - h)] for h in hits])
    return p, y


def test_ece_ci_contains_its_estimate_where_every_replicate_lies_above_it():
    p, y = _exactly_calibrated()
    groups = np.repeat(np.arange(100), 10)  # 100 prompts of 10 samples, spread over every bin
    rng = np.random.default_rng(0)
    groups = rng.permutation(groups)
    est = M.ece(p, y, 10)
    assert est == pytest.approx(0.0, abs=1e-12)
    lo, hi = M.calibration_summary(p, y, groups, n_bins=10, n_boot=200)["ece_ci"]
    assert lo <= est <= hi and hi > 0  # was: [0.019, 0.048] around an estimate of 0
    assert [lo, hi] == pytest.approx(M.ece_bootstrap_ci(p, y, groups, n_bins=10, n_boot=200))
    reps = M.ece_bootstrap_replicates(p, y, groups, n_bins=10, n_boot=200)
    assert (reps > est).all()  # resampling only adds noise to |gap|: the replicates are biased upwards
    lo_pct, _ = M.ece_bootstrap_ci(p, y, groups, n_bins=10, n_boot=200, method="percentile")
    assert lo_pct > est  # why the percentile interval excluded its own estimate


@pytest.mark.parametrize("seed", range(6))
def test_recentred_interval_keeps_the_percentile_width_and_brackets_the_estimate(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(40, 3000))
    p = rng.beta(2, 2, size=n)
    y = (rng.uniform(size=n) < p ** rng.uniform(0.8, 1.6)).astype(float)  # from calibrated to over-confident
    groups = rng.integers(0, max(n // 15, 2), size=n)
    est = M.ece(p, y, 15)
    lo, hi = M.ece_bootstrap_ci(p, y, groups, n_boot=100, seed=seed)
    assert 0.0 <= lo <= est <= hi
    reps = M.ece_bootstrap_replicates(p, y, groups, n_boot=100, seed=seed)
    q_lo, q_hi = np.quantile(reps, [0.025, 0.975])
    if lo > 0:  # unclipped: the percentile interval moved down by the replicates' median shift
        assert hi - lo == pytest.approx(q_hi - q_lo)
        assert hi - est == pytest.approx(q_hi - np.median(reps))


def test_ece_ci_methods_and_refusal():
    p, y = _exactly_calibrated()
    g = np.arange(p.size)
    for method in M.ECE_CI_METHODS:
        lo, hi = M.ece_bootstrap_ci(p, y, g, n_bins=10, n_boot=50, method=method)
        assert 0.0 <= lo <= hi
    with pytest.raises(ValueError, match="method='bca'"):
        M.ece_bootstrap_ci(p, y, g, method="bca")
    assert np.isnan(M.ece_bootstrap_ci([], [], [])[0])


def test_ece_if_calibrated_is_the_noise_floor_of_a_finite_sample():
    """SYNTHETIC: labels drawn from the predictions themselves (perfect calibration) give a plug-in ECE
    near ece_if_calibrated's mean, below its 95th percentile; a 0.1 over-confidence is far above it;
    the floor shrinks as the sample grows."""
    from calib.metrics import ece, ece_if_calibrated

    rng = np.random.default_rng(3)
    p = rng.beta(2, 3, 3000)
    mean, q95 = ece_if_calibrated(p, n_sim=100)
    assert 0 < mean < q95
    inside = [ece(p, rng.random(p.size) < p) <= q95 for _ in range(20)]
    assert sum(inside) >= 16  # ~95% of perfectly calibrated samples
    assert ece(np.clip(p + 0.1, 0, 1), rng.random(p.size) < p) > 2 * q95
    big_mean, _ = ece_if_calibrated(rng.beta(2, 3, 30000), n_sim=50)
    assert big_mean < mean / 2  # ~1/sqrt(n)
