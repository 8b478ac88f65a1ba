"""Calibrators as scikit-learn estimators and their choice by grouped cross-validation
(calib.calibrators.selection). Synthetic data, unit test: confidences drawn uniformly, labels drawn from a
known acceptance curve, rows grouped into prompts."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from sklearn.base import clone
from sklearn.model_selection import GroupKFold, cross_validate

from calib.calibrators.base import Calibrator, check_inputs, with_depth
from calib.calibrators.binning import IsotonicPerDepth
from calib.calibrators.features import LogisticAcceptance
from calib.calibrators.identity import Identity
from calib.calibrators.scaling import TemperatureScaling
from calib.calibrators.selection import GroupedCVSelection, one_se_choice
from calib.metrics import nll


def draw(curve, n=6000, depths=3, prompts=300, seed=0):
    """(conf [n], depth [n], y [n], prompt [n]): labels ~ Bernoulli(curve(conf))."""
    rng = np.random.default_rng(seed)
    c = rng.uniform(0.02, 0.98, n)
    d = rng.integers(0, depths, n)
    y = (rng.uniform(size=n) < curve(c)).astype(int)
    return c, d, y, rng.integers(0, prompts, n)


# -- (1) scikit-learn interop -------------------------------------------------------------------------------

ESTIMATORS = {
    "identity": (Identity, lambda c: c),
    "isotonic": (lambda: IsotonicPerDepth(min_samples=50), lambda c: c),
    "logistic": (lambda: LogisticAcceptance(features=["conf"]), lambda c: pd.DataFrame({"conf": c})),
}


@pytest.mark.parametrize("name", list(ESTIMATORS))
def test_clone_and_cross_validate(name):
    make, as_x = ESTIMATORS[name]
    c, d, y, g = draw(lambda c: c**2)
    est = make()
    twin = clone(est)
    assert twin is not est and type(twin) is type(est) and twin.get_params() == est.get_params()
    X = with_depth(as_x(c), d)
    res = cross_validate(est, X, y, groups=g, cv=GroupKFold(3), scoring="neg_log_loss", return_estimator=True,
                         error_score="raise")
    scores = -res["test_score"]
    assert scores.shape == (3,) and np.isfinite(scores).all()
    # the fold NLLs are NLLs of these labels: the raw confidence's for identity, better for a fitted map
    # (the planted acceptance is conf**2, so the raw confidence is miscalibrated)
    raw = nll(c, y)
    if name == "identity":
        assert abs(scores.mean() - raw) < 0.02
    else:
        assert scores.mean() < raw - 0.02
    assert not hasattr(est, "classes_")  # cross_validate fitted clones, not the estimator itself
    fitted = res["estimator"][0]
    assert list(fitted.classes_) == [0, 1]
    p = fitted.predict_proba(X)
    assert p.shape == (len(y), 2) and np.allclose(p.sum(1), 1) and np.array_equal(p[:, 1], fitted.accept_proba(X))
    assert twin.set_params(**est.get_params()) is twin


def test_clone_of_a_selection_copies_its_candidates():
    sel = GroupedCVSelection({"identity": Identity(), "isotonic": IsotonicPerDepth()}, n_splits=3)
    twin = clone(sel)
    assert twin.get_params(deep=False)["n_splits"] == 3
    assert list(twin.candidates) == ["identity", "isotonic"]
    assert twin.candidates["isotonic"] is not sel.candidates["isotonic"]


# -- (2) the choice: the baseline where calibrated, a richer candidate where it pays ---------------------------

def test_calibrated_confidence_keeps_the_identity_baseline():
    c, d, y, g = draw(lambda c: c)  # already calibrated
    sel = GroupedCVSelection({"identity": Identity(), "isotonic": IsotonicPerDepth(min_samples=50)},
                             ece_guard=True).fit(with_depth(c, d), y, groups=g)
    assert sel.choice_ == {0: "identity", 1: "identity", 2: "identity"}
    for why in sel.why_.values():
        (step,) = why["steps"]
        assert step["candidate"] == "isotonic" and not step["won"] and step["nll_gain"] <= step["se"]
    assert np.array_equal(sel.accept_proba(with_depth(c, d)), c)  # the raw confidence, untouched
    assert list(sel.chosen_estimators_) == ["identity"]  # only what was chosen is refitted


@pytest.mark.parametrize("richer", [
    lambda: IsotonicPerDepth(min_samples=50),
    lambda: TemperatureScaling(progress=False, max_epochs=30),
])
def test_miscalibrated_confidence_chooses_a_richer_candidate(richer):
    truth = lambda c: c**3  # the drafter is badly overconfident
    c, d, y, g = draw(truth)
    sel = GroupedCVSelection({"identity": Identity(), "richer": richer()}, ece_guard=True)
    sel.fit(with_depth(c, d), y, groups=g)
    assert sel.choice_ == {0: "richer", 1: "richer", 2: "richer"}
    for why in sel.why_.values():
        (step,) = why["steps"]
        assert step["won"] and step["nll_gain"] > max(step["se"], 0.05)
    c2, d2, y2, _ = draw(truth, seed=1)
    p = sel.accept_proba(with_depth(c2, d2))
    assert nll(p, y2) < nll(c2, y2) - 0.05
    assert sel.accept_proba(with_depth(c2[:5], np.full(5, 9))).shape == (5,)  # deeper than fitted: deepest


def test_choice_is_made_per_depth():
    # calibrated at depth 0, overconfident deeper: identity stays at depth 0 only
    rng = np.random.default_rng(3)
    c, d, _, g = draw(lambda c: c)
    y = (rng.uniform(size=c.size) < np.where(d == 0, c, c**3)).astype(int)
    sel = GroupedCVSelection({"identity": Identity(), "isotonic": IsotonicPerDepth(min_samples=50)})
    sel.fit(with_depth(c, d), y, groups=g)
    assert sel.choice_ == {0: "identity", 1: "isotonic", 2: "isotonic"}
    p = sel.accept_proba(with_depth(c, d))
    assert np.array_equal(p[d == 0], c[d == 0]) and not np.array_equal(p[d == 1], c[d == 1])


# -- (3) folds never split a prompt ------------------------------------------------------------------------

SPY_LOG: list = []


class Spy(Calibrator):
    """Predicts the raw confidence; records the prompts (X's second column) it was fitted on and scored on."""

    name = "spy"

    def _fit(self, X, depth, y, *, val=None, groups=None) -> None:
        _, _, _, extra = check_inputs(X, depth, y)
        self.record_ = {"fit": set(extra[:, 0].astype(int).tolist()), "predict": set()}
        SPY_LOG.append(self.record_)

    def _predict(self, X, depth) -> np.ndarray:
        conf, _, _, extra = check_inputs(X, depth)
        self.record_["predict"] |= set(extra[:, 0].astype(int).tolist())
        return np.clip(conf, 1e-3, 1 - 1e-3)


def test_no_prompt_is_in_two_folds():
    SPY_LOG.clear()
    c, d, y, g = draw(lambda c: c, n=3000, prompts=97)
    X = with_depth(np.column_stack([c, g]), d)  # the spy reads the prompt id as a second own column
    GroupedCVSelection({"identity": Identity(), "spy": Spy()}, n_own=2, n_splits=5).fit(X, y, groups=g)
    folds = [r for r in SPY_LOG if r["predict"]]  # the cross-validation fits; the final refit predicts nothing
    assert len(folds) == 5
    for r in folds:
        assert r["fit"] and r["predict"] and not (r["fit"] & r["predict"])  # held-out prompts never trained on
        assert r["fit"] | r["predict"] == set(np.unique(g).tolist())
    held_out = [p for r in folds for p in r["predict"]]
    assert sorted(held_out) == sorted(set(np.unique(g).tolist()))  # every prompt held out exactly once


def test_groupkfold_indices_keep_prompts_whole():
    _, _, _, g = draw(lambda c: c, n=2000, prompts=60)
    for train, test in GroupKFold(5).split(g, groups=g):
        assert not set(g[train]) & set(g[test])


# -- (4) the one-SE rule -----------------------------------------------------------------------------------

BASE = np.array([0.50, 0.52, 0.48, 0.51, 0.49])


def test_gain_below_one_se_keeps_the_simpler_candidate():
    noise = np.array([0.02, -0.02, 0.015, -0.015, 0.0])
    richer = BASE - 0.002 + noise  # mean gain 0.002, SE of the paired difference ~0.007
    name, why = one_se_choice({"a": BASE, "b": richer}, ["a", "b"])
    assert name == "a"
    (step,) = why["steps"]
    assert step["nll_gain"] == pytest.approx(0.002) and step["se"] > step["nll_gain"] and not step["won"]
    assert one_se_choice({"a": BASE, "b": richer}, ["a", "b"], rule="min")[0] == "b"  # lowest mean alone


def test_gain_above_one_se_wins():
    richer = BASE - 0.03 + np.array([0.002, -0.002, 0.001, -0.001, 0.0])
    name, why = one_se_choice({"a": BASE, "b": richer}, ["a", "b"])
    assert name == "b" and why["steps"][0]["won"]
    # the walk: c beats b (the current choice) clearly, so it replaces it
    richest = richer - 0.03
    assert one_se_choice({"a": BASE, "b": richer, "c": richest}, ["a", "b", "c"])[0] == "c"
    # ...but c must beat b, not just a: a small edge over b keeps b
    barely = richer - 0.0005 + np.array([0.01, -0.01, 0.01, -0.01, 0.0])
    assert one_se_choice({"a": BASE, "b": richer, "c": barely}, ["a", "b", "c"])[0] == "b"


def test_ece_guard_blocks_a_candidate_that_raises_ece_beyond_its_se():
    richer = BASE - 0.03 + np.array([0.002, -0.002, 0.001, -0.001, 0.0])
    ece_a = np.array([0.010, 0.012, 0.011, 0.009, 0.010])
    worse = ece_a + 0.02 + np.array([0.001, -0.001, 0.0, 0.001, -0.001])  # ECE up by 0.02, SE ~0.0004
    name, why = one_se_choice({"a": BASE, "b": richer}, ["a", "b"], eces={"a": ece_a, "b": worse})
    assert name == "a"
    (step,) = why["steps"]
    assert step["nll_gain"] > step["se"] and step["ece_gain"] < -step["ece_se"] and not step["won"]
    # an ECE change within its SE does not block it
    same = ece_a + np.array([0.003, -0.003, 0.002, -0.002, 0.0])
    assert one_se_choice({"a": BASE, "b": richer}, ["a", "b"], eces={"a": ece_a, "b": same})[0] == "b"
    assert one_se_choice({"a": BASE, "b": richer}, ["a", "b"])[0] == "b"  # no guard: NLL alone


def test_folds_without_rows_at_a_depth_are_skipped():
    nan = np.full(5, np.nan)
    richer = BASE - 0.03
    assert one_se_choice({"a": nan, "b": richer}, ["a", "b"]) == ("a", {"rule": "one_se", "steps": []})
    one = BASE.copy()
    one[1:] = np.nan  # one fold holds the depth: no SE, the baseline stands
    assert one_se_choice({"a": one, "b": richer}, ["a", "b"])[0] == "a"


class _CannotFit(Calibrator):
    """A candidate that cannot be fitted on these rows (as gradient boosting's own stratified validation
    split cannot on a tiny bank with one sample of a label)."""

    def _fit(self, X, depth, y, *, val=None, groups=None):
        raise ValueError("the least populated class in y has only 1 member")

    def _predict(self, X, depth):
        raise AssertionError("never chosen, never asked")


def test_a_candidate_that_cannot_be_fitted_is_left_out_not_fatal():
    c, d, y, g = draw(lambda c: c ** 3)  # badly miscalibrated: a richer candidate would win if it could fit
    sel = GroupedCVSelection({"identity": Identity(), "broken": _CannotFit()}).fit(with_depth(c, d), y, groups=g)
    assert set(sel.choice_.values()) == {"identity"}
    assert np.isnan(sel.cv_scores_["broken"]).all()
    with pytest.raises(ValueError, match="least populated"):  # the baseline must fit: nothing to fall back on
        GroupedCVSelection({"broken": _CannotFit(), "identity": Identity()}).fit(with_depth(c, d), y, groups=g)


def test_a_held_out_fold_with_one_label_is_scored_not_fatal():
    # a small bank: one prompt holds every accepted draft, so the folds without it hold label 0 only
    # (sklearn's "neg_log_loss" refuses such a fold: "y_true contains only one label")
    c, d, _, g = draw(lambda c: c, n=600, prompts=10)
    y = (g == 0).astype(int)
    sel = GroupedCVSelection({"identity": Identity(), "isotonic": IsotonicPerDepth(min_samples=5)}).fit(
        with_depth(c, d), y, groups=g)
    assert np.isfinite(sel.cv_scores_["identity"]).any() and set(sel.choice_.values()) <= {"identity", "isotonic"}
