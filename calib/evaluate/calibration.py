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

TEMPERATURE_DECIMALS = 4  # temperatures are grouped after rounding (0.8 stored as 0.800000011920929 is 0.8)


def round_temperatures(bank: EvalBank) -> np.ndarray:
    """Sampling temperature per round, rounded; NaN where the bank does not record one.

    Per round where the bank carries the column (a folder list read as one bank may mix temperatures),
    else the bank-level value.
    """
    if bank.round_temperature is not None:
        t = np.asarray(bank.round_temperature, dtype=np.float64)
    else:
        t = np.full(len(bank.category), np.nan if bank.temperature is None else float(bank.temperature))
    return np.round(t, TEMPERATURE_DECIMALS)


def temperature_groups(bank: EvalBank, keep: np.ndarray | None = None) -> list[tuple[float | None, np.ndarray]]:
    """``[(temperature or None, round mask)]`` over the rounds in ``keep``, lowest temperature first.

    None collects rounds without a recorded temperature. A bank of one temperature gives one group.
    """
    t = round_temperatures(bank)
    keep = np.ones(len(t), bool) if keep is None else keep
    known = sorted({float(v) for v in t[keep & ~np.isnan(t)]})
    groups = [(v, keep & (t == v)) for v in known]
    if (keep & np.isnan(t)).any():
        groups.append((None, keep & np.isnan(t)))
    return groups or [(None, keep)]  # nothing kept: one empty group, so pooled rows still say n = 0


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
    """``(calibration rows, accepted-length rows)`` of metrics.json.

    Calibration rows are per (bank, drafter, variant, category, depth), pooled slices included.
    Accepted-length rows are per (bank, drafter, variant, temperature, category): the temperature
    is that of the rounds (None where not recorded), so a bank of one temperature gives one row per
    (drafter, variant, category) as before, and a bank mixing temperatures one per temperature.
    """
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
                pred = M.expected_accepted_length(p)
                for temp, in_t in temperature_groups(bank, keep):
                    cats = bank.category[in_t]
                    for c in [*sorted(set(cats.tolist())), "all"]:
                        m = in_t if c == "all" else in_t & (bank.category == c)
                        length.append({"bank": bank.name, "drafter": drafter, "variant": variant,
                                       "temperature": temp, "category": c,
                                       **M.accept_length_summary(pred[m], chain.accept[m])})
    return cal, length
