"""metrics.json and report.md, written atomically (temp file + rename)."""

from __future__ import annotations

import json
import math
import os
import statistics
from pathlib import Path

from calib.atomic import write_text_atomic
from calib.policies import camp_of, display_order, policy_of_row, row_order


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


# --- the Answer: best calib policy against the best peer, per (bank, cost curve) -------------------------

ANSWER_COLS = ["bank", "cost_model", "calib_policy", "calib_vs_best_fixed_mean", "calib_worst", "peer_policy",
               "peer_vs_best_fixed_mean", "ratio_mean", "ratio_min", "ratio_min_at", "oracle_vs_peer_mean"]
ANSWER_HEADERS = ["bank", "cost", "best calib", "calib / best_fixed (mean B)", "calib worst (setting)",
                  "best peer", "peer / best_fixed (mean B)", "**calib / peer** (mean B)", "calib / peer (min)",
                  "min at", "oracle / peer (mean B)"]


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def _mean(v):
    return sum(v) / len(v) if v else None


def answer_rows(ladder) -> list[dict]:
    """Per (bank, cost curve), in ladder order: the best ``calib`` policy against the best ``peer`` (camps
    from the registry, :func:`calib.policies.camp_of`).

    Best = highest mean over batch sizes of ``vs_best_fixed`` on category ``all`` (ties: the first in
    display order). Per row: ``calib_policy``/``peer_policy``, their ``*_vs_best_fixed_mean``; the calib
    policy's lowest ``vs_best_fixed`` over every (category, B) (``calib_vs_best_fixed_min`` at
    ``calib_min_category``/``calib_min_batch_size``); ``cells`` (:func:`answer_cells`): per (category, B),
    calib's best row there against the best peer row there; ``ratio_mean`` = mean over B of those cells'
    ratios on ``all``; ``ratio_min`` = the lowest over every cell (at ``ratio_min_category``/
    ``ratio_min_batch_size``); ``oracle_vs_peer_mean`` = mean over B of oracle / best peer on ``all`` (the
    headroom left); ``calib_beats_peer`` = ``ratio_mean > 1``. A camp with no rows in the pair leaves its
    fields None. Peers are the arms a vLLM user could deploy (:data:`calib.policies.CAMP_DEFAULTS`): on a
    model-drafter bank, vLLM's fixed K of the n-gram chain its rounds carry (``second_fixed_<K>``) too."""
    pairs: dict[tuple, list] = {}
    for r in ladder:
        pairs.setdefault((r["bank"], r["cost_model"]), []).append(r)
    return [_answer_pair(bank, cm, rows) for (bank, cm), rows in pairs.items()]


def _answer_pair(bank: str, cm: str, rows: list[dict]) -> dict:
    """:func:`answer_rows`' row for one (bank, cost curve)'s ladder rows."""
    vbf = {(r["category"], r["batch_size"], r["policy"]): r["vs_best_fixed"] for r in rows}
    names = row_order(rows)
    camp = {n: camp_of(policy_of_row(n)) for n in names}
    bs = sorted({r["batch_size"] for r in rows})

    def mean_all(n):
        return _mean([vbf[("all", b, n)] for b in bs if _finite(vbf.get(("all", b, n)))])

    def best(c):
        cands = [(n, m) for n in names if camp[n] == c and (m := mean_all(n)) is not None]
        return max(cands, key=lambda t: t[1])[0] if cands else None  # max keeps the first of equals

    cal, peer = best("calib"), best("peer")
    cells = answer_cells(rows, camp)
    row = {"bank": bank, "cost_model": cm, "unit": rows[0].get("unit"), "batch_sizes": bs,
           "calib_policy": cal, "calib_vs_best_fixed_mean": mean_all(cal) if cal else None,
           "calib_vs_best_fixed_min": None, "calib_min_category": None, "calib_min_batch_size": None,
           "peer_policy": peer, "peer_vs_best_fixed_mean": mean_all(peer) if peer else None,
           "ratio_mean": None, "ratio_min": None, "ratio_min_category": None, "ratio_min_batch_size": None,
           "ratio_min_calib": None, "ratio_min_peer": None,
           "oracle_vs_peer_mean": None, "calib_beats_peer": None,
           "calib_camp": [n for n in names if camp[n] == "calib"],
           "peer_camp": [n for n in names if camp[n] == "peer"], "cells": cells}
    if cal:
        worst = [(v, c, b) for (c, b, n), v in vbf.items() if n == cal and _finite(v)]
        if worst:
            v, c, b = min(worst, key=lambda t: t[0])
            row.update(calib_vs_best_fixed_min=v, calib_min_category=c, calib_min_batch_size=b)
    # per cell, calib's best there against the best peer there (not the pair's average winners)
    ratio = {(c["category"], c["batch_size"]): c["ratio"] for c in cells if c["ratio"] is not None}
    if ratio:
        row["ratio_mean"] = _mean([ratio[("all", b)] for b in bs if ("all", b) in ratio])
        worst = min((c for c in cells if c["ratio"] is not None), key=lambda c: c["ratio"])
        row.update(ratio_min=worst["ratio"], ratio_min_category=worst["category"],
                   ratio_min_batch_size=worst["batch_size"], ratio_min_calib=worst["calib"],
                   ratio_min_peer=worst["peer"])
        row["calib_beats_peer"] = None if row["ratio_mean"] is None else bool(row["ratio_mean"] > 1)
    row["oracle_vs_peer_mean"] = _mean([c["oracle_vs_peer"] for c in cells
                                        if c["category"] == "all" and c["oracle_vs_peer"] is not None])
    return row


def answer_cells(rows: list[dict], camp: dict[str, str]) -> list[dict]:
    """Per (category, B) of one (bank, cost curve)'s ladder rows: the best ``calib`` row there against the best
    ``peer`` row there (goodput), the oracle's ratio to that peer, and the headroom captured
    ``(calib − peer) / (oracle − peer)`` (None where the oracle is not above the peer)."""
    by_cell: dict[tuple, dict[str, float]] = {}
    for r in rows:
        if _finite(r["goodput"]):
            by_cell.setdefault((r["category"], r["batch_size"]), {})[r["policy"]] = r["goodput"]
    out = []
    for (c, b), gp in by_cell.items():
        best = {k: max(((n, g) for n, g in gp.items() if camp.get(n) == k), key=lambda t: t[1], default=None)
                for k in ("calib", "peer")}
        cal, peer, orc = best["calib"], best["peer"], gp.get("oracle")
        ok = peer is not None and peer[1] > 0
        out.append({"category": c, "batch_size": b, "calib": cal and cal[0], "peer": peer and peer[0],
                    "ratio": cal[1] / peer[1] if (cal and ok) else None,
                    "oracle_vs_peer": orc / peer[1] if (orc is not None and ok) else None,
                    "headroom_captured": ((cal[1] - peer[1]) / (orc - peer[1])
                                          if (cal and ok and orc is not None and orc - peer[1] > 1e-12 * peer[1])
                                          else None)})
    return out


def answer_verdict(answer) -> str:
    """One sentence: in how many (bank, cost) pairs calib's best beats the best peer, and the worst setting."""
    scored = [a for a in answer if a["calib_beats_peer"] is not None]
    if not scored:
        return "**No (bank, cost) pair has both a calib and a peer policy to compare.**"
    wins = sum(a["calib_beats_peer"] for a in scored)
    everywhere = sum(a["ratio_min"] is not None and a["ratio_min"] >= 1 for a in scored)
    w = min((a for a in scored if a["ratio_min"] is not None), key=lambda a: a["ratio_min"], default=None)
    s = (f"**Replayed (a prediction from the banks, not a clock): calib beats the best peer in {wins} of "
         f"{len(scored)} (bank, cost) pairs** (mean over B of the goodput ratio on category `all`); it is at "
         f"least the peer in every (category, B) in {everywhere} of them")
    if w is not None:
        s += (f"; worst setting: calib / peer = {w['ratio_min']:.3f} (`{w['ratio_min_calib']}` vs `{w['ratio_min_peer']}`, "
              f"`{w['bank']}`, cost `{w['cost_model']}`, {w['ratio_min_category']}, B={w['ratio_min_batch_size']})")
    missing = [a for a in answer if a["calib_beats_peer"] is None]
    if missing:
        s += "; not compared (a camp has no rows): " + ", ".join(f"`{a['bank']}`/`{a['cost_model']}`" for a in missing)
    return s + "."


def newest_serving_bench(where) -> Path | None:
    """The serving bench's JSON a report cites: ``where`` itself (a file), or in a folder its newest grid manifest
    (``grid-*.json``: each cell of the grid from its latest run, docs/bench), else its newest ``serve-*.json`` (by
    its recorded date, then name); None when there is none."""
    if where is None:
        return None
    where = Path(where)
    if where.is_file():
        return where
    grids = sorted(where.glob("grid-*.json")) if where.is_dir() else []
    if grids:
        return grids[-1]
    found = []
    for p in sorted(where.glob("serve-*.json")) if where.is_dir() else []:
        try:
            d = json.loads(p.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(d, dict) and isinstance(d.get("table"), list):
            found.append((str(d.get("date", "")), p.name, p))
    return max(found)[2] if found else None


def clock_summary(bench: Path | None, tables_sha256: str | None) -> dict | None:
    """The serving bench's answer (a clock) from its JSON: per cell, calib's best arm over the best vLLM arm (no
    speculation included), the headroom captured where the bench ran an oracle arm, and the replay's prediction
    error; min / median / max over the cells; and whose tables it served (these only when it records their
    tables.json digest). None without a bench."""
    if bench is None:
        return None
    from calib.evaluate import clock

    d = json.loads(Path(bench).read_text())
    if "sources" in d:  # a grid manifest: one table of each cell's latest run
        d = _grid_as_bench(d, Path(bench))
    calib_arms = [a for a in d.get("arms", []) if a in clock.calib_arms()]
    figures = clock.answer_figures(d["table"])  # the same figures the README's clock block states
    recorded = d.get("tables_sha256")
    whose = ("these" if recorded and tables_sha256 and recorded == tables_sha256
             else "other" if recorded else "unrecorded")

    def spread(v):
        return None if not v else {"min": min(v), "median": statistics.median(v), "max": max(v), "cells": len(v)}

    ident = d.get("identity_float32_greedy") or {}
    return {"bench": str(bench), "command": d.get("command", "python bench/serve.py"), "date": d.get("date"),
            "cpu": d.get("cpu"), "cells": len(d["table"]), "tables": whose, "tables_sha256": recorded,
            "calib_arms": calib_arms, "calib_best_vs_best_vllm": spread(figures["best"]),
            "headroom_captured": spread(figures["headroom"]),
            "headroom_captured_decode": spread(figures["headroom_decode"]),
            "prediction_abs_error": spread(figures["errors"]),
            "per_arm": {a: [r["ratio_to_best_vllm"][a] for r in d["table"] if a in r.get("ratio_to_best_vllm", {})]
                        for a in calib_arms},
            "identical": (all(v.get("identical") == v.get("prompts") for v in ident.values()) if ident else None)}


def _grid_as_bench(manifest: dict, path: Path) -> dict:
    """A grid manifest read as one bench: its cells' latest rows (calib.evaluate.clock_blocks.latest_cells, paths
    relative to the project root the manifest's folder sits two levels under, docs/bench/), the newest run's
    date and CPU, and the tables digest where every run recorded the same one."""
    from calib.evaluate.clock_blocks import latest_cells

    cells = latest_cells(manifest, path.resolve().parents[2])
    runs = {src: res for _, src, res in cells}
    shas = {res.get("tables_sha256") for res in runs.values()}
    newest = max(runs.values(), key=lambda r: str(r.get("date", "")))
    return {"command": f"each cell's latest of {len(runs)} runs: python bench/serve.py --from-json {path.name}",
            "date": newest.get("date"), "cpu": newest.get("cpu"), "table": [row for row, _, _ in cells],
            "arms": sorted({a for res in runs.values() for a in res.get("arms", [])}),
            "tables_sha256": shas.pop() if len(shas) == 1 else (f"{len(shas)} digests" if any(shas) else None)}


def _digest(sha) -> str:
    """A recorded tables digest as the report shows it: a sha256 shortened, anything else (a grid's "2 digests") whole."""
    sha = str(sha)
    return f"{sha[:12]}…" if len(sha) == 64 else sha


def clock_lines(clock: dict | None, out: Path | None = None) -> list[str]:
    """The report's answer, measured (:func:`clock_summary`): calib's best arm over the best vLLM arm per cell,
    the headroom captured and the replay's error, linked relative to the report's folder ``out``."""
    if clock is None:
        return [("**On a clock — the answer:** no serving bench found (`python bench/serve.py --tables DIR` "
                 "measures one)."), ""]
    bench = Path(clock["bench"])
    link = os.path.relpath(bench, out) if out is not None else bench.name
    whose = {"these": "these tables",
             "other": f"**other tables** (tables.json sha256 {_digest(clock['tables_sha256'])}, not these)",
             "unrecorded": "tables it does not record (an older bench: **not necessarily these tables**)"}[clock["tables"]]
    b, h, e = clock["calib_best_vs_best_vllm"], clock["headroom_captured"], clock["prediction_abs_error"]
    hd = clock.get("headroom_captured_decode")  # the same quotient in the decode state (older reports: absent)
    s = (f"**On a clock — the answer** (`{clock['command']}`, {clock.get('date') or '?'}, {clock.get('cpu') or '?'}; "
         f"[{bench.name}]({link}); it served {whose}): ")
    s += (f"calib's best arm is **{b['min']:.2f}–{b['max']:.2f}× the best vLLM arm** (no speculation included; "
          f"median {b['median']:.2f}× over {b['cells']} cells)" if b else "no cell with a calib arm")
    if h:
        s += (f"; headroom captured (calib − best vLLM) / (clock oracle − best vLLM) {h['min']:.0%}–{h['max']:.0%} "
              f"(median {0.0 if abs(h['median']) < 0.005 else h['median']:.0%}, {h['cells']} greedy cells)")
    elif hd:
        s += "; headroom captured by output tok/s: no cell's oracle 2 % above the best vLLM arm"
    else:
        s += "; headroom captured: not measured (the bench ran no oracle arm)"
    if hd:
        s += (f" ({hd['min']:.0%}–{hd['max']:.0%} in the decode state, prefill and each cell's draining tail left "
              f"out, {hd['cells']} cells)")
    per_arm = ", ".join(f"`{a}` {min(v):.2f}–{max(v):.2f}×" for a, v in clock["per_arm"].items() if v)
    if per_arm:
        s += f"; per arm: {per_arm}"
    if clock.get("identical") is not None:
        s += f"; float32 greedy outputs identical to no speculation: {'yes' if clock['identical'] else 'no'}"
    lines = [s + ".", ""]
    if e:
        lines += [(f"The replay below is a prediction: its speed-up over no speculation missed the clock's decode "
                   f"speed-up by {e['median']:.0%} (median) to {e['max']:.0%} (worst) over {e['cells']} (cell, arm) "
                   "pairs of that bench."), ""]
    return lines


def cell_lines(answer) -> list[str]:
    """Per cell (bank, category, B) of the engine's step cost (else the first cost curve): calib's best row
    there, the best peer there, their ratio, the oracle's and the headroom captured, in a folded block."""
    cms = [a["cost_model"] for a in answer]
    cm = "engine" if "engine" in cms else (cms[0] if cms else None)
    rows = [{"bank": f"`{a['bank']}`", "category": c["category"], "B": c["batch_size"],
             "calib": c["calib"] and f"`{c['calib']}`", "peer": c["peer"] and f"`{c['peer']}`",
             "ratio": c["ratio"], "oracle": c["oracle_vs_peer"], "headroom": c["headroom_captured"]}
            for a in answer if a["cost_model"] == cm for c in a.get("cells", []) if c["category"] != "all"]
    if not rows:
        return []
    return ["<details><summary>Per cell (replayed, cost <code>" + str(cm) + "</code>): calib's best against the "
            "best peer of the same cell, the oracle, the headroom captured</summary>", "",
            table(rows, ["bank", "category", "B", "calib", "peer", "ratio", "oracle", "headroom"],
                  ["bank", "category", "B", "best calib", "best peer", "calib / peer", "oracle / peer",
                   "headroom captured"]), "", "</details>", ""]


def answer_lines(answer, picture: str | None = None, clock: list[str] | None = None) -> list[str]:
    """The report's first section: the clock first (the answer), then the replay's verdict (a prediction),
    its table, per-cell figures, what the columns mean, the figure."""
    L = ["## Answer", "", *(clock or []), answer_verdict(answer), ""]
    rows = [{**a, "calib_worst": (f"{_f(a['calib_vs_best_fixed_min'])} ({a['calib_min_category']}, "
                                  f"B={a['calib_min_batch_size']})" if a["calib_vs_best_fixed_min"] is not None else None),
             "ratio_min_at": (f"{a['ratio_min_category']}, B={a['ratio_min_batch_size']}"
                              if a["ratio_min"] is not None else None),
             "calib_policy": f"`{a['calib_policy']}`" if a["calib_policy"] else None,
             "peer_policy": f"`{a['peer_policy']}`" if a["peer_policy"] else None} for a in answer]
    L.append(table(rows, ANSWER_COLS, ANSWER_HEADERS))
    L += ["", *cell_lines(answer)]
    camps = {}
    for a in answer:
        for c in ("calib", "peer"):
            camps.setdefault(c, [])
            camps[c] += [n for n in a[f"{c}_camp"] if n not in camps[c]]
    L += [("Best calib / best peer = highest goodput / best_fixed on category `all`, averaged over the batch "
           "sizes B; the ratios compare, per (category, B) cell of the replay below, calib's best row there with "
           "the best peer row there: mean over B on `all`, min over every cell. `calib worst` = the best calib "
           "policy's lowest goodput / best_fixed over every cell. oracle / peer = the headroom left above the best "
           "peer. Camps come from the policy registry (`Policy.camp`): calib (what calib serves) = "
           + (", ".join(f"`{n}`" for n in camps.get("calib", [])) or "none")
           + "; peer (the arms a vLLM user could deploy instead: no speculation, vLLM's fixed K of every drafter "
             "the bank records — `second_fixed_*` is vLLM's n-gram arm on a model-drafter bank — Dynamic SD, V2 "
             "adaptive verification) = "
           + (", ".join(f"`{n}`" for n in camps.get("peer", [])) or "none")
           + ". `best_fixed` (γ in hindsight per setting) and the replay-only allocators are references, not "
             "in the answer."), ""]
    if picture:
        L += [f"![answer]({picture})", ""]
    return L
