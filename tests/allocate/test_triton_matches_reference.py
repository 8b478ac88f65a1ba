"""The Triton kernel (interpreted on CPU) takes the reference's decisions bit for bit."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import assert_same, cost_curve, instance, pair, two_chain_tables

from calib.allocate import GridTables, allocate, allocate_probs

# The interpreter is slow: few, small cases here; the reference carries the heavy property tests.
FEW = settings(max_examples=25, deadline=None)


@FEW
@given(instance(max_b=5, max_k=4, two=True), st.integers(0, 24), st.booleans())
def test_budget_mode(inst, budget, two):
    model_p, ngram_p = inst
    ngram_p = ngram_p if two else None
    ref = allocate_probs(pair(model_p, ngram_p), budget=budget)
    assert_same(ref, allocate_probs(pair(model_p, ngram_p), budget=budget, impl="triton"))


@FEW
@given(instance(max_b=4, max_k=3, two=True), st.booleans(), st.data())
def test_price_mode(inst, two, data):
    model_p, ngram_p = inst
    ngram_p = ngram_p if two else None
    cost = data.draw(cost_curve(max_len=model_p.shape[0] * 4 + 2, min_len=model_p.shape[0] + 1))
    ref = allocate_probs(pair(model_p, ngram_p), cost=cost)
    assert_same(ref, allocate_probs(pair(model_p, ngram_p), cost=cost, impl="triton"))


def random_tables(gen: torch.Generator) -> GridTables:
    model_grid = torch.rand(3, 9, generator=gen).sort(dim=1).values
    edges = torch.tensor([[0.5, 1.5, 2.5], [1.0, float("inf"), float("inf")]])
    strides = torch.tensor([1, 4])
    ngram_grid = torch.rand(2, 8, generator=gen)
    # Chains deeper than the tables (K = 5 > D = 3, L = 4 > D_ng = 2) read the last rows: allowed
    # because these tables say so.
    return two_chain_tables(model_grid, edges, strides, ngram_grid, reuse_last_row=True)


@pytest.mark.parametrize("seed", range(3))
def test_table_lookups_inside_the_kernel(seed):
    gen = torch.Generator().manual_seed(seed)
    tables = random_tables(gen)
    b, k, l = 7, 5, 4
    conf = (torch.rand(b, k, generator=gen) * 1.2 - 0.1).clamp(0, 1)  # many exactly 0 or 1
    conf[torch.rand(b, k, generator=gen) < 0.15] = float("nan")
    feats = torch.rand(b, l, 2, generator=gen) * torch.tensor([3.0, 2.0])
    feats[torch.rand(b, l, generator=gen) < 0.2, 0] = float("nan")
    # Exact grid points and bin edges exercise the boundaries of both lookups.
    conf[0, :3] = torch.tensor([0.0, 0.5, 1.0])
    feats[1, :2, 0] = torch.tensor([0.5, 2.5])
    for mode in ({"budget": 6}, {"budget": 30}, {"cost": 1 + 0.07 * torch.arange(64.0)}):
        ref = allocate(tables, pair(conf, feats), **mode)
        assert_same(ref, allocate(tables, pair(conf, feats), impl="triton", **mode))
        ref = allocate(tables, pair(conf), **mode)
        assert_same(ref, allocate(tables, pair(conf), impl="triton", **mode))


@pytest.mark.parametrize("mode", ["budget", "price"])
def test_a_padded_mid_size_batch(mode):
    """Non-power-of-two B and widths, realistic curves, many near-ties across requests."""
    gen = torch.Generator().manual_seed(7)
    b = 37
    model_p = torch.rand(b, 8, generator=gen) ** 0.25
    ngram_p = torch.rand(b, 6, generator=gen) ** 0.25
    ngram_p[torch.rand(b, generator=gen) < 0.5] = float("nan")  # half the requests have no match
    kwargs = {"budget": 90} if mode == "budget" else {"cost": 1 + 0.004 * torch.arange(b * 9 + 1.0) ** 1.5}
    ref = allocate_probs(pair(model_p, ngram_p), **kwargs)
    assert_same(ref, allocate_probs(pair(model_p, ngram_p), impl="triton", **kwargs))
    assert ref.depth.sum() > 0
