"""metrics.json and report.md, written atomically (temp file + rename)."""

from __future__ import annotations

import json
import math
from pathlib import Path

from calib.atomic import write_text_atomic


def _clean(x):
    if isinstance(x, float) and not math.isfinite(x):
        return None  # JSON has no NaN; null = undefined (e.g. AUROC with one class)
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items() if not str(k).startswith("_")}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    if hasattr(x, "item"):
        return _clean(x.item())
    return x


def write_metrics(path, obj: dict) -> Path:
    return write_text_atomic(path, json.dumps(_clean(obj), indent=2) + "\n")


def _f(x, nd=3):
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "–"
    if isinstance(x, (list, tuple)):
        return "[" + ", ".join(_f(v, nd) for v in x) + "]"
    if isinstance(x, float):
        return f"{x:.{nd}f}"
    return str(x)


def table(rows, cols, headers=None) -> str:
    headers = headers or cols
    out = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        out.append("| " + " | ".join(_f(r.get(c)) for c in cols) + " |")
    return "\n".join(out)


def ladder_notes(ladder) -> list[str]:
    """Sanity checks the report states instead of hiding: oracle on top, and who loses to no_spec, why."""
    notes = []
    by = {}
    for r in ladder:
        by.setdefault((r["bank"], r["category"], r["batch_size"], r["cost_model"]), {})[r["policy"]] = r
    above_oracle, below_nospec = [], {}
    for key, pols in by.items():
        g_or = pols.get("oracle", {}).get("goodput")
        g_ns = pols.get("no_spec", {}).get("goodput")
        for name, r in pols.items():
            if g_or is not None and name != "oracle" and r["goodput"] > g_or * (1 + 1e-9):
                above_oracle.append(f"{name} @ {key}")
            if g_ns is not None and name not in ("no_spec",) and r["goodput"] < g_ns * (1 - 1e-9):
                below_nospec.setdefault(name, []).append(key)
    if above_oracle:
        notes.append("**Oracle is not on top** in " + str(len(above_oracle)) + " settings: "
                     + "; ".join(above_oracle[:8]) + ". The oracle maximises each step's goodput; the ladder"
                     " reports a ratio of sums over steps, which a per-step optimum need not maximise.")
    else:
        notes.append("Oracle ≥ every policy in every setting.")
    reasons = {
        "fixed": "verifies γ tokens for every request whatever its odds: where acceptance is low or the "
                 "per-position cost is high, the extra positions cost more than the tokens they bring",
        "homogeneous": "γ comes from the training split's pooled acceptance curve (both categories), "
                       "not this category's",
        "gated_uniform": "pays for K draft passes to read the signal before choosing a uniform γ",
        "ragged_raw": "raw confidences are mis-calibrated, so the goodput rule buys positions that do not "
                      "pay; it also pays for K draft passes",
        "ragged_calibrated": "pays for K draft passes before deciding (sunk drafter cost); it can verify "
                             "nothing but cannot refund the drafting",
        "two_drafter": "pays for K model-draft passes before deciding",
        "oracle": "pays drafting it cannot avoid",
    }
    fixed = {k: v for k, v in below_nospec.items() if k.startswith("fixed_")}
    if fixed:
        notes.append("Fixed γ ≥ 1 is below `no_spec` in " + ", ".join(f"{len(v)} settings (`{k}`)" for k, v in
                                                                   sorted(fixed.items()))
                     + ": " + reasons["fixed"] + ". `best_fixed` includes γ = 0 (= no_spec).")
    for name, keys in sorted(below_nospec.items()):
        if name.startswith("fixed_"):
            continue
        fam = name
        shown = ", ".join(f"{b}/{c}/B={bs}/{cm}" for b, c, bs, cm in keys[:6])
        more = f" (+{len(keys) - 6} more)" if len(keys) > 6 else ""
        notes.append(f"`{name}` is below `no_spec` in {len(keys)} settings ({shown}{more}): {reasons.get(fam, '')}.")
    return notes
