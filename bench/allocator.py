"""Time the allocator: torch reference on CPU next to a naive flatten-and-topk baseline, and on a
CUDA device the fused Triton kernel next to the torch reference.

    python bench/allocator.py               # CPU table (and the GPU table when CUDA is present)
    python bench/allocator.py --threads 2   # torch intra-op threads for the CPU part (default 1)
    TRITON_INTERPRET=1 python bench/allocator.py --shape   # shape-aware price kernel vs today's price kernel
                                                           # (CPU: Triton's interpreter; GPU: do_bench)

The baseline only computes survival products and takes the global top-N (with two drafters, over
both chains at once, which ignores the one-chain-per-request rule): it is the speed floor of any
budget allocator, not a correct two-drafter one. Inputs are synthetic: confidences ~ U(0,1)^0.3, an
n-gram chain for half of the requests, a budget of a quarter of the drafted tokens, and a
verify-cost curve that is flat up to 256 positions and then linear.

Why argparse, not Hydra like train.py/eval.py: a micro-benchmark on synthetic inputs; its settings are two
flags, not a config tree from conf/.
"""

from __future__ import annotations

import statistics
import time
from functools import partial

from calib.cli import parser as plain_parser

# torch and the allocator are imported by main() after parsing (--help answers without them) and bound here
torch = allocate_probs = plan_draft = ShapePrice = None

BATCHES = (1, 4, 64, 256, 1024)
WIDTHS = (4, 8, 16)


def make_inputs(b: int, k: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    model_p = torch.rand(b, k, generator=gen) ** 0.3
    ngram_p = torch.rand(b, k, generator=gen) ** 0.3
    ngram_p[torch.rand(b, generator=gen) < 0.5] = float("nan")  # no n-gram match for half
    total = torch.arange(2 * b * (k + 1) + 2, dtype=torch.float32)
    cost = 1.0 + torch.clamp(total - 256, min=0) / 256
    return model_p, ngram_p, max(b * k // 4, 1), cost


def naive_topk(model_p, ngram_p, budget):
    p = model_p if ngram_p is None else torch.cat([model_p, ngram_p], dim=1)
    surv = torch.nan_to_num(p, nan=0.0).clamp(0, 1).cumprod(dim=1)
    top = surv.flatten().topk(min(budget, surv.numel())).indices
    return torch.bincount(top // surv.shape[1], minlength=surv.shape[0])


def median_ms(fn, min_time: float = 0.2, max_reps: int = 200) -> float:
    for _ in range(3):
        fn()
    times, start = [], time.perf_counter()
    while len(times) < 5 or (time.perf_counter() - start < min_time and len(times) < max_reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def cpu_table() -> None:
    print(f"CPU: torch {torch.__version__}, {torch.get_num_threads()} thread(s); median ms per call")
    print(f"{'B':>5} {'K':>3} {'drafters':>8} {'ref budget':>11} {'ref price':>10} {'naive topk':>11}")
    for b in BATCHES:
        for k in WIDTHS:
            model_p, ngram_p, budget, cost = make_inputs(b, k)
            for two in (False, True):
                ng = ngram_p if two else None
                probs = {"model": model_p} | ({"ngram": ng} if two else {})
                t_budget = median_ms(partial(allocate_probs, probs, budget=budget))
                t_price = median_ms(partial(allocate_probs, probs, cost=cost))
                t_naive = median_ms(partial(naive_topk, model_p, ng, budget))
                print(f"{b:>5} {k:>3} {2 if two else 1:>8} {t_budget:>11.3f} {t_price:>10.3f} {t_naive:>11.3f}")


def plan_table() -> None:
    """The draft-aware decision before the first model pass (the widest: K + 1 candidate plans, each one
    price-mode allocation), next to one price-mode allocation of the drafted chains."""
    print("\nDraft-aware plan before pass 0 (calib.allocate.plan_draft, reference; pass cost 0.05): median ms")
    print(f"{'B':>5} {'K':>3} {'drafters':>8} {'plan':>8} {'allocate':>9}")
    for b in (4, 64, 256):
        for k in (4, 16):
            model_p, ngram_p, _, cost = make_inputs(b, k)
            for two in (False, True):
                known = {"model": torch.empty(b, 0)} | ({"ngram": ngram_p} if two else {})
                probs = {"model": model_p} | ({"ngram": ngram_p} if two else {})
                t_plan = median_ms(partial(plan_draft, known, model_p, cost=cost, pass_cost=0.05))
                t_alloc = median_ms(partial(allocate_probs, probs, cost=cost))
                print(f"{b:>5} {k:>3} {2 if two else 1:>8} {t_plan:>8.3f} {t_alloc:>9.3f}")


def gpu_table() -> None:
    import triton.testing

    dev = torch.device("cuda")
    print(f"\nGPU: {torch.cuda.get_device_name(dev)}, triton {triton.__version__}; median us per call")
    print(f"{'B':>5} {'K':>3} {'drafters':>8} {'mode':>6} {'kernel':>8} {'graph':>8} {'reference':>10}")
    for b in (64, 256, 1024):
        k = 16
        model_p, ngram_p, budget, cost = (x.to(dev) if torch.is_tensor(x) else x for x in make_inputs(b, k))
        budget_t = torch.tensor(budget, device=dev)  # a device budget keeps the launch sync-free
        for two in (False, True):
            ng = ngram_p if two else None
            for mode, kw in (("budget", {"budget": budget_t}), ("price", {"cost": cost})):
                probs = {"model": model_p} | ({"ngram": ng} if two else {})
                kernel = partial(allocate_probs, probs, impl="triton", **kw)
                reference = partial(allocate_probs, probs, **kw)
                t_kernel = triton.testing.do_bench(kernel, warmup=25, rep=100) * 1e3
                t_graph = _graph_us(kernel)
                t_ref = triton.testing.do_bench(reference, warmup=5, rep=50) * 1e3
                print(f"{b:>5} {k:>3} {2 if two else 1:>8} {mode:>6} {t_kernel:>8.1f} {t_graph:>8} {t_ref:>10.1f}")


def shape_inputs(b: int, k: int, two: bool):
    """The flat inputs of :func:`make_inputs` and an MoE-like shape price (each deeper position cheaper)."""
    model_p, ngram_p, _, cost = make_inputs(b, k)
    probs = {"model": model_p} | ({"ngram": ngram_p} if two else {})
    steps = 0.02 * 0.8 ** torch.arange(k, dtype=torch.float64)  # concave in depth
    price = ShapePrice(1.0, torch.cat([torch.zeros(1, dtype=torch.float64), steps.cumsum(0)]))
    return probs, cost, price


def shape_table() -> None:
    """The shape-aware price kernel next to today's price-mode kernel on the same chains (and the two references)."""
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    if cuda:
        import triton.testing

        def clock(fn):
            return triton.testing.do_bench(fn, warmup=25, rep=100) * 1e3  # us
    else:
        def clock(fn):
            return median_ms(fn, min_time=1.0, max_reps=20) * 1e3  # us
    where = "GPU (do_bench)" if cuda else "CPU, Triton interpreter"
    print(f"\nShape-aware price (ShapePrice) vs flat price (cost curve), {where}: median us per call")
    print(f"{'B':>5} {'K':>3} {'drafters':>8} {'flat kernel':>12} {'shape kernel':>13} {'ratio':>6} "
          f"{'flat ref':>9} {'shape ref':>10}")
    for b, k in ((4, 4), (16, 4), (64, 8)) if not cuda else ((64, 16), (256, 16), (1024, 16)):
        for two in (False, True):
            probs, cost, price = shape_inputs(b, k, two)
            probs = {n: p.to(dev) for n, p in probs.items()}
            cost = cost.to(dev)
            flat = clock(partial(allocate_probs, probs, cost=cost, impl="triton"))
            shaped = clock(partial(allocate_probs, probs, price=price, impl="triton"))
            flat_ref = clock(partial(allocate_probs, probs, cost=cost))
            shape_ref = clock(partial(allocate_probs, probs, price=price))
            print(f"{b:>5} {k:>3} {2 if two else 1:>8} {flat:>12.0f} {shaped:>13.0f} {shaped / flat:>6.2f} "
                  f"{flat_ref:>9.0f} {shape_ref:>10.0f}")


def _graph_us(fn) -> str:
    """Replay time of the kernel captured in a CUDA graph (launch overhead removed)."""
    try:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()  # compile and warm up outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        import triton.testing

        return f"{triton.testing.do_bench(graph.replay, warmup=25, rep=100) * 1e3:.1f}"
    except Exception as err:  # noqa: BLE001 -- report in the table, don't abort it
        return f"fail:{type(err).__name__}"


def main() -> None:
    parser = plain_parser(__doc__)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    parser.add_argument("--skip-cpu", action="store_true", help="only the GPU table")
    parser.add_argument("--shape", action="store_true", help="only the shape-aware vs flat price kernel table "
                        "(on CPU set TRITON_INTERPRET=1)")
    args = parser.parse_args()
    global torch, allocate_probs, plan_draft, ShapePrice
    import torch

    from calib.allocate import ShapePrice, allocate_probs, plan_draft

    torch.set_num_threads(args.threads)
    if args.shape:
        shape_table()
        return
    if not args.skip_cpu:
        cpu_table()
        plan_table()
    if torch.cuda.is_available():
        gpu_table()
    else:
        print("\nNo CUDA device: GPU timing of the Triton kernel skipped.")


if __name__ == "__main__":
    main()
