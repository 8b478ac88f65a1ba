"""metrics.json and report.md, written atomically (temp file + rename)."""

from __future__ import annotations

import json
import math
from pathlib import Path

from calib.atomic import write_text_atomic
from calib.evaluate.policies import display_order, policy_of_row, row_order


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


# Issue 13's target for accepted-length prediction: within 5 % of the actual mean on every slice large
# enough to tell (≥ 2,000 rounds; a smaller slice's mean moves by more than that from noise alone).
SLICE_MIN_ROUNDS = 2000
SLICE_MAX_ERROR = 0.05


def length_slices(length, min_rounds: int = SLICE_MIN_ROUNDS, max_error: float = SLICE_MAX_ERROR,
                  noise: dict | None = None) -> list[dict]:
    """Relative error of the predicted mean accepted length per (temperature, chain, category, bank).

    ``length`` are metrics.json's ``accept_length`` rows. One row per slice with ``rounds`` (test
    rounds), ``actual_mean``, ``predicted_calibrated`` / ``error_calibrated`` and, where the chain has a
    raw confidence, ``predicted_raw`` / ``error_raw``; error = ``|predicted − actual| / actual`` of the
    slice means (None when the actual mean is 0). ``flagged``: the slice has ``≥ min_rounds`` rounds
    and its calibrated error exceeds ``max_error``. Slices of different banks are not pooled: an
    over- and an under-predicting bank would cancel. Sorted by temperature, chain, bank, category.

    ``noise`` (:func:`calib.evaluate.calibration.length_noise`, keyed by (temperature, chain,
    category, bank)) adds ``prompts`` (distinct prompts in the slice), ``actual_ci`` (95 % interval
    of the actual mean, whole prompts resampled) and ``within_noise`` (the calibrated prediction lies
    inside ``actual_ci``; None without a calibrated prediction or an interval) to the slices it covers.
    """
    by: dict[tuple, dict] = {}
    for r in length:
        key = (r.get("temperature"), r["drafter"], r["category"], r["bank"])
        s = by.setdefault(key, {"temperature": key[0], "chain": key[1], "category": key[2], "bank": key[3],
                                "rounds": r["n"], "actual_mean": r["actual_mean"]})
        err = (abs(r["predicted_mean"] - r["actual_mean"]) / r["actual_mean"]
               if r["n"] and r["actual_mean"] and math.isfinite(r["predicted_mean"]) else None)
        s[f"predicted_{r['variant']}"] = r["predicted_mean"]
        s[f"error_{r['variant']}"] = err
    out = []
    for s in by.values():
        e = s.get("error_calibrated")
        s["flagged"] = bool(s["rounds"] >= min_rounds and e is not None and e > max_error)
        nz = (noise or {}).get((s["temperature"], s["chain"], s["category"], s["bank"]))
        if nz is not None:
            lo, hi = nz["actual_ci"]
            pred = s.get("predicted_calibrated")
            s["prompts"] = nz["prompts"]
            s["actual_ci"] = [lo, hi]
            s["within_noise"] = (bool(lo <= pred <= hi) if pred is not None and all(
                isinstance(x, (int, float)) and math.isfinite(x) for x in (lo, hi, pred)) else None)
        out.append(s)
    return sorted(out, key=lambda s: (s["temperature"] is None, s["temperature"] or 0.0, s["chain"], s["bank"],
                                      s["category"] == "all", s["category"]))


def length_headline(slices, min_rounds: int = SLICE_MIN_ROUNDS, max_error: float = SLICE_MAX_ERROR) -> str:
    """One sentence: the worst calibrated slice error, among slices large enough for the target and overall."""
    def worst(rows):
        rows = [s for s in rows if s.get("error_calibrated") is not None]
        return max(rows, key=lambda s: s["error_calibrated"]) if rows else None

    def say(s):
        t = "T=?" if s["temperature"] is None else f"T={s['temperature']:g}"
        return (f"{s['error_calibrated']:.1%} ({t}, {s['chain']} chain, {s['category']}, `{s['bank']}`, "
                f"{s['rounds']:,} rounds: predicted {s['predicted_calibrated']:.3f} vs actual {s['actual_mean']:.3f})")

    big = [s for s in slices if s["rounds"] >= min_rounds]
    flagged = [s for s in big if s["flagged"]]
    w_all, w_big = worst(slices), worst(big)
    if w_all is None:
        return "Accepted length: no slice has a calibrated prediction to score."
    head = (f"**Accepted length: worst calibrated slice error {say(w_big)}** among the slices with ≥ "
            f"{min_rounds:,} rounds; {len(flagged)} of {len(big)} such slices exceed the {max_error:.0%} target"
            + noise_clause(flagged) + "."
            if w_big else f"**Accepted length: no slice has ≥ {min_rounds:,} test rounds**, so none is held to the "
                          f"{max_error:.0%} target.")
    if w_big is not w_all:
        head += f" Worst over all {len(slices)} slices: {say(w_all)}."
    return head


def noise_clause(flagged) -> str:
    """``", N of them within prompt-sampling noise (...)"`` for flagged slices carrying ``within_noise``;
    empty when none carries it (no bootstrap was run)."""
    known = [s for s in flagged if s.get("within_noise") is not None]
    if not known:
        return ""
    k = sum(s["within_noise"] for s in known)
    return (f", {k} of {'them' if len(known) == len(flagged) else f'the {len(known)} with an interval'} within "
            "prompt-sampling noise (calibrated prediction inside the 95% prompt-bootstrap interval of the "
            "actual mean)")


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
    reason = {}  # row -> the registered policy's one line on why it can fall below no_spec
    for name in below_nospec:
        p = policy_of_row(name)
        reason[name] = p.below_no_spec if p is not None else ""
    family = {k: v for k, v in below_nospec.items() if (p := policy_of_row(k)) is not None and p.family}
    by_family: dict = {}
    for k, v in sorted(family.items()):
        by_family.setdefault(policy_of_row(k).name, []).append((k, v))
    for fam, members in by_family.items():
        notes.append(f"`{fam}_*` is below `no_spec` in " + ", ".join(f"{len(v)} settings (`{k}`)" for k, v in members)
                     + ": " + reason[members[0][0]] + ".")
    for name, keys in sorted(below_nospec.items()):
        if name in family:
            continue
        shown = ", ".join(f"{b}/{c}/B={bs}/{cm}" for b, c, bs, cm in keys[:6])
        more = f" (+{len(keys) - 6} more)" if len(keys) > 6 else ""
        notes.append(f"`{name}` is below `no_spec` in {len(keys)} settings ({shown}{more}): {reason[name]}.")
    return notes


def ladder_policy_rows(ladder) -> list[str]:
    """The ladder's policy rows in report order: the registry's display order, a family's rows (``fixed_<γ>``)
    where the family sits."""
    return row_order(ladder)


def policy_lines(ladder) -> list[str]:
    """One report line per registered policy with rows in ``ladder`` (display order): its explanation."""
    present = {r["policy"] for r in ladder}
    return [f"- `{p.name + '_*' if p.family else p.name}`: {p.explanation}"
            for p in display_order() if any(p.owns(n) for n in present)]
