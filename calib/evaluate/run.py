"""``eval.py``'s body: load banks + tables, score calibration, replay policies, write outputs.

The tables are cross-checked against every bank before anything is scored (a mismatch is refused);
a training bank is scored on its held-out prompts, any other bank whole. Everything the run writes
(metrics.json, report.md, pictures, config.yaml, eval.log, the tracker's files) is staged beside
``out_dir`` and published as one unit, so a report never sits beside an earlier run's pictures; an
``out_dir`` holding an earlier report is replaced only with ``overwrite=true``.
"""

from __future__ import annotations

import hashlib
import logging
import time
from pathlib import Path

import numpy as np
from omegaconf import DictConfig, OmegaConf

from calib.atomic import staged_output, write_text_atomic
from calib.cost import CostCurve, make_curve
from calib.evaluate import plots
from calib.evaluate.calibration import POOLED_ECE_MAX, calibration_rows, length_noise, pooled_calibration_rows
from calib.evaluate.checks import check_eval
from calib.evaluate.data import load_eval_bank
from calib.evaluate.depths import depth_section
from calib.evaluate.online import online_metrics, online_settings, replays, with_online
from calib.evaluate.replay import ReplayConfig, replay
from calib.evaluate.report import (
    SLICE_MAX_ERROR,
    SLICE_MIN_ROUNDS,
    answer_lines,
    answer_rows,
    clock_lines,
    clock_summary,
    ladder_notes,
    ladder_policy_rows,
    length_headline,
    length_slices,
    newest_serving_bench,
    policy_lines,
    table,
    write_metrics,
)
from calib.metrics import ECE_CI_DESCRIPTION
from calib.tables.io import META, TENSORS

CAL_COLS = ["bank", "drafter", "variant", "category", "n", "ece", "ece_ci", "ece_equal_mass", "ece_debiased",
            "mce", "brier", "nll", "auroc", "mean_conf", "accept_rate"]
LEN_COLS = ["bank", "drafter", "variant", "temperature", "category", "n", "predicted_mean", "actual_mean", "bias", "mae", "pearson"]
SLICE_COLS = ["temperature", "chain", "category", "bank", "rounds", "actual_mean", "prompts", "actual_ci",
              "predicted_calibrated", "error_calibrated", "within_noise", "predicted_raw", "error_raw", "flag"]
POOLED_COLS = ["temperature", "chain", "banks", "n", "ece_raw", "ece_calibrated", "ece_if_calibrated",
               "ece_if_calibrated_q95", "within_noise", "target_met"]
TEMP_PIC = "reliability_temperature_"  # file prefix of the per-temperature reliability figures
log = logging.getLogger("calib.eval")


def _path(root, p) -> Path:
    p = Path(p)
    return p if p.is_absolute() else Path(root) / p


def run(cfg: DictConfig) -> dict:
    """The whole job for a composed ``conf/eval.yaml``; returns the metrics written to ``out_dir``.

    ``out_dir`` must be absent, empty, or (with ``overwrite: true``) an earlier eval.py output; a
    folder holding anything else is refused. Outputs are staged and published as one unit on
    success; a failed run leaves ``out_dir`` as it was and no staging folder behind.
    """
    check_eval(cfg)  # before anything loads: a setting that makes a metric meaningless is refused by key
    root = cfg.get("root") or "."
    target = _path(root, cfg.out_dir)
    with staged_output(target, overwrite=bool(cfg.get("overwrite", False)), job="eval.py",
                       log_file="eval.log") as stage:
        write_text_atomic(stage / "config.yaml", OmegaConf.to_yaml(cfg, resolve=True))
        log.info("eval.py -> %s (staged in %s); tables %s", target, stage.name, _path(root, cfg.tables))
        metrics = _evaluate(cfg, stage)
        log.info("%d calibration slices, %d ladder rows in %.1f s", len(metrics["calibration"]),
                 len(metrics["ladder"]), metrics["runtime_s"]["total"])
    print(f"eval: {len(metrics['calibration'])} calibration slices, {len(metrics['ladder'])} ladder rows in "
          f"{metrics['runtime_s']['total']:.1f} s (replay {metrics['runtime_s']['replay']:.1f} s) -> "
          f"{target}/metrics.json, report.md" + _wandb_note(target))
    return metrics


def _wandb_note(out: Path) -> str:
    """Where the W&B offline runs ended up: W&B names the staging folder they were written in."""
    runs = sorted(Path(out).glob("wandb/offline-run-*"))
    return "".join(f"\nW&B offline run published with the outputs: wandb sync {r}" for r in runs) + (
        f"\nthen: python -m calib.tracking declare-inputs {out} (the input tables' lineage edge)" if runs else "")


def _evaluate(cfg: DictConfig, out: Path) -> dict:
    """Load, check, score, replay and write everything into ``out`` (the staging folder)."""
    import calib.tables

    t0 = time.perf_counter()
    root = cfg.get("root") or "."
    tables = calib.tables.load(_path(root, cfg.tables))
    banks = _load_banks(cfg, tables, root)
    cal, length = calibration_rows(banks, cfg.metrics.n_bins, cfg.metrics.n_boot, cfg.metrics.seed)
    t_noise = time.perf_counter()
    noise = length_noise(banks, int(cfg.metrics.get("length_n_boot", 1000)), cfg.metrics.seed)
    pooled = pooled_calibration_rows(banks, cfg.metrics.n_bins)
    log.info("prompt bootstrap of %d accepted-length slices and %d pooled ECE rows in %.2f s", len(noise),
             len(pooled), time.perf_counter() - t_noise)
    replayed = None  # the online correction over each bank's rounds: its metrics, and what replay.online reads
    if cfg.replay.get("online"):
        replayed = replays(banks, tables, online_settings(cfg), split=cfg.split.get("name", "test"))
    rcfg, curves, ladder, replay_s = _replay_ladder(cfg, with_online(banks, replayed) if replayed else banks, root)
    pics = _pictures(cfg, banks, curves, ladder, out)
    answer = answer_rows(ladder)
    answer_pic = plots.answer(answer, out / "answer.png")
    notes = ladder_notes(ladder)
    elapsed = time.perf_counter() - t0
    slices = length_slices(length, noise=noise)
    online = online_metrics(cfg, banks, tables, out, replayed)  # the online correction, read as serving reads it
    bench = newest_serving_bench(_path(root, cfg.serving_bench) if cfg.get("serving_bench") else None)
    tables_json = _path(root, cfg.tables) / META
    clock_answer = clock_summary(bench, hashlib.sha256(tables_json.read_bytes()).hexdigest()
                                 if tables_json.is_file() else None)
    clock = clock_lines(clock_answer, out)
    metrics = {"calibration": cal, "accept_length": length, "ladder": ladder, "notes": notes, "online": online,
               "length_slices": slices, "calibration_pooled": pooled, "ece_ci_method": ECE_CI_DESCRIPTION,
               "config": OmegaConf.to_container(cfg, resolve=True),
               "tables": {"dir": str(_path(root, cfg.tables)), "meta": {k: tables.meta.get(k) for k in
                                                                       ("git_commit", "calib_version", "chains",
                                                                        "ngram_features", "banks")}},
               "banks": [{"name": b.name, "path": str(b.path), "evaluated": b.scope, "seen_in_training": b.seen,
                          "notes": b.notes} for b in banks],
               "runtime_s": {"total": elapsed, "replay": replay_s}, "clock": clock_answer, "answer": answer}
    write_metrics(out / "metrics.json", metrics)
    write_text_atomic(out / "report.md", render_report(banks, cal, length, ladder, notes, curves, rcfg, pics, out,
                                                  tables, elapsed, slices=slices, pooled=pooled, answer=answer,
                                                  answer_pic=answer_pic, online=online, clock=clock))
    _track(cfg, out, metrics, pics + ([answer_pic] if answer_pic else []))
    return metrics


def _load_banks(cfg: DictConfig, tables, root) -> list:
    """The test banks, checked against ``tables``; a training bank's ``split.name`` part is what is scored."""
    fractions = tuple(cfg.split.fractions)
    split = cfg.split.get("name", "test")
    tests = [cfg.data.test] if isinstance(cfg.data.test, str) else list(cfg.data.test)
    banks = [load_eval_bank(_path(root, p), tables, fractions, cfg.split.seed) for p in tests]
    for b in banks:
        log.info("bank %s (%s): %s", b.name, b.path, b.scope)
        for n in b.notes:
            log.warning("bank %s: %s", b.name, n)
        if split != "test" and b.seen:  # an unseen bank is evaluated whole whatever split is named
            b.split = np.where(b.split == split, "test", "other")  # replay and metrics read "test"
        if not (b.split == "test").any():
            n_prompts = len(set(zip(b.category.tolist(), b.prompt_idx.tolist())))
            raise ValueError(f"eval.py: bank {b.path} holds no {split!r} prompts to score ({b.scope}; "
                             f"{n_prompts} prompts, split fractions {list(fractions)}): collect more prompts, or "
                             "evaluate tables that did not train on this bank (then it is scored whole)")
    return banks


def _replay_ladder(cfg: DictConfig, banks: list, root) -> tuple[ReplayConfig, dict, list, float]:
    """(the replay's config, {name: cost curve}, the ladder rows, the replay's seconds)."""
    rc = OmegaConf.to_container(cfg.replay, resolve=True)
    # Every field comes from the composed config (conf/eval.yaml + overrides); `progress` is replay()'s.
    rcfg = ReplayConfig(**{k: v for k, v in rc.items() if k != "progress"},
                        draft_cost=OmegaConf.to_container(cfg.draft_cost, resolve=True))
    width = max(c.acc.shape[1] for b in banks for c in b.chains.values())
    t_max = max(rcfg.batch_sizes) * (width + 1)
    curves = {name: make_curve(name, dict(c), t_max, root) for name, c in cfg.cost.items()}
    t_replay = time.perf_counter()
    ladder = replay(banks, curves, rcfg, progress=rc.get("progress", True))
    return rcfg, curves, ladder, time.perf_counter() - t_replay


def _pictures(cfg: DictConfig, banks: list, curves: dict, ladder: list, out: Path) -> list:
    """Every figure of the report (reliability, accepted length, histograms, ladders), written into ``out``."""
    pics = []
    for b in banks:
        for d in b.chains:
            pics.append(plots.reliability(b, d, out / f"reliability_{b.name}_{d}.png", cfg.plots.reliability_bins))
        pics.append(plots.length_scatter(b, out / f"length_{b.name}.png"))
    for t in plots.temperatures(banks):  # every chain served at one temperature, side by side
        pic = plots.reliability_by_temperature(banks, t, out / f"{TEMP_PIC}{'unknown' if t is None else f'{t:g}'}.png",
                                               cfg.plots.reliability_bins)
        if pic is not None:
            pics.append(pic)
    pics.append(plots.accept_histograms(banks, out / "accept_hist.png"))
    for b in banks:
        for c in curves:
            pics.append(plots.ladder(ladder, b.name, c, out / f"ladder_{b.name}_{c}.png"))
    return pics


MAX_SUMMARY_KEYS = 50  # headline scalars per run; everything else is a wandb.Table


def _scalars(metrics: dict) -> dict:
    """The run's headline scalars (at most :data:`MAX_SUMMARY_KEYS`, whatever the number of banks): the answer
    (calib / best peer: pairs won, mean and worst), pooled ECE per (chain, variant) (mean and worst over
    temperatures), the worst accepted-length slice error, the online correction's mean length error. Every
    row behind them is logged as a table."""
    out: dict[str, float] = {}
    clock = metrics.get("clock") or {}  # the answer, measured: first in the summary
    for key, name in (("calib_best_vs_best_vllm", "clock/calib_vs_best_vllm"),
                      ("headroom_captured", "clock/headroom_captured"),
                      ("headroom_captured_decode", "clock/headroom_captured_decode"),
                      ("prediction_abs_error", "clock/replay_abs_error")):
        if clock.get(key):
            out.update({f"{name}_{s}": float(clock[key][s]) for s in ("min", "median", "max")})
    scored = [a for a in metrics["answer"] if a.get("ratio_mean") is not None]
    if scored:  # the replay's answer: a prediction
        out["replay_answer/pairs"] = len(scored)
        out["replay_answer/pairs_calib_beats_peer"] = sum(bool(a["calib_beats_peer"]) for a in scored)
        out["replay_answer/calib_vs_peer_mean"] = float(np.mean([a["ratio_mean"] for a in scored]))
        mins = [a["ratio_min"] for a in scored if a.get("ratio_min") is not None]
        if mins:
            out["replay_answer/calib_vs_peer_worst"] = float(min(mins))
    pooled: dict[str, list] = {}
    for r in metrics["calibration_pooled"]:
        for v in ("raw", "calibrated"):
            if r.get(f"ece_{v}") is not None and np.isfinite(r[f"ece_{v}"]):
                pooled.setdefault(f"ece_pooled/{r['chain']}/{v}", []).append(r[f"ece_{v}"])
    for k, vals in list(pooled.items())[:12]:
        out[f"{k}/mean_over_T"], out[f"{k}/worst_over_T"] = float(np.mean(vals)), float(max(vals))
    errs = [s["error_calibrated"] for s in metrics["length_slices"] if s.get("error_calibrated") is not None]
    big = [s["error_calibrated"] for s in metrics["length_slices"]
           if s.get("error_calibrated") is not None and s["rounds"] >= SLICE_MIN_ROUNDS]
    if errs:
        out["length/worst_slice_error"] = float(max(errs))
    if big:
        out["length/worst_large_slice_error"] = float(max(big))
    out["length/slices_flagged"] = sum(bool(s["flagged"]) for s in metrics["length_slices"])
    online = (metrics.get("online") or {}).get("slices") or []
    for v in ("tables", "online"):
        e = [r[f"error_{v}"] for r in online if r.get(f"error_{v}") is not None]
        if e:
            out[f"online/mean_length_error_{v}"] = float(np.mean(e))
    verdict = (metrics.get("online") or {}).get("depth_verdict")
    if verdict:  # depths with enough labels that end worse than raw: 0 is the target
        out.update({f"depth_vs_raw/worse_{v}": len(verdict[v]) for v in ("tables", "online")})
    assert len(out) <= MAX_SUMMARY_KEYS, sorted(out)
    return out


def _track(cfg: DictConfig, out: Path, metrics: dict, pics: list) -> None:
    """Log the scalars, tables and pictures to the configured tracker; its files join ``out``."""
    from calib.tracking import make_tracker

    tracker = make_tracker(OmegaConf.to_container(cfg.logger, resolve=True), out,
                           OmegaConf.to_container(cfg, resolve=True), "eval")
    try:
        tables_dir = Path(metrics["tables"]["dir"])  # eval's input, as train.py logged it: the lineage
        tracker.use_artifact("calib-tables", "tables", [tables_dir / TENSORS, tables_dir / META])
        tracker.log({k: v for k, v in _scalars(metrics).items() if v is not None and np.isfinite(v)})
        online = (metrics.get("online") or {})
        tracker.log_table("online", online.get("slices") or [])
        tracker.log_table("online_warmup", online.get("warmup_curve") or [])
        tracker.log_table("depth_vs_raw", [{k: (", ".join(v) if isinstance(v, list) else v) for k, v in r.items()}
                                           for r in online.get("depths") or []])
        tracker.log_table("calibration", [{**r, "depth": str(r["depth"])} for r in metrics["calibration"]])
        tracker.log_table("accept_length", metrics["accept_length"])
        tracker.log_table("length_slices", metrics["length_slices"])
        tracker.log_table("calibration_pooled", metrics["calibration_pooled"])
        tracker.log_table("answer", [{k: (", ".join(map(str, v)) if isinstance(v, list) else v) for k, v in a.items()}
                                     for a in metrics["answer"]])
        tracker.log_table("ladder", [{k: v for k, v in r.items() if not k.startswith("_")} for r in metrics["ladder"]])
        for p in pics:
            tracker.log_image(f"eval/{Path(p).stem}", p)
    finally:
        tracker.finish()  # before publishing: the tracker's files are part of the unit


def _slice_section(slices, pics, out) -> list[str]:
    """Report lines: accepted-length error per (temperature, chain, category) slice, then the
    per-temperature reliability figures; the answer (flagged slices) before the table."""
    flagged = [s for s in slices if s["flagged"]]

    def noise_note(s):
        w = s.get("within_noise")
        return "" if w is None else (", within prompt noise" if w else ", outside prompt noise")

    L = ["## Accepted length by slice (temperature, chain, category)", ""]
    L.append(f"{len(flagged)} of {sum(s['rounds'] >= SLICE_MIN_ROUNDS for s in slices)} slices with ≥ "
             f"{SLICE_MIN_ROUNDS:,} test rounds miss the {SLICE_MAX_ERROR:.0%} target"
             + (": " + "; ".join(f"{plots.temperature_label(s['temperature'])} {s['chain']} {s['category']} "
                                 f"(`{s['bank']}`) {s['error_calibrated']:.1%}{noise_note(s)}" for s in flagged)
                if flagged else "")
             + ". Error = |predicted − actual| / actual mean accepted length over the slice's test rounds; "
               "calibrated = the tables, raw = the drafter's own confidence (model chain only). Slices of "
               "different banks are kept apart (errors of opposite sign would cancel); the n-gram chain of a "
               "model-drafter bank is the counterfactual chain the context offered, which the engine did not "
               "verify. The engine does not know the category: it is a reporting slice. `prompts` = distinct "
               "test prompts in the slice; `actual_ci` = 95% percentile bootstrap interval of the actual mean, "
               "resampling whole prompts (a slice holds a few dozen prompts whose acceptance differs widely, "
               "so its actual mean is itself uncertain); `within_noise` = the calibrated prediction lies inside "
               "it, i.e. the slice's error is no larger than prompt-sampling noise.")
    L.append("")
    rows = [{**s, "temperature": "?" if s["temperature"] is None else f"{s['temperature']:g}",
             "within_noise": {True: "yes", False: "no"}.get(s.get("within_noise")),
             "flag": f"> {SLICE_MAX_ERROR:.0%}" if s["flagged"] else ""} for s in slices]
    L.append(table(rows, SLICE_COLS))
    L.append("")
    for p in pics:
        if Path(p).name.startswith(TEMP_PIC):
            L += [f"![{Path(p).stem}]({Path(p).relative_to(out)})", ""]
    return L


def _beats_raw_lines(pooled) -> list[str]:
    """One plain sentence per chain with a raw confidence: does calibration beat it, per temperature?"""
    out = []
    scored = [r for r in pooled if r.get("ece_raw") is not None and r.get("nll_calibrated") is not None]
    for chain in dict.fromkeys(r["chain"] for r in pooled if r.get("ece_raw") is not None and r not in scored):
        out += [f"**The {chain} chain** is in the banks, not in these tables: nothing to set beside its raw confidence.", ""]
    for chain in dict.fromkeys(r["chain"] for r in scored):
        parts = []
        for r in (r for r in scored if r["chain"] == chain):
            t = "T = ?" if r["temperature"] is None else f"T = {r['temperature']:g}"
            e_ok = r["ece_calibrated"] <= r["ece_raw"]
            n_ok = r.get("nll_raw") is None or r["nll_calibrated"] <= r["nll_raw"]
            verdict = "yes" if e_ok and n_ok else ("no" if not e_ok and not n_ok else "partly")
            parts.append(f"{t}: **{verdict}** (ECE {r['ece_calibrated']:.4f} vs raw {r['ece_raw']:.4f}"
                         + (f", NLL {r['nll_calibrated']:.4f} vs raw {r['nll_raw']:.4f}" if r.get("nll_raw") is not None
                            else "") + f"; a calibrated predictor shows ECE ≈ {r['ece_if_calibrated']:.4f} at this size)")
        out += [f"**Does calibration beat the {chain} drafter's raw confidence?** " + "; ".join(parts) + ".", ""]
    return out


def _pooled_section(pooled) -> list[str]:
    """Report lines: calibrated (and raw) ECE per (temperature, chain), every bank's samples pooled."""
    if not pooled:
        return []
    met = sum(r["target_met"] for r in pooled)
    noise = sum(bool(r.get("within_noise")) for r in pooled)
    L = ["## Calibration pooled per (temperature, chain)", "", *_beats_raw_lines(pooled),
         (f"{met} of {len(pooled)} (temperature, chain) pools meet the target (calibrated ECE ≤ "
          f"{POOLED_ECE_MAX:g} and not above raw where the chain has a raw confidence). Every bank's scored test "
          "samples of that temperature and chain are pooled (the n-gram chain of a model-drafter bank is its "
          "counterfactual chain); same equal-width ECE and bins as the rows below. `ece_if_calibrated` "
          "(mean, 95th percentile) is the ECE a perfectly calibrated predictor with the same predictions shows "
          "at this sample size (labels drawn from the predictions): plug-in ECE is biased upward, so a pool "
          f"at or below that percentile is within noise ({noise} of {len(pooled)} are)."), ""]
    rows = [{**r, "temperature": "?" if r["temperature"] is None else f"{r['temperature']:g}",
             "banks": ", ".join(r["banks"]), "target_met": "yes" if r["target_met"] else "**no**",
             "within_noise": "yes" if r.get("within_noise") else "no"} for r in pooled]
    L += [table(rows, POOLED_COLS), ""]
    return L


ONLINE_COLS = ["bank", "chain", "temperature", "category", "rounds", "actual_mean", "predicted_tables", "error_tables",
               "predicted_online", "error_online", "ece_tables", "ece_online"]


def _online_section(online) -> list[str]:
    """Report lines: the tables alone vs corrected online, per slice, after the warm-up."""
    if not online or not online.get("slices"):
        return []
    s = online["settings"]
    rows = online["slices"]
    better = sum((r["error_online"] or 0) <= (r["error_tables"] or 0) for r in rows)
    big = [r for r in rows if r["rounds"] >= SLICE_MIN_ROUNDS]
    L = ["## Online correction (replay of the banks' rounds in collection order)", "",
         (f"With the online correction ({'on' if s['enabled'] else 'off'}: decay {s['decay']:g}, prior "
         f"{s['prior']:g} pseudo-positions, keyed per chain, depth and {s['cells']}) the predicted mean accepted "
         f"length is at least as close to the actual as the tables alone in {better} of {len(rows)} slices; "
         f"{sum((r['error_online'] or 0) > SLICE_MAX_ERROR for r in big)} of {len(big)} slices with ≥ "
         f"{SLICE_MIN_ROUNDS:,} rounds miss the {SLICE_MAX_ERROR:.0%} target. Measured after the first "
         f"{s['warmup_rounds']} rounds of each bank's stream (a prediction: the replay, not a clock). The engine "
         "does not know a request's category, so a correction shared by a mixed stream cannot fix a per-category "
         "bias; it follows the stream's mix."), ""]
    L += [table([{**r, "temperature": "?" if r["temperature"] is None else f"{r['temperature']:g}"} for r in rows],
                ONLINE_COLS), ""]
    if online.get("figure"):
        L += [f"![online warm-up]({online['figure']})", ""]
    return L


def render_report(banks, cal, length, ladder, notes, curves, rcfg, pics, out, tables, elapsed, slices=None,
                  pooled=None, answer=None, answer_pic=None, online=None, clock=None) -> str:
    L = ["# Evaluation report", ""]
    # the answer first: calib's best policy against the best peer per (bank, cost curve)
    L += answer_lines(answer_rows(ladder) if answer is None else answer,
                      str(Path(answer_pic).relative_to(out)) if answer_pic else None, clock)
    slices = length_slices(length) if slices is None else slices
    L += [length_headline(slices), ""]
    L += _banks_section(banks, tables, elapsed)
    L += _slice_section(slices, pics, out)
    L += _pooled_section(pooled)
    L += _online_section(online)
    L += depth_section((online or {}).get("depths") or [])
    L += _calibration_section(cal, length, pics, out)
    L += _ladder_section(ladder, notes, curves, rcfg)
    for b in banks:
        for cname in curves:
            L += _ladder_tables(ladder, b.name, cname, curves[cname].unit)
    return "\n".join(L) + "\n"


def _banks_section(banks, tables, elapsed) -> list[str]:
    """Report lines: the tables, the runtime, every bank and what of it was scored, how to read raw and ECE."""
    L = [(f"Tables: `{tables.meta.get('git_commit') or '?'}` ({', '.join(tables.meta.get('chains', {}))}). "
          f"Runtime {elapsed:.0f} s. Banks (a training bank is scored on its held-out **test** prompts, "
          "split by prompt as in training; a bank training never saw is scored whole):")]
    L.append("")
    for b in banks:
        L.append(f"- `{b.name}` ({b.path}): {b.scope}")
        L += [f"  - note: {n}" for n in b.notes]
    L += ["", ("Raw = the drafter's own confidence of the token it proposed, read as P(accept | reached). "
          "The n-gram drafter has no confidence, so only its calibrated tables are scored. `ece_debiased` is "
          "the L2 estimator with the binomial variance removed (≈ 0 for a calibrated sample). `ece_ci` is a "
          f"95% {ECE_CI_DESCRIPTION}. The plain percentile interval sat wholly above its estimate on nearly "
          "calibrated slices (every resample adds noise to |gap|); the basic and BC intervals exclude the "
          "estimate in the same cases, because they correct towards the true (smaller) error. Read `ece_ci` as "
          "the spread of the reported ECE, and `ece_debiased` for where the true error lies on a nearly "
          "calibrated slice."), ""]
    return L


def _calibration_section(cal, length, pics, out) -> list[str]:
    """Report lines: calibration tables (pooled over depths, per depth), accepted length, every picture."""
    L = ["## Calibration (all depths pooled)", ""]
    L.append(table([r for r in cal if r["depth"] == "all"], CAL_COLS))
    L += ["", "### Per depth (all categories)", ""]
    L.append(table([r for r in cal if r["category"] == "all" and r["depth"] != "all"],
                   ["bank", "drafter", "variant", "depth", "n", "ece", "ece_debiased", "brier", "nll", "auroc",
                    "mean_conf", "accept_rate"]))
    L += ["", "## Expected vs actual accepted length", "",
          ("Predicted = Σ_k Π_{j≤k} p_j over the drafted depths; bias = predicted − actual mean (positive: "
           "over-confident)."), ""]
    L.append(table(length, LEN_COLS))
    L += ["", "## Pictures", ""]
    for p in pics:
        L.append(f"![{Path(p).stem}]({Path(p).relative_to(out)})")
        L.append("")
    return L


def _ladder_section(ladder, notes, curves, rcfg) -> list[str]:
    """Report lines: how the replay scores policies, the policy list, shape-dependent curves, the checks."""
    L = ["## Policy ladder (replayed serving)", ""]
    t_hi = len(next(iter(curves.values())).values) - 1
    curve_desc = "; ".join(f"`{n}` (unit: {c.unit}, C(1)={c.values[1]:.4g}, C({t_hi})={c.values[t_hi]:.4g})"
                           for n, c in curves.items())
    L.append(f"{rcfg.accounting()} A round verified at depth d "
             f"commits min(d, accepted)+1 tokens; a step costs C(B + Σ d) plus drafting "
             f"({rcfg.draft_cost} × draft passes × C(B)). Cost curves: {curve_desc}. Decisions: "
             f"`{rcfg.mode}` mode through `calib.allocate.allocate_probs` (impl={rcfg.impl}). "
             "Goodput = committed tokens per unit cost; headroom captured = (G − G_best_fixed) / "
             "(G_oracle − G_best_fixed). Signal-based policies pay K draft passes before deciding; the "
             "oracle chooses in hindsight how many to pay. Category `all` sums both categories' steps. "
             "Policies (registered in `calib.policies`, docs/policies.md):")
    L += [""] + policy_lines(ladder)
    for n, c in curves.items():
        if type(c).for_batch is not CostCurve.for_batch:  # shape-dependent (MoE): say what pricing missed
            ratios = [r["charged_vs_priced"] for r in ladder if r["cost_model"] == n and "charged_vs_priced" in r]
            L.append("")
            L.append(f"`{n}` depends on the verify shape: each step is charged its actual shape, while the "
                     "allocator priced T positions spread evenly over the batch"
                     + (f"; charged / priced cost of the allocator's steps: {min(ratios):.4f} .. {max(ratios):.4f}."
                        if ratios else "."))
    L += ["", "### Checks", ""] + [f"- {n}" for n in notes]
    return L


def _ladder_tables(ladder, bank: str, cname: str, unit: str) -> list[str]:
    """Report lines: one bank's ladder under one cost curve, a table per category (goodput / best_fixed)."""
    rows = [r for r in ladder if r["bank"] == bank and r["cost_model"] == cname]
    if not rows:
        return []
    L = ["", f"### {bank} — cost `{cname}`", ""]
    cats = sorted({r["category"] for r in rows}, key=lambda c: (c == "all", c))
    bs = sorted({r["batch_size"] for r in rows})
    for c in cats:
        L += [f"**{c}** — goodput / best_fixed (headroom captured)", ""]
        hdr = ["policy"] + [f"B={x}" for x in bs]
        out_rows = []
        for p in ladder_policy_rows(rows):
            rr = {"policy": p}
            for x in bs:
                m = [r for r in rows if r["category"] == c and r["batch_size"] == x and r["policy"] == p]
                if m:
                    h = m[0]["headroom_captured"]
                    rr[f"B={x}"] = (f"{m[0]['vs_best_fixed']:.3f}" +
                                    (f" ({h:+.2f})" if h is not None and np.isfinite(h) else ""))
            out_rows.append(rr)
        L.append(table(out_rows, hdr))
        bf = [r for r in rows if r["category"] == c and r["policy"] == "best_fixed"]
        L.append("")
        L.append("best fixed γ: " + ", ".join(f"B={r['batch_size']}: γ={r.get('gamma')} "
                                               f"({r['goodput']:.4g} tok/{unit})" for r in bf))
        L.append("")
    return L
