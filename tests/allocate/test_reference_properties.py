"""The reference allocator against independent brute-force optima (hypothesis)."""

from __future__ import annotations

import math

import pytest
import torch
from bruteforce import best_goodput, best_value_within_budget, goodput, options
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import chain_length, chains, cost_curve, instance, pair

from calib.allocate import allocate_probs

TOL = 1e-5  # fixed-point grid (2**-24 per token) and float32 products vs float64 brute force


def realised(out, model_p, ngram_p):
    """(depth, value) per request from the returned decisions, valued by the brute-force gains."""
    result = []
    for i in range(model_p.shape[0]):
        drafter, depth = int(out.drafter[i]), int(out.depth[i])
        by_id = dict(chains(model_p, ngram_p, i))
        if drafter == 0:
            assert depth == 0
            result.append((0, 0.0))
            continue
        g = by_id[drafter]
        assert 1 <= depth <= len(g), "allocated beyond the chain or a worthless token"
        result.append((depth, sum(g[:depth])))
    return result


def check_structure(out, model_p, ngram_p):
    b = model_p.shape[0]
    assert out.drafter.dtype == torch.int8 and out.depth.dtype == torch.int32
    assert out.drafter.shape == out.depth.shape == out.expected_accepted.shape == (b,)
    pairs = realised(out, model_p, ngram_p)
    for (depth, value), expected in zip(pairs, out.expected_accepted.tolist()):
        assert expected == pytest.approx(value, abs=TOL)
    return pairs


def all_options(model_p, ngram_p):
    return [options(chains(model_p, ngram_p, i)) for i in range(model_p.shape[0])]


@settings(max_examples=1000, deadline=None)
@given(instance(max_b=4, max_k=4), st.integers(0, 18))
def test_single_drafter_budget_is_optimal(inst, budget):
    model_p, _ = inst
    out = allocate_probs(pair(model_p), budget=budget)
    pairs = check_structure(out, model_p, None)
    used = sum(d for d, _ in pairs)
    positive = sum(len(chains(model_p, None, i)[0][1]) for i in range(model_p.shape[0]))
    assert used == min(budget, positive)  # the N largest positive gains, no more, no fewer
    best = best_value_within_budget(all_options(model_p, None), budget)
    assert sum(v for _, v in pairs) == pytest.approx(best, abs=TOL)


@settings(max_examples=500, deadline=None)
@given(instance(max_b=3, max_k=3), st.data())
def test_single_drafter_price_is_optimal(inst, data):
    model_p, _ = inst
    b = model_p.shape[0]
    cost = data.draw(cost_curve(max_len=b * (model_p.shape[1] + 1) + 2, min_len=b + 1))
    out = allocate_probs(pair(model_p), cost=cost)
    pairs = check_structure(out, model_p, None)
    costs = cost.tolist()
    ours = goodput(pairs, costs, b)
    best = best_goodput(all_options(model_p, None), costs, b)
    if best == -math.inf:
        assert int(out.depth.sum()) == 0
    else:
        assert ours == pytest.approx(best, rel=1e-6, abs=TOL)


@settings(max_examples=1000, deadline=None)
@given(instance(max_b=4, max_k=4, two=True), st.integers(0, 20))
def test_two_drafter_budget_bounds(inst, budget):
    model_p, ngram_p = inst
    out = allocate_probs(pair(model_p, ngram_p), budget=budget)
    pairs = check_structure(out, model_p, ngram_p)
    ours = sum(v for _, v in pairs)
    assert sum(d for d, _ in pairs) <= budget
    best_model = best_value_within_budget(all_options(model_p, None), budget)
    best_ngram = best_value_within_budget(all_options(ngram_p, None), budget)
    assert ours >= max(best_model, best_ngram) - TOL
    joint = all_options(model_p, ngram_p)
    optimum = best_value_within_budget(joint, budget)
    largest_request_gain = max(v for opts in joint for _, _, v in opts)
    assert ours <= optimum + TOL
    assert ours >= optimum - largest_request_gain - TOL


@settings(max_examples=400, deadline=None)
@given(instance(max_b=3, max_k=3, two=True), st.data())
def test_two_drafter_price_bounds(inst, data):
    model_p, ngram_p = inst
    b = model_p.shape[0]
    cost = data.draw(cost_curve(max_len=b * (model_p.shape[1] + 1) + 2, min_len=b + 1))
    out = allocate_probs(pair(model_p, ngram_p), cost=cost)
    pairs = check_structure(out, model_p, ngram_p)
    costs = cost.tolist()
    ours = goodput(pairs, costs, b)
    singles = max(
        best_goodput(all_options(model_p, None), costs, b),
        best_goodput(all_options(ngram_p, None), costs, b),
    )
    if singles == -math.inf:
        assert int(out.depth.sum()) == 0
        return
    assert ours >= singles - 1e-6 * abs(singles) - TOL  # never worse than either drafter alone
    assert ours <= best_goodput(all_options(model_p, ngram_p), costs, b) + TOL


@settings(max_examples=100, deadline=None)
@given(instance(max_b=5, max_k=5, two=True), st.integers(0, 30))
def test_chains_are_respected(inst, budget):
    """Each request verifies one chain, never past its first missing token."""
    model_p, ngram_p = inst
    out = allocate_probs(pair(model_p, ngram_p), budget=budget)
    for i in range(model_p.shape[0]):
        length = {1: chain_length(model_p, i), 2: chain_length(ngram_p, i), 0: 0}[int(out.drafter[i])]
        assert 0 <= int(out.depth[i]) <= length
