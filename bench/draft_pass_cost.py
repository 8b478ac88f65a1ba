"""Measure an EAGLE head's draft-pass cost in vLLM: one draft pass as a fraction of the verify pass.

    python bench/draft_pass_cost.py --drafter data/drafters/eagle-smollm2-135m --out /tmp/full.json
    python bench/draft_pass_cost.py --drafter runs/eagle/reduced/eagle-smollm2-135m-v8192 --out /tmp/v8k.json
    python bench/draft_pass_cost.py --drafter none --out /tmp/plain.json   # the target's pass over B positions

The engine runs in-process (greedy, K = 4, concurrency 4, the prompts of --prompts); the target's and
the drafter's ``forward`` and ``compute_logits`` are timed (perf_counter; CPU, so synchronous). A step's
verify pass is the target's forward + logits; its draft passes are the drafter's forward + logits, the
first (fed every verified position) apart from the later ones (a token per request). calib prices a
draft pass as a fraction of the target's pass over B positions, C(B) (calib/evaluate/README.md): with
``--drafter none`` the engine decodes plainly and ``target_pass_ms`` is the median target pass of its
steps of exactly ``--concurrency`` positions; ``draft_cost`` = later_pass_ms / that (the two runs'
JSON, :func:`draft_cost_of`). ``later_over_verify`` is the later pass over the same steps' verify pass.

Why argparse, not Hydra like train.py/eval.py: a timing of one engine with a few flags, not a config tree from
conf/.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

from calib.cli import parser as plain_parser

ROOT = Path(__file__).resolve().parents[1]


def _rows(args, kwargs) -> int:
    """Positions in a call: the first tensor argument (input ids or hidden states), or ``positions``."""
    first = next((a for a in (*args, kwargs.get("positions"), kwargs.get("hidden_states")) if hasattr(a, "shape")),
                 None)
    return int(first.shape[0]) if first is not None else -1


def install_timers(events: list) -> None:
    """Wrap the target's and the EAGLE heads' forward / compute_logits to append (kind, rows, s)."""
    from vllm.model_executor.models.llama import LlamaForCausalLM
    from vllm.model_executor.models.llama_eagle import EagleLlamaForCausalLM

    from calib.vllm.eagle_reduced_vocab import EagleLlamaReducedVocabForCausalLM

    def timed(cls, name, part):
        orig = getattr(cls, name)

        def wrapper(self, *args, **kwargs):
            t = time.perf_counter()
            out = orig(self, *args, **kwargs)
            role = "draft" if isinstance(self, EagleLlamaForCausalLM) else "target"
            events.append((f"{role}_{part}", _rows(args, kwargs), time.perf_counter() - t))
            return out

        setattr(cls, name, wrapper)

    for cls in (LlamaForCausalLM, EagleLlamaForCausalLM):
        timed(cls, "forward", "forward")
    for cls in (LlamaForCausalLM, EagleLlamaReducedVocabForCausalLM):  # EagleLlama... inherits Llama's
        timed(cls, "compute_logits", "logits")


def steps_of(events: list) -> list[dict]:
    """Group the events into engine steps (a target forward starts one); keep steps that drafted."""
    steps, cur = [], None
    for kind, rows, seconds in events:
        if kind == "target_forward":
            cur = {"verify": seconds, "verify_rows": rows, "draft": []}
            steps.append(cur)
        elif cur is not None and kind == "target_logits":
            cur["verify"] += seconds
        elif cur is not None and kind == "draft_forward":
            cur["draft"].append([seconds, rows])
        elif cur is not None and kind == "draft_logits" and cur["draft"]:
            cur["draft"][-1][0] += seconds
    return [s for s in steps if len(s["draft"]) >= 2]


def draft_cost_of(head: dict, plain: dict) -> float:
    """One draft pass over the target's pass of B positions: two records of this script, same B."""
    if head["concurrency"] != plain["concurrency"]:
        raise ValueError(f"concurrency {head['concurrency']} vs {plain['concurrency']}: measure both at the same B")
    return head["later_pass_ms"] / plain["target_pass_ms"]


def summarize_plain(events: list, rows: int) -> dict:
    """Plain decoding: the target's forward + logits per step, median over steps of ``rows`` positions."""
    steps = [s for s in steps_of_plain(events) if s[1] == rows]
    return {"steps": len(steps), "target_pass_ms": 1e3 * statistics.median(s[0] for s in steps)}


def steps_of_plain(events: list) -> list[tuple[float, int]]:
    out = []
    for kind, rows, seconds in events:
        if kind == "target_forward":
            out.append([seconds, rows])
        elif kind == "target_logits" and out:
            out[-1][0] += seconds
    return [tuple(s) for s in out]


def summarize(steps: list[dict]) -> dict:
    verify = [s["verify"] for s in steps]
    first = [s["draft"][0][0] for s in steps]
    later = [d[0] for s in steps for d in s["draft"][1:]]
    med = statistics.median
    return {"steps": len(steps), "verify_ms": 1e3 * med(verify), "first_pass_ms": 1e3 * med(first),
            "later_pass_ms": 1e3 * med(later), "later_over_verify": med(later) / med(verify),
            "first_pass_cost": med(first) / med(verify),
            "mean_verify_rows": statistics.fmean(s["verify_rows"] for s in steps)}


def main() -> None:
    ap = plain_parser(__doc__)
    ap.add_argument("--drafter", required=True)
    ap.add_argument("--prompts", default="data/prompts/code_edit.jsonl")
    ap.add_argument("--limit", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the timers must run in this process
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    from vllm import LLM, SamplingParams

    from calib.prompts import encode_chat, load_prompts
    from calib.target import prepare_target

    events: list = []
    install_timers(events)
    plain = args.drafter == "none"
    spec = None if plain else {"method": "eagle", "num_speculative_tokens": args.k,
                               "model": str((ROOT / args.drafter).resolve())}
    llm = LLM(model=str(prepare_target()), enforce_eager=True, max_model_len=2048, max_num_seqs=args.concurrency,
              seed=0, speculative_config=spec)
    prompts = load_prompts([args.prompts], root=ROOT)[: args.limit]
    tok = llm.get_tokenizer()
    inputs = [{"prompt_token_ids": encode_chat(tok, p.messages)} for p in prompts]
    events.clear()  # engine start-up and warm-up runs are not steps
    t = time.perf_counter()
    outs = llm.generate(inputs, SamplingParams(temperature=0.0, max_tokens=args.max_tokens), use_tqdm=False)
    wall = time.perf_counter() - t
    record = {"drafter": args.drafter, "prompts": args.prompts, "n_prompts": len(prompts),
              "concurrency": args.concurrency, "k": args.k, "max_tokens": args.max_tokens, "wall_s": wall,
              "output_tokens": sum(len(o.outputs[0].token_ids) for o in outs),
              **(summarize_plain(events, args.concurrency) if plain else summarize(steps_of(events)))}
    Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
