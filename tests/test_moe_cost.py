"""MoE verify-cost model and its use as a shape-aware cost curve (SYNTHETIC configs, uniform routing)."""

import numpy as np
import pytest

from calib.evaluate.cost import CostCurve, make_curve
from calib.moe.cost import MoECost, break_even_alpha, depth_counts, shape_counts

CFG = {"kind": "moe", "unit": "s", "layers": 2, "n_experts": 8, "top_k": 2, "expert_params": 1e6,
       "dense_params": 4e6, "bytes_per_param": 1, "bandwidth_gbs": 1.0, "flops_per_position": 1e3,
       "peak_tflops": 1.0, "distinct": {"model": "uniform"}}


def _by_hand(total_positions):
    distinct = 8 * (1 - (1 - 2 / 8) ** total_positions)  # uniform: only the total matters
    return (4e6 + 1e6 * 2 * distinct) / 1e9


def test_step_cost_by_hand():
    cm = MoECost(CFG)
    for shape in ([1], [3], [1, 1, 1], [2, 5]):
        assert cm.shape_cost(shape) == pytest.approx(_by_hand(sum(shape)), rel=1e-12)


def test_compute_bound_when_flops_dominate():
    cm = MoECost({**CFG, "flops_per_position": 1e9, "peak_tflops": 1e-3})  # 1 s per position
    assert cm.shape_cost([3, 1]) == pytest.approx(4.0)


def test_even_curve_spreads_positions():
    cm = MoECost(CFG)
    curve = cm.even_curve(2, 8)
    assert curve[5] == pytest.approx(cm.shape_cost([2, 3]))
    assert curve[1] == pytest.approx(curve[2])  # T < B repeats T = B
    np.testing.assert_array_equal(shape_counts([[2, 3]]), [[0, 0, 1, 1]])
    np.testing.assert_array_equal(depth_counts(np.array([[0, 2]]), 2), [[0, 1, 0, 1]])


def test_moe_curve_charges_shapes_and_prices_even_spread():
    curve = make_curve("moe", CFG, t_max=20)
    assert isinstance(curve, CostCurve)
    c4 = curve.for_batch(4)
    depth = np.array([[0, 1, 2, 3], [2, 2, 2, 2]])
    np.testing.assert_allclose(c4.charge(depth), [_by_hand(10), _by_hand(12)])
    assert c4.values[4 * 3] == pytest.approx(c4.charge(np.array([[2, 2, 2, 2]]))[0])


def test_plain_curves_charge_by_total_positions():
    curve = make_curve("parametric", {"kind": "parametric", "weight_read": 1.0, "per_position": 0.5}, t_max=10)
    assert curve.for_batch(3) is curve
    np.testing.assert_allclose(curve.charge(np.array([[1, 2, 0]])), [1.0 + 0.5 * 6])


def test_break_even_alpha_hand_cases():
    assert break_even_alpha(2.0, 4.0) == 0.0  # depth repeats its k experts: any acceptance pays
    assert break_even_alpha(3.0, 3.0) == 1.0  # no sharing: depth must always be accepted to tie


def test_config_errors_are_named():
    with pytest.raises(ValueError, match="missing"):
        MoECost({"kind": "moe"})
    with pytest.raises(ValueError, match="needs distinct.routing"):
        MoECost({**CFG, "distinct": {"model": "maxent"}})
