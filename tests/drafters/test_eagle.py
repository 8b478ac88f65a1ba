"""EAGLE head: the training step learns on a tiny random target; the export loads in vLLM."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from calib.drafters.eagle import EagleHead, export_head
from calib.drafters.eagle.model import eagle_loss

ROOT = Path(__file__).resolve().parents[2]


def tiny_target():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(cfg).eval()


def test_training_step_reduces_loss_on_a_tiny_random_target():
    target = tiny_target()
    ids = torch.randint(0, 64, (8, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        hidden = target(ids, output_hidden_states=True).hidden_states[-1]  # post-norm states
    head = EagleHead(target.config)
    opt = torch.optim.AdamW(head.parameters(), lr=3e-3)
    embed, lm_head = target.get_input_embeddings(), target.get_output_embeddings()
    frozen = lm_head.weight.detach().clone()
    _, first = eagle_loss(head, embed, lm_head, ids, hidden)
    for _ in range(60):
        opt.zero_grad()
        loss, parts = eagle_loss(head, embed, lm_head, ids, hidden)
        loss.backward()
        opt.step()
    # The feature regression is learnable down to a fraction; the soft-label cross-entropy is
    # bounded below by the target distribution's entropy, so it only has to fall.
    assert parts["feature"] < 0.5 * first["feature"]
    assert parts["token"] < first["token"]
    assert torch.equal(lm_head.weight, frozen)  # only the head is trained


def test_lightning_module_fits(tmp_path):
    import lightning as L

    from calib.drafters.eagle.training import EagleTrainingModule

    target = tiny_target()
    ids = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        hidden = target(ids, output_hidden_states=True).hidden_states[-1]
    module = EagleTrainingModule(EagleHead(target.config), target.get_input_embeddings(),
                                 target.get_output_embeddings(), lr=3e-3)
    from torch.utils.data import DataLoader

    batches = DataLoader([{"input_ids": ids, "hidden": hidden}], batch_size=None)
    trainer = L.Trainer(max_epochs=3, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, accelerator="cpu", default_root_dir=str(tmp_path))
    trainer.fit(module, batches, batches)
    assert trainer.current_epoch == 3 and "val_loss" in trainer.callback_metrics


def test_export_layout(tmp_path):
    head = EagleHead(tiny_target().config)
    out = export_head(head, tmp_path / "head")
    from safetensors.torch import load_file

    names = set(load_file(out / "model.safetensors"))
    assert "fc.weight" in names and "layers.0.self_attn.q_proj.weight" in names
    assert not any("input_layernorm" in n or "embed" in n or "lm_head" in n for n in names)
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == 1


@pytest.mark.engine
def test_exported_head_loads_and_runs_in_vllm(tmp_path):
    pytest.importorskip("vllm")
    from calib.collect.target import prepare_target

    cfg = LlamaConfig.from_pretrained(prepare_target())
    torch.manual_seed(0)
    export_head(EagleHead(cfg), tmp_path / "head")  # untrained: checks the load path, not acceptance
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_LOGGING_LEVEL": "WARNING"}
    proc = subprocess.run([sys.executable, "collect.py", f"out_dir={tmp_path / 'run'}", "prompts=smoke",
                           "speculative=eagle", f"speculative.model={tmp_path / 'head'}", "sampling.max_tokens=16",
                           "progress=false"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert (tmp_path / "run" / "bank" / "acceptance.parquet").exists()
