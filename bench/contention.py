"""What another job on the machine does to a serving arm's steps: each cell served alone, then beside a memory hog.

    python bench/contention.py --arms none vllm_ngram --out runs/bench/contention.jsonl   # ~15 min on 2 cores

On a 2-core machine the clock's cells moved by 5-13 % between runs, and a grid's no-speculation steps took 20-30 %
longer than its profile's (docs/serving.md, "December 7, evening"). This serves each (category, concurrency) cell of
each arm, greedy, 64 tokens, float32, twice alone and twice beside a process that copies 256 MB arrays on the other
core (``--hog-core``: the memory bandwidth another tenant takes), alternated, one engine per arm, and writes one JSON
line per cell: its steady step time (every client's request in flight, no prefill: the state the replay prices), its
tokens a step and its output tok/s. Run it with the engine on one core (``VLLM_CPU_OMP_THREADS_BIND=1 taskset -c 1``)
and nothing else on the machine.

Why argparse, not Hydra like train.py/eval.py: a few flags over bench/serve.py's arms, one subprocess per arm.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from calib.cli import parser as plain_parser

HOG_MB = 256  # larger than any L3 cache: every copy goes to memory
HOG = ("import numpy as np, time, sys\n"
       f"a = np.ones({HOG_MB} * 2**20 // 8); b = np.empty_like(a); end = time.time() + float(sys.argv[1])\n"
       "while time.time() < end:\n    np.copyto(b, a); np.copyto(a, b)\n")


def worker(arm: str, args) -> None:
    """One arm's engine: every cell alone and beside the hog, ``--reps`` times, alternated; a JSON line each."""
    from bench.lib.serve_arms import cell_prompts, compose, warmup_prompts
    from calib.evaluate.clock import arms, cell_prompt_count
    from calib.prompts import load_prompts
    from calib.vllm import cell_stats, serve_runner

    cfg = compose([*arms()[arm].overrides, "engine.dtype=float32"])
    llm = serve_runner.build_engine(cfg, ROOT, max_num_seqs=max(args.concurrency))
    for cat in args.categories:
        prompts = load_prompts(compose([f"prompts={cat}"])["prompts"]["files"], root=ROOT)
        sampling = {**compose(["sampling=greedy"])["sampling"], "max_tokens": args.max_tokens}
        serve_runner.serve_cell(llm, cfg, warmup_prompts(cat), {**sampling, "max_tokens": 8}, 2, cat, progress=False)
        for c in args.concurrency:
            for rep in range(args.reps):
                for hog in (False, True):
                    proc = (subprocess.Popen(["taskset", "-c", str(args.hog_core), sys.executable, "-c", HOG, "600"])
                            if hog else None)
                    try:
                        cell_stats.forget_served(llm)
                        rec, _ = serve_runner.serve_cell(llm, cfg, cell_prompts(prompts, cell_prompt_count(c)),
                                                         sampling, c, cat, progress=False)
                    finally:
                        if proc is not None:
                            proc.kill()
                            proc.wait()
                    print(json.dumps({"arm": arm, "category": cat, "concurrency": c, "rep": rep, "hog": hog,
                                      "steady_step_ms": rec["steady_step_ms"],
                                      "steady_tokens_per_step": rec["steady_tokens_per_step"],
                                      "tok_s": rec["tok_s"]}), flush=True)


def main(argv=None) -> None:
    ap = plain_parser(__doc__)
    ap.add_argument("--arms", nargs="+", default=["none", "vllm_ngram"], help="vLLM's arms of bench/serve.py")
    ap.add_argument("--categories", nargs="+", default=["code_edit", "chat"])
    ap.add_argument("--concurrency", nargs="+", type=int, default=[1, 4])
    ap.add_argument("--reps", type=int, default=2, help="each cell alone and beside the hog, this many times")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--hog-core", type=int, default=0, help="the core the hog runs on (not the engine's)")
    ap.add_argument("--out", default="runs/bench/contention.jsonl", help="one JSON line per cell, appended")
    ap.add_argument("--worker", metavar="ARM", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args.worker, args)
    from calib.evaluate.clock import vllm_arms

    unknown = [a for a in args.arms if a not in vllm_arms()]
    if unknown:
        sys.exit(f"--arms {' '.join(unknown)}: not one of vLLM's arms ({', '.join(vllm_arms())}); calib's arms read "
                 "tables, which this bench does not take")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for arm in args.arms:
        print(f"[{arm}] serving {len(args.categories) * len(args.concurrency)} cells x {args.reps} x (alone, hog)",
              flush=True)
        done = subprocess.run([sys.executable, __file__, "--worker", arm, *(argv or sys.argv[1:])], check=True,
                              capture_output=True, text=True)
        lines = [x for x in done.stdout.splitlines() if x.startswith("{")]
        with out.open("a") as fh:
            fh.writelines(x + "\n" for x in lines)
        for x in lines:
            r = json.loads(x)
            print(f"  {r['category']:<9} c={r['concurrency']:<3} {'hog  ' if r['hog'] else 'alone'} "
                  f"{r['steady_step_ms']:6.1f} ms a steady step, {r['tok_s']:6.1f} tok/s", flush=True)
    print(f"appended to {out}")


if __name__ == "__main__":
    main()
