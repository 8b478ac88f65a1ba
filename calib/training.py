"""``train.py``'s job: banks → censored labels → calibrators (selected on validation NLL) → tables.

Stages, each a function so tests and other tools can call them: :func:`fit_model_calibrator`,
:func:`fit_ngram_model`, :func:`ngram_transfer`, and :func:`run` which wires them to a config,
writes ``tables.safetensors`` + ``tables.json``, logs to the tracker and prints a summary.

A run owns its ``out_dir``: everything it writes (tables, summary, pictures, the resolved config,
its log, the tracker's files) is built in a staging folder and published as one unit when the run
succeeds (:func:`calib.atomic.staged_output`). An ``out_dir`` holding earlier tables is replaced only
with ``overwrite=true``; a failed or killed run leaves it as it was.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import numpy as np
import pandas as pd
from hydra.utils import instantiate
from omegaconf import OmegaConf

from calib.atomic import staged_output, write_text_atomic
from calib.bank import load, schema
from calib.labels import model_samples, ngram_samples, prompt_split
from calib.metrics import auroc, brier, ece, nll
from calib.tables import GridTables, save
from calib.tables.export import model_grid, model_table_predict, ngram_grid, ngram_table_predict
from calib.tables.io import META, TENSORS, bank_fingerprint
from calib.tracking import make_tracker

log = logging.getLogger("calib.train")

# What marks a folder as an earlier train.py output (replaced only with overwrite=true); .hydra and
# train.log are what runs before the staged layout left in a folder whose tables were never written.
OUT_MARKERS = (META, TENSORS, "summary.txt", "train.log", ".hydra")


def _extra(df: pd.DataFrame, names) -> np.ndarray | None:
    names = list(names or [])
    if not names:
        return None
    missing = [n for n in names if n not in df.columns]
    if missing:
        raise ValueError(f"calibrator.extra asks for {missing}, which the bank does not have "
                         f"(available: entropy, margin, temperature where recorded)")
    return df[names].to_numpy(np.float64)


def _metrics(p, y) -> dict:
    a = auroc(p, y)
    return {"n": len(y), "nll": nll(p, y), "brier": brier(p, y), "ece": ece(p, y),
            "auroc": None if np.isnan(a) else a}


def _select(kind: str, candidates: dict, fit_one) -> dict:
    """Fit every candidate (``fit_one(estimator) -> (val_nll, info)``), keep the lowest validation NLL."""
    fits = {}
    for name, spec in candidates.items():
        t0 = time.time()
        estimator = instantiate(spec)
        val_nll, info = fit_one(estimator)
        fits[name] = {"estimator": estimator, "val_nll": val_nll, "fit_s": round(time.time() - t0, 2), **info}
        log.info("%s %-12s val NLL %.5f (%.1fs)", kind, name, val_nll, fits[name]["fit_s"])
    return {"best": min(fits, key=lambda n: fits[n]["val_nll"]), "fits": fits}


def fit_model_calibrator(samples: pd.DataFrame, candidates: dict, extra_names=()) -> dict:
    """Fit every candidate on the train split and pick the lowest validation NLL."""
    tr, va = samples[samples.split == "train"], samples[samples.split == "val"]
    if tr.empty or va.empty:
        raise ValueError("the model-based samples need train and val prompts; add prompts or banks")

    def fit_one(cal):
        ex = _extra(tr, extra_names) if getattr(cal, "name", "") == "temperature" else None
        vex = _extra(va, extra_names) if ex is not None else None
        val = (va.conf, va.depth, va.label) + ((vex,) if vex is not None else ())
        cal.fit(tr.conf, tr.depth, tr.label, extra=ex, val=val)
        return nll(cal.predict_proba(va.conf, va.depth, vex), va.label), {"uses_extra": ex is not None}

    return _select("model calibrator", candidates, fit_one)


def fit_ngram_model(samples: pd.DataFrame, candidates: dict) -> dict:
    tr, va = samples[samples.split == "train"], samples[samples.split == "val"]
    if tr.empty or va.empty:
        raise ValueError("the n-gram samples need train and val prompts")

    def fit_one(model):
        model.fit(tr, tr.label.to_numpy(), val=(va, va.label.to_numpy()))
        return nll(model.predict_proba(va), va.label), {}

    return _select("n-gram model", candidates, fit_one)


def ngram_transfer(samples: pd.DataFrame, spec: dict, baseline: dict, fit_on, eval_on) -> dict | None:
    """Fit on some categories (e.g. chat), score on others (e.g. code edits) against a baseline."""
    src = samples[samples.category.isin(fit_on) & samples.split.isin(["train", "val"])]
    dst = samples[samples.category.isin(eval_on)]
    if src.empty or dst.empty or dst.label.nunique() < 2:
        return None
    out = {"fit_on": list(fit_on), "eval_on": list(eval_on), "n_fit": len(src), "n_eval": len(dst)}
    for name, s in (("model", spec), ("baseline", baseline)):
        m = instantiate(s).fit(src, src.label.to_numpy())
        p = m.predict_proba(dst)
        out[name] = {"kind": getattr(m, "name", name), "features": list(m.features),
                     "brier": brier(p, dst.label), "auroc": auroc(p, dst.label),
                     "nll": nll(p, dst.label)}
    return out


def _bank_identity(bank) -> list[dict]:
    out = []
    for path, man in zip(bank.paths, bank.manifests()):
        digest = bank_fingerprint(path)  # eval tells training banks from unseen ones by it
        out.append({"path": str(path), "acceptance_sha256": digest,
                    **{k: man.get(k) for k in ("model", "speculator", "config", "n_rounds", "engine",
                                               "engine_version")}})
    return out


def _accept_length(samples_rounds: pd.DataFrame, p_col: str) -> dict:
    """Predicted Σ_k Π_{j≤k} p_j vs actual accepted, over the rounds of ``samples_rounds``."""
    return {"predicted_mean": float(samples_rounds[p_col].mean()),
            "actual_mean": float(samples_rounds["accept"].mean())}


def _round_predictions(bank, test_prompts: set, tables) -> pd.DataFrame:
    """Test rounds of the model-based drafter with raw and calibrated expected accepted length."""
    import torch

    t = bank.rounds()
    width = schema.width(t.column_names)
    conf = np.stack([t.column(f"conf{k}").to_numpy(zero_copy_only=False).astype(float) for k in range(width)], 1)
    keep = ~np.isnan(conf).all(axis=1)
    keys = list(zip(t.column("category").to_pylist(), t.column("prompt_idx").to_pylist()))
    keep &= np.array([k in test_prompts for k in keys])
    conf = conf[keep]
    accept = t.column("accept").to_numpy(zero_copy_only=False)[keep]
    cal = tables.model_accept_prob(torch.from_numpy(conf)).double().numpy()

    def expected(p):
        return np.nancumprod(np.where(np.isnan(p), 0.0, p), axis=1).sum(axis=1)

    cats = np.asarray(t.column("category").to_pylist(), dtype=object)[keep]
    return pd.DataFrame({"category": cats, "accept": accept, "raw": expected(conf), "calibrated": expected(cal)})


def _target_models(bank) -> list[str]:
    """The target models the banks were collected with (the ``model`` key of their rounds)."""
    return sorted(map(str, bank.table(schema.ACCEPTANCE, ["model"]).column("model").unique().to_pylist()))


def _chain_depths(bank) -> dict[str, int]:
    """Drafted depth K per chain over the banks: ``model`` = the widest conf columns holding data,
    ``ngram`` = the widest n-gram chain (ngram_tok columns). Recorded so that eval and serving can
    refuse a deeper bank (whose extra depths would reuse the last row)."""
    import pyarrow.parquet as pq

    out = {"model": 0, "ngram": 0}
    for p in bank.paths:
        spec = Path(p) / schema.SPECULATOR
        w = schema.width(pq.read_schema(spec).names, schema.CONF)
        if w:
            conf0 = pq.read_table(spec, columns=[schema.col(schema.CONF, 0)]).column(0)
            if conf0.null_count < len(conf0):
                out["model"] = max(out["model"], w)
        ng = Path(p) / schema.NGRAM
        if ng.exists():
            out["ngram"] = max(out["ngram"], schema.width(pq.read_schema(ng).names, schema.NGRAM_TOK))
    return out


def run(cfg: dict) -> Path:
    """The whole job for a resolved ``conf/train.yaml``; returns the tables folder (``out_dir``).

    ``out_dir`` must be absent, empty, or (with ``overwrite: true``) an earlier train.py output; a
    folder holding anything else is refused. The tables, ``summary.txt``, ``reliability_test.png``,
    ``config.yaml`` (this resolved config), ``train.log`` and the tracker's files are staged beside
    ``out_dir`` and published as one unit on success; on failure the staging folder is removed and
    ``out_dir`` keeps what it held.
    """
    out_dir = Path(cfg["out_dir"])
    with staged_output(out_dir, overwrite=bool(cfg.get("overwrite", False)), markers=OUT_MARKERS,
                       job="train.py", log_file="train.log") as stage:
        write_text_atomic(stage / "config.yaml", OmegaConf.to_yaml(OmegaConf.create(cfg)))
        log.info("train.py -> %s (staged in %s)", out_dir, stage.name)
        summary = _fit_and_export(cfg, stage, out_dir)
    print(summary + wandb_note(out_dir))
    return out_dir


def wandb_note(out_dir: Path) -> str:
    """Where the W&B offline runs ended up: W&B names the staging folder they were written in."""
    runs = sorted(Path(out_dir).glob("wandb/offline-run-*"))
    return "".join(f"\nW&B offline run published with the outputs: wandb sync {r}" for r in runs)


def _fit_and_export(cfg: dict, stage: Path, out_dir: Path) -> str:
    """Fit, export and log into ``stage`` (published later as ``out_dir``); returns the summary text."""
    bank = load(cfg["data"]["train"])
    tracker = make_tracker(cfg.get("logger"), stage, cfg, job_type="train")
    try:
        return _fit_and_export_tracked(cfg, bank, tracker, stage, out_dir)
    finally:
        tracker.finish()  # before publishing: the tracker's files are part of the unit


def _fit_and_export_tracked(cfg: dict, bank, tracker, stage: Path, out_dir: Path) -> str:
    t_start = time.time()
    split_cfg = cfg["split"]
    fractions, seed = tuple(split_cfg["fractions"]), int(split_cfg["seed"])
    widths = _chain_depths(bank)
    meta: dict = {"drafters": {}, "banks": _bank_identity(bank), "split": dict(split_cfg),
                  "target_models": _target_models(bank)}
    summary_rows, fit_rows = [], []
    tensors = {}

    ms = model_samples(bank)
    if len(ms):
        ms["split"] = prompt_split(ms.category, ms.prompt_idx, fractions, seed)
        ccfg = cfg["calibrator"]
        res = fit_model_calibrator(ms, ccfg["candidates"], ccfg.get("extra", []))
        best = res["fits"][res["best"]]["estimator"]
        n_depths = int(ms.depth.max()) + 1
        extra_by_depth = None
        if res["fits"][res["best"]]["uses_extra"]:  # tabulate E[p | conf, depth] over training extras
            tr = ms[ms.split == "train"]
            rng = np.random.default_rng(seed)
            extra_by_depth = {}
            for d in range(n_depths):
                ex = _extra(tr[tr.depth == d], ccfg.get("extra"))
                extra_by_depth[d] = (ex[rng.choice(len(ex), min(len(ex), 256), replace=False)] if len(ex)
                                     else extra_by_depth[d - 1])  # no training rounds reached depth d
        grid, change = model_grid(best, n_depths, int(ccfg.get("grid_points", 1025)), extra_by_depth)
        tensors["model_grid"] = grid
        te = ms[ms.split == "test"]
        probe = GridTables(__import__("torch").from_numpy(grid), *_empty_ngram())
        va = ms[ms.split == "val"]
        per_depth = _per_depth(te, model_table_predict(probe, te.conf.to_numpy(), te.depth.to_numpy()), n_depths)
        val_per_depth = _per_depth(va, model_table_predict(probe, va.conf.to_numpy(), va.depth.to_numpy()),
                                   n_depths)
        test_prompts = set(zip(te.category, te.prompt_idx))
        rounds = _round_predictions(bank, test_prompts, probe)
        length = {"actual_mean": float(rounds.accept.mean()), "raw_predicted_mean": float(rounds.raw.mean()),
                  "calibrated_predicted_mean": float(rounds.calibrated.mean()), "n_rounds": len(rounds)}
        meta["drafters"]["model"] = {
            "ids": sorted(set(ms.speculator.astype(str))), "depths": n_depths, "k": max(widths["model"], n_depths),
            "grid_points": int(grid.shape[1]), "grid": "uniform raw confidence in [0, 1], linear interpolation",
            "calibrator": res["best"], "params": best.get_params(),
            "monotone_projection_max_change": change, "n_samples": {s: int((ms.split == s).sum()) for s in
                                                                   ("train", "val", "test")},
            "val_nll": {n: f["val_nll"] for n, f in res["fits"].items()},
            "val": val_per_depth, "test": per_depth, "accept_length_test": length}
        for n, f in res["fits"].items():
            fit_rows.append({"drafter": "model", "candidate": n, "val_nll": f["val_nll"], "fit_s": f["fit_s"],
                             "selected": n == res["best"]})
        summary_rows = per_depth
    else:
        tensors["model_grid"] = np.full((1, 2), np.nan, np.float32)  # no model-based drafter in the banks

    ng_meta = None
    if bank.has(schema.NGRAM):
        ns = ngram_samples(bank)
        if len(ns):
            ns["split"] = prompt_split(ns.category, ns.prompt_idx, fractions, seed)
            ncfg = cfg["ngram_model"]
            res = fit_ngram_model(ns, ncfg["candidates"])
            best = res["fits"][res["best"]]["estimator"]
            feats, edges = list(ncfg["table"]["features"]), [list(e) for e in ncfg["table"]["edges"]]
            n_depths = int(ns.depth.max()) + 1
            e_arr, strides, grid, info = ngram_grid(best, ns[ns.split == "train"], feats, edges, n_depths)
            tensors.update(ngram_edges=e_arr, ngram_strides=strides, ngram_grid=grid)
            import torch

            probe = GridTables(torch.zeros(1, 2), torch.from_numpy(e_arr), torch.from_numpy(strides),
                               torch.from_numpy(grid))
            te = ns[ns.split == "test"]
            test = {"model": _metrics(best.predict_proba(te), te.label),
                    "table": _metrics(ngram_table_predict(probe, te, feats), te.label)} if len(te) else {}
            transfer = None
            tcfg = ncfg.get("transfer")
            if tcfg:
                transfer = ngram_transfer(ns, ncfg["candidates"][res["best"]], tcfg["baseline"],
                                          tcfg["fit_on"], tcfg["eval_on"])
            ng_meta = {"model": res["best"], "features": feats, "edges": edges, "depths": n_depths,
                       "ids": ["ngram"], "k": max(widths["ngram"], n_depths), **info,
                       "val_nll": {n: f["val_nll"] for n, f in res["fits"].items()}, "test": test,
                       "transfer": transfer, "n_samples": {s: int((ns.split == s).sum()) for s in
                                                           ("train", "val", "test")},
                       "label_sources": ns.groupby("counterfactual").size().rename(
                           lambda c: "counterfactual" if c else "verified").to_dict()}
            meta["drafters"]["ngram"] = ng_meta
            meta["ngram_features"] = feats
            for n, f in res["fits"].items():
                fit_rows.append({"drafter": "ngram", "candidate": n, "val_nll": f["val_nll"], "fit_s": f["fit_s"],
                                 "selected": n == res["best"]})
    if not meta["drafters"]:
        raise ValueError(f"{cfg['data']['train']}: no model-based confidences and no labelled n-gram chains "
                         "to fit; check the banks (python -m calib.bank stats PATH)")
    if "ngram_grid" not in tensors:  # a placeholder the allocator never reads (no n-gram drafter)
        tensors.update(ngram_edges=np.full((1, 1), np.inf, np.float32), ngram_strides=np.ones(1, np.int64),
                       ngram_grid=np.full((1, 1), np.nan, np.float32))
        meta["ngram_features"] = []

    import torch

    # A drafted depth no training round reached has no row of its own: the last row stands for it
    # (the calibrators' rule), and the tables say so, or the allocator would refuse K > D at serve time.
    short = {c: (d["k"], tensors[f"{c}_grid"].shape[0]) for c, d in meta["drafters"].items()
             if d["k"] > tensors[f"{c}_grid"].shape[0]}
    if short:
        log.warning("depths without training rounds (chain: drafted K, fitted rows): %s; their "
                    "calibration is the last row's (reuse_last_row=True)", short)
    tables = GridTables(*(torch.from_numpy(tensors[n]) for n in ("model_grid", "ngram_edges", "ngram_strides",
                                                                  "ngram_grid")), reuse_last_row=bool(short))
    meta["fit"] = fit_rows
    meta["train_wall_s"] = round(time.time() - t_start, 2)
    save(stage, tables, meta)
    _log(tracker, stage, meta, summary_rows, fit_rows, ms)
    return _write_summary(stage, out_dir, meta)


def _per_depth(samples: pd.DataFrame, calibrated: np.ndarray, n_depths: int) -> list[dict]:
    """Raw vs calibrated ECE / NLL / Brier per depth and pooled ("all")."""
    rows = []
    for d in ["all", *range(n_depths)]:
        m = np.ones(len(samples), bool) if d == "all" else (samples.depth == d).to_numpy()
        if not m.any():
            continue
        raw, cal = _metrics(samples.conf[m], samples.label[m]), _metrics(calibrated[m], samples.label[m])
        rows.append({"depth": d, "n": raw["n"], "raw_ece": raw["ece"], "cal_ece": cal["ece"], "raw_nll": raw["nll"],
                     "cal_nll": cal["nll"], "raw_brier": raw["brier"], "cal_brier": cal["brier"]})
    return rows


def _empty_ngram():
    import torch

    return torch.full((1, 1), float("inf")), torch.ones(1, dtype=torch.int64), torch.zeros(1, 1)


def _log(tracker, out_dir: Path, meta: dict, per_depth: list[dict], fit_rows: list[dict], ms) -> None:
    for split in ("val", "test"):
        for row in meta["drafters"].get("model", {}).get(split, []):
            tracker.log({f"{split}/depth_{row['depth']}/{k}": v for k, v in row.items() if k != "depth"})
    tracker.log_table("fit", fit_rows)
    if per_depth:
        tracker.log_table("test_per_depth", per_depth)
        from calib.presentation import reliability_figure
        from calib.tables import load as load_tables

        tables = load_tables(out_dir)
        te = ms[ms.split == "test"]
        cal = model_table_predict(tables, te.conf.to_numpy(), te.depth.to_numpy())
        panels = {}
        for d in [*sorted(te.depth.unique()), "all"]:
            m = np.ones(len(te), bool) if d == "all" else (te.depth == d).to_numpy()
            panels["all depths" if d == "all" else f"depth {d}"] = {
                "raw": (te.conf[m].to_numpy(), te.label[m].to_numpy()), "calibrated": (cal[m], te.label[m].to_numpy())}
        png = reliability_figure(panels, out_dir / "reliability_test.png",
                                 f"model drafter, test prompts: raw vs {meta['drafters']['model']['calibrator']}")
        tracker.log_image("reliability/test", png)
    tracker.log_artifact("calib-tables", "tables", [out_dir / TENSORS, out_dir / META],
                         metadata={k: meta[k] for k in ("drafters",) if k in meta} | {"banks": meta["banks"]})


def _write_summary(stage: Path, out_dir: Path, meta: dict) -> str:
    """``summary.txt`` in the staging folder; returns its text (printed once published)."""
    lines = [f"tables written to {out_dir} ({meta['train_wall_s']:.1f}s)"]
    m = meta["drafters"].get("model")
    if m:
        lines.append(f"model drafter {m['ids']}: selected {m['calibrator']} (val NLL); test split:")
        lines.append(f"  {'depth':>5} {'n':>7} {'ECE raw':>8} {'ECE cal':>8} {'NLL raw':>8} {'NLL cal':>8}")
        for r in m["test"]:
            lines.append(f"  {r['depth']!s:>5} {r['n']:>7} {r['raw_ece']:>8.4f} {r['cal_ece']:>8.4f} "
                         f"{r['raw_nll']:>8.4f} {r['cal_nll']:>8.4f}")
        L = m["accept_length_test"]
        lines.append(f"  accepted length per round: actual {L['actual_mean']:.3f}, predicted raw "
                     f"{L['raw_predicted_mean']:.3f}, calibrated {L['calibrated_predicted_mean']:.3f} "
                     f"({L['n_rounds']} test rounds)")
    n = meta["drafters"].get("ngram")
    if n:
        lines.append(f"n-gram drafter: selected {n['model']}; test "
                     + ", ".join(f"{k} Brier {v['brier']:.4f} AUROC {v['auroc']:.3f}" for k, v in n["test"].items()
                                 if v.get("auroc") is not None))
        t = n.get("transfer")
        if t:
            lines.append(f"  transfer {'+'.join(t['fit_on'])} -> {'+'.join(t['eval_on'])}: {t['model']['kind']} "
                         f"Brier {t['model']['brier']:.4f} AUROC {t['model']['auroc']:.3f} | baseline "
                         f"({'+'.join(t['baseline']['features'])}) Brier {t['baseline']['brier']:.4f} "
                         f"AUROC {t['baseline']['auroc']:.3f}")
    text = "\n".join(lines)
    write_text_atomic(stage / "summary.txt", text + "\n")
    return text
