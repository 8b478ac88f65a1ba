"""The sampled path's price: a step under sampling that verifies draft tokens pays the rejection sampler's
random path on top of ``verify`` (calib.cost.step ``sampled``), in the fit, the replay's curve and serving's
decision. SYNTHETIC profile rows, tables and steps: made here from known coefficients, not engine data."""

import json

import numpy as np
import pytest
import torch

from calib.cost.serving import check_sampled_extra, sampled_cost, sampled_extra
from calib.cost.step import EngineStepCurve, Linear, StepCost, fit_step_cost, load_step_cost, save_step_cost
from tests.cost.test_step import TRUE, profile_rows

JUMP = Linear(0.030, {"D": 0.0005})  # 30 ms once any draft token is verified under sampling, +0.5 ms per token
SAMPLED = StepCost(TRUE.verify, TRUE.idle, TRUE.lm_head, TRUE.more, TRUE.chain, TRUE.calib, {"what": "SYNTHETIC"},
                   sampled=JUMP)


def sampled_rows(rng, n=300):
    """Rows of a sampled profile (SYNTHETIC): TRUE's step plus the jump where draft tokens were verified."""
    rows = profile_rows(rng, n)
    for r in rows:
        d = r["tokens"] - r["batch"]
        r["sampled"], r["draft_tokens"] = True, d
        r["step_ms"] += 1e3 * float(SAMPLED.speculating_sampled(d))
    return rows


def test_the_fit_separates_the_sampled_jump_from_verify():
    rng = np.random.default_rng(1)
    fit = fit_step_cost(profile_rows(rng) + sampled_rows(rng), {"what": "SYNTHETIC"})
    for T, B in [(4, 4), (20, 4), (80, 16)]:
        assert float(fit.verify(T=T, B=B)) == pytest.approx(float(TRUE.verify(T=T, B=B)), rel=0.03)
    assert fit.sampled.intercept == pytest.approx(JUMP.intercept, rel=0.1)
    assert float(fit.speculating_sampled(0)) == 0.0  # no draft token, no jump
    greedy_only = fit_step_cost(profile_rows(np.random.default_rng(2)), {"what": "SYNTHETIC"})
    assert greedy_only.sampled.intercept == 0 and not any(greedy_only.sampled.slopes.values())


def test_the_replay_curve_prices_the_jump_above_the_batch_only():
    curve = EngineStepCurve("engine", SAMPLED, 40, batch=4)
    sampled = curve.with_sampling(True)
    assert sampled.values[4] == curve.values[4]  # T = B: no draft token verified
    assert sampled.values[5] - curve.values[5] == pytest.approx(0.030 + 0.0005)
    assert sampled.values[12] - curve.values[12] == pytest.approx(0.030 + 8 * 0.0005)
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
    assert float(load_step_cost(path).speculating_sampled(5)) == 0.0


def test_serving_adds_the_jump_at_the_steps_draft_tokens(tmp_path):
    path = tmp_path / "step.json"
    save_step_cost(SAMPLED, path)
    extra = sampled_extra(str(path), 20)
    assert extra.shape == (21,) and float(extra[0]) == 0.0
    assert float(extra[3]) == pytest.approx(0.030 + 3 * 0.0005)
    cost = torch.linspace(1.0, 2.0, 21)
    priced = sampled_cost(cost, extra, n_requests=4)
    assert torch.equal(priced[:5], cost[:5])  # T <= B: no draft token
    assert float(priced[7] - cost[7]) == pytest.approx(float(extra[3]))
    save_step_cost(TRUE, path)  # greedy-only: nothing to add
    from calib.cost.serving import serving_step_cost

    serving_step_cost.cache_clear()
    assert sampled_extra(str(path), 20) is None and sampled_extra("1.0,0.01", 20) is None


@pytest.mark.parametrize("bad", [torch.ones(21), torch.zeros(20), torch.full((21,), float("nan")),
                                 -torch.arange(21.0)])
def test_a_wrong_sampled_price_is_refused(bad):
    with pytest.raises(ValueError, match="sampled_extra"):
        check_sampled_extra(bad, torch.ones(21))
    with pytest.raises(ValueError, match="needs `cost`"):
        check_sampled_extra(torch.zeros(21), None)


def test_a_sampled_step_drafts_nothing_where_the_jump_outweighs_the_gain_and_a_greedy_one_still_drafts():
    from calib.serve import StepInputs, decide_step
    from tests.serve.test_decide import _cheap, _history, _inputs, _tables

    t, inputs = _tables(2), _inputs(B=5, seed=2)
    h = _history(inputs.req_ids, 2)
    cost = _cheap(5)
    jump = torch.cat([torch.zeros(1), torch.full((cost.numel() - 1,), 10.0)])  # ten plain steps' price
    greedy = StepInputs(inputs.req_ids, torch.zeros(5), inputs.offers)
    sampled = StepInputs(inputs.req_ids, torch.tensor([0.0, 0.0, 0.8, 0.0, 0.0]), inputs.offers)
    plain = decide_step(t, greedy, h, k_max=4, cost=cost)
    assert any(plain.drafts)  # the fixture's cheap curve pays for drafts
    assert decide_step(t, greedy, h, k_max=4, cost=cost, sampled_extra=jump).drafts == plain.drafts
    assert decide_step(t, sampled, h, k_max=4, cost=cost, sampled_extra=jump).drafts == [[]] * 5
