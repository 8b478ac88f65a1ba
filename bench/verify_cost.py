"""Measure the target's verify-pass time as a function of the positions it scores: the cost curve
``C(T)`` that ``eval.py cost=measured`` replays serving policies with.

    python bench/verify_cost.py                       # SmolLM2-135M, fp32, 1 thread -> data/cost/smollm2-135m-cpu.csv
    python bench/verify_cost.py --repeats 5 --context 512 --out /tmp/curve.csv

One verify pass of a batch appends ``T = B + Σ depth`` positions (each request's draft tokens plus
its bonus position) to contexts already in the KV cache. We time ``T`` positions appended to one
fixed-length context with a KV cache, cropping the cache back after each pass: the weight reads and
the per-position matmuls are what grows with ``T``; attention over B separate contexts of the same
length costs about as much as over one (a proxy, stated in the CSV's README). ``T`` is sampled on a
grid (every value to 16, then sparser); ``seconds`` is the median of ``--repeats`` runs (the minimum
is kept too, as ``seconds_min``: the least disturbed by other load); eval.py
interpolates linearly between grid points. The grid reaches past 128 because a batch of 128
requests verifies at least 128 positions (up to 128·(K+1) = 640 at K = 4).

Why argparse, not Hydra like train.py/eval.py: a timing of the target's forward pass with a few flags, not a
config tree from conf/.
"""

from __future__ import annotations

import csv
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

from calib.cli import parser as plain_parser

DEFAULT_GRID = (list(range(1, 17)) + list(range(20, 65, 4)) + list(range(72, 129, 8))
                + [160, 192, 256, 320, 384, 448, 512, 576, 640])


def model_dir() -> Path:
    """The HF folder calib.target.prepare_target() creates (converted once from the GGUF wheel)."""
    d = Path.home() / ".cache" / "calib" / "SmolLM2-135M-Instruct"
    if not (d / "config.json").exists():
        from calib.target import prepare_target

        d = Path(prepare_target())
    return d


def measure(grid, context: int, repeats: int, model_path: Path) -> list[tuple[int, float]]:
    import torch  # here, not at the top: --help answers without torch
    from transformers import AutoModelForCausalLM, DynamicCache

    torch.set_num_threads(1)  # per-process, as the engine's CPU workers run (see FIELD_NOTES)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    ctx_ids = torch.randint(0, vocab, (1, context), generator=gen)
    rows = []
    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        model(input_ids=ctx_ids, past_key_values=cache, use_cache=True)
        # warm-up: first calls allocate buffers and pick kernels
        for t in (1, 8, 64):
            model(input_ids=torch.randint(0, vocab, (1, t), generator=gen), past_key_values=cache,
                  use_cache=True)
            cache.crop(-t)
        # Rounds over the whole grid (not repeats of one T back to back): a burst of load from other
        # processes then inflates one sample of many T values instead of every sample of a few.
        ids = {t: torch.randint(0, vocab, (1, t), generator=gen) for t in grid}
        times = {t: [] for t in grid}
        for r in range(repeats):
            for t in grid:
                start = time.perf_counter()
                model(input_ids=ids[t], past_key_values=cache, use_cache=True)
                times[t].append(time.perf_counter() - start)
                cache.crop(-t)  # back to the fixed context: every pass sees the same length
            print(f"round {r + 1}/{repeats} done", flush=True)
        for t in grid:
            rows.append((t, statistics.median(times[t]), min(times[t])))
            print(f"T={t:4d}  median {rows[-1][1] * 1e3:8.2f} ms  min {rows[-1][2] * 1e3:8.2f} ms", flush=True)
    return rows


def write_csv(path: Path, rows) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    with os.fdopen(fd, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["T", "seconds", "seconds_min"])
        for t, s, m in rows:
            w.writerow([t, f"{s:.6f}", f"{m:.6f}"])
    os.replace(tmp, path)


def main(argv=None) -> None:
    ap = plain_parser(__doc__)
    ap.add_argument("--out", default="data/cost/smollm2-135m-cpu.csv")
    ap.add_argument("--context", type=int, default=256, help="tokens already in the KV cache")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--max-t", type=int, default=640)
    args = ap.parse_args(argv)
    grid = [t for t in DEFAULT_GRID if t <= args.max_t]
    start = time.perf_counter()
    rows = measure(grid, args.context, args.repeats, model_dir())
    write_csv(Path(args.out), rows)
    import torch

    print(f"wrote {args.out}: {len(rows)} points in {time.perf_counter() - start:.0f} s "
          f"({platform.processor() or platform.machine()}, torch {torch.__version__}, 1 thread)")


if __name__ == "__main__":
    main()
