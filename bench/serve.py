"""Wall-clock serving benchmark: calib's policies against vLLM's own, all arms in one run.

    python bench/serve.py --tables DIR    # the full grid (hours on 2 cores); a part: --categories code_edit --reps 3

Arms (each servable policy's ``Serving.arms`` in calib.policies, + conf/speculative/): ``none`` (no_spec),
``vllm_eagle`` and ``vllm_ngram`` (fixed: vLLM, K=4), ``vllm_dynamic`` (vllm_dsd: vLLM Dynamic SD, EAGLE,
K by batch size), ``calib_ragged`` (ragged_calibrated: EAGLE, calib truncates and picks the draft passes)
and ``calib_two_drafter`` (two_drafter: EAGLE + the n-gram chain, calib picks chain, depth and passes);
``--arms ... calib_ngram`` adds calib cutting vLLM's n-gram drafts; ``vllm_suffix`` (vLLM's suffix decoding) and
``calib_three_chain`` (EAGLE + the n-gram and the suffix chain) are the third drafter's (make install-suffix).
Each (arm, repetition) is one process (calib's hooks install once per process) that builds its engine once
(``max_num_seqs`` = the largest concurrency) and warms it up on held-out prompts no cell serves; every cell (category
x sampling x concurrency) starts from an empty prefix cache and suffix trees (``calib.vllm.cell_stats.
forget_served``: what an earlier cell cached would favour whichever arm served after it), and each repetition seeds
the engine apart (a sampled cell's repetitions then draw different texts). Repetitions rotate the arms' order;
``--interleave cells`` instead keeps every arm's engine of a repetition alive and serves each cell by every arm in
turn, seconds apart (it needs memory for every engine at once and no GPU; on a 2-core EPYC it spread the ratios no
less: bench/lib/serve_arms.py). A cell at concurrency ``c`` serves ``max(min_prompts, 2c)`` prompts (a category
holding fewer is served again from the top, so the batch fills) with ``c`` in flight. Reported per cell: the median
over repetitions of output tokens/s, and each arm's ratio to the best vLLM arm of that cell: no speculation included
(a user who finds speculation slower turns it off), and to the best vLLM speculation arm (eagle, ngram, dynamic).

``--identity`` (on by default) also serves every category greedily in float32 with every arm, at
concurrency 4, and counts prompts whose text equals no speculation's (tests/engine_identity.py explains
why float32: bf16 greedy parts at near-ties that differ between CPUs).

Resumable: each finished (arm, repetition), or (repetition, cell) under ``--interleave cells``, is kept in
``--work`` (default runs/bench/serve-work/) under a digest of what it served (cells, overrides, the tables' bytes,
and the served code: calib/, bench/, conf/ and data/ at git HEAD plus their uncommitted diff, so a commit of docs
keeps it); the same command run again on the same code serves only what is missing, so an interrupted run of hours
loses one arm (or one cell) at most. ``--set KEY=VALUE`` passes serve.py overrides to every arm (e.g.
``engine.dtype=float32``).

Writes ``--out`` (default runs/bench/serve.json, staged then renamed) and prints the table.

Why argparse, not Hydra like train.py/eval.py: it orchestrates one subprocess per (arm, repetition) over a
grid of cells; its flags are the grid, not a config tree from conf/ (serve.py is the Hydra entry point for one
arm).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from calib.cli import parser as plain_parser

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.lib import serve_arms
from bench.lib.serve_arms import cell_prompts, compose, warmup_prompts, worker  # noqa: F401 -- the worker's entry


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


def arm_overrides(arm: str, args, extra: list[str]) -> list[str]:
    """serve.py's overrides of ``arm``'s engine: the arm's own, the tables, ``--set``, then ``extra``."""
    return [*ARMS[arm], f"tables={args.tables}", *args.set, *extra]


def run_arm(arm: str, rep: int, cells: list, args, extra: list[str], work: Path, reference: str | None = None,
            max_num_seqs: int | None = None) -> list:
    """Serve every cell with ``arm`` in one process (:func:`bench.lib.serve_arms.run_arm`)."""
    spec = serve_arms.arm_spec(arm, rep, cells, arm_overrides(arm, args, extra), reference, max_num_seqs)
    return serve_arms.run_arm(spec, args.tables, work)


def cells_for(args) -> list:
    from calib.evaluate.clock import cell_prompt_count

    return [{"category": cat, "sampling": s, "concurrency": c, "max_tokens": args.max_tokens,
             "n_prompts": cell_prompt_count(c, args.min_prompts)}
            for cat in args.categories for s in args.sampling for c in args.concurrency]


def predictions(records: list, metrics: dict | None, cost_model: str) -> dict:
    """{(category, sampling, concurrency, arm): the replay's prediction over no speculation (its speed-up and the
    speed-up's factors, :class:`calib.evaluate.prediction.Predicted`)}."""
    from calib.evaluate.prediction import bank_kinds, predicted, replay_row

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
        out[key] = predicted(metrics, row=row, method=a.method, temperature=float(r["temperature"]),
                             category=c["category"], batch=c["concurrency"], cost_model=cost_model, kinds=kinds)
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
    ap.add_argument("--interleave", default="arms", choices=serve_arms.INTERLEAVE, metavar="HOW",
                    help="arms (the default) or cells (--help-all)")
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
        key = serve_arms.served_digest({"cells": greedy, "set": args.set})  # no speculation's outputs: no tables
        ref = str((work / f"reference-{key}.json").resolve())
        widest = {}
        for c in greedy:
            w = widest.setdefault(c["category"], {**c, "concurrency": 4, "n_prompts": 0})  # float32: batch-invariant
            w["n_prompts"] = max(w["n_prompts"], c["n_prompts"])
        print(f"[reference] no speculation's greedy outputs for the oracle -> {ref}", flush=True)
        run_arm("none", -1, list(widest.values()), args, [], work, reference=ref)
        extra = {a: [f"serve.oracle={ref}"] for a in ORACLE_ARMS}
    max_reps = max(args.reps, args.max_reps or args.reps)
    mode = args.interleave
    kv_gb = float(compose(list(args.set))["engine"]["kv_cache_gb"]) if mode == "cells" else None  # cells' memory
    try:
        why = serve_arms.check_interleave(mode, len(arms), kv_gb)
    except ValueError as exc:
        sys.exit(f"bench/serve.py: {exc}")
    print(f"{len(arms)} arms x {args.reps} reps (up to {max_reps} while a ratio spreads more than "
          f"±{args.tolerance:.0%}) x {len(cells)} cells, interleaved by {mode}: {why} (each finished "
          f"{'cell' if mode == 'cells' else 'arm'} kept in {work})", flush=True)
    arm_cells = {a: greedy if a in ORACLE_ARMS else cells for a in arms}
    overrides = {a: arm_overrides(a, args, extra.get(a, [])) for a in arms}
    served_s, served, rep, todo = 0.0, 0, 0, arm_cells
    widest = max(args.concurrency)  # every engine sized alike, a repetition of a few cells too
    while rep < args.reps or (rep < max_reps and (pending := clock.unstable(clock.rows(records), args.tolerance))):
        if rep >= args.reps:  # a further repetition serves only the cells still spread too wide, with every arm
            print(f"rep {rep}: unstable cells {pending}", flush=True)
            again = clock.unstable_cells(pending, cells)
            todo = {a: kept for a, cs in arm_cells.items() if (kept := [c for c in cs if c in again])}
        if mode == "cells":
            print(f"[rep {rep + 1}/{max(args.reps, rep + 1)}] every arm's engine, then each cell by every arm in turn",
                  flush=True)
            records += serve_arms.serve_rep_by_cells(todo, rep, overrides, args.tables, work, max_num_seqs=widest,
                                                     progress=lambda line: print(line, flush=True))
            rep += 1
            continue
        order = [a for a in arms[rep % len(arms):] + arms[: rep % len(arms)] if a in todo]  # rotated by repetition
        for i, arm in enumerate(order):
            left = len(order) - i + len(arms) * max(0, args.reps - rep - 1)
            eta = f", ETA {served_s / served * left / 60:.0f} min" if served else ""
            print(f"[rep {rep + 1}/{args.reps}, arm {i + 1}/{len(order)}] {arm}{eta}", flush=True)
            t0 = time.time()
            records += run_arm(arm, rep, todo[arm], args, extra.get(arm, []), work, max_num_seqs=widest)
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
              "interleave": mode, "tables": args.tables,
              "tables_sha256": serve_arms.tables_digest(args.tables),  # eval's report matches on it
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
    from calib.evaluate import clock, clock_blocks

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
    factors = clock.factor_table(rows, arms)
    if factors:
        print(f"\n{clock_blocks.FACTOR_SENTENCE}\n{factors}")
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
