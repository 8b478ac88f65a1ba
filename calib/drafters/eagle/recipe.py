"""The EAGLE recipe, stage by stage (``python -m calib.drafters.eagle``, config ``conf/eagle.yaml``).

Each stage writes one artifact into ``work_dir`` atomically and is skipped when it exists, so a
killed run resumes where it stopped and a user can redo one stage by deleting its file.
"""

from __future__ import annotations

import json
import random
import shutil
import time
from pathlib import Path

import torch

from calib import envs
from calib.atomic import atomic_dir, write_json_atomic, write_text_atomic
from calib.drafters.eagle import magpie
from calib.drafters.eagle.corpus import build_corpus, excluded_prompts
from calib.drafters.eagle.distill import (
    HiddenStateSequences,
    extract_hidden_states,
    generate_responses,
    hidden_state_count,
    load_hidden_states,
    read_chunked_jsonl,
)
from calib.drafters.eagle.export import export_head, load_exported
from calib.drafters.eagle.model import EagleHead, head_cost_ratio
from calib.drafters.eagle.training import EagleTrainingModule
from calib.sidefiles import read_json
from calib.target import target_dir


def _lightning_logger(cfg: dict, out: Path):
    kind = cfg["logger"]["kind"]
    if kind == "wandb":
        from lightning.pytorch.loggers import WandbLogger

        mode = cfg["logger"].get("mode") or envs.WANDB_MODE
        return WandbLogger(project=cfg["logger"].get("project", "calib"), save_dir=str(out),
                           offline=mode == "offline", job_type="eagle", name=cfg["logger"].get("name"),
                           config=cfg)
    if kind == "csv":
        from lightning.pytorch.loggers import CSVLogger

        return CSVLogger(str(out), name="eagle")
    return False


def _stage(name: str, path: Path, done: bool, timings: dict, timings_path: Path, fn, resumed: bool = False) -> Path:
    """Run ``fn`` unless ``done``; record its time (added to the earlier time if it ``resumed`` work)."""
    if done:
        print(f"[eagle] {name}: cached {path}")
        return path
    t = time.time()
    fn()
    timings[name] = round(time.time() - t + (timings.get(name, 0) if resumed else 0), 1)
    write_json_atomic(timings_path, timings)
    print(f"[eagle] {name}: {timings[name]} s -> {path}")
    return path


def run(cfg: dict) -> Path:
    root = Path(cfg["root"])
    work = root / cfg["work_dir"]
    work.mkdir(parents=True, exist_ok=True)
    timings_path = work / "timings.json"
    timings = _read_timings(timings_path)
    model_dir = str(target_dir(cfg["model"], root)[0])  # model.path= or the embedded GGUF (calib.target)
    records = _corpus(cfg, root, work, model_dir, timings, timings_path)

    responses_path = work / "responses.jsonl"
    d = cfg["distill"]
    distilled = work / ".responses.done"

    def distill():
        generate_responses(records, model_dir, responses_path, d["max_tokens"], d["temperature"], cfg["seed"],
                           d["max_num_seqs"], d["max_model_len"], d["kv_cache_gb"])
        distilled.touch()

    _stage("distill", responses_path, distilled.exists(), timings, timings_path, distill, resumed=True)

    hidden_path = work / "hidden.safetensors"
    f = cfg["features"]
    responses = read_chunked_jsonl(responses_path)
    # extract_hidden_states extends a file that holds the first answers (the corpus grew), else fails
    have = hidden_path.exists()
    _stage("hidden_states", hidden_path, have and hidden_state_count(hidden_path) == len(responses), timings,
           timings_path, lambda: extract_hidden_states(responses, model_dir, hidden_path, f["max_len"], f["threads"]),
           resumed=have)

    head_dir = work / "head"
    t = cfg["train"]
    init = Path(cfg["root"]) / t["init_from"] if t.get("init_from") else None
    _stage("train", head_dir, (head_dir / "model.safetensors").exists(), timings, timings_path,
           lambda: train(cfg, t, model_dir, hidden_path, head_dir, work, init))
    r = cfg.get("refine") or {}
    if r.get("steps", 0) > 1:  # training-time test: the trained head, fine-tuned on its own drafts
        refined = work / "head-refined"
        _stage("refine", refined, (refined / "model.safetensors").exists(), timings, timings_path,
               lambda: train(cfg, {**t, **r}, model_dir, hidden_path, refined, work, head_dir))
        head_dir = refined
    return _export(root / cfg["export_dir"], head_dir, model_dir)


def _read_timings(timings_path: Path) -> dict:
    timings = read_json(timings_path, missing_ok=True,
                        hint="it only records stage times: delete it to start the record afresh") or {}
    bad = next((k for k, v in timings.items() if isinstance(v, bool) or not isinstance(v, (int, float))), None)
    if bad is not None:
        raise ValueError(f"{timings_path}: key {bad!r} is {timings[bad]!r}, expected seconds (a number); "
                         "it only records stage times: delete it to start the record afresh")
    return timings


def _corpus(cfg: dict, root: Path, work: Path, model_dir: str, timings: dict, timings_path: Path) -> list[dict]:
    """The corpus records, written to ``work/corpus.jsonl`` when they changed.

    The corpus is rebuilt on every run (seconds, deterministic): a changed corpus config then means
    only the new prompts are distilled and only the new answers' hidden states extracted."""
    corpus_path = work / "corpus.jsonl"
    c = cfg["corpus"]
    records = build_corpus(c["n_chat"], c["n_rewrite"], c["n_code_edit"], [root / d for d in c["exclude_dirs"]],
                           seed=cfg["seed"], n_howto=c.get("n_howto", 0))
    n_magpie, n_code = c.get("n_magpie", 0), c.get("n_magpie_code", 0)
    if n_magpie or n_code:  # self-generated requests: sampled once (resumable), then filtered
        m = c.get("magpie") or {}
        raw = work / "magpie_raw.jsonl"
        have = len(read_chunked_jsonl(raw))
        _, ex_texts, ex_files = excluded_prompts([root / d for d in c["exclude_dirs"]])
        _stage("magpie", raw, have >= n_magpie + n_code, timings, timings_path,
               lambda: magpie.generate(raw, model_dir, n_magpie, n_code, cfg["seed"], m.get("temperature", 1.0),
                                       m.get("top_p", 1.0), m.get("max_tokens", 160), m.get("max_num_seqs", 128),
                                       cfg["distill"]["kv_cache_gb"], frozenset(ex_files)),
               resumed=have > 0)
        kept, dropped = magpie.select(raw, ex_texts, n_magpie, n_code)
        print(f"[eagle] magpie: kept {len(kept)} of {n_magpie + n_code} requests; dropped {dropped}")
        records += kept
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
    if not corpus_path.exists() or corpus_path.read_text(encoding="utf-8") != text:
        if corpus_path.exists():
            print(f"[eagle] corpus: the config changed; {len(records)} prompts now (answers kept by id)")
        write_text_atomic(corpus_path, text)
        (work / ".responses.done").unlink(missing_ok=True)
    return records


def _export(export: Path, head_dir: Path, model_dir: str) -> Path:
    """A complete copy first, then swap: never half a checkpoint. What the export does not write (the
    head's README) is carried over, and the folder is replaced only where calib wrote it."""
    with atomic_dir(export, carry_foreign=True) as stage:
        shutil.copytree(head_dir, stage, dirs_exist_ok=True)
    from transformers import AutoConfig

    cost = head_cost_ratio(AutoConfig.from_pretrained(model_dir))
    print(f"[eagle] exported {export} ({sum(p.stat().st_size for p in export.iterdir()) / 1e6:.1f} MB; "
          f"a draft step costs {cost:.3f} of a target forward per token)")
    return export


def train(cfg: dict, t: dict, model_dir: str, hidden_path: Path, head_dir: Path, work: Path,
          init_from: Path | None = None) -> None:
    """Train a head with the parameters ``t`` (``cfg.train``, or it updated by ``cfg.refine``) and
    write it to ``head_dir``; ``init_from`` is an exported head to start from."""
    import lightning as L
    from transformers import AutoModelForCausalLM

    if t.get("threads"):
        torch.set_num_threads(int(t["threads"]))
    L.seed_everything(cfg["seed"], verbose=False)
    target = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    head = EagleHead(target.config)
    if init_from is not None:  # warm start from an exported head (refinement, or more epochs or data)
        load_exported(head, init_from)
    data = load_hidden_states(hidden_path)  # ~0.5 GB for the default corpus: loaded once, split by sequence
    n_seq = len(data["offsets"]) - 1
    order = list(range(n_seq))
    random.Random(cfg["seed"]).shuffle(order)
    n_val = max(1, int(n_seq * t["val_fraction"]))
    train_ds = HiddenStateSequences(data, sorted(order[n_val:]), t["window"])
    val_ds = HiddenStateSequences(data, sorted(order[:n_val]), t["window"])
    fraction = float(t.get("epoch_fraction", 1.0))  # of the training windows per epoch (a random subset)
    total_steps = t["max_epochs"] * max(1, int(len(train_ds) * fraction)) // t["accumulate"]
    module = EagleTrainingModule(head, target.get_input_embeddings(), target.get_output_embeddings(), lr=t["lr"],
                                 token_weight=t["token_weight"], weight_decay=t["weight_decay"],
                                 warmup_steps=t["warmup_steps"], total_steps=total_steps, hidden_noise=t["hidden_noise"],
                                 steps=t.get("steps", 1), step_decay=t.get("step_decay", 1.0),
                                 val_steps=t.get("val_steps", 4))
    collate = lambda b: {k: v[None] for k, v in b[0].items()}

    class ExportEachEpoch(L.Callback):
        """The head is written (atomically, safetensors) at every epoch's end: a time limit loses nothing."""

        def on_train_epoch_end(self, trainer, pl_module):
            export_head(head, head_dir, extra={"calib_eagle": {"epoch": trainer.current_epoch,
                                                               "train_windows": len(train_ds)}})

    trainer = L.Trainer(max_epochs=t["max_epochs"], max_time=t["max_time"], accumulate_grad_batches=t["accumulate"],
                        logger=_lightning_logger(cfg, work), enable_checkpointing=False,
                        enable_progress_bar=t["progress"], callbacks=[ExportEachEpoch()], log_every_n_steps=20,
                        val_check_interval=0.5, gradient_clip_val=1.0, accelerator=t.get("accelerator", "auto"),
                        devices=1, limit_train_batches=fraction)
    val_loader = torch.utils.data.DataLoader(val_ds, batch_size=1, collate_fn=collate)

    def report(when: str) -> None:  # the same metrics before and after (a time limit can stop mid-epoch)
        metrics = trainer.validate(module, val_loader, verbose=False)[0]
        print(f"[eagle] {head_dir.name} {when}: " + ", ".join(
            f"{k} {v:.3f}" for k, v in sorted(metrics.items()) if "accept" in k or "top1_step" in k))

    if init_from is not None:
        report(f"before training (from {init_from.name})")
    trainer.fit(module, torch.utils.data.DataLoader(train_ds, batch_size=1, shuffle=True, collate_fn=collate),
                val_loader)
    report("after training")
    if not (head_dir / "model.safetensors").exists():  # stopped by max_time inside the first epoch
        export_head(head, head_dir)
