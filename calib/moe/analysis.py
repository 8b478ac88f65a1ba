"""Analysis of a routing capture: popularity, distinct experts by shape, overlap by distance, the three
distinct-count models' errors on held-out requests, MoE cost curves and the width-vs-depth break-even.

``python -m calib.moe`` (stage ``analyze``) runs :func:`run_analysis`; outputs in ``analyze.out_dir``:
``metrics.json``, ``report.md`` and PNGs (also logged to W&B, offline by default).

Error definition: for each shape configuration (e.g. depth N = 4, or B = 8 sequences with random
depths) the *measured* value is the mean distinct-expert count per layer over random draws from the
held-out requests, the *predicted* value the model's expectation for the same draws (fitted on the
other requests). MARE = mean over configurations and layers of |predicted − measured| / measured
(N = 1 is left out: every model is exact there).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import numpy as np

from calib.atomic import write_text_atomic
from calib.cost.distinct import MODELS
from calib.cost.moe import MoECost, break_even_alpha, shape_counts
from calib.cost.trajectories import Trajectories

log = logging.getLogger("calib.moe")

FAMILIES = ("depth", "same_seq_random", "width", "mixed")
ERROR_FAMILIES = ("depth", "width", "mixed")


# -- drawing shapes from trajectories -------------------------------------------------------------
def draw(tr: Trajectories, family: str, n: int, samples: int, rng: np.random.Generator, max_depth: int = 5):
    """``samples`` draws of one shape family: lists of (sequence, positions) and the shape of each."""
    lengths = np.array([s.shape[0] for s in tr.seqs])
    draws, shapes = [], []
    for _ in range(samples):
        if family in ("depth", "same_seq_random"):
            ok = np.flatnonzero(lengths >= n)
            if ok.size == 0:
                raise ValueError(f"no held-out sequence has {n} positions (longest: {lengths.max()})")
            s = int(rng.choice(ok))
            if family == "depth":
                start = int(rng.integers(0, lengths[s] - n + 1))
                pos = np.arange(start, start + n)
            else:
                pos = np.sort(rng.choice(lengths[s], size=n, replace=False))
            draws.append([(s, pos)])
            shapes.append([n])
        elif family == "width":
            seqs = _distinct_requests(tr, n, lengths, rng)
            draws.append([(int(s), np.array([int(rng.integers(0, lengths[s]))])) for s in seqs])
            shapes.append([1] * len(seqs))
        elif family == "mixed":
            seqs = _distinct_requests(tr, n, lengths, rng)
            item, shape = [], []
            for s in seqs:
                d = int(min(1 + rng.integers(0, max_depth), lengths[s]))
                start = int(rng.integers(0, lengths[s] - d + 1))
                item.append((int(s), np.arange(start, start + d)))
                shape.append(d)
            draws.append(item)
            shapes.append(shape)
        else:
            raise ValueError(f"unknown shape family {family!r}")
    return draws, shapes


def _distinct_requests(tr: Trajectories, n: int, lengths: np.ndarray, rng: np.random.Generator) -> list[int]:
    """One segment from each of ``n`` different requests (a segment chosen in proportion to its length,
    so every position of a request is equally likely)."""
    reqs = np.unique(tr.request)
    out = []
    for r in rng.choice(reqs, size=min(n, reqs.size), replace=False):
        segs = np.flatnonzero(tr.request == r)
        out.append(int(rng.choice(segs, p=lengths[segs] / lengths[segs].sum())))
    return out


def distinct(tr: Trajectories, draws) -> np.ndarray:
    """[draws, layers] distinct experts each draw routes to."""
    out = np.empty((len(draws), tr.layers))
    for i, item in enumerate(draws):
        used = np.zeros((tr.layers, tr.n_experts), dtype=bool)
        for s, pos in item:
            used |= tr.seqs[s][pos].any(axis=0)
        out[i] = used.sum(axis=1)
    return out


# -- descriptive statistics -------------------------------------------------------------------------
def popularity_fits(marginals: np.ndarray, top_k: int) -> list[dict]:
    """Per layer: share vs rank, least-squares fits of log share on rank (exponential) and on log rank
    (power law), with R² in log space."""
    rows = []
    for l, m in enumerate(marginals):
        share = np.sort(m / top_k)[::-1]
        rank = np.arange(1, share.size + 1)
        ok = share > 0
        y = np.log(share[ok])
        row = {"layer": l, "top_share": float(share[0]), "bottom_share": float(share[-1])}
        for name, x in (("exp", rank[ok].astype(float)), ("power", np.log(rank[ok]))):
            slope, icpt = np.polyfit(x, y, 1)
            resid = y - (slope * x + icpt)
            r2 = 1 - resid.var() / y.var() if y.var() > 0 else 1.0
            row[f"{name}_slope"], row[f"{name}_r2"] = float(slope), float(r2)
        rows.append(row)
    return rows


def overlap_by_distance(tr: Trajectories, max_distance: int, rng: np.random.Generator, pairs: int = 4000):
    """Mean |S_p ∩ S_{p+δ}| / k over positions and layers for δ = 1..max_distance (same sequence), and
    for random pairs of positions of different sequences."""
    same = []
    for d in range(1, max_distance + 1):
        num, den = 0.0, 0
        for s in tr.seqs:
            if s.shape[0] > d:
                num += (s[:-d] & s[d:]).sum()
                den += (s.shape[0] - d) * s.shape[1]
        same.append(num / den / tr.top_k if den else np.nan)
    lengths = [s.shape[0] for s in tr.seqs]
    a = rng.integers(0, len(tr), pairs)
    b = rng.integers(0, len(tr), pairs)
    ok = tr.request[a] != tr.request[b]
    cross = np.mean([(tr.seqs[i][rng.integers(0, lengths[i])] & tr.seqs[j][rng.integers(0, lengths[j])]).sum()
                     / (tr.layers * tr.top_k) for i, j in zip(a[ok], b[ok])])
    return np.array(same), float(cross)


# -- the errors table -------------------------------------------------------------------------------
def evaluate_models(fit: Trajectories, held: Trajectories, a: dict, rng: np.random.Generator):
    models = {"uniform": MODELS["uniform"]().fit(fit),
              "independent": MODELS["independent"]().fit(fit),
              "maxent": MODELS["maxent"](max_chain=int(a["max_chain"]), max_iter=int(a["ipf_iters"]),
                                         tol=float(a["ipf_tol"])).fit(fit)}
    configs = {"depth": a["depth_n"], "same_seq_random": a["depth_n"], "width": a["width_n"], "mixed": a["mixed_b"]}
    curves, errors = [], {}
    for family, ns in configs.items():
        for n in ns:
            n = int(n)
            if family in ("width", "mixed") and n > held.n_requests:
                continue
            if family in ("depth", "same_seq_random") and n > max(s.shape[0] for s in held.seqs):
                continue
            draws, shapes = draw(held, family, n, int(a["samples"]), rng, int(a["mixed_max_depth"]))
            measured = distinct(held, draws).mean(axis=0)  # [L]
            counts = shape_counts(shapes)
            row = {"family": family, "n": n, "positions": float(np.mean([sum(s) for s in shapes])),
                   "measured": measured}
            for name, m in models.items():
                row[name] = m.predict_counts(counts).mean(axis=0)
            curves.append(row)
            if family in ERROR_FAMILIES and n > 1:
                for name in models:
                    rel = np.abs(row[name] - measured) / measured
                    tot = abs(row[name].sum() - measured.sum()) / measured.sum()
                    errors.setdefault((family, name), {"layer": [], "total": []})
                    errors[(family, name)]["layer"].append(rel.mean())
                    errors[(family, name)]["total"].append(tot)
    table = []
    for family in ERROR_FAMILIES:
        for name in models:
            e = errors.get((family, name))
            if e:
                table.append({"family": family, "model": name, "mare_per_layer": float(np.mean(e["layer"])),
                              "mare_total": float(np.mean(e["total"])), "configs": len(e["layer"])})
    for name in models:
        ls = [r["mare_per_layer"] for r in table if r["model"] == name]
        ts = [r["mare_total"] for r in table if r["model"] == name]
        if not ls:
            continue
        table.append({"family": "all", "model": name, "mare_per_layer": float(np.mean(ls)),
                      "mare_total": float(np.mean(ts)), "configs": sum(r["configs"] for r in table
                                                                      if r["model"] == name)})
    ipf = {int(d): {"sweeps": int(v[1]), "max_constraint_error": float(v[2])}
           for d, v in models["maxent"].ipf_.items()}
    return models, curves, table, ipf


def aggregate_splits(tables: list[list[dict]]) -> list[dict]:
    """Mean (and spread) of each (shape family, model) error over repeated splits."""
    out = []
    for row in tables[0]:
        same = [r for t in tables for r in t if r["family"] == row["family"] and r["model"] == row["model"]]
        layer = np.array([r["mare_per_layer"] for r in same])
        total = np.array([r["mare_total"] for r in same])
        out.append({"family": row["family"], "model": row["model"], "mare_per_layer": float(layer.mean()),
                    "mare_per_layer_min": float(layer.min()), "mare_per_layer_max": float(layer.max()),
                    "mare_total": float(total.mean()), "configs": row["configs"], "splits": len(same)})
    return out


def load_cost_configs(names, root) -> dict:
    from omegaconf import OmegaConf

    out = {}
    for name in names:
        path = Path(root) / "conf" / "cost" / f"{name}.yaml"
        out[name] = OmegaConf.to_container(OmegaConf.load(path), resolve=True)[name]
    return out


def run_analysis(c: dict, root: str | Path = ".") -> dict:
    """Fit and score the distinct-expert models on the capture ``c.analyze.routing``; write
    metrics.json, report.md and the pictures to ``c.analyze.out_dir``."""
    from calib.atomic import write_json_atomic
    from calib.bank import read_routing

    t0 = time.perf_counter()
    a = c["analyze"]
    root = Path(root)
    bank = Path(a["routing"]) if Path(a["routing"]).is_absolute() else root / a["routing"]
    out = Path(a["out_dir"]) if Path(a["out_dir"]).is_absolute() else root / a["out_dir"]
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(int(a["seed"]))
    tr = Trajectories.from_bank(bank)
    fit, held = tr.split(float(a["heldout_fraction"]), int(a["seed"]))
    info = read_routing(bank, validate_on_open=False).info
    log.info("routing capture %s: %d requests (%d fit, %d held out), %d layers, %d experts, top-%d, proxy=%s",
             bank, tr.n_requests, fit.n_requests, held.n_requests, tr.layers, tr.n_experts, tr.top_k,
             info.get("proxy"))

    models, curves, ipf, table = score_on_splits(tr, a)
    pop = popularity_fits(tr.marginals(), tr.top_k)
    same, cross = overlap_by_distance(tr, 32, rng)
    be = width_vs_depth(tr, models, int(a["samples"]), rng)
    acc0 = _first_draft_acceptance(bank)
    cost_models = capture_cost_models(load_cost_configs(a.get("cost") or [], root), bank, root)
    pics = draw_pictures(out, tr, pop, curves, same, cross, be, acc0, cost_models, proxy=bool(info.get("proxy")))

    metrics = {"routing": str(bank), "routing_info": info,
               "requests": {"all": tr.n_requests, "fit": fit.n_requests, "heldout": held.n_requests,
                            "segments": len(tr)},
               "errors": table, "ipf": ipf, "break_even": be, "first_draft_acceptance": acc0,
               "popularity": pop, "overlap_same_sequence": same.tolist(), "overlap_other_sequence": cross,
               "curves": [{k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in r.items()} for r in curves],
               "runtime_s": time.perf_counter() - t0}
    write_json_atomic(out / "metrics.json", metrics)
    report = render(metrics, pics, out)
    write_text_atomic(out / "report.md", report)
    print(error_table(table))
    print(f"break-even alpha (2 positions, batch 1): measured {be['measured']['alpha']:.3f}, "
          + ", ".join(f"{k} {v['alpha']:.3f}" for k, v in be.items() if k != "measured"))
    print(f"-> {out}/report.md, metrics.json, {len(pics)} pictures ({metrics['runtime_s']:.0f} s)")
    _track(c, out, table, be, pop, pics)
    return metrics


def score_on_splits(tr: Trajectories, a: dict) -> tuple[dict, list, dict, list[dict]]:
    """The models fitted and scored on ``a.splits`` random splits by request (with a few dozen requests
    one split's error is noisy): the models of the last split (their parameters), ``curves`` and
    ``ipf`` of the first and the error table aggregated over all."""
    tables = []
    for s in range(int(a.get("splits", 1))):
        f_s, h_s = tr.split(float(a["heldout_fraction"]), int(a["seed"]) + s)
        models, c_s, t_s, ipf_s = evaluate_models(f_s, h_s, a, np.random.default_rng(int(a["seed"]) + s))
        if s == 0:
            curves, ipf = c_s, ipf_s
        tables.append(t_s)
    return models, curves, ipf, aggregate_splits(tables)


def width_vs_depth(tr: Trajectories, models: dict, samples: int, rng) -> dict:
    """Width vs depth at 2 positions: measured on every request (``20 * samples`` draws) and predicted by
    each model refitted on all; per source the experts read and the break-even acceptance α."""
    full = {name: m.__class__(**m.get_params()).fit(tr) for name, m in models.items()}
    n_be = 20 * samples
    by = {fam: {"measured": distinct(tr, draw(tr, fam, 2, n_be, rng)[0]).mean(axis=0),
                **{name: m.predict([2] if fam == "depth" else [1, 1]) for name, m in full.items()}}
          for fam in ("depth", "width")}
    be = {}
    for src in ("measured", *full):
        d2 = float(np.sum(by["depth"][src]))
        w2 = float(np.sum(by["width"][src]))
        per_layer = 2 * by["depth"][src] / by["width"][src] - 1
        be[src] = {"depth2_experts": d2, "width2_experts": w2, "alpha": break_even_alpha(d2, w2),
                   "alpha_layer_min": float(per_layer.min()), "alpha_layer_max": float(per_layer.max())}
    return be


def capture_cost_models(costs: dict, bank: Path, root: Path) -> dict:
    """``{name: MoECost}`` of the cost configs, a fitted model's routing replaced by the capture under
    analysis; a config that capture cannot drive (another model's) falls back to the uniform model."""
    cost_models = {}
    for name, cfg in costs.items():
        d = dict(cfg.get("distinct") or {})
        if d.get("routing"):
            d["routing"] = str(bank)  # the capture under analysis
            cfg = {**cfg, "distinct": d}
        try:
            cost_models[name] = MoECost(cfg, root)
        except ValueError as exc:  # a capture of another model cannot drive this config
            log.warning("cost %s: %s; falling back to the uniform model", name, exc)
            cost_models[name] = MoECost({**cfg, "distinct": {"model": "uniform"}}, root)
    return cost_models


def draw_pictures(out: Path, tr, pop, curves, same, cross, be, acc0, cost_models, proxy: bool) -> list:
    """The analysis's pictures in ``out`` (titles tagged PROXY for a proxy capture); their paths."""
    from calib.moe import plots

    plots.TAG = " (PROXY)" if proxy else ""
    pics = [plots.popularity(tr, pop, out / "popularity.png"),
            plots.distinct_by_shape(curves, tr, out / "distinct_by_shape.png"),
            plots.models_vs_measured(curves, out / "models_vs_measured.png"),
            plots.overlap(same, cross, tr, out / "overlap_by_distance.png"),
            plots.break_even(be, acc0, out / "break_even.png")]
    if cost_models:
        pics.append(plots.cost_curves(cost_models, out / "cost_curves.png"))
    return pics


def _track(c: dict, out: Path, table: list[dict], be: dict, pop, pics) -> None:
    """The errors, break-even α, popularity and pictures to the configured tracker."""
    from calib.tracking import make_tracker

    tracker = make_tracker(c.get("logger"), out, c, "moe")
    try:
        tracker.log({f"moe/mare/{r['family']}/{r['model']}": r["mare_per_layer"] for r in table}
                    | {f"moe/break_even_alpha/{k}": v["alpha"] for k, v in be.items()})
        tracker.log_table("moe_errors", table)
        tracker.log_table("moe_popularity", pop)
        for p in pics:
            tracker.log_image(f"moe/{Path(p).stem}", p)
    finally:
        tracker.finish()


def _first_draft_acceptance(bank: Path) -> float | None:
    """P(first draft accepted) over the capture's rounds that drafted (the α the break-even compares to)."""
    import pyarrow.parquet as pq

    t = pq.read_table(bank / "acceptance.parquet", columns=["acc0"]).column("acc0").to_numpy(zero_copy_only=False)
    t = t[~np.isnan(t.astype(float))] if t.dtype != object else np.array([v for v in t if v is not None], float)
    return float(t.mean()) if t.size else None


def error_table(table: list[dict]) -> str:
    n = table[0].get("splits", 1) if table else 1
    lines = [f"distinct-expert models: mean absolute relative error on held-out requests (mean of {n} splits)",
             f"{'shape':<8}{'model':<13}{'MARE/layer':>12}{'(min..max)':>17}{'MARE total':>12}{'configs':>9}"]
    for r in table:
        spread = f"{100 * r.get('mare_per_layer_min', np.nan):.1f}..{100 * r.get('mare_per_layer_max', np.nan):.1f}%"
        lines.append(f"{r['family']:<8}{r['model']:<13}{100 * r['mare_per_layer']:>11.2f}%{spread:>17}"
                     f"{100 * r['mare_total']:>11.2f}%{r['configs']:>9}")
    return "\n".join(lines)


def render(m: dict, pics, out: Path) -> str:
    info = m["routing_info"]
    L = ["# MoE routing analysis", ""]
    if info.get("proxy"):
        L += [f"**PROXY** routing: {info.get('source', '')}", ""]
    L += [(f"Capture `{m['routing']}`: {m['requests']['all']} requests ({m['requests']['fit']} fit, "
           f"{m['requests']['heldout']} held out)."), "",
          "## Distinct-expert models (held-out requests)", "", "```", error_table(m["errors"]), "```", "",
          ("MARE/layer: mean over shape configurations and layers of |pred − measured| / measured; MARE total: "
           "the same on the sum over layers (what a cost model reads). N = 1 excluded (all models exact). "
           "Each split holds out a random share of requests per category; min..max over splits."), "",
          "## Width vs depth at 2 positions", ""]
    for k, v in m["break_even"].items():
        L.append(f"- {k}: depth-2 reads {v['depth2_experts']:.2f} experts, width-2 {v['width2_experts']:.2f}; "
                 f"break-even α = {v['alpha']:.3f} (per layer {v['alpha_layer_min']:.2f} .. {v['alpha_layer_max']:.2f})")
    if m.get("first_draft_acceptance") is not None:
        L.append(f"- first-draft acceptance on this capture: {m['first_draft_acceptance']:.3f}")
    L += ["", "## Pictures", ""] + [f"![{Path(p).stem}]({Path(p).name})" for p in pics]
    return "\n".join(L) + "\n"
