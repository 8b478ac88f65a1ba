"""calib's calibration metrics against the field's own tools (issue 30 Must 7): the same numbers as
torchmetrics' BinaryCalibrationError (ECE, MCE) and scikit-learn's calibration_curve (reliability), one
binning convention (equal-width, 15 bins by default). Synthetic predictions, unit test."""

import numpy as np
import pytest
import torch
from sklearn.calibration import calibration_curve
from torchmetrics.classification import BinaryCalibrationError

from calib import metrics as M


def _draw(n=20_000, seed=0):
    rng = np.random.default_rng(seed)
    p = rng.beta(2, 3, n)  # continuous: no prediction sits exactly on a bin edge
    y = (rng.uniform(size=n) < p ** 1.3).astype(np.float64)  # somewhat miscalibrated
    return p, y


@pytest.mark.parametrize("n_bins", [10, M.ECE_BINS])
def test_ece_and_mce_equal_torchmetrics(n_bins):
    p, y = _draw()
    t_p, t_y = torch.from_numpy(p), torch.from_numpy(y).long()
    ece = BinaryCalibrationError(n_bins=n_bins, norm="l1")(t_p, t_y).item()
    mce = BinaryCalibrationError(n_bins=n_bins, norm="max")(t_p, t_y).item()
    assert M.ece(p, y, n_bins) == pytest.approx(ece, rel=1e-5, abs=1e-7)
    assert M.mce(p, y, n_bins) == pytest.approx(mce, rel=1e-5, abs=1e-7)


def test_reliability_equals_sklearn_calibration_curve():
    p, y = _draw(seed=1)
    prob_true, prob_pred = calibration_curve(y, p, n_bins=M.ECE_BINS, strategy="uniform")
    _, conf, acc, count = M.reliability(p, y, M.ECE_BINS)
    seen = count > 0
    np.testing.assert_allclose(acc[seen], prob_true, rtol=1e-10)
    np.testing.assert_allclose(conf[seen], prob_pred, rtol=1e-10)


def test_prompt_bootstrap_interval_agrees_with_scipy():
    """eval's interval of a mean accepted length, resampling whole prompts (calib.evaluate.calibration.
    prompt_mean_ci), against scipy.stats.bootstrap's percentile interval of the same ratio statistic on
    the same prompts: different random draws, the same interval within Monte-Carlo error."""
    from scipy.stats import bootstrap

    from calib.evaluate.calibration import prompt_mean_ci

    rng = np.random.default_rng(3)
    rounds = rng.integers(5, 60, 80).astype(float)  # rounds per prompt
    total = rounds * rng.gamma(2.0, 0.4, 80)  # accepted tokens per prompt: prompts differ widely
    lo, hi = prompt_mean_ci(rounds, total, n_boot=4000, seed=0)
    res = bootstrap((rounds, total), lambda r, t, axis=-1: t.sum(axis) / r.sum(axis), paired=True, vectorized=True,
                    n_resamples=4000, method="percentile", random_state=0)
    ci = res.confidence_interval
    width = ci.high - ci.low
    assert abs(lo - ci.low) < 0.1 * width and abs(hi - ci.high) < 0.1 * width
