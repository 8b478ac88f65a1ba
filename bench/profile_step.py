"""Where an engine step's time goes, per serving arm and concurrency: milliseconds per part, on the clock.

    python bench/profile_step.py                                   # 4 arms x concurrency 1 4 16, code edits
    python bench/profile_step.py --arms none calib_two_drafter --concurrency 4 --sampling sampled

Each arm (bench/serve.py's arms) runs in its own process on vLLM's V1 runner with sync scheduling, the engine
calib serves on, vLLM's own arms too (on a GPU bench/serve.py leaves those on vLLM's V2 + async defaults),
with perf_counter wrappers on that runner (installed once the engine has started): the target's forward and LM
head, the verify/sampling, the drafter's first pass (it keeps the head's KV cache right and runs even when 0
tokens are drafted), its further passes and its LM head, the n-gram proposer and bookkeeping; calib's hooks
come from its serving statistics, "other" is the scheduler, output processing and the rest. One row per engine
step (batch, tokens, draft passes, the parts) goes to ``--out`` (runs/bench/profile.json); the table of
medians is printed and, with ``--docs``, written into docs/profile.md's marked block; ``--step-cost`` fits the
replay's engine step cost (calib/cost/step.py) to the rows. Run it alone on the machine.

Why argparse, not Hydra like train.py/eval.py: it orchestrates one subprocess per serving arm; its settings
are the grid's flags, not a config tree from conf/.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from calib.cli import parser as plain_parser
from calib.cli import worker_env

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("bench_serve", Path(__file__).with_name("serve.py"))
bench_serve = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_serve)

DEFAULT_ARMS = ["none", "vllm_ngram", "vllm_eagle", "calib_two_drafter"]
# the parts of a step, in the order of the table (each a wrapper below, or calib's statistics)
PARTS = ("prepare_inputs", "target_forward", "target_lm_head", "verify_sample", "drafter_first_pass",
         "drafter_more_passes", "drafter_lm_head", "ngram_propose", "calib", "bookkeeping", "other")
CALIB_PARTS = ("plan", "decide", "observe")  # calib's hooks within the "calib" part (calib_totals)
BEGIN, END = "<!-- profile:begin -->", "<!-- profile:end -->"


class StepTimer:
    """perf_counter totals per part within the engine step in progress, and the finished steps' rows."""

    def __init__(self):
        self.parts: dict[str, float] = {}
        self.info: dict = {}
        self.rows: list[dict] = []
        self.drafter_calls = 0  # drafter forwards within the propose call in progress

    def add(self, part: str, seconds: float) -> None:
        self.parts[part] = self.parts.get(part, 0.0) + seconds

    def finish(self, step_s: float, calib_ms: float) -> None:
        ms = {k: v * 1e3 for k, v in self.parts.items()}
        ms["calib"] = calib_ms
        ms["other"] = step_s * 1e3 - sum(ms.values())
        self.rows.append({**self.info, "step_ms": step_s * 1e3, "ms": ms})
        self.parts, self.info = {}, {}


TIMER = StepTimer()


def _sync() -> None:
    """Wait for the GPU's queued work, so that a part's time is its kernels' and not their launch's (a GPU runs
    asynchronously; a CPU engine has nothing to wait for). The waits add a little to the step on a GPU."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _timed(cls, name: str, part, before=None):
    """Wrap ``cls.name`` so each call adds its time to ``part`` (a name, or a function of self -> name)."""
    import functools

    original = getattr(cls, name)

    @functools.wraps(original)
    def wrapper(self, *args, **kwargs):
        if before is not None:
            before(self, *args, **kwargs)
        key = part(self) if callable(part) else part
        _sync()
        t0 = time.perf_counter()
        try:
            return original(self, *args, **kwargs)
        finally:
            if key is not None:
                _sync()
                TIMER.add(key, time.perf_counter() - t0)

    setattr(cls, name, wrapper)


def step_context(so) -> dict:
    """What a step's attention reads: ``context``, the tokens already in the KV cache of its requests (Σ_r c_r),
    and ``query_keys``, the (query, key) pairs its positions attend over (Σ_r n_r·c_r + n_r(n_r+1)/2 for the
    ``n_r`` positions of request ``r``), the step cost's ``Q`` input (calib.cost.step)."""
    computed = dict(zip(so.scheduled_cached_reqs.req_ids, so.scheduled_cached_reqs.num_computed_tokens))
    computed.update({r.req_id: r.num_computed_tokens for r in so.scheduled_new_reqs})
    n = so.num_scheduled_tokens
    return {"context": int(sum(computed.get(r, 0) for r in n)),
            "query_keys": int(sum(q * computed.get(r, 0) + q * (q + 1) // 2 for r, q in n.items()))}


def install_timers() -> None:
    """The wrappers, on vLLM's classes (outside calib's patch set: ``verify_sample`` includes calib's
    observation of the verify, a list copy; calib's decision and plan are its own statistics)."""
    from vllm.model_executor.models.llama import LlamaForCausalLM
    from vllm.model_executor.models.llama_eagle import EagleLlamaForCausalLM
    from vllm.v1.spec_decode.ngram_proposer import NgramProposer
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    def note_batch(runner, scheduler_output, *a, **k):
        so = scheduler_output
        TIMER.info = {"batch": len(so.num_scheduled_tokens), "tokens": int(so.total_num_scheduled_tokens),
                      "draft_tokens": sum(len(v) for v in so.scheduled_spec_decode_tokens.values()),
                      "drafting": sum(1 for v in so.scheduled_spec_decode_tokens.values() if v), "passes": 0,
                      **step_context(so)}

    def reset_drafter(runner, *a, **k):
        TIMER.drafter_calls = 0

    def lm_head(model):
        if isinstance(model, EagleLlamaForCausalLM):  # one per draft pass run (none when 0 are planned)
            TIMER.info["passes"] = TIMER.info.get("passes", 0) + 1
            return "drafter_lm_head"
        return "target_lm_head"

    def drafter_pass(model):
        TIMER.drafter_calls += 1
        return "drafter_first_pass" if TIMER.drafter_calls == 1 else "drafter_more_passes"

    _timed(GPUModelRunner, "execute_model", None, before=note_batch)
    _timed(GPUModelRunner, "propose_draft_token_ids", None, before=reset_drafter)
    _timed(GPUModelRunner, "_sample", "verify_sample")
    _timed(GPUModelRunner, "_bookkeeping_sync", "bookkeeping")
    _timed(GPUModelRunner, "_prepare_inputs", "prepare_inputs")
    _timed(GPUModelRunner, "_update_states", "prepare_inputs")
    _timed(LlamaForCausalLM, "forward", "target_forward")
    _timed(EagleLlamaForCausalLM, "forward", drafter_pass)
    _timed(LlamaForCausalLM, "compute_logits", lm_head)
    _timed(NgramProposer, "propose", "ngram_propose")


def profile_cell(llm, cfg: dict, prompts: list, sampling: dict, concurrency: int) -> list[dict]:
    """Serve ``prompts`` at ``concurrency`` step by step; one timed row per engine step."""
    from vllm import SamplingParams

    from calib.prompts import encode_chat
    from calib.vllm import serving

    engine, tok = llm.llm_engine, llm.get_tokenizer()
    params = SamplingParams(temperature=float(sampling["temperature"]), max_tokens=int(sampling["max_tokens"]))
    queue = [{"prompt_token_ids": encode_chat(tok, p.messages)} for p in prompts]
    TIMER.rows, inflight, n = [], 0, 0
    while queue or inflight:
        while queue and inflight < concurrency:
            engine.add_request(f"profile-{concurrency}-{n}", queue.pop(0), params)
            n, inflight = n + 1, inflight + 1
        st = serving.stats()
        before = calib_totals(st)
        TIMER.parts, t0 = {}, time.perf_counter()
        outs = engine.step()
        step_s = time.perf_counter() - t0
        calib = {k: v - before[k] for k, v in calib_totals(st).items()}
        if TIMER.info:  # a step that ran the model (not a scheduler-only call)
            TIMER.info["running"] = inflight
            TIMER.info["calib_parts"] = calib
            TIMER.finish(step_s, sum(calib.values()))
        inflight -= sum(1 for o in outs if o.finished)
    return TIMER.rows


def calib_totals(st) -> dict:
    """calib's hook time so far, ms, by hook: the plan of draft passes, the decision after drafting, the
    update after verification (history, online correction); zeros where serving is off."""
    if st is None:
        return dict.fromkeys(CALIB_PARTS, 0.0)
    return {"plan": sum(st.plan_ms), "decide": sum(st.hook_ms), "observe": sum(st.observe_ms)}


def worker(spec_path: str) -> None:
    from calib.prompts import load_prompts
    from calib.vllm.cell_stats import forget_served
    from calib.vllm.serve_runner import build_engine

    spec = json.loads(Path(spec_path).read_text())
    cfg = bench_serve.compose(spec["overrides"])
    # every arm on V1 + sync scheduling, the engine calib serves on (the fit is its step cost; the timers wrap V1's
    # runner, so a vLLM arm left on V2, vLLM's GPU default, would record no rows)
    llm = build_engine(cfg, ROOT, max_num_seqs=max(spec["concurrency"]), v1_sync=True)
    install_timers()  # after the engine: its start scans every loaded module (vLLM's Triton overrides)
    prompts = load_prompts(cfg["prompts"]["files"], root=ROOT)
    sampling = {**cfg["sampling"], "max_tokens": spec["max_tokens"]}
    category = cfg["prompts"]["name"]
    profile_cell(llm, cfg, bench_serve.warmup_prompts(category), {**sampling, "max_tokens": 8}, 2)  # off the record
    # what the engine steps on (vLLM's device_config): the step cost records it, and serving's engine line compares it
    device = str(getattr(getattr(llm.llm_engine.vllm_config, "device_config", None), "device_type", None) or "cpu")
    from calib.cost.step import accelerator_name

    accelerator = accelerator_name(device)  # the GPU's model: two GPUs of one kind step apart
    out = []
    for c in spec["concurrency"]:
        forget_served(llm)  # each cell from an empty prefix cache and suffix trees (bench/serve.py does the same)
        rows = profile_cell(llm, cfg, prompts[: max(spec["min_prompts"], 2 * c)], sampling, c)
        out.append({"arm": spec["arm"], "concurrency": c, "device": device, "accelerator": accelerator, "steps": rows})
        print(f"  {spec['arm']:<18} c={c:<3} {len(rows)} steps, median {statistics.median(r['step_ms'] for r in rows):.1f} ms",
              flush=True)
    Path(spec["out"]).write_text(json.dumps(out))


def step_device(result: dict) -> str:
    """The device the profiled engine stepped on (its cells' ``device``; "cpu" for files written before it was
    recorded); a profile whose cells ran on different devices fits no one engine's step cost."""
    devices = {str(c.get("device", "cpu")) for c in result["cells"]}
    if len(devices) != 1:
        raise SystemExit(f"the profile's cells ran on {sorted(devices)}: fit a step cost per device "
                         "(profile into a fresh --out on each machine)")
    return devices.pop()


def decode_rows(cell: dict) -> list[dict]:
    """A cell's decode steps: no prompt chunk in the step (at most K + 1 = 5 positions per request)."""
    return [r for r in cell["steps"] if r["tokens"] <= r["batch"] * 5]


def summarise(cell: dict) -> dict:
    """Medians per step over a cell's steady steps (every request in flight decoding: no prefill)."""
    rows = [r for r in decode_rows(cell) if r["running"] == cell["concurrency"]] or cell["steps"]
    med = {p: statistics.median(r["ms"].get(p, 0.0) for r in rows) for p in PARTS}
    calib = {p: statistics.fmean(r.get("calib_parts", {}).get(p, 0.0) for r in rows) for p in CALIB_PARTS}
    return {"arm": cell["arm"], "concurrency": cell["concurrency"], "steps": len(rows),
            "step_ms": statistics.median(r["step_ms"] for r in rows), "parts_ms": med, "calib_mean_ms": calib,
            "passes_mean": statistics.fmean(r.get("passes", 0) for r in rows),
            "tokens_mean": statistics.fmean(r["tokens"] for r in rows)}


def table(summaries: list[dict]) -> str:
    head = "| arm | c | step ms | " + " | ".join(p.replace("_", " ") for p in PARTS) + " | passes/step | tokens/step |"
    lines = [head, "|" + "---|" * (len(PARTS) + 5)]
    for s in summaries:
        lines.append(f"| {s['arm']} | {s['concurrency']} | {s['step_ms']:.1f} | "
                     + " | ".join(f"{s['parts_ms'][p]:.1f}" for p in PARTS)
                     + f" | {s['passes_mean']:.2f} | {s['tokens_mean']:.1f} |")
    calib = [s for s in summaries if any(s.get("calib_mean_ms", {}).values())]
    if calib:  # calib's own part, hook by hook (means: a stand-aside step costs ~0, a decided one its all)
        lines += ["", "calib's part by hook (mean ms per steady decode step):", "",
                  "| arm | c | " + " | ".join(CALIB_PARTS) + " | calib | share of step |", "|" + "---|" * 6]
        for s in calib:
            total = sum(s["calib_mean_ms"].values())
            lines.append(f"| {s['arm']} | {s['concurrency']} | "
                         + " | ".join(f"{s['calib_mean_ms'][p]:.2f}" for p in CALIB_PARTS)
                         + f" | {total:.2f} | {100 * total / s['step_ms']:.1f} % |")
    return "\n".join(lines)


def write_block(path: Path, text: str, begin: str, end: str) -> None:
    """Replace the block of ``path`` between the markers ``begin`` and ``end`` with ``text`` (written to a temp
    name, then renamed); the docs block (--docs)."""
    from calib.atomic import write_text_atomic

    doc = path.read_text()
    if begin not in doc or end not in doc:
        raise SystemExit(f"{path}: no {begin} ... {end} block to regenerate; add the two markers where the "
                         "table goes")
    head, rest = doc.split(begin, 1)
    write_text_atomic(path, head + begin + "\n" + text + "\n" + end + rest.split(end, 1)[1])


def main(argv=None) -> None:
    ap = plain_parser(__doc__)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    # the clock oracle's arms replay a reference pass of bench/serve.py (serve.oracle=PATH), which a profile has not
    ap.add_argument("--arms", nargs="+", default=DEFAULT_ARMS,
                    choices=[a for a in bench_serve.ARMS if a not in bench_serve.ORACLE_ARMS])
    ap.add_argument("--concurrency", nargs="+", type=int, default=[1, 4, 16])
    ap.add_argument("--prompts", default="code_edit", help="a conf/prompts/ name")
    ap.add_argument("--sampling", default="greedy", choices=["greedy", "sampled"])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--min-prompts", type=int, default=4, help="prompts per cell: max(this, 2 x concurrency)")
    ap.add_argument("--tables", default="runs/train/default", help="tables folder (calib arms)")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                    help="serve.py overrides for every arm, e.g. engine.dtype=float32")
    ap.add_argument("--out", default="runs/bench/profile.json")
    ap.add_argument("--docs", help="regenerate this markdown file's profile block (docs/profile.md)")
    ap.add_argument("--from-json", help="summarise an earlier --out file (runs nothing)")
    ap.add_argument("--with-json", nargs="+", default=[], metavar="FILE",
                    help="--step-cost also fits these earlier --out files' steps (a greedy profile beside a sampled one)")
    ap.add_argument("--step-cost", help="fit the replay's engine step-cost model (calib.cost.step) to every "
                    "decode step profiled and write it here (data/cost/smollm2-135m-cpu-step.json)")
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args.worker)
    if args.from_json:
        result = json.loads(Path(args.from_json).read_text())
    else:
        result = run(args, argv)
    text = table(result["summary"])
    print(text)
    if args.step_cost:
        from calib.cost.step import fit_step_cost, save_step_cost

        results = [result, *(json.loads(Path(f).read_text()) for f in args.with_json)]
        rows = [{**r, "sampled": res.get("sampling") == "sampled"}  # the sampled path's jump is fitted apart
                for res in results for c in res["cells"] for r in decode_rows(c)]
        machine = {(res.get("cpu", "unknown"), step_device(res), res.get("dtype", "auto"),
                    next((c.get("accelerator") for c in res["cells"] if c.get("accelerator")), None)) for res in results}
        if len(machine) != 1:
            raise SystemExit(f"--with-json: the profiles ran on {sorted(machine, key=str)} (cpu, device, dtype, "
                             "accelerator): fit one engine's step cost from profiles of that one engine")
        cpu, device, dtype, accelerator = machine.pop()
        save_step_cost(fit_step_cost(rows, {"command": " + ".join(r["command"] for r in results),
                                            "date": result["date"], "steps": len(rows), "cpu": cpu,
                                            "arms": sorted({c["arm"] for r in results for c in r["cells"]}),
                                            "sampling": sorted({r.get("sampling", "greedy") for r in results}),
                                            "device": device, "dtype": dtype,
                                            **({"accelerator": accelerator} if accelerator else {})}), args.step_cost)
        print(f"wrote {args.step_cost} (fitted on {len(rows)} decode steps)")
    if args.docs:
        write_block(Path(args.docs), f"Made by `{result['command']}` on {result['date']} "
                    f"({result.get('cpu', 'CPU not recorded')}, dtype {result.get('dtype', 'auto')}; "
                    f"{result['prompts']} prompts, {result['sampling']}, {result['max_tokens']} "
                    f"tokens; medians per steady decode step, ms):\n\n{text}", BEGIN, END)
        print(f"wrote {args.docs}")


def run(args, argv) -> dict:
    """Profile each arm in its own process; ``--out`` is rewritten after each arm, keeping the cells of
    arms not run now (so a run can be resumed, or an arm re-profiled, one arm at a time)."""
    if any(a.startswith("calib") for a in args.arms) and not (Path(args.tables) / "tables.json").is_file():
        sys.exit(f"--tables {args.tables}: no tables.json; make tables with `python train.py out_dir={args.tables}`")
    out = Path(args.out)
    kept = json.loads(out.read_text())["cells"] if out.is_file() else []
    kept = [c for c in kept if c["arm"] not in args.arms]
    t_start, cells = time.time(), []
    with tempfile.TemporaryDirectory(prefix="calib-profile-") as tmp:
        for i, arm in enumerate(args.arms, 1):
            elapsed = time.time() - t_start
            eta = f", ETA {elapsed / (i - 1) * (len(args.arms) - i + 1) / 60:.1f} min" if i > 1 else ""
            print(f"[{i}/{len(args.arms)}] {arm}{eta}", flush=True)
            cells += profile_arm(arm, args, Path(tmp))
            result = write_result(out, args, argv, kept + cells)
    print(f"wrote {out} ({(time.time() - t_start) / 60:.1f} min)")
    return result


def profile_arm(arm: str, args, tmp: Path) -> list[dict]:
    spec = {"arm": arm, "concurrency": args.concurrency, "max_tokens": args.max_tokens,
            "min_prompts": args.min_prompts, "out": str(tmp / f"{arm}.json"),
            "overrides": [*bench_serve.ARMS[arm], f"tables={Path(args.tables).resolve()}",
                          f"prompts={args.prompts}", f"sampling={args.sampling}", *args.set]}
    (tmp / f"{arm}.spec.json").write_text(json.dumps(spec))
    env = worker_env(ROOT)  # this tree's calib, whatever an editable install points at
    with open(tmp / f"{arm}.log", "w") as fh:
        proc = subprocess.run([sys.executable, __file__, "--worker", str(tmp / f"{arm}.spec.json")], env=env,
                              cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT, check=False)
    log = (tmp / f"{arm}.log").read_text().splitlines()
    print("\n".join(line for line in log if line.startswith("  ") and " steps, median " in line), flush=True)
    if proc.returncode:
        raise SystemExit(f"arm {arm} failed (exit {proc.returncode}):\n" + "\n".join(log[-30:]))
    return json.loads(Path(spec["out"]).read_text())


def write_result(out: Path, args, argv, cells: list[dict]) -> dict:
    from calib.cost.step import this_machine

    result = {"command": " ".join(["python bench/profile_step.py", *(argv or sys.argv[1:])]),
              "date": time.strftime("%Y-%m-%d"), "cpu": this_machine(),
              "dtype": next((o.split("=", 1)[1] for o in args.set if o.startswith("engine.dtype=")), "auto"),
              "prompts": args.prompts, "sampling": args.sampling,
              "max_tokens": args.max_tokens, "summary": [summarise(c) for c in cells], "cells": cells}
    from calib.atomic import write_text_atomic

    out.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out, json.dumps(result))
    return result


if __name__ == "__main__":
    main()
