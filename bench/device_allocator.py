"""Device check for a lent GPU machine: time the Triton allocator and the V2 acceptance estimator.

    python bench/device_allocator.py                                   # CUDA, B=256, K=16, 200 calls
    python bench/device_allocator.py --device cpu --batch 8 --k 4 --iters 3   # smoke test here

Runs from a copy of the repository root without installing calib (the root is put on sys.path), and
needs only torch, triton, numpy and safetensors: no vLLM, no pyarrow, no network. Inputs and tables
are SYNTHETIC (random grids and confidences; no fitted data): the timings and the reference check do
not depend on what the tables hold.

1. ``calib.allocate.allocate(tables, {"model", "ngram"}, impl="triton")`` on two chains at
   ``--batch`` x ``--k`` (table lookup, survival, selection, chain choice in one kernel), price mode
   (a verify-cost curve) and budget mode (a device tensor budget). Timed per call with CUDA events
   after warm-up (median of ``--iters`` calls, host launch included), and, on CUDA, as replays of
   a CUDA graph of the call (the kernel alone: how it runs inside a captured step). Target: the
   graph-replay median <= ``--target-us`` (15 us). Decisions (drafter, depth) are compared with
   ``impl="reference"`` on the same float32 inputs for ``--checks`` input sets; any mismatch exits 1.
2. ``CalibAcceptanceEstimator.predict`` (calib/serve/v2_estimator.py) at ``--max-num-reqs`` rows,
   K = ``--k``, vocabulary ``--vocab``: max q of the logits, context gather, calib's Triton lookup;
   timed the same way; its writes are compared with ``impl="reference"`` (exit 1 on mismatch).

It prints torch / triton versions first. A kernel that does not compile (e.g. another triton than
pyproject's 3.7.1) is reported as such (exit 3) with the error, not as a bare traceback. Output: one
JSON line (``{"bench": "device_allocator", ...}``), then a human summary.

Why argparse, not Hydra like train.py/eval.py: it must run from a bare copy of the repository on a lent
machine with only torch, triton, numpy and safetensors (no Hydra needed).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def parse_args(argv=None):
    if str(ROOT) not in sys.path:  # calib is not installed here: the root is put on sys.path
        sys.path.insert(0, str(ROOT))
    from calib.cli import parser as plain_parser

    p = plain_parser(__doc__)
    p.add_argument("--device", default=None, help="cuda (default when available) or cpu (Triton interpreter)")
    p.add_argument("--batch", type=int, default=256, help="B, requests in the batch (allocator)")
    p.add_argument("--k", type=int, default=16, help="K, draft depth of each chain")
    p.add_argument("--max-num-reqs", type=int, default=None, help="estimator rows (default: --batch)")
    p.add_argument("--vocab", type=int, default=32000, help="drafter vocabulary for the estimator's logits")
    p.add_argument("--iters", type=int, default=200, help="timed calls (median reported)")
    p.add_argument("--warmup", type=int, default=20, help="untimed calls first")
    p.add_argument("--checks", type=int, default=5, help="random input sets compared with impl='reference'")
    p.add_argument("--target-us", type=float, default=15.0, help="target for the allocator kernel (us)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    device = args.device
    if device is None or device == "cpu":
        # Before triton is first imported (torch alone does not import it).
        import torch

        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if device == "cpu":
            os.environ["TRITON_INTERPRET"] = "1"
    import torch

    try:
        import triton

        triton_version = triton.__version__
    except Exception as exc:  # noqa: BLE001
        triton_version = f"unavailable ({exc!r})"
    result = {"bench": "device_allocator", "device": device, "torch": torch.__version__, "triton": triton_version,
              "python": platform.python_version(), "cuda": torch.version.cuda,
              "gpu": torch.cuda.get_device_name(0) if device == "cuda" else None,
              "batch": args.batch, "k": args.k, "iters": args.iters, "synthetic": True}
    print(f"torch {torch.__version__} (cuda {torch.version.cuda}), triton {triton_version}, "
          f"device {device}{' ' + result['gpu'] if result['gpu'] else ''}", flush=True)
    if device == "cuda" and not torch.cuda.is_available():
        result["error"] = "--device cuda but torch sees no CUDA device"
        return finish(result, 2)

    sys.path.insert(0, str(ROOT))
    torch.manual_seed(args.seed)
    status = 0
    try:
        status |= bench_allocator(args, device, result)
    except Exception as exc:  # noqa: BLE001
        result["allocator_error"] = describe(exc)
        status |= 3
    try:
        status |= bench_estimator(args, device, result)
    except Exception as exc:  # noqa: BLE001
        result["estimator_error"] = describe(exc)
        status |= 3
    return finish(result, status)


def describe(exc: BaseException) -> str:
    """One paragraph: the error, and what it most likely means."""
    text = "".join(traceback.format_exception_only(type(exc), exc)).strip()
    name = type(exc).__name__
    hint = ""
    if "CompilationError" in name or "compil" in text.lower() or "triton" in type(exc).__module__:
        hint = (" -- the Triton kernel did not compile with this triton; calib pins triton==3.7.1 "
                "(pyproject.toml). Install that version (pip install triton==3.7.1) or report the message.")
    print(f"ERROR {text[-2000:]}{hint}", file=sys.stderr, flush=True)
    traceback.print_exc(file=sys.stderr)
    return f"{text[-2000:]}{hint}"


# --- inputs (SYNTHETIC) ------------------------------------------------------------------------------

def synthetic_tables(k: int, device):
    """SYNTHETIC tables: model = conf (17 points) x temperature (2) x prev_accept (3); n-gram =
    match_n (3) x temperature (2); K depths each, random grids non-decreasing in conf."""
    import torch

    from calib.chains import Axis
    from calib.tables.layout import ChainTable, GridTables

    g = torch.Generator().manual_seed(1234)
    pts = 17
    m_axes = (Axis("conf", points=pts), Axis("temperature", edges=(0.4,)), Axis("prev_accept", edges=(0.0, 2.0)))
    m_grid = torch.rand(k, 6, pts, generator=g).sort(dim=2).values.reshape(k, 6 * pts)
    model = ChainTable.build(m_axes, m_grid, torch.tensor([[0.4, math.inf], [0.0, 2.0]]), torch.tensor([3 * pts, pts]))
    n_axes = (Axis("match_n", edges=(1.5, 2.5)), Axis("temperature", edges=(0.4,)))
    ngram = ChainTable.build(n_axes, torch.rand(k, 6, generator=g), torch.tensor([[1.5, 2.5], [0.4, math.inf]]),
                             torch.tensor([2, 1]))
    return GridTables({"model": model, "ngram": ngram}).to(device)


def allocator_inputs(b: int, k: int, seed: int, device):
    """Two chains' table inputs [B, K, A] (float32), a verify-cost curve and a budget (SYNTHETIC)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    temp = torch.where(torch.rand(b, generator=g) < 0.5, 0.0, 0.8)
    prev = torch.randint(-1, k + 1, (b,), generator=g).float()
    prev[prev < 0] = float("nan")  # first round
    conf = torch.rand(b, k, generator=g) ** 0.3
    model_len = torch.randint(0, k + 1, (b,), generator=g)
    conf[torch.arange(k)[None, :] >= model_len[:, None]] = float("nan")
    model = torch.stack([conf, temp[:, None].expand(b, k), prev[:, None].expand(b, k)], dim=2)
    match_n = torch.randint(1, 4, (b,), generator=g).float()
    ngram_len = torch.randint(0, k + 1, (b,), generator=g)
    feat = match_n[:, None].expand(b, k).clone()
    feat[torch.arange(k)[None, :] >= ngram_len[:, None]] = float("nan")
    ngram = torch.stack([feat, temp[:, None].expand(b, k)], dim=2)
    total = torch.arange(2 * b * (k + 1) + 2, dtype=torch.float64)
    cost = 1.0 + torch.clamp(total - 256, min=0) / 256  # flat to 256 positions, then linear
    budget = torch.tensor([max(b * k // 4, 1)], dtype=torch.int64)
    return ({"model": model.to(device), "ngram": ngram.to(device)}, cost.to(device), budget.to(device))


# --- timing ------------------------------------------------------------------------------------------

def time_calls(fn, device: str, iters: int, warmup: int) -> dict:
    """Median / p10 / p90 microseconds per call (CUDA events around each call on CUDA)."""
    import torch

    for _ in range(warmup):
        fn()
    times = []
    if device == "cuda":
        torch.cuda.synchronize()
        pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
        for start, end in pairs:
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize()
        times = [s.elapsed_time(e) * 1e3 for s, e in pairs]
    else:
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e6)
    return summary(times)


def time_graph(fn, iters: int, warmup: int) -> dict:
    """The same call captured once in a CUDA graph, then replays timed with CUDA events."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(warmup):
        graph.replay()
    torch.cuda.synchronize()
    pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for start, end in pairs:
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    return summary([s.elapsed_time(e) * 1e3 for s, e in pairs])


def summary(us: list[float]) -> dict:
    us = sorted(us)
    q = statistics.quantiles(us, n=10) if len(us) >= 2 else [us[0]] * 9
    return {"median_us": round(statistics.median(us), 2), "p10_us": round(q[0], 2), "p90_us": round(q[-1], 2),
            "n": len(us)}


# --- 1. the allocator --------------------------------------------------------------------------------

def bench_allocator(args, device: str, result: dict) -> int:
    import torch

    from calib.allocate import allocate

    tables = synthetic_tables(args.k, device)
    status = 0
    mismatches = []
    for check in range(args.checks):
        signals, cost, budget = allocator_inputs(args.batch, args.k, args.seed + check, device)
        for mode, kw in (("price", {"cost": cost}), ("budget", {"budget": budget})):
            got = allocate(tables, signals, impl="triton", **kw)  # the first call compiles the kernel
            want = allocate(tables, signals, impl="reference", **kw)
            same = (torch.equal(got.drafter.cpu(), want.drafter.cpu()) and torch.equal(got.depth.cpu(), want.depth.cpu()))
            close = torch.allclose(got.expected_accepted.cpu(), want.expected_accepted.cpu(), rtol=0, atol=1e-6)
            if not (same and close):
                rows = (got.depth.cpu() != want.depth.cpu()) | (got.drafter.cpu() != want.drafter.cpu())
                mismatches.append({"check": check, "mode": mode, "rows_differing": int(rows.sum()),
                                   "expected_accepted_max_diff": float((got.expected_accepted.cpu()
                                                                        - want.expected_accepted.cpu()).abs().max())})
    result["allocator_matches_reference"] = not mismatches
    result["allocator_checks"] = args.checks * 2
    if mismatches:
        result["allocator_mismatches"] = mismatches
        status |= 1

    signals, cost, budget = allocator_inputs(args.batch, args.k, args.seed, device)
    for mode, kw in (("price", {"cost": cost}), ("budget", {"budget": budget})):
        def call(kw=kw):
            return allocate(tables, signals, impl="triton", **kw)
        result[f"allocator_{mode}_call"] = time_calls(call, device, args.iters, args.warmup)
        if device == "cuda":
            try:
                result[f"allocator_{mode}_graph"] = time_graph(call, args.iters, args.warmup)
            except Exception as exc:  # noqa: BLE001
                result[f"allocator_{mode}_graph_error"] = describe(exc)
    if device == "cuda" and "allocator_price_graph" in result:
        kernel = result["allocator_price_graph"]["median_us"]
        result["allocator_target_us"] = args.target_us
        result["allocator_meets_target"] = kernel <= args.target_us
    return status


# --- 2. the V2 estimator -----------------------------------------------------------------------------

def load_estimator_module():
    """calib/serve/v2_estimator.py by path: calib.serve's package __init__ imports the V1 serving
    code (pyarrow, ...), which the GPU machine may lack; the estimator itself does not need it."""
    path = ROOT / "calib" / "serve" / "v2_estimator.py"
    spec = importlib.util.spec_from_file_location("calib_v2_estimator", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def bench_estimator(args, device: str, result: dict) -> int:
    import torch

    mod = load_estimator_module()
    tables = synthetic_tables(args.k, device)
    n = args.max_num_reqs or args.batch
    k = args.k
    est = mod.CalibAcceptanceEstimator(tables, n, k, device, impl="triton")
    ref = mod.CalibAcceptanceEstimator(tables, n, k, device, impl="reference")
    g = torch.Generator().manual_seed(args.seed + 99)
    # SYNTHETIC history: a few verdicts so prev_accept varies across slots.
    for _ in range(3):
        slots = torch.randperm(n, generator=g)[: max(n // 2, 1)]
        sampled = torch.randint(1, k + 2, (slots.numel(),), generator=g).to(torch.int32)
        rejected = torch.randint(0, 2, (slots.numel(),), generator=g).to(torch.int32)
        for e in (est, ref):
            e.step(slots.to(device), sampled.to(device), rejected.to(device))
    temps = torch.where(torch.rand(n, generator=g) < 0.5, 0.0, 0.8).to(device)  # [max_num_reqs]
    logits = (4 * torch.randn(n, args.vocab, generator=g)).to(device)  # [num_reqs, V]
    idx = torch.randperm(n, generator=g).to(device)  # [num_reqs] batch -> req_state_idx
    idx[-1] = -1  # one cudagraph-padded row
    step = torch.tensor(min(3, k - 1), device=device)  # 0-d: one draft step
    out, out_ref = (torch.full((n, k), -1.0, device=device) for _ in range(2))
    est.predict(logits, idx, step, out, temps)  # compiles
    ref.predict(logits, idx, step, out_ref, temps)
    same = torch.equal(out.cpu(), out_ref.cpu())
    result["estimator_matches_reference"] = bool(same)
    status = 0 if same else 1
    if not same:
        result["estimator_max_diff"] = float((out - out_ref).abs().max())

    def call():
        est.predict(logits, idx, step, out, temps)

    result["estimator_predict_call"] = time_calls(call, device, args.iters, args.warmup)
    result["estimator_rows"], result["estimator_vocab"] = n, args.vocab
    if device == "cuda":
        try:
            result["estimator_predict_graph"] = time_graph(call, args.iters, args.warmup)
        except Exception as exc:  # noqa: BLE001
            result["estimator_predict_graph_error"] = describe(exc)
    sampled = torch.randint(1, k + 2, (n,), generator=g).to(torch.int32).to(device)
    rejected = torch.zeros(n, dtype=torch.int32, device=device)

    def step_call():
        est.step(idx, sampled, rejected)

    result["estimator_step_call"] = time_calls(step_call, device, args.iters, args.warmup)
    return status


def finish(result: dict, status: int) -> int:
    result["exit_code"] = status
    print(json.dumps(result, sort_keys=True), flush=True)
    lines = [(f"device_allocator on {result['device']} ({result.get('gpu') or 'no GPU'}), torch {result['torch']}, "
              f"triton {result['triton']}; B={result['batch']}, K={result['k']}, SYNTHETIC tables")]
    for key in ("allocator_price_call", "allocator_price_graph", "allocator_budget_call", "allocator_budget_graph",
                "estimator_predict_call", "estimator_predict_graph", "estimator_step_call"):
        if key in result:
            r = result[key]
            lines.append(f"  {key:<26} median {r['median_us']:>10.2f} us  (p10 {r['p10_us']:.2f}, p90 {r['p90_us']:.2f},"
                         f" n={r['n']})")
    if "allocator_meets_target" in result:
        lines.append(f"  allocator kernel (graph replay, price mode) {'meets' if result['allocator_meets_target'] else 'MISSES'}"
                     f" the {result['allocator_target_us']} us target")
    for key in ("allocator_matches_reference", "estimator_matches_reference"):
        if key in result:
            lines.append(f"  {key}: {result[key]}")
    for key in [k for k in result if k.endswith("error")]:
        lines.append(f"  {key}: {result[key]}")
    lines.append(f"  exit code {status} (0 ok, 1 mismatch with the reference, 2 no device, 3 a kernel failed)")
    print("\n".join(lines), flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
