"""A digest of serving decisions, for changes that must not change them (not a timing).

Replays rounds of the shipped EAGLE banks as serving steps of B = 1, 4, 16 requests (each request's model
chain with its recorded confidences, its n-gram chain with its recorded features) through
:func:`calib.serve.decide_step` with the given tables, in price mode and budget mode, and writes every
decision (drafts, chain id, depth, expected accepted as float32 hex) as JSON lines; prints the count and
sha256. Run it before and after a change on the same tables and compare:

    python bench/decisions_digest.py runs/train/default /tmp/decisions.jsonl

Why argparse, not Hydra like train.py/eval.py: it takes two paths and a few flags, not a config tree from
conf/.
"""

from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING

import numpy as np

from calib.cli import parser as plain_parser

if TYPE_CHECKING:  # the functions import torch and calib's serving code themselves: --help answers without them
    from calib.serve import StepInputs

BANKS = ("data/banks/eagle-chat_code-t0", "data/banks/eagle-chat_code-t0.8")
K, ROUNDS, STEPS, STRIDE = 4, 2400, 480, 149  # rounds read per bank, steps' first rows, rows between requests


def present(v) -> bool:
    """Not NaN (the bank writes NaN where a depth was not drafted)."""
    return not np.isnan(float(v))


def step_inputs(rows, own: list[str]) -> StepInputs:
    """One serving step from bank rounds: each row a request, its model and n-gram chains as recorded."""
    import torch

    from calib.chains import Offer
    from calib.chains.ngram import step_feature_tensor
    from calib.serve import StepInputs

    ids = [f"{r.category}-{r.prompt_idx}-{r.turn}" for r in rows.itertuples()]
    model_tokens = [[int(r[f"tok{k}"]) for k in range(K) if present(r[f"tok{k}"])] for _, r in rows.iterrows()]
    conf = torch.tensor(rows[[f"conf{k}" for k in range(K)]].to_numpy(np.float32))  # [B, K]
    lengths = [int(x) if present(x) else 0 for x in rows["ng_ngram_len"]]
    ngram_tokens = [[int(r[f"ng_ngram_tok{k}"]) for k in range(min(n, K))] for n, (_, r) in zip(lengths, rows.iterrows())]
    feats = [None if n == 0 else {f: float(r[f"ng_{f}"]) for f in own} for n, (_, r) in zip(lengths, rows.iterrows())]
    ngram_x = step_feature_tensor(feats, lengths, own, K)  # [B, K, F]
    temperature = torch.tensor(rows["temperature"].to_numpy(np.float32))  # [B]
    return StepInputs(ids, temperature, offers={"model": Offer(model_tokens, conf), "ngram": Offer(ngram_tokens, ngram_x)})


def decisions(tables, bank_dir: str) -> list[list]:
    import torch

    from calib.bank import Bank
    from calib.chains import chains, split_context
    from calib.serve import decide_step
    from calib.serve.decide import feature_names
    from calib.serve.history import RequestHistory

    rounds = Bank(bank_dir).rounds(chains=chains()).to_pandas().iloc[:ROUNDS]
    own = split_context(feature_names(tables, "ngram"), "ngram")[0]
    history, out = RequestHistory(), []
    for B in (1, 4, 16):
        for s in range(0, STEPS, B):
            rows = rounds.iloc[[(s + j * STRIDE) % len(rounds) for j in range(B)]]
            inputs = step_inputs(rows, own)
            if len(set(inputs.req_ids)) < B:
                continue
            for budget in (None, 2 * B):
                cost = None if budget is not None else torch.tensor([1.0 + 0.01 * i for i in range(K * B + 1)])
                dec = decide_step(tables, inputs, history, k_max=K, budget=budget, cost=cost)
                out.append([bank_dir, B, s, budget, dec.drafts, dec.chain.tolist(), dec.depth.tolist(),
                            [float(x).hex() for x in dec.expected_accepted.float()]])
            for req, r in zip(inputs.req_ids, rows.itertuples()):
                history.observe(req, int(r.accept) if present(r.accept) else 0, K)
    return out


def main() -> None:
    ap = plain_parser(__doc__)
    ap.add_argument("tables", help="a tables folder (python train.py out_dir=...)")
    ap.add_argument("out", help="where to write the decisions (JSON lines)")
    args = ap.parse_args()
    from calib.tables import load

    tables = load(args.tables)
    text = "\n".join(json.dumps(d) for bank in BANKS for d in decisions(tables, bank))
    with open(args.out, "w", encoding="utf-8") as f:
        f.write(text)
    print(len(text.splitlines()), hashlib.sha256(text.encode()).hexdigest())


if __name__ == "__main__":
    main()
