"""Calibration slices of evaluation banks: per (bank, drafter, variant, category, depth).

Samples are the censored per-depth samples of :mod:`calib.labels` (depth k counts only when every
shallower token was accepted), so a probability is judged as ``P(accept k | reached k)``, exactly
what the tables estimate and the allocator multiplies.
"""

from __future__ import annotations

import numpy as np

from calib import metrics as M
from calib.evaluate.data import EvalBank
from calib.labels import censored


def variants(chain) -> dict[str, np.ndarray]:
    """raw (the drafter's own confidence; model drafter only) and calibrated probabilities."""
    out = {}
    if chain.p_raw is not None:
        out["raw"] = chain.p_raw
    if chain.p_cal is not None:
        out["calibrated"] = chain.p_cal
    return out


def samples(bank: EvalBank, drafter: str, p: np.ndarray, split: str = "test"):
    """(p, y, depth, category, prompt) flattened over reached depths of labelled rounds in ``split``."""
    chain = bank.chains[drafter]
    keep = (bank.split == split) & chain.labelled
    acc = chain.acc[keep]
    reached, label = censored(acc)
    reached &= ~np.isnan(p[keep])
    rows, depth = np.nonzero(reached)
    return (p[keep][rows, depth], label[rows, depth].astype(np.float64), depth,
            bank.category[keep][rows], bank.prompt_idx[keep][rows])


def calibration_rows(banks, n_bins: int, n_boot: int, seed: int = 0, split: str = "test"):
    cal, length = [], []
    for bank in banks:
        for drafter, chain in bank.chains.items():
            for variant, p in variants(chain).items():
                p_s, y, depth, cat, prompt = samples(bank, drafter, p, split)
                groups = np.array([f"{c}/{i}" for c, i in zip(cat, prompt)], dtype=object)
                for c in [*sorted(set(cat.tolist())), "all"]:
                    m_c = np.ones_like(y, bool) if c == "all" else cat == c
                    for d in [*range(chain.acc.shape[1]), "all"]:
                        m = m_c if d == "all" else m_c & (depth == d)
                        if not m.any():
                            continue
                        row = {"bank": bank.name, "drafter": drafter, "variant": variant, "category": c,
                               "depth": d, **M.calibration_summary(p_s[m], y[m], groups[m], n_bins, n_boot, seed)}
                        cal.append(row)
                # accepted length: survival-based expectation vs the realised accepted prefix
                keep = (bank.split == split) & chain.labelled
                pred = M.expected_accepted_length(p[keep])
                actual = chain.accept[keep]
                cats = bank.category[keep]
                for c in [*sorted(set(cats.tolist())), "all"]:
                    m = np.ones_like(actual, bool) if c == "all" else cats == c
                    length.append({"bank": bank.name, "drafter": drafter, "variant": variant, "category": c,
                                   **M.accept_length_summary(pred[m], actual[m])})
    return cal, length
