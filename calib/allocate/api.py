"""Public entry points: ``allocate_probs`` (calibrated probabilities) and ``allocate`` (raw signals).

Both return an :class:`Allocation` whose tensors stay on the input device. ``impl="reference"``
runs the torch reference (any device); ``impl="triton"`` runs the fused kernel (on CPU under the
Triton interpreter, for testing only). Both take bit-identical decisions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from calib.allocate.reference import allocate_reference
from calib.allocate.tables import AcceptanceTables

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
            positions (index 0 unused); totals beyond ``len(cost) - 1`` are infeasible.
        impl: "reference" or "triton".

    Exactly one of ``budget`` and ``cost`` must be given. See :mod:`calib.allocate.reference`
    for the decision rules.
    """
    _check_mode(budget, cost)
    _check_probs(model_p, "model_p")
    if ngram_p is not None:
        _check_probs(ngram_p, "ngram_p")
        if ngram_p.shape[0] != model_p.shape[0]:
            raise ValueError(f"model_p has {model_p.shape[0]} requests, ngram_p {ngram_p.shape[0]}")
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
        model_conf: float [B, K]; the drafter's probability of each proposed token, NaN = none.
        ngram_features: float [B, L, F] n-gram match features in the tables' order (feature 0 NaN
            = no token at that depth), or None.
        budget, cost, impl: as in :func:`allocate_probs`.
    """
    _check_mode(budget, cost)
    _check_probs(model_conf, "model_conf")
    if ngram_features is not None and (
        ngram_features.ndim != 3 or ngram_features.shape[0] != model_conf.shape[0]
    ):
        raise ValueError(f"ngram_features must be [B, L, F], got {tuple(ngram_features.shape)}")
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


def _check_mode(budget, cost) -> None:
    if (budget is None) == (cost is None):
        raise ValueError("give exactly one of `budget` (token budget) and `cost` (verify-cost curve)")
    if cost is not None and (cost.ndim != 1 or cost.numel() < 1 or not cost.is_floating_point()):
        raise ValueError("`cost` must be a non-empty 1-D float tensor indexed by total positions")


def _check_probs(x: torch.Tensor, name: str) -> None:
    if x.ndim != 2:
        raise ValueError(f"{name} must be [B, K], got {tuple(x.shape)}")


def _empty(device: torch.device) -> Allocation:
    return Allocation(
        torch.zeros(0, dtype=torch.int8, device=device),
        torch.zeros(0, dtype=torch.int32, device=device),
        torch.zeros(0, dtype=torch.float32, device=device),
    )
