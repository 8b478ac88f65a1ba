"""Degenerate inputs and the documented tie rules, on both implementations."""

from __future__ import annotations

import pytest
import torch
from strategies import pair

from calib.allocate import allocate_probs

NAN, INF = float("nan"), float("inf")
IMPLS = ["reference", "triton"]


def run(impl, *args, **kwargs):
    return allocate_probs(pair(*args), impl=impl, **kwargs)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("mode", [{"budget": 5}, {"cost": torch.linspace(1, 2, 30)}])
def test_empty_batch(impl, mode):
    out = run(impl, torch.zeros(0, 4), torch.zeros(0, 3), **mode)
    assert out.drafter.shape == out.depth.shape == out.expected_accepted.shape == (0,)
    assert out.drafter.dtype == torch.int8 and out.depth.dtype == torch.int32


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("two", [False, True])
def test_zero_budget_allocates_nothing(impl, two):
    p = torch.full((3, 4), 0.9)
    out = run(impl, p, p if two else None, budget=0)
    assert out.depth.tolist() == [0, 0, 0] and out.drafter.tolist() == [0, 0, 0]
    assert out.expected_accepted.tolist() == [0.0, 0.0, 0.0]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("mode", [{"budget": 100}, {"cost": torch.ones(64)}])
def test_all_nan_allocates_nothing(impl, mode):
    p = torch.full((3, 4), NAN)
    for ngram in (None, torch.full((3, 2), NAN)):
        out = run(impl, p, ngram, **mode)
        assert out.depth.tolist() == [0, 0, 0] and out.drafter.tolist() == [0, 0, 0]


@pytest.mark.parametrize("impl", IMPLS)
def test_budget_ties_lower_request_then_lower_depth(impl):
    # Gains 0.5, 0.25, ... in every row: three ties at 0.5, then ties at 0.25 in request order.
    p = torch.full((3, 3), 0.5)
    assert run(impl, p, budget=4).depth.tolist() == [2, 1, 1]
    assert run(impl, p, budget=2).depth.tolist() == [1, 1, 0]
    # p = 1 makes a row flat: ties inside a row go to the lower depth first (a prefix).
    flat = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]])
    assert run(impl, flat, budget=4).depth.tolist() == [3, 1]


@pytest.mark.parametrize("impl", IMPLS)
def test_chain_ends_at_first_nan_and_at_zero(impl):
    p = torch.tensor([[0.9, NAN, 0.9, 0.9], [0.8, 0.0, 0.9, 0.9]])
    out = run(impl, p, budget=10)
    assert out.depth.tolist() == [1, 1]
    ngram = torch.tensor([[0.99], [NAN]])  # shorter than the model chain, absent for request 1
    out = run(impl, p, ngram, budget=10)
    assert out.drafter.tolist() == [2, 1] and out.depth.tolist() == [1, 1]


@pytest.mark.parametrize("impl", IMPLS)
def test_missing_ngram_equals_single_drafter(impl):
    torch.manual_seed(0)
    p = torch.rand(6, 5)
    for mode in ({"budget": 7}, {"cost": 1.0 + 0.1 * torch.arange(40.0)}):
        single = run(impl, p, **mode)
        absent = run(impl, p, torch.full((6, 3), NAN), **mode)
        assert torch.equal(single.depth, absent.depth)
        assert torch.equal(single.drafter, absent.drafter)


@pytest.mark.parametrize("impl", IMPLS)
def test_price_mode_with_infeasible_totals(impl):
    p = torch.full((2, 3), 0.9)
    just_b = torch.ones(3)  # only T = B = 2 is priced: no draft token fits
    assert run(impl, p, cost=just_b).depth.tolist() == [0, 0]
    inf_beyond = torch.tensor([1.0, 1.0, 1.0, 1.0, INF, INF, INF, INF])
    assert run(impl, p, cost=inf_beyond).depth.sum().item() == 1  # T = 3 is the only usable total


@pytest.mark.parametrize("impl", IMPLS)
def test_price_mode_flat_cost_takes_every_positive_gain(impl):
    p = torch.tensor([[0.9, 0.5, 0.0], [0.3, NAN, 0.9]])
    out = run(impl, p, cost=torch.ones(16))
    assert out.depth.tolist() == [2, 1]


@pytest.mark.parametrize("impl", IMPLS)
def test_out_of_range_probabilities_are_clamped(impl):
    p = torch.tensor([[1.5, -0.2, 0.5]])
    out = run(impl, p, budget=3)
    assert out.depth.tolist() == [1] and out.expected_accepted.tolist() == [1.0]


def test_budget_tensor_and_negative_budget():
    p = torch.full((2, 2), 0.9)
    assert allocate_probs(pair(p), budget=torch.tensor(3)).depth.sum().item() == 3
    assert allocate_probs(pair(p), budget=0).depth.sum().item() == 0
    # A negative budget is a caller's error (it used to allocate nothing, silently).
    with pytest.raises(ValueError, match=r"budget=-4 is invalid; it must be None or an integer in \[0, inf\)"):
        allocate_probs(pair(p), budget=-4)


def test_argument_errors():
    p = torch.full((2, 2), 0.9)
    with pytest.raises(ValueError):
        allocate_probs(pair(p))
    with pytest.raises(ValueError):
        allocate_probs(pair(p), budget=1, cost=torch.ones(4))
    with pytest.raises(ValueError):
        allocate_probs(pair(p, torch.full((3, 2), 0.9)), budget=1)
    with pytest.raises(ValueError):
        allocate_probs(pair(p), budget=1, impl="numpy")
