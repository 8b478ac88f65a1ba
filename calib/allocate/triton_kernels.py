"""Fused Triton allocator: table lookup, survival product, selection and drafter choice.

One program handles the whole batch (selection is batch-global): every tensor lives in registers
as a ``[BLOCK_B, BLOCK_K]`` tile, searches are fixed-length bisections over the fixed-point gain
grid, and nothing is read back to the host, so a launch can be captured in a CUDA graph (pass
``budget`` as a device tensor). The rules and their justification are in
:mod:`calib.allocate.reference`; this file follows them step for step:

* lookups and the survival product use the same float32 operations in the same order as the
  torch code (FMA contraction is disabled at launch so ``a + f * (b - a)`` rounds the same way);
* every decision is taken on integer fixed-point gains, so different reduction orders cannot
  change it;
* price mode sorts the gains in-kernel (``tl.sort``) and computes each prefix's goodput as one
  float64 division of an exact integer, like the reference.

On CPU tensors the same kernel runs (slowly, for testing) under Triton's interpreter, which must be
switched on by the caller: ``TRITON_INTERPRET=1`` in the environment before ``triton`` is first
imported (tests/allocate/conftest.py does it). Importing this module changes no environment
variable; a launch on CPU tensors without the interpreter is a ``RuntimeError`` that says so.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from calib import envs
from calib.allocate.reference import SCALE
from calib.chains import NO_CHAIN

MAX_WIDTH = 64  # per-row surplus sums stay below 2**31 in int32
MAX_TILE = 16384  # BLOCK_B * BLOCK_K held by one program, e.g. B <= 1024 at K = 16
_SEARCH_STEPS = 25  # bisection over (-1, SCALE] closes to width 1 in ceil(log2(SCALE + 1)) steps


@triton.jit
def chain_column(
    ptr, stride_b, stride_l, stride_a, k, rows, row_ok, L,
    grid_ptr, D, C, G, edges_ptr, strides_ptr, A_BINS, E,
    FROM_TABLE: tl.constexpr, INTERP: tl.constexpr, BLOCK_B: tl.constexpr,
):
    """Conditional acceptance probability of depth ``k`` of one chain, NaN = no token.

    Without a table the input already holds probabilities ([B, L]). With one (layout in
    :mod:`calib.tables.layout`): the binned axes (after the interpolated one when ``INTERP``) give
    the cell, and an interpolated axis 0 (the raw confidence) interpolates between grid points
    ``cell + lo`` and ``cell + lo + 1``.
    """
    base = ptr + rows * stride_b + k * stride_l
    x0 = tl.load(base, mask=row_ok & (k < L), other=float("nan")).to(tl.float32)
    if FROM_TABLE:
        present = x0 == x0  # noqa: PLR0124 -- NaN test (no isnan in tl)
        cell = tl.zeros([BLOCK_B], dtype=tl.int64)
        binned = base + stride_a if INTERP else base  # the binned axes follow an interpolated axis 0
        for f in range(A_BINS):
            x = tl.load(binned + f * stride_a, mask=row_ok & (k < L), other=float("nan")).to(tl.float32)
            bucket = tl.zeros([BLOCK_B], dtype=tl.int64)
            for e in range(E):
                edge = tl.load(edges_ptr + f * E + e)
                bucket += (edge <= x).to(tl.int64) * (edge < float("inf")).to(tl.int64)
            cell += bucket * tl.load(strides_ptr + f)
        cell = tl.where(present, cell, 0)
        grid_row = tl.minimum(k, D - 1)
        if INTERP:
            c = tl.minimum(tl.maximum(tl.where(present, x0, 0.0), 0.0), 1.0)
            pos = c * (G - 1).to(tl.float32)
            lo = tl.minimum(tl.floor(pos).to(tl.int32), tl.maximum(G - 2, 0))
            hi = tl.minimum(lo + 1, G - 1)
            frac = pos - lo.to(tl.float32)
            g_lo = tl.load(grid_ptr + grid_row * C + cell + lo, mask=row_ok, other=0.0)
            g_hi = tl.load(grid_ptr + grid_row * C + cell + hi, mask=row_ok, other=0.0)
            x0 = tl.where(present, g_lo + frac * (g_hi - g_lo), float("nan"))
        else:
            p = tl.load(grid_ptr + grid_row * C + cell, mask=row_ok, other=0.0)
            x0 = tl.where(present, p, float("nan"))
    return x0


_chain_column = chain_column  # the name _allocate_kernel's body calls it by (the kernel is left as it is)


@triton.jit
def _append_survival(surv, running, alive, p, k, cols):
    """Multiply depth ``k`` into the running survival and write it into column ``k`` of the tile."""
    present = p == p  # noqa: PLR0124 -- NaN test
    alive = alive & present
    running = running * tl.where(present, tl.minimum(tl.maximum(p, 0.0), 1.0), 0.0)
    surv = tl.where(cols[None, :] == k, tl.where(alive, running, 0.0)[:, None], surv)
    return surv, running, alive


@triton.jit
def _count_above(q, t):
    return tl.sum(tl.sum((q > t).to(tl.int32), axis=1), axis=0)


@triton.jit
def _nth_threshold(q, n, STEPS: tl.constexpr, SCALE_: tl.constexpr):
    """Smallest integer ``t >= 0`` with ``#{q > t} <= n`` (selects the same set as the n-th largest)."""
    lo = tl.full([], -1, tl.int32)
    hi = tl.full([], SCALE_, tl.int32)
    for _ in range(STEPS):
        mid = lo + (hi - lo) // 2
        fits = _count_above(q, mid) <= n
        still_open = hi - lo > 1
        hi = tl.where(still_open & fits, mid, hi)
        lo = tl.where(still_open & (fits == 0), mid, lo)
    return hi


@triton.jit
def _take_top(q, t, n):
    """Per-row depth taking everything above ``t`` and ties at ``t`` in request order up to ``n``."""
    above = (q > t).to(tl.int32)
    ties = ((q == t) & (t > 0)).to(tl.int32)
    left = tl.maximum(n - tl.sum(tl.sum(above, axis=1), axis=0), 0)
    ties_per_row = tl.sum(ties, axis=1)
    ties_before = tl.cumsum(ties_per_row, axis=0) - ties_per_row
    taken = tl.minimum(tl.maximum(left - ties_before, 0), ties_per_row)
    return tl.sum(above, axis=1) + taken


@triton.jit
def _choose(q_model, q_ngram, price):
    """Lagrangian choice at ``price``: (use_second, depth); larger surplus, then fewer tokens, then the
    first chain. (``_m`` names the first chain, ``_n`` the second: model and n-gram by default.)"""
    surplus_m = tl.sum(tl.maximum(q_model - price, 0), axis=1)
    surplus_n = tl.sum(tl.maximum(q_ngram - price, 0), axis=1)
    depth_m = tl.sum((q_model > price).to(tl.int32), axis=1)
    depth_n = tl.sum((q_ngram > price).to(tl.int32), axis=1)
    use_ngram = (surplus_n > surplus_m) | ((surplus_n == surplus_m) & (depth_n < depth_m))
    return use_ngram, tl.where(use_ngram, depth_n, depth_m)


@triton.jit
def _lagrangian_price(q_model, q_ngram, n, STEPS: tl.constexpr, SCALE_: tl.constexpr):
    """Smallest integer price ``>= 0`` whose Lagrangian depths sum to at most ``n``."""
    lo = tl.full([], -1, tl.int32)
    hi = tl.full([], SCALE_, tl.int32)
    for _ in range(STEPS):
        mid = lo + (hi - lo) // 2
        fits = tl.sum(_choose(q_model, q_ngram, mid)[1], axis=0) <= n
        still_open = hi - lo > 1
        hi = tl.where(still_open & fits, mid, hi)
        lo = tl.where(still_open & (fits == 0), mid, lo)
    return hi


@triton.jit
def _prefix_value(q, depth, cols):
    taken = tl.where(cols[None, :] < depth[:, None], q, 0).to(tl.int64)
    return tl.sum(tl.sum(taken, axis=1), axis=0)


@triton.jit
def _best_price_prefix(q, cost_ptr, C, B, SCALE_: tl.constexpr, BLOCK_N: tl.constexpr):
    """Exact one-chain price mode: (m*, goodput*, threshold) over every top-m prefix."""
    ordered = tl.sort(tl.reshape(q, [BLOCK_N]), descending=True)
    gained = tl.cumsum(ordered.to(tl.int64), axis=0)  # gained[j] = sum of the top j + 1
    m = tl.arange(0, BLOCK_N) + 1
    total = B + m
    ok = (m <= tl.sum((ordered > 0).to(tl.int32), axis=0)) & (total < C)
    price = tl.load(cost_ptr + total, mask=ok, other=1.0)
    ok = ok & (price > 0) & (price < float("inf"))
    base = B.to(tl.int64) * SCALE_
    goodput = tl.where(ok, (base + gained).to(tl.float64) / price, float("-inf"))
    # m = 0: no draft token at all, still one bonus position per request.
    price0 = tl.load(cost_ptr + B, mask=B < C, other=1.0)
    ok0 = (B < C) & (price0 > 0) & (price0 < float("inf"))
    goodput0 = tl.where(ok0, base.to(tl.float64) / price0, float("-inf"))
    best = tl.max(goodput, axis=0)
    first = tl.min(tl.where(goodput == best, m, BLOCK_N + 1), axis=0)  # ties: fewest tokens
    keep_none = goodput0 >= best
    best_m = tl.where(keep_none, 0, first)
    threshold = tl.sum(tl.where(m == best_m, ordered, 0), axis=0)
    threshold = tl.where(best_m > 0, threshold, SCALE_ + 1)
    return best_m, tl.where(keep_none, goodput0, best), threshold


@triton.jit
def _allocate_kernel(
    m_ptr, m_stride_b, m_stride_l, m_stride_a, K,
    m_grid_ptr, MD, MC, MG, m_edges_ptr, m_strides_ptr, M_BINS, ME,
    n_ptr, n_stride_b, n_stride_l, n_stride_a, L,
    n_grid_ptr, ND, NC, NG, n_edges_ptr, n_strides_ptr, N_BINS, NE,
    budget_ptr, cost_ptr, C,
    drafter_ptr, depth_ptr, expected_ptr,
    B,
    MODEL_TABLE: tl.constexpr, MODEL_INTERP: tl.constexpr,
    NGRAM_TABLE: tl.constexpr, NGRAM_INTERP: tl.constexpr, HAS_NGRAM: tl.constexpr,
    FIRST_ID: tl.constexpr, SECOND_ID: tl.constexpr, NO_CHAIN_: tl.constexpr,
    PRICE: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_K: tl.constexpr,
    STEPS: tl.constexpr, SCALE_: tl.constexpr,
):
    # Two chain slots: m_* / MODEL_* is the first chain (lower registry id), n_* / NGRAM_* the second
    # (the model and n-gram chains by default); FIRST_ID / SECOND_ID are their ids from calib.chains.
    rows = tl.arange(0, BLOCK_B)
    cols = tl.arange(0, BLOCK_K)
    row_ok = rows < B

    # 1. Lookups and survival, one depth at a time (left-to-right products, like the reference).
    surv_m = tl.zeros([BLOCK_B, BLOCK_K], dtype=tl.float32)
    surv_n = tl.zeros([BLOCK_B, BLOCK_K], dtype=tl.float32)
    run_m = tl.full([BLOCK_B], 1.0, tl.float32)
    run_n = tl.full([BLOCK_B], 1.0, tl.float32)
    alive_m = row_ok
    alive_n = row_ok
    for k in tl.static_range(BLOCK_K):
        p = _chain_column(m_ptr, m_stride_b, m_stride_l, m_stride_a, k, rows, row_ok, K,
                          m_grid_ptr, MD, MC, MG, m_edges_ptr, m_strides_ptr, M_BINS, ME,
                          MODEL_TABLE, MODEL_INTERP, BLOCK_B)
        surv_m, run_m, alive_m = _append_survival(surv_m, run_m, alive_m, p, k, cols)
        if HAS_NGRAM:
            p = _chain_column(n_ptr, n_stride_b, n_stride_l, n_stride_a, k, rows, row_ok, L,
                              n_grid_ptr, ND, NC, NG, n_edges_ptr, n_strides_ptr, N_BINS, NE,
                              NGRAM_TABLE, NGRAM_INTERP, BLOCK_B)
            surv_n, run_n, alive_n = _append_survival(surv_n, run_n, alive_n, p, k, cols)
    q_m = (surv_m * SCALE_).to(tl.int32)  # exact scaling, truncation = floor for gains >= 0
    q_n = (surv_n * SCALE_).to(tl.int32)

    # 2. Selection.
    use_n = rows < 0
    if not HAS_NGRAM:
        if PRICE:
            m, _, t = _best_price_prefix(q_m, cost_ptr, C, B, SCALE_, BLOCK_B * BLOCK_K)
            depth = _take_top(q_m, t, m)
        else:
            n = tl.maximum(tl.load(budget_ptr), 0)
            depth = _take_top(q_m, _nth_threshold(q_m, n, STEPS, SCALE_), n)
    else:
        first_m = tl.sum(tl.where(cols[None, :] == 0, q_m, 0), axis=1)
        first_n = tl.sum(tl.where(cols[None, :] == 0, q_n, 0), axis=1)
        if PRICE:
            m_m, good_m, t_m = _best_price_prefix(q_m, cost_ptr, C, B, SCALE_, BLOCK_B * BLOCK_K)
            m_n, good_n, t_n = _best_price_prefix(q_n, cost_ptr, C, B, SCALE_, BLOCK_B * BLOCK_K)
            price = tl.where(good_n > good_m, t_n, t_m)
            use_c, depth_c = _choose(q_m, q_n, price)
            use_c = tl.where(depth_c > 0, use_c, first_n > first_m)
            chain = tl.where(use_c[:, None], q_n, q_m)
            m_c, score_c, t_c = _best_price_prefix(chain, cost_ptr, C, B, SCALE_, BLOCK_B * BLOCK_K)
            depth_c = _take_top(chain, t_c, m_c)
            depth_m = _take_top(q_m, t_m, m_m)
            depth_n = _take_top(q_n, t_n, m_n)
            score_m = good_m
            score_n = good_n
        else:
            n = tl.maximum(tl.load(budget_ptr), 0)
            price = _lagrangian_price(q_m, q_n, n, STEPS, SCALE_)
            use_c, depth_c = _choose(q_m, q_n, price)
            # Upgrades to the choice one price unit lower, in request order, while they fit.
            use_lower, depth_lower = _choose(q_m, q_n, tl.maximum(price - 1, 0))
            extra = tl.maximum(depth_lower - depth_c, 0)
            upgrade = (extra > 0) & (tl.cumsum(extra, axis=0) <= n - tl.sum(depth_c, axis=0))
            use_c = tl.where(upgrade, use_lower, use_c)
            depth_c = tl.where(upgrade, depth_lower, depth_c)
            # Greedy fill on fixed chains.
            use_c = tl.where(depth_c > 0, use_c, first_n > first_m)
            chain = tl.where(use_c[:, None], q_n, q_m)
            rest = tl.where(cols[None, :] >= depth_c[:, None], chain, 0)
            left = n - tl.sum(depth_c, axis=0)
            depth_c += _take_top(rest, _nth_threshold(rest, left, STEPS, SCALE_), left)
            score_c = _prefix_value(chain, depth_c, cols)
            depth_m = _take_top(q_m, _nth_threshold(q_m, n, STEPS, SCALE_), n)
            depth_n = _take_top(q_n, _nth_threshold(q_n, n, STEPS, SCALE_), n)
            score_m = _prefix_value(q_m, depth_m, cols)
            score_n = _prefix_value(q_n, depth_n, cols)
        # Best of Lagrangian, model only, n-gram only; earlier wins ties.
        take_m = score_m > score_c
        take_n = score_n > tl.maximum(score_c, score_m)
        use_n = tl.where(take_n, rows >= 0, tl.where(take_m, rows < 0, use_c))
        depth = tl.where(take_n, depth_n, tl.where(take_m, depth_m, depth_c))

    # 3. Outputs.
    surv = tl.where(use_n[:, None], surv_n, surv_m)
    expected = tl.sum(tl.where(cols[None, :] < depth[:, None], surv, 0.0), axis=1)
    drafter = tl.where(depth > 0, tl.where(use_n, SECOND_ID, FIRST_ID), NO_CHAIN_)
    tl.store(drafter_ptr + rows, drafter.to(tl.int8), mask=row_ok)
    tl.store(depth_ptr + rows, depth.to(tl.int32), mask=row_ok)
    tl.store(expected_ptr + rows, expected, mask=row_ok)


def interpreting() -> bool:
    """Whether Triton runs interpreted: decided when ``triton`` was first imported (its own library of
    ``@jit`` functions, such as ``tl.sum``, is built then) and when this module was (our kernels)."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(tl.sum, InterpretedFunction) and isinstance(_allocate_kernel, InterpretedFunction)


def check_runnable(device: torch.device) -> None:
    """Refuse (RuntimeError, saying what to set) tensors on a device no Triton kernel of this process runs on."""
    if device.type == "cuda" or interpreting():
        return
    state = ("is set now, but was not when triton (or this module) was first imported"
             if envs.TRITON_INTERPRET else "is not set")
    raise RuntimeError(
        f"the Triton allocator got {device.type} tensors and no CUDA device runs them: on the CPU it needs "
        f"Triton's interpreter, and TRITON_INTERPRET {state}. Set TRITON_INTERPRET=1 in the environment "
        "before the first `import triton` (e.g. `TRITON_INTERPRET=1 python ...`), or use impl='reference'")


def allocate_triton(
    first: torch.Tensor,
    second: torch.Tensor | None = None,
    *,
    budget: int | torch.Tensor | None = None,
    cost: torch.Tensor | None = None,
    ids: tuple[int, int] = (1, 2),
    tables=None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch the fused kernel on one or two chains. ``first``/``second`` are probabilities ``[B, K]``,
    or, when ``tables`` (one :class:`calib.tables.layout.ChainTable` per chain given) is passed, table
    inputs ``[B, K, A]``. ``ids`` are the chains' registry ids (the kernel's ``FIRST_ID`` /
    ``SECOND_ID`` constexprs). Returns device tensors ``(drafter int8, depth int32, expected_accepted
    float32)``."""
    device = first.device
    check_runnable(device)
    n_requests, k = first.shape[:2]  # first: [B, K] or [B, K, A]
    n_second = 0 if second is None else second.shape[1]  # second: [B, L] or [B, L, A]
    width = max(k, n_second, 1)
    block_b = max(triton.next_power_of_2(n_requests), 2)
    block_k = max(triton.next_power_of_2(width), 2)
    if width > MAX_WIDTH or block_b * block_k > MAX_TILE:
        raise ValueError(f"B={n_requests}, width={width} exceeds the kernel's tile ({MAX_TILE}, {MAX_WIDTH})")
    has_second = second is not None
    slot_first = _slot(first, None if tables is None else tables[0], device)
    slot_second = _slot(second if has_second else first, None if tables is None or not has_second else tables[1],
                        device)

    price_mode = cost is not None
    budget_t, cost_t = _budget_and_cost(budget, cost, n_requests * width, device)
    drafter = torch.empty(n_requests, dtype=torch.int8, device=device)
    depth = torch.empty(n_requests, dtype=torch.int32, device=device)
    expected = torch.empty(n_requests, dtype=torch.float32, device=device)
    launch = {} if interpreting() else {"enable_fp_fusion": False, "num_warps": _num_warps(block_b * block_k)}
    _allocate_kernel[(1,)](
        *slot_first["args"],
        *(slot_second["args"][:4] + [n_second] + slot_second["args"][5:]),
        budget_t, cost_t, cost_t.numel(),
        drafter, depth, expected,
        n_requests,
        MODEL_TABLE=slot_first["table"], MODEL_INTERP=slot_first["interp"],
        NGRAM_TABLE=has_second and slot_second["table"], NGRAM_INTERP=slot_second["interp"], HAS_NGRAM=has_second,
        FIRST_ID=int(ids[0]), SECOND_ID=int(ids[1]), NO_CHAIN_=NO_CHAIN,
        PRICE=price_mode, BLOCK_B=block_b, BLOCK_K=block_k,
        STEPS=_SEARCH_STEPS, SCALE_=SCALE,
        **launch,
    )
    return drafter, depth, expected


def _budget_and_cost(budget, cost, slots: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's budget (int32 [1]) and verify-cost curve (float64 [C]) tensors: the curve in price
    mode (``cost`` given), else a budget of at most ``slots`` (= B * width) draft tokens."""
    if cost is not None:
        return torch.zeros(1, dtype=torch.int32, device=device), cost.to(device=device, dtype=torch.float64).contiguous()
    cost_t = torch.ones(1, dtype=torch.float64, device=device)
    # The kernel counts in int32: a budget of B * width slots or more already takes every slot, so
    # clamp to that (on the host for an int, on the device for a tensor: no sync) instead of
    # letting 2**31 wrap to a negative budget.
    if isinstance(budget, torch.Tensor):
        budget_t = budget.to(device=device, dtype=torch.int64).reshape(1).clamp(0, slots).to(torch.int32)
    else:
        budget_t = torch.full((1,), min(max(int(budget), 0), slots), dtype=torch.int32, device=device)
    return budget_t, cost_t


def _slot(x: torch.Tensor, table, device) -> dict:
    """A chain's kernel arguments: input pointer and strides (b, l, a), its depth, and its table
    (grid, D, C, G, edges, strides, binned axes, E); placeholders where there is no table."""
    x = x.contiguous()
    stride_a = x.stride(2) if x.ndim == 3 else 0
    if table is None:
        dummy_i = torch.zeros(1, dtype=torch.int64, device=device)
        return {"args": [x, x.stride(0), x.stride(1), stride_a, x.shape[1], x, 1, 1, 1, x, dummy_i, 0, 0],
                "table": False, "interp": False}
    if x.ndim == 2:
        x = x[..., None]
        stride_a = 0
    if x.shape[2] != len(table.axes):
        # The kernel reads the table's A features per depth: another count would read past the row.
        raise ValueError(f"chain inputs must be [B, L, A] with the table's A={len(table.axes)}, got shape "
                         f"{tuple(x.shape)}")
    grid = table.grid.to(device=device, dtype=torch.float32).contiguous()
    edges = table.edges.to(device=device, dtype=torch.float32).contiguous()
    strides = table.strides.to(device=device, dtype=torch.int64).contiguous()
    if edges.numel() == 0:  # no binned axes: the pointers are never read, but must be valid
        edges = torch.zeros(1, dtype=torch.float32, device=device)
        strides = torch.zeros(1, dtype=torch.int64, device=device)
    n_bins = table.edges.shape[0]
    d, c = grid.shape
    return {"args": [x, x.stride(0), x.stride(1), stride_a, x.shape[1], grid, d, c, max(table.points, 1), edges,
                     strides, n_bins, table.edges.shape[1] if n_bins else 0],
            "table": True, "interp": table.interpolated}


def _num_warps(tile: int) -> int:
    return 4 if tile <= 1024 else 8 if tile <= 4096 else 16
