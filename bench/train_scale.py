"""train.py at scale: a 1,000,000-round, 16-depth bank built by RESAMPLING REAL ROUNDS.

The bank is synthetic in arrangement, real in content: each 16-depth round stitches up to four real
4-depth rounds of the shipped model-based bank (confidences and accept masks kept; a later block is
reached only if the earlier one was fully accepted, so acceptance stays a contiguous prefix), and
its n-gram row is a real n-gram row drawn at random. Prompts are resampled into 2,000 pseudo
prompts so the split by prompt still has many groups. Then ``train.py`` runs on it in a subprocess;
the script prints wall time and peak memory (maxrss of the child) against the 120 s / 4 GB target.

    python bench/train_scale.py [--rounds 1000000] [--depth 16] [--source data/banks/...]

Why argparse, not Hydra like train.py/eval.py: it builds a bank and runs train.py (Hydra) in a subprocess; its
own settings are a few flags.
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from calib.bank import load, schema, write_bank
from calib.cli import parser as plain_parser


def build(source: list[str], n: int, depth: int, out: Path, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    bank = load(source)
    rounds = bank.rounds()
    w = schema.width(rounds.column_names)
    conf = np.stack([rounds.column(f"conf{k}").to_numpy(zero_copy_only=False).astype(float) for k in range(w)], 1)
    has = ~np.isnan(conf).all(1)
    conf = conf[has]
    acc = np.stack([rounds.column(f"acc{k}").to_numpy(zero_copy_only=False).astype(float) for k in range(w)], 1)[has]
    cats = np.asarray(rounds.column("category").to_pylist(), dtype=object)[has]
    blocks = depth // w
    pick = rng.integers(0, len(conf), size=(n, blocks))
    C = conf[pick].reshape(n, blocks * w)
    A = acc[pick].reshape(n, blocks * w)
    # A block is reached only if every earlier token was accepted; after the first rejection the
    # remaining drafted tokens are rejected (0), as in a real round.
    ok = np.nan_to_num(A, nan=0.0) == 1
    prefix = np.concatenate([np.ones((n, 1), bool), np.cumprod(ok, 1)[:, :-1] == 1], 1)
    A = np.where(np.isnan(A), np.nan, np.where(prefix, A, 0.0))
    accept = np.cumprod(np.nan_to_num(A, nan=0.0) == 1, axis=1).sum(1)
    prompt = rng.integers(0, 2000, size=n)
    cat = cats[pick[:, 0]]
    order = np.lexsort((np.arange(n), prompt))
    round_idx = np.empty(n, dtype=np.int64)
    _, starts = np.unique(prompt[order], return_index=True)
    counts = np.diff(np.append(starts, n))
    round_idx[order] = np.concatenate([np.arange(c) for c in counts])
    keys = {"model": pa.array(np.full(n, "resampled"), pa.string()),
            "speculator": pa.array(np.full(n, "resampled-model"), pa.string()),
            "config": pa.array(np.full(n, f"resampled-k{depth}"), pa.string()),
            "category": pa.array(cat.astype(str), pa.string()), "prompt_idx": pa.array(prompt, pa.int64()),
            "turn": pa.array(np.zeros(n, np.int16), pa.int16()), "round_idx": pa.array(round_idx, pa.int64())}
    acc_t = pa.table({**keys, "accept": pa.array(accept, pa.int64()),
                      **{f"acc{k}": pa.array(A[:, k], pa.float64(), from_pandas=True).cast(pa.int8())
                         for k in range(depth)}})
    spec_t = pa.table({**keys, **{f"conf{k}": pa.array(C[:, k], pa.float64(), from_pandas=True)
                                  for k in range(depth)}})
    ng = bank.table(schema.NGRAM)
    ng = ng.take(pa.array(rng.integers(0, ng.num_rows, size=n)))
    ng = ng.drop_columns(list(schema.KEYS))
    for name in reversed(schema.KEYS):
        ng = ng.add_column(0, name, keys[name])
    return write_bank(out, acc_t, spec_t, ng)


def main() -> None:
    ap = plain_parser(__doc__)
    ap.add_argument("--rounds", type=int, default=1_000_000)
    ap.add_argument("--depth", type=int, default=16)
    ap.add_argument("--source", nargs="+", default=["data/banks/draft_model-chat_code-t0"])
    ap.add_argument("--overrides", nargs="*", default=["logger=none", "trainer.progress=false"])
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.time()
        bank = build([str(ROOT / s) for s in args.source], args.rounds, args.depth, Path(tmp) / "bank")
        print(f"built {args.rounds:,}-round, {args.depth}-depth resampled bank in {time.time() - t0:.1f}s "
              f"({sum(f.stat().st_size for f in bank.iterdir()) / 1e6:.1f} MB)", flush=True)
        cmd = [sys.executable, "train.py", f"data.train=[{bank}]", f"out_dir={tmp}/out", *args.overrides]
        t0 = time.time()
        proc = subprocess.run(cmd, check=False, cwd=ROOT, env={**os.environ, "WANDB_MODE": "offline"},
                              capture_output=True, text=True)
        wall = time.time() - t0
        peak_gb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024**2
        if proc.returncode:
            print(proc.stdout[-3000:], proc.stderr[-5000:])
            raise SystemExit(proc.returncode)
        print(proc.stdout[-2500:])
        print(f"{'':<24}{'measured':>12}{'target':>10}{'ratio':>8}")
        print(f"{'train.py wall time (s)':<24}{wall:>12.1f}{120:>10}{wall / 120:>8.2f}")
        print(f"{'peak memory (GB)':<24}{peak_gb:>12.2f}{4:>10}{peak_gb / 4:>8.2f}")


if __name__ == "__main__":
    main()
