"""Wall-clock serving benchmark: calib's policies against vLLM's own, all arms in one run.

    python bench/serve.py --tables DIR                   # the full grid (hours on 2 CPU cores)
    python bench/serve.py --tables DIR --concurrency 1 4 --categories code_edit --sampling greedy --reps 3

Arms (each servable policy's ``Serving.arms`` in calib.policies, + conf/speculative/): ``none`` (no_spec),
``vllm_eagle`` and ``vllm_ngram`` (fixed: vLLM, K=4), ``vllm_dynamic`` (vllm_dsd: vLLM Dynamic SD, EAGLE,
K by batch size), ``calib_ragged`` (ragged_calibrated: EAGLE, calib truncates and picks the draft passes)
and ``calib_two_drafter`` (two_drafter: EAGLE + the n-gram chain, calib picks chain, depth and passes);
``--arms ... calib_ngram`` adds calib cutting vLLM's n-gram drafts; ``vllm_suffix`` (vLLM's suffix decoding) and
``calib_three_chain`` (EAGLE + the n-gram and the suffix chain) are the third drafter's (make install-suffix). Each (arm, repetition) is one process (calib's hooks install once per process)
that builds its engine once (``max_num_seqs`` = the largest concurrency) and serves every cell (category x
sampling x concurrency) in a shuffled order after a short warm-up on held-out prompts no cell serves; every cell
starts from an empty prefix cache and suffix trees (``calib.vllm.serve_runner.forget_served``: what an earlier cell
cached would favour whichever arm served after it), and each repetition seeds the engine apart (a sampled cell's
repetitions then draw different texts); repetitions rotate the arms' order, so arms alternate on the clock. A cell at concurrency ``c`` serves ``max(min_prompts, 2c)`` prompts (a category
holding fewer is served again from the top, so the batch fills) with ``c`` in flight. Reported per cell: the median over repetitions of output
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
import subprocess
import sys
import time
from pathlib import Path

from calib.cli import parser as plain_parser
from calib.cli import worker_env

ROOT = Path(__file__).resolve().parents[1]


def _arms():
    from calib.evaluate import clock

    info = clock.arms()
    return ({a: list(i.overrides) for a, i in info.items()}, [a for a, i in info.items() if i.default],
            clock.vllm_arms(), clock.vllm_spec_arms(), clock.calib_arms(), clock.oracle_arms())


ARMS, DEFAULT_ARMS, VLLM_ARMS, VLLM_SPEC_ARMS, CALIB_ARMS, ORACLE_ARMS = _arms()  # VLLM_ARMS: not speculating too
# calib deciding between the EAGLE draft, the n-gram chain and the suffix chain (the suffix tree: arctic-inference,
# make install-suffix; calib.vllm.server.Server.two_chains: two per step reach the allocator), run when --arms
# names it. vLLM's own suffix arm (vllm_suffix) is registered with fixed's arms (calib/policies/reference.py).
SUFFIX_ARMS = {"calib_three_chain": ["policy=two_drafter", "speculative=eagle", "policy.chains=[model,ngram,suffix]"]}
ARMS = {**ARMS, **{a: o for a, o in SUFFIX_ARMS.items() if a not in ARMS}}
CALIB_ARMS = (*CALIB_ARMS, "calib_three_chain")
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


def cell_prompts(prompts: list, n: int) -> list:
    """The first ``n`` prompts of a category, its file served again from the top where it holds fewer: at c = 64 a
    60-prompt category serves 128 requests (each prompt about twice), so the batch fills and stays full for a
    while, the steady state the replay prices (with 60 for 64 clients it never filled). The replay predicts
    the cell from the same prompts' rounds (``cell_rows``: the first 128 of 60 are all 60)."""
    if not prompts:
        raise ValueError("a category without prompts cannot fill a bench cell")
    return [prompts[i % len(prompts)] for i in range(n)]


def warmup_prompts(category: str, n: int = 2) -> list:
    """The warm-up's prompts: the first of ``category`` in the held-out set (``prompts=holdout``,
    data/prompts/holdout/; the set's first where it holds none of that category), which no cell serves, so that the
    warm-up leaves nothing in a cache a cell could reuse (the cells' prompts are the category's own file,
    :func:`cell_prompts`)."""
    from calib.prompts import load_prompts

    held_out = load_prompts(compose(["prompts=holdout"])["prompts"]["files"], root=ROOT)
    return ([p for p in held_out if p.category == category] or held_out)[:n]


def worker(spec_path: str) -> None:
    """One (arm, repetition): build the engine, warm it up, serve every cell; results to spec['out']."""
    import random

    from calib.prompts import load_prompts
    from calib.vllm.serve_runner import build_engine, calib_off, forget_served, serve_cell

    spec = json.loads(Path(spec_path).read_text())
    cfg = compose(spec["overrides"])
    # Each repetition samples its own outputs: the engine's seed moves with the repetition, the same for every arm of
    # it. With one seed, a sampled cell's repetitions drew the same texts again (an arm's accepted tokens per step
    # alike to the last digit), so its median compared one draw of each arm's outputs. Greedy cells are unchanged.
    cfg["seed"] = int(cfg["seed"]) + max(int(spec["rep"]), 0)
    llm = build_engine(cfg, ROOT, max_num_seqs=max(c["concurrency"] for c in spec["cells"]))
    cells = list(spec["cells"])
    random.Random(spec["seed"]).shuffle(cells)
    by_category = {}
    results = []
    reference: dict | None = {} if spec.get("reference") else None  # {prompt key: output token ids}
    for i, cell in enumerate(cells):
        cat = cell["category"]
        if cat not in by_category:
            by_category[cat] = load_prompts(compose([f"prompts={cat}"])["prompts"]["files"], root=ROOT)
        prompts = cell_prompts(by_category[cat], cell["n_prompts"])
        sampling = compose([f"sampling={cell['sampling']}"])["sampling"]
        sampling["max_tokens"] = cell["max_tokens"]
        if i == 0:  # warm-up: first-call costs (lazy tables, allocator, caches) off the clock, on prompts no cell serves
            serve_cell(llm, cfg, warmup_prompts(cat), {**sampling, "max_tokens": 8}, 2, cat, progress=False)
        forget_served(llm)  # every arm starts every cell from an empty prefix cache and suffix trees
        record, texts = serve_cell(llm, cfg, prompts, sampling, cell["concurrency"], cat, progress=False,
                                   tokens=reference)
        # A calib arm that decided nothing is vLLM's own arm under another name: recorded, never counted.
        record["calib_off"] = calib_off(cfg["policy"], record)
        record.update(arm=spec["arm"], rep=spec["rep"], cell=cell, texts=texts)
        results.append(record)
        print(f"  {spec['arm']:<18} rep {spec['rep']} {cat:<9} {cell['sampling']:<7} c={cell['concurrency']:<3} "
              f"{record['tok_s']:7.1f} tok/s" + (f"  calib OFF: {record['calib_off']}" if record["calib_off"] else ""),
              flush=True)
    if reference is not None:
        from calib.serve.oracle import write_reference

        write_reference(spec["reference"], reference, max_tokens=max(c["max_tokens"] for c in cells),
                        dtype=str(cfg["engine"].get("dtype", "auto")))
    Path(spec["out"]).write_text(json.dumps(results))


def run_arm(arm: str, rep: int, cells: list, args, extra: list[str], work: Path, reference: str | None = None) -> list:
    """Serve every cell with ``arm`` in one process; its records, kept in ``work`` under a digest of what was
    served (a finished (arm, rep) with the same digest is read back, not served again). ``reference``: also
    write the served outputs there as the clock oracle's reference (:mod:`calib.serve.oracle`)."""
    spec = {"arm": arm, "rep": rep, "seed": rep, "cells": cells, "reference": reference,
            "overrides": [*ARMS[arm], f"tables={args.tables}", *args.set, *extra]}
    key = hashlib.sha256(json.dumps({**spec, "tables_sha": _tables_digest(args.tables), "code": _code_digest()},
                                    sort_keys=True).encode()).hexdigest()[:12]
    done = work / f"{arm}-{rep}-{key}.json"
    if done.is_file() and (reference is None or Path(reference).is_file()):
        records = json.loads(done.read_text())
        print(f"  {arm:<18} rep {rep}: kept from an earlier run ({done})", flush=True)
        return records
    spec["out"] = str(work / f"{arm}-{rep}-{key}.partial.json")
    path = work / f"{arm}-{rep}-{key}.spec.json"
    path.write_text(json.dumps(spec))
    env = worker_env(ROOT)  # this tree's calib, whatever an editable install points at
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
    from calib.evaluate.clock import cell_prompt_count

    return [{"category": cat, "sampling": s, "concurrency": c, "max_tokens": args.max_tokens,
             "n_prompts": cell_prompt_count(c, args.min_prompts)}
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
        from calib.evaluate.clock import arms

        a = arms().get(r["arm"])
        if a is None:  # an arm no policy registers (SUFFIX_ARMS): the replay has no prediction for it
            continue
        family = a.family and a.replay_policy == a.policy  # a row of another policy is that policy's own
        row = replay_row(a.replay_policy or a.policy, family, int(r["num_speculative_tokens"]) or 1, a.dynamic,
                         c["concurrency"])
        out[key] = predicted_speedup(metrics, row=row,
                                     method=a.method, temperature=float(r["temperature"]), category=c["category"],
                                     batch=c["concurrency"], cost_model=cost_model, kinds=kinds)
    return out


def table(records: list, arms: list[str], predicted: dict | None = None) -> tuple[list[dict], str]:
    """The bench's rows (:func:`calib.evaluate.clock.rows`) and its tok/s table."""
    from calib.evaluate import clock

    rows = clock.rows(records, predicted)
    return rows, clock.tok_s_table(rows, arms)


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
    ap = plain_parser(__doc__, epilog=None)  # the --help-all line says it: 40 lines in 80 columns
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--tables", default="runs/train/default", metavar="DIR", help="train.py's out_dir")
    ap.add_argument("--arms", nargs="+", default=DEFAULT_ARMS, choices=list(ARMS), metavar="ARM",
                    help="e.g. none vllm_ngram (a wrong name lists them all)")
    ap.add_argument("--concurrency", nargs="+", type=int, default=[1, 4, 16, 64], metavar="C")
    ap.add_argument("--categories", nargs="+", default=["chat", "code_edit"], metavar="CAT")
    ap.add_argument("--sampling", nargs="+", default=["greedy", "sampled"], choices=list(SAMPLING), metavar="S")
    ap.add_argument("--reps", type=int, default=3, metavar="N")
    ap.add_argument("--max-tokens", type=int, default=64, metavar="N")
    from calib.evaluate.clock import MIN_CELL_PROMPTS, PROMPTS_PER_REQUEST

    ap.add_argument("--min-prompts", type=int, default=MIN_CELL_PROMPTS, metavar="N",
                    help=f"prompts per cell: max(this, {PROMPTS_PER_REQUEST} x concurrency)")
    ap.add_argument("--identity", action=argparse.BooleanOptionalAction, default=True,
                    help="float32 greedy outputs against no speculation's")
    ap.add_argument("--identity-prompts", type=int, default=8, metavar="N")
    ap.add_argument("--set", nargs="*", default=[], metavar="K=V", help="serve.py overrides for every arm")
    ap.add_argument("--out", default="runs/bench/serve.json", metavar="PATH")
    ap.add_argument("--work", default="runs/bench/serve-work", metavar="DIR", help="done (arm, rep); a rerun resumes")
    ap.add_argument("--from-json", metavar="PATH", help="print an earlier --out's tables (runs nothing)")
    ap.add_argument("--retable", metavar="OUT", help="with --from-json: its table redone, to OUT")
    ap.add_argument("--replay", default=None, metavar="PATH",  # under --retable: replaces the run's recorded one
                    help="eval.py's metrics.json (default runs/eval/default/)")
    ap.add_argument("--cost-model", default="engine", metavar="NAME", help="the ladder's cost model to predict by")
    ap.add_argument("--readme", nargs="*", default=[], metavar="FILE", help="redraw their blocks citing --out")
    ap.add_argument("--oracle", action=argparse.BooleanOptionalAction, default=True,
                    help="the clock oracle's arms in greedy cells")
    ap.add_argument("--tolerance", type=float, default=0.10, metavar="F",
                    help="more repetitions while a ratio spreads wider")
    ap.add_argument("--max-reps", type=int, default=None, metavar="N", help="the most repetitions (default: --reps)")
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args.worker)
    replay_given, args.replay = args.replay is not None, args.replay or "runs/eval/default/metrics.json"
    if args.from_json:
        if args.retable and Path(args.retable).resolve() == Path(args.from_json).resolve():
            sys.exit(f"--retable {args.retable}: that is the --from-json file itself; the retabled result goes to a new "
                     "file, so that the run as it was measured is kept")
        done = _read_result(args.from_json)
        if args.retable and "sources" in done:
            sys.exit(f"--retable: {args.from_json} is a grid manifest; retable each run it lists")
        if args.retable:  # the table recomputed from the run's records by this code, to a new file
            from calib.atomic import write_text_atomic
            from calib.evaluate import clock

            if replay_given:  # the same clock, predicted by another replay
                done["replay"] = args.replay
            done["table"] = clock.rows(done["runs"], predictions(done["runs"], _metrics(done.get("replay")),
                                                                 done.get("cost_model", args.cost_model)))
            done["unstable"] = clock.unstable(done["table"], done.get("tolerance", args.tolerance))
            done["retabled_from"] = args.from_json
            done["retable_command"] = " ".join(["python bench/serve.py", *(argv or sys.argv[1:])])
            write_text_atomic(Path(args.retable), json.dumps(done, indent=1))
            print(f"wrote {args.retable}")
            return report(done, args, source=args.retable)
        return report(done, args, source=args.from_json)
    if not (Path(args.tables) / "tables.json").is_file():
        sys.exit(f"--tables {args.tables}: no tables.json there; make tables with "
                 f"`python train.py out_dir={args.tables} logger=none`")
    args.tables = str(Path(args.tables).resolve())
    from calib.evaluate import clock

    cost_file = _cost_file(args)
    cells = cells_for(args)
    greedy = [c for c in cells if c["sampling"] == "greedy"]
    arms = list(args.arms)
    if args.oracle and greedy:
        arms += [a for a in ORACLE_ARMS if a not in arms]
    t_start = time.time()
    records = []
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    extra: dict[str, list[str]] = {}
    if any(a in ORACLE_ARMS for a in arms):  # the oracle's reference: no speculation's outputs of every greedy cell
        ref = str((work / f"reference-{_cells_digest(greedy, args)}.json").resolve())
        widest = {}
        for c in greedy:
            w = widest.setdefault(c["category"], {**c, "concurrency": 4, "n_prompts": 0})  # float32: batch-invariant
            w["n_prompts"] = max(w["n_prompts"], c["n_prompts"])
        print(f"[reference] no speculation's greedy outputs for the oracle -> {ref}", flush=True)
        run_arm("none", -1, list(widest.values()), args, [], work, reference=ref)
        extra = {a: [f"serve.oracle={ref}"] for a in ORACLE_ARMS}
    max_reps = max(args.reps, args.max_reps or args.reps)
    print(f"{len(arms)} arms x {args.reps} reps (up to {max_reps} while a ratio spreads more than "
          f"±{args.tolerance:.0%}) x {len(cells)} cells (each finished arm kept in {work})", flush=True)
    served_s, served, rep = 0.0, 0, 0
    while rep < args.reps or (rep < max_reps and (pending := clock.unstable(clock.rows(records), args.tolerance))):
        if rep >= args.reps:
            print(f"rep {rep}: unstable cells {pending}", flush=True)
        order = arms[rep % len(arms):] + arms[: rep % len(arms)]  # repetitions rotate the arms' order
        for i, arm in enumerate(order):
            left = len(order) - i + len(arms) * max(0, args.reps - rep - 1)
            eta = f", ETA {served_s / served * left / 60:.0f} min" if served else ""
            print(f"[rep {rep + 1}/{args.reps}, arm {i + 1}/{len(order)}] {arm}{eta}", flush=True)
            t0 = time.time()
            records += run_arm(arm, rep, greedy if arm in ORACLE_ARMS else cells, args, extra.get(arm, []), work)
            if time.time() - t0 > 5:  # an arm kept from an earlier run says nothing about the time left
                served_s, served = served_s + time.time() - t0, served + 1
        rep += 1
    ident = None
    if args.identity:
        icells = [{"category": cat, "sampling": "greedy", "concurrency": 4, "max_tokens": args.max_tokens,
                   "n_prompts": args.identity_prompts} for cat in args.categories]
        id_records = []
        for arm in ["none", *[a for a in arms if a != "none" and a not in ORACLE_ARMS]]:
            id_records += run_arm(arm, 99, icells, args, ["engine.dtype=float32"], work)
        ident = identity(id_records)
    metrics = _metrics(args.replay)
    rows, _ = table(records, arms, predictions(records, metrics, args.cost_model))
    for r in records:
        r.pop("texts", None)
    from calib.cost.step import this_machine

    result = {"command": " ".join(["python bench/serve.py", *(argv or sys.argv[1:])]), "wall_s": time.time() - t_start,
              "date": time.strftime("%Y-%m-%d"), "cpu": this_machine(), "replay": args.replay if metrics else None,
              "cost_model": args.cost_model, "arms": arms, "table": rows, "identity_float32_greedy": ident,
              "tolerance": args.tolerance, "unstable": clock.unstable(rows, args.tolerance), "cost_file": cost_file,
              "tables": args.tables, "tables_sha256": _tables_digest(args.tables),  # eval's report matches on it
              "runs": records}
    from calib.atomic import write_text_atomic

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out, json.dumps(result, indent=1))
    report(result, args, source=args.out)
    print(f"\nwrote {out} ({result['wall_s'] / 60:.1f} min)")


def _cost_file(args) -> dict:
    """The step cost calib's arms price with (``serve.cost``), where and in which dtype it was measured; a
    warning when that is not this machine or the bench's dtype (its prices, and the replay's, may be far off)."""
    from calib.cost.serving import prices_greedy_only, step_cost_path
    from calib.cost.step import load_step_cost, this_machine

    text = next((s.split("=", 1)[1] for s in args.set if s.startswith("serve.cost=")), None)
    text = text or compose([])["serve"]["cost"]
    path = step_cost_path(str(text))
    if path is None:
        return {"path": str(text), "kind": "verify-only"}
    src = load_step_cost(path if Path(path).is_absolute() else ROOT / path).source
    dtype = next((s.split("=", 1)[1] for s in args.set if s.startswith("engine.dtype=")), "auto")
    out = {"path": str(path), "cpu": src.get("cpu"), "dtype": src.get("dtype"),
           "prices_sampling": not prices_greedy_only(str(text))}
    differ = [f"CPU {src.get('cpu')!r} (this machine: {this_machine()!r})" if src.get("cpu") != this_machine() else "",
              f"dtype {src.get('dtype')!r} (this bench: {dtype!r})" if str(src.get("dtype")) != dtype else ""]
    if any(differ):
        out["warning"] = (f"serve.cost {path} was measured on another " + " and ".join(d for d in differ if d)
                          + ": calib prices steps, and the replay predicts, another machine's clock; "
                          "`python bench/prepare_replay.py` profiles this one")
        print(f"WARNING: {out['warning']}", flush=True)
    if "sampled" in args.sampling and not out["prices_sampling"]:
        out["note_sampling"] = (f"serve.cost {path} was fitted on greedy steps only: calib's arms price the T = 0.8 "
                                "cells as greedy ones (no rejection-sampler term); `python bench/prepare_replay.py` "
                                "profiles both")
        print(f"note: {out['note_sampling']}", flush=True)
    return out


def _read_result(path: str) -> dict:
    """``--from-json``'s file: a bench/serve.py result (``table`` and ``arms``) or a grid manifest (``sources``);
    anything else exits naming the file and what it lacks, not with a traceback from deep in the report."""
    from calib.sidefiles import SideFileError, read_json

    hint = "--from-json takes a bench/serve.py --out JSON or a grid manifest (docs/bench/grid-*.json)"
    try:
        done = read_json(path, dict, hint=hint)
    except SideFileError as exc:
        sys.exit(f"bench/serve.py: {exc}")
    if "sources" not in done and not (isinstance(done.get("table"), list) and isinstance(done.get("arms"), list)):
        sys.exit(f"bench/serve.py: {path}: no `table` and `arms` lists (a run's result) nor `sources` (a grid "
                 f"manifest); {hint}")
    return done


def _cells_digest(cells: list, args) -> str:
    return hashlib.sha256(json.dumps([cells, args.set, _code_digest()], sort_keys=True).encode()).hexdigest()[:12]


def _metrics(path: str | None) -> dict | None:
    if not path or not Path(path).is_file():
        print(f"(no replay prediction: {path} not found; run `python eval.py` first)", flush=True)
        return None
    return json.loads(Path(path).read_text())


def report(result: dict, args=None, source: str | None = None) -> None:
    """The answer first (each calib arm against the best vLLM arm, headroom captured), then the tables; with
    ``args.readme``, the marked blocks of those files that cite ``source`` are redrawn from it."""
    from calib.evaluate import clock_blocks

    rel = os.path.relpath(Path(source).resolve(), ROOT) if source else None  # as the marked blocks cite it
    if "sources" in result:  # a grid manifest (docs/bench/grid-*.json): each cell's latest run, one answer
        try:
            print(clock_blocks.render_grid(result, rel or "grid"))
        except (FileNotFoundError, ValueError) as exc:  # the manifest or a source it lists, named by the message
            sys.exit(f"bench/serve.py: {source}: {exc}")
    else:
        _report_run(result)
    for doc in (args.readme if args is not None else []):
        n = clock_blocks.redraw(Path(doc), ROOT, only=rel)
        print(f"redrew {n} marked block(s) of {doc} citing {rel}")


def _report_run(result: dict) -> None:
    from calib.evaluate import clock

    rows, arms = result["table"], result["arms"]
    print("\n".join(clock.answer_lines(rows)))
    deploy = clock.deploy_lines(rows)
    if deploy:
        print("\nWhere the model drafter does not pay:\n" + "\n".join(deploy))
    print("\nOutput tokens/s, median [min–max] over the repetitions (ratio to the best vLLM arm of the cell, no "
          "speculation included, median of the per-repetition ratios):")
    print(clock.tok_s_table(rows, arms))
    print("\nSpeed-up over no speculation, measured on the clock: output tok/s (prefill included) / decode by "
          f"TPOT where recorded (in brackets the replay's prediction, {result.get('cost_model')} cost model, and its "
          "error):")
    print(clock.speedup_table(rows, arms))
    head = clock.headroom_table(rows)
    if head:
        print("\nHeadroom captured, per greedy cell ((calib - best vLLM) / (oracle - best vLLM)):")
        print(head)
    if result.get("unstable"):
        print(f"\nStill spread wider than ±{result.get('tolerance', 0):.0%}: {', '.join(result['unstable'])}")
    ident = result.get("identity_float32_greedy")
    if ident:
        print("\nfloat32 greedy outputs identical to no speculation:")
        for arm, o in ident.items():
            print(f"  {arm:<18} {o['identical']}/{o['prompts']}" + (f"  differ: {o['differ']}" if o["differ"] else ""))


if __name__ == "__main__":
    main()
