"""What the allocator refuses at its boundary, the same way for both implementations (issue 12)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from strategies import pair, two_chain_tables

from calib.allocate import GridTables, allocate, allocate_probs, check_cost
from calib.tables.io import Tables

INF, NAN = float("inf"), float("nan")
IMPLS = ["reference", "triton"]
ROOT = Path(__file__).resolve().parents[2]


def tables(reuse_last_row: bool = False) -> GridTables:
    model_grid = torch.tensor([[0.0, 0.5, 1.0], [0.2, 0.4, 0.6]])  # D = 2
    edges = torch.tensor([[1.0, 3.0], [0.5, INF]])  # F = 2
    ngram_grid = torch.arange(12, dtype=torch.float32).reshape(2, 6) / 20  # D_ng = 2
    return two_chain_tables(model_grid, edges, torch.tensor([1, 3]), ngram_grid, reuse_last_row=reuse_last_row)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("budget", [2**31, 2**31 + 5, 2**40, torch.tensor(2**31), torch.tensor(2**62)])
@pytest.mark.parametrize("two", [False, True])
def test_huge_budget_fills_every_slot(impl, budget, two):
    # Before: the kernel cast the budget to int32, so 2**31 wrapped negative and allocated nothing.
    p = torch.full((3, 4), 0.9)
    out = allocate_probs(pair(p, p if two else None), budget=budget, impl=impl)
    assert out.depth.tolist() == [4, 4, 4]


@pytest.mark.parametrize("budget", [2.5, True, torch.tensor(2.0), torch.tensor([1, 2])])
def test_budget_must_be_one_integer(budget):
    with pytest.raises(ValueError, match="budget"):
        allocate_probs(pair(torch.full((2, 2), 0.9)), budget=budget)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("n_features", [1, 3])
def test_feature_count_must_match_the_tables(impl, n_features):
    # Before: the reference raised an opaque broadcasting RuntimeError; the kernel read past the row
    # and returned an allocation.
    feats = torch.ones(2, 2, n_features)
    with pytest.raises(ValueError, match=rf"F={n_features} features per depth but the tables expect F=2"):
        allocate(tables(), pair(torch.full((2, 2), 0.9), feats), budget=3, impl=impl)


@pytest.mark.parametrize("impl", IMPLS)
def test_chains_deeper_than_the_tables_are_refused_unless_the_tables_say_so(impl):
    # Before: K = 4 on D = 2 tables silently read row 1 for depths 2 and 3.
    conf = torch.full((2, 4), 0.9)
    with pytest.raises(ValueError, match=r"signals\['model'\] has 4 depths but the tables' model.grid .* \(D=2\)"):
        allocate(tables(), pair(conf), budget=8, impl=impl)
    feats = torch.ones(2, 3, 2)
    with pytest.raises(ValueError, match=r"signals\['ngram'\] has 3 depths but the tables' ngram.grid .*\(D=2\)"):
        allocate(tables(), pair(conf[:, :2], feats), budget=8, impl=impl)
    deep = allocate(tables(reuse_last_row=True), pair(conf, feats), budget=8, impl=impl)
    reuse = tables(reuse_last_row=True)
    same = allocate_probs(pair(reuse.accept_prob("model", conf), reuse.accept_prob("ngram", feats)), budget=8, impl=impl)
    assert torch.equal(deep.depth, same.depth) and torch.equal(deep.drafter, same.drafter)


@pytest.mark.parametrize("impl", IMPLS)
def test_confidences_outside_0_1_are_refused(impl):
    with pytest.raises(ValueError, match=r"signals\['model'\]\[0, 1\] = 3.5.*\[0, 1\]"):
        allocate(tables(), pair(torch.tensor([[0.5, 3.5], [NAN, NAN]])), budget=2, impl=impl)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("cost, match", [
    (torch.ones(2), r"`cost` has 2 entries .* B=2 requests needs at least B \+ 1 = 3"),
    (torch.zeros(16), r"cost\[2\] = 0.0: the verify pass without draft tokens"),
    (-torch.ones(16), r"cost\[2\] = -1.0"),
    (torch.full((16,), NAN), r"cost\[2\] = nan"),
    (torch.tensor([9.0, 9.0, 1.0, 1.1, 0.0, 1.3]), r"cost\[4\] = 0.0: verify costs must be positive"),
    (torch.tensor([9.0, 9.0, 1.0, NAN, 1.2]), r"cost\[3\] = nan"),
])
def test_unusable_cost_curves_are_refused(impl, cost, match):
    # Before: every request silently verified nothing.
    p = torch.full((2, 3), 0.9)
    with pytest.raises(ValueError, match=match):
        allocate_probs(pair(p), cost=cost, impl=impl)
    with pytest.raises(ValueError, match=match):
        allocate(tables(reuse_last_row=True), pair(p), cost=cost, impl=impl)


def test_check_cost_accepts_usable_curves():
    check_cost(torch.tensor([NAN, 0.0, 1.0]), 2)  # entries below B are never read
    check_cost(torch.tensor([1.0, 1.0, 1.0, INF, 2.0]), 2)  # +inf: a total the engine cannot run


def test_tables_model_accept_prob_at_one_depth():
    t = Tables(two_chain_tables(torch.tensor([[0.0, 0.5, 1.0], [0.2, 0.4, 0.6]]), torch.full((1, 1), INF),
                                torch.zeros(1, dtype=torch.int64), torch.zeros(1, 1)).chains)
    ref = t.accept_prob("model", torch.tensor([0.5, NAN]), depth=1)
    assert ref[0].item() == pytest.approx(0.4) and torch.isnan(ref[1])
    # numpy arrays and lists are converted (before: AttributeError on .reshape / .to)
    for converted in (np.array([0.5, NAN]), [0.5, NAN]):
        got = t.accept_prob("model", converted, depth=1)
        torch.testing.assert_close(got, ref, rtol=0, atol=0, equal_nan=True)
    assert t.accept_prob("model", np.array([[0.5, 1.0]])).shape == (1, 2)
    with pytest.raises(ValueError, match="numpy array or a .* list of numbers"):
        t.accept_prob("model", ["high"], depth=0)
    with pytest.raises(ValueError, match="floating-point tensor"):
        t.accept_prob("model", torch.tensor([1]), depth=0)
    # Before: depth -1 and depth >= D both read the last row; logits were clamped.
    for depth in (-1, 2, 7):
        with pytest.raises(ValueError, match=rf"depth={depth}: these tables hold model depths 0..1"):
            t.accept_prob("model", torch.tensor([0.5]), depth=depth)
    with pytest.raises(ValueError, match=r"in \[0, 1\]"):
        t.accept_prob("model", torch.tensor([3.0, -2.0]), depth=0)
    t.reuse_last_row = True
    assert t.accept_prob("model", torch.tensor([0.5]), depth=7).item() == pytest.approx(0.4)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU path without the interpreter")
def test_importing_the_kernel_changes_no_environment_and_says_what_to_set():
    # Before: importing calib.allocate.triton_kernels set TRITON_INTERPRET=1 for the whole process.
    code = (
        "import os, torch\n"
        "import calib.allocate.triton_kernels\n"
        "print('TRITON_INTERPRET' in os.environ)\n"
        "from calib.allocate import allocate_probs\n"
        "try:\n"
        "    allocate_probs({'model': torch.full((2, 2), 0.9)}, budget=1, impl='triton')\n"
        "except RuntimeError as err:\n"
        "    print(err)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, cwd=ROOT,
                         env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    first, message = out.stdout.split("\n", 1)
    assert first == "False"
    assert "TRITON_INTERPRET is not set" in message and "Set TRITON_INTERPRET=1" in message
    assert "before the first `import triton`" in message


# --- declarative argument checks and request temperatures (issue 25) --------------------------------

def _temperature_tables() -> GridTables:
    """SYNTHETIC model chain cut by a temperature axis (edge 0.4): conf x temperature."""
    from calib.chains import Axis
    from calib.tables.layout import ChainTable

    grid = torch.tensor([[0.1, 0.2, 0.3, 0.7, 0.8, 0.9]])  # D = 1, G = 3 per temperature cell
    table = ChainTable.build((Axis("conf", points=3), Axis("temperature", edges=(0.4,))), grid,
                             torch.tensor([[0.4]]), torch.tensor([3]))
    return GridTables({"model": table}, reuse_last_row=True)


@pytest.mark.parametrize("bad", [NAN, -0.5, INF])
def test_a_bad_request_temperature_is_refused_not_binned(bad):
    """Before: NaN counted no edge (bucket 0) and a negative one too: an end bin, silently."""
    x = torch.tensor([[[0.9, 0.0], [0.8, 0.0]], [[0.9, bad], [0.8, bad]]])  # request 1's temperature
    with pytest.raises(ValueError, match=rf"signals\['model'\]\[1, 0, 1\] = {bad!r}: request 1's sampling temperature"):
        allocate(_temperature_tables(), {"model": x}, budget=2)
    from calib.allocate import calibrated_probs

    with pytest.raises(ValueError, match="request 1's sampling temperature"):
        calibrated_probs(_temperature_tables(), {"model": x})


def test_temperature_is_not_checked_where_there_is_no_token():
    x = torch.tensor([[[0.9, 0.0], [NAN, NAN]]])  # depth 1: no token, its context padding is NaN
    assert allocate(_temperature_tables(), {"model": x}, budget=2).depth.tolist() == [1]


@pytest.mark.parametrize("kwargs, match", [
    ({"budget": -1}, r"allocate_probs: parameter budget=-1 is invalid; it must be None or an integer in \[0, inf\)"),
    ({"budget": torch.tensor(-3)}, r"budget=tensor\(-3\) is invalid; it must be >= 0"),
    ({"budget": "8"}, r"parameter budget='8' is invalid"),
    ({"budget": 2, "impl": "cuda"}, r"parameter impl='cuda' is invalid; it must be one of 'reference', 'triton'"),
    ({"cost": torch.ones(2, 2)}, r"(?s)parameter cost=.* it must be None or a non-empty 1-D float tensor"),
])
def test_entry_arguments_are_checked_declaratively(kwargs, match):
    with pytest.raises(ValueError, match=match):
        allocate_probs(pair(torch.full((2, 2), 0.9)), **kwargs)


def test_reference_entry_checks_its_arguments():
    from calib.allocate.reference import allocate_reference

    p = torch.full((2, 2), 0.9)
    for kwargs, match in [({"budget": 2, "ids": (0, 2)}, r"parameter ids=\(0, 2\) is invalid"),
                          ({"budget": -2}, r"budget=-2 is invalid"),
                          ({}, "exactly one of"),
                          ({"budget": 1, "second_p": torch.full((3, 2), 0.9)}, "different batch sizes")]:
        with pytest.raises(ValueError, match=match):
            allocate_reference(p, **kwargs)
    with pytest.raises(ValueError, match=r"parameter first_p=.* a 2-D float tensor"):
        allocate_reference(torch.ones(2, dtype=torch.int64), budget=1)


def test_plan_and_forecast_arguments():
    from calib.allocate import forecast_probs, plan_draft

    cost = torch.linspace(1.0, 2.0, 12)
    known, fc = {"model": torch.zeros(2, 0)}, torch.full((2, 3), 0.8)
    for kwargs, match in [({"pass_cost": NAN}, r"plan_draft: parameter pass_cost=nan is invalid; it must be a finite"),
                          ({"pass_cost": 0.1, "sunk": -1.0}, r"parameter sunk=-1.0 is invalid"),
                          ({"pass_cost": 0.1, "impl": "fast"}, r"parameter impl='fast' is invalid"),
                          ({"pass_cost": 0.1, "chain": "lookahead"}, r"parameter chain='lookahead' is invalid; it must be one of 'model'")]:
        with pytest.raises(ValueError, match=match):
            plan_draft(known, fc, cost=cost, **kwargs)

    from types import SimpleNamespace

    def _T(meta):  # a stand-in for tables holding a forecast (calib.tables.Tables.forecast)
        return SimpleNamespace(meta=meta, forecast=lambda c: meta["chains"].get(c, {}).get("forecast"))
    meta = {"chains": {"model": {"forecast": {"axes": [{"name": "temperature", "kind": "bins", "edges": [0.4]}],
                                              "values": [[0.6, 0.4]]}}}}

    assert forecast_probs(_T(meta=meta), "model", np.array([[0.0], [NAN]])).tolist() == [[pytest.approx(0.6)]] * 2
    with pytest.raises(ValueError, match=r"context\[1, 0\] = -1.0: request 1's sampling temperature"):
        forecast_probs(_T(meta=meta), "model", np.array([[0.0], [-1.0]]))
    with pytest.raises(ValueError, match=r"forecast_probs: parameter depths=0 is invalid"):
        forecast_probs(_T(meta=meta), "model", None, depths=0)
    with pytest.raises(ValueError, match=r"calibrate \['model'\], not the 'ngram' chain"):
        forecast_probs(_T(meta=meta), "ngram", None)
