"""The host allocator (numpy, calib/allocate/host.py) takes the reference's decisions bit for bit in price mode."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import assert_same, cost_curve, instance, pair
from test_shape_price import random_instance

from calib.allocate import Allocation, allocate_probs
from calib.allocate.host import allocate_chains_host, quantized_host
from calib.chains import chain


@settings(max_examples=400, deadline=None)
@given(instance(max_b=16, max_k=5, two=True), st.booleans(), st.data())
def test_price_mode(inst, two, data):
    model_p, ngram_p = inst
    ngram_p = ngram_p if two else None
    cost = data.draw(cost_curve(max_len=model_p.shape[0] * 6 + 2, min_len=model_p.shape[0] + 1))
    ref = allocate_probs(pair(model_p, ngram_p), cost=cost)
    assert_same(ref, allocate_probs(pair(model_p, ngram_p), cost=cost, impl="host"))


@settings(max_examples=50, deadline=None)
@given(instance(max_b=6, max_k=4, two=True), st.integers(0, 20))
def test_budget_mode_is_the_reference(inst, budget):
    model_p, ngram_p = inst
    ref = allocate_probs(pair(model_p, ngram_p), budget=budget)
    host = allocate_probs(pair(model_p, ngram_p), budget=budget, impl="host")
    assert torch.equal(ref.drafter, host.drafter) and torch.equal(ref.depth, host.depth)


@pytest.mark.parametrize("seed", range(6))
def test_shape_price_mode(seed):
    """The shape-aware price mode in numpy (allocate_shape_host) takes the torch reference's decisions bit for bit:
    6 seeds x 60 random instances (one or two chains, concave, convex, shared and arbitrary prices, +inf depths)."""
    gen = torch.Generator().manual_seed(7000 + seed)
    for n in range(60):
        _, model_p, ngram_p, price = random_instance(gen, n, max_b=16, max_k=5)
        ref = allocate_probs(pair(model_p, ngram_p), price=price)
        assert_same(ref, allocate_probs(pair(model_p, ngram_p), price=price, impl="host"))


@pytest.mark.parametrize("compiled", [True, False])
@pytest.mark.parametrize("seed", range(4))
def test_serving_entry(seed, compiled, monkeypatch):
    """allocate_chains_host (the serving decider's entry, numpy in and out) decides as allocate_probs does under
    both prices, and its chosen probabilities are the chosen chain's per verified token, NaN beyond: in one compiled
    call under the curve where numba is installed (compiled=True), and in numpy without it."""
    from calib.allocate import host

    if not compiled:
        monkeypatch.setattr(host, "kernels", lambda: None)
    elif host.kernels() is None:
        pytest.skip("numba is not installed: the numpy rules run")
    gen = torch.Generator().manual_seed(9100 + seed)
    for n in range(40):
        b, model_p, ngram_p, price = random_instance(gen, n, max_b=16, max_k=5)
        probs = pair(model_p, ngram_p)
        cost = 1.0 + 0.02 * torch.arange(b * 12 + 2, dtype=torch.float32) ** 1.1
        width = max(p.shape[1] for p in probs.values())
        for ref, kw in ((allocate_probs(probs, cost=cost), {"cost": cost.double().numpy()}),
                        (allocate_probs(probs, price=price), {"price_q": quantized_host(price, b, width)})):
            drafter, depth, expected, chosen = allocate_chains_host({k: v.numpy() for k, v in probs.items()}, **kw)
            assert_same(ref, Allocation(torch.from_numpy(drafter), torch.from_numpy(depth), torch.from_numpy(expected)))
            by_id = {chain(k).id: v for k, v in probs.items()}
            for i in range(b):
                d = int(depth[i])
                want = by_id[int(drafter[i])][i, :d].numpy() if d else np.zeros(0, np.float32)
                assert np.array_equal(chosen[i, :d], want) and np.isnan(chosen[i, d:]).all()
