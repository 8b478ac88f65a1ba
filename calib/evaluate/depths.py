"""Per depth, the tables and the online correction against the drafter's raw confidence.

Deep depths are where a decision to stop is made, and they have the fewest labels: a table fitted on the
training prompts can move a depth's probabilities away from a raw confidence that was already right on
other prompts. So every depth of every chain with a raw confidence is scored three ways on the same
verified positions (every bank of one temperature pooled, every scored round from the start of its
bank's stream, the online correction's cold start included): the raw confidence, the tables alone, the
tables corrected online (:func:`calib.evaluate.online.replays`, as serving reads them). A depth with at
least ``min_labels`` positions must not end worse than raw, with or without the correction.

ECE differences between two predictors on a few hundred positions are mostly noise, so each difference
comes with a 95 % interval from a bootstrap over prompts (a prompt's positions resampled together, the
unit that varies): "worse" is a difference above 0, "worse beyond noise" one whose interval lies wholly
above 0. Both are reported; the verdict counts the first.
"""

from __future__ import annotations

import numpy as np

from calib import metrics as M
from calib.labels import censored

DEPTH_MIN_LABELS = 500  # issue 42: "no depth with ≥ 500 labels may end worse than raw, with or without the online correction"
VARIANTS = ("tables", "online")  # each set against raw

DEPTH_COLS = ["temperature", "chain", "depth", "n", "prompts", "ece_raw", "ece_tables", "diff_tables_ci", "ece_online",
              "diff_online_ci", "verdict"]


def _pools(replayed: list[dict]) -> dict[tuple, dict]:
    """Positions per (temperature, chain, depth): the three predictions, the censored labels, the prompt
    (bank, prompt index) of each; chains without a raw confidence are left out."""
    pools: dict[tuple, dict] = {}
    for rec in replayed:
        if rec["raw"] is None:
            continue
        bank = rec["bank"]
        reached, label = censored(rec["acc"])
        preds = {"raw": rec["raw"], "tables": rec["tables"], "online": rec["online"]}
        for v in preds.values():
            reached &= ~np.isnan(v)
        prompt = np.asarray(bank.prompt_idx[rec["keep"]], dtype=np.int64)
        temps = rec["temperature"]
        for t in np.unique(temps[np.isfinite(temps)]).tolist() + ([None] if np.isnan(temps).any() else []):
            in_t = np.isnan(temps) if t is None else temps == t
            for d in range(reached.shape[1]):
                rows = np.flatnonzero(in_t & reached[:, d])
                if rows.size == 0:
                    continue
                pool = pools.setdefault((t, rec["chain"], d), {"y": [], "group": [], "banks": [],
                                                               **{k: [] for k in preds}})
                if bank.name not in pool["banks"]:
                    pool["banks"].append(bank.name)
                pool["y"].append(label[rows, d].astype(np.float64))
                pool["group"].append([f"{bank.name}/{i}" for i in prompt[rows].tolist()])
                for k, v in preds.items():
                    pool[k].append(v[rows, d])
    return pools


def depth_rows(replayed: list[dict], n_bins: int = M.ECE_BINS, n_boot: int = 200, seed: int = 0,
               min_labels: int = DEPTH_MIN_LABELS) -> list[dict]:
    """One row per (temperature, chain with a raw confidence, depth) of :func:`calib.evaluate.online.replays`'
    records: ``n`` positions, ``prompts``, ``ece_raw`` / ``ece_tables`` / ``ece_online``, each variant's
    ``diff_<v>`` (its ECE minus raw's) with ``diff_<v>_lo`` / ``_hi`` (the prompt bootstrap's 95 % interval),
    ``worse_<v>`` (the difference above 0) and ``worse_<v>_beyond_noise`` (the interval above 0), and
    ``counted``: ``n ≥ min_labels``. Sorted by temperature, chain, depth."""
    rng = np.random.default_rng(seed)
    rows = []
    for (t, chain, d), pool in _pools(replayed).items():
        y = np.concatenate(pool["y"])
        _, group = np.unique(np.concatenate(pool["group"]), return_inverse=True)
        n_groups = int(group.max()) + 1
        p = {k: np.concatenate(pool[k]) for k in ("raw", *VARIANTS)}
        row = {"temperature": t, "chain": chain, "depth": d, "n": int(y.size), "prompts": n_groups,
               "banks": pool["banks"], "counted": bool(y.size >= min_labels)}
        for k, v in p.items():
            row[f"ece_{k}"] = M.ece(v, y, n_bins)
        boot = {k: np.empty(n_boot) for k in VARIANTS}
        for b in range(n_boot):  # a prompt drawn c times weighs its positions c times
            w = np.bincount(rng.integers(0, n_groups, n_groups), minlength=n_groups)[group].astype(np.float64)
            e_raw = M.ece(p["raw"], y, n_bins, weight=w)
            for k in VARIANTS:
                boot[k][b] = M.ece(p[k], y, n_bins, weight=w) - e_raw
        for k in VARIANTS:
            diff = row[f"ece_{k}"] - row["ece_raw"]
            lo, hi = (np.quantile(boot[k], [0.025, 0.975]).tolist() if n_boot else (float("nan"),) * 2)
            row.update({f"diff_{k}": diff, f"diff_{k}_lo": lo, f"diff_{k}_hi": hi, f"worse_{k}": bool(diff > 0),
                        f"worse_{k}_beyond_noise": bool(lo > 0)})
        rows.append(row)
    return sorted(rows, key=lambda r: (r["temperature"] is None, r["temperature"] or 0.0, r["chain"], r["depth"]))


def depth_verdict(rows: list[dict]) -> dict:
    """The counted depths (``n ≥ min_labels``) worse than raw, per variant: ``{"tables": [...], "online": [...],
    "counted": n}``, each entry ``"T = t, chain depth d"``; empty lists: the target is met."""
    counted = [r for r in rows if r["counted"]]
    out = {"counted": len(counted)}
    for k in VARIANTS:
        out[k] = [_where(r) for r in counted if r[f"worse_{k}"]]
        out[f"{k}_beyond_noise"] = [_where(r) for r in counted if r[f"worse_{k}_beyond_noise"]]
    return out


def _where(r: dict) -> str:
    t = "?" if r["temperature"] is None else f"{r['temperature']:g}"
    return f"T = {t}, {r['chain']} depth {r['depth']}"


def depth_section(rows: list[dict], min_labels: int = DEPTH_MIN_LABELS) -> list[str]:
    """Report lines: the verdict first, then one row per (temperature, chain, depth)."""
    from calib.evaluate.report import table

    if not rows:
        return []
    v = depth_verdict(rows)

    def said(k, name):
        if not v[k]:
            return f"{name}: **none**"
        beyond = v[f"{k}_beyond_noise"]
        return (f"{name}: **{len(v[k])}** ({'; '.join(v[k])}; "
                + (f"beyond the prompt bootstrap's noise: {'; '.join(beyond)}" if beyond else "none beyond noise") + ")")

    L = ["## Per depth against the raw confidence", "",
         (f"**Does any depth with ≥ {min_labels:,} labels end worse than raw?** {said('tables', 'the tables alone')}; "
          f"{said('online', 'with the online correction')} ({v['counted']} depths counted)."), "",
         ("Same verified positions for all three (every bank of a temperature pooled, every scored round from the "
          "start of its stream: the online correction's cold start included). `diff_*_ci`: the ECE difference to raw "
          "and its 95 % interval from a bootstrap over prompts. Depths under the label floor are shown, not counted."),
         ""]
    shown = [{**r, "temperature": "?" if r["temperature"] is None else f"{r['temperature']:g}",
              "depth": f"{r['depth']}" + ("" if r["counted"] else " (under floor)"),
              **{f"diff_{k}_ci": f"{r[f'diff_{k}']:+.4f} [{r[f'diff_{k}_lo']:+.4f}, {r[f'diff_{k}_hi']:+.4f}]"
                 for k in VARIANTS},
              "verdict": ("worse: " + ", ".join(k for k in VARIANTS if r[f"worse_{k}"])
                          if any(r[f"worse_{k}"] for k in VARIANTS) else "not worse")} for r in rows]
    return L + [table(shown, DEPTH_COLS), ""]
