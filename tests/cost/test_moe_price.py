"""The MoE shape price (calib/cost/moe.py tangent_price), the transferred distinct model and the two real-shape
configs (conf/cost/moe_qwen3_30b_a3b.yaml, moe_deepseek_v3.yaml)."""

from __future__ import annotations

import numpy as np
import pytest
import yaml

from calib.cost.distinct import ChainTransfer
from calib.cost.moe import MoECost, depth_counts, shape_counts

ROOT = __import__("pathlib").Path(__file__).resolve().parents[2]
CONFIGS = ("moe", "moe_qwen3_30b_a3b", "moe_deepseek_v3")


@pytest.fixture(scope="module", params=CONFIGS)
def cost(request) -> MoECost:
    name = request.param
    return MoECost(yaml.safe_load((ROOT / "conf" / "cost" / f"{name}.yaml").read_text())[name], ROOT)


def test_tangent_price_is_exact_at_the_reference_and_above_the_cost_elsewhere(cost):
    rng = np.random.default_rng(0)
    for batch in (1, 3, 8, 32):
        ref = rng.integers(0, 5, batch)
        base, table = cost.tangent_price(ref, 4)
        assert table[0] == 0 and (np.diff(table) >= 0).all()
        true = cost.step_cost(depth_counts(ref[None], 4))[0]
        assert base + table[ref].sum() == pytest.approx(true, rel=1e-9)
        for _ in range(20):
            d = rng.integers(0, 5, batch)
            assert cost.step_cost(depth_counts(d[None], 4))[0] <= (base + table[d].sum()) * (1 + 1e-9)


def test_depth_shares_experts_in_every_config(cost):
    """One sequence verifying 2 positions reads fewer experts than two sequences verifying 1 each."""
    depth2, width2 = cost.experts_read(shape_counts([[2], [1, 1]]))
    assert depth2 < width2
    assert cost.shape_cost([2]) < cost.shape_cost([1, 1])


def test_real_shapes_transfer_the_testbed_capture():
    for name, layers, experts in (("moe_qwen3_30b_a3b", 48, 128), ("moe_deepseek_v3", 58, 256)):
        c = MoECost(yaml.safe_load((ROOT / "conf" / "cost" / f"{name}.yaml").read_text())[name], ROOT)
        assert isinstance(c.model, ChainTransfer) and c.model_name == "transfer(maxent)"
        one = c.model.predict([1])
        assert one.shape == (layers,) and np.allclose(one, 8.0)  # one position reads its top-8
        deep = c.model.predict([6])
        assert (deep < 6 * 8).all() and (deep > 8).all()  # consecutive positions share experts
        assert (c.model.predict([1] * 6) > deep).all()  # six sequences share none beyond chance
        assert c.memory_bound(shape_counts([[5] * 128]))[0]  # the replayed grid never turns compute-bound


def test_a_mismatched_capture_without_transfer_is_refused():
    cfg = yaml.safe_load((ROOT / "conf" / "cost" / "moe_qwen3_30b_a3b.yaml").read_text())["moe_qwen3_30b_a3b"]
    cfg["distinct"] = {**cfg["distinct"], "transfer": False}
    with pytest.raises(ValueError, match="transfer"):
        MoECost(cfg, ROOT)
