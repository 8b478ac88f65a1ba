"""Public entry points: ``allocate_probs`` (calibrated probabilities) and ``allocate`` (raw signals).

Chains are named by their registered kind (:mod:`calib.chains`): both take a mapping
``{chain name: tensor}`` of one or two chains, and ``Allocation.drafter`` reports the chosen chain's
registry id (``NO_CHAIN`` = 0: nothing verified). Each request verifies at most one chain; with two,
the lower id wins ties (the rules are in :mod:`calib.allocate.reference`).

Both return an :class:`Allocation` whose tensors stay on the input device. ``impl="reference"``
runs the torch reference (any device); ``impl="triton"`` runs the fused kernel (on CPU under the
Triton interpreter, for testing only); ``impl="host"`` runs the reference's price mode in numpy
(:mod:`calib.allocate.host`: a serving step's few requests on a CPU, where torch's per-call cost
dominates; budget mode falls back to the reference; tensors come back on the CPU). All take
bit-identical decisions.

Inputs are checked here, at the boundary, the same way for both implementations: the arguments
declaratively (:data:`ENTRY_CONSTRAINTS`, :func:`calib.params.validate_params`: ``impl`` one of
:data:`IMPLEMENTATIONS`, ``budget`` an integer ``>= 0`` or a one-element integer tensor, ``cost`` a 1-D
float tensor); shapes always (they are host metadata); values (a cost curve's entries, confidences in
``[0, 1]``, a tensor budget ``>= 0``, the requests' sampling temperatures finite and ``>= 0`` on every
table axis named ``temperature``) wherever that needs no device sync, i.e. always for the reference
and for tensors on the CPU. The Triton path never reads a CUDA tensor back (it stays capturable in a
CUDA graph), so there a cost curve is checked once at start-up with :func:`check_cost`, out-of-range
confidences are clamped, and temperatures are the caller's to check (the serving decider does,
:mod:`calib.serve.decide`). Calibrated probabilities given to :func:`allocate_probs` are clamped to
``[0, 1]`` (NaN = no token), never refused.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from calib.allocate.reference import BUDGET, COST, allocate_reference, check_cost
from calib.allocate.shape import ShapePrice
from calib.chains import ChainKind, chain, chain_names
from calib.params import Options, validate_params
from calib.tables.layout import AcceptanceTables, check_chain_inputs, check_confidences

IMPLEMENTATIONS = ("reference", "triton", "host")
MAX_CHAINS = 2  # chains one step chooses between (see calib.allocate.reference)
TEMPERATURE = "temperature"  # the context axis holding each request's sampling temperature (calib.chains.CONTEXT)


# The arguments of allocate / allocate_probs (and plan_draft's cost), checked with validate_params.
ENTRY_CONSTRAINTS = {"impl": [Options(IMPLEMENTATIONS)], "budget": BUDGET, "cost": COST}


@dataclass(frozen=True)
class Allocation:
    """Per-request verification decision for one engine step.

    Attributes:
        drafter: int8 [B]; the registry id of the chain to verify (:mod:`calib.chains`: 1 = model,
            2 = n-gram, ...), ``NO_CHAIN`` = 0 = verify nothing.
        depth: int32 [B]; number of draft tokens of that chain to verify (0 iff drafter is 0).
        expected_accepted: float32 [B]; sum over the verified depths of the chain's survival
            ``S_k = prod_{j<=k} p_j``, i.e. the expected number of accepted draft tokens.
    """

    drafter: torch.Tensor
    depth: torch.Tensor
    expected_accepted: torch.Tensor


def allocate_probs(
    probs: Mapping[str, torch.Tensor],
    *,
    budget: int | torch.Tensor | None = None,
    cost: torch.Tensor | None = None,
    impl: str = "reference",
    price: ShapePrice | None = None,
) -> Allocation:
    """Allocate verification from already-calibrated conditional acceptance probabilities.

    Args:
        probs: ``{chain name: float [B, K_c]}``, one or two registered chains;
            ``P(accept depth k | depth k reached)``, NaN where there is no token (a chain ends at its
            first NaN).
        budget: total draft tokens for the batch, ``>= 0`` (int or 0-d integer tensor; a device
            tensor keeps the call free of host synchronisation and capturable in a CUDA graph, and its
            value is then not checked on the Triton path).
        cost: 1-D float tensor, ``cost[T]`` = cost of a verify pass with ``T = B + sum(depth)``
            positions; see :func:`check_cost` for what a curve must hold (at least ``B + 1``
            entries, positive, +inf = a total the engine cannot run; entries below ``B`` unused).
            Totals beyond ``len(cost) - 1`` are infeasible.
        impl: "reference" or "triton".
        price: a :class:`calib.allocate.ShapePrice` (shape-aware price mode, :mod:`calib.allocate.shape`):
            the step costs ``price.base + sum_i price.table[i, depth_i]``, e.g. an MoE target's expert
            reads (``calib.cost.moe.MoECost.tangent_price``); exact goodput rule, one or two chains;
            ``impl="host"`` runs its numpy twin (:func:`calib.allocate.host.allocate_shape_host`).

    Exactly one of ``budget``, ``cost`` and ``price`` must be given. See :mod:`calib.allocate.reference`
    for the decision rules.
    """
    if price is not None:
        return _allocate_shaped(probs, price, budget, cost, impl)
    check_mode(budget, cost, impl, "allocate_probs")
    first, second, ids, n_requests = _checked_chains(probs)
    if cost is not None and _host_readable(cost, impl):
        check_cost(cost, n_requests)
    if n_requests == 0:
        return _empty(first.device)
    if impl == "host" and budget is None:
        from calib.allocate.host import allocate_host

        return Allocation(*allocate_host(first, second, cost, ids=ids))
    if impl in ("reference", "host"):
        return Allocation(*allocate_reference(first, second, budget=budget, cost=cost, ids=ids))
    if impl == "triton":
        from calib.allocate.triton_kernels import allocate_triton  # triton is imported lazily

        return Allocation(*allocate_triton(first, second, budget=budget, cost=cost, ids=ids))
    raise ValueError(f"impl must be one of {IMPLEMENTATIONS}, got {impl!r}")


def _checked_chains(probs: Mapping[str, torch.Tensor]):
    """``probs`` checked (registered chains, probabilities in [0, 1] or NaN, one batch size) as the rules take
    them: ``(first [B, K_1], second [B, K_2] or None, (first id, second id), B)``, chains in registry order."""
    kinds = chain_kinds_of(probs, "probs")
    for kind in kinds:
        check_probs(probs[kind.name], kind.name)
    second = probs[kinds[1].name] if len(kinds) > 1 else None
    return probs[kinds[0].name], second, (kinds[0].id, kinds[-1].id), batch_size_of(probs, kinds)


def allocate(
    tables: AcceptanceTables,
    signals: Mapping[str, torch.Tensor],
    *,
    budget: int | torch.Tensor | None = None,
    cost: torch.Tensor | None = None,
    impl: str = "reference",
    price: ShapePrice | None = None,
) -> Allocation:
    """Allocate verification from raw engine signals through calibrated ``tables``.

    Args:
        tables: any :class:`~calib.tables.layout.AcceptanceTables`.
        signals: ``{chain name: float [B, L, A]}`` for one or two chains the tables calibrate: per
            depth, the chain's ``A`` table inputs in the tables' order (``tables.chains[name].axes``;
            a one-axis chain such as the model chain may pass ``[B, K]`` raw confidences in [0, 1]).
            Feature 0 NaN = no token at that depth. ``A`` must be the table's; the depth may not
            exceed the table's rows ``D`` unless the tables say that their last row stands for deeper
            depths (``tables.reuse_last_row``).
        budget, cost, impl, price: as in :func:`allocate_probs` (with ``price`` the tables are read by the
            reference lookup, then the shape kernel runs on the probabilities).

    Input that does not match the tables is a ``ValueError`` naming both sides; so is a request whose
    sampling temperature (on a table axis named ``temperature``) is NaN, infinite or negative.
    """
    if price is not None:
        return allocate_probs(calibrated_probs(tables, signals), price=price, budget=budget, cost=cost, impl=impl)
    check_mode(budget, cost, impl, "allocate")
    kinds = chain_kinds_of(signals, "signals")
    checked = _checked_signals(tables, signals, kinds, impl)
    n_requests = batch_size_of(checked, kinds)
    if cost is not None and _host_readable(cost, impl):
        check_cost(cost, n_requests)
    first = checked[kinds[0].name]
    if n_requests == 0:
        return _empty(first.device)
    ids = (kinds[0].id, kinds[-1].id)
    if impl in ("reference", "host"):
        p = {k.name: tables.chains[k.name].lookup(checked[k.name], k.name) for k in kinds}
        return allocate_probs(p, budget=budget, cost=cost, impl=impl)
    if impl == "triton":
        from calib.allocate.triton_kernels import allocate_triton

        second = checked[kinds[1].name] if len(kinds) > 1 else None
        return Allocation(*allocate_triton(first, second, budget=budget, cost=cost, ids=ids,
                                           tables=[tables.chains[k.name] for k in kinds]))
    raise ValueError(f"impl must be one of {IMPLEMENTATIONS}, got {impl!r}")


def _allocate_shaped(probs, price, budget, cost, impl: str) -> Allocation:
    """:func:`allocate_probs` in shape-aware price mode (:mod:`calib.allocate.shape`)."""
    from calib.allocate.shape import allocate_shape_reference, check_price, quantized

    if budget is not None or cost is not None:
        raise ValueError("give exactly one of `budget` (token budget), `cost` (verify-cost curve) and `price` "
                         "(shape-aware price)")
    validate_params("allocate_probs", {"impl": impl}, {"impl": ENTRY_CONSTRAINTS["impl"]})
    first, second, ids, n_requests = _checked_chains(probs)
    check_price(price, n_requests)
    if n_requests == 0:
        return _empty(first.device)
    if impl == "triton":
        from calib.allocate.shape_triton import allocate_shape_triton

        width = max(first.shape[1], 0 if second is None else second.shape[1], 1)
        return Allocation(*allocate_shape_triton(first, second, quantized(price, n_requests, width, first.device),
                                                 ids=ids))
    if impl == "host":
        from calib.allocate.host import allocate_shape_host

        return Allocation(*allocate_shape_host(first, second, price, ids=ids))
    return Allocation(*allocate_shape_reference(first, second, price, ids=ids))


def calibrated_probs(tables: AcceptanceTables, signals: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``{chain name: float32 [B, L]}`` calibrated P(accept | reached) per depth from raw ``signals``
    (as :func:`allocate` takes them, checked the same way; NaN where there is no token): what
    :func:`allocate` feeds :func:`allocate_probs`, for a caller that reuses or combines them (an engine
    that prices a plan before drafting and decides after it). Reference lookup."""
    kinds = chain_kinds_of(signals, "signals")
    checked = _checked_signals(tables, signals, kinds, "reference")
    return {k.name: tables.chains[k.name].lookup(checked[k.name], k.name) for k in kinds}


def built_probs(tables: AcceptanceTables, signals: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """:func:`calibrated_probs` of signals the caller built itself from inputs it checked (the serving decider:
    float32 ``[B, L, A]`` in the tables' axis order, temperatures checked once per step), so only what they
    cannot vouch for is checked here (a depth beyond the table); the lookup checks a confidence's range."""
    reuse = bool(getattr(tables, "reuse_last_row", False))
    out = {}
    for name, x in signals.items():
        table = tables.chains[name]
        _check_depths(f"signals[{name!r}]", x.shape[1], f"{name}.grid", table.depths, reuse)
        out[name] = table.lookup(x, name)
    return out


def _checked_signals(tables, signals, kinds, impl: str) -> dict[str, torch.Tensor]:
    reuse = bool(getattr(tables, "reuse_last_row", False))
    checked = {}
    for kind in kinds:
        name = kind.name
        if name not in tables.chains:
            raise ValueError(f"signals name the {name} chain, but the tables calibrate {sorted(tables.chains)}")
        table = tables.chains[name]
        x = signals[name]
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            raise ValueError(f"signals[{name!r}] must be a float tensor, got {type(x).__name__} "
                             f"{getattr(x, 'dtype', '')}".rstrip())
        x = check_chain_inputs(x, table, f"signals[{name!r}]")
        _check_depths(f"signals[{name!r}]", x.shape[1], f"{name}.grid", table.depths, reuse)
        if _host_readable(x, impl):
            if table.interpolated:
                check_confidences(x[..., 0], f"signals[{name!r}]")
            _check_temperatures(x, table, f"signals[{name!r}]")
        checked[name] = x
    return checked


def chain_kinds_of(mapping, what: str) -> list[ChainKind]:
    """The registered chain kinds ``mapping`` names, by registry id (the allocator's tie order)."""
    if not isinstance(mapping, Mapping) or not mapping:
        raise ValueError(f"`{what}` must be a non-empty mapping {{chain name: tensor}} over the registered "
                         f"chains {list(chain_names())}, got {type(mapping).__name__}")
    try:
        kinds = sorted((chain(name) for name in mapping), key=lambda k: k.id)
    except KeyError as err:
        raise ValueError(f"`{what}`: {err.args[0]}") from None
    if len(kinds) > MAX_CHAINS:
        raise ValueError(f"`{what}` names {[k.name for k in kinds]}: a step chooses between at most "
                         f"{MAX_CHAINS} chains per request (see calib.allocate.reference)")
    return kinds


def batch_size_of(mapping, kinds) -> int:
    sizes = {k.name: mapping[k.name].shape[0] for k in kinds}
    if len(set(sizes.values())) > 1:
        raise ValueError(f"the chains have different batch sizes B: {sizes}")
    return next(iter(sizes.values()))


def _host_readable(x: torch.Tensor, impl: str) -> bool:
    """Whether a value check of ``x`` costs no device sync on this path (see the module docstring)."""
    return impl in ("reference", "host") or x.device.type == "cpu"


def check_mode(budget, cost, impl: str, owner: str = "allocate") -> None:
    """The entry arguments (:data:`ENTRY_CONSTRAINTS`), exactly one of ``budget`` and ``cost``, and a
    tensor budget's value where reading it costs no device sync (the reference reads it anyway)."""
    validate_params(owner, {"impl": impl, "budget": budget, "cost": cost}, ENTRY_CONSTRAINTS)
    if (budget is None) == (cost is None):
        raise ValueError("give exactly one of `budget` (token budget) and `cost` (verify-cost curve)")
    if isinstance(budget, torch.Tensor) and _host_readable(budget, impl) and int(budget) < 0:
        raise ValueError(f"{owner}: parameter budget=tensor({int(budget)}) is invalid; it must be >= 0 (draft "
                         "tokens for the batch)")


def _check_temperatures(x: torch.Tensor, table, name: str) -> None:
    """Refuse a request whose sampling temperature (the table's ``temperature`` axis of ``x [B, L, A]``)
    is NaN, infinite or negative where it has a token: the lookup would silently read an end bin.
    One fused check per axis; the first bad request is named with its value."""
    for j, axis in enumerate(table.axes):
        if axis.name != TEMPERATURE:
            continue
        t = x[..., j]
        bad = ~((t >= 0) & (t < math.inf))
        if j:
            bad &= ~torch.isnan(x[..., 0])  # no token at that depth: nothing is looked up
        if bool(bad.any()):
            i, k = (int(v) for v in bad.nonzero()[0])
            raise ValueError(f"{name}[{i}, {k}, {j}] = {float(t[i, k])!r}: request {i}'s sampling temperature "
                             f"(the tables' {TEMPERATURE!r} axis) must be a finite number >= 0 (0 = greedy); a NaN or "
                             "negative one would silently be read from an end bin of the tables")


def check_probs(x: torch.Tensor, name: str) -> None:
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
