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


def _sample_index(bank: EvalBank, drafter: str, p: np.ndarray, split: str = "test"):
    """(round index into the bank, depth) of every reached depth of a labelled round in ``split``
    where ``p`` has a value, and the censored labels ``[R_kept, K]``."""
    chain = bank.chains[drafter]
    keep = (bank.split == split) & chain.labelled
    kept = np.flatnonzero(keep)
    reached, label = censored(chain.acc[keep])
    reached &= ~np.isnan(p[keep])
    rows, depth = np.nonzero(reached)
    return kept[rows], depth, label[rows, depth].astype(np.float64)


def samples(bank: EvalBank, drafter: str, p: np.ndarray, split: str = "test"):
    """(p, y, depth, category, prompt) flattened over reached depths of labelled rounds in ``split``."""
    r, depth, y = _sample_index(bank, drafter, p, split)
    return p[r, depth], y, depth, bank.category[r], bank.prompt_idx[r]


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
                pred = M.expected_accepted_length(p)
                for temp, c, m in length_slice_masks(bank, drafter, split):
                    length.append({"bank": bank.name, "drafter": drafter, "variant": variant,
                                   "temperature": temp, "category": c,
                                   **M.accept_length_summary(pred[m], chain.accept[m])})
    return cal, length


def length_slice_masks(bank: EvalBank, drafter: str, split: str = "test"):
    """``(temperature, category, round mask)`` of every accepted-length slice of one chain of ``bank``:
    labelled rounds in ``split``, per temperature, per category and pooled (``"all"``)."""
    keep = (bank.split == split) & bank.chains[drafter].labelled
    for temp, in_t in temperature_groups(bank, keep):
        for c in [*sorted(set(bank.category[in_t].tolist())), "all"]:
            yield temp, c, (in_t if c == "all" else in_t & (bank.category == c))


def prompt_mean_ci(rounds, total, n_boot: int = 1000, seed: int = 0, level: float = 0.95) -> tuple[float, float]:
    """Percentile bootstrap interval of a mean over rounds, resampling whole prompts.

    ``rounds[g]`` / ``total[g]``: rounds of prompt ``g`` and the sum of the quantity over them. Each
    replicate draws prompt multiplicities (multinomial, all replicates at once) and takes
    ``Σ w·total / Σ w·rounds``. (nan, nan) without prompts or replicates.
    """
    rounds, total = np.asarray(rounds, np.float64), np.asarray(total, np.float64)
    if rounds.size == 0 or n_boot <= 0:
        return float("nan"), float("nan")
    rng = np.random.default_rng(seed)
    w = rng.multinomial(rounds.size, np.full(rounds.size, 1.0 / rounds.size), size=n_boot).astype(np.float64)
    den = w @ rounds
    with np.errstate(invalid="ignore", divide="ignore"):
        vals = (w @ total) / den
    vals = vals[den > 0]
    if vals.size == 0:
        return float("nan"), float("nan")
    a = (1 - level) / 2
    lo, hi = np.quantile(vals, [a, 1 - a])
    return float(lo), float(hi)


def length_noise(banks, n_boot: int = 1000, seed: int = 0, split: str = "test", level: float = 0.95) -> dict:
    """Prompt-sampling noise of every accepted-length slice's actual mean.

    ``{(temperature, chain, category, bank): {"prompts": G, "actual_ci": [lo, hi]}}`` with G the
    slice's distinct (category, prompt_idx) prompts and ``actual_ci`` the ``level`` percentile
    bootstrap interval of its actual mean accepted length, resampling whole prompts (a prompt's
    rounds share text and drafter state, and prompts differ far more than rounds of one prompt).
    Keys match :func:`calib.evaluate.report.length_slices`' slices.
    """
    out = {}
    for bank in banks:
        for drafter, chain in bank.chains.items():
            accept = chain.accept.astype(np.float64)
            for temp, c, m in length_slice_masks(bank, drafter, split):
                keys = np.array([f"{a}/{i}" for a, i in zip(bank.category[m], bank.prompt_idx[m])], dtype=object)
                if keys.size:
                    _, gid = np.unique(keys, return_inverse=True)
                    rounds, total = np.bincount(gid), np.bincount(gid, weights=accept[m])
                else:
                    rounds = total = np.zeros(0)
                lo, hi = prompt_mean_ci(rounds, total, n_boot, seed, level)
                out[(temp, drafter, c, bank.name)] = {"prompts": int(rounds.size), "actual_ci": [lo, hi]}
    return out


# Issue 13's target for the calibrated tables' pooled ECE per (temperature, chain): at most this,
# and never worse than the drafter's raw confidence where it has one.
POOLED_ECE_MAX = 0.02


def pooled_calibration_rows(banks, n_bins: int, split: str = "test", max_ece: float = POOLED_ECE_MAX) -> list[dict]:
    """ECE per (temperature, chain), pooling every bank's scored samples of that temperature and chain.

    Same samples (censored per-depth, ``split``) and the same equal-width ECE and binning as the
    calibration rows; one chain (the n-gram chain) can come from several banks at one temperature.
    Row: ``temperature`` (None: not recorded), ``chain``, ``banks``, ``n`` (calibrated samples),
    ``ece_calibrated`` / ``nll_calibrated``, and where the chain has a raw confidence ``n_raw`` / ``ece_raw`` /
    ``nll_raw`` (else None);
    ``target_met``: calibrated ECE ≤ ``max_ece`` and ≤ the raw ECE where there is one;
    ``ece_if_calibrated`` / ``_q95``: the mean and 95th percentile ECE a perfectly calibrated predictor
    with the same predictions shows at this sample size (:func:`calib.metrics.ece_if_calibrated`), and
    ``within_noise``: the calibrated ECE is at or below that percentile. Sorted by temperature then chain.
    """
    pools: dict[tuple, dict] = {}
    for bank in banks:
        temps = round_temperatures(bank)
        for drafter, chain in bank.chains.items():
            for variant, p in variants(chain).items():
                r, depth, y = _sample_index(bank, drafter, p, split)
                t = temps[r]
                for v in sorted({float(x) for x in t[~np.isnan(t)]}) + ([None] if np.isnan(t).any() else []):
                    m = np.isnan(t) if v is None else t == v
                    pool = pools.setdefault((v, drafter), {"banks": [], "raw": [], "calibrated": []})
                    if bank.name not in pool["banks"]:
                        pool["banks"].append(bank.name)
                    pool[variant].append((p[r[m], depth[m]], y[m]))
    rows = []
    for (temp, drafter), pool in pools.items():
        ece, nll = {}, {}
        for variant in ("raw", "calibrated"):
            if pool[variant]:
                p = np.concatenate([a for a, _ in pool[variant]])
                y = np.concatenate([b for _, b in pool[variant]])
                ece[variant] = (int(p.size), M.ece(p, y, n_bins) if p.size else float("nan"))
                nll[variant] = M.nll(p, y) if p.size else float("nan")
        n, e_cal = ece.get("calibrated", (0, float("nan")))
        n_raw, e_raw = ece.get("raw", (None, None))
        met = bool(np.isfinite(e_cal) and e_cal <= max_ece
                   and (e_raw is None or not np.isfinite(e_raw) or e_cal <= e_raw))
        null_mean, null_q95 = (M.ece_if_calibrated(np.concatenate([a for a, _ in pool["calibrated"]]), n_bins)
                               if pool["calibrated"] else (float("nan"), float("nan")))
        rows.append({"temperature": temp, "chain": drafter, "banks": pool["banks"], "n": n,
                     "ece_calibrated": e_cal, "n_raw": n_raw, "ece_raw": e_raw, "target_met": met,
                     "nll_calibrated": nll.get("calibrated"), "nll_raw": nll.get("raw"),
                     "ece_if_calibrated": null_mean, "ece_if_calibrated_q95": null_q95,
                     "within_noise": bool(np.isfinite(e_cal) and e_cal <= null_q95)})
    return sorted(rows, key=lambda r: (r["temperature"] is None, r["temperature"] or 0.0, r["chain"]))
