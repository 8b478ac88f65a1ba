"""The host allocator (numpy, calib/allocate/host.py) takes the reference's decisions bit for bit in price mode."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import assert_same, cost_curve, instance, pair

from calib.allocate import allocate_probs


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
