"""Draft-aware allocation: decide *before* each model draft pass whether it pays.

The allocator (:mod:`calib.allocate.reference`) decides what to verify once every chain is drafted.
A model drafter costs one forward pass per drafted depth, so a policy that always drafts K tokens
and then verifies fewer has paid for passes it did not use. :func:`plan_draft` decides while
drafting, from what is known before the next pass:

* ``known``: the calibrated P(accept | reached) of the model tokens drafted so far
  (``[B, passes_done]``, NaN where a request's chain ended) and of any chain that costs no model pass
  (the n-gram chain: known in full before the model drafts);
* ``forecast``: the tables' forecast of the model chain's later depths for each request
  (``[B, K]``, :func:`forecast_probs`: the calibrated acceptance the tables expect at each depth in
  the request's context cell, before its confidence is known);
* the prices: ``cost[T]`` of a verify pass over ``T`` positions (as :func:`calib.allocate.allocate_probs`)
  and ``pass_cost``, the price of one model draft pass over the batch (the same however many rows
  draft: drafting is memory-bound, and the replay's curves do not tell rows apart), plus ``sunk``,
  what was spent drafting this step already.

For every plan ``g`` = total passes in ``passes_done .. K``, the model chain is the known tokens then
the forecast up to depth ``g``; the exact goodput rule allocates it (with the free chains) at the
price of ``g`` passes, and the plan's value is its expected goodput ``(B + expected accepted) /
(cost[T] + sunk + (g - passes_done) * pass_cost)`` on the fixed-point gains the allocator uses. The
best plan wins (ties: fewer passes); the next pass runs iff it drafts more than ``passes_done``, and
the requests that draft in it are the ones the best plan verifies deeper than ``passes_done`` on the
model chain (an engine may skip the others; the price is the pass's either way).

Guarantee (one chain, tested against brute force in ``tests/allocate/test_draft.py``): were the
forecast the true acceptance probabilities, the chosen plan's expected goodput equals the maximum,
over every number of passes ``g`` and every allocation of depths ``<= g``, of the expected goodput of
drafting ``g`` passes and verifying that allocation: for a fixed ``g`` the price rule is exact, and a
plan that verifies less than ``g`` deep is also scored at its own ``g``. With two chains the plan
inherits the two-chain price rule's guarantee (never worse than either chain alone). Stopping is
myopic only in what the forecast does not know: each pass's outcome updates ``known`` and the plan is
made again.

Both implementations of the allocator (``impl``) take bit-identical decisions, and the plan's values
are computed here from those decisions on exact integer gains, so the plan is identical too.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

from calib.allocate.api import allocate_probs
from calib.allocate.reference import SCALE, survival


@dataclass(frozen=True)
class DraftPlan:
    """The decision before one model draft pass.

    Attributes:
        run_pass: whether to run the next draft pass (False: stop drafting and verify what is known).
        drafting: bool [B]; the requests the best plan verifies deeper than ``passes_done`` on the
            model chain (the ones the next pass drafts for; all False when ``run_pass`` is False).
        passes: total passes of the best plan (``passes_done`` when stopping).
        goodput: float; the best plan's expected goodput in tokens per cost unit.
    """

    run_pass: bool
    drafting: torch.Tensor
    passes: int
    goodput: float


def plan_draft(
    known: Mapping[str, torch.Tensor],
    forecast: torch.Tensor,
    *,
    cost: torch.Tensor,
    pass_cost: float,
    sunk: float = 0.0,
    chain: str = "model",
    impl: str = "reference",
) -> DraftPlan:
    """The draft-aware decision before the next pass of ``chain`` (see the module docstring).

    Args:
        known: ``{chain name: float [B, W]}``; ``known[chain]`` holds the ``passes_done = W`` depths
            drafted so far (W may be 0), NaN where a request's chain has ended; any other chain (at
            most one) is known in full.
        forecast: float [B, K]; forecast P(accept | reached) of ``chain`` at each depth (K = the most
            passes a step may run; depths below ``passes_done`` are ignored).
        cost: verify cost curve, as :func:`calib.allocate.allocate_probs`.
        pass_cost: price of one draft pass of ``chain`` (>= 0), in the curve's unit.
        sunk: drafting already spent in this step (it is part of every plan's cost).
        impl: the allocator implementation.
    """
    if chain not in known:
        raise ValueError(f"`known` must hold the {chain} chain's drafted depths ([B, 0] before the first pass)")
    done_p = known[chain]
    B, done = done_p.shape
    K = forecast.shape[1]
    if forecast.ndim != 2 or forecast.shape[0] != B:
        raise ValueError(f"forecast must be [B={B}, K], got {tuple(forecast.shape)}")
    if done > K:
        raise ValueError(f"{done} passes done but the forecast covers K={K} depths")
    if not (np.isfinite(pass_cost) and pass_cost >= 0 and np.isfinite(sunk) and sunk >= 0):
        raise ValueError(f"pass_cost={pass_cost!r} and sunk={sunk!r} must be finite and >= 0")
    others = {n: p for n, p in known.items() if n != chain}
    done_p = done_p.to(torch.float32)
    ended = torch.isnan(done_p).any(dim=1, keepdim=True) if done else torch.zeros(B, 1, dtype=torch.bool)
    best = None
    for g in range(done, K + 1):
        tail = torch.where(ended, torch.nan, forecast[:, done:g].to(torch.float32))
        p = torch.cat([done_p, tail], dim=1)
        extra = sunk + (g - done) * pass_cost
        value, depth_model = _plan_value({chain: p, **others}, chain, cost, extra, impl)
        if best is None or value > best[0]:  # ties: the fewer passes
            best = (value, g, depth_model)
    value, g, depth_model = best
    run = bool((depth_model > done).any())
    drafting = depth_model > done if run else torch.zeros(B, dtype=torch.bool)
    return DraftPlan(run, drafting, int(depth_model.max()) if run else done, value)


def _plan_value(probs: dict, chain: str, cost: torch.Tensor, extra: float, impl: str) -> tuple[float, torch.Tensor]:
    """Expected goodput of the allocator's decision on ``probs`` priced ``cost + extra``, on the
    allocator's fixed-point gains; and the depth it verifies on ``chain`` per request [B]."""
    from calib.chains import chain as chain_kind

    B = next(iter(probs.values())).shape[0]
    priced = cost.to(torch.float64) + extra
    out = allocate_probs(probs, cost=priced, impl=impl)
    gained = torch.zeros((), dtype=torch.int64)
    depth_chain = torch.zeros(B, dtype=torch.int64)
    for name, p in probs.items():
        cid = chain_kind(name).id
        mine = out.drafter.to(torch.int64) == cid
        depth = torch.where(mine, out.depth.to(torch.int64), 0)
        if p.shape[1]:
            _, q = survival(p)
            taken = torch.arange(p.shape[1])[None, :] < depth[:, None]
            gained = gained + torch.where(taken, q.to(torch.int64), 0).sum()
        if name == chain:
            depth_chain = depth
    T = B + int(out.depth.to(torch.int64).sum())
    price = float(priced[T]) if T < priced.numel() else float("inf")
    return (B * SCALE + int(gained)) / SCALE / price, depth_chain


def forecast_probs(tables, chain: str, context, depths: int | None = None) -> torch.Tensor:
    """The tables' forecast of ``chain`` (tables.json ``chains.<chain>.forecast``): float32 [B, K] of
    the calibrated acceptance expected at each depth in each request's context cell.

    ``context``: float [B, A_ctx], the request's values of the forecast's context axes in their
    order (``forecast["axes"]``: the chain's context axes, e.g. temperature); [B, 0] or None when
    there are none. Depths beyond the forecast's rows repeat its last row (``depths``: K, default D).
    """
    from calib.calibrators.context import context_cells

    meta = tables.meta["chains"][chain].get("forecast")
    if meta is None:
        raise ValueError(f"the tables hold no forecast for the {chain} chain (tables from before the "
                         "draft-aware allocator: re-run train.py)")
    values = torch.tensor(meta["values"], dtype=torch.float32)  # [D, cells]
    edges = [a["edges"] for a in meta["axes"]]
    ctx = np.zeros((0, 0)) if context is None else np.asarray(torch.as_tensor(context, dtype=torch.float64))
    n = ctx.shape[0] if context is not None else 1
    if edges and (ctx.ndim != 2 or ctx.shape[1] != len(edges)):
        names = [a["name"] for a in meta["axes"]]
        raise ValueError(f"context must be [B, {len(edges)}] holding {names}, got shape {tuple(ctx.shape)}")
    cells = torch.from_numpy(context_cells(ctx, edges)) if edges else torch.zeros(n, dtype=torch.int64)
    D = values.shape[0]
    rows = torch.arange(depths if depths is not None else D).clamp(max=D - 1)
    return values[rows][:, cells].t().contiguous()
