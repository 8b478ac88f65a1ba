"""What tables.json says about a chain's fitted estimator: the choice per depth (and context cell), why,
the held-out NLL per candidate, the features and parameters (split from :mod:`calib.training`)."""

from __future__ import annotations

import numpy as np
import pandas as pd

from calib.calibrators.context import PerContextCell
from calib.calibrators.identity import Identity
from calib.chains import ChainKind


def _selections(est) -> list:
    return list(est.cells_.values()) + ([est.pooled_] if est.pooled_ is not None else []) \
        if isinstance(est, PerContextCell) else [est]


def _per_cell(est, attr: str) -> dict:
    """A selection's per-depth ``attr`` (``choice_`` or ``why_``), keyed by context cell for an estimator per
    cell (``"cell c"``, and ``"pooled (thin cells)"`` where thin cells took the pooled fit)."""
    def depths(s):
        return {int(d): v for d, v in getattr(s, attr).items()}

    if not isinstance(est, PerContextCell):
        return depths(est)
    out = {f"cell {c}": depths(s) for c, s in sorted(est.cells_.items())}
    if est.pooled_ is not None:
        out["pooled (thin cells)"] = depths(est.pooled_)
    return out


def _choices(est) -> dict:
    """tables.json's ``choice``: the candidate per depth (per context cell for an estimator per cell)."""
    return _per_cell(est, "choice_")


def _why(est) -> dict:
    """tables.json's ``choice_why``: per depth (per context cell), each richer candidate's held-out NLL and
    ECE gain over the choice before it, their standard errors, and whether it won."""
    return _per_cell(est, "why_")


def _cv_nll(est) -> dict:
    """Mean held-out NLL per candidate over folds and depths (pooled over cells, weighted equally)."""
    out: dict[str, list] = {}
    for s in _selections(est):
        for n, sc in s.cv_scores_.items():
            if np.isfinite(sc).any():
                out.setdefault(n, []).append(float(np.nanmean(sc)))
    return {n: float(np.mean(v)) for n, v in out.items()}


def _uses_context(kind: ChainKind, est) -> bool:
    """Whether the table must average the estimator over inputs other than its axes (a model chain
    estimator reading more than the confidence)."""
    return bool(kind.confidence) and any(s.uses_context for s in _selections(est))


def _chosen_names(res: dict) -> set[str]:
    """Every candidate chosen at some depth (of some context cell)."""
    ch = res["choice"]
    per = ch.values() if ch and isinstance(next(iter(ch.values())), dict) else [ch]
    return {n for c in per for n in c.values()}


def _describe_choice(res: dict) -> str:
    """tables.json's ``estimator``: the candidate chosen, or ``a|b`` where depths (or cells) differ."""
    return "|".join(n for n in res["eligible"] if n in _chosen_names(res))


def _features(kind: ChainKind, est, chain_cfg: dict) -> list[str]:
    sel = est.estimator if isinstance(est, PerContextCell) else est
    own = list(kind.feature_names(chain_cfg))
    cells = _selections(est) if isinstance(est, PerContextCell) else [sel]
    named = [f for s in cells for f in (s.features_read(own) or own)]
    return list(dict.fromkeys(named)) or own


def _candidates(est) -> dict:
    return (est.estimator if isinstance(est, PerContextCell) else est).candidates


def _params(est) -> dict:
    """tables.json's ``params``: each candidate's parameters (of the wrapped selection for an estimator
    per context cell)."""
    sel = est.estimator if isinstance(est, PerContextCell) else est
    return {n: {k: (list(v) if isinstance(v, tuple) else v) for k, v in c.get_params(deep=False).items()}
            for n, c in sel.candidates.items()}


def _context_cells(est) -> dict:
    """tables.json's ``context_cells`` (additive): how an estimator per context cell was fitted."""
    if not isinstance(est, PerContextCell):
        return {}
    return {"context_cells": {"edges": [list(e) for e in est.edges], "min_samples": est.min_samples,
                              "train_samples": est.cell_samples_,
                              "cells_fitted": sorted(int(c) for c in est.cells_)}}


def _chain_ids(kind: ChainKind, samples: pd.DataFrame) -> dict:
    """The drafters a chain's tables were fitted on: the banks' speculator names for a chain with a
    confidence (EAGLE tables must not calibrate a draft model), else the chain's own name."""
    return {"ids": sorted(set(samples.speculator.astype(str))) if kind.confidence else [kind.name]}


def _probe_choice(est, candidates: dict) -> str | None:
    """The candidate an optional context axis is tried on: the one chosen at the most (cell, depth) slots,
    the richer on a tie; the baseline where only it was, unless it is the raw confidence
    (:class:`Identity`, a fixed map: None, nothing for an axis to refine)."""
    votes: dict[str, int] = {}
    for s in _selections(est):
        for n in s.choice_.values():
            votes[n] = votes.get(n, 0) + 1
    order = list(candidates)
    if any(n != order[0] for n in votes):
        return max((n for n in votes if n != order[0]), key=lambda n: (votes[n], order.index(n)))
    return None if isinstance(candidates[order[0]], Identity) else order[0]
