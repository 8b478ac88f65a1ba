"""A step's lookup and allocation for :func:`calib.serve.decide.decide_step`: on the host in numpy (``impl="host"``,
:func:`host_decision`), or through the torch entry points (:func:`torch_decision`).

Inside vLLM's step calib decides for a few requests on a CPU, where each torch call's fixed cost (microseconds)
is most of the decision's time (bench/hot_path.py). Here the step's signals, built by the decider from inputs it
checked once this step (temperatures) or at construction (the cost curve, the sampled price), are looked up once
per chain (:func:`calib.allocate.api.built_probs`) and allocated by :func:`calib.allocate.host.allocate_chains_host`,
which also hands back the chosen chain's probabilities per verified token: no torch call per request, no check
repeated on what cannot have changed. The decisions are :func:`calib.allocate.allocate_probs`' bit for bit
(tests/allocate/test_host_matches_reference.py, tests/serve/test_allocation.py).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from calib.allocate import allocate, allocate_probs, calibrated_probs
from calib.allocate.api import _check_depths
from calib.allocate.host import allocate_chains_host, quantized_host
from calib.allocate.shape import MAX_PRICE_RATIO, ShapePrice, check_price
from calib.chains import chain
from calib.cost.serving import SampledPrice, sampled_price_table
from calib.tables.layout import ChainTable, chain_lookup_host, check_chain_inputs

# the implementations whose tables are read by a lookup in this process (the kernel reads them itself)
HOST_LOOKUPS = ("reference", "host")


def sampled_price_q(cost: np.ndarray, price: SampledPrice, n_requests: int, width: int) -> np.ndarray:
    """int64 ``[B, width + 1]``: the quantized shape price of a sampled step of ``n_requests`` (:func:`calib.cost.
    serving.sampled_shape_price` on the float32 curve ``cost``), refused as :func:`calib.allocate.shape.check_price`
    refuses it (its message) when an entry is one the rule cannot use."""
    base, table = sampled_price_table(cost, price, n_requests, width)
    shape = ShapePrice(base, torch.from_numpy(table))
    with np.errstate(invalid="ignore"):
        bad = np.isnan(table) | (table < 0) | (np.isfinite(table) & (table > MAX_PRICE_RATIO * base))
    if not (math.isfinite(base) and base > 0) or table[0] != 0 or bad.any():
        check_price(shape, n_requests)  # raises, naming the entry
    return quantized_host(shape, n_requests, width)


def host_decision(tables, signals: dict, given: dict, cost: torch.Tensor, sampled_price: SampledPrice | None,
                  temperatures: np.ndarray, k_max: int, cache: dict | None = None):
    """``(drafter int8 [B], depth int32 [B], expected float32 [B], chosen float32 [B, W])`` numpy (as
    :func:`calib.allocate.host.allocate_chains_host`) for the step's ``signals`` (numpy float32 ``[B, L, A]`` per
    chain, built from checked inputs) and ``given`` probabilities (numpy float32 ``[B, W]``), priced by ``cost``
    (checked at construction) plus ``sampled_price`` where a request samples. ``cache``: a dict the caller keeps
    (the decider's): its ``"allocation"`` entry holds the curve and each batch size's sampled price, computed once
    for as long as ``cost`` and ``sampled_price`` are the same objects, not every step."""
    probs = {**host_probs(tables, signals), **given}
    B = next(iter(probs.values())).shape[0]
    cache = {} if cache is None else cache.setdefault("allocation", {})
    held = cache.get("for")
    if held is None or held[0] is not cost or held[1] is not sampled_price:  # kept for these very objects
        cache.clear()
        raw = cost.detach().cpu().numpy()  # [T_max + 1], the curve's dtype (float32)
        cache.update({"for": (cost, sampled_price), "raw": raw, "curve": raw.astype(np.float64)})
    if sampled_price is not None and (temperatures > 0).any():  # the sampler's random path, priced per request
        key = ("price_q", B, k_max)
        if key not in cache:
            cache[key] = sampled_price_q(cache["raw"], sampled_price, B, k_max)
        return allocate_chains_host(probs, price_q=cache[key])
    return allocate_chains_host(probs, cost=cache["curve"])


def host_probs(tables, signals: dict) -> dict[str, np.ndarray]:
    """:func:`calib.allocate.api.built_probs` in numpy: float32 ``[B, L]`` per chain of numpy float32 signals
    ``[B, L, A]`` (:func:`calib.tables.layout.chain_lookup_host` where the table is on the host, else the tensor
    lookup)."""
    reuse = bool(getattr(tables, "reuse_last_row", False))
    out = {}
    for name, x in signals.items():
        table = tables.chains[name]
        host = table.host_view() if isinstance(table, ChainTable) else None  # None: the grid is on a device
        depths = host["depths"] if host is not None else table.depths
        if x.shape[1] > depths:  # the message is built only where it is raised
            _check_depths(f"signals[{name!r}]", x.shape[1], f"{name}.grid", depths, reuse)
        if host is not None and (table.read is None or table.read_host is not None):
            if x.ndim != 3 or x.shape[2] != len(table.axes):
                x = check_chain_inputs(x, table, f"signals[{name!r}]")  # [B, L] of one axis: [B, L, 1]; else raises
            out[name] = chain_lookup_host(table, x, name, checked=True)
        else:
            out[name] = table.lookup(torch.from_numpy(x), name).detach().cpu().numpy()
    return out


def torch_decision(tables, signals: dict, given: dict, cost, budget, impl: str, shape):
    """The torch paths of :func:`calib.serve.decide.decide_step` (``impl`` ``"reference"``, ``"triton"``, or budget mode): ``(drafter [B], depth [B], expected [B], chosen [B, W] or None)``
    on the CPU, ``chosen`` each request's verified prefix of its chosen chain (None where the kernel looked the
    probabilities up itself)."""
    probs = None
    if given or impl in HOST_LOOKUPS:  # the probabilities are kept: the online correction learns from them
        probs = {**calibrated_probs(tables, signals), **given} if signals else given
        out = allocate_probs(probs, cost=cost, budget=budget, impl=impl, price=shape)
    else:
        out = allocate(tables, signals, cost=cost, budget=budget, impl=impl, price=shape)
    drafter, depth = out.drafter.cpu(), out.depth.cpu()
    chosen = None
    if probs is not None:  # [B, W]: each request's verified prefix of its chosen chain
        B, depths = drafter.shape[0], depth.tolist()
        chosen = torch.full((B, max([1, *depths])), math.nan)
        by_id = {chain(n).id: p for n, p in probs.items()}
        for i, (c, d) in enumerate(zip(drafter.tolist(), depths)):
            if d:
                chosen[i, :d] = by_id[c][i, :d].to(torch.float32)
    return drafter, depth, out.expected_accepted.cpu(), chosen
