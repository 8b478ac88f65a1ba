"""MoE verify-cost model and its use as a shape-aware cost curve (SYNTHETIC configs, uniform routing)."""

import numpy as np
import pytest

from calib.cost import CostCurve, make_curve
from calib.cost.moe import MoECost, break_even_alpha, depth_counts, shape_counts

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


def test_replay_charges_the_actual_shape(tmp_path):
    """On the hand-made replay bank (SYNTHETIC), a shape-sensitive MoE cost charges each policy the
    cost of the depths it chose, not the even-spread price the allocator saw."""
    from calib.cost import MoECurve
    from calib.cost.distinct import MaxEntPairwise
    from calib.cost.trajectories import Trajectories, one_hot
    from calib.evaluate.data import load_eval_bank
    from calib.evaluate.replay import ReplayConfig, replay_setting, train_mean_curve
    from calib.policies.setting import StepBatch
    from tests.evaluate.test_replay import identity_tables, tiny_bank

    rng = np.random.default_rng(0)
    # SYNTHETIC routing: a position keeps the previous position's experts half of the time, so
    # consecutive positions share experts (depth is cheaper than width).
    seqs = []
    for _ in range(20):
        ids = np.argsort(rng.random((30, 2, 8)), axis=2)[..., :2]
        for p in range(1, 30):
            if rng.random() < 0.5:
                ids[p] = ids[p - 1]
        seqs.append(one_hot(ids.astype(np.uint8), 8))
    tr = Trajectories(seqs, np.array(["synthetic"] * 20, dtype=object), np.arange(20), 8, 2)
    cm = MoECost(CFG)
    cm.model = MaxEntPairwise(max_chain=5).fit(tr)
    curve = MoECurve("moe", cm, t_max=40, unit="s").for_batch(4)
    bank = load_eval_bank(tiny_bank(tmp_path), identity_tables(tmp_path), fractions=(0, 0, 1))
    sb = StepBatch(bank, np.arange(4), np.array([[0, 1, 2, 3]]))
    res = replay_setting(sb, curve, ReplayConfig(draft_cost={"model": 0.0, "ngram": 0.0}), train_mean_curve(bank))
    assert float(res["fixed_3"][1][0]) == pytest.approx(cm.shape_cost([4, 4, 4, 3]))
    # oracle depths 3, 2 (n-gram), 1, 2 -> positions 4, 3, 2, 3; the even spread of 12 would be 3, 3, 3, 3
    assert float(res["oracle"][1][0]) == pytest.approx(cm.shape_cost([4, 3, 2, 3]))
    assert cm.shape_cost([4, 3, 2, 3]) != pytest.approx(curve.values[12])
