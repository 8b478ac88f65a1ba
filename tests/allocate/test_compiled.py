"""The compiled plan (calib/allocate/compiled.py) answers as the vectorised plan (draft._plan_all) and the
plan-by-plan loop (draft._plan_draft_loop), bit for bit, on SYNTHETIC plans (tests/allocate/test_draft.py's:
ended chains, tied and out-of-range probabilities, curves that end or turn infinite, one chain or two, either
chain planned); and its outer loop runs as Python too, over the helpers as numba left them (compiled where it
is installed)."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

from calib.allocate import draft, plan_draft
from calib.allocate.compiled import plan_all_loops
from tests.allocate.test_draft import _random_case, _same_plan

# Whether numba is there, asked without importing it: collecting this file must not load numba (llvmlite), since
# vLLM's CPU platform, registering its kernels (tests/vllm/test_lean_recovered_draw.py does at import), scans every
# loaded module and trips over llvmlite's library object
NO_NUMBA = importlib.util.find_spec("numba") is None


def _inputs(known, forecast, kw):
    """The plan's arrays as plan_draft hands them to the kernel or to _plan_all."""
    chain = kw.get("chain", "model")
    done_p, _, done, K = draft._check_plan(known, forecast, chain, kw["pass_cost"], kw["sunk"])
    extras = [kw["sunk"] + (g - done) * kw["pass_cost"] for g in range(done, K + 1)]
    p, other, chain_first, cost64 = draft._plan_inputs(known, forecast, kw["cost"], chain, done_p, extras,
                                                       "reference")
    return p, other, chain_first, done, cost64, np.array(extras)


@pytest.mark.parametrize("seed", range(6))
def test_the_loops_are_the_vectorised_plan(seed):
    rng = np.random.default_rng(3000 + seed)
    two = 0
    for _ in range(25):
        known, forecast, kw = _random_case(rng)
        try:
            p, other, chain_first, done, cost, extras = _inputs(known, forecast, kw)
        except ValueError:  # a curve the plan refuses: plan_draft takes the loop (test_draft.py)
            continue
        want = draft._plan_all(p, other, chain_first=chain_first, done=done, cost=cost, extras=extras)
        free_p = np.zeros((p.shape[0], 0), dtype=np.float32) if other is None else other
        got = plan_all_loops(p, free_p, other is not None, chain_first, done, cost, extras)  # the Python loop
        assert got[0] == want[0] and got[1] == want[1] and np.array_equal(got[2], want[2]), (got, want)
        assert np.array_equal(got[3], want[3]) if other is not None else not got[3].any()
        two += other is not None
    assert two >= 5


@pytest.mark.skipif(NO_NUMBA, reason="numba is not installed: plan_draft runs the vectorised plan")
@pytest.mark.parametrize("seed", range(4))
def test_the_compiled_plan_is_the_vectorised_plan_and_the_loop(seed, monkeypatch):
    rng = np.random.default_rng(4000 + seed)
    cases = [_random_case(rng) for _ in range(40)]
    compiled = [plan_draft(known, forecast, **kw) for known, forecast, kw in cases]
    monkeypatch.setattr(draft, "plan_kernel", lambda: None)  # the vectorised plan
    vectorised = [plan_draft(known, forecast, **kw) for known, forecast, kw in cases]
    for (known, forecast, kw), a, b in zip(cases, compiled, vectorised, strict=True):
        loop = draft._plan_draft_loop(known, forecast, **kw)
        assert _same_plan(a, b) and _same_plan(a, loop), (kw, a, b, loop)
        assert a.drafting.dtype == torch.bool and (a.free_depth is None or a.free_depth.dtype == torch.int64)


@pytest.mark.skipif(NO_NUMBA, reason="numba is not installed: the host allocator runs in numpy")
@pytest.mark.parametrize("seed", range(4))
def test_the_compiled_host_allocation_is_the_numpy_one(seed, monkeypatch):
    """The price mode and the shape price's Dinkelbach rounds, compiled and in numpy: the same decisions and
    expected lengths bit for bit, one chain or two, on SYNTHETIC probabilities, curves and sampled prices."""
    from calib.allocate import host
    from calib.allocate.shape import ShapePrice
    from tests.allocate.test_draft import _random_curve, _random_probs

    rng = np.random.default_rng(5000 + seed)
    cases = []
    for _ in range(40):
        B, W = int(rng.integers(1, 17)), int(rng.integers(1, 7))
        first = _random_probs(rng, B, W).numpy()
        second = _random_probs(rng, B, int(rng.integers(1, 7))).numpy() if rng.random() < 0.6 else None
        cost = _random_curve(rng, B, int(rng.integers(B + 1, B + 2 * B * W + 3)))
        table = np.concatenate([[0.0], rng.uniform(0.001, 0.05, W + 1).cumsum()]) * cost[B]
        table[rng.random(W + 2) < 0.1] = np.inf
        table[0] = 0.0
        price_q = host.quantized_host(ShapePrice(float(cost[B]), torch.from_numpy(table)), B, W + 1)
        cases.append((first, second, cost, price_q))

    def run():
        return [(host._price_mode(f, s, c, (1, 2)), host._shape_mode(f, s, q, (1, 2))) for f, s, c, q in cases]

    compiled = run()
    monkeypatch.setattr(host, "kernels", lambda: None)
    for got, want in zip(compiled, run(), strict=True):
        for a, b in zip(got, want, strict=True):
            assert all(np.array_equal(x, y) and x.dtype == y.dtype for x, y in zip(a, b, strict=True)), (a, b)
    assert any(w[0][1].any() for w in compiled) and any(w[1][1].any() for w in compiled)


@pytest.mark.skipif(NO_NUMBA, reason="numba not installed: the numpy rules run, nothing is compiled")
def test_a_served_plan_compiles_nothing_after_the_warm_up():
    """Serving warms the compiled rules at engine start (calib.allocate.compiled.warm); a plan whose draft prices
    arrive as float32 must reuse that compilation, not compile another inside the first step (~1.5 s)."""
    from calib.allocate.compiled import kernels, warm

    warm()
    kernel = kernels()["plan_all_loops"]
    before = len(kernel.signatures)
    known = {"model": torch.full((4, 0), 0.5), "ngram": torch.full((4, 4), 0.7)}
    cost = torch.linspace(0.06, 0.2, 41, dtype=torch.float32)
    for price in (0.01, np.float32(0.01), np.float64(0.01)):
        plan_draft(known, torch.full((4, 4), 0.6), cost=cost, pass_cost=price, sunk=price * 0, impl="reference")
    assert len(kernel.signatures) == before
