"""train.py at scale: fleets of 1M, 10M, 100M rounds (16 depths) built by RESAMPLING REAL ROUNDS, trained
part by part in one process (``scale.mode=stream``) and with Ray Data (``scale.mode=ray``).

The banks are synthetic in arrangement, real in content: each 16-depth round stitches up to four real
4-depth rounds of the shipped model-drafter bank (confidences and accept masks kept; a later block is
reached only if the earlier one was fully accepted, so acceptance stays a contiguous prefix), and its
n-gram row is a real n-gram row drawn at random. The rounds are written part by part (``--part-rounds``
each, one bank folder per part, never all in memory), as a fleet of replicas would write them: each part
holds its own pseudo prompts (~500 rounds each), so round keys are disjoint. Parts are cached under
``--cache`` and shared by the sizes (the 10M fleet is the 1M fleet's part plus nine more).

Then ``train.py`` runs on each fleet in a subprocess; the script reports its wall time and peak memory:
the proportional set size summed over train.py's process tree (Ray's raylet, object store and workers
included; PSS splits a shared page between the processes sharing it, RSS would count it in each), sampled
every 0.2 s, and the largest single process's maxrss. Results go to
``docs/bench/train_scale-<date>.json`` (``--out``), with each mode's line ``wall = a + b * rounds`` (an affine
line: ``a`` the fixed cost, start-up and the fits on the sample; ``b`` the cost per round) and each point's
deviation from it, beside the line through the origin (:func:`line_fit`).

    python bench/train_scale.py --rounds 1000000 10000000 [100000000] [--modes stream ray] [--keep]

Why argparse, not Hydra like train.py/eval.py: it builds banks and runs train.py (Hydra) in a subprocess;
its own settings are a few flags.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from calib.atomic import write_json_atomic
from calib.bank import load, schema, write_bank
from calib.cli import parser as plain_parser

ROUNDS_PER_PROMPT = 500
TARGETS = {1_000_000: None, 10_000_000: 120.0, 100_000_000: 900.0}  # wall seconds (issue 46); memory 4 GB


def source_rounds(source: list[str]) -> dict:
    """The real rounds resampled: confidences and accept masks of the rounds with a confidence, their
    categories, and the banks' n-gram rows."""
    bank = load(source)
    rounds = bank.rounds()
    w = schema.width(rounds.column_names)
    conf = np.stack([rounds.column(f"conf{k}").to_numpy(zero_copy_only=False).astype(float) for k in range(w)], 1)
    has = ~np.isnan(conf).all(1)
    acc = np.stack([rounds.column(f"acc{k}").to_numpy(zero_copy_only=False).astype(float) for k in range(w)], 1)
    return {"conf": conf[has], "acc": acc[has], "width": w,
            "cats": np.asarray(rounds.column("category").to_pylist(), dtype=object)[has],
            "ngram": bank.table(schema.NGRAM).drop_columns(list(schema.KEYS)),
            "manifest": {k: v for k, v in bank.manifests()[0].items() if k in ("model", "engine", "engine_version")}}


def build_part(src: dict, n: int, depth: int, first_prompt: int, out: Path, seed: int) -> Path:
    """One part of ``n`` resampled rounds with pseudo prompts ``first_prompt ...`` (disjoint per part)."""
    rng = np.random.default_rng(seed)
    w = src["width"]
    blocks = depth // w
    pick = rng.integers(0, len(src["conf"]), size=(n, blocks))
    C = src["conf"][pick].reshape(n, blocks * w)
    A = src["acc"][pick].reshape(n, blocks * w)
    # A block is reached only if every earlier token was accepted; after the first rejection the
    # remaining drafted tokens are rejected (0), as in a real round.
    ok = np.nan_to_num(A, nan=0.0) == 1
    prefix = np.concatenate([np.ones((n, 1), bool), np.cumprod(ok, 1)[:, :-1] == 1], 1)
    A = np.where(np.isnan(A), np.nan, np.where(prefix, A, 0.0))
    accept = np.cumprod(np.nan_to_num(A, nan=0.0) == 1, axis=1).sum(1)
    n_prompts = max(1, n // ROUNDS_PER_PROMPT)
    prompt = first_prompt + rng.integers(0, n_prompts, size=n)
    order = np.lexsort((np.arange(n), prompt))
    round_idx = np.empty(n, dtype=np.int64)
    _, starts = np.unique(prompt[order], return_index=True)
    round_idx[order] = np.concatenate([np.arange(c) for c in np.diff(np.append(starts, n))])
    keys = {"model": pa.array(np.full(n, "resampled"), pa.string()),
            "speculator": pa.array(np.full(n, "resampled-model"), pa.string()),
            "config": pa.array(np.full(n, f"resampled-k{depth}"), pa.string()),
            "category": pa.array(src["cats"][pick[:, 0]].astype(str), pa.string()),
            "prompt_idx": pa.array(prompt, pa.int64()),
            "turn": pa.array(np.zeros(n, np.int16), pa.int16()), "round_idx": pa.array(round_idx, pa.int64())}
    acc_t = pa.table({**keys, "accept": pa.array(accept, pa.int64()),
                      **{f"acc{k}": pa.array(A[:, k], pa.float64(), from_pandas=True).cast(pa.int8())
                         for k in range(depth)}})
    spec_t = pa.table({**keys, **{f"conf{k}": pa.array(C[:, k], pa.float64(), from_pandas=True)
                                  for k in range(depth)}})
    ng = src["ngram"].take(pa.array(rng.integers(0, src["ngram"].num_rows, size=n)))
    for name in reversed(schema.KEYS):
        ng = ng.add_column(0, name, keys[name])
    manifest = {**src["manifest"], "model": "resampled", "speculator": "resampled-model", "config": f"resampled-k{depth}",
                "num_speculative_tokens": depth, "resampled_from": "data/banks (see bench/train_scale.py)"}
    return write_bank(out, acc_t, spec_t, ng, manifest=manifest)


def fleet(cache: Path, source: list[str], rounds: int, part_rounds: int, depth: int) -> Path:
    """A folder of ``rounds`` rounds in parts (links to the cached parts, built where missing)."""
    from tqdm.auto import tqdm

    sizes = [min(part_rounds, rounds - i) for i in range(0, rounds, part_rounds)]
    folder = cache / f"fleet-{rounds}"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    src = None
    for i, n in enumerate(tqdm(sizes, desc=f"building {rounds:,} rounds", unit="part")):
        part = cache / "parts" / f"part-{i:05d}-{n}"
        if not (part / schema.ACCEPTANCE).exists():
            src = src or source_rounds(source)
            build_part(src, n, depth, i * (part_rounds // ROUNDS_PER_PROMPT + 1), part, seed=i)
        (folder / part.name).symlink_to(part.resolve(), target_is_directory=True)
    return folder


def measure(cmd: list[str]) -> dict:
    """Run ``cmd``; its wall time, peak resident memory summed over its process tree (sampled) and the
    largest single process's maxrss."""
    import psutil

    t0 = time.time()
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "WANDB_MODE": "offline"}, stdout=subprocess.PIPE,
                            text=True)
    peak = [0, 0]  # PSS (shared pages split between the processes sharing them), RSS

    def sample():
        p = psutil.Process(proc.pid)
        while proc.poll() is None:
            pss = rss = 0
            try:
                for q in [p, *p.children(recursive=True)]:
                    with contextlib.suppress(psutil.Error):
                        m = q.memory_full_info()
                        pss, rss = pss + m.pss, rss + m.rss
            except psutil.Error:
                pass
            peak[0], peak[1] = max(peak[0], pss), max(peak[1], rss)
            time.sleep(0.2)

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    out = proc.stdout.read()
    proc.wait()
    th.join()
    return {"rc": proc.returncode, "wall_s": round(time.time() - t0, 1), "peak_tree_gb": round(peak[0] / 1e9, 2),
            "peak_tree_rss_gb": round(peak[1] / 1e9, 2),
            "peak_largest_process_gb": round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024**2, 2),
            "stdout": out}


def line_fit(rows: list[dict]) -> dict | None:
    """``wall = a + b * rounds`` fitted to one mode's points by least squares on the relative deviations (the
    20 % of the issue is relative) (an affine line: ``a`` is the fixed cost,
    start-up and the fits on the sample, ``b`` the cost per round) and each point's deviation from it; beside
    it the line through the origin (``wall = b * rounds``, proportional), so a reader sees what the intercept
    carries. None with fewer than two points."""
    if len(rows) < 2:
        return None
    x = np.array([r["rounds"] for r in rows], dtype=np.float64)
    y = np.array([r["wall_s"] for r in rows], dtype=np.float64)
    b, a = np.polyfit(x, y, 1, w=1 / y)
    prop = float(np.sum(1 / y) / np.sum(x / y**2))  # argmin_b sum((b x / y - 1)^2)

    def dev(pred):
        return [{"rounds": int(r), "wall_s": float(w), "line_s": round(float(p), 1), "deviation": round(float(w / p - 1), 3)}
                for r, w, p in zip(x, y, pred)]

    affine = dev(a + b * x)
    # two points lie on a line whatever they are: the check needs three
    within = all(abs(p["deviation"]) <= 0.2 for p in affine) if len(rows) > 2 else None
    return {"affine": {"intercept_s": round(float(a), 1), "s_per_million_rounds": round(float(b) * 1e6, 2),
                       "points": affine, "max_abs_deviation": max(abs(p["deviation"]) for p in affine),
                       "within_20_percent": within},
            "proportional": {"s_per_million_rounds": round(prop * 1e6, 2),
                             "points": (pts := dev(prop * x)),
                             "max_abs_deviation": max(abs(p["deviation"]) for p in pts)}}


def main() -> None:
    ap = plain_parser(__doc__)
    ap.add_argument("--rounds", type=int, nargs="+", default=[1_000_000, 10_000_000])
    ap.add_argument("--modes", nargs="+", default=["stream", "ray"], choices=["stream", "ray", "memory"])
    ap.add_argument("--depth", type=int, default=16)
    ap.add_argument("--part-rounds", type=int, default=1_000_000)
    ap.add_argument("--source", nargs="+", default=["data/banks/draft_model-chat_code-t0"])
    ap.add_argument("--cache", type=Path, default=Path("/tmp/calib-train-scale"))
    ap.add_argument("--keep", action="store_true", help="keep the built parts in --cache for the next run")
    ap.add_argument("--validate-parts", action="store_true",
                    help="validate each part again as train.py reads it (scale.validate_parts; the parts were "
                         "validated when built: write_bank refuses an invalid bank). Its cost is measured apart")
    ap.add_argument("--out", type=Path, default=ROOT / "docs/bench" / f"train_scale-{datetime.date.today()}.json")
    ap.add_argument("--overrides", nargs="*", default=["logger=none", "trainer.progress=false"])
    args = ap.parse_args()
    results, validate_s = [], None
    try:
        for rounds in args.rounds:
            t0 = time.time()
            folder = fleet(args.cache, [str(ROOT / s) for s in args.source], rounds, args.part_rounds, args.depth)
            parts = sorted(folder.iterdir())
            size = sum(f.stat().st_size for p in parts for f in p.resolve().iterdir())
            print(f"{rounds:,} rounds in {len(parts)} parts ({size / 1e9:.2f} GB on disk) ready in "
                  f"{time.time() - t0:.0f} s", flush=True)
            if validate_s is None:  # what scale.validate_parts=true adds per part (one process)
                from calib.bank.validate import validate

                t0 = time.time()
                validate(str(parts[0].resolve()))
                validate_s = round(time.time() - t0, 1)
            for mode in args.modes:
                out = args.cache / f"out-{rounds}-{mode}"
                cmd = [sys.executable, "train.py", f"data.train=[{folder}]", f"out_dir={out}", "overwrite=true",
                       f"scale.mode={mode}", "scale.progress=true",
                       f"scale.validate_parts={str(args.validate_parts).lower()}", *args.overrides]
                print(f"train.py {mode} on {rounds:,} rounds ...", flush=True)
                r = measure(cmd)
                if r["rc"]:
                    print(r["stdout"][-4000:])
                    raise SystemExit(f"train.py failed ({r['rc']}): {' '.join(cmd)}")
                meta = json.loads((out / "tables.json").read_text())
                stats = meta["chains"]["model"].get("statistics", {})
                row = {"rounds": rounds, "parts": len(parts), "bank_gb": round(size / 1e9, 2), "mode": mode,
                       **{k: r[k] for k in ("wall_s", "peak_tree_gb", "peak_tree_rss_gb", "peak_largest_process_gb")},
                       "sample_rounds": meta.get("scale", {}).get("sample_rounds"),
                       "listing_and_sample_wall_s": meta.get("scale", {}).get("listing_and_sample_wall_s"),
                       "statistics_wall_s": stats.get("statistics_wall_s"), "train_wall_s": meta["train_wall_s"]}
                results.append(row)
                print(" ".join(f"{k}={v}" for k, v in row.items()), flush=True)
                shutil.rmtree(out, ignore_errors=True)
    finally:
        if not args.keep:
            shutil.rmtree(args.cache, ignore_errors=True)
    print(f"\n{'rounds':>12} {'mode':>7} {'wall s':>8} {'target s':>9} {'peak GB':>8} {'target':>7}")
    for r in results:
        print(f"{r['rounds']:>12,} {r['mode']:>7} {r['wall_s']:>8.1f} {TARGETS.get(r['rounds']) or '-':>9} "
              f"{r['peak_tree_gb']:>8.2f} {4:>7}")
    lines = {m: line_fit([r for r in results if r["mode"] == m]) for m in args.modes}
    for mode, fit in lines.items():
        if fit is None:
            continue
        aff = fit["affine"]
        print(f"\n{mode}: wall = {aff['intercept_s']:.1f} s + {aff['s_per_million_rounds']:.2f} s per million rounds "
              f"(an affine line: the intercept is the fixed cost, start-up and the fits on the sample)")
        for p in aff["points"]:
            print(f"  {p['rounds']:>12,} rounds: {p['wall_s']:.1f} s measured, {p['line_s']:.1f} s on the line "
                  f"({p['deviation']:+.1%})")
        verdict = {True: "yes", False: "no", None: "not tested (two points lie on any line; it needs three)"}
        print(f"  on one line within 20 %: {verdict[aff['within_20_percent']]} (largest deviation "
              f"{aff['max_abs_deviation']:.1%}); through the origin (proportional, no intercept) the largest "
              f"deviation is {fit['proportional']['max_abs_deviation']:.1%}")
    write_json_atomic(args.out, {
        "bench": "bench/train_scale.py", "date": str(datetime.date.today()), "command": " ".join(sys.argv),
        "machine": {"cpus": os.cpu_count(), "processor": platform.processor() or platform.machine()},
        "depth": args.depth, "part_rounds": args.part_rounds, "source": args.source,
        "validate_parts": args.validate_parts, "validate_one_part_s": validate_s,
        "memory": "peak_tree_gb: proportional set size (PSS: a shared page split between its sharers) summed over "
                  "train.py's process tree (Ray's raylet, GCS, workers included), sampled every 0.2 s; "
                  "peak_tree_rss_gb: the same with RSS (shared pages counted in every process); "
                  "peak_largest_process_gb: the largest single process's maxrss",
        "targets": {"wall_s": {str(k): v for k, v in TARGETS.items() if v}, "peak_gb": 4.0}, "results": results,
        "line": {m: f for m, f in lines.items() if f},
        "line_note": "affine: wall = a + b * rounds per mode, least squares on the relative deviations, and each point's deviation from it (a line "
                     "with an intercept: a is the fixed cost); proportional: the line through the origin, for contrast"})
    print(f"written {args.out}")


if __name__ == "__main__":
    main()
