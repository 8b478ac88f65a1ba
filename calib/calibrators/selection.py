"""Choosing a calibrator by grouped cross-validation, per depth, with a one-standard-error rule.

A calibrator chosen on one validation split can lose to the raw confidence on the next prompts (the
split's noise picks a richer model that does not generalise). :class:`GroupedCVSelection` scores every
candidate by K-fold cross-validation grouped by prompt (``GroupKFold``: no prompt in two folds; the
NLL of each fold's held-out rows, per depth), then walks the candidates from the simplest (the
baseline, listed first) to the richest: a richer candidate replaces the current choice at a depth only
if it lowers that depth's held-out NLL by more than the fold-to-fold standard error of the paired
difference. Depths where nothing clears that bar keep the baseline (for the model chain: the raw
confidence, :class:`calib.calibrators.identity.Identity`). The chosen candidates are refitted on every
row; a depth deeper than any fitted uses the deepest depth's choice.

``sklearn.model_selection.cross_validate`` and ``sklearn.base.clone`` do the fitting; the candidates
are scikit-learn estimators (:mod:`calib.calibrators.base`). Each candidate reads its own columns of
``X``: a model reading named ``features`` takes them by name; any other takes X's first ``n_own``
columns (the chain's own features: the confidence, then its ``extra`` inputs).
"""

from __future__ import annotations

import logging
import numbers
from typing import ClassVar

import numpy as np
import pandas as pd
from sklearn.base import clone
from sklearn.metrics import log_loss, make_scorer
from sklearn.model_selection import GroupKFold, cross_validate

from calib.calibrators.base import Boolean, Calibrator, Interval, Options, with_depth
from calib.metrics import ece, nll

log = logging.getLogger(__name__)
# sklearn's "neg_log_loss" with both labels named: a held-out fold of a small bank may hold one label only
NEG_LOG_LOSS = make_scorer(log_loss, greater_is_better=False, response_method="predict_proba", labels=[0, 1])

RULES = ("one_se", "min")  # one_se: richer only if better by > one SE; min: lowest mean held-out NLL


def _scored_below(estimator, X, y) -> float:
    """``cross_validate``'s scorer where the folds are scored per depth afterwards from each fitted estimator
    (:meth:`GroupedCVSelection._cross_validate`): it predicts nothing (a second prediction of every held-out
    fold would cost as much as the scoring itself)."""
    return 0.0


def candidate_columns(est, X, n_own: int):
    """The columns of ``X`` (a DataFrame without depth) candidate ``est`` reads."""
    feats = est.get_params(deep=False).get("features") if hasattr(est, "get_params") else None
    if feats is not None:
        missing = [f for f in feats if f not in X.columns]
        if missing:
            raise ValueError(f"{type(est).__name__} reads {list(feats)}; X lacks {missing} "
                             f"(it has {list(map(str, X.columns))})")
        return X[list(feats)]
    return X.iloc[:, :n_own]


def as_frame(X, n: int) -> pd.DataFrame:
    """``X`` as a DataFrame of ``n`` rows (an array's columns numbered), the form candidates are handed."""
    return X if isinstance(X, pd.DataFrame) else pd.DataFrame(np.asarray(X, dtype=np.float64).reshape(n, -1))


def group_sample(groups, n: int, seed: int = 0) -> np.ndarray:
    """Row indices of whole groups (prompts) drawn at random until about ``n`` rows; every row where ``n`` is
    0 or the rows are fewer. A choice taken on a sample of prompts, never on a sample of rows."""
    groups = np.asarray(groups)
    if not n or len(groups) <= n:
        return np.arange(len(groups))
    uniq, inv = np.unique(groups, return_inverse=True)
    perm = np.random.default_rng(seed).permutation(len(uniq))
    keep = perm[: int(np.searchsorted(np.cumsum(np.bincount(inv)[perm]), n)) + 1]
    return np.flatnonzero(np.isin(inv, keep))


def one_se_choice(scores: dict[str, np.ndarray], order: list[str], rule: str = "one_se",
                  eces: dict[str, np.ndarray] | None = None) -> tuple[str, dict]:
    """The chosen candidate for one depth from per-fold held-out NLL ``scores[name] [folds]`` (NaN: a fold
    without rows at this depth), walking ``order`` from the baseline; returns ``(name, why)``. With
    per-fold ECE ``eces``, a richer candidate must also not raise the held-out ECE on average (a
    better NLL bought with a calibration error worse by more than its own standard error is no win for
    a calibrator)."""
    finite = {n: s[np.isfinite(s)] for n, s in scores.items()}
    if rule == "min":
        means = {n: float(s.mean()) if s.size else np.inf for n, s in finite.items()}
        best = min(order, key=lambda n: means[n])
        return best, {"rule": "min", "mean_nll": means[best]}
    chosen, steps = order[0], []
    for name in order[1:]:
        both = np.isfinite(scores[name]) & np.isfinite(scores[chosen])
        if both.sum() < 2:
            continue
        diff = scores[name][both] - scores[chosen][both]
        se = float(diff.std(ddof=1) / np.sqrt(diff.size))
        gain = -float(diff.mean())
        ece_diff = np.zeros(2) if eces is None else eces[name][both] - eces[chosen][both]
        ece_gain, ece_se = -float(ece_diff.mean()), float(ece_diff.std(ddof=1) / np.sqrt(ece_diff.size))
        won = gain > se and ece_gain >= -ece_se
        steps.append({"candidate": name, "vs": chosen, "nll_gain": gain, "se": se, "ece_gain": ece_gain,
                      "ece_se": ece_se, "won": bool(won)})
        if won:
            chosen = name
    return chosen, {"rule": "one_se", "steps": steps}


class GroupedCVSelection(Calibrator):
    """Per depth, the simplest of ``candidates`` that no richer one beats (see the module docstring).

    ``candidates``: ``{name: estimator}``, the baseline first, then by increasing richness.
    ``ece_guard``: a richer candidate must also not raise the held-out ECE by more than its standard
error (for a calibrator of a confidence, where calibration error is the point; a model adding
features is judged on NLL alone, as its sharper predictions can cost a little ECE).
``n_jobs``: folds fitted in parallel (joblib processes; each fit keeps its one thread).
``max_cv_samples``: the cross-validation runs on whole prompts drawn at random until this many rows
    where there are more (a choice, not a fit: the chosen candidates are refitted on every row).
    """

    name = "grouped_cv"
    _parameter_constraints: ClassVar[dict] = {
        "candidates": [],  # {name: estimator}; checked in _fit
        "n_own": [Interval(numbers.Integral, 1, None)],
        "n_splits": [Interval(numbers.Integral, 2, None)],
        "rule": [Options(RULES)],
        "max_cv_samples": [Interval(numbers.Integral, 100, None)],
        "ece_guard": [Boolean()],
        "n_jobs": [Interval(numbers.Integral, 1, None)],
        "seed": [Interval(numbers.Integral, 0, None)],
    }

    def __init__(self, candidates=None, n_own: int = 1, n_splits: int = 5, rule: str = "one_se",
                 max_cv_samples: int = 30_000, ece_guard: bool = False, n_jobs: int = 1, seed: int = 0):
        self.candidates = candidates
        self.n_own = n_own
        self.n_splits = n_splits
        self.rule = rule
        self.max_cv_samples = max_cv_samples
        self.ece_guard = ece_guard
        self.n_jobs = n_jobs
        self.seed = seed

    @property
    def uses_context(self) -> bool:
        return any(getattr(self.chosen_estimators_[n], "uses_context", False) for n in set(self.choice_.values()))

    def _fit(self, X, depth, y, *, val=None, groups=None) -> None:
        if not isinstance(self.candidates, dict) or not self.candidates:
            raise ValueError(f"GroupedCVSelection: candidates must be a non-empty {{name: estimator}}, got {self.candidates!r}")
        X = as_frame(X, len(depth))
        y = np.asarray(y, dtype=np.float64)
        groups = np.arange(len(y)) if groups is None else np.asarray(groups)
        order = list(self.candidates)
        self.n_depths_ = int(depth.max()) + 1
        self.cv_scores_, self.cv_ece_ = self._cross_validate(X, depth, y, groups, order)
        self.choice_, self.why_ = {}, {}
        for d in range(self.n_depths_):
            scores = {n: self.cv_scores_[n][:, d] for n in order}
            eces = {n: self.cv_ece_[n][:, d] for n in order} if self.ece_guard else None
            self.choice_[d], self.why_[d] = one_se_choice(scores, order, self.rule, eces)
        self.chosen_estimators_ = {}
        for name in dict.fromkeys(self.choice_.values()):
            est = clone(self.candidates[name])
            v = None
            if val is not None:
                vX, vd, vy = val
                vX = as_frame(vX, len(vd))
                v = (with_depth(candidate_columns(est, vX, self.n_own), vd), vy)
            self.chosen_estimators_[name] = est.fit(with_depth(candidate_columns(est, X, self.n_own), depth), y, val=v)
        if len(order) > 1:
            log.info("grouped CV (%d folds, %s): chosen per depth %s", self.n_splits, self.rule,
                     {d: n for d, n in self.choice_.items()})

    def _cross_validate(self, X, depth, y, groups, order) -> tuple[dict, dict]:
        """``({name: held-out NLL [folds, depths]}, {name: held-out ECE [folds, depths]})`` (NaN where a fold
        holds no row of a depth)."""
        rows = group_sample(groups, self.max_cv_samples, self.seed)
        n_groups = len(np.unique(groups[rows]))
        n_splits = min(self.n_splits, n_groups)
        scores = {n: np.full((max(n_splits, 1), self.n_depths_), np.nan) for n in order}
        eces = {n: np.full((max(n_splits, 1), self.n_depths_), np.nan) for n in order}
        if len(order) == 1 or n_splits < 2:
            if len(order) > 1:
                log.warning("grouped CV: %d prompt group(s), no cross-validation; the baseline %r stands",
                            n_groups, order[0])
            return scores, eces
        yr, dr = y[rows], depth[rows]
        for name in order:
            est = self.candidates[name]
            Xc = with_depth(candidate_columns(est, X, self.n_own).iloc[rows], dr)
            try:
                res = cross_validate(est, Xc, yr, groups=groups[rows], cv=GroupKFold(n_splits),
                                     scoring=_scored_below, return_estimator=True, return_indices=True,
                                     error_score="raise", n_jobs=self.n_jobs)
            except (ValueError, RuntimeError) as exc:
                if name == order[0]:  # the baseline must fit: there is nothing to fall back on
                    raise
                # a richer candidate that cannot fit these rows (e.g. too few of a label for its own
                # validation split) is not a candidate here; its scores stay NaN, never chosen
                log.warning("grouped CV: candidate %r cannot be fitted on these rows (%s: %s); left out",
                            name, type(exc).__name__, exc)
                continue
            for f, (fitted, test) in enumerate(zip(res["estimator"], res["indices"]["test"], strict=True)):
                p = fitted.accept_proba(Xc.iloc[test])
                for d in np.unique(dr[test]):
                    m = dr[test] == d
                    scores[name][f, d] = nll(p[m], yr[test][m])
                    eces[name][f, d] = ece(p[m], yr[test][m])
        return scores, eces

    def features_read(self, own) -> list[str] | None:
        """The named columns the chosen candidates read, the chain's ``own`` features first (None when
        no chosen candidate reads named features: X's first ``n_own`` columns are all it needs)."""
        named = [f for n in dict.fromkeys(self.choice_.values())
                 for f in (self.chosen_estimators_[n].get_params(deep=False).get("features") or ())]
        return list(dict.fromkeys([*own, *named])) if named else None

    def _predict(self, X, depth) -> np.ndarray:
        X = as_frame(X, len(depth))
        out = np.empty(len(depth), dtype=np.float64)
        d_eff = np.minimum(depth, self.n_depths_ - 1)
        for name in dict.fromkeys(self.choice_.values()):
            ds = [d for d, n in self.choice_.items() if n == name]
            m = np.isin(d_eff, ds)
            if m.any():
                est = self.chosen_estimators_[name]
                out[m] = est.accept_proba(with_depth(candidate_columns(est, X.iloc[np.flatnonzero(m)], self.n_own),
                                                     depth[m]))
        return out
