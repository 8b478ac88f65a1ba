"""Draft-aware allocation (calib.allocate.draft): the plan against brute force on small SYNTHETIC cases,
its stop/continue behaviour, reference vs Triton, and the tables' forecast lookup."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from calib.allocate import plan_draft
from calib.allocate.forecast import forecast_probs


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
        kw = {"cost": _curve(B, K, 0.02), "pass_cost": 0.2, "sunk": 0.2}
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

    def forecast(self, chain):  # calib.tables.Tables.forecast
        return self.meta["chains"].get(chain, {}).get("forecast")


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


# -- the vectorised plan (plan_draft) against the plan-by-plan loop (_plan_draft_loop) -----------------------


def _random_probs(rng, b: int, w: int) -> torch.Tensor:
    """SYNTHETIC [b, w] confidences: uniform, coarse (many tied gains), near 1, out of [0, 1], or 1 - eps;
    about a third of the rows end early (NaN from a random depth on)."""
    kind = rng.integers(5)
    if kind == 0:
        p = rng.uniform(0, 1, (b, w))
    elif kind == 1:
        p = rng.choice([0.0, 0.25, 0.5, 0.75, 1.0], (b, w))
    elif kind == 2:
        p = rng.uniform(0.8, 1.0, (b, w)) ** 0.3
    elif kind == 3:
        p = rng.uniform(-0.2, 1.2, (b, w))
    else:
        p = 1 - rng.choice([1e-3, 1e-2, 0.05, 0.2], (b, w))
    p = p.astype(np.float32)
    for i in range(b):
        if w and rng.random() < 0.3:
            p[i, rng.integers(0, w) :] = np.nan
    return torch.from_numpy(p)


def _random_curve(rng, b: int, n: int) -> np.ndarray:
    """SYNTHETIC verify-cost curve of n entries: linear, flat then linear, steps, or +inf from some total on."""
    t = np.arange(n, dtype=np.float64)
    kind = rng.integers(4)
    if kind == 0:
        return 1 + rng.choice([0.0005, 0.002, 0.01, 0.05]) * t
    if kind == 1:
        return 1 + np.clip(t - rng.integers(0, 3 * b + 1), 0, None) / rng.choice([4, 32, 256])
    if kind == 2:
        return 1 + 0.2 * np.floor(t / rng.choice([4, 8, 16])) + rng.choice([0, 0.01]) * t
    c = 1 + rng.uniform(0, 0.05, n).cumsum()
    c[rng.integers(b + 1, n + 1) :] = np.inf
    return c


def _random_case(rng):
    B, K = int(rng.integers(1, 65)), int(rng.integers(1, 17))
    done = int(rng.integers(0, K + 1))
    forecast = _random_probs(rng, B, K)
    known = {"model": _random_probs(rng, B, done)}
    if rng.random() < 0.6:  # a free chain, shorter or longer than K
        known["ngram"] = _random_probs(rng, B, int(rng.integers(0, K + 3)))
    c = _random_curve(rng, B, int(rng.integers(B + 1, B + 2 * B * (K + 1) + 3)))  # may end before B + 2 B K
    cost = torch.from_numpy(c).to(torch.float32 if rng.random() < 0.2 else torch.float64)
    kw = {"cost": cost, "pass_cost": float(rng.choice([0.0, 0.0, 0.001, 0.01, 0.03, 0.1, 1.0]) * c[B]),
          "sunk": float(rng.choice([0.0, 0.1, 1.0]))}
    if "ngram" in known and rng.random() < 0.2:  # plan the n-gram chain (higher id) with the model chain free
        known = {"ngram": known["model"], "model": _random_probs(rng, B, K)}
        kw["chain"] = "ngram"
    return known, forecast, kw


def _same_plan(a, b) -> bool:
    # goodput compared exactly (tolerance 0): the same float64 operations on the same exact integers
    return ((a.run_pass, a.passes, a.goodput) == (b.run_pass, b.passes, b.goodput)
            and a.drafting.dtype == b.drafting.dtype and torch.equal(a.drafting, b.drafting)
            and (a.free_depth is None) == (b.free_depth is None)
            and (a.free_depth is None or torch.equal(a.free_depth, b.free_depth)))


@pytest.mark.parametrize("seed", range(6))
def test_a_plan_that_stops_before_the_first_pass_is_the_free_chains_allocation(seed):
    """SYNTHETIC: when the plan runs no pass the model drafts nothing, and the free chain's depths it
    returns are what the allocator decides on that chain alone (serving then skips the second call)."""
    from calib.allocate import allocate_probs

    rng = np.random.default_rng(500 + seed)
    stopped = 0
    for _ in range(40):
        B, K, L = int(rng.integers(1, 9)), int(rng.integers(1, 6)), int(rng.integers(1, 6))
        ngram = rng.uniform(0, 1, (B, L)).astype(np.float32)
        ngram[rng.uniform(size=(B, L)) < 0.2] = np.nan  # chains that end early
        ngram = torch.from_numpy(np.where(np.isnan(ngram).cumsum(axis=1) > 0, np.float32(np.nan), ngram))
        cost = _curve(B, max(K, L), float(rng.choice([0.005, 0.05, 0.3])))
        plan = plan_draft({"model": torch.zeros(B, 0), "ngram": ngram},
                          torch.from_numpy(rng.uniform(0, 1, (B, K)).astype(np.float32)), cost=cost,
                          pass_cost=float(rng.choice([0.1, 1.0, 100.0])))
        assert plan.free_depth is not None and plan.free_depth.dtype == torch.int64
        if plan.passes:
            continue
        stopped += 1
        alone = allocate_probs({"ngram": ngram}, cost=cost)
        assert torch.equal(plan.free_depth, alone.depth.to(torch.int64)), (ngram, plan, alone)
    assert stopped >= 10


@pytest.mark.parametrize("seed", range(8))
def test_vectorised_plan_equals_the_plan_by_plan_loop(seed, monkeypatch):
    from calib.allocate import draft

    loop = draft._plan_draft_loop
    rng = np.random.default_rng(1000 + seed)
    cases = [_random_case(rng) for _ in range(50)]
    expected = [loop(known, forecast, **kw) for known, forecast, kw in cases]

    def no_fallback(*args, **kwargs):
        raise AssertionError("plan_draft fell back to the loop")

    monkeypatch.setattr(draft, "_plan_draft_loop", no_fallback)  # every case takes the vectorised path
    for (known, forecast, kw), want in zip(cases, expected, strict=True):
        got = plan_draft(known, forecast, **kw)
        assert _same_plan(got, want), ({n: tuple(p.shape) for n, p in known.items()}, tuple(forecast.shape), kw,
                                       got, want)


def test_vectorised_gains_equal_the_reference_survival():
    from calib.allocate.draft import _gains
    from calib.allocate.reference import survival

    rng = np.random.default_rng(3)
    values = [np.nan, np.inf, -np.inf, 0.0, -0.0, 1.0, 0.5, 1e-30, 1e-45, 1 - 1e-7]
    for p in (rng.uniform(-0.5, 1.5, (40, 9)), np.exp(-rng.uniform(0, 30, (40, 9))),  # products below 2**-126
              rng.choice(values, (40, 9)), rng.uniform(0, 1, (40, 17)) ** 0.1, np.zeros((3, 0))):
        p = p.astype(np.float32)
        q = _gains(p)
        assert q.dtype == np.int64 and np.array_equal(q[:, : p.shape[1]], survival(torch.from_numpy(p))[1].numpy())


def test_unusual_inputs_take_the_loop_and_answer_the_same():
    from calib.allocate.draft import _plan_draft_loop

    f = torch.full((3, 2), 0.9)
    for known, forecast, cost in [
        ({"model": torch.zeros(0, 0)}, torch.zeros(0, 2), _curve(1, 2)),  # B = 0: the loop
        ({"model": torch.zeros(3, 0)}, torch.zeros(3, 0), _curve(3, 0)),  # K = 0: vectorised, one plan
        ({"model": torch.zeros(3, 0), "ngram": torch.zeros(3, 0)}, f, _curve(3, 2)),  # an empty free chain
    ]:
        want = _plan_draft_loop(known, forecast, cost=cost, pass_cost=0.1)
        assert _same_plan(plan_draft(known, forecast, cost=cost, pass_cost=0.1), want)
    # refusals are the loop's (it raises what allocate_probs does)
    bad_cost = _curve(3, 2).clone()
    bad_cost[5] = float("nan")
    for known, kw in [
        ({"model": torch.zeros(3, 0)}, {"cost": torch.ones(3, dtype=torch.float64)}),  # no entry for T = B
        ({"model": torch.zeros(3, 0)}, {"cost": bad_cost}),
        ({"model": torch.zeros(3, 0), "ngram": torch.zeros(2, 2)}, {"cost": _curve(3, 2)}),  # batch sizes differ
        ({"model": torch.zeros(3, 0), "nope": torch.zeros(3, 2)}, {"cost": _curve(3, 2)}),  # not a chain
        ({"model": torch.zeros(3, 0)}, {"cost": _curve(3, 2), "sunk": 1e308, "pass_cost": 1e308}),
    ]:
        kw.setdefault("pass_cost", 0.1)
        with pytest.raises(ValueError) as loop_err:
            _plan_draft_loop(known, f, **kw)
        with pytest.raises(ValueError) as fast_err:
            plan_draft(known, f, **kw)
        assert str(fast_err.value) == str(loop_err.value)


@pytest.mark.parametrize("seed", range(6))
def test_the_serving_plans_first_pass_on_numpy_is_plan_drafts(seed):
    """SYNTHETIC: plan_first_pass_host (serving's plan before the first pass: numpy in, one compiled call) returns
    plan_draft's passes and free-chain depths on the same forecast, free chain, curve and pass price."""
    from calib.allocate.compiled import plan_kernel
    from calib.allocate.draft import plan_first_pass_host

    if plan_kernel() is None:
        pytest.skip("numba is not installed: serving takes plan_draft")
    rng = np.random.default_rng(2000 + seed)
    answered = 0
    for _ in range(60):
        known, forecast, kw = _random_case(rng)
        if kw.get("chain", "model") != "model":
            continue
        B = forecast.shape[0]
        free = known.get("ngram")
        cost = kw["cost"].to(torch.float64)
        want = plan_draft({"model": torch.zeros(B, 0), **({} if free is None else {"ngram": free})}, forecast,
                          cost=cost, pass_cost=kw["pass_cost"])
        got = plan_first_pass_host(forecast.numpy(), None if free is None else free.numpy(), cost=cost.numpy(),
                                   pass_cost=kw["pass_cost"], chain_first=True)
        if got is None:  # a curve plan_draft prices at its own pace (infinite at B): it is the one to ask then
            assert not np.isfinite(cost.numpy()[B])
            continue
        answered += 1
        assert got[0] == want.passes
        assert (got[1] is None) == (want.free_depth is None)
        assert got[1] is None or np.array_equal(got[1], want.free_depth.numpy())
    assert answered >= 20
