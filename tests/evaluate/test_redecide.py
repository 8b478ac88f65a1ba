"""replay.redecide: a policy inside a recorded round's stretch decides again on the rest of it (SYNTHETIC: the
four hand-written rounds of test_replay.py, not engine data)."""

import numpy as np
import pytest

from calib.cost import make_curve
from calib.evaluate.replay import ReplayConfig, replay_setting, summarise, train_mean_curve
from calib.evaluate.replay.driver import summarise_redecided
from calib.evaluate.replay.redecide import residual_batch
from calib.policies.setting import StepBatch
from tests.evaluate.test_replay import bank  # noqa: F401  (the fixture)


def flat(per_position: float):
    return make_curve("parametric", {"kind": "parametric", "weight_read": 1.0, "per_position": per_position}, 64)


def test_residual_rounds_shift_every_chain_by_what_was_committed(bank):  # noqa: F811
    """Rounds 0, 2, 3 (model chain accepted 3, 1, 2 of 3, 3, 2 drafted) left unfinished after 2, 1, 1 tokens; round 1
    (nothing accepted) crossed. Dealt two to a step, the last step padded with a round that counts for nothing."""
    sb = StepBatch(bank, np.arange(4), np.array([[0, 1], [2, 3]]))
    tokens = np.array([[2, 1], [1, 1]])
    res, rest = residual_batch(sb, tokens, sb.covered)
    model, ngram = sb.ids
    assert rest.tolist() == [[2, 1], [2, 0]]  # the stretches left (4-2, 2-1, 3-1), then the padding
    assert res.S == 2 and res.B == 2
    nan = np.nan
    # round 0, model (1,1,1) after 2: its last depth, then accepted past the recording (it was accepted throughout)
    np.testing.assert_array_equal(res.oracle[model][0, 0], [1, 1, 1])
    # round 2, model (1,0,0) after 1: the rejection, then nothing drafted (it was rejected inside the recording)
    np.testing.assert_array_equal(res.oracle[model][0, 1], [0, 0, nan])
    # round 3, model (1,1,-) after 1: its last token, then nothing (its drafter stopped at 2 of K = 3)
    np.testing.assert_array_equal(res.oracle[model][1, 0], [1, nan, nan])
    assert res.acc[model][:, 0].tolist() == [3, 1] and res.acc[model][0, 1] == 0
    assert (res.covered == rest).all()  # each stands for what is left of its stretch (the padding for nothing)
    # the n-gram chain of round 0 accepted 1 < 2 committed: it left the text and offers nothing; so round 3's (0)
    assert res.length[ngram][0, 0] == 0 and res.length[ngram][1, 0] == 0 and np.isnan(res.p_cal[ngram][0, 0]).all()
    # the model chain's probabilities shift with it; past the recording, its last drafted depth's where it goes on
    p = sb.p_cal[model]
    np.testing.assert_allclose(res.p_cal[model][0, 0], [p[0, 0, 2]] * 3)
    np.testing.assert_allclose(res.p_cal[model][1, 0], [p[1, 1, 1], nan, nan])
    assert residual_batch(sb, sb.covered, sb.covered) is None  # every stretch crossed


def test_policies_that_cross_each_stretch_are_unchanged_and_all_write_the_same_text(bank):  # noqa: F811
    sb = StepBatch(bank, np.arange(4), np.array([[0, 1], [2, 3]]))
    cfg = ReplayConfig(draft_cost={"model": 0.0, "ngram": 0.0})
    curve = flat(0.01)
    res = replay_setting(sb, curve, cfg, train_mean_curve(bank))
    before, after = summarise(res, 2, sb.covered), summarise_redecided(res, sb, curve, cfg, train_mean_curve(bank))
    text = float(sb.covered.sum())
    for name in ("fixed_3", "oracle"):  # the collector's own depth, and what commits at least as much
        assert after[name] == pytest.approx(before[name])
    for name, row in after.items():
        assert row["tokens"] == pytest.approx(text), name
    assert after["no_spec"]["steps"] == pytest.approx(before["no_spec"]["steps"])  # one token a step either way


def test_a_policy_declining_a_stretchs_first_token_takes_the_rest_in_one_step(bank):  # noqa: F811
    """Round 0 (accepted 3 of 3, so 4 tokens) with calibrated probabilities 0.3, 0.95, 0.95 and positions priced high:
    the allocator declines the unsure first token. Counted at the same rate it takes 4 steps; deciding again after
    that token, on 0.95, 0.95, 0.95, it verifies the rest and commits 4 where 3 were left: 1 + 3/4 steps."""
    bank.chains["model"].p_cal[0] = [0.3, 0.95, 0.95]
    sb = StepBatch(bank, np.arange(4), np.array([[0]]))
    cfg = ReplayConfig(draft_cost={"model": 0.0, "ngram": 0.0}, policies=("no_spec", "ragged_calibrated"))
    curve = flat(0.5)
    res = replay_setting(sb, curve, cfg, train_mean_curve(bank))
    assert res["ragged_calibrated"].tokens.tolist() == [[1]]  # declined
    before, after = summarise(res, 1, sb.covered), summarise_redecided(res, sb, curve, cfg, train_mean_curve(bank))
    assert before["ragged_calibrated"]["steps"] == pytest.approx(4.0)
    assert after["ragged_calibrated"]["steps"] == pytest.approx(1.75)
    assert after["ragged_calibrated"]["tokens"] == before["ragged_calibrated"]["tokens"] == 4
