"""train.py's reports: metrics per depth, summary.txt, the tracker's tables and picture, and what
tables.json says about the banks (split from :mod:`calib.training`)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from calib.atomic import write_text_atomic
from calib.bank import schema
from calib.chains import ChainKind, chain, chains, round_inputs
from calib.metrics import auroc, brier, ece, nll
from calib.tables.export import table_predict
from calib.tables.io import META, TENSORS, bank_fingerprint


def _metrics(p, y) -> dict:
    a = auroc(p, y)
    return {"n": len(y), "nll": nll(p, y), "brier": brier(p, y), "ece": ece(p, y),
            "auroc": None if np.isnan(a) else a}


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
    banks = [Path(b["path"]) for b in meta.get("banks", []) if b.get("path") and Path(b["path"]).exists()]
    if banks:  # the run's inputs: the lineage banks -> tables (an offline run records them for declare-inputs)
        tracker.use_artifact("calib-banks", "bank", banks)
    for name, m in meta["chains"].items():  # headline scalars of every chain: each split pooled over depths
        for split in ("val", "test"):
            found = m.get(split)
            if isinstance(found, list):  # per depth, with an "all" row (a chain with raw confidences)
                for row in found:
                    if row["depth"] == "all":
                        tracker.log({f"{name}/{split}/{k}": v for k, v in row.items() if k != "depth"})
                tracker.log_table(f"{name}_{split}_per_depth", found)
            elif isinstance(found, dict):  # per predictor (the n-gram chain: its model and its table)
                tracker.log({f"{name}/{split}/{who}/{k}": v for who, metrics in found.items()
                             if isinstance(metrics, dict) for k, v in metrics.items()
                             if isinstance(v, (int, float)) and not isinstance(v, bool)})
    tracker.log_table("fit", fit_rows)
    if per_depth and reports:  # the per-depth table is logged above, once (as <chain>_test_per_depth)
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


def _choice_text(m: dict) -> str:
    """How the calibrator was chosen, and what, in one phrase."""
    sel = m.get("selection") or {}
    ch = m.get("choice") or {}
    if ch and isinstance(next(iter(ch.values())), dict):
        per = "; ".join(f"{c}: " + ", ".join(f"d{d} {n}" for d, n in v.items()) for c, v in ch.items())
    else:
        per = ", ".join(f"d{d} {n}" for d, n in ch.items())
    return (f"chosen per depth by {sel.get('n_splits', '?')}-fold CV grouped by prompt "
            f"({sel.get('rule', '?')} rule, baseline {sel.get('baseline', '?')}): {per}")


def _summary_lines(name: str, m: dict) -> list[str]:
    """One chain's part of summary.txt: per-depth raw vs calibrated for a chain with raw confidences,
    estimator vs table otherwise, and the transfer check where one ran."""
    lines = []
    if isinstance(m.get("test"), list):
        lines.append(f"{name} drafter {m['ids']}: {_choice_text(m)}; test split:")
        lines.append(f"  {'depth':>5} {'n':>7} {'ECE raw':>8} {'ECE cal':>8} {'NLL raw':>8} {'NLL cal':>8}")
        for r in m["test"]:
            lines.append(f"  {r['depth']!s:>5} {r['n']:>7} {r['raw_ece']:>8.4f} {r['cal_ece']:>8.4f} "
                         f"{r['raw_nll']:>8.4f} {r['cal_nll']:>8.4f}")
        L = m["accept_length_test"]
        lines.append(f"  accepted length per round: actual {L['actual_mean']:.3f}, predicted raw "
                     f"{L['raw_predicted_mean']:.3f}, calibrated {L['calibrated_predicted_mean']:.3f} "
                     f"({L['n_rounds']} test rounds; vLLM's mean acceptance length = 1 + these: actual "
                     f"{1 + L['actual_mean']:.3f})")
    else:
        lines.append(f"{name} drafter: {_choice_text(m)}; test "
                     + ", ".join(f"{k} Brier {v['brier']:.4f} AUROC {v['auroc']:.3f}" for k, v in m["test"].items()
                                 if v.get("auroc") is not None))
    for t in m.get("transfer") or []:
        lines.append(f"  transfer {'+'.join(t['fit_on'])} -> {'+'.join(t['eval_on'])}: {m['estimator']} "
                     f"Brier {t['model']['brier']:.4f} AUROC {t['model']['auroc']:.3f} | baseline "
                     f"({'+'.join(t['baseline']['features'])}) Brier {t['baseline']['brier']:.4f} "
                     f"AUROC {t['baseline']['auroc']:.3f}")
    return lines


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


def _bank_identity(bank) -> list[dict]:
    out = []
    for path, man in zip(bank.paths, bank.manifests()):
        digest = bank_fingerprint(path)  # eval tells training banks from unseen ones by it
        out.append({"path": str(path), "acceptance_sha256": digest,
                    **{k: man.get(k) for k in ("model", "speculator", "config", "n_rounds", "engine",
                                               "engine_version", "method", "dtype")},
                    # target/drafter fingerprints (calib/fingerprint.py): what check_bank and serving compare
                    **({"identity": man["identity"]} if isinstance(man.get("identity"), dict) else {})})
    return out


def _target_models(bank) -> list[str]:
    """The target models the banks were collected with (the ``model`` key of their rounds)."""
    return sorted(map(str, bank.table(schema.ACCEPTANCE, ["model"]).column("model").unique().to_pylist()))


def _chain_depths(bank) -> dict[str, int]:
    """Drafted depth K per registered chain over the banks (the widest a bank folder records).
    Recorded so that eval and serving can refuse a deeper bank (whose extra depths would reuse the
    last row)."""
    return {kind.name: max((kind.drafted_depth(p) for p in bank.paths), default=0) for kind in chains()}


def wandb_note(out_dir: Path) -> str:
    """Where the W&B offline runs ended up: W&B names the staging folder they were written in."""
    runs = sorted(Path(out_dir).glob("wandb/offline-run-*"))
    return "".join(f"\nW&B offline run published with the outputs: wandb sync {r}" for r in runs) + (
        f"\nthen: python -m calib.tracking declare-inputs {out_dir} (the input banks' lineage edge)" if runs else "")
