"""An EAGLE head that drafts over a reduced vocabulary: ``python -m calib.drafters.eagle.reduced_vocab``.

The draft vocabulary is the ``draft_vocab_size`` most frequent tokens of the recipe's corpus (its
``responses.jsonl``: prompt and answer tokens), plus the target's special tokens. The head starts from
an exported full-vocabulary head (``reduced.init_from``), its own lm_head from the target's rows of those
tokens; it is trained briefly on the recipe's hidden states and written in the layout of
calib/vllm/eagle_reduced_vocab.py (``lm_head.weight``, ``d2t``; config conf/eagle_reduced.yaml).
"""

from __future__ import annotations

import random
from pathlib import Path

if __name__ != "__main__":  # as the command, Hydra answers --help first; main() then imports this module whole
    import torch
    from torch import nn

    from calib.cost.draft import DRAFT_COST_KEY, check_draft_cost
    from calib.drafters.eagle.distill import HiddenStateSequences, load_hidden_states, read_chunked_jsonl
    from calib.drafters.eagle.export import export_head, load_exported
    from calib.drafters.eagle.model import EagleHead
    from calib.vllm.plugin import D2T_KEY, REDUCED_VOCAB_EAGLE

FLOPS_COST_KEY = "calib_draft_cost_flops"  # the matmul-FLOP ratio, beside the measured DRAFT_COST_KEY


def token_counts(responses: list[dict], vocab_size: int, answers_only: bool = False) -> torch.Tensor:
    """How often each target id occurs in the corpus sequences [vocab_size] (int64)."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for r in responses:
        ids = r["output_ids"] if answers_only else r["prompt_ids"] + r["output_ids"]
        if ids:
            counts += torch.bincount(torch.tensor(ids, dtype=torch.long), minlength=vocab_size)[:vocab_size]
    return counts


def choose_draft_vocab(counts: torch.Tensor, size: int, keep: list[int] = ()) -> torch.Tensor:
    """The target ids of the draft vocabulary [size], ascending: ``keep`` first, then the most frequent
    (ties by the lower id). Ascending ids make every ``d2t`` offset >= 0."""
    vocab = counts.numel()
    if not 0 < size <= vocab:
        raise ValueError(f"reduced.draft_vocab_size {size} must be in (0, {vocab}] (the target's vocabulary)")
    keep = sorted({int(k) for k in keep if 0 <= int(k) < vocab})
    score = counts.double().clone()
    score[keep] = float("inf")
    order = torch.argsort(-score, stable=True)  # stable: equal counts keep the lower id first
    return torch.sort(order[:size]).values


def coverage(counts: torch.Tensor, draft_ids: torch.Tensor) -> float:
    """The fraction of the counted tokens that lie in the draft vocabulary."""
    total = int(counts.sum())
    return int(counts[draft_ids].sum()) / total if total else float("nan")


def d2t_offsets(draft_ids: torch.Tensor) -> torch.Tensor:
    """EAGLE-3's map [Vd] int64: target id = draft id + d2t[draft id]."""
    return draft_ids.long() - torch.arange(draft_ids.numel(), dtype=torch.long)


def reduced_cost_ratio(config, draft_vocab_size: int) -> float:
    """Matmul FLOPs of one reduced head step over one target forward, per token (as
    :func:`calib.drafters.eagle.model.head_cost_ratio`, with ``draft_vocab_size`` lm_head rows)."""
    h, inter = config.hidden_size, config.intermediate_size
    head_dim = getattr(config, "head_dim", None) or h // config.num_attention_heads
    kv = config.num_key_value_heads * head_dim
    layer = h * (config.num_attention_heads * head_dim) * 2 + h * kv * 2 + 3 * h * inter
    return (2 * h * h + layer + h * draft_vocab_size) / (config.num_hidden_layers * layer + h * config.vocab_size)


def draft_lm_head_from_target(target_lm_head: nn.Module, draft_ids: torch.Tensor) -> nn.Linear:
    """A trainable lm_head of the target's rows ``draft_ids`` (the tied embedding rows) [Vd, H]."""
    weight = target_lm_head.weight.detach()[draft_ids].clone()
    head = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    head.weight.data.copy_(weight)
    return head


def export_reduced(head: EagleHead, draft_lm_head: nn.Linear, draft_ids: torch.Tensor, out_dir, draft_cost: float,
                   extra: dict | None = None) -> Path:
    """Write the head as vLLM loads it for architecture ``EagleLlamaReducedVocabForCausalLM``."""
    vocab = int(draft_ids.numel())
    # not tied: the lm_head is the head's own (fewer rows than the shared embeddings)
    config = {"architectures": [REDUCED_VOCAB_EAGLE], "draft_vocab_size": vocab, "tie_word_embeddings": False,
              DRAFT_COST_KEY: check_draft_cost(draft_cost, "reduced.draft_cost"),
              FLOPS_COST_KEY: round(reduced_cost_ratio(head.config, vocab), 3), **(extra or {})}
    tensors = {"lm_head.weight": draft_lm_head.weight.detach().to(torch.bfloat16), D2T_KEY: d2t_offsets(draft_ids)}
    return export_head(head, out_dir, extra=config, extra_tensors=tensors)


def load_reduced(head: EagleHead, path) -> tuple[nn.Linear, torch.Tensor]:
    """Load :func:`export_reduced`'s folder into ``head``; its lm_head and draft ids [Vd]."""
    import tempfile

    from safetensors.torch import load_file, save_file

    tensors = load_file(str(Path(path) / "model.safetensors"))
    weight, d2t = tensors.pop("lm_head.weight").float(), tensors.pop(D2T_KEY)
    with tempfile.TemporaryDirectory() as tmp:  # load_exported reads the full-vocabulary layout
        save_file(tensors, str(Path(tmp) / "model.safetensors"))
        load_exported(head, tmp)
    lm_head = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    lm_head.weight.data.copy_(weight)
    return lm_head, d2t + torch.arange(d2t.numel())


def train_reduced(cfg: dict, head: EagleHead, draft_lm_head: nn.Linear, draft_ids: torch.Tensor, target,
                  hidden_path: Path, log_dir: Path) -> dict:
    """Train ``head`` and ``draft_lm_head`` in place with ``cfg['train']`` (the recipe's split and
    metrics, conf/eagle.yaml); the validation metrics before and after."""
    import lightning as L

    from calib.drafters.eagle.training import EagleTrainingModule

    t = cfg["train"]
    L.seed_everything(cfg["seed"], verbose=False)
    data = load_hidden_states(hidden_path)
    order = list(range(len(data["offsets"]) - 1))
    random.Random(cfg["seed"]).shuffle(order)  # the recipe's split (calib.drafters.eagle.recipe.train)
    n_val = max(1, int(len(order) * t["val_fraction"]))
    train_ds = HiddenStateSequences(data, sorted(order[n_val:]), t["window"])
    val_ds = HiddenStateSequences(data, sorted(order[:n_val]), t["window"])
    total_steps = t["max_epochs"] * max(1, int(len(train_ds) * t["epoch_fraction"])) // t["accumulate"]
    module = EagleTrainingModule(head, target.get_input_embeddings(), target.get_output_embeddings(), lr=t["lr"],
                                 token_weight=t["token_weight"], weight_decay=t["weight_decay"],
                                 warmup_steps=t["warmup_steps"], total_steps=total_steps,
                                 steps=t["steps"], step_decay=t["step_decay"], val_steps=t["val_steps"],
                                 draft_lm_head=draft_lm_head, draft_ids=draft_ids)
    collate = lambda b: {k: v[None] for k, v in b[0].items()}  # windows are batches of one
    loader = lambda ds, shuffle: torch.utils.data.DataLoader(ds, batch_size=1, shuffle=shuffle,
                                                             collate_fn=collate)
    trainer = L.Trainer(max_epochs=t["max_epochs"], max_time=t["max_time"], accumulate_grad_batches=t["accumulate"],
                        logger=False, enable_checkpointing=False, enable_progress_bar=t["progress"],
                        gradient_clip_val=1.0, accelerator="cpu", devices=1, limit_train_batches=t["epoch_fraction"],
                        default_root_dir=str(log_dir), num_sanity_val_steps=0, enable_model_summary=False)
    keys = ("val_accept_per_round", "val_top1_step0", "val_top1_step1", "val_loss")
    before = trainer.validate(module, loader(val_ds, False), verbose=False)[0]
    trainer.fit(module, loader(train_ds, True))
    after = trainer.validate(module, loader(val_ds, False), verbose=False)[0]
    return {"val_sequences": n_val, "train_windows": len(train_ds), "optimizer_steps": trainer.global_step,
            "before": {k: round(float(before[k]), 4) for k in keys if k in before},
            "after": {k: round(float(after[k]), 4) for k in keys if k in after}}


def corpus_records(work_dir: Path, count_prompts: list[Path], model_dir: str) -> list[dict]:
    """What the vocabulary is counted over: the recipe's answers (``work_dir/responses.jsonl``, prompt
    and answer ids), then the prompts of ``count_prompts`` (corpus JSONL files: id, messages) not
    answered there, as records with ``prompt_ids`` only."""
    from transformers import AutoTokenizer

    from calib.prompts import encode_chat

    responses_path = work_dir / "responses.jsonl"
    if not responses_path.is_file():
        raise FileNotFoundError(f"{responses_path}: no corpus answers; run the recipe's stages first "
                                f"(python -m calib.drafters.eagle work_dir={work_dir} ...)")
    records = read_chunked_jsonl(responses_path)
    have, tok = {r["id"] for r in records}, AutoTokenizer.from_pretrained(model_dir)
    for path in count_prompts:
        if not path.is_file():
            raise FileNotFoundError(f"reduced.count_prompts: {path} does not exist (a corpus.jsonl of the recipe)")
        for rec in read_chunked_jsonl(path):
            if rec["id"] not in have:
                have.add(rec["id"])
                records.append({"id": rec["id"], "prompt_ids": encode_chat(tok, rec["messages"]), "output_ids": []})
    return records


def special_ids(model_dir: str) -> list[int]:
    """The tokenizer's special tokens: always in the draft vocabulary (end of turn, padding)."""
    from transformers import AutoTokenizer

    return sorted(AutoTokenizer.from_pretrained(model_dir).all_special_ids)


def _choose(cfg: dict, model_dir: str, vocab: int) -> tuple[torch.Tensor, dict]:
    """The draft ids from the corpus of ``work_dir`` (and ``reduced.count_prompts``); what they cover."""
    root, r = Path(cfg["root"]), cfg["reduced"]
    count_prompts = list(r.get("count_prompts") or [])
    records = corpus_records(root / cfg["work_dir"], [root / p for p in count_prompts], model_dir)
    counts = token_counts(records, vocab)
    ids = choose_draft_vocab(counts, int(r["draft_vocab_size"]), special_ids(model_dir) + list(r["keep_ids"]))
    stats = {"corpus": f"{cfg['work_dir']}/responses.jsonl", "count_prompts": count_prompts,
             "sequences": len(records), "tokens": int(counts.sum()), "coverage": round(coverage(counts, ids), 4),
             "answer_coverage": round(coverage(token_counts(records, vocab, answers_only=True), ids), 4)}
    return ids, stats


def _head(cfg: dict, target, ids: torch.Tensor, stats: dict) -> tuple[EagleHead, nn.Linear]:
    """The head warm-started from ``reduced.init_from`` (its lm_head the target's rows ``ids``), then
    trained with ``train:`` updated by ``reduced.train`` unless that says ``max_epochs: 0``. A trained
    head is cached in ``work_dir/reduced-head-v<size>`` (delete it to train again)."""
    root, r = Path(cfg["root"]), cfg["reduced"]
    t = {**cfg["train"], **(r.get("train") or {})}
    head = EagleHead(target.config)
    trained = root / cfg["work_dir"] / f"reduced-head-v{ids.numel()}"
    if t["max_epochs"] > 0 and (trained / "model.safetensors").is_file():
        draft_lm_head, cached_ids = load_reduced(head, trained)
        if not torch.equal(cached_ids, ids):
            raise ValueError(f"{trained}: its draft vocabulary is not the one chosen now; delete it to retrain")
        from calib.sidefiles import read_json

        stats["training"] = read_json(trained / "config.json")["calib_eagle_reduced"].get("training")
        return head, draft_lm_head
    load_exported(head, root / r["init_from"])
    draft_lm_head = draft_lm_head_from_target(target.get_output_embeddings(), ids)
    stats["training"] = None  # warm start only: the init head's layers, the target's lm_head rows
    if t["max_epochs"] > 0:
        stats["training"] = {"init_from": r["init_from"],
                             **train_reduced({**cfg, "train": t}, head, draft_lm_head, ids, target,
                                             root / cfg["work_dir"] / "hidden.safetensors", trained.parent)}
        print(f"[reduced] training: {stats['training']}")
        flops = round(reduced_cost_ratio(target.config, ids.numel()), 3)
        export_reduced(head, draft_lm_head, ids, trained, flops, extra={"calib_eagle_reduced": stats})
    return head, draft_lm_head


def run(cfg: dict) -> Path:
    """Choose the vocabulary, warm-start, train (or not), export to ``reduced.out_dir``."""
    from transformers import AutoModelForCausalLM

    from calib.target import target_dir

    root, r = Path(cfg["root"]), cfg["reduced"]
    model_dir = str(target_dir(cfg["model"], root)[0])  # model.path= or the embedded GGUF (calib.target)
    target = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids, stats = _choose(cfg, model_dir, target.config.vocab_size)
    print(f"[reduced] {ids.numel()} draft ids cover {stats['coverage']:.4f} of the corpus tokens "
          f"({stats['answer_coverage']:.4f} of the answer tokens)")
    stats["init_from"] = r["init_from"]
    head, draft_lm_head = _head(cfg, target, ids, stats)
    flops = round(reduced_cost_ratio(target.config, ids.numel()), 3)
    cost = flops if r.get("draft_cost") is None else r["draft_cost"]
    out = export_reduced(head, draft_lm_head, ids, root / r["out_dir"], cost, extra={"calib_eagle_reduced": stats})
    print(f"[reduced] exported {out}: draft cost {cost} ({FLOPS_COST_KEY} {flops})")
    return out


def main() -> None:
    import hydra
    from omegaconf import OmegaConf

    @hydra.main(config_path="../../../conf", config_name="eagle_reduced", version_base="1.3")
    def _main(cfg) -> None:
        from calib.drafters.eagle.reduced_vocab import run  # the module with torch (not this light __main__)

        run(OmegaConf.to_container(cfg, resolve=True))

    _main()


if __name__ == "__main__":
    main()
