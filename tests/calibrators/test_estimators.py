"""Calibrators against known answers (SYNTHETIC samples drawn from known acceptance curves)."""

import numpy as np
import pandas as pd
import pytest

from calib.calibrators.base import NotFittedError, with_depth
from calib.calibrators.binning import HistogramBinning, IsotonicPerDepth
from calib.calibrators.features import GradientBoostingAcceptance, LogisticAcceptance
from calib.calibrators.identity import Identity
from calib.calibrators.scaling import TemperatureScaling
from calib.metrics import ece, nll

N = 40_000


def draw(curve, seed=0, n=N, depths=3):
    rng = np.random.default_rng(seed)
    c = rng.uniform(size=n)
    d = rng.integers(0, depths, n)
    y = (rng.uniform(size=n) < curve(c, d)).astype(int)
    return c, d, y


CALIBRATORS = [
    lambda: TemperatureScaling(progress=False, max_epochs=20),
    lambda: IsotonicPerDepth(),
    lambda: HistogramBinning(n_bins=20),
]


@pytest.mark.parametrize("make", CALIBRATORS)
def test_calibrated_input_stays_put(make):
    c, d, y = draw(lambda c, d: c)
    cal = make().fit(with_depth(c, d), y)
    grid = np.linspace(0.05, 0.95, 19)
    for depth in range(3):
        p = cal.accept_proba(with_depth(grid, np.full(grid.size, depth)))
        assert np.max(np.abs(p - grid)) < 0.08, (type(cal).__name__, depth, p - grid)


@pytest.mark.parametrize("make", CALIBRATORS)
def test_monotone_distortion_is_undone(make):
    # The drafter is overconfident: true acceptance is c**2 at depth 0 and c**3 deeper.
    truth = lambda c, d: np.where(d == 0, c**2, c**3)
    c, d, y = draw(truth)
    cal = make().fit(with_depth(c, d), y)
    c2, d2, y2 = draw(truth, seed=1)
    p = cal.accept_proba(with_depth(c2, d2))
    assert ece(p, y2) < 0.02 < ece(c2, y2)
    assert nll(p, y2) < nll(c2, y2)
    assert np.mean(np.abs(p - truth(c2, d2))) < 0.04


def test_temperature_recovers_platt_parameters():
    a, b = 0.5, -0.3
    c, d, y = draw(lambda c, d: 1 / (1 + np.exp(-(a * np.log(c / (1 - c)) + b))), n=80_000)
    cal = TemperatureScaling(progress=False).fit(with_depth(c, d), y)
    assert np.allclose(cal.a_, a, atol=0.06) and np.allclose(cal.b_, b, atol=0.06)


def test_deeper_depths_use_the_deepest_fit():
    c, d, y = draw(lambda c, d: c)
    cal = IsotonicPerDepth().fit(with_depth(c, d), y)
    grid = np.linspace(0, 1, 11)
    assert np.array_equal(cal.accept_proba(with_depth(grid, np.full(11, 7))),
                          cal.accept_proba(with_depth(grid, np.full(11, 2))))


def test_pooled_fallback_for_thin_depths():
    c, d, y = draw(lambda c, d: c)
    d[:50] = 5  # depth 5 has 50 samples only
    cal = IsotonicPerDepth(min_samples=200).fit(with_depth(c, d), y)
    assert 5 not in cal.per_depth_ and 0 in cal.per_depth_


def test_boundary_validation():
    cal = IsotonicPerDepth()
    with pytest.raises(NotFittedError):
        cal.accept_proba(with_depth([0.5], [0]))
    with pytest.raises(ValueError, match="sample 1"):
        cal.fit(with_depth([0.2, float("nan")], [0, 0]), [0, 1])
    with pytest.raises(ValueError, match="labels must be 0 or 1"):
        cal.fit(with_depth([0.2, 0.4], [0, 0]), [0, 2])
    with pytest.raises(ValueError, match="depth"):
        cal.fit(with_depth([0.2, 0.4], [0]), [0, 1])
    with pytest.raises(ValueError, match="depth"):  # X without its depth column
        cal.fit(np.array([[0.2], [0.4]]), [0, 1])
    with pytest.raises(ValueError, match="depth must be >= 0"):
        cal.fit(with_depth([0.2, 0.4], [0, -1]), [0, 1])
    fitted = Identity().fit(with_depth([0.3], [0]), [1])
    assert fitted.accept_proba(with_depth([0.3], [0]))[0] == 0.3
    assert np.array_equal(fitted.predict_proba(with_depth([0.3], [0])), [[0.7, 0.3]])


def test_sklearn_style_params():
    cal = HistogramBinning(n_bins=7)
    assert cal.get_params() == {"n_bins": 7, "min_samples": 200, "prior": 1.0}
    assert "n_bins=7" in repr(cal)
    assert cal.set_params(n_bins=9) is cal and cal.n_bins == 9


def test_ngram_models_learn_match_length():
    rng = np.random.default_rng(0)
    n = 20_000
    df = pd.DataFrame({"match_n": rng.integers(1, 5, n), "occurrences": rng.integers(1, 9, n),
                       "agreement": rng.uniform(size=n), "depth": rng.integers(0, 4, n)})
    p = 0.15 + 0.2 * (df.match_n - 1)  # longer matches are accepted more often
    y = (rng.uniform(size=n) < p).astype(int)
    for model in (LogisticAcceptance(features=["match_n", "occurrences", "agreement"]),
                  GradientBoostingAcceptance(features=["match_n", "occurrences", "agreement"])):
        pred = model.fit(df, y).accept_proba(df)
        by_n = pd.Series(pred).groupby(df.match_n).mean()
        assert by_n.is_monotonic_increasing and abs(by_n.iloc[-1] - 0.75) < 0.05
    with pytest.raises(ValueError, match="lack columns"):
        LogisticAcceptance(features=["distance"]).fit(df, y)
