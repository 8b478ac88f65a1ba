"""Draft-aware allocation (calib.allocate.draft): the plan against brute force on small SYNTHETIC cases,
its stop/continue behaviour, reference vs Triton, and the tables' forecast lookup."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from calib.allocate import plan_draft
from calib.allocate.draft import forecast_probs


def _curve(B, K, slope=0.05):
    return torch.tensor([1.0 + slope * t for t in range(B * (K + 1) + 1)], dtype=torch.float64)


def _brute(p: np.ndarray, cost: np.ndarray, pass_cost: float) -> float:
    """max over passes g and depths d_i <= g of (B + sum_i sum_{k<d_i} S_ik) / (cost[B + sum d] + g pass_cost)."""
    B, K = p.shape
    S = np.cumprod(p, axis=1)
    best = -np.inf
    for d in itertools.product(range(K + 1), repeat=B):
        g = max(d)
        gain = sum(S[i, : d[i]].sum() for i in range(B))
        best = max(best, (B + gain) / (cost[B + sum(d)] + g * pass_cost))
    return best


@pytest.mark.parametrize("seed", range(12))
def test_plan_is_the_best_number_of_passes_and_allocation(seed):
    rng = np.random.default_rng(seed)
    B, K = 3, 3
    p = rng.uniform(0.05, 0.99, (B, K)).astype(np.float32)
    pass_cost = float(rng.choice([0.0, 0.05, 0.3, 1.0]))
    cost = _curve(B, K, slope=float(rng.choice([0.01, 0.1, 0.4])))
    plan = plan_draft({"model": torch.zeros(B, 0)}, torch.from_numpy(p), cost=cost, pass_cost=pass_cost)
    truth = _brute(p.astype(np.float64), cost.numpy(), pass_cost)
    assert plan.goodput == pytest.approx(truth, rel=1e-6)  # fixed-point gains: 2**-24 per token
    assert plan.run_pass == (plan.passes > 0)
    assert plan.drafting.any() == plan.run_pass


def test_expensive_passes_stop_and_free_passes_draft_everyone():
    B, K = 4, 4
    f = torch.full((B, K), 0.9)
    stop = plan_draft({"model": torch.zeros(B, 0)}, f, cost=_curve(B, K, 0.01), pass_cost=100.0)
    assert not stop.run_pass and stop.passes == 0 and not stop.drafting.any()
    go = plan_draft({"model": torch.zeros(B, 0)}, f, cost=_curve(B, K, 0.0001), pass_cost=0.0)
    assert go.run_pass and go.passes == K and go.drafting.all()


def test_a_request_whose_chain_ended_does_not_draft():
    B, K = 3, 4
    known = torch.tensor([[0.95], [float("nan")], [0.9]])
    plan = plan_draft({"model": known}, torch.full((B, K), 0.95), cost=_curve(B, K, 0.001), pass_cost=0.01)
    assert plan.run_pass and plan.drafting.tolist() == [True, False, True]


def test_free_chain_known_in_full_can_make_the_model_pass_unnecessary():
    # the n-gram chain is known before the model drafts; a sure n-gram chain beats paying a model pass
    B, K = 2, 3
    ngram = torch.full((B, K), 0.99)
    model_only = plan_draft({"model": torch.zeros(B, 0)}, torch.full((B, K), 0.6), cost=_curve(B, K, 0.01),
                            pass_cost=0.3)
    both = plan_draft({"model": torch.zeros(B, 0), "ngram": ngram}, torch.full((B, K), 0.6),
                      cost=_curve(B, K, 0.01), pass_cost=0.3)
    assert model_only.run_pass and not both.run_pass and both.goodput > model_only.goodput


def test_reference_and_triton_plans_are_identical():
    rng = np.random.default_rng(7)
    for _ in range(4):
        B, K = 5, 4
        f = torch.from_numpy(rng.uniform(0.1, 0.95, (B, K)).astype(np.float32))
        known = {"model": f[:, :1].clone(), "ngram": torch.from_numpy(rng.uniform(0, 1, (B, 3)).astype(np.float32))}
        kw = dict(cost=_curve(B, K, 0.02), pass_cost=0.2, sunk=0.2)
        ref, tri = (plan_draft(known, f, impl=impl, **kw) for impl in ("reference", "triton"))
        assert (ref.run_pass, ref.passes, ref.goodput) == (tri.run_pass, tri.passes, tri.goodput)
        assert torch.equal(ref.drafting, tri.drafting)


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="known"):
        plan_draft({"ngram": torch.zeros(2, 1)}, torch.zeros(2, 2), cost=_curve(2, 2), pass_cost=0.1)
    with pytest.raises(ValueError, match="forecast must be"):
        plan_draft({"model": torch.zeros(2, 0)}, torch.zeros(3, 2), cost=_curve(2, 2), pass_cost=0.1)
    with pytest.raises(ValueError, match="pass_cost"):
        plan_draft({"model": torch.zeros(2, 0)}, torch.zeros(2, 2), cost=_curve(2, 2), pass_cost=-1.0)


class _Tables:
    def __init__(self, forecast):
        self.meta = {"chains": {"model": {"forecast": forecast}}}


def test_forecast_lookup_by_context_cell():
    fc = {"axes": [{"name": "temperature", "kind": "bins", "edges": [0.4]}],
          "values": [[0.6, 0.4], [0.7, 0.5]], "samples": [[10, 10], [5, 5]]}
    out = forecast_probs(_Tables(fc), "model", np.array([[0.0], [0.8], [np.nan]]), depths=3)
    # T=0 -> cell 0, T=0.8 -> cell 1, NaN -> bucket 0; depth 2 repeats the last row
    assert np.allclose(out.numpy(), [[0.6, 0.7, 0.7], [0.4, 0.5, 0.5], [0.6, 0.7, 0.7]])
    with pytest.raises(ValueError, match="temperature"):
        forecast_probs(_Tables(fc), "model", np.zeros((2, 2)))
    with pytest.raises(ValueError, match="no forecast"):
        forecast_probs(_Tables(None), "model", None)
