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
from sklearn.base import clone
from sklearn.model_selection import GroupKFold, cross_validate

from calib.atomic import staged_output, write_text_atomic
from calib.bank import load
from calib.calibrators.base import DEPTH, with_depth
from calib.calibrators.context import PerContextCell
from calib.calibrators.selection import NEG_LOG_LOSS, GroupedCVSelection, group_sample
from calib.chains import (
    CONTEXT,
    ChainKind,
    chain,
    chains,
    context_axes,
    context_spec,
    resolve_edges,
)
from calib.config_checks import check_train
from calib.labels import prompt_split
from calib.metrics import auroc, brier, nll
from calib.tables import GridTables, save
from calib.tables.export import chain_forecast, encode_chain, table_predict
from calib.tracking import make_tracker
from calib.training_describe import (
    _candidates,
    _chain_ids,
    _choices,
    _chosen_names,
    _context_cells,
    _cv_nll,
    _describe_choice,
    _features,
    _params,
    _probe_choice,
    _uses_context,
    _why,
)
from calib.training_report import (
    _bank_identity,
    _chain_depths,
    _log,
    _metrics,
    _per_depth,
    _round_predictions,
    _target_models,
    _write_summary,
    wandb_note,
)
from calib.training_transfer import transfer_checks, ways

log = logging.getLogger("calib.train")


SELECTION_DEFAULTS = {"n_splits": 5, "rule": "one_se", "max_cv_samples": 30_000, "ece_guard": False}


def fit_chain(kind: ChainKind, samples: pd.DataFrame, chain_cfg: dict) -> dict:
    """Fit a chain's calibrator on the train and val prompts of ``samples`` (the chain's feature matrix,
    :meth:`ChainKind.X`), chosen per depth by grouped cross-validation
    (:class:`calib.calibrators.selection.GroupedCVSelection`: folds by prompt, the one-SE rule, the
    first of ``chain_cfg["candidates"]`` being the baseline).

    With a ``context`` block (:func:`calib.chains.context_spec`) a model chain is fitted per context cell
    of the ``axes`` (:class:`calib.calibrators.context.PerContextCell`, the choice made per cell; thin
    cells take the pooled fit), a chain of models reading named ``features`` (the n-gram chain) once with
    the context axes added to its features. Each optional ``candidates`` axis is then tried on the
    candidate the selection chose most often (on ``context.trial_samples`` rows of whole prompts) and
    kept only where grouped CV says it pays by more than one standard error; with an axis kept, the
    choice per depth (and cell) is then made again between the baseline and that candidate. With a ``transfer`` block, a candidate that loses to the transfer baseline (Brier)
    when fitted on some categories and scored on the others, in either direction, is not a candidate.

    Returns ``{"estimator": fitted, "chain_cfg": the config with the context resolved
    (``context.selected``, numeric edges), "uses_context", "choice" (the candidate per depth, per context
    cell), "cv_nll" (mean held-out NLL per candidate), "transfer_guard", "context_trials"}``.
    """
    rows = samples[samples.split.isin(["train", "val"])]
    if rows.empty or rows.label.nunique() < 2:
        raise ValueError(f"the {kind.name} chain's samples need train/val prompts with both labels; add prompts or banks")
    axes, optional, edge_specs = context_spec(chain_cfg)
    cfg = _resolve_context(chain_cfg, rows, axes, optional, edge_specs)
    sel_cfg = {**SELECTION_DEFAULTS, **(chain_cfg.get("selection") or {})}
    candidates = {n: instantiate(s) for n, s in candidate_specs(chain_cfg).items()}
    groups = prompt_groups(rows)
    selected = list(axes)
    guard = _transfer_guard(kind, rows, cfg, candidates, selected, chain_cfg.get("transfer"))
    eligible = {n: c for i, (n, c) in enumerate(candidates.items()) if i == 0 or guard.get(n, {}).get("eligible", True)}
    est = _selection(kind, cfg, eligible, selected, sel_cfg, rows).fit(
        _chain_X(kind, rows, _with_selected(cfg, selected), eligible), rows.label.to_numpy(), groups=groups)
    trials, baseline_scores = {}, None
    probe = _probe_choice(est, eligible)
    trial_rows = _prompt_sample(rows, int((cfg.get("context") or {}).get("trial_samples") or 0), sel_cfg.get("seed", 0))
    for name in optional if probe is not None else ():
        keep, trials[name], baseline_scores = _try_axis(kind, trial_rows, cfg, {probe: eligible[probe]}, selected,
                                                        name, sel_cfg, chain_cfg.get("transfer"), baseline_scores)
        log.info("%s chain: context axis %s on %s: grouped-CV NLL %.5f -> %.5f (SE %.5f): %s", kind.name, name,
                 probe, trials[name]["cv_nll_without"], trials[name]["cv_nll_with"], trials[name]["se"],
                 "kept" if keep else "dropped")
        if keep:
            selected.append(name)
    if len(selected) > len(axes):  # refit with the kept axes, choosing between the baseline and the probe
        eligible = {n: c for i, (n, c) in enumerate(eligible.items()) if i == 0 or n == probe}  # they paid on
        est = _selection(kind, cfg, eligible, selected, sel_cfg, rows).fit(
            _chain_X(kind, rows, _with_selected(cfg, selected), eligible), rows.label.to_numpy(), groups=groups)
    return {"estimator": est, "chain_cfg": _with_selected(cfg, selected), "uses_context": _uses_context(kind, est),
            "choice": _choices(est), "choice_why": _why(est), "cv_nll": _cv_nll(est), "transfer_guard": guard,
            "context_trials": trials, "eligible": list(eligible)}


def candidate_specs(chain_cfg: dict) -> dict:
    """A chain config's candidates, its ``baseline`` first (always a candidate; without one, the first
    listed candidate is the baseline)."""
    base = dict(chain_cfg.get("baseline") or {})
    return {**base, **{n: s for n, s in chain_cfg["candidates"].items() if n not in base}}


def prompt_groups(samples: pd.DataFrame) -> np.ndarray:
    """One group id per row: its prompt, the unit no fold may split; the rank of its name "category/prompt_idx"
    among the prompts' (so folds and prompt samples are the names' own, without a string per row)."""
    cat_codes, cats = pd.factorize(samples.category, use_na_sentinel=False)
    idx_codes, idxs = pd.factorize(samples.prompt_idx, use_na_sentinel=False)
    codes, keys = pd.factorize(cat_codes.astype(np.int64) * max(len(idxs), 1) + idx_codes)
    names = [f"{cats[k // len(idxs)]}/{idxs[k % len(idxs)]}" for k in keys.tolist()]
    rank = np.empty(len(names), dtype=np.int64)
    rank[sorted(range(len(names)), key=names.__getitem__)] = np.arange(len(names))
    return rank[codes]


def _with_axes(kind: ChainKind, est, selected) -> object:
    """A candidate as the chain fits it: a model reading named features of a chain without a raw
    confidence reads the selected context axes as features too."""
    feats = est.get_params(deep=False).get("features")
    if feats is None or kind.confidence:
        return est
    return clone(est).set_params(features=(*[f for f in feats if f not in CONTEXT], *selected))


def _selection(kind: ChainKind, cfg: dict, candidates: dict, selected, sel_cfg: dict, rows: pd.DataFrame):
    """The unfitted estimator of a chain: grouped-CV selection over ``candidates``, per context cell of
    ``selected`` for a chain with a raw confidence and for one whose config says ``per_cell`` (else a chain of
    models reading named features reads the context axes as features)."""
    c = _with_selected(cfg, selected)
    n_own = len(kind.feature_names(c))
    per_cell = bool(selected) and (bool(kind.confidence) or bool(cfg.get("per_cell")))
    # fitted per cell, a candidate reads no context axis: each cell's rows hold one bucket of each
    cands = {n: _with_axes(kind, _readable(kind, e, rows), () if per_cell else selected) for n, e in candidates.items()}
    sel = GroupedCVSelection(cands, n_own=n_own, **sel_cfg)
    if per_cell:
        edges = [list(a.edges) for a in context_axes(c)]
        return PerContextCell(sel, n_own, edges, int((c.get("context") or {}).get("min_cell_samples", 500)))
    return sel


_WARNED_MISSING: set[tuple[str, str]] = set()  # (chain, candidate) already warned about features the banks lack


def _readable(kind: ChainKind, est, rows: pd.DataFrame):
    """``est`` reading only the named features the banks record (a warning for the others); for a chain
    with a raw confidence, that confidence must be its first feature (the table's interpolated axis)."""
    feats = est.get_params(deep=False).get("features")
    if feats is None:
        return est
    reads = [f for f in feats if f in rows.columns]
    missing = [f for f in feats if f not in rows.columns]
    if missing and (kind.name, est.name) not in _WARNED_MISSING:
        _WARNED_MISSING.add((kind.name, est.name))
        log.warning("%s chain %s: the banks record no %s; fitted without them", kind.name, est.name, missing)
    if kind.confidence and (not reads or reads[0] != kind.confidence):
        raise ValueError(f"{kind.name} chain {est.name}: features {list(feats)} must start with "
                         f"{kind.confidence!r} (the table's interpolated axis)")
    return clone(est).set_params(features=tuple(reads)) if missing else est


def _chain_X(kind: ChainKind, rows: pd.DataFrame, cfg: dict, candidates: dict) -> pd.DataFrame:
    """The chain's X with its depth: own features, selected context axes, then every named feature a
    candidate reads."""
    reads = [f for e in candidates.values() for f in (e.get_params(deep=False).get("features") or ())
             if f in rows.columns]
    return with_depth(kind.X(rows, cfg, reads=list(dict.fromkeys(reads))), rows.depth.to_numpy())


def _prompt_sample(rows: pd.DataFrame, n: int, seed: int = 0) -> pd.DataFrame:
    """Whole prompts of ``rows`` drawn at random until about ``n`` rows (all of them when ``n`` is 0 or
    they hold fewer): a decision taken on a sample, as the optional axes are."""
    if not n or len(rows) <= n:
        return rows
    return rows.iloc[group_sample(prompt_groups(rows), n, seed)]


def _try_axis(kind: ChainKind, rows: pd.DataFrame, cfg: dict, probe: dict, selected: list, name: str,
              sel_cfg: dict, transfer: dict | None, without=None) -> tuple[bool, dict, np.ndarray]:
    """Whether optional context axis ``name`` pays on the ``probe`` candidate: held-out NLL per fold
    (grouped CV, whole prompts) with and without it; kept when the gain exceeds one standard error of
    the paired difference and (with a ``transfer`` block) the probe with it still beats the transfer
    baseline. ``without``: the scores without it when already known; returns ``(keep, info, the
    scores of the axes kept)``."""
    groups = prompt_groups(rows)
    scores = {"without": without}
    for label, axes in (("without", selected), ("with", [*selected, name])):
        if scores.get(label) is not None:
            continue
        est = _selection(kind, cfg, probe, axes, {**sel_cfg, "n_splits": 2}, rows)  # one candidate: no inner CV
        X = _chain_X(kind, rows, _with_selected(cfg, axes), probe)
        folds = min(sel_cfg["n_splits"], len(np.unique(groups)))
        res = cross_validate(est, X, rows.label.to_numpy(), groups=groups, scoring=NEG_LOG_LOSS,
                             cv=GroupKFold(folds), error_score="raise", n_jobs=sel_cfg.get("n_jobs", 1))
        scores[label] = -res["test_score"]
    diff = scores["with"] - scores["without"]
    se = float(diff.std(ddof=1) / np.sqrt(diff.size)) if diff.size > 1 else np.inf
    keep = -float(diff.mean()) > se
    info = {"cv_nll_without": float(scores["without"].mean()), "cv_nll_with": float(scores["with"].mean()), "se": se,
            "n_rows": len(rows)}
    if keep and transfer:
        guard = _transfer_guard(kind, rows, cfg, probe, [*selected, name], transfer)
        info["transfer_guard"] = guard
        keep = all(g["eligible"] for g in guard.values())
    return keep, info, scores["with"] if keep else scores["without"]


def _transfer_guard(kind: ChainKind, rows: pd.DataFrame, cfg: dict, candidates: dict, selected, transfer) -> dict:
    """``{candidate: {"eligible", "<fit> -> <eval>": {"brier", "baseline_brier"}}}``: each candidate fitted on
    the ``transfer`` block's ``fit_on`` categories and scored on ``eval_on``, and the reverse, against the
    transfer baseline; eligible when it is not worse in either direction ({} without a transfer block or
    without both categories)."""
    if not transfer or not candidates:
        return {}
    out = {}
    rows = _prompt_sample(rows, int(transfer.get("max_samples") or 0)).assign(split="train")  # a decision: a sample
    c = _with_selected(cfg, selected)
    got = iter(transfer_checks(transfer_check, kind, rows, c, [_with_axes(kind, _readable(kind, e, rows), selected)
                                                for e in candidates.values()], transfer))
    for name in candidates:
        entry = {"eligible": True}
        for src, dst in ways(transfer):
            r = next(got)
            if isinstance(r, Exception):  # cannot be fitted on one side: not a candidate
                log.warning("%s chain %s: transfer guard %s -> %s cannot fit it (%s: %s); left out", kind.name,
                            name, "+".join(src), "+".join(dst), type(r).__name__, r)
                entry["eligible"] = False
                continue
            if r is None:
                return {}
            entry[f"{'+'.join(src)} -> {'+'.join(dst)}"] = {"brier": r["model"]["brier"],
                                                             "baseline_brier": r["baseline"]["brier"]}
            entry["eligible"] &= r["model"]["brier"] <= r["baseline"]["brier"]
        out[name] = entry
        log.info("%s chain %s: transfer guard %s", kind.name, name,
                 {k: (round(v["brier"], 4), round(v["baseline_brier"], 4)) for k, v in entry.items() if k != "eligible"}
                 | {"eligible": entry["eligible"]})
    return out


def _resolve_context(chain_cfg: dict, tr: pd.DataFrame, axes, optional, edge_specs) -> dict:
    """``chain_cfg`` with every context axis' edges resolved on the rows it is fitted on."""
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
TRANSFER_MAX_FIT = 100_000  # rows (whole prompts) the transfer check fits on


def transfer_check(kind: ChainKind, samples: pd.DataFrame, chain_cfg: dict, model, baseline, fit_on,
                   eval_on, context: bool = False, which=("model", "baseline")) -> dict | None:
    """Fit ``model`` (an estimator or its config) on some categories (e.g. chat), score it on others
    (e.g. code edits) against ``baseline``; None when either side has no rows (or one label only).
    ``which``: the entries to fit (the baseline's does not depend on the model: one fit serves every model,
    :func:`calib.training_transfer.transfer_checks`)."""
    src = _prompt_sample(samples[samples.category.isin(fit_on) & samples.split.isin(["train", "val"])],
                         TRANSFER_MAX_FIT)  # a score, not the tables: fitted on whole prompts up to this many rows
    dst = samples[samples.category.isin(eval_on)]
    if src.empty or dst.empty or dst.label.nunique() < 2 or src.label.nunique() < 2:
        return None
    if len(dst) > TRANSFER_MAX_EVAL:  # a score, not a fit: a random sample of the rows estimates it
        dst = dst.iloc[np.sort(np.random.default_rng(0).choice(len(dst), TRANSFER_MAX_EVAL, replace=False))]
    out = {"fit_on": list(fit_on), "eval_on": list(eval_on), "n_fit": len(src), "n_eval": len(dst)}
    for name, s in (("model", model), ("baseline", baseline)):
        if name not in which:
            continue
        m = clone(s) if hasattr(s, "fit") else instantiate(s)
        if name == "baseline" or not context:
            X_src, X_dst = kind.X(src, chain_cfg, context=False), kind.X(dst, chain_cfg, context=False)
        else:
            cands = m.candidates if isinstance(m, GroupedCVSelection) else {"m": m}
            X_src, X_dst = (_chain_X(kind, d, chain_cfg, cands).drop(columns=DEPTH) for d in (src, dst))
        kw = {"groups": prompt_groups(src)} if isinstance(m, (GroupedCVSelection, PerContextCell)) else {}
        m.fit(with_depth(X_src, src.depth.to_numpy()), src.label.to_numpy(), **kw)
        p = m.accept_proba(with_depth(X_dst, dst.depth.to_numpy()))
        out[name] = {"kind": getattr(m, "name", name), "features": list(getattr(m, "features", None) or X_src.columns),
                     "brier": brier(p, dst.label), "auroc": auroc(p, dst.label), "nll": nll(p, dst.label)}
    return out


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


def _fit_and_export(cfg: dict, stage: Path, out_dir: Path) -> str:
    """Fit, export and log into ``stage`` (published later as ``out_dir``); returns the summary text."""
    # rounds of requests with target-only logit transforms accept differently: left out unless asked (calib/transforms.py)
    judged_only = not bool(cfg["data"].get("keep_logit_transforms", False))
    if (cfg.get("scale") or {}).get("mode", "memory") != "memory":  # part by part (calib/training_stream.py)
        from calib.training_stream import streamed

        with streamed(cfg, judged_only) as (bank, refine):
            tracker = make_tracker(cfg.get("logger"), stage, cfg, job_type="train")
            try:
                return _fit_and_export_tracked(cfg, bank, tracker, stage, out_dir, refine)
            finally:
                tracker.finish()
    bank = load(cfg["data"]["train"], judged_only=judged_only)
    if bank.judged_only and (n_out := bank.transformed_keys().num_rows):
        log.info("left out %d rounds of requests with target-only logit transforms "
                 "(data.keep_logit_transforms=true keeps them)", n_out)
    tracker = make_tracker(cfg.get("logger"), stage, cfg, job_type="train")
    try:
        return _fit_and_export_tracked(cfg, bank, tracker, stage, out_dir)
    finally:
        tracker.finish()  # before publishing: the tracker's files are part of the unit


def _fit_and_export_tracked(cfg: dict, bank, tracker, stage: Path, out_dir: Path, refine=None) -> str:
    """``refine`` (streamed training, :class:`calib.training_stream.Refiner`): the banks' parts behind the
    sample ``bank``, whose statistics refit and score the model chain."""
    t_start = time.time()
    split_cfg = cfg["split"]
    fractions, seed = tuple(split_cfg["fractions"]), int(split_cfg["seed"])
    whole = refine.parts_bank if refine is not None else bank  # what the tables describe: every part
    widths = _chain_depths(whole)
    meta: dict = {"chains": {}, "banks": _bank_identity(whole), "split": dict(split_cfg),
                  "target_models": refine.target_models() if refine is not None else _target_models(bank)}
    summary_rows, fit_rows, chain_tables, reports = [], [], {}, {}

    for kind in chains():  # one loop: every registered chain kind the config and the banks have
        chain_cfg = cfg.get(kind.config)
        if chain_cfg is None:
            log.info("%s chain: no `%s` config group, not trained", kind.name, kind.config)
            continue
        chain_cfg = refine.chain_config(chain_cfg) if refine is not None else chain_cfg
        samples = kind.samples(bank)
        if not len(samples):
            continue
        samples["split"] = prompt_split(samples.category, samples.prompt_idx, fractions, seed)
        res, table, chain_meta, per_depth = _train_chain(kind, samples, chain_cfg, bank, widths[kind.name], seed,
                                                         refine)
        chain_tables[kind.name] = table
        if per_depth is not None:
            summary_rows = per_depth
            reports[kind.name] = samples
        meta["chains"][kind.name] = chain_meta
        for n, v in res["cv_nll"].items():
            fit_rows.append({"drafter": kind.name, "candidate": n, "cv_nll": v, "chosen": n in _chosen_names(res)})
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
    if refine is not None:
        meta["scale"] = refine.meta()
    meta["train_wall_s"] = round(time.time() - t_start, 2)
    save(stage, tables, meta)
    _log(tracker, stage, meta, summary_rows, fit_rows, reports)
    return _write_summary(stage, out_dir, meta)


def _train_chain(kind: ChainKind, samples: pd.DataFrame, chain_cfg: dict, bank, width: int, seed: int,
                 refine=None):
    """Fit one chain (:func:`fit_chain`), encode its table and score it: ``(fit result, table,
    tables.json's chain entry, per-depth test rows or None for a chain without confidences)``. With
    ``refine`` (streamed training) a chain with a raw confidence is refitted, where its choice can be,
    and scored on every part's statistics (:mod:`calib.training_stats`)."""
    res = fit_chain(kind, samples, chain_cfg)
    if refine is not None and kind.confidence:
        refine.refit(kind, res)
    chain_cfg = res["chain_cfg"]  # context axes selected, edges resolved
    best = res["estimator"]
    n_depths = int(samples.depth.max()) + 1
    tr, va, te = (samples[samples.split == s] for s in ("train", "val", "test"))
    fitted_on = pd.concat([tr, va])  # grouped CV chose on these prompts; test stays held out
    table, info = encode_chain(kind, best, fitted_on, chain_cfg, n_depths, res["uses_context"], seed)
    axes = [a.name for a in table.axes]
    chain_meta = {"id": kind.id, **_chain_ids(kind, samples), "depths": n_depths,
                  "k": max(width, n_depths), "estimator": _describe_choice(res), "choice": res["choice"],
                  "choice_why": res["choice_why"],
                  "selection": {**SELECTION_DEFAULTS, **(chain_cfg.get("selection") or {}),
                                "groups": "prompt", "baseline": next(iter(candidate_specs(chain_cfg)))},
                  "params": _params(best), **_context_cells(best),
                  **({"context_trials": res["context_trials"]} if res.get("context_trials") else {}),
                  **({"transfer_guard": res["transfer_guard"]} if res.get("transfer_guard") else {}),
                  "features": list(_features(kind, best, chain_cfg)), **info,
                  "n_samples": {s: int((samples.split == s).sum()) for s in ("train", "val", "test")},
                  "cv_nll": res["cv_nll"]}
    per_depth = None
    if kind.confidence:  # raw vs calibrated per depth, and the accepted length per round
        per_depth = _per_depth(te, table_predict(table, te[axes], te.depth), n_depths, kind.confidence)
        chain_meta["val"] = _per_depth(va, table_predict(table, va[axes], va.depth), n_depths, kind.confidence)
        chain_meta["test"] = per_depth
        if refine is not None:
            per_depth = refine.report(kind, table, chain_meta, n_depths)
        chain_meta["forecast"] = chain_forecast(table, tr, context_axes(chain_cfg), n_depths)
        rounds = _round_predictions(bank, set(zip(te.category, te.prompt_idx)), table, kind)
        chain_meta["accept_length_test"] = {
            "actual_mean": float(rounds.accept.mean()), "raw_predicted_mean": float(rounds.raw.mean()),
            "calibrated_predicted_mean": float(rounds.calibrated.mean()), "n_rounds": len(rounds)}
    else:  # the estimator itself vs its table on the test split
        table_p = table_predict(table, te[axes], te.depth) if len(te) else None
        chain_meta["test"] = ({"model": _metrics(best.accept_proba(_chain_X(kind, te, chain_cfg, _candidates(best))), te.label),
                               "table": _metrics(table_p, te.label)} if len(te) else {})
    tcfg = chain_cfg.get("transfer")
    if tcfg:  # both ways: the chosen candidates, chosen again on the one side, scored on the other
        chosen = {n: c for n, c in ((n, instantiate(candidate_specs(chain_cfg)[n])) for n in res["eligible"])
                  if n in _chosen_names(res)}
        cands = {n: _with_axes(kind, _readable(kind, c, samples), _selected_axes(chain_cfg)) for n, c in chosen.items()}
        model = GroupedCVSelection(cands, n_own=len(kind.feature_names(chain_cfg)),
                                   **{**SELECTION_DEFAULTS, **(chain_cfg.get("selection") or {})})
        chain_meta["transfer"] = []
        for (src, dst), t in zip(ways(tcfg), transfer_checks(transfer_check, kind, samples, chain_cfg, [model], tcfg)):
            if isinstance(t, Exception):  # a report, not the tables: say so and go on
                log.warning("%s chain: transfer check %s -> %s could not be fitted (%s: %s)", kind.name,
                            "+".join(src), "+".join(dst), type(t).__name__, t)
            elif t:
                chain_meta["transfer"].append(t)
    if "counterfactual" in samples.columns:
        chain_meta["label_sources"] = samples.groupby("counterfactual").size().rename(
            lambda c: "counterfactual" if c else "verified").to_dict()
    return res, table, chain_meta, per_depth


def _selected_axes(chain_cfg: dict) -> list[str]:
    return [a.name for a in context_axes(chain_cfg)] if chain_cfg.get("context") else []


