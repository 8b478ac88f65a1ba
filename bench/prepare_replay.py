"""Make the replay replay what bench/serve.py serves: one command, this machine, the bench's own settings.

    python bench/prepare_replay.py                          # bf16 (the engine's default), 64 tokens
    python bench/prepare_replay.py --set engine.dtype=float32 --max-tokens 64 --out runs/replay-f32

Three steps, each skipped when its output is already there (so a killed run resumes where it stopped):

1. **profile** this machine's engine step (bench/profile_step.py), greedy and under sampling, each category the
   bench serves apart (``OUT/profile/<sampling>-<category>.json``), then fit one step cost from all of them
   (``--step-cost``) into ``OUT/step-cost.json``: the cost that serving prices with (``serve.cost``) and the
   replay charges (``cost.engine.path``), with the CPU and dtype it was measured on recorded in it (eval.py and
   bench/serve.py warn when those differ). Both samplings, because a step under sampling pays the rejection
   sampler's random path once it verifies a draft token (the cost's ``sampled`` term, docs/cost.md), which a
   greedy profile cannot see and the replay of the T = 0.8 banks must charge (whether serving gains by pricing it:
   on one machine, not, docs/serving.md). Both categories, because the fit's attention terms need contexts of
   both lengths (step-cost version 3);
2. **collect** banks on the prompts, K, dtype and engine the bench serves (collect.py: EAGLE and n-gram,
   greedy and T = 0.8, both categories, ``--max-tokens``) into ``OUT/collect/<method>-<sampling>/bank``;
3. **replay** them (eval.py on those banks, whole, with the tables the bench serves and that step cost) into
   ``OUT/eval/metrics.json``,

then prints the bench command that reads both (``--replay OUT/eval/metrics.json --set serve.cost=...``), so
every arm's predicted speed-up comes from the served prompts, this machine's clock and calib's own time.
39 min end to end on one core of a 2-core AMD EPYC (``VLLM_CPU_OMP_THREADS_BIND=1 taskset -c 1``, ``--set
engine.dtype=float32 --max-tokens 64``, December 6): the four profiles 24 min, the four collections 13, the replay 2.
Each step resumes: a finished one is skipped.

Why argparse, not Hydra like train.py/eval.py: it orchestrates those entry points, one subprocess each; its
flags are the bench's settings, not a config tree from conf/.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from calib.cli import parser as plain_parser
from calib.evaluate.clock import MIN_CELL_PROMPTS, PROMPTS_PER_REQUEST

ROOT = Path(__file__).resolve().parents[1]
METHODS = ("eagle", "ngram")
SAMPLINGS = ("greedy", "sampled")
PROFILE_ARMS = ("none", "vllm_ngram", "vllm_eagle", "calib_ngram", "calib_two_drafter")
# under sampling the fit needs steps with draft tokens and without (the sampled jump), not the EAGLE terms again
SAMPLED_PROFILE_ARMS = ("none", "vllm_ngram", "calib_ngram")
# The replay's step cap for a served cell: above any cell's rounds (a cell serves at most a few thousand steps),
# so that no cell is predicted from a subsample of its rounds (eval.py's default caps a setting at 128 steps).
CELL_STEPS_CAP = 1_000_000


def _run(cmd: list[str], what: str) -> None:
    print(f"[{what}] {' '.join(cmd)}", flush=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "WANDB_MODE": "offline"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, check=False)
    if proc.returncode != 0:
        sys.exit(f"{what} failed (exit {proc.returncode}): {' '.join(cmd)}; rerun this command to resume")


def staged(done: Path) -> Path:
    """Where a step whose output is written piecemeal (a profile, rewritten after each arm) writes: renamed to
    ``done`` once the step ends well, so that a killed profile is run again, not taken as finished."""
    return done.with_name(f"{done.stem}.partial{done.suffix}")


def commands(args) -> list[tuple[str, list[str], Path]]:
    """(what, command, the output whose presence means it is done), in order."""
    out = Path(args.out)
    py = sys.executable
    serve_set = [s for s in args.set]
    dtype = next((s.split("=", 1)[1] for s in args.set if s.startswith("engine.dtype=")), None)
    steps, profiles = [], []
    for sampling in SAMPLINGS:
        for category in args.categories:
            profile = out / "profile" / f"{sampling}-{category}.json"
            profiles.append(profile)
            arms = PROFILE_ARMS if sampling == "greedy" else SAMPLED_PROFILE_ARMS
            steps.append((f"profile {sampling} {category}",
                          [py, "bench/profile_step.py", "--arms", *arms, "--concurrency", *map(str, args.concurrency),
                           "--prompts", category, "--sampling", sampling, "--min-prompts", str(args.min_prompts),
                           "--max-tokens", str(args.max_tokens), "--tables", args.tables, "--out", str(staged(profile)),
                           *(["--set", *serve_set] if serve_set else [])], profile))
    steps.append(("step cost", [py, "bench/profile_step.py", "--from-json", str(profiles[0]),
                                "--with-json", *map(str, profiles[1:]), "--step-cost", str(out / "step-cost.json")],
                  out / "step-cost.json"))
    banks = []
    for method in METHODS:
        for sampling in SAMPLINGS:
            run = out / "collect" / f"{method}-{sampling}"
            banks.append(run / "bank")
            steps.append((f"collect {method} {sampling}",
                          [py, "collect.py", f"speculative={method}", f"prompts={args.prompts}", f"sampling={sampling}",
                           f"sampling.max_tokens={args.max_tokens}", f"out_dir={run}",
                           *([f"engine.dtype={dtype}"] if dtype else [])], run / "bank" / "run_manifest.json"))
    steps.append(("replay", [py, "eval.py", f"data.test=[{','.join(str(b) for b in banks)}]", f"tables={args.tables}",
                             "cost=engine", f"cost.engine.path={out / 'step-cost.json'}", f"out_dir={out / 'eval'}",
                             "overwrite=true", "logger=none", "serving_bench=null",
                             # each B replays the prompts the bench's cell at concurrency B serves
                             f"replay.cell_prompts=[{args.min_prompts},{PROMPTS_PER_REQUEST}]",
                             # every recorded round of the cell once (one pass, no cap): the cell's own steps
                             "replay.passes=1", f"replay.max_steps={CELL_STEPS_CAP}"],
                  out / "eval" / "metrics.json"))
    return steps


def main(argv=None) -> None:
    ap = plain_parser(__doc__)
    ap.add_argument("--out", default="runs/replay", help="where the step cost, banks and replay go")
    ap.add_argument("--tables", default="runs/train/default", help="the tables the bench serves")
    ap.add_argument("--prompts", default="chat_code", help="the conf/prompts/ set the bench serves")
    ap.add_argument("--max-tokens", type=int, default=64, help="bench/serve.py's --max-tokens")
    ap.add_argument("--min-prompts", type=int, default=MIN_CELL_PROMPTS, help="bench/serve.py's --min-prompts")
    ap.add_argument("--concurrency", nargs="+", type=int, default=[1, 4, 16], help="profiled concurrencies")
    ap.add_argument("--categories", nargs="+", default=["chat", "code_edit"], metavar="CAT",
                    help="bench/serve.py's --categories (conf/prompts/ names): each profiled apart")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                    help="the bench's serve.py overrides (engine.dtype=... is used for collection too)")
    ap.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    args = ap.parse_args(argv)
    if not (Path(args.tables) / "tables.json").is_file():
        sys.exit(f"--tables {args.tables}: no tables.json there; make tables with `python train.py`")
    for what, cmd, done in commands(args):
        if args.dry_run:
            print(f"[{what}] {' '.join(cmd)}")
        elif done.exists():
            print(f"[{what}] done already ({done})", flush=True)
        else:
            _run(cmd, what)
            if staged(done).exists():
                os.replace(staged(done), done)
    out = Path(args.out)
    print("\nThe bench that reads this replay and this step cost:\n  python bench/serve.py "
          f"--replay {out / 'eval' / 'metrics.json'} --set serve.cost={out / 'step-cost.json'} "
          + " ".join(args.set) + f" --max-tokens {args.max_tokens}")


if __name__ == "__main__":
    main()
