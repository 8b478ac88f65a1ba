"""Torch reference allocator: exact, readable, device-agnostic, free of host synchronisation.

Notation (per request ``i`` of ``B``, per chain ``c`` of at most two registered chain kinds
(:mod:`calib.chains`; "first" = the lower registry id, e.g. model, "second" e.g. n-gram), depth ``k``
from 0):

* ``p[i, k]`` calibrated P(accept token k | tokens < k accepted); NaN = no token. A chain ends at
  its first NaN: deeper tokens cannot be verified whatever their value.
* ``S[i, k] = prod_{j <= k} p[i, j]`` (float32, multiplied left to right) is the probability that
  token k is accepted, i.e. the expected gain of verifying depth k. Curves are non-increasing.
* ``expected_accepted[i] = sum_{k < depth[i]} S[i, k]`` of the chosen chain.

Decisions are taken on ``q = floor(S * 2**24)``, the gains on a fixed-point grid of one float32 ulp
at 1.0. Integer sums are exact and order-free, so this reference and the Triton kernel (which
reduces in a different order) take bit-identical decisions; the price is that gains below 2**-24
count as zero. Only positions with positive gain are ever allocated: nothing is spent where nothing
can be verified or nothing is expected.

Budget mode, one chain: take the N largest gains in the batch, ties broken by lower request index,
then lower depth. Rows are non-increasing, so the taken set is a prefix of every row and
``depth[i]`` is the number taken in row ``i``; no allocation of N tokens has a larger sum.

Price mode, one chain: ``cost[T]`` is the cost of one verify pass with ``T`` positions in all
(``T = B + sum(depth)``: every request contributes its bonus position). The goodput of an
allocation is ``(B + sum expected_accepted) / cost[T]``; totals with ``T > len(cost) - 1`` or a
non-positive/NaN cost are infeasible. For a fixed number ``m`` of draft tokens the cost is fixed and
the top-``m`` gains maximise the numerator, so the best allocation is the best of the ``m + 1``
top-``m`` prefixes of the sorted gains: we evaluate all of them (ties -> smallest ``m``). This is the
"add the next most valuable token while it pays" rule made exact even for non-convex cost curves.

Two chains, budget mode (each request verifies at most one chain):

1. Lagrangian. At slot price ``lam`` a request's best choice maximises ``sum_{k<d} (q_k - lam)``:
   per chain that is ``d_c = #{q_c > lam}`` with surplus ``V_c = sum (q_c - lam)^+``; the request
   takes the chain with the larger surplus (ties: fewer tokens, then the first chain). The total
   depth ``D(lam)`` is non-increasing in ``lam`` (exchange argument), and ``lam*`` is the smallest
   integer price with ``D(lam*) <= N``. (The Triton kernel finds it by bisection; the reference
   reads it off the per-request breakpoints ``t[i, d]`` = smallest price at which request ``i``
   takes at most ``d`` tokens: ``lam*`` is the ``N + 1``-th largest of them, the same integer.)
2. Upgrades. Requests whose choice at ``lam* - 1`` is deeper take that choice, in request order,
   while the whole increment fits the unused budget. Their tokens are worth at least ``lam* - 1``
   each while the Lagrangian bound caps the optimum at ``value + lam* * unused``, so after this step
   the gap to the optimum is at most the increment of the first request that did not fit, i.e.
   at most one request's largest gain (plus rounding on the 2**-24 grid).
3. Greedy fill. Chains are then fixed (a request still at depth 0 takes the chain with the larger
   first gain) and the remaining budget goes to the largest remaining gains, same tie rule.
4. The result is compared (exact integer sums) with the two single-chain optima and the best is
   returned (ties: Lagrangian, first, second), so it is never worse than either chain alone.

Two chains, price mode (a heuristic with the same guarantees against single drafters): the better
single-drafter price allocation sets the slot price ``lam`` (its smallest accepted gain: the gain at
which the goodput rule stopped); each request picks its chain by the Lagrangian rule at ``lam``
(depth-0 requests by larger first gain), and the exact one-chain price mode runs on the chosen
chains. The best goodput among that and the two single-drafter allocations is returned.
"""

from __future__ import annotations

import functools
import math
import numbers

import torch

from calib.chains import NO_CHAIN
from calib.params import Interval, NoneValue, Satisfies, validate_params

SCALE = 1 << 24  # fixed-point units per expected accepted token


_PROBS = Satisfies("a 2-D float tensor [B, K]",
                   lambda t: isinstance(t, torch.Tensor) and t.ndim == 2 and t.is_floating_point())
_CHAIN_ID = Interval(numbers.Integral, NO_CHAIN + 1, 127)
# A budget and a verify-cost curve, as every allocator entry point takes them (calib.allocate.api too).
BUDGET = [NoneValue(), Interval(numbers.Integral, 0, None),
          Satisfies("a one-element integer tensor", lambda t: isinstance(t, torch.Tensor) and t.numel() == 1
                    and not t.dtype.is_floating_point and not t.dtype.is_complex and t.dtype != torch.bool)]
COST = [NoneValue(), Satisfies("a non-empty 1-D float tensor indexed by total positions",
                               lambda t: isinstance(t, torch.Tensor) and t.ndim == 1 and t.numel() >= 1
                               and t.is_floating_point())]
# allocate_reference's arguments.
REFERENCE_CONSTRAINTS = {
    "first_p": [_PROBS],
    "second_p": [NoneValue(), _PROBS],
    "ids": [Satisfies(f"a pair of chain ids, each {_CHAIN_ID}",
                      lambda v: len(v) == 2 and all(_CHAIN_ID.accepts(i) for i in v))],
    "budget": BUDGET,
    "cost": COST,
}


def survival(p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, K]`` conditional probabilities -> survival ``S`` (float32) and fixed-point gains ``q``.

    Both are zero from a chain's first missing (NaN) token on: a missing token counts as
    probability 0, and the running product stays 0 from there. The product is taken column by
    column in float32 so that every device, and the kernel, round it identically.
    """
    p = p.to(torch.float32).t()
    # Column-major, so each step is one in-place row product; NaN (no token) -> 0, clamp to [0, 1].
    surv = torch.empty(p.shape, dtype=torch.float32, device=p.device)
    torch.nan_to_num(p, nan=0.0, posinf=1.0, neginf=0.0, out=surv).clamp_(0.0, 1.0)
    for k in range(1, surv.shape[0]):
        surv[k] *= surv[k - 1]
    surv = surv.t().contiguous()
    return surv, (surv * SCALE).to(torch.int32)


def take_top(q: torch.Tensor, threshold: int | torch.Tensor, n: int | torch.Tensor) -> torch.Tensor:
    """Per-row count of the ``n`` largest positive entries of ``q`` given the ``n``-th largest value.

    Everything above ``threshold`` is taken; entries equal to it fill what is left of ``n`` in
    request order. Rows must be non-increasing over their positive entries, so counts are prefixes.
    """
    above = q > threshold
    ties = (q == threshold) & (threshold > 0)
    left = (n - above.sum()).clamp(min=0)
    ties_per_row = ties.sum(dim=1)
    ties_before = ties_per_row.cumsum(dim=0) - ties_per_row
    taken_ties = (left - ties_before).clamp(min=0).minimum(ties_per_row)
    return above.sum(dim=1) + taken_ties


def top_n_values(q: torch.Tensor, n: int) -> torch.Tensor:
    """Sum of the ``n`` largest gains of each chain of ``q [C, B, W]`` (int64 ``[C]``): what
    :func:`top_n` takes, from the ``n``-th largest gain ``t``: every gain above ``t``, and ``t``
    for each of the ``n`` still missing (a non-positive ``t``: every positive gain, and nothing)."""
    size = q[0].numel()
    if n == 0:
        return torch.zeros(q.shape[0], dtype=torch.int64, device=q.device)
    if n >= size:
        return q.sum(dim=(1, 2), dtype=torch.int64)
    threshold = q.reshape(q.shape[0], -1).kthvalue(size - n + 1, dim=1).values[:, None, None]
    above = q > threshold
    taken = torch.where(above, q, 0).sum(dim=(1, 2), dtype=torch.int64)
    return taken + (n - above.sum(dim=(1, 2))) * threshold.view(-1).clamp(min=0)


def top_n(q: torch.Tensor, n: int) -> torch.Tensor:
    """Budget mode on one chain: per-row depths taking the ``n`` largest positive gains."""
    flat = q.flatten()
    positive = int((flat > 0).sum())
    if n >= positive:
        return (q > 0).sum(dim=1)
    if n == 0:
        return torch.zeros(q.shape[0], dtype=torch.int64, device=q.device)
    threshold = flat.kthvalue(flat.numel() - n + 1).values  # the n-th largest: a selection, no sort
    return take_top(q, threshold, n)


# On CPU, torch sorts integers with a radix sort from this many entries on, and with a comparison
# sort below, which is several times slower from a few thousand entries on: pad mid-size sorts.
_RADIX_MIN = 1 << 15
_PAD_FROM = 1 << 13


def sort_keys(key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Ascending sort of 1-D non-negative integer keys: ``(values, indices)``."""
    size = key.numel()
    if key.device.type == "cpu" and _PAD_FROM <= size < _RADIX_MIN:
        padded = key.new_full((_RADIX_MIN,), torch.iinfo(key.dtype).max)  # sorted after every real key
        padded[:size] = key
        values, indices = torch.sort(padded)
        return values[:size], indices[:size]
    return torch.sort(key)


def sorted_gains(q: torch.Tensor) -> torch.Tensor:
    """All gains of ``q`` (``0 <= q <= SCALE``) in non-increasing order, flattened."""
    return SCALE - sort_keys(SCALE - q.flatten())[0]  # one ascending integer sort


def best_price_prefix(
    q: torch.Tensor, cost: torch.Tensor, n_requests: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Exact one-chain price mode: ``(m*, goodput*, threshold)`` over all top-``m`` prefixes."""
    return best_sorted_prefix(sorted_gains(q), cost, n_requests)


def price_table(cost: torch.Tensor, n_requests: int, size: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """``price[m]`` = cost of a top-``m`` prefix (``T = n_requests + m``, float64, ``m <= size``)
    and whether that total is infeasible (no entry, or not positive and finite)."""
    price = torch.full((size + 1,), torch.nan, dtype=torch.float64, device=device)
    available = cost[n_requests : n_requests + size + 1]
    price[: available.numel()] = available  # float64 copy of the entries that can be read
    return price, ~((price > 0) & (price < torch.inf))


def best_sorted_prefix(
    ordered: torch.Tensor,
    cost: torch.Tensor,
    n_requests: int,
    prices: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`best_price_prefix` on gains already sorted: ``ordered`` is ``[..., M]``, non-increasing
    along the last dim (leading dims are independent chains). ``prices`` is :func:`price_table`'s
    answer for this ``M``, if already at hand.

    Goodput is in units of ``SCALE`` tokens per cost unit, computed as one float64 division of an
    exact integer, which the kernel reproduces bit for bit. (The prefix sums are taken in float64:
    they are integers below 2**53, so every partial sum is exact.)
    """
    size = ordered.shape[-1]
    price, price_bad = prices if prices is not None else price_table(cost, n_requests, size, ordered.device)
    # gained[m] = n_requests * SCALE + top-m sum; a prefix is feasible where its last gain is positive.
    gained = ordered.new_empty((*ordered.shape[:-1], size + 1), dtype=torch.float64)
    gained[..., 0] = n_requests * SCALE
    gained[..., 1:] = ordered
    infeasible = ordered.new_zeros(gained.shape, dtype=torch.bool)
    torch.le(ordered, 0, out=infeasible[..., 1:])
    infeasible |= price_bad
    goodput = gained.cumsum_(dim=-1).div_(price).masked_fill_(infeasible, -torch.inf)
    best = torch.argmax(goodput, dim=-1, keepdim=True)  # first maximum: the fewest tokens
    threshold = torch.where(best > 0, ordered.gather(-1, (best - 1).clamp(min=0)), SCALE + 1)
    return best.squeeze(-1), goodput.gather(-1, best).squeeze(-1), threshold.squeeze(-1)


def sort_two_groups(q: torch.Tensor) -> torch.Tensor:
    """Gains ``q`` ``[2, ...]`` (``0 <= q <= SCALE``), each half sorted in non-increasing order:
    ``[2, q[0].numel()]``.

    One ascending integer sort of ``half * 2**25 + (SCALE - q)`` does it (on CPU, torch uses a
    radix sort from 32768 entries, much faster than two descending sorts of half the size).
    """
    offset = _group_offsets(q.dtype, q.device)
    keys = sort_keys((offset - q.reshape(2, -1)).flatten())[0].view(2, -1)
    return offset - keys


@functools.lru_cache(maxsize=8)
def _group_offsets(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.tensor([[SCALE], [SCALE + (1 << 25)]], dtype=dtype, device=device)


class TwoChains:
    """Both chains' gains stacked as ``[2, B, W]`` (0 = first, 1 = second chain; rows are
    non-increasing), and, when first needed, their prefix sums ``[2, B, W + 1]`` (int64)."""

    def __init__(self, q: torch.Tensor):
        self.q = q  # [2, B, W]
        self.n_requests, self.width = q.shape[1:]

    @functools.cached_property
    def _prefix(self) -> torch.Tensor:
        return torch.nn.functional.pad(self.q.cumsum(dim=2, dtype=torch.int64), (1, 0))

    def choose(self, price: int | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each request's best (chain, depth) at slot price ``price``: ``(use_second, depth)``.

        A chain's best depth is ``#{q > price}`` with surplus ``sum (q - price)^+``; the larger
        surplus wins, then the shorter chain, then the first chain.
        """
        price = torch.as_tensor(price, dtype=self.q.dtype, device=self.q.device)
        depth = (self.q > price).sum(dim=2)
        surplus = (self.q - price).clamp_(min=0).sum(dim=2)
        use_second = (surplus[1] > surplus[0]) | ((surplus[1] == surplus[0]) & (depth[1] < depth[0]))
        return use_second, torch.where(use_second, depth[1], depth[0])

    def value(self, use_second: torch.Tensor, depth: torch.Tensor) -> torch.Tensor:
        """Total gain (int64) of verifying ``depth[i]`` tokens of chain ``use_second[i]``."""
        picked = self._prefix.gather(2, depth.expand(2, -1)[:, :, None]).squeeze(2)
        return torch.where(use_second, picked[1], picked[0]).sum()

    def breakpoints(self) -> torch.Tensor:
        """``t [B, W]`` (int32, at most ``SCALE``): request ``i``'s Lagrangian choice takes at most
        ``d`` tokens exactly at the integer prices ``>= t[i, d]``.

        With ``best[d]`` the larger of the chains' top-``d`` sums, the choice at price ``lam`` is the
        smallest ``d`` maximising ``best[d] - lam * d`` (larger surplus, then fewer tokens), so it
        takes at most ``d`` tokens iff every ``d'' > d`` is matched by some ``d' <= d``:
        ``t[d] = max_{d'' > d} min_{d' <= d} ceil((best[d''] - best[d']) / (d'' - d'))``. A request
        whose one chain's sums dominate the other's at every depth follows that chain alone:
        ``t = q`` of that chain.
        """
        first, second = self._prefix
        lowest, highest = torch.aminmax(first - second, dim=1)
        t = torch.where((highest <= 0)[:, None], self.q[1], self.q[0])
        rows = ((lowest < 0) & (highest > 0)).nonzero().squeeze(1)  # neither chain dominates
        chunk = max(1, _BREAKPOINT_ENTRIES // max(self.width, 1) ** 2)
        for start in range(0, rows.numel(), chunk):
            part = rows[start : start + chunk]
            t[part] = _envelope_breakpoints(torch.maximum(first[part], second[part]))
        return t

    def lagrangian_price(self, n: int) -> int:
        """Smallest integer price ``>= 0`` whose Lagrangian choices use at most ``n`` tokens.

        The total depth at price ``lam`` is ``#{t > lam}`` over all breakpoints ``t``
        (:meth:`breakpoints`), so the answer is the ``n + 1``-th largest breakpoint (0 if there are
        at most ``n``): a selection, no search. No gain exceeds ``SCALE``, nor does any breakpoint.
        """
        t = self.breakpoints().flatten()
        if n >= t.numel():
            return 0
        return int(t.kthvalue(t.numel() - n).values)


# Entries of the [rows, W, W] float64 breakpoint matrix worked on at once (32 MiB).
_BREAKPOINT_ENTRIES = 1 << 22


def _envelope_breakpoints(best: torch.Tensor) -> torch.Tensor:
    """:meth:`TwoChains.breakpoints` for rows with their best top-``d`` sums ``best [R, W + 1]``
    (int64, non-decreasing along ``d``).

    Quotients are taken in float64: numerators are integers below ``W * 2**24`` and denominators at
    most ``W``, so a non-integer quotient is at least ``1 / W`` from any integer and ``ceil`` exact.
    """
    width = best.shape[1] - 1
    span, below = _spans(width, best.device)
    at = best.t().to(torch.float64)  # [W + 1, R]: each step below works on contiguous rows
    # crossing[d', d'', i] = smallest integer price at which d' does at least as well as d''.
    crossing = (at[None, 1:, :] - at[:-1, None, :]).div_(span).ceil_()
    for k in range(1, width):  # running minimum over d' <= d
        torch.minimum(crossing[k], crossing[k - 1], out=crossing[k])
    return crossing.masked_fill_(below, 0).amax(dim=1).t().to(torch.int32)


@functools.lru_cache(maxsize=16)
def _spans(width: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``d'' - d'`` (at least 1) as float64 ``[W, W, 1]`` over ``d' = 0..W-1, d'' = 1..W``, and the
    mask of the entries with ``d'' <= d'``."""
    d = torch.arange(width + 1, dtype=torch.float64, device=device)
    span = (d[None, 1:] - d[:-1, None]).clamp_(min=1)[:, :, None]
    return span, torch.ones(width, width, dtype=torch.bool, device=device).tril_(-1)[:, :, None]


def _first_gain_prefers_second(chains: TwoChains) -> torch.Tensor:
    return chains.q[1, :, 0] > chains.q[0, :, 0]


def _two_chain_budget(chains: TwoChains, n: int):
    q_first, q_second = chains.q
    cols = torch.arange(chains.width, device=q_first.device)
    price = chains.lagrangian_price(n)
    use_second, depth = chains.choose(price)
    if price > 0:
        # Upgrades: requests that go deeper one price unit lower, in request order, while they fit.
        use_lower, depth_lower = chains.choose(price - 1)
        extra = (depth_lower - depth).clamp(min=0)
        upgrade = (extra > 0) & (extra.cumsum(dim=0) <= n - depth.sum())
        use_second = torch.where(upgrade, use_lower, use_second)
        depth = torch.where(upgrade, depth_lower, depth)
    # Greedy fill on fixed chains.
    use_second = torch.where(depth > 0, use_second, _first_gain_prefers_second(chains))
    chain = torch.where(use_second[:, None], q_second, q_first)
    rest = torch.where(cols >= depth[:, None], chain, torch.zeros_like(chain))
    depth = depth + top_n(rest, n - int(depth.sum()))

    # Against the single chains' top-n (highest value wins, ties in this order); their depths are
    # only worked out for the one that wins.
    values = torch.cat([chains.value(use_second, depth)[None], top_n_values(chains.q, n)])
    winner = int(torch.argmax(values))  # the first maximum
    if winner == 0:
        return use_second, depth
    use_second = torch.full_like(use_second, winner == 2)
    return use_second, top_n(chains.q[winner - 1], n)


def _two_chain_price(chains: TwoChains, cost: torch.Tensor, n_requests: int):
    q_first, q_second = chains.q
    size = q_first.numel()
    prices = price_table(cost, n_requests, size, q_first.device)
    (m_f, m_s), (good_f, good_s), (thr_f, thr_s) = best_sorted_prefix(
        sort_two_groups(chains.q), cost, n_requests, prices
    )
    # The slot price is where the better single drafter's goodput rule stopped adding tokens.
    price = torch.where(good_s > good_f, thr_s, thr_f)
    use_second, depth = chains.choose(price)
    use_second = torch.where(depth > 0, use_second, _first_gain_prefers_second(chains))
    chain = torch.where(use_second[:, None], q_second, q_first)
    m_c, good_c, thr_c = best_sorted_prefix(sorted_gains(chain), cost, n_requests, prices)
    # Highest goodput wins, ties in this order; only the winner's depths are worked out.
    winner = int(torch.argmax(torch.stack([good_c, good_f, good_s])))  # the first maximum
    if winner == 0:
        return use_second, take_top(chain, thr_c, m_c)
    use_second = torch.full_like(use_second, winner == 2)
    return use_second, take_top(chains.q[winner - 1], (thr_f, thr_s)[winner - 1], (m_f, m_s)[winner - 1])


def allocate_reference(
    first_p: torch.Tensor,
    second_p: torch.Tensor | None = None,
    *,
    budget: int | torch.Tensor | None = None,
    cost: torch.Tensor | None = None,
    ids: tuple[int, int] = (1, 2),
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Decide ``(drafter int8 [B], depth int32 [B], expected_accepted float32 [B])``.

    ``first_p`` is ``[B, K]`` and ``second_p`` ``[B, L]`` (or None) calibrated conditional acceptance
    probabilities of two chains; ``ids`` are their registry ids (:mod:`calib.chains`), which
    ``drafter`` reports (:data:`NO_CHAIN` = nothing verified). Exactly one of ``budget`` (total draft
    tokens) and ``cost`` (1-D verify-cost curve) is given. See the module docstring for the rules.
    The reference reads a few scalars back to the host (the budget, the Lagrangian price, which of
    the two-chain candidates wins); the Triton kernel does not. Arguments are checked with
    :data:`REFERENCE_CONSTRAINTS` (host metadata only) and the budget's value (it is read anyway).
    """
    validate_params("allocate_reference", {"first_p": first_p, "second_p": second_p, "ids": ids, "budget": budget,
                                           "cost": cost}, REFERENCE_CONSTRAINTS)
    if (budget is None) == (cost is None):
        raise ValueError("allocate_reference: give exactly one of `budget` and `cost`")
    if second_p is not None and second_p.shape[0] != first_p.shape[0]:
        raise ValueError(f"allocate_reference: the chains have different batch sizes B: {first_p.shape[0]} and "
                         f"{second_p.shape[0]}")
    device = first_p.device
    n_requests = first_p.shape[0]
    width = max(first_p.shape[1], 0 if second_p is None else second_p.shape[1], 1)
    n = None if budget is None else int(budget)
    if n is not None and n < 0:
        raise ValueError(f"allocate_reference: parameter budget={n} is invalid; it must be >= 0")

    if second_p is None:
        surv, q = survival(_pad(first_p, width))
        if n is not None:
            depth = top_n(q, n)
        else:
            m, _, threshold = best_price_prefix(q, cost, n_requests)
            depth = take_top(q, threshold, m)
        use_second = torch.zeros(n_requests, dtype=torch.bool, device=device)
    else:
        # One pass over both chains: survival is row-wise, so stacking them changes nothing.
        surv_both, q_both = survival(torch.cat([_pad(first_p, width), _pad(second_p.to(device), width)]))
        chains = TwoChains(q_both.view(2, n_requests, width))
        if n is not None:
            use_second, depth = _two_chain_budget(chains, n)
        else:
            use_second, depth = _two_chain_price(chains, cost, n_requests)
        surv = torch.where(use_second[:, None], surv_both[n_requests:], surv_both[:n_requests])

    cols = torch.arange(width, device=device)
    expected = surv.masked_fill(cols >= depth[:, None], 0.0).sum(dim=1)
    drafter = torch.where(depth > 0, torch.where(use_second, ids[1], ids[0]), NO_CHAIN).to(torch.int8)
    return drafter, depth.to(torch.int32), expected


def _pad(p: torch.Tensor, width: int) -> torch.Tensor:
    """Right-pad with NaN (no token) so both chains share one width."""
    p = p.to(torch.float32)
    if p.shape[1] == width:
        return p
    return torch.nn.functional.pad(p, (0, width - p.shape[1]), value=float("nan"))


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
