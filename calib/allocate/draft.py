"""Draft-aware allocation: decide *before* each model draft pass whether it pays.

The allocator (:mod:`calib.allocate.reference`) decides what to verify once every chain is drafted.
A model drafter costs one forward pass per drafted depth, so a policy that always drafts K tokens
and then verifies fewer has paid for passes it did not use. :func:`plan_draft` decides while
drafting, from what is known before the next pass:

* ``known``: the calibrated P(accept | reached) of the model tokens drafted so far
  (``[B, passes_done]``, NaN where a request's chain ended) and of any chain that costs no model pass
  (the n-gram chain: known in full before the model drafts);
* ``forecast``: the tables' forecast of the model chain's later depths for each request
  (``[B, K]``, :func:`calib.allocate.forecast.forecast_probs`: the calibrated acceptance the tables
  expect at each depth in the request's context cell, before its confidence is known);
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

import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

from calib.allocate.api import (
    IMPLEMENTATIONS,
    allocate_probs,
    batch_size_of,
    chain_kinds_of,
    check_mode,
    check_probs,
)
from calib.allocate.compiled import plan_kernel
from calib.allocate.reference import SCALE, survival
from calib.params import Interval, Options, validate_params

# plan_draft's scalar arguments (``chain``: a registered chain name, checked against the registry per call).
PLAN_CONSTRAINTS = {
    "pass_cost": [Interval(numbers.Real, 0, None)],
    "sunk": [Interval(numbers.Real, 0, None)],
    "impl": [Options(IMPLEMENTATIONS)],
}


@dataclass(frozen=True)
class DraftPlan:
    """The decision before one model draft pass.

    Attributes:
        run_pass: whether to run the next draft pass (False: stop drafting and verify what is known).
        drafting: bool [B]; the requests the best plan verifies deeper than ``passes_done`` on the
            model chain (the ones the next pass drafts for; all False when ``run_pass`` is False).
        passes: total passes of the best plan (``passes_done`` when stopping).
        goodput: float; the best plan's expected goodput in tokens per cost unit.
        free_depth: int64 [B]; the depth the best plan verifies on the free chain (the other chain of
            ``known``), None without one. When the plan stops before the first pass, the model drafts
            nothing and this is the step's allocation: the allocator on the free chain alone decides
            the same (an engine need not allocate again).
    """

    run_pass: bool
    drafting: torch.Tensor  # bool [B]
    passes: int
    goodput: float
    free_depth: torch.Tensor | None = None  # int64 [B]


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

    With the reference allocator on CPU tensors all ``K - passes_done + 1`` plans are scored in one call: compiled
    (:mod:`calib.allocate.compiled`, where numba is installed) or vectorised (:func:`_plan_all`, the
    reference's price rule over the plans on exact integer gains); the answer is identical to allocating each
    plan in turn (:func:`_plan_draft_loop`, the Triton path and the fallback for anything unusual).
    """
    done_p, B, done, K = _check_plan(known, forecast, chain, pass_cost, sunk, impl)
    kwargs = {"cost": cost, "pass_cost": pass_cost, "sunk": sunk, "chain": chain, "impl": impl}
    tensors = [*known.values(), forecast, cost]
    if impl != "reference" or B == 0 or not all(isinstance(t, torch.Tensor) and t.device.type == "cpu"
                                                and not t.requires_grad for t in tensors):
        return _plan_draft_loop(known, forecast, **kwargs)
    # float64 whatever types sunk and pass_cost arrive as: the compiled plan was warmed on float64 (a float32 array
    # here compiled a second specialisation inside the first serving step, ~1.5 s)
    extras = [float(sunk + (g - done) * pass_cost) for g in range(done, K + 1)]
    try:
        p, other, chain_first, cost64 = _plan_inputs(known, forecast, cost, chain, done_p, extras, impl)
    except Exception:  # noqa: BLE001 - anything the loop would refuse: it raises what allocate_probs does
        return _plan_draft_loop(known, forecast, **kwargs)
    kernel = plan_kernel()  # compiled (numba): the same rule in microseconds; else the vectorised plan
    if kernel is not None:
        free_p = np.zeros((B, 0), dtype=np.float32) if other is None else np.ascontiguousarray(other)
        value, _, depth, free = kernel(np.ascontiguousarray(p), free_p, other is not None, chain_first, done,
                                       np.ascontiguousarray(cost64), np.array(extras, dtype=np.float64))
        free = None if other is None else free
    else:
        value, _, depth, free = _plan_all(p, other, chain_first=chain_first, done=done, cost=cost64,
                                          extras=np.array(extras, dtype=np.float64))
    drafting = depth > done
    run = bool(drafting.any())
    drafting = torch.from_numpy(drafting) if run else torch.zeros(B, dtype=torch.bool)
    free = None if free is None else torch.from_numpy(free.astype(np.int64))
    return DraftPlan(run, drafting, int(depth.max()) if run else done, value, free)


def plan_first_pass_host(forecast: np.ndarray, free: np.ndarray | None, *, cost: np.ndarray, pass_cost: float,
                         chain_first: bool) -> tuple[int, np.ndarray | None] | None:
    """:func:`plan_draft` before the first pass (nothing drafted yet, nothing sunk) on numpy arrays, as serving's plan
    of draft passes makes it every step: ``forecast`` float32 ``[B, K]`` of the model chain, ``free`` float32
    ``[B, L]`` of the chain known in full (None: none), the curve ``cost`` float64 ``[T]`` (checked once by the
    caller: :func:`calib.allocate.check_cost`), ``chain_first``: the model chain has the lower registry id. Returns
    ``(passes, free_depth int64 [B] or None)``, :class:`DraftPlan`'s ``passes`` and ``free_depth``, in one compiled
    call and no torch call (tests/allocate/test_draft.py: the same plans as :func:`plan_draft`); None where numba is
    not installed or anything is unusual (a price :func:`plan_draft` would refuse, an empty batch): call it then."""
    kernel = plan_kernel()
    B, K = forecast.shape
    if kernel is None or B == 0 or (free is not None and free.shape[0] != B) or not _plain_price(pass_cost):
        return None
    extras = np.array([float(g * pass_cost) for g in range(K + 1)], dtype=np.float64)
    if not (cost.shape[0] > B and 0 < cost[B] < math.inf and math.isfinite(cost[B] + extras[-1])) or not (
            cost[B:] > 0).all():  # _plan_inputs' conditions on the curve (plan_draft refuses, naming it)
        return None
    other = np.zeros((B, 0), dtype=np.float32) if free is None else np.ascontiguousarray(free, dtype=np.float32)
    _, _, depth, free_depth = kernel(np.ascontiguousarray(forecast, dtype=np.float32), other, free is not None,
                                     chain_first, 0, cost, extras)
    return (int(depth.max()) if depth.any() else 0), (None if free is None else free_depth)


def _plan_inputs(known: Mapping[str, torch.Tensor], forecast: torch.Tensor, cost: torch.Tensor, chain: str,
                 done_p: torch.Tensor, extras: list[float], impl: str):
    """:func:`_plan_all`'s inputs ``(p [B, K], other [B, L] or None, chain_first, cost float64 [T])``, after
    allocate_probs's checks of the first plan (g = done), on the same chains, shapes and dtypes. They
    pass for every later plan too: its curve entries are these plus a larger extra, still > 0 (or
    still +inf), unless cost[B] overflows, which is refused here (the loop reports it). Raises
    whatever check fails."""
    B, done = done_p.shape
    others = {n: x for n, x in known.items() if n != chain}
    done_p = done_p.to(torch.float32)
    probs = {chain: done_p, **others}
    cost64 = cost.to(torch.float64)
    if not (impl in IMPLEMENTATIONS and cost64.ndim == 1 and cost64.numel() >= 1):  # else check_mode passes
        check_mode(None, cost64, impl)
    kinds = chain_kinds_of(probs, "probs")
    for kind in kinds:
        check_probs(probs[kind.name], kind.name)
    batch_size_of(probs, kinds)
    cost64 = cost64.numpy()
    priced = cost64[B:] + extras[0]  # check_cost's conditions on the curve of plan g = done
    if not (priced.size and np.isfinite(priced[0]) and (priced > 0).all() and np.isfinite(cost64[B] + extras[-1])):
        raise ValueError("a cost check fails")
    other = next(iter(others.values()), None)
    other = None if other is None else other.to(torch.float32).numpy()
    # Plan g's chain is p's first g columns (the loop's): survival is a running product along a row,
    # so its gains are those of p's first g columns.
    p = forecast[:, done:].to(torch.float32).numpy()
    if done:
        done_np = done_p.numpy()
        ended = np.isnan(done_np).any(axis=1, keepdims=True)
        p = np.concatenate([done_np, np.where(ended, np.float32(np.nan), p)], axis=1)
    return p, other, kinds[0].name == chain, cost64


def _plan_all(p: np.ndarray, other: np.ndarray | None, *, chain_first: bool, done: int, cost: np.ndarray,
              extras: np.ndarray) -> tuple[float, int, np.ndarray, np.ndarray | None]:
    """Every plan ``g = done..K`` at once: the reference price rule (one chain, or two:
    :func:`calib.allocate.reference._two_chain_price`) on the planned chain's first ``g`` columns of
    ``p [B, K]`` (with ``other [B, L]``, the free chain; ``chain_first``: the planned chain has the
    lower registry id) priced ``cost + extras[g - done]``, then :func:`_plan_value`'s goodput.

    Returns ``(value, g, depth, free)`` of the best plan (first maximum: the fewest passes), ``depth``
    its verified depth on the planned chain per request (int64 [B]), ``free`` on the free chain (None
    without one).

    Exactness. The reference pads both chains to one width with NaN (zero gains); a zero gain is
    never allocated, is never above a slot price (always a positive gain, or ``SCALE + 1``), adds
    nothing to a surplus, and its prefixes are infeasible, so widths do not change a decision. Every
    sorted gain list the reference builds (a chain alone, the chosen chains) is here one sort of all
    positive gains with the entries a plan does not hold skipped (:func:`_best_prefixes`).
    Goodputs are the reference's float64 divisions of the same exact integers by the same prices, and
    maxima are first maxima in the same order, so every decision is the reference's.
    """
    B, K = p.shape
    gs = np.arange(done, K + 1)
    base = B * SCALE
    qm, qo = _plan_gains(p, other)
    price = _slot_prices(cost, B, max(qm.shape[1], 0 if qo is None else qo.shape[1]))
    v, mine, req, held = _sorted_gains(qm, qo, gs)
    alone = _best_prefixes(v, held & mine, price, extras, base)  # the planned chain alone
    q_plan = np.where(np.arange(qm.shape[1])[None, None, :] < gs[:, None, None], qm[None], 0)  # [G, B, K]

    if qo is None:
        m, total, threshold, _ = alone
        values = (total / SCALE) / (price[m] + extras)
        best = int(values.argmax())
        return float(values[best]), int(gs[best]), _take_top(q_plan[best], threshold[best], m[best]), None
    return _plan_two_chains(v, mine, req, held, alone, q_plan, qo, price, extras, gs, base, chain_first)


def _plan_gains(p: np.ndarray, other: np.ndarray | None) -> tuple[np.ndarray, np.ndarray | None]:
    """Fixed-point gains of the planned chain ``p [B, K]`` and of the free chain ``other [B, L]`` (None:
    none): int64 ``[B, max(K, 1)]`` and ``[B, max(L, 1)]``, both from one pass as the reference takes it."""
    B, K = p.shape
    if other is None:
        return _gains(p), None  # [B, K or 1]
    # one pass over both chains (NaN padding: zero gains), as the reference
    stacked = np.full((2 * B, max(K, other.shape[1])), np.float32(np.nan), dtype=np.float32)
    stacked[:B, :K], stacked[B:, : other.shape[1]] = p, other
    q_both = _gains(stacked)
    return q_both[:B, : max(K, 1)], q_both[B:, : max(other.shape[1], 1)]


def _slot_prices(cost: np.ndarray, B: int, W: int) -> np.ndarray:
    """``price[m] = cost[B + m]`` for ``m <= B W`` (the reference's most slots; NaN: no entry) [B W + 1]."""
    size = B * W
    available = cost[B : B + size + 1]
    price = np.full(size + 1, np.nan)
    price[: available.size] = available
    return price


def _sorted_gains(qm: np.ndarray, qo: np.ndarray | None, gs: np.ndarray) -> tuple:
    """Every positive gain of both chains, sorted non-increasing once: ``(v [E], mine [E], req [E],
    held [G, E])``: its value, whether it is the planned chain's, its request, and whether plan ``g``
    (of ``gs``) holds it (every free-chain entry; a planned-chain entry at a column below ``g``)."""
    chains = [qm] if qo is None else [qm, qo]
    flat = np.concatenate([q.ravel() for q in chains])
    idx = np.flatnonzero(flat > 0)
    idx = idx[np.argsort(-flat[idx], kind="stable")]
    v = flat[idx]
    mine = idx < qm.size  # the planned chain's entries
    req = np.where(mine, idx // qm.shape[1], (idx - qm.size) // (1 if qo is None else qo.shape[1]))
    held = ~mine | ((idx % qm.shape[1])[None, :] < gs[:, None])  # [G, E]: plan g holds the entry
    return v, mine, req, held


def _plan_two_chains(v, mine, req, held, alone, q_plan, qo, price, extras, gs, base, chain_first):
    """:func:`_plan_all` with a free chain: the two-chain price rule over every plan (the reference's
    :func:`calib.allocate.reference._two_chain_price`), ``alone`` the planned chain's own best prefixes."""
    B = q_plan.shape[1]
    free = _best_prefixes(v[~mine], None, price, extras, base)  # the free chain alone
    first, second = (alone, free) if chain_first else (free, alone)
    q = (q_plan, qo[None]) if chain_first else (qo[None], q_plan)
    # Slot price of the better single chain, each request's Lagrangian choice at it.
    lam = np.where(second[3] > first[3], second[2], first[2])[:, None, None]
    depth_f, depth_s = (np.add.reduce(x > lam, axis=2) for x in q)  # ufunc reductions: no Python wrapper
    surplus_f, surplus_s = (np.add.reduce(np.maximum(x - lam, 0), axis=2) for x in q)
    use_second = (surplus_s > surplus_f) | ((surplus_s == surplus_f) & (depth_s < depth_f))
    depth = np.where(use_second, depth_s, depth_f)
    use_second = np.where(depth > 0, use_second, q[1][:, :, 0] > q[0][:, :, 0])  # [G, B]
    plan_second_id = not chain_first  # the planned chain is the second
    picked = held & ((use_second[:, req] == plan_second_id) == mine[None, :])  # the chosen chains
    both = _best_prefixes(v, picked, price, extras, base)

    candidates = (both, first, second)
    plans = np.arange(extras.size)
    winner = np.array([c[3] for c in candidates]).argmax(axis=0)  # first maximum, in this order
    m = np.array([c[0] for c in candidates])[winner, plans]
    total = np.array([c[1] for c in candidates])[winner, plans]
    values = (total / SCALE) / (price[m] + extras)
    best = int(values.argmax())
    w = int(winner[best])
    q_best = [x[min(best, x.shape[0] - 1)] for x in q]  # plan best's chains [B, W_c]
    if w == 0:
        plan_second = use_second[best]
        width = max(x.shape[1] for x in q_best)
        chosen = np.zeros((B, width), dtype=np.int64)
        for x, rows in zip(q_best, (~plan_second, plan_second), strict=True):
            chosen[rows, : x.shape[1]] = x[rows]
    else:
        plan_second = np.full(B, w == 2)
        chosen = q_best[w - 1]
    depth = _take_top(chosen, candidates[w][2][best], m[best])
    planned = plan_second == plan_second_id
    return float(values[best]), int(gs[best]), np.where(planned, depth, 0), np.where(planned, 0, depth)


def _best_prefixes(v: np.ndarray, held: np.ndarray | None, price: np.ndarray, extras: np.ndarray,
                   base: int) -> tuple:
    """:func:`calib.allocate.reference.best_sorted_prefix` per plan: ``(m, gained, threshold, goodput)``
    [G] of the best top-``m`` prefix of the gains ``v [E]`` (positive, non-increasing) that plan ``g``
    holds (``held [G, E]``; None: all), priced ``price[B + m] + extras[g]`` (``price``: the curve from
    ``B`` on, NaN-padded); ``gained`` = ``base`` + the prefix's gains (an exact integer, in float64).

    The reference's sorted list is ``v[held[g]]`` then zeros (never feasible): its prefix of ``m``
    entries ends at the ``m``-th held entry here, and an entry not held repeats the prefix before it,
    marked infeasible, so the first maximum is at the same ``m``. Sums are integers below 2**53, exact
    in float64 in any order. A price is positive wherever the curve was checked, so infeasible means
    NaN (no entry) or +inf.
    """
    G = extras.size
    rows = np.arange(G)
    gained = np.empty((G if held is not None else 1, v.size + 1))
    gained[:, 0] = 0
    if held is None:
        m_at = np.arange(v.size + 1)[None, :]
        np.add.accumulate(v, out=gained[0, 1:], dtype=np.float64)  # the ufunc: no Python wrapper
    else:
        m_at = np.zeros((G, v.size + 1), dtype=np.intp)
        np.add.accumulate(held, axis=1, out=m_at[:, 1:], dtype=np.intp)
        np.add.accumulate(np.where(held, v, 0), axis=1, out=gained[:, 1:], dtype=np.float64)
    gained += base
    priced = price[m_at] + extras[:, None]
    infeasible = ~(priced < np.inf)
    if held is not None:
        infeasible[:, 1:] |= ~held
    good = gained / priced
    good[infeasible] = -np.inf
    j = good.argmax(axis=1)
    threshold = np.concatenate([[SCALE + 1], v])[j]  # the last gain taken (SCALE + 1: none)
    m = m_at[rows, j] if held is not None else j
    return m, gained[rows if held is not None else 0, j], threshold, good[rows, j]


def _gains(p: np.ndarray) -> np.ndarray:
    """:func:`calib.allocate.reference.survival`'s fixed-point gains of float32 ``p [B, K]`` (int64;
    one zero column if ``K = 0``, as the reference pads): the same float32 operations (NaN -> 0,
    clamp to [0, 1], running product left to right, scale by 2**24 and truncate), so the same
    integers (a product below 2**-24 gives 0 whether or not it is flushed to zero)."""
    q = np.zeros((p.shape[0], max(p.shape[1], 1)), dtype=np.int64)
    surv = np.fmin(np.fmax(p, np.float32(0)), np.float32(1))  # fmax: NaN -> 0; +-inf -> 1, 0
    surv = np.multiply.accumulate(surv, axis=1, dtype=np.float32)
    q[:, : p.shape[1]] = (surv * np.float32(SCALE)).astype(np.int32)
    return q


def _take_top(q: np.ndarray, threshold: int, n: int) -> np.ndarray:
    """:func:`calib.allocate.reference.take_top` on one ``[B, W]`` gain matrix (int64 depths [B])."""
    above = np.add.reduce(q > threshold, axis=1)
    ties_per_row = np.add.reduce((q == threshold) & (threshold > 0), axis=1)
    left = max(int(n) - int(np.add.reduce(above)), 0)
    ties_before = np.add.accumulate(ties_per_row) - ties_per_row
    return above + np.minimum(np.maximum(left - ties_before, 0), ties_per_row)


def _check_plan(known, forecast, chain: str, pass_cost: float, sunk: float, impl: str = "reference"):
    """``(drafted [B, passes_done], B, passes_done, K)`` of a plan's inputs, refused with what is wrong
    (the scalars declaratively: :data:`PLAN_CONSTRAINTS`)."""
    from calib.chains import chain_names

    if not (_plain_price(pass_cost) and _plain_price(sunk) and impl in IMPLEMENTATIONS
            and chain in chain_names()):  # the usual call passes at once; anything else is checked in full
        validate_params("plan_draft", {"pass_cost": pass_cost, "sunk": sunk, "impl": impl,
                                       "chain": chain}, {**PLAN_CONSTRAINTS, "chain": [Options(chain_names())]})
    if not isinstance(known, Mapping) or not all(isinstance(v, torch.Tensor) and v.ndim == 2 for v in known.values()):
        raise ValueError("`known` must be a mapping {chain name: float tensor [B, W]}")
    if not isinstance(forecast, torch.Tensor) or forecast.ndim != 2:
        raise ValueError(f"forecast must be a float tensor [B, K], got {type(forecast).__name__}"
                         f"{tuple(getattr(forecast, 'shape', ()))}")
    if chain not in known:
        raise ValueError(f"`known` must hold the {chain} chain's drafted depths ([B, 0] before the first pass)")
    done_p = known[chain]
    B, done = done_p.shape
    K = forecast.shape[1]
    if forecast.ndim != 2 or forecast.shape[0] != B:
        raise ValueError(f"forecast must be [B={B}, K], got {tuple(forecast.shape)}")
    if done > K:
        raise ValueError(f"{done} passes done but the forecast covers K={K} depths")
    return done_p, B, done, K


def _plain_price(x) -> bool:
    """A price :data:`PLAN_CONSTRAINTS` accepts for certain (a finite Python or numpy number ``>= 0``, not a bool)."""
    return type(x) in (float, int, np.float64, np.float32) and 0 <= x < math.inf


def _plan_draft_loop(known: Mapping[str, torch.Tensor], forecast: torch.Tensor, *, cost: torch.Tensor,
                     pass_cost: float, sunk: float = 0.0, chain: str = "model", impl: str = "reference") -> DraftPlan:
    """:func:`plan_draft` one plan at a time: one :func:`calib.allocate.allocate_probs` call per ``g``
    (the Triton path, the fallback of the fast path, and its reference in the tests)."""
    done_p, B, done, K = _check_plan(known, forecast, chain, pass_cost, sunk, impl)
    others = {n: p for n, p in known.items() if n != chain}
    done_p = done_p.to(torch.float32)
    ended = torch.isnan(done_p).any(dim=1, keepdim=True) if done else torch.zeros(B, 1, dtype=torch.bool)
    best = None
    for g in range(done, K + 1):
        tail = torch.where(ended, torch.nan, forecast[:, done:g].to(torch.float32))
        p = torch.cat([done_p, tail], dim=1)
        extra = sunk + (g - done) * pass_cost
        value, depths = _plan_value({chain: p, **others}, cost, extra, impl)
        if best is None or value > best[0]:  # ties: the fewer passes
            best = (value, g, depths)
    value, g, depths = best
    depth_model = depths[chain]
    run = bool((depth_model > done).any())
    drafting = depth_model > done if run else torch.zeros(B, dtype=torch.bool)
    free = next((d for n, d in depths.items() if n != chain), None)
    return DraftPlan(run, drafting, int(depth_model.max()) if run else done, value, free)


def _plan_value(probs: dict, cost: torch.Tensor, extra: float, impl: str) -> tuple[float, dict[str, torch.Tensor]]:
    """Expected goodput of the allocator's decision on ``probs`` priced ``cost + extra``, on the
    allocator's fixed-point gains; and the depth it verifies on each chain per request (int64 [B])."""
    from calib.chains import chain as chain_kind

    B = next(iter(probs.values())).shape[0]
    priced = cost.to(torch.float64) + extra
    out = allocate_probs(probs, cost=priced, impl=impl)
    gained = torch.zeros((), dtype=torch.int64)
    depths = {}
    for name, p in probs.items():
        cid = chain_kind(name).id
        mine = out.drafter.to(torch.int64) == cid
        depth = torch.where(mine, out.depth.to(torch.int64), 0)
        if p.shape[1]:
            _, q = survival(p)
            taken = torch.arange(p.shape[1])[None, :] < depth[:, None]
            gained = gained + torch.where(taken, q.to(torch.int64), 0).sum()
        depths[name] = depth
    T = B + int(out.depth.to(torch.int64).sum())
    price = float(priced[T]) if T < priced.numel() else float("inf")
    return (B * SCALE + int(gained)) / SCALE / price, depths
