"""The sampled path's price: a step under sampling that verifies draft tokens pays the rejection sampler's
random path on top of ``verify`` (calib.cost.step ``sampled``), in the fit, the replay's curve and serving's
decision. SYNTHETIC profile rows, tables and steps: made here from known coefficients, not engine data."""

import json

import numpy as np
import pytest
import torch

from calib.cost.serving import SampledPrice, prices_greedy_only, sampled_price, sampled_shape_price
from calib.cost.step import EngineStepCurve, Linear, StepCost, fit_step_cost, load_step_cost, save_step_cost
from tests.cost.test_step import TRUE, profile_rows

# 30 ms once any draft token is verified under sampling, +0.5 ms per token, +0.4 ms per request with draft tokens
JUMP = Linear(0.030, {"D": 0.0005, "R": 0.0004})
SAMPLED = StepCost(TRUE.verify, TRUE.idle, TRUE.lm_head, TRUE.more, TRUE.chain, TRUE.calib, {"what": "SYNTHETIC"},
                   sampled=JUMP)


def sampled_rows(rng, n=300):
    """Rows of a sampled profile (SYNTHETIC): TRUE's step plus the jump where draft tokens were verified."""
    rows = profile_rows(rng, n)
    for r in rows:
        d = r["tokens"] - r["batch"]
        r["sampled"], r["draft_tokens"] = True, d
        r["drafting"] = int(rng.integers(min(d, 1), min(d, r["batch"]) + 1))  # the requests the d tokens are of
        r["step_ms"] += 1e3 * float(SAMPLED.speculating_sampled(d, r["drafting"]))
    return rows


def test_the_fit_separates_the_sampled_jump_from_verify():
    rng = np.random.default_rng(1)
    fit = fit_step_cost(profile_rows(rng) + sampled_rows(rng), {"what": "SYNTHETIC"})
    for T, B in [(4, 4), (20, 4), (80, 16)]:
        assert float(fit.verify(T=T, B=B)) == pytest.approx(float(TRUE.verify(T=T, B=B)), rel=0.03)
    for d, b in [(1, 1), (8, 4), (40, 16)]:
        assert float(fit.speculating_sampled(d, b)) == pytest.approx(float(SAMPLED.speculating_sampled(d, b)), rel=0.1)
    assert float(fit.speculating_sampled(0, 16)) == 0.0  # no draft token, no jump
    greedy_only = fit_step_cost(profile_rows(np.random.default_rng(2)), {"what": "SYNTHETIC"})
    assert greedy_only.sampled.intercept == 0 and not any(greedy_only.sampled.slopes.values())


def test_the_replay_curve_prices_the_jump_above_the_batch_only():
    curve = EngineStepCurve("engine", SAMPLED, 40, batch=4)
    sampled = curve.with_sampling(True)
    assert sampled.values[4] == curve.values[4]  # T = B: no draft token verified
    assert sampled.values[5] - curve.values[5] == pytest.approx(0.030 + 0.0005 + 0.0004)  # 1 token: 1 request
    assert sampled.values[12] - curve.values[12] == pytest.approx(0.030 + 8 * 0.0005 + 4 * 0.0004)  # at most B
    depth = np.array([[2, 0, 0, 0], [0, 0, 0, 0]])  # a step charged its own drafting requests
    assert sampled.charge(depth)[0] - curve.charge(depth)[0] == pytest.approx(0.030 + 2 * 0.0005 + 0.0004)
    assert sampled.charge(depth)[1] == curve.charge(depth)[1]
    assert sampled.for_batch(8).sampled and sampled.with_drafter(True).sampled  # kept through the other views
    assert sampled.with_sampling(False).values.tolist() == curve.values.tolist()


def test_a_version_1_file_reads_with_no_jump_and_a_bad_term_is_named(tmp_path):
    path = tmp_path / "step.json"
    save_step_cost(SAMPLED, path)
    assert load_step_cost(path).sampled == JUMP
    doc = json.loads(path.read_text())
    del doc["sampled"]
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match=r"step\.json: sampled: expected"):
        load_step_cost(path)
    doc["version"] = 1  # written before the term existed: read as zero
    path.write_text(json.dumps(doc))
    assert float(load_step_cost(path).speculating_sampled(5, 4)) == 0.0


def test_serving_prices_each_drafting_request(tmp_path):
    from calib.cost.serving import serving_step_cost

    path = tmp_path / "step.json"
    save_step_cost(SAMPLED, path)
    serving_step_cost.cache_clear()
    price = sampled_price(str(path))
    assert price == SampledPrice(0.0005, 0.030 + 0.0004)  # the once-per-step jump charged per drafting request
    cost = torch.linspace(1.0, 2.0, 21, dtype=torch.float64)  # affine: 0.05 per position
    base, table = sampled_shape_price(cost, price, n_requests=4, width=3)
    assert base == pytest.approx(float(cost[4]))
    assert table.tolist() == pytest.approx([0.0, 0.05 + 0.0305 + 0.0004, 0.10 + 0.0310 + 0.0004,
                                                  0.15 + 0.0315 + 0.0004])
    assert not prices_greedy_only(str(path))
    save_step_cost(TRUE, path)  # greedy-only: nothing to add
    serving_step_cost.cache_clear()
    assert sampled_price(str(path)) is None and sampled_price("1.0,0.01") is None
    # a step cost that prices sampled steps as greedy ones is told apart from a verify-only curve (no step model)
    assert prices_greedy_only(str(path)) and not prices_greedy_only("1.0,0.01")


def test_a_step_cost_of_other_inputs_is_named(tmp_path):
    path = tmp_path / "step.json"
    save_step_cost(SAMPLED, path)
    doc = json.loads(path.read_text())
    doc["sampled"]["slopes"] = {"D": 0.0005, "B": 0.0004}
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match=r"step\.json: sampled: slopes over \['B', 'D'\]"):
        load_step_cost(path)


@pytest.mark.parametrize("bad", [(-1.0, 0.0), (float("nan"), 0.0), (0.0, float("inf"))])
def test_a_wrong_sampled_price_is_refused(bad):
    with pytest.raises(ValueError, match="SampledPrice needs finite numbers >= 0"):
        SampledPrice(*bad)


def test_a_sampled_step_drafts_nothing_where_the_jump_outweighs_the_gain_and_a_greedy_one_still_drafts():
    from calib.serve import StepInputs, decide_step
    from tests.serve.decide_cases import cheap_curve, random_inputs, synthetic_history, synthetic_tables

    t, inputs = synthetic_tables(2), random_inputs(B=5, seed=2)
    h = synthetic_history(inputs.req_ids, 2)
    cost = cheap_curve(5)
    jump = SampledPrice(0.0, 10.0)  # ten plain steps' price for each request with draft tokens
    greedy = StepInputs(inputs.req_ids, torch.zeros(5), inputs.offers)
    sampled = StepInputs(inputs.req_ids, torch.tensor([0.0, 0.0, 0.8, 0.0, 0.0]), inputs.offers)
    plain = decide_step(t, greedy, h, k_max=4, cost=cost)
    for impl in ("reference", "host"):  # serving runs host; the shape price takes the reference there
        assert decide_step(t, sampled, h, k_max=4, cost=cost, sampled_price=jump, impl=impl).drafts == [[]] * 5
    assert any(plain.drafts)  # the fixture's cheap curve pays for drafts
    assert decide_step(t, greedy, h, k_max=4, cost=cost, sampled_price=jump).drafts == plain.drafts
    assert decide_step(t, sampled, h, k_max=4, cost=cost, sampled_price=jump).drafts == [[]] * 5
    with pytest.raises(ValueError, match="needs `cost`"):
        decide_step(t, sampled, h, k_max=4, budget=10, sampled_price=jump)
