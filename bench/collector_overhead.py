"""Capture overhead: tokens/s of the same collection with calib's capture on vs off.

Runs ``collect.py`` alternately with ``capture=true`` and ``capture=false`` (same prompts, same
greedy outputs), ``--repeats`` times each, and prints the median tokens/s side by side and their
ratio. The rate is output tokens over the time spent in ``LLM.generate`` (engine start excluded).

    python bench/collector_overhead.py [--prompts chat_code] [--limit 8] [--max-tokens 128]

Why argparse, not Hydra like train.py/eval.py: it orchestrates collect.py runs in subprocesses (handing them
Hydra overrides); its own settings are a few flags, not a config tree.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from calib.cli import parser as plain_parser

ROOT = Path(__file__).resolve().parents[1]


def one(out: Path, capture: bool, args) -> float:
    cmd = [sys.executable, "collect.py", f"out_dir={out}", f"prompts={args.prompts}",
           f"prompts.limit_per_file={args.limit}", f"sampling.max_tokens={args.max_tokens}",
           f"speculative={args.speculative}", f"capture={str(capture).lower()}", "progress=false",
           f"part_size={args.part_size}"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_LOGGING_LEVEL": "WARNING"}
    subprocess.run(cmd, cwd=ROOT, env=env, check=True, capture_output=True)
    return json.loads((out / "timing.json").read_text())["tokens_per_s"]


def main() -> None:
    ap = plain_parser(__doc__)
    ap.add_argument("--prompts", default="chat_code")
    ap.add_argument("--limit", type=int, default=8, help="prompts per file")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--speculative", default="ngram")
    ap.add_argument("--part-size", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    on, off = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeats):
            for capture, acc in ((False, off), (True, on)):
                rate = one(Path(tmp) / f"{r}-{capture}", capture, args)
                acc.append(rate)
                print(f"  repeat {r} capture={'on ' if capture else 'off'} {rate:7.1f} tok/s", flush=True)
    m_on, m_off = statistics.median(on), statistics.median(off)
    print(f"\n{'speculative':<12}{'capture off':>14}{'capture on':>14}{'on/off':>10}{'overhead':>10}")
    print(f"{args.speculative:<12}{m_off:>10.1f} t/s{m_on:>10.1f} t/s{m_on / m_off:>10.3f}"
          f"{(1 - m_on / m_off) * 100:>9.1f}%")


if __name__ == "__main__":
    main()
