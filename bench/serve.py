"""Wall-clock serving benchmark: calib's policies against vLLM's own, all arms in one run.

    python bench/serve.py --tables DIR                   # the full grid (hours on 2 CPU cores)
    python bench/serve.py --tables DIR --concurrency 1 4 --categories code_edit --sampling greedy --reps 3

Arms (each servable policy's ``Serving.arms`` in calib.policies, + conf/speculative/): ``none`` (no_spec),
``vllm_eagle`` and ``vllm_ngram`` (fixed: vLLM, K=4), ``vllm_dynamic`` (vllm_dsd: vLLM Dynamic SD, EAGLE,
K by batch size), ``calib_ragged`` (ragged_calibrated: EAGLE, calib truncates and picks the draft passes)
and ``calib_two_drafter`` (two_drafter: EAGLE + the n-gram chain, calib picks chain, depth and passes);
``--arms ... calib_ngram`` adds calib cutting vLLM's n-gram drafts. Each (arm, repetition) is one process (calib's hooks install once per process)
that builds its engine once (``max_num_seqs`` = the largest concurrency) and serves every cell (category x
sampling x concurrency) in a shuffled order after a short warm-up; repetitions rotate the arms' order, so
arms alternate on the clock. A cell at concurrency ``c`` serves ``max(min_prompts, 2c)`` prompts (at
most the category's) with ``c`` in flight. Reported per cell: the median over repetitions of output
tokens/s, and each arm's ratio to the best vLLM arm of that cell: no speculation included (a user who
finds speculation slower turns it off), and to the best vLLM speculation arm (eagle, ngram, dynamic).

``--identity`` (on by default) also serves every category greedily in float32 with every arm, at
concurrency 4, and counts prompts whose text equals no speculation's (tests/engine_identity.py explains
why float32: bf16 greedy parts at near-ties that differ between CPUs).

Resumable: each finished (arm, repetition) is kept in ``--work`` (default runs/bench/serve-work/) under a
digest of what it served (cells, overrides, the tables' bytes, and the code: git HEAD plus its uncommitted
diff); the same command run again on the same code serves only what is missing, so an interrupted run of hours loses one arm at most. ``--set KEY=VALUE`` passes serve.py
overrides to every arm (e.g. ``engine.dtype=float32``).

Writes ``--out`` (default runs/bench/serve.json, staged then renamed) and prints the table.

Why argparse, not Hydra like train.py/eval.py: it orchestrates one subprocess per (arm, repetition) over a
grid of cells; its flags are the grid, not a config tree from conf/ (serve.py is the Hydra entry point for one
arm).
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from calib.cli import parser as plain_parser

ROOT = Path(__file__).resolve().parents[1]


def _arms() -> tuple[dict, list, tuple, tuple]:
    """{arm: serve.py overrides}, the default arms, vLLM's arms (no calib; not speculating included) and
    vLLM's speculating arms, from the servable policies of calib.policies: vLLM's first, then calib's
    (registration order within each). Also fills :data:`REPLAYED` (what the replay predicts each arm as)."""
    import calib.policies

    arms, default, vllm, vllm_spec = {}, [], [], []
    for p in sorted(calib.policies.servable(), key=lambda p: p.serving.calib):
        for arm in p.serving.arms:
            arms[arm.name] = [f"policy={p.name}"] + ([f"speculative={arm.speculative}"] if arm.speculative else [])
            # conf/speculative/<name>.yaml is named after its vLLM method (eagle, ngram)
            REPLAYED[arm.name] = (p.name, p.family, arm.speculative if p.serving.speculate else None,
                                  p.serving.dynamic)
            default += [arm.name] if arm.default else []
            vllm += [arm.name] if not p.serving.calib else []
            vllm_spec += [arm.name] if not p.serving.calib and p.serving.speculate else []
    return arms, default, tuple(vllm), tuple(vllm_spec)


REPLAYED: dict[str, tuple] = {}  # arm -> (policy name, family, speculative method or None, Dynamic SD schedule)
ARMS, DEFAULT_ARMS, VLLM_ARMS, VLLM_SPEC_ARMS = _arms()  # VLLM_ARMS: what vLLM offers, not speculating too
CALIB_ARMS = tuple(a for a in ARMS if a not in VLLM_ARMS)
SAMPLING = {"greedy": "greedy", "sampled": "sampled"}


def compose(overrides: list[str]) -> dict:
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from omegaconf import OmegaConf

    from calib.policies.config_store import store_policy_configs

    store_policy_configs()  # the `policy` group
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfg = hydra_compose("serve", overrides=[f"root={ROOT}", *overrides])
    return OmegaConf.to_container(cfg, resolve=True)


def worker(spec_path: str) -> None:
    """One (arm, repetition): build the engine, warm it up, serve every cell; results to spec['out']."""
    import random

    from calib.prompts import load_prompts
    from calib.vllm.serve_runner import build_engine, calib_off, serve_cell

    spec = json.loads(Path(spec_path).read_text())
    cfg = compose(spec["overrides"])
    llm = build_engine(cfg, ROOT, max_num_seqs=max(c["concurrency"] for c in spec["cells"]))
    cells = list(spec["cells"])
    random.Random(spec["seed"]).shuffle(cells)
    by_category = {}
    results = []
    for i, cell in enumerate(cells):
        cat = cell["category"]
        if cat not in by_category:
            by_category[cat] = load_prompts(compose([f"prompts={cat}"])["prompts"]["files"], root=ROOT)
        prompts = by_category[cat][: cell["n_prompts"]]
        sampling = compose([f"sampling={cell['sampling']}"])["sampling"]
        sampling["max_tokens"] = cell["max_tokens"]
        if i == 0:  # warm-up: first-call costs (lazy tables, allocator, caches) off the clock
            serve_cell(llm, cfg, prompts[:2], {**sampling, "max_tokens": 8}, 2, cat, progress=False)
        record, texts = serve_cell(llm, cfg, prompts, sampling, cell["concurrency"], cat, progress=False)
        # A calib arm that decided nothing is vLLM's own arm under another name: recorded, never counted.
        record["calib_off"] = calib_off(cfg["policy"], record)
        record.update(arm=spec["arm"], rep=spec["rep"], cell=cell, texts=texts)
        results.append(record)
        print(f"  {spec['arm']:<18} rep {spec['rep']} {cat:<9} {cell['sampling']:<7} c={cell['concurrency']:<3} "
              f"{record['tok_s']:7.1f} tok/s" + (f"  calib OFF: {record['calib_off']}" if record["calib_off"] else ""),
              flush=True)
    Path(spec["out"]).write_text(json.dumps(results))


def run_arm(arm: str, rep: int, cells: list, args, extra: list[str], work: Path) -> list:
    """Serve every cell with ``arm`` in one process; its records, kept in ``work`` under a digest of what was
    served (a finished (arm, rep) with the same digest is read back, not served again)."""
    spec = {"arm": arm, "rep": rep, "seed": rep, "cells": cells,
            "overrides": [*ARMS[arm], f"tables={args.tables}", *args.set, *extra]}
    key = hashlib.sha256(json.dumps({**spec, "tables_sha": _tables_digest(args.tables), "code": _code_digest()},
                                    sort_keys=True).encode()).hexdigest()[:12]
    done = work / f"{arm}-{rep}-{key}.json"
    if done.is_file():
        records = json.loads(done.read_text())
        print(f"  {arm:<18} rep {rep}: kept from an earlier run ({done})", flush=True)
        return records
    spec["out"] = str(work / f"{arm}-{rep}-{key}.partial.json")
    path = work / f"{arm}-{rep}-{key}.spec.json"
    path.write_text(json.dumps(spec))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "WANDB_MODE": "offline"}
    log = work / f"{arm}-{rep}-{key}.log"
    with open(log, "w") as fh:
        proc = subprocess.run([sys.executable, __file__, "--worker", str(path)], check=False, stdout=fh,
                              stderr=subprocess.STDOUT,
                              env=env, cwd=ROOT)
    lines = log.read_text().splitlines()
    for line in lines:
        if line.startswith("  ") and "tok/s" in line:
            print(line, flush=True)
    if proc.returncode != 0:
        tail = "\n".join(lines[-30:])
        raise RuntimeError(f"arm {arm} rep {rep} failed (exit {proc.returncode}); log {log}:\n{tail}")
    os.replace(spec["out"], done)  # only a finished (arm, rep) is ever kept
    return json.loads(done.read_text())


@functools.cache
def _code_digest() -> str:
    """git HEAD and its uncommitted diff, digested: a kept arm is never reused after the code changed."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, check=True).stdout
        diff = subprocess.run(["git", "diff", "HEAD"], cwd=ROOT, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "no git"
    return hashlib.sha256(head + diff).hexdigest()


def _tables_digest(tables: str) -> str:
    path = Path(tables) / "tables.json"
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else ""


def cells_for(args) -> list:
    return [{"category": cat, "sampling": s, "concurrency": c, "max_tokens": args.max_tokens,
             "n_prompts": max(args.min_prompts, 2 * c)}
            for cat in args.categories for s in args.sampling for c in args.concurrency]


def predictions(records: list, metrics: dict | None, cost_model: str) -> dict:
    """{(category, sampling, concurrency, arm): the replay's predicted speed-up over no speculation}."""
    from calib.evaluate.prediction import bank_kinds, predicted_speedup, replay_row

    out = {}
    if metrics is None:
        return out
    kinds = bank_kinds(metrics)  # each bank's manifest read once
    for r in records:
        c = r["cell"]
        key = (c["category"], c["sampling"], c["concurrency"], r["arm"])
        if key in out:
            continue
        name, family, method, dynamic = REPLAYED[r["arm"]]
        row = replay_row(name, family, int(r["num_speculative_tokens"]) or 1, dynamic, c["concurrency"])
        out[key] = predicted_speedup(metrics, row=row,
                                     method=method, temperature=float(r["temperature"]), category=c["category"],
                                     batch=c["concurrency"], cost_model=cost_model, kinds=kinds)
    return out


def _decode_ratios(by_arm: dict[str, list]) -> dict:
    """{arm: no speculation's median TPOT / the arm's} over the repetitions (records without TPOT: none)."""
    tpot = {a: statistics.median(x["tpot_ms_median"] for x in rs) for a, rs in by_arm.items()
            if rs and all(x.get("tpot_ms_median") is not None for x in rs)}
    if not tpot.get("none"):
        return {}
    return {a: tpot["none"] / t for a, t in tpot.items() if t}


def speedup_table(rows: list[dict], arms: list[str]) -> str:
    """Measured tok/s over no speculation's per cell and arm (and its decode speed-up by TPOT where recorded),
    beside the replay's prediction."""
    head = "| category | sampling | c | " + " | ".join(a for a in arms if a != "none") + " |"
    lines = [head, "|" + "---|" * (len(arms) + 2)]
    for row in rows:
        cells = []
        for a in arms:
            if a == "none":
                continue
            m, p = row["ratio_to_none"].get(a), row["predicted_vs_none"].get(a)
            d = (row.get("decode_ratio_to_none") or {}).get(a)
            cells.append(("–" if m is None else f"{m:.2f}×") + ("" if d is None else f" / {d:.2f}×")
                         + ("" if p is None else f" ({p:.2f}×)"))
        lines.append(f"| {row['category']} | {row['sampling']} | {row['concurrency']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def table(records: list, arms: list[str], predicted: dict | None = None) -> tuple[list[dict], str]:
    """Median tok/s per (cell, arm) over repetitions, and each arm's ratio to the best vLLM arm. A calib
    arm's repetition served with calib off (``calib_off``, :func:`calib.vllm.serve_runner.calib_off`) is not
    counted; a cell where every repetition was is shown as OFF."""
    cells: dict[tuple, dict[str, list]] = {}
    off: dict[tuple, dict[str, str]] = {}
    for r in records:
        c = r["cell"]
        key = (c["category"], c["sampling"], c["concurrency"])
        cells.setdefault(key, {})
        if r.get("calib_off"):
            off.setdefault(key, {})[r["arm"]] = r["calib_off"]
            continue
        cells[key].setdefault(r["arm"], []).append(r)
    rows = []
    for key in sorted(cells, key=lambda k: (k[0], k[1], k[2])):
        med = {a: statistics.median(x["tok_s"] for x in rs) for a, rs in cells[key].items()}
        vllm = {a: med[a] for a in VLLM_ARMS if a in med}
        best = max(vllm, key=vllm.get) if vllm else None
        spec = {a: med[a] for a in VLLM_SPEC_ARMS if a in med}
        best_spec = max(spec, key=spec.get) if spec else None
        row = {"category": key[0], "sampling": key[1], "concurrency": key[2], "tok_s": med,
               "reps": {a: len(rs) for a, rs in cells[key].items()}, "best_vllm": best,
               "calib_off": off.get(key, {}),
               "ratio_to_best_vllm": {a: med[a] / vllm[best] for a in med} if best else {},
               "best_vllm_speculative": best_spec,
               "ratio_to_best_vllm_speculative": {a: med[a] / spec[best_spec] for a in med} if best_spec else {},
               "calib_overhead_pct": {a: statistics.median(x["overhead_pct"] for x in rs)
                                      for a, rs in cells[key].items() if rs[0].get("overhead_pct") is not None},
               "ratio_to_none": {a: med[a] / med["none"] for a in med} if med.get("none") else {},
               # decode speed over no speculation's, prefill excluded: median TPOT of none / of the arm
               "decode_ratio_to_none": _decode_ratios(cells[key]),
               "predicted_vs_none": {a: (predicted or {}).get((*key, a)) for a in med},
               "tok_s_spread": {a: [min(x["tok_s"] for x in rs), max(x["tok_s"] for x in rs)]
                                for a, rs in cells[key].items()}}
        rows.append(row)
    head = "| category | sampling | c | " + " | ".join(arms) + " | best vLLM arm |"
    lines = [head, "|" + "---|" * (len(arms) + 4)]
    for row in rows:
        cellv = []
        for a in arms:
            if a not in row["tok_s"]:
                cellv.append("OFF" if a in row["calib_off"] else "–")
                continue
            ratio = row["ratio_to_best_vllm"].get(a)
            lo, hi = row["tok_s_spread"][a]
            spread = f" [{lo:.1f}–{hi:.1f}]" if row["reps"][a] > 1 else ""  # min–max over the repetitions
            cellv.append(f"{row['tok_s'][a]:.1f}{spread}" + (f" ({ratio:.2f}×)" if ratio is not None else ""))
        lines.append(f"| {row['category']} | {row['sampling']} | {row['concurrency']} | " + " | ".join(cellv)
                     + f" | {row['best_vllm']} |")
    return rows, "\n".join(lines)


def identity(records: list) -> dict:
    """Per arm: prompts whose float32 greedy text equals no speculation's."""
    ref = {}
    for r in records:
        if r["arm"] == "none":
            ref.update(r["texts"])
    out = {}
    for r in records:
        if r["arm"] == "none":
            continue
        same = [k for k, v in r["texts"].items() if ref.get(k) == v]
        o = out.setdefault(r["arm"], {"identical": 0, "prompts": 0, "differ": []})
        o["identical"] += len(same)
        o["prompts"] += len(r["texts"])
        o["differ"] += sorted(set(r["texts"]) - set(same))
    return out


def main(argv=None) -> None:
    ap = plain_parser(__doc__)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--tables", default="runs/train/default", help="tables folder (python train.py out_dir=DIR)")
    ap.add_argument("--arms", nargs="+", default=DEFAULT_ARMS, choices=list(ARMS))
    ap.add_argument("--concurrency", nargs="+", type=int, default=[1, 4, 16, 64])
    ap.add_argument("--categories", nargs="+", default=["chat", "code_edit"])
    ap.add_argument("--sampling", nargs="+", default=["greedy", "sampled"], choices=list(SAMPLING))
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--min-prompts", type=int, default=8, help="prompts per cell: max(this, 2 x concurrency)")
    ap.add_argument("--identity", action=argparse.BooleanOptionalAction, default=True,
                    help="float32 greedy output identity against no speculation (concurrency 4)")
    ap.add_argument("--identity-prompts", type=int, default=8)
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                    help="serve.py overrides for every arm, e.g. engine.dtype=float32")
    ap.add_argument("--out", default="runs/bench/serve.json")
    ap.add_argument("--work", default="runs/bench/serve-work",
                    help="where each finished (arm, repetition) is kept, so a rerun of the command resumes")
    ap.add_argument("--from-json", help="print the table of an earlier run's --out file (runs nothing)")
    ap.add_argument("--replay", default="runs/eval/default/metrics.json",
                    help="eval.py's metrics.json whose ladder predicts each cell (the replay's speed-up over none)")
    ap.add_argument("--cost-model", default="engine", help="the ladder's cost model the prediction reads")
    ap.add_argument("--readme", help="regenerate this markdown file's serve-bench block (docs/serving.md)")
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args.worker)
    if args.from_json:
        done = json.loads(Path(args.from_json).read_text())
        return report(done["runs"], done["arms"], done.get("identity_float32_greedy"),
                      len({r["rep"] for r in done["runs"]}), args, done)
    if not (Path(args.tables) / "tables.json").is_file():
        sys.exit(f"--tables {args.tables}: no tables.json there; make tables with "
                 f"`python train.py out_dir={args.tables} logger=none`")
    args.tables = str(Path(args.tables).resolve())
    cells = cells_for(args)
    t_start = time.time()
    records = []
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    print(f"{len(args.arms)} arms x {args.reps} reps x {len(cells)} cells (each finished arm kept in {work})",
          flush=True)
    runs = [(arm, rep) for rep in range(args.reps)  # repetitions rotate the arms' order
            for arm in args.arms[rep % len(args.arms):] + args.arms[: rep % len(args.arms)]]
    served_s, served = 0.0, 0
    for i, (arm, rep) in enumerate(runs):
        eta = f", ETA {served_s / served * (len(runs) - i) / 60:.0f} min" if served else ""
        print(f"[{i + 1}/{len(runs)}] {arm} rep {rep}{eta}", flush=True)
        t0 = time.time()
        records += run_arm(arm, rep, cells, args, [], work)
        if time.time() - t0 > 5:  # an arm kept from an earlier run says nothing about the time left
            served_s, served = served_s + time.time() - t0, served + 1
    ident = None
    if args.identity:
        icells = [{"category": cat, "sampling": "greedy", "concurrency": 4, "max_tokens": args.max_tokens,
                   "n_prompts": args.identity_prompts} for cat in args.categories]
        id_records = []
        for arm in ["none", *[a for a in args.arms if a != "none"]]:
            id_records += run_arm(arm, 99, icells, args, ["engine.dtype=float32"], work)
        ident = identity(id_records)
    metrics = _metrics(args.replay)
    rows, _ = table(records, args.arms, predictions(records, metrics, args.cost_model))
    for r in records:
        r.pop("texts", None)
    from calib.cost.step import this_machine

    result = {"command": " ".join(["python bench/serve.py", *(argv or sys.argv[1:])]), "wall_s": time.time() - t_start,
              "date": time.strftime("%Y-%m-%d"), "cpu": this_machine(), "replay": args.replay if metrics else None,
              "cost_model": args.cost_model, "arms": args.arms, "table": rows, "identity_float32_greedy": ident,
              "tables": args.tables, "tables_sha256": _tables_digest(args.tables),  # eval's report matches on it
              "runs": records}
    from calib.atomic import write_text_atomic

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out, json.dumps(result, indent=1))
    report(records, args.arms, ident, args.reps, args, result)
    print(f"\nwrote {out} ({result['wall_s'] / 60:.1f} min)")


def _metrics(path: str | None) -> dict | None:
    if not path or not Path(path).is_file():
        print(f"(no replay prediction: {path} not found; run `python eval.py` first)", flush=True)
        return None
    return json.loads(Path(path).read_text())


def report(records: list, arms: list[str], ident: dict | None, reps: int, args=None, result=None) -> None:
    """The answer first (calib's ratios to vLLM), then the table and the identity check; with
    ``args.readme``, the same as the file's marked block."""
    metrics = _metrics(args.replay) if args is not None else None
    rows, text = table(records, arms, predictions(records, metrics, args.cost_model if args else "engine"))
    for arm in reversed(CALIB_ARMS):
        r = [row["ratio_to_best_vllm"].get(arm) for row in rows if arm in row["tok_s"]]
        s = [row["ratio_to_best_vllm_speculative"].get(arm) for row in rows if arm in row["tok_s"]]
        if r:
            print(f"{arm}: {min(r):.2f}-{max(r):.2f}x the best vLLM arm (no speculation included), "
                  f"{min(s):.2f}-{max(s):.2f}x the best vLLM speculation arm, over {len(r)} cells")
        off = [f"{row['category']}/{row['sampling']}/c{row['concurrency']}" for row in rows
               if arm in row["calib_off"] and arm not in row["tok_s"]]
        if off:
            print(f"{arm}: calib was OFF in {len(off)} cells, not counted ({', '.join(off)}): "
                  f"{next(row['calib_off'][arm] for row in rows if arm in row['calib_off'])}")
    print(f"\nOutput tokens/s, median of {reps} [min–max] (ratio to the best vLLM arm of the cell, no speculation "
          "included):")
    print(text)
    ratios = speedup_table(rows, arms)
    print("\nSpeed-up over no speculation, measured on the clock: output tok/s (prefill included) / decode by "
          f"TPOT where recorded (in brackets the replay's prediction, {args.cost_model if args else 'engine'} cost "
          "model):")
    print(ratios)
    if ident:
        print("\nfloat32 greedy outputs identical to no speculation:")
        for arm, o in ident.items():
            print(f"  {arm:<18} {o['identical']}/{o['prompts']}" + (f"  differ: {o['differ']}" if o["differ"] else ""))
    if args is not None and args.readme and result is not None:
        write_block(Path(args.readme), readme_block(result, text, ratios, reps, ident))
        print(f"wrote the serve-bench block of {args.readme}")


BEGIN, END = "<!-- serve-bench:begin -->", "<!-- serve-bench:end -->"


def readme_block(result: dict, text: str, ratios: str, reps: int, ident: dict | None) -> str:
    same = (", ".join(f"{a} {o['identical']}/{o['prompts']}" for a, o in ident.items()) if ident else "not run")
    return (f"Measured on the clock by `{result['command']}` on {result.get('date', '?')} ({result.get('cpu', '?')}, "
            f"{result['wall_s'] / 60:.0f} min, all arms in one run, output tokens/s, median of {reps}, then "
            "the range over them in square brackets; in round brackets the ratio to the best vLLM arm of the cell, "
            "no speculation included):\n\n" + text +
            "\n\nSpeed-up over no speculation, measured: output tok/s (prefill included) / decode speed by TPOT "
            "where recorded (in brackets the replay's prediction for the same cell, "
            f"`python eval.py` ladder, {result.get('cost_model')} cost model; a prediction, not a clock):\n\n"
            + ratios + f"\n\nfloat32 greedy outputs identical to no speculation (concurrency 4): {same}.")


def write_block(path: Path, text: str, begin: str = BEGIN, end: str = END) -> None:
    """Replace the block of ``path`` between the markers ``begin`` and ``end`` with ``text`` (written to
    a temp name, then renamed)."""
    from calib.atomic import write_text_atomic

    doc = path.read_text()
    if begin not in doc or end not in doc:
        raise SystemExit(f"{path}: no {begin} ... {end} block to regenerate; add the two markers where the "
                         "table goes")
    head, rest = doc.split(begin, 1)
    write_text_atomic(path, head + begin + "\n" + text + "\n" + end + rest.split(end, 1)[1])


if __name__ == "__main__":
    main()
