"""``train.py``'s job: banks → censored labels → calibrators (selected on validation NLL) → tables.

Every registered chain kind (:mod:`calib.chains`) goes through the same stages, each a function so
tests and other tools can call them: its samples (``ChainKind.samples``), :func:`fit_chain` (one
candidate-selection loop over its config group's ``candidates``), the table encoding
(:func:`calib.tables.export.encode_chain`) and, where configured, :func:`transfer_check`. :func:`run`
wires them to a config, writes ``tables.safetensors`` + ``tables.json``, logs to the tracker and
prints a summary.

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
from calib.calibrators.context import PerContextCell
from calib.chains import ChainKind, chain, chains, context_axes, context_spec, resolve_edges, round_inputs
from calib.config_checks import check_train
from calib.labels import prompt_split
from calib.metrics import auroc, brier, ece, nll
from calib.tables import GridTables, save
from calib.tables.export import chain_forecast, encode_chain, table_predict
from calib.tables.io import META, TENSORS, bank_fingerprint
from calib.tracking import make_tracker

log = logging.getLogger("calib.train")



def _metrics(p, y) -> dict:
    a = auroc(p, y)
    return {"n": len(y), "nll": nll(p, y), "brier": brier(p, y), "ece": ece(p, y),
            "auroc": None if np.isnan(a) else a}


def _select(kind: str, candidates: dict, fit_one) -> dict:
    """Fit every candidate (``fit_one(estimator) -> (val_nll, info)``), keep the lowest validation NLL.
    ``info["wrapped"]``, where given, is the estimator as fitted (the caller swaps it in)."""
    fits = {}
    for name, spec in candidates.items():
        t0 = time.time()
        estimator = instantiate(spec)
        val_nll, info = fit_one(estimator)
        fits[name] = {"estimator": estimator, "val_nll": val_nll, "fit_s": round(time.time() - t0, 2), **info}
        log.info("%s %-12s val NLL %.5f (%.1fs)", kind, name, val_nll, fits[name]["fit_s"])
    return {"best": min(fits, key=lambda n: fits[n]["val_nll"]), "fits": fits}


def fit_chain(kind: ChainKind, samples: pd.DataFrame, chain_cfg: dict) -> dict:
    """Fit every candidate estimator of ``chain_cfg["candidates"]`` on the train split of ``samples``
    (the chain's feature matrix, :meth:`ChainKind.X`) and keep the lowest validation NLL.

    With a ``context`` block (:func:`calib.chains.context_spec`) every candidate is fitted per context
    cell of the ``axes`` (:class:`calib.calibrators.context.PerContextCell`; edges resolved on the train
    split, :func:`calib.chains.resolve_edges`), or, for an estimator reading named ``features`` (the
    n-gram models), once with the context axes added to its features; then each optional ``candidates`` axis is added to the
    selected estimator's cells, in order, and kept where it lowers the validation NLL.

    Returns ``{"best": name, "fits": {name: {"estimator", "val_nll", "fit_s", "uses_context"}},
    "chain_cfg": the config with the context resolved (``context.selected``, numeric edges)}``.
    """
    tr, va = samples[samples.split == "train"], samples[samples.split == "val"]
    if tr.empty or va.empty:
        raise ValueError(f"the {kind.name} chain's samples need train and val prompts; add prompts or banks")
    axes, optional, edge_specs = context_spec(chain_cfg)
    cfg = _resolve_context(chain_cfg, tr, axes, optional, edge_specs)
    ctx_cfg = cfg.get("context") or {}
    fitter = _chain_fitter(kind, cfg, tr, va)
    res = _select(f"{kind.name} chain", chain_cfg["candidates"], fitter(axes))
    for f in res["fits"].values():
        f["estimator"] = f.pop("wrapped")
    selected = _add_optional_axes(kind, res, chain_cfg, ctx_cfg, list(axes), optional, fitter, tr, va)
    res["chain_cfg"] = _with_selected(cfg, selected) if ctx_cfg else cfg
    return res


def _chain_fitter(kind: ChainKind, cfg: dict, tr: pd.DataFrame, va: pd.DataFrame):
    """``fitter(selected, tr, va)``: a ``fit_one(estimator)`` for :func:`_select` that fits on ``tr`` with
    the context axes ``selected`` and scores on ``va`` (``(val NLL, {"uses_context", "wrapped"})``)."""
    n_own = len(kind.feature_names(cfg))
    ctx_cfg = cfg.get("context") or {}
    min_cell = int(ctx_cfg.get("min_cell_samples", 500))

    def fitter(selected, tr=tr, va=va):
        c = _with_selected(cfg, selected)
        edges = [list(a.edges) for a in context_axes(c)]

        def fit_one(est):
            reads = _named_features(kind, est, tr)
            if reads is not None:
                # a model reading named features takes the context as features (one pooled fit that
                # learns how much the context matters; its table is distilled per table cell)
                est = type(est)(**{**est.get_params(), "features": (*reads, *selected)})
            elif ctx_cfg:
                est = PerContextCell(est, n_own, edges, min_cell)
            X_tr, X_va = kind.X(tr, c, reads=reads or ()), kind.X(va, c, reads=reads or ())
            est.fit(X_tr, tr.depth, tr.label, val=(X_va, va.depth, va.label))
            uses_context = (bool(kind.confidence) and getattr(est, "uses_context", False)
                            and (n_own > 1 or reads is not None))
            return nll(est.predict_proba(X_va, va.depth), va.label), {"uses_context": uses_context,
                                                                      "wrapped": est}
        return fit_one
    return fitter


def _add_optional_axes(kind: ChainKind, res: dict, chain_cfg: dict, ctx_cfg: dict, selected: list, optional,
                       fitter, tr: pd.DataFrame, va: pd.DataFrame) -> list:
    """Try each optional context axis on the selected estimator, in order: kept (``res``'s fit replaced)
    where it lowers the validation NLL; large banks decide on a row sample (both variants fitted on
    it) and refit only a kept axis. Records ``res["context_trials"]``; returns the axes kept."""
    best_spec = {res["best"]: chain_cfg["candidates"][res["best"]]}
    trial_n = int(ctx_cfg.get("trial_samples") or 0)
    sampled = bool(trial_n) and len(tr) > trial_n
    if sampled:  # large banks: decide on a row sample (both variants fitted on it), refit only a kept axis
        rng = np.random.default_rng(0)
        sub_tr = tr.iloc[np.sort(rng.choice(len(tr), trial_n, replace=False))]
        sub_va = va.iloc[np.sort(rng.choice(len(va), min(len(va), trial_n), replace=False))]
        sample_nll = None  # the selected axes' NLL on the sample, refitted only when the selection changes
    for name in optional:  # an optional context axis stays where it pays on validation NLL
        if sampled:
            if sample_nll is None:
                before = _select(f"{kind.name} chain (sample)", best_spec, fitter(selected, sub_tr, sub_va))
                sample_nll = before["fits"][res["best"]]["val_nll"]
            after = _select(f"{kind.name} chain +{name} (sample)", best_spec,
                            fitter([*selected, name], sub_tr, sub_va))
            old_nll, new_nll = sample_nll, after["fits"][res["best"]]["val_nll"]
        else:
            old_nll = res["fits"][res["best"]]["val_nll"]
            after = _select(f"{kind.name} chain +{name}", best_spec, fitter([*selected, name]))
            new_nll = after["fits"][res["best"]]["val_nll"]
        keep = new_nll < old_nll
        log.info("%s chain: context axis %s: val NLL %.5f -> %.5f (%s)", kind.name, name, old_nll, new_nll,
                 "kept" if keep else "dropped")
        res.setdefault("context_trials", {})[name] = {"val_nll_without": old_nll, "val_nll_with": new_nll}
        if keep:
            if sampled:
                sample_nll = new_nll
                after = _select(f"{kind.name} chain +{name}", best_spec, fitter([*selected, name]))
            fit = after["fits"][res["best"]]
            fit["estimator"] = fit.pop("wrapped")
            res["fits"][res["best"]] = fit
            selected.append(name)
    return selected


def _named_features(kind: ChainKind, est, samples: pd.DataFrame) -> list[str] | None:
    """The features a model reading named ones (``features`` parameter) takes from ``samples``, or None
    for an estimator on the chain's X. Features the banks do not record (a bank without entropy) are
    left out with a warning; for a chain with a raw confidence it must be the first feature (the
    table's interpolated axis)."""
    if "features" not in est.get_params():
        return None
    reads = [f for f in est.features if f in samples.columns]
    missing = [f for f in est.features if f not in samples.columns]
    if missing:
        log.warning("%s chain %s: the banks record no %s; fitted without them", kind.name, est.name, missing)
    if kind.confidence and (not reads or reads[0] != kind.confidence):
        raise ValueError(f"{kind.name} chain {est.name}: features {list(est.features)} must start with "
                         f"{kind.confidence!r} (the table's interpolated axis)")
    return reads


def _resolve_context(chain_cfg: dict, tr: pd.DataFrame, axes, optional, edge_specs) -> dict:
    """``chain_cfg`` with every context axis' edges resolved on the train split."""
    ctx = (chain_cfg or {}).get("context")
    if not ctx:
        return chain_cfg
    max_bins = int(ctx.get("max_bins", 8))
    for n in axes + optional:
        if n not in tr.columns:
            raise ValueError(f"context axis {n!r}: the samples have no such column (calib.labels.round_context)")
    edges = {n: resolve_edges(tr[n].to_numpy(np.float64), edge_specs[n], max_bins) for n in axes + optional}
    out = dict(chain_cfg)
    out["context"] = {**ctx, "axes": {n: {"edges": edges[n]} for n in axes},
                      "candidates": {n: {"edges": edges[n]} for n in optional}, "selected": list(axes)}
    return out


def _with_selected(cfg: dict, selected) -> dict:
    if not cfg.get("context"):
        return cfg
    return {**cfg, "context": {**cfg["context"], "selected": list(selected)}}


def fit_model_calibrator(samples: pd.DataFrame, candidates: dict, extra_names=()) -> dict:
    """:func:`fit_chain` on the model chain (``samples`` from :func:`calib.chains.model.model_samples`)."""
    return fit_chain(chain("model"), samples, {"candidates": candidates, "extra": list(extra_names or [])})


TRANSFER_MAX_EVAL = 500_000  # rows the transfer check scores (a random sample of larger sets)


def transfer_check(kind: ChainKind, samples: pd.DataFrame, chain_cfg: dict, spec: dict, baseline: dict, fit_on,
                   eval_on) -> dict | None:
    """Fit on some categories (e.g. chat), score on others (e.g. code edits) against a baseline."""
    src = samples[samples.category.isin(fit_on) & samples.split.isin(["train", "val"])]
    dst = samples[samples.category.isin(eval_on)]
    if src.empty or dst.empty or dst.label.nunique() < 2:
        return None
    if len(dst) > TRANSFER_MAX_EVAL:  # a score, not a fit: a random sample of the rows estimates it
        dst = dst.iloc[np.sort(np.random.default_rng(0).choice(len(dst), TRANSFER_MAX_EVAL, replace=False))]
    out = {"fit_on": list(fit_on), "eval_on": list(eval_on), "n_fit": len(src), "n_eval": len(dst)}
    X_src, X_dst = kind.X(src, chain_cfg, context=False), kind.X(dst, chain_cfg, context=False)
    for name, s in (("model", spec), ("baseline", baseline)):
        m = instantiate(s).fit(X_src, src.depth, src.label.to_numpy())
        p = m.predict_proba(X_dst, dst.depth)
        out[name] = {"kind": getattr(m, "name", name), "features": list(getattr(m, "features", X_src.columns)),
                     "brier": brier(p, dst.label), "auroc": auroc(p, dst.label),
                     "nll": nll(p, dst.label)}
    return out


def _bank_identity(bank) -> list[dict]:
    out = []
    for path, man in zip(bank.paths, bank.manifests()):
        digest = bank_fingerprint(path)  # eval tells training banks from unseen ones by it
        out.append({"path": str(path), "acceptance_sha256": digest,
                    **{k: man.get(k) for k in ("model", "speculator", "config", "n_rounds", "engine",
                                               "engine_version", "method")},
                    # target/drafter fingerprints (calib/fingerprint.py): what check_bank and serving compare
                    **({"identity": man["identity"]} if isinstance(man.get("identity"), dict) else {})})
    return out


def _round_predictions(bank, test_prompts: set, table, kind: ChainKind) -> pd.DataFrame:
    """Test rounds of a drafter with raw confidences with raw and calibrated (``table``, read with the
    round's inputs as eval reads them: :func:`calib.chains.round_inputs`) expected accepted length."""
    import torch

    t = bank.rounds()
    data = round_inputs(kind, t, [a.name for a in table.axes])
    conf = data.raw
    keep = ~np.isnan(conf).all(axis=1)
    keys = list(zip(t.column("category").to_pylist(), t.column("prompt_idx").to_pylist()))
    keep &= np.array([k in test_prompts for k in keys])
    conf = conf[keep]
    accept = t.column("accept").to_numpy(zero_copy_only=False)[keep]
    cal = table.lookup(torch.from_numpy(data.inputs[keep])).double().numpy()

    def expected(p):
        return np.nancumprod(np.where(np.isnan(p), 0.0, p), axis=1).sum(axis=1)

    cats = np.asarray(t.column("category").to_pylist(), dtype=object)[keep]
    return pd.DataFrame({"category": cats, "accept": accept, "raw": expected(conf), "calibrated": expected(cal)})


def _target_models(bank) -> list[str]:
    """The target models the banks were collected with (the ``model`` key of their rounds)."""
    return sorted(map(str, bank.table(schema.ACCEPTANCE, ["model"]).column("model").unique().to_pylist()))


def _chain_depths(bank) -> dict[str, int]:
    """Drafted depth K per registered chain over the banks (the widest a bank folder records).
    Recorded so that eval and serving can refuse a deeper bank (whose extra depths would reuse the
    last row)."""
    return {kind.name: max((kind.drafted_depth(p) for p in bank.paths), default=0) for kind in chains()}


def run(cfg: dict) -> Path:
    """The whole job for a resolved ``conf/train.yaml``; returns the tables folder (``out_dir``).

    ``out_dir`` must be absent, empty, or (with ``overwrite: true``) an earlier train.py output; a
    folder holding anything else is refused. The tables, ``summary.txt``, ``reliability_test.png``,
    ``config.yaml`` (this resolved config), ``train.log`` and the tracker's files are staged beside
    ``out_dir`` and published as one unit on success; on failure the staging folder is removed and
    ``out_dir`` keeps what it held.
    """
    check_train(cfg)  # before anything loads: a setting that makes a metric meaningless is refused by key
    out_dir = Path(cfg["out_dir"])
    with staged_output(out_dir, overwrite=bool(cfg.get("overwrite", False)), job="train.py",
                       log_file="train.log") as stage:
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
    # rounds of requests with target-only logit transforms accept differently: left out unless asked (calib/transforms.py)
    bank = load(cfg["data"]["train"], judged_only=not bool(cfg["data"].get("keep_logit_transforms", False)))
    if bank.judged_only and (n_out := bank.transformed_keys().num_rows):
        log.info("left out %d rounds of requests with target-only logit transforms "
                 "(data.keep_logit_transforms=true keeps them)", n_out)
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
    meta: dict = {"chains": {}, "banks": _bank_identity(bank), "split": dict(split_cfg),
                  "target_models": _target_models(bank)}
    summary_rows, fit_rows, chain_tables, reports = [], [], {}, {}

    for kind in chains():  # one loop: every registered chain kind the config and the banks have
        chain_cfg = cfg.get(kind.config)
        if chain_cfg is None:
            log.info("%s chain: no `%s` config group, not trained", kind.name, kind.config)
            continue
        samples = kind.samples(bank)
        if not len(samples):
            continue
        samples["split"] = prompt_split(samples.category, samples.prompt_idx, fractions, seed)
        res, table, chain_meta, per_depth = _train_chain(kind, samples, chain_cfg, bank, widths[kind.name], seed)
        chain_tables[kind.name] = table
        if per_depth is not None:
            summary_rows = per_depth
            reports[kind.name] = samples
        meta["chains"][kind.name] = chain_meta
        for n, f in res["fits"].items():
            fit_rows.append({"drafter": kind.name, "candidate": n, "val_nll": f["val_nll"], "fit_s": f["fit_s"],
                             "selected": n == res["best"]})
    if not meta["chains"]:
        raise ValueError(f"{cfg['data']['train']}: no model-based confidences and no labelled n-gram chains "
                         "to fit; check the banks (python -m calib.bank stats PATH)")
    # A drafted depth no training round reached has no row of its own: the last row stands for it
    # (the calibrators' rule), and the tables say so, or the allocator would refuse K > D at serve time.
    short = {c: (d["k"], chain_tables[c].depths) for c, d in meta["chains"].items()
             if d["k"] > chain_tables[c].depths}
    if short:
        log.warning("depths without training rounds (chain: drafted K, fitted rows): %s; their "
                    "calibration is the last row's (reuse_last_row=True)", short)
    tables = GridTables(chain_tables, reuse_last_row=bool(short))
    meta["fit"] = fit_rows
    meta["train_wall_s"] = round(time.time() - t_start, 2)
    save(stage, tables, meta)
    _log(tracker, stage, meta, summary_rows, fit_rows, reports)
    return _write_summary(stage, out_dir, meta)


def _train_chain(kind: ChainKind, samples: pd.DataFrame, chain_cfg: dict, bank, width: int, seed: int):
    """Fit one chain (:func:`fit_chain`), encode its table and score it: ``(fit result, table,
    tables.json's chain entry, per-depth test rows or None for a chain without confidences)``."""
    res = fit_chain(kind, samples, chain_cfg)
    chain_cfg = res["chain_cfg"]  # context axes selected, edges resolved
    chosen = res["fits"][res["best"]]
    best = chosen["estimator"]
    n_depths = int(samples.depth.max()) + 1
    tr, va, te = (samples[samples.split == s] for s in ("train", "val", "test"))
    table, info = encode_chain(kind, best, tr, chain_cfg, n_depths, chosen["uses_context"], seed)
    axes = [a.name for a in table.axes]
    chain_meta = {"id": kind.id, **_chain_ids(kind, samples), "depths": n_depths,
                  "k": max(width, n_depths), "estimator": res["best"], "params": _params(best), **_context_cells(best),
                  **({"context_trials": res["context_trials"]} if res.get("context_trials") else {}),
                  "features": list(getattr(best, "features", kind.feature_names(chain_cfg))), **info,
                  "n_samples": {s: int((samples.split == s).sum()) for s in ("train", "val", "test")},
                  "val_nll": {n: f["val_nll"] for n, f in res["fits"].items()}}
    per_depth = None
    if kind.confidence:  # raw vs calibrated per depth, and the accepted length per round
        per_depth = _per_depth(te, table_predict(table, te[axes], te.depth), n_depths, kind.confidence)
        chain_meta["val"] = _per_depth(va, table_predict(table, va[axes], va.depth), n_depths, kind.confidence)
        chain_meta["test"] = per_depth
        chain_meta["forecast"] = chain_forecast(table, tr, context_axes(chain_cfg), n_depths)
        rounds = _round_predictions(bank, set(zip(te.category, te.prompt_idx)), table, kind)
        chain_meta["accept_length_test"] = {
            "actual_mean": float(rounds.accept.mean()), "raw_predicted_mean": float(rounds.raw.mean()),
            "calibrated_predicted_mean": float(rounds.calibrated.mean()), "n_rounds": len(rounds)}
    else:  # the estimator itself vs its table on the test split
        table_p = table_predict(table, te[axes], te.depth) if len(te) else None
        chain_meta["test"] = ({"model": _metrics(best.predict_proba(kind.X(te, chain_cfg), te.depth), te.label),
                               "table": _metrics(table_p, te.label)} if len(te) else {})
    tcfg = chain_cfg.get("transfer")
    if tcfg:
        chain_meta["transfer"] = transfer_check(kind, samples, chain_cfg, chain_cfg["candidates"][res["best"]],
                                                tcfg["baseline"], tcfg["fit_on"], tcfg["eval_on"])
    if "counterfactual" in samples.columns:
        chain_meta["label_sources"] = samples.groupby("counterfactual").size().rename(
            lambda c: "counterfactual" if c else "verified").to_dict()
    return res, table, chain_meta, per_depth


def _params(est) -> dict:
    """tables.json's ``params``: the estimator's (the wrapped one's for an estimator per context cell)."""
    return (est.estimator if isinstance(est, PerContextCell) else est).get_params()


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


def _per_depth(samples: pd.DataFrame, calibrated: np.ndarray, n_depths: int, raw: str = "conf") -> list[dict]:
    """Raw vs calibrated ECE / NLL / Brier per depth and pooled ("all")."""
    rows = []
    for d in ["all", *range(n_depths)]:
        m = np.ones(len(samples), bool) if d == "all" else (samples.depth == d).to_numpy()
        if not m.any():
            continue
        raw_m, cal = _metrics(samples[raw][m], samples.label[m]), _metrics(calibrated[m], samples.label[m])
        rows.append({"depth": d, "n": raw_m["n"], "raw_ece": raw_m["ece"], "cal_ece": cal["ece"],
                     "raw_nll": raw_m["nll"], "cal_nll": cal["nll"], "raw_brier": raw_m["brier"],
                     "cal_brier": cal["brier"]})
    return rows


def _log(tracker, out_dir: Path, meta: dict, per_depth: list[dict], fit_rows: list[dict],
         reports: dict[str, pd.DataFrame]) -> None:
    """Per-depth metrics, the fit table, the reliability picture of the chain with raw confidences
    (``reports``: its samples, by chain name) and the tables as an artifact."""
    for name in reports:
        for split in ("val", "test"):
            for row in meta["chains"][name].get(split, []):
                tracker.log({f"{split}/depth_{row['depth']}/{k}": v for k, v in row.items() if k != "depth"})
    tracker.log_table("fit", fit_rows)
    if per_depth and reports:
        tracker.log_table("test_per_depth", per_depth)
        from calib.presentation import reliability_figure
        from calib.tables import load as load_tables

        name, samples = next(iter(reports.items()))
        raw = chain(name).confidence
        tables = load_tables(out_dir)
        te = samples[samples.split == "test"]
        cal = table_predict(tables.table(name), te[tables.feature_names(name)], te.depth)
        panels = {}
        for d in [*sorted(te.depth.unique()), "all"]:
            m = np.ones(len(te), bool) if d == "all" else (te.depth == d).to_numpy()
            panels["all depths" if d == "all" else f"depth {d}"] = {
                "raw": (te[raw][m].to_numpy(), te.label[m].to_numpy()), "calibrated": (cal[m], te.label[m].to_numpy())}
        png = reliability_figure(panels, out_dir / "reliability_test.png",
                                 f"{name} drafter, test prompts: raw vs {meta['chains'][name]['estimator']}")
        tracker.log_image("reliability/test", png)
    tracker.log_artifact("calib-tables", "tables", [out_dir / TENSORS, out_dir / META],
                         metadata={k: meta[k] for k in ("chains",) if k in meta} | {"banks": meta["banks"]})


def _write_summary(stage: Path, out_dir: Path, meta: dict) -> str:
    """``summary.txt`` in the staging folder; returns its text (printed once published)."""
    lines = [f"tables written to {out_dir} ({meta['train_wall_s']:.1f}s)"]
    for name, m in meta["chains"].items():
        lines += _summary_lines(name, m)
    text = "\n".join(lines)
    write_text_atomic(stage / "summary.txt", text + "\n")
    return text


def _summary_lines(name: str, m: dict) -> list[str]:
    """One chain's part of summary.txt: per-depth raw vs calibrated for a chain with raw confidences,
    estimator vs table otherwise, and the transfer check where one ran."""
    lines = []
    if isinstance(m.get("test"), list):
        lines.append(f"{name} drafter {m['ids']}: selected {m['estimator']} (val NLL); test split:")
        lines.append(f"  {'depth':>5} {'n':>7} {'ECE raw':>8} {'ECE cal':>8} {'NLL raw':>8} {'NLL cal':>8}")
        for r in m["test"]:
            lines.append(f"  {r['depth']!s:>5} {r['n']:>7} {r['raw_ece']:>8.4f} {r['cal_ece']:>8.4f} "
                         f"{r['raw_nll']:>8.4f} {r['cal_nll']:>8.4f}")
        L = m["accept_length_test"]
        lines.append(f"  accepted length per round: actual {L['actual_mean']:.3f}, predicted raw "
                     f"{L['raw_predicted_mean']:.3f}, calibrated {L['calibrated_predicted_mean']:.3f} "
                     f"({L['n_rounds']} test rounds)")
    else:
        lines.append(f"{name} drafter: selected {m['estimator']}; test "
                     + ", ".join(f"{k} Brier {v['brier']:.4f} AUROC {v['auroc']:.3f}" for k, v in m["test"].items()
                                 if v.get("auroc") is not None))
    t = m.get("transfer")
    if t:
        lines.append(f"  transfer {'+'.join(t['fit_on'])} -> {'+'.join(t['eval_on'])}: {t['model']['kind']} "
                     f"Brier {t['model']['brier']:.4f} AUROC {t['model']['auroc']:.3f} | baseline "
                     f"({'+'.join(t['baseline']['features'])}) Brier {t['baseline']['brier']:.4f} "
                     f"AUROC {t['baseline']['auroc']:.3f}")
    return lines
