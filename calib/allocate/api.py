"""Public entry points: ``allocate_probs`` (calibrated probabilities) and ``allocate`` (raw signals).

Both return an :class:`Allocation` whose tensors stay on the input device. ``impl="reference"``
runs the torch reference (any device); ``impl="triton"`` runs the fused kernel (on CPU under the
Triton interpreter, for testing only). Both take bit-identical decisions.

Inputs are checked here, at the boundary, the same way for both implementations: shapes always
(they are host metadata); values (a cost curve's entries, confidences in ``[0, 1]``) wherever that
needs no device sync, i.e. always for the reference and for tensors on the CPU. The Triton path
never reads a CUDA tensor back (it stays capturable in a CUDA graph), so there a cost curve is
checked once at start-up with :func:`check_cost`, and out-of-range confidences are clamped.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch

from calib.allocate.reference import allocate_reference
from calib.allocate.tables import AcceptanceTables
from calib.tables.layout import check_confidences, check_ngram_features

IMPLEMENTATIONS = ("reference", "triton")


@dataclass(frozen=True)
class Allocation:
    """Per-request verification decision for one engine step.

    Attributes:
        drafter: int8 [B]; 0 = verify nothing, 1 = the model draft chain, 2 = the n-gram chain.
        depth: int32 [B]; number of draft tokens of that chain to verify (0 iff drafter is 0).
        expected_accepted: float32 [B]; sum over the verified depths of the chain's survival
            ``S_k = prod_{j<=k} p_j``, i.e. the expected number of accepted draft tokens.
    """

    drafter: torch.Tensor
    depth: torch.Tensor
    expected_accepted: torch.Tensor


def allocate_probs(
    model_p: torch.Tensor,
    ngram_p: torch.Tensor | None = None,
    *,
    budget: int | torch.Tensor | None = None,
    cost: torch.Tensor | None = None,
    impl: str = "reference",
) -> Allocation:
    """Allocate verification from already-calibrated conditional acceptance probabilities.

    Args:
        model_p: float [B, K]; ``P(accept depth k | depth k reached)`` for the model chain,
            NaN where there is no token (a chain ends at its first NaN).
        ngram_p: float [B, L] for the n-gram chain, or None when there is no second drafter.
        budget: total draft tokens for the batch (int or 0-d integer tensor; a device tensor keeps
            the call free of host synchronisation and capturable in a CUDA graph).
        cost: 1-D float tensor, ``cost[T]`` = cost of a verify pass with ``T = B + sum(depth)``
            positions; see :func:`check_cost` for what a curve must hold (at least ``B + 1``
            entries, positive, +inf = a total the engine cannot run; entries below ``B`` unused).
            Totals beyond ``len(cost) - 1`` are infeasible.
        impl: "reference" or "triton".

    Exactly one of ``budget`` and ``cost`` must be given. See :mod:`calib.allocate.reference`
    for the decision rules.
    """
    _check_mode(budget, cost, impl)
    _check_probs(model_p, "model_p")
    if ngram_p is not None:
        _check_probs(ngram_p, "ngram_p")
        if ngram_p.shape[0] != model_p.shape[0]:
            raise ValueError(f"model_p has {model_p.shape[0]} requests, ngram_p {ngram_p.shape[0]}")
    if cost is not None and _host_readable(cost, impl):
        check_cost(cost, model_p.shape[0])
    if model_p.shape[0] == 0:
        return _empty(model_p.device)
    if impl == "reference":
        return Allocation(*allocate_reference(model_p, ngram_p, budget=budget, cost=cost))
    if impl == "triton":
        from calib.allocate.triton_kernels import allocate_triton  # triton is imported lazily

        return Allocation(*allocate_triton(model_p, ngram_p, budget=budget, cost=cost))
    raise ValueError(f"impl must be one of {IMPLEMENTATIONS}, got {impl!r}")


def allocate(
    tables: AcceptanceTables,
    model_conf: torch.Tensor,
    ngram_features: torch.Tensor | None = None,
    *,
    budget: int | torch.Tensor | None = None,
    cost: torch.Tensor | None = None,
    impl: str = "reference",
) -> Allocation:
    """Allocate verification from raw engine signals through calibrated ``tables``.

    Args:
        tables: any :class:`~calib.allocate.tables.AcceptanceTables`.
        model_conf: float [B, K]; the drafter's probability of each proposed token (in [0, 1]),
            NaN = none. ``K`` may not exceed the tables' model depths ``D`` unless the tables say
            that their last row stands for deeper depths (``tables.reuse_last_row``).
        ngram_features: float [B, L, F] n-gram match features in the tables' order (feature 0 NaN
            = no token at that depth), or None. ``F`` must be the tables' feature count; ``L`` may
            not exceed the tables' n-gram depths unless ``tables.reuse_last_row``.
        budget, cost, impl: as in :func:`allocate_probs`.

    Input that does not match the tables is a ``ValueError`` naming both sides.
    """
    _check_mode(budget, cost, impl)
    _check_probs(model_conf, "model_conf")
    reuse = bool(getattr(tables, "reuse_last_row", False))
    _check_depths("model_conf", model_conf.shape[1], "model_grid", tables.model_grid.shape[0], reuse)
    if _host_readable(model_conf, impl):
        check_confidences(model_conf, "model_conf")
    if ngram_features is not None:
        check_ngram_features(ngram_features, tables.ngram_edges.shape[0])
        if ngram_features.shape[0] != model_conf.shape[0]:
            raise ValueError(f"model_conf has B={model_conf.shape[0]} requests, ngram_features "
                             f"B={ngram_features.shape[0]}")
        _check_depths("ngram_features", ngram_features.shape[1], "ngram_grid", tables.ngram_grid.shape[0],
                      reuse)
    if cost is not None and _host_readable(cost, impl):
        check_cost(cost, model_conf.shape[0])
    if model_conf.shape[0] == 0:
        return _empty(model_conf.device)
    if impl == "reference":
        model_p = tables.model_accept_prob(model_conf)
        ngram_p = None if ngram_features is None else tables.ngram_accept_prob(ngram_features)
        return Allocation(*allocate_reference(model_p, ngram_p, budget=budget, cost=cost))
    if impl == "triton":
        from calib.allocate.triton_kernels import allocate_triton

        return Allocation(
            *allocate_triton(model_conf, ngram_features, budget=budget, cost=cost, tables=tables)
        )
    raise ValueError(f"impl must be one of {IMPLEMENTATIONS}, got {impl!r}")


def check_cost(cost: torch.Tensor, n_requests: int) -> None:
    """Refuse a price-mode cost curve the goodput rule cannot use, naming the entry and why.

    ``cost[T]`` prices a verify pass over ``T`` positions; a step verifies ``T = B + sum(depth)``
    with ``B = n_requests`` bonus positions, so (the reference's feasibility rule):

    * it needs at least ``B + 1`` entries: with fewer, even the pass without draft tokens has no
      price and every request would silently verify nothing;
    * ``cost[B]`` (no draft token) must be finite and positive;
    * every later entry must be positive; ``+inf`` marks a total the engine cannot run (as does
      the end of the curve). Zero, negative and NaN entries are errors.

    Entries below ``B`` are never read and not checked. Reads the tensor on the host.
    """
    if not isinstance(cost, torch.Tensor) or cost.ndim != 1 or not cost.is_floating_point():
        raise ValueError("`cost` must be a 1-D float tensor indexed by total positions T, got "
                         f"{type(cost).__name__}{tuple(getattr(cost, 'shape', ()))}")
    if cost.numel() < n_requests + 1:
        raise ValueError(f"`cost` has {cost.numel()} entries (T = 0..{cost.numel() - 1}) but a batch of "
                         f"B={n_requests} requests needs at least B + 1 = {n_requests + 1}: cost[T] prices "
                         f"a verify pass over T = B + sum(depth) positions, and cost[{n_requests}] (no draft "
                         "token) is the least it reads")
    used = cost[n_requests:].to(torch.float64).cpu()
    first = float(used[0])
    if not (math.isfinite(first) and first > 0):
        raise ValueError(f"cost[{n_requests}] = {first!r}: the verify pass without draft tokens (T = B = "
                         f"{n_requests}) must have a finite positive cost")
    bad = torch.isnan(used) | (used <= 0)
    if bool(bad.any()):
        t = int(bad.nonzero()[0, 0]) + n_requests
        raise ValueError(f"cost[{t}] = {float(cost[t])!r}: verify costs must be positive (+inf marks a "
                         "total the engine cannot run); zero, negative and NaN entries are errors")


def _host_readable(x: torch.Tensor, impl: str) -> bool:
    """Whether a value check of ``x`` costs no device sync on this path (see the module docstring)."""
    return impl == "reference" or x.device.type == "cpu"


def _check_mode(budget, cost, impl: str) -> None:
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"impl must be one of {IMPLEMENTATIONS}, got {impl!r}")
    if (budget is None) == (cost is None):
        raise ValueError("give exactly one of `budget` (token budget) and `cost` (verify-cost curve)")
    if budget is not None:
        if isinstance(budget, torch.Tensor):
            if budget.numel() != 1 or budget.dtype.is_floating_point or budget.dtype == torch.bool:
                raise ValueError(f"`budget` tensor must hold one integer, got dtype {budget.dtype} "
                                 f"shape {tuple(budget.shape)}")
        elif isinstance(budget, bool) or not isinstance(budget, numbers.Integral):
            raise ValueError(f"`budget` must be an int or a one-element integer tensor, got {budget!r}")
    if cost is not None and (not isinstance(cost, torch.Tensor) or cost.ndim != 1 or cost.numel() < 1
                             or not cost.is_floating_point()):
        raise ValueError("`cost` must be a non-empty 1-D float tensor indexed by total positions")


def _check_probs(x: torch.Tensor, name: str) -> None:
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise ValueError(f"{name} must be a float tensor, got {type(x).__name__} "
                         f"{getattr(x, 'dtype', '')}".rstrip())
    if x.ndim != 2:
        raise ValueError(f"{name} must be [B, K], got {tuple(x.shape)}")


def _check_depths(name: str, width: int, table: str, n_depths: int, reuse_last_row: bool) -> None:
    if width > n_depths and not reuse_last_row:
        raise ValueError(f"{name} has {width} depths but the tables' {table} has rows for depths "
                         f"0..{n_depths - 1} only (D={n_depths}); draft at most {n_depths} tokens, use "
                         "tables fitted on the deeper depths, or, if their last row stands for every "
                         "deeper depth, tables with reuse_last_row=True")


def _empty(device: torch.device) -> Allocation:
    return Allocation(
        torch.zeros(0, dtype=torch.int8, device=device),
        torch.zeros(0, dtype=torch.int32, device=device),
        torch.zeros(0, dtype=torch.float32, device=device),
    )
