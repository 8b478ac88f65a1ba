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
   integer price with ``D(lam*) <= N``, found by bisection.
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

import torch

from calib.chains import NO_CHAIN

SCALE = 1 << 24  # fixed-point units per expected accepted token


def survival(p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, K]`` conditional probabilities -> survival ``S`` (float32) and fixed-point gains ``q``.

    Both are zero from a chain's first missing (NaN) token on. The product is taken column by column
    in float32 so that every device, and the kernel, round it identically.
    """
    p = p.to(torch.float32)
    present = ~torch.isnan(p)
    p = torch.where(present, p.clamp(0.0, 1.0), torch.zeros_like(p))
    in_chain = present.to(torch.int8).cummin(dim=1).values.bool()
    surv = p.t().contiguous()  # column-major, so each step is one in-place row product
    for k in range(1, surv.shape[0]):
        surv[k] *= surv[k - 1]
    surv = surv.t()
    surv = torch.where(in_chain, surv, torch.zeros_like(surv))
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


def best_price_prefix(
    q: torch.Tensor, cost: torch.Tensor, n_requests: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Exact one-chain price mode: ``(m*, goodput*, threshold)`` over all top-``m`` prefixes."""
    return best_sorted_prefix(q.flatten().sort(descending=True).values, cost, n_requests)


def best_sorted_prefix(
    ordered: torch.Tensor, cost: torch.Tensor, n_requests: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`best_price_prefix` on gains already sorted: ``ordered`` is ``[..., M]``, non-increasing
    along the last dim (leading dims are independent chains).

    Goodput is in units of ``SCALE`` tokens per cost unit, computed as one float64 division of an
    exact integer, which the kernel reproduces bit for bit.
    """
    ordered = ordered.to(torch.int64)
    size = ordered.shape[-1]
    cost = cost.to(device=ordered.device, dtype=torch.float64)
    # price[m] = cost of the top-m prefix (T = n_requests + m); NaN = no such entry.
    price = torch.full((size + 1,), torch.nan, dtype=torch.float64, device=ordered.device)
    available = cost[n_requests : n_requests + size + 1]
    price[: available.numel()] = available
    gained = torch.nn.functional.pad(ordered.cumsum(dim=-1), (1, 0))  # gained[m] = top-m sum
    feasible = (price > 0) & (price < torch.inf) & torch.nn.functional.pad(ordered > 0, (1, 0), value=True)
    goodput = ((n_requests * SCALE + gained).to(torch.float64) / price).masked_fill(~feasible, -torch.inf)
    best = torch.argmax(goodput, dim=-1, keepdim=True)  # first maximum: the fewest tokens
    threshold = torch.where(best > 0, ordered.gather(-1, (best - 1).clamp(min=0)), SCALE + 1)
    return best.squeeze(-1), goodput.gather(-1, best).squeeze(-1), threshold.squeeze(-1)


def sort_two_groups(q: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
    """Gains ``q`` (any shape, ``0 <= q <= SCALE``) split by the bool mask ``second`` into two groups
    of equal size, each sorted in non-increasing order: ``[2, q.numel() // 2]``.

    One ascending integer sort of ``group * 2**25 + (SCALE - q)`` does it (on CPU, torch uses a
    radix sort from 32768 entries, much faster than two descending sorts of half the size).
    """
    key = (second.to(q.dtype) << 25) + (SCALE - q)
    keys = torch.sort(key.flatten()).values.view(2, -1)
    return SCALE - (keys - torch.tensor([[0], [1 << 25]], dtype=keys.dtype, device=keys.device))


class TwoChains:
    """Both chains' gains stacked as ``[2, B, W]`` (0 = first, 1 = second chain), with what the
    Lagrangian needs precomputed: rows are non-increasing, so ``#{q > price}`` is a binary search
    and the surplus a prefix-sum lookup."""

    def __init__(self, q_first: torch.Tensor, q_second: torch.Tensor):
        self.q = torch.stack([q_first, q_second])
        self.n_requests, self.width = q_first.shape
        self._ascending = (-self.q).contiguous()
        self._prefix = torch.nn.functional.pad(self.q.to(torch.int64).cumsum(dim=2), (1, 0))

    def choose(
        self, price: int | torch.Tensor, rows: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each request's best (chain, depth) at slot price ``price``: ``(use_second, depth)``.

        A chain's best depth is ``#{q > price}`` with surplus ``sum (q - price)^+``; the larger
        surplus wins, then the shorter chain, then the first chain. ``rows`` restricts to a subset.
        """
        ascending, prefix = self._ascending, self._prefix
        if rows is not None:
            ascending, prefix = ascending[:, rows], prefix[:, rows]
        price = torch.as_tensor(price, dtype=self.q.dtype, device=self.q.device)
        depth = torch.searchsorted(ascending, (-price).expand(*ascending.shape[:2], 1).contiguous())
        surplus = (prefix.gather(2, depth) - price * depth).squeeze(2)
        depth = depth.squeeze(2)
        use_second = (surplus[1] > surplus[0]) | ((surplus[1] == surplus[0]) & (depth[1] < depth[0]))
        return use_second, torch.where(use_second, depth[1], depth[0])

    def lagrangian_price(self, n: int) -> int:
        """Smallest integer price ``>= 0`` whose Lagrangian choices use at most ``n`` tokens.

        Each request's depth is non-increasing in the price (exchange argument), so bisection is
        exact; no gain exceeds ``SCALE``. Once the bracket is narrow, requests whose depth is the
        same at both ends keep it inside and are frozen, so late steps only touch the few left.
        """
        if int(self.choose(0)[1].sum()) <= n:
            return 0
        lo, hi = 0, SCALE  # D(lo) > n >= D(hi)
        rows, frozen = None, 0
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if frozen + int(self.choose(mid, rows)[1].sum()) <= n:
                hi = mid
            else:
                lo = mid
            if rows is None and hi - lo <= _FREEZE_WIDTH:
                depth_lo, depth_hi = self.choose(lo + 1)[1], self.choose(hi)[1]
                moving = depth_lo != depth_hi
                frozen = int(depth_hi[~moving].sum())
                rows = moving.nonzero().squeeze(1)
        return hi


# Bracket width (in 2**-24 units) below which most requests have no breakpoint left inside it.
_FREEZE_WIDTH = 1 << 14


def _prefix_value(q: torch.Tensor, depth: torch.Tensor) -> torch.Tensor:
    cols = torch.arange(q.shape[1], device=q.device)
    return torch.where(cols < depth[:, None], q, torch.zeros_like(q)).to(torch.int64).sum()


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
    value = _prefix_value(chain, depth)

    depth_f, depth_s = top_n(q_first, n), top_n(q_second, n)
    return _pick_best(
        (use_second, depth, value),
        (torch.zeros_like(use_second), depth_f, _prefix_value(q_first, depth_f)),
        (torch.ones_like(use_second), depth_s, _prefix_value(q_second, depth_s)),
    )


def _two_chain_price(chains: TwoChains, cost: torch.Tensor, n_requests: int):
    q_first, q_second = chains.q
    is_second = torch.zeros_like(chains.q, dtype=torch.bool)
    is_second[1] = True
    (m_m, m_n), (good_m, good_n), (thr_m, thr_n) = best_sorted_prefix(
        sort_two_groups(chains.q, is_second), cost, n_requests
    )
    # The slot price is where the better single drafter's goodput rule stopped adding tokens.
    price = torch.where(good_n > good_m, thr_n, thr_m)
    use_second, depth = chains.choose(price)
    use_second = torch.where(depth > 0, use_second, _first_gain_prefers_second(chains))
    chain = torch.where(use_second[:, None], q_second, q_first)
    # Sort the chosen entries first (each request has exactly one chosen chain).
    unchosen = torch.stack([use_second, ~use_second])[:, :, None].expand_as(chains.q)
    m_c, good_c, thr_c = best_sorted_prefix(sort_two_groups(chains.q, unchosen)[0], cost, n_requests)
    return _pick_best(
        (use_second, take_top(chain, thr_c, m_c), good_c),
        (torch.zeros_like(use_second), take_top(q_first, thr_m, m_m), good_m),
        (torch.ones_like(use_second), take_top(q_second, thr_n, m_n), good_n),
    )


def _pick_best(first, second, third):
    """Highest score wins; earlier candidates win ties."""
    (use_a, depth_a, score_a), (use_b, depth_b, score_b), (use_c, depth_c, score_c) = first, second, third
    take_b = score_b > score_a
    take_c = score_c > torch.maximum(score_a, score_b)
    use = torch.where(take_c, use_c, torch.where(take_b, use_b, use_a))
    depth = torch.where(take_c, depth_c, torch.where(take_b, depth_b, depth_a))
    return use, depth


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
    The reference reads a few scalars back to the host (the budget, bisection steps); the Triton
    kernel does not.
    """
    device = first_p.device
    n_requests = first_p.shape[0]
    width = max(first_p.shape[1], 0 if second_p is None else second_p.shape[1], 1)
    n = None if budget is None else max(int(budget), 0)

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
        both = torch.cat([_pad(first_p, width), _pad(second_p.to(device), width)])
        surv_both, q_both = survival(both)
        chains = TwoChains(q_both[:n_requests], q_both[n_requests:])
        if n is not None:
            use_second, depth = _two_chain_budget(chains, n)
        else:
            use_second, depth = _two_chain_price(chains, cost, n_requests)
        surv = torch.where(use_second[:, None], surv_both[n_requests:], surv_both[:n_requests])

    cols = torch.arange(width, device=device)
    expected = torch.where(cols < depth[:, None], surv, torch.zeros_like(surv)).sum(dim=1)
    drafter = torch.where(depth > 0, torch.where(use_second, ids[1], ids[0]), NO_CHAIN).to(torch.int8)
    return drafter, depth.to(torch.int32), expected


def _pad(p: torch.Tensor, width: int) -> torch.Tensor:
    """Right-pad with NaN (no token) so both chains share one width."""
    p = p.to(torch.float32)
    if p.shape[1] == width:
        return p
    return torch.nn.functional.pad(p, (0, width - p.shape[1]), value=float("nan"))
