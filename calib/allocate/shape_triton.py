"""Fused Triton kernel of the shape-aware price mode (:mod:`calib.allocate.shape`), step for step.

One program holds the batch as ``[BLOCK_B, BLOCK_K]`` tiles (one per chain): survival products column
by column (the same float32 operations as :func:`calib.allocate.reference.survival`), the gains on the
``2**-24`` grid, their running sums, then the Dinkelbach rounds with the same float64 operations as the
reference (``G - lam * P``: FMA contraction is disabled at launch) and the same tie rules; a round that
does not raise the ratio ends the search (a device-side loop condition: no host read). Nothing is read back,
so a launch with fixed ``B`` and width can be captured in a CUDA graph. On CPU tensors it runs under
Triton's interpreter (``TRITON_INTERPRET=1`` before triton is first imported), for tests.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from calib.allocate.reference import SCALE
from calib.allocate.shape import MAX_ITERS, PRICE_SCALE
from calib.allocate.triton_kernels import MAX_TILE, MAX_WIDTH, _append_survival, check_runnable, interpreting
from calib.chains import NO_CHAIN


@triton.jit
def _chain_tile(p_ptr, stride_b, stride_k, K, rows, row_ok, cols, BLOCK_B: tl.constexpr, BLOCK_K: tl.constexpr):
    """Survival ``[BLOCK_B, BLOCK_K]`` float32 of one chain's probabilities ``[B, K]`` (NaN = no token)."""
    surv = tl.zeros([BLOCK_B, BLOCK_K], dtype=tl.float32)
    running = tl.full([BLOCK_B], 1.0, tl.float32)
    alive = row_ok
    for k in tl.static_range(BLOCK_K):
        p = tl.load(p_ptr + rows * stride_b + k * stride_k, mask=row_ok & (k < K), other=float("nan"))
        surv, running, alive = _append_survival(surv, running, alive, p.to(tl.float32), k, cols)
    return surv


@triton.jit
def _best_depth(gained, q, price, lam, cols, BLOCK_K: tl.constexpr):
    """Per row: (surplus = max(0, best G - lam * P), depth: its fewest tokens, 0 when nothing beats 0)."""
    feasible = (q > 0) & (price >= 0)
    score = tl.where(feasible, gained.to(tl.float64) - lam * price.to(tl.float64), float("-inf"))
    best = tl.max(score, axis=1)
    d = tl.min(tl.where(score == best[:, None], cols[None, :] + 1, BLOCK_K + 1), axis=1)
    d = tl.where(best > 0, d, 0)
    return tl.maximum(best, 0.0), d


@triton.jit
def _picked(values, depth, cols):
    """Σ_i values[i, depth_i - 1] over the rows with depth > 0 (int64)."""
    return tl.sum(tl.sum(tl.where(cols[None, :] + 1 == depth[:, None], values, 0).to(tl.int64), axis=1), axis=0)


@triton.jit
def _shape_kernel(
    f_ptr, f_sb, f_sk, K, s_ptr, s_sb, s_sk, L, price_ptr, price_sb, W1,
    drafter_ptr, depth_ptr, expected_ptr, B,
    HAS_SECOND: tl.constexpr, FIRST_ID: tl.constexpr, SECOND_ID: tl.constexpr, NO_CHAIN_: tl.constexpr,
    BLOCK_B: tl.constexpr, BLOCK_K: tl.constexpr, ITERS: tl.constexpr, SCALE_: tl.constexpr,
    PRICE_SCALE_: tl.constexpr,
):
    rows = tl.arange(0, BLOCK_B)
    cols = tl.arange(0, BLOCK_K)
    row_ok = rows < B
    surv_f = _chain_tile(f_ptr, f_sb, f_sk, K, rows, row_ok, cols, BLOCK_B, BLOCK_K)
    q_f = (surv_f * SCALE_).to(tl.int32)
    g_f = tl.cumsum(q_f.to(tl.int64), axis=1)
    # price of depth d = cols + 1; -1 (infeasible) beyond the table and on padded rows
    price_ok = row_ok[:, None] & (cols[None, :] + 1 < W1)
    price = tl.load(price_ptr + rows[:, None] * price_sb + cols[None, :] + 1, mask=price_ok, other=-1)
    if HAS_SECOND:
        surv_s = _chain_tile(s_ptr, s_sb, s_sk, L, rows, row_ok, cols, BLOCK_B, BLOCK_K)
    else:
        surv_s = tl.zeros([BLOCK_B, BLOCK_K], dtype=tl.float32)
    q_s = (surv_s * SCALE_).to(tl.int32)
    g_s = tl.cumsum(q_s.to(tl.int64), axis=1)

    base_n = B.to(tl.int64) * SCALE_
    lam = base_n.to(tl.float64) / PRICE_SCALE_
    use_s = rows < 0
    depth = tl.zeros([BLOCK_B], dtype=tl.int32)
    done = B < 0
    it = 0
    while (done == 0) & (it < ITERS):  # a round that does not raise the ratio ends the search
        it += 1
        sur_f, d_f = _best_depth(g_f, q_f, price, lam, cols, BLOCK_K)
        sur_s, d_s = _best_depth(g_s, q_s, price, lam, cols, BLOCK_K)
        take = (sur_s > sur_f) | ((sur_s == sur_f) & (d_s < d_f))
        new_d = tl.where(take, d_s, d_f)
        num = base_n + _picked(tl.where(take[:, None], g_s, g_f), new_d, cols)
        den = PRICE_SCALE_ + _picked(price, new_d, cols)
        lam_new = num.to(tl.float64) / den.to(tl.float64)
        better = (lam_new > lam) & (done == 0)
        use_s = tl.where(better, take, use_s)
        depth = tl.where(better, new_d, depth)
        lam = tl.where(better, lam_new, lam)
        done = done | (better == 0)

    surv = tl.where(use_s[:, None], surv_s, surv_f)
    expected = tl.sum(tl.where(cols[None, :] < depth[:, None], surv, 0.0), axis=1)
    drafter = tl.where(depth > 0, tl.where(use_s, SECOND_ID, FIRST_ID), NO_CHAIN_)
    tl.store(drafter_ptr + rows, drafter.to(tl.int8), mask=row_ok)
    tl.store(depth_ptr + rows, depth, mask=row_ok)
    tl.store(expected_ptr + rows, expected, mask=row_ok)


def allocate_shape_triton(first: torch.Tensor, second: torch.Tensor | None, price_q: torch.Tensor,
                          ids: tuple[int, int] = (1, 2)) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch the kernel on probabilities ``first [B, K]`` (and ``second [B, L]``) with the quantized prices
    ``price_q`` int64 ``[B, W + 1]`` (:func:`calib.allocate.shape.quantized`, W = max(K, L)). Returns
    device tensors ``(drafter int8, depth int32, expected_accepted float32)``."""
    device = first.device
    check_runnable(device)
    n_requests, k = first.shape
    n_second = 0 if second is None else second.shape[1]
    width = max(k, n_second, 1)
    block_b = max(triton.next_power_of_2(n_requests), 2)
    block_k = max(triton.next_power_of_2(width), 2)
    if width > MAX_WIDTH or block_b * block_k > MAX_TILE:
        raise ValueError(f"B={n_requests}, width={width} exceeds the kernel's tile ({MAX_TILE}, {MAX_WIDTH})")
    first = first.to(torch.float32).contiguous()
    other = first if second is None else second.to(device=device, dtype=torch.float32).contiguous()
    price_q = price_q.to(device=device, dtype=torch.int64).contiguous()
    drafter = torch.empty(n_requests, dtype=torch.int8, device=device)
    depth = torch.empty(n_requests, dtype=torch.int32, device=device)
    expected = torch.empty(n_requests, dtype=torch.float32, device=device)
    launch = {} if interpreting() else {"enable_fp_fusion": False, "num_warps": 4 if block_b * block_k <= 1024 else 8}
    _shape_kernel[(1,)](
        first, first.stride(0), first.stride(1), k, other, other.stride(0), other.stride(1), n_second,
        price_q, price_q.stride(0), price_q.shape[1],
        drafter, depth, expected, n_requests,
        HAS_SECOND=second is not None, FIRST_ID=int(ids[0]), SECOND_ID=int(ids[1]), NO_CHAIN_=NO_CHAIN,
        BLOCK_B=block_b, BLOCK_K=block_k, ITERS=MAX_ITERS, SCALE_=SCALE, PRICE_SCALE_=PRICE_SCALE,
        **launch,
    )
    return drafter, depth, expected
