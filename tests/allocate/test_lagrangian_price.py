"""The reference's Lagrangian price (read off per-request breakpoints, no search) is the smallest
integer price at which the Lagrangian choices fit the budget, as a plain bisection finds it."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import prob_matrix

from calib.allocate.reference import SCALE, TwoChains, survival


def bisect_price(chains: TwoChains, n: int) -> int:
    """Smallest integer price in [0, SCALE] with total Lagrangian depth <= n (depth is monotone)."""
    if int(chains.choose(0)[1].sum()) <= n:
        return 0
    lo, hi = 0, SCALE
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if int(chains.choose(mid)[1].sum()) <= n:
            hi = mid
        else:
            lo = mid
    return hi


def two_chains(first: torch.Tensor, second: torch.Tensor) -> TwoChains:
    _, q = survival(torch.cat([first, second]))
    return TwoChains(q.view(2, *first.shape))


def check(chains: TwoChains, budgets) -> None:
    depth_at = {}
    for n in budgets:
        price = chains.lagrangian_price(n)
        assert price == bisect_price(chains, n), n
        depth_at[n] = int(chains.choose(price)[1].sum())
        assert depth_at[n] <= n
        assert price == 0 or int(chains.choose(price - 1)[1].sum()) > n


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 6), st.data())
def test_matches_bisection(b, data):
    cols = data.draw(st.integers(1, 5))
    first = data.draw(prob_matrix(b, cols, min_cols=cols))
    second = data.draw(prob_matrix(b, cols, min_cols=cols))
    budgets = data.draw(st.lists(st.integers(0, 2 * b * cols + 1), min_size=1, max_size=4))
    check(two_chains(first, second), budgets)


@pytest.mark.parametrize("seed", range(4))
def test_wide_and_chunked(seed, monkeypatch):
    """Long chains, near-ties between the chains, and the breakpoint matrix split into chunks."""
    from calib.allocate import reference

    monkeypatch.setattr(reference, "_BREAKPOINT_ENTRIES", 40 * 40 * 7)  # 7 rows per chunk
    gen = torch.Generator().manual_seed(seed)
    b, k = 60, 40
    first = torch.rand(b, k, generator=gen) ** 0.05
    second = torch.where(
        torch.rand(b, k, generator=gen) < 0.5, first, torch.rand(b, k, generator=gen) ** 0.02
    )
    second[torch.rand(b, k, generator=gen) < 0.03] = float("nan")
    chains = two_chains(first, second)
    check(chains, [0, 1, 7, b, b * k // 3, b * k, 2 * b * k - 1, 2 * b * k])
