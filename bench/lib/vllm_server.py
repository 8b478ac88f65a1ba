"""One vLLM OpenAI-compatible server on 127.0.0.1, as the bench scripts run it: its command line (speculation
as a ``--speculative-config``), its environment (calib serving switched on by ``CALIB_SERVE``, or off), its start
in a process group of its own, ``/health``, vLLM's speculative-decoding counters from ``/metrics``, and its stop
(SIGTERM, then SIGKILL to the whole group; atexit stops every server still running).

Not a script: bench/serve_http.py (and the tests, through it) import it. bench/*.py are the scripts.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
NGRAM_CONFIG = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 4}
EAGLE_DIR = ROOT / "data" / "drafters" / "eagle-smollm2-135m"
SPEC_COUNTERS = {"drafts": "vllm:spec_decode_num_drafts", "draft_tokens": "vllm:spec_decode_num_draft_tokens",
                 "accepted_tokens": "vllm:spec_decode_num_accepted_tokens"}
CALIB_ENV = ("CALIB_SERVE", "CALIB_COLLECT_DIR")  # prefixes removed from the servers' environment

_LIVE: set[subprocess.Popen] = set()  # servers started and not yet stopped (atexit stops them)
_LIVE_LOCK = threading.Lock()


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def speculative_config(speculator: str, k: int = 4, eagle_dir: str | Path = EAGLE_DIR) -> dict:
    if speculator == "ngram":
        return {**NGRAM_CONFIG, "num_speculative_tokens": int(k)}
    if speculator == "eagle":
        return {"method": "eagle", "model": str(Path(eagle_dir).resolve()), "num_speculative_tokens": int(k)}
    raise ValueError(f"speculator {speculator!r}: expected 'ngram' or 'eagle'")


def server_command(model_dir: str | Path, port: int, spec: dict | None, *, dtype: str = "float32",
                   served_name: str = "target", max_model_len: int = 2048, max_num_seqs: int = 16,
                   extra: list[str] | tuple[str, ...] = ()) -> list[str]:
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
            "--served-model-name", served_name, "--host", "127.0.0.1", "--port", str(port),
            "--dtype", dtype, "--max-model-len", str(max_model_len), "--max-num-seqs", str(max_num_seqs),
            "--enforce-eager", "--no-async-scheduling", "--seed", "0",
            *([] if spec is None else ["--speculative-config", json.dumps(spec)]), *extra]


def server_env(tables: str | Path | None, *, cost: str | None = None, extra: dict | None = None) -> dict:
    """The server's environment: inherited ``CALIB_SERVE*`` / ``CALIB_COLLECT_DIR`` removed (the off arm is
    vLLM as shipped; no capture), then ``CALIB_SERVE`` (the serving knobs as JSON: ``tables``, and ``cost``
    when given) for ``tables``, then ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(CALIB_ENV)}
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("HF_DATASETS_OFFLINE", "1")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if tables is not None:
        knobs = {"tables": str(Path(tables).resolve()), **({"cost": cost} if cost else {})}
        env["CALIB_SERVE"] = json.dumps(knobs)
    env.update(extra or {})
    return env


def start_server(cmd: list[str], env: dict, log_path: str | Path, cwd: str | Path = ROOT) -> subprocess.Popen:
    """The server in a new session (its own process group: engine core and worker included)."""
    log = open(log_path, "wb")  # noqa: SIM115 - owned by the child; closed in stop_server
    proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True)
    proc._calib_log = log  # type: ignore[attr-defined]
    with _LIVE_LOCK:
        _LIVE.add(proc)
    return proc


def stop_server(proc: subprocess.Popen, grace_s: float = 30.0) -> None:
    """SIGTERM to the server's process group, SIGKILL after ``grace_s``; never leaves a child behind."""
    try:
        pgid = os.getpgid(proc.pid)
    except ProcessLookupError:
        pgid = None
    if pgid is not None:
        try:
            os.killpg(pgid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass
    if pgid is not None:  # the group may outlive its leader (engine core, worker): kill what is left
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline:
            try:
                os.killpg(pgid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.2)
        else:
            try:
                os.killpg(pgid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    log = getattr(proc, "_calib_log", None)
    if log is not None:
        log.close()
    with _LIVE_LOCK:
        _LIVE.discard(proc)


@atexit.register
def _stop_all() -> None:
    with _LIVE_LOCK:
        live = list(_LIVE)
    for proc in live:
        stop_server(proc, grace_s=10.0)


def log_tail(path: str | Path, n: int = 60) -> str:
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-n:])
    except OSError as exc:
        return f"(no log: {exc})"


def wait_healthy(proc: subprocess.Popen, port: int, log_path: str | Path, timeout_s: float = 600.0) -> float:
    """Seconds until ``/health`` answers 200; RuntimeError with the log's tail if the server dies or times out."""
    start = time.monotonic()
    url = f"http://127.0.0.1:{port}/health"
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with code {proc.returncode} before it was healthy; log "
                               f"{log_path}, tail:\n{log_tail(log_path)}")
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                if r.status == 200:
                    return time.monotonic() - start
        except (urllib.error.URLError, OSError):
            pass
        if time.monotonic() - start > timeout_s:
            raise RuntimeError(f"the server was not healthy after {timeout_s:.0f} s; log {log_path}, tail:\n"
                               f"{log_tail(log_path)}")
        time.sleep(1.0)


def spec_metrics(port: int) -> dict[str, float]:
    """vLLM's speculative-decoding counters (summed over labels) from ``/metrics``; {} if unavailable."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            text = r.read().decode()
    except (urllib.error.URLError, OSError):
        return {}
    out = dict.fromkeys(SPEC_COUNTERS, 0.0)
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        for key, name in SPEC_COUNTERS.items():
            if line.startswith(name + "_total"):
                out[key] += float(line.rsplit(" ", 1)[1])
    return out
