"""What a serving bench's counts are worth at the profiled step price: the clock's noise left out, the cost model's kept.

Greedy outputs are the same whatever an arm verifies, and so, run to run, are the counts an arm's decisions leave:
draft tokens verified and accepted a step. The clock's tok/s moves by ±5-13 % a cell on a 2-core machine
(docs/serving.md, "December 7, night"), more than a change of calib's decisions may be worth. This prices each
arm's counts by the step cost serving and the replay read: tokens a step over the price of its positions,
``(B + accepted) / price[B + verified]`` at batch ``B`` = the cell's concurrency, and states it over the same
figure of the best vLLM arm of the cell (no speculation included). A prediction from measured counts, not a clock. Only the arms
that load no model drafter are priced (no speculation, the n-gram engine's): an EAGLE engine's draft passes are
not in the counts.

    python bench/priced_counts.py docs/bench/serve-2026-12-07-epyc-aside-grid.json --cost runs/replay-epyc/step-cost.json

Why argparse, not Hydra like train.py/eval.py: one JSON and one cost file in, a table out.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from calib.cli import parser as plain_parser


def priced(records: list[dict], price_at, greedy_only: bool = True) -> list[dict]:
    """One row per (cell, arm) served without a model drafter: the median over repetitions of the arm's verified and
    accepted draft tokens a step, its priced speed ``(B + accepted) / price_at(B)[B + verified]`` (``price_at``:
    batch -> float ``[T_max + 1]``, interpolated between positions) and that over the best vLLM arm's of the cell."""
    import numpy as np

    from calib.evaluate.clock import arms, vllm_arms

    info = arms()
    cells: dict[tuple, dict[str, list]] = {}
    for r in records:
        c = r["cell"]
        a = info.get(r["arm"])
        if a is None or a.method not in (None, "ngram") or (greedy_only and c["sampling"] != "greedy"):
            continue
        if r.get("calib_off") or r.get("mean_verified_per_step") is None:
            continue
        cells.setdefault((c["category"], c["sampling"], int(c["concurrency"])), {}).setdefault(r["arm"], []).append(r)
    out = []
    for (cat, sampling, B), by_arm in sorted(cells.items()):
        price = price_at(B)
        speed = {}
        for arm, rs in by_arm.items():
            ver = statistics.median(x["mean_verified_per_step"] for x in rs)
            acc = statistics.median(x["mean_accepted_per_step"] for x in rs)
            speed[arm] = (ver, acc, (B + acc) / float(np.interp(B + ver, np.arange(len(price)), price)))
        peers = [speed[a][2] for a in vllm_arms() if a in speed]
        best = max(peers) if peers else None
        for arm, (ver, acc, s) in speed.items():
            out.append({"category": cat, "sampling": sampling, "concurrency": B, "arm": arm, "verified": ver,
                        "accepted": acc, "priced_tok_s": s, "vs_best_vllm": s / best if best else None})
    return out


def main(argv=None) -> None:
    import json

    import numpy as np

    ap = plain_parser(__doc__)
    ap.add_argument("bench", help="bench/serve.py's --out JSON (its per-repetition records, `runs`)")
    ap.add_argument("--cost", required=True, help="the engine step cost it served with (serve.cost)")
    ap.add_argument("--context", type=float, default=None,
                    help="tokens cached per request (default: the profile's mean)")
    args = ap.parse_args(argv)
    from calib.cost.serving import serving_step_cost, step_cost_path

    doc = json.loads(Path(args.bench).read_text())
    if "runs" not in doc:
        sys.exit(f"{args.bench}: no `runs` (the per-repetition records of bench/serve.py --out)")
    if step_cost_path(args.cost) is None:
        sys.exit(f"--cost {args.cost}: not an engine step cost file (the JSON bench/prepare_replay.py writes, "
                 "e.g. runs/replay-epyc/step-cost.json)")
    cost = serving_step_cost(step_cost_path(args.cost))
    rows = priced(doc["runs"], lambda B: np.asarray(cost.price_curve(B * 6, B, context=args.context)))
    print(f"Counts of {args.bench} priced by {args.cost} (a prediction from measured counts, not a clock):")
    print("| category | sampling | c | arm | verified / step | accepted / step | priced tok/s | over the best vLLM arm |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        vs = "–" if r["vs_best_vllm"] is None else f"{r['vs_best_vllm']:.2f}×"
        print(f"| {r['category']} | {r['sampling']} | {r['concurrency']} | {r['arm']} | {r['verified']:.2f} | "
              f"{r['accepted']:.2f} | {r['priced_tok_s']:.1f} | {vs} |")


if __name__ == "__main__":
    main()
