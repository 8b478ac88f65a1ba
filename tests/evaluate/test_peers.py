"""vllm_adaptive (calib.policies.vllm_adaptive): vLLM 0.32 adaptive verification re-implemented for the replay.

SYNTHETIC data throughout: planted logistic parameters, hand-made cost tables and the tiny hand-made
bank of tests/evaluate/test_replay.py. Numerics are compared with tolerances.
"""

import itertools

import numpy as np
import pytest

from calib.evaluate.replay import ReplayConfig, replay, replay_setting, train_mean_curve
from calib.policies import policy
from calib.policies.setting import Setting, StepBatch
from calib.policies.vllm_adaptive import (
    INIT_BIAS,
    INIT_SLOPE,
    OnlineAcceptanceEstimator,
    adaptive_replay,
    assign_drafts,
    build_cost_tables,
    draft_budget,
    log_odds_feature,
    vllm_adaptive,
)
from tests.evaluate.test_replay import bank, curve  # noqa: F401  (bank is a fixture)

SYNTHETIC_SLOPE = 1.3
SYNTHETIC_BIAS = np.array([0.6, 0.1, -0.3, -0.7])


def _synthetic_stream(rng, S, B, K=4):
    """Confidences and accepted prefix lengths drawn from the planted SYNTHETIC logistic model."""
    conf = rng.beta(1.0, 2.0, size=(S, B, K))
    p = 1.0 / (1.0 + np.exp(-(SYNTHETIC_SLOPE * log_odds_feature(conf) + SYNTHETIC_BIAS[:K])))
    accepted = np.cumprod(rng.random((S, B, K)) < p, axis=2).sum(axis=2)
    return conf, accepted


def test_estimator_recovers_planted_parameters():
    rng = np.random.default_rng(0)
    S, B, K = 2000, 64, 4
    conf, accepted = _synthetic_stream(rng, S, B, K)
    est = OnlineAcceptanceEstimator(B, K)
    for s in range(S):
        est.predict(conf[s])
        # every draft verified (admitted = K): the first rejection ends what is observed (censoring)
        est.step(num_sampled=accepted[s] + 1, num_rejected=K - accepted[s])
    assert est.refits == S // est.REFIT_INTERVAL
    assert est.slope == pytest.approx(SYNTHETIC_SLOPE, abs=0.1)
    np.testing.assert_allclose(est.intercepts, SYNTHETIC_BIAS, atol=0.15)


def test_refit_is_vllms_arrowhead_newton_step():
    # With damping off, the arrowhead solve is the dense ridge-Newton step (XᵀWX + λI)⁻¹ Xᵀ(y - p).
    class Undamped(OnlineAcceptanceEstimator):
        DAMPING_OBSERVATIONS = 0.0
        REFIT_INTERVAL = 3

    rng = np.random.default_rng(1)
    K, B = 3, 40
    conf, accepted = _synthetic_stream(rng, 3, B, K)
    est = Undamped(B, K)
    rows, ys, ps = [], [], []
    for s in range(3):
        pred = est.predict(conf[s])
        n_acc = np.minimum(accepted[s], 2)  # admitted 2 of 3: position 2 is never observed
        f = log_odds_feature(conf[s])
        for i in range(B):
            for k in range(min(n_acc[i] + 1, 2)):
                rows.append(np.concatenate([[f[i, k]], np.eye(K)[k]]))
                ys.append(float(k < n_acc[i]))
                ps.append(pred[i, k])
        est.step(num_sampled=n_acc + 1, num_rejected=2 - n_acc)
    X, y, p = np.array(rows), np.array(ys), np.array(ps)
    W = p * (1 - p)
    delta = np.linalg.solve(X.T @ (W[:, None] * X) + est.L2 * np.eye(K + 1), X.T @ (y - p))
    assert est.refits == 1
    assert est.slope == pytest.approx(INIT_SLOPE + delta[0], rel=1e-6)
    np.testing.assert_allclose(est.intercepts, INIT_BIAS + delta[1:], rtol=1e-6, atol=1e-9)
    assert est.intercepts[2] == pytest.approx(INIT_BIAS)  # no observation at position 2: Δb = 0


def test_no_refit_before_the_interval():
    rng = np.random.default_rng(2)
    B, K = 16, 4
    conf, accepted = _synthetic_stream(rng, 101, B, K)
    est = OnlineAcceptanceEstimator(B, K)
    assert est.REFIT_INTERVAL == 100
    for s in range(99):
        est.predict(conf[s])
        est.step(num_sampled=accepted[s] + 1, num_rejected=K - accepted[s])
        assert est.refits == 0 and est.slope == INIT_SLOPE and (est.intercepts == INIT_BIAS).all()
    assert est.counts.sum() > 0  # it has been accumulating
    est.predict(conf[99])
    est.step(num_sampled=accepted[99] + 1, num_rejected=K - accepted[99])
    assert est.refits == 1 and est.slope != INIT_SLOPE
    assert est.counts.sum() == 0 and not est.info.any() and not est.grad.any()  # the round is cleared


def test_observation_rule_is_censored_like_vllm():
    est = OnlineAcceptanceEstimator(4, 4)
    est.predict(np.full((4, 4), 0.5))
    # (accepted, admitted): (2, 4) -> 0,1 accepted, 2 rejected, 3 unseen; (3, 3) -> 0..2 accepted, no rejection
    # seen; (0, 2) -> 0 rejected; (0, 0) -> nothing verified, nothing observed
    acc, adm = np.array([2, 3, 0, 0]), np.array([4, 3, 2, 0])
    est.step(num_sampled=acc + 1, num_rejected=adm - acc)
    assert est.counts.tolist() == [3, 2, 2, 0]
    p = 1 / (1 + np.exp(-INIT_BIAS))  # feature 0 at q = 0.5
    np.testing.assert_allclose(est.grad[:, 1], [2 * (1 - p) - p, 2 * (1 - p), (1 - p) - p, 0.0], atol=1e-12)


def test_budget_is_the_brute_force_argmax():
    rng = np.random.default_rng(3)
    for _ in range(50):
        R, K = int(rng.integers(1, 4)), int(rng.integers(1, 4))
        stale = rng.random((R, K))
        sched = rng.integers(0, K + 1, size=R)
        vt = 1.0 + rng.random() * 0.2 * np.arange(R * (K + 1) + 1) + rng.random(R * (K + 1) + 1) * 0.05
        dcost = float(rng.random())
        got = draft_budget(stale, sched, dcost, vt)
        surv = [np.prod(stale[i, : k + 1]) for i in range(R) for k in range(sched[i])]
        best, arg = -np.inf, None
        for n in range(len(surv) + 1):  # every budget; its expected tokens from the n best slots
            gp = (R + sum(sorted(surv, reverse=True)[:n])) / (dcost + vt[R + n])
            if gp > best + 1e-12:
                best, arg = gp, n
        assert got == arg


def test_budget_on_a_hand_made_case():
    # two requests, one draft each; scores 0.9, 0.2; C(T) = 1 + 0.5 (T - 2), no drafting cost:
    # budget 0: 2/1, 1: 2.9/1.5 = 1.93, 2: 3.1/2 -> 0
    vt = np.array([1.0, 1.0, 1.0, 1.5, 2.0])
    assert draft_budget(np.array([[0.9], [0.2]]), [1, 1], 0.0, vt) == 0
    vt = np.array([1.0, 1.0, 1.0, 1.05, 1.5])  # 2.9/1.05 = 2.76 > 3.1/1.5 -> 1
    assert draft_budget(np.array([[0.9], [0.2]]), [1, 1], 0.0, vt) == 1


def test_top_k_admits_the_best_survival_slots():
    rng = np.random.default_rng(4)
    for _ in range(50):
        R, K = 3, 4
        conf = rng.random((R, K)).astype(np.float32)
        sched = rng.integers(0, K + 1, size=R)
        budget = int(rng.integers(0, sched.sum() + 1))
        got = assign_drafts(conf, sched, budget)
        assert got.sum() == min(budget, sched.sum()) and (got <= sched).all()
        surv = np.cumprod(conf, axis=1)
        # brute force: among admissible prefix allocations with this total, the largest summed survival
        best = max((c for c in itertools.product(*[range(n + 1) for n in sched]) if sum(c) == got.sum()),
                   key=lambda c: sum(surv[i, :d].sum() for i, d in enumerate(c)))
        assert sum(surv[i, :d].sum() for i, d in enumerate(got)) == pytest.approx(
            sum(surv[i, :d].sum() for i, d in enumerate(best)), rel=1e-6)


def test_cost_tables_as_vllm_builds_them():
    draft, verify = build_cost_tables([(4, 2.0)], [(1, 1.0), (2, 1.5), (3, 1.4), (4, 2.0)], 6, 6)
    np.testing.assert_allclose(draft, [2.0] * 7)
    # running maximum (1.4 -> 1.5), step-function lookup, linear past the last point
    np.testing.assert_allclose(verify, [1.0, 1.0, 1.5, 1.5, 2.0, 2.5, 3.0])


def test_stream_is_causal():
    # Changing what steps >= s0 accept cannot change any decision up to s0 (the estimator learns from
    # verified steps only, and step s0's budget reads step s0 - 1's predictions).
    rng = np.random.default_rng(5)
    S, B, K, s0 = 230, 8, 4, 150
    conf, accepted = _synthetic_stream(rng, S, B, K)
    vt = 1.0 + 0.02 * np.arange(B * (K + 1) + 1)
    d1, i1 = adaptive_replay(conf, accepted, np.full((S, B), K), 0.5, vt)
    other = accepted.copy()
    other[s0:] = K - other[s0:]
    d2, i2 = adaptive_replay(conf, other, np.full((S, B), K), 0.5, vt)
    assert (d1[: s0 + 1] == d2[: s0 + 1]).all()
    assert i1["refits"] == i2["refits"] == 2 and (d1 != d2).any()


def test_policy_in_a_small_replay(bank):  # noqa: F811
    rng = np.random.default_rng(6)
    idx = np.stack([rng.permutation(4) for _ in range(30)])
    sb = StepBatch(bank, np.arange(4), idx)
    cfg = ReplayConfig(draft_cost={"model": 0.3, "ngram": 0.0}, policies=["no_spec", "vllm_adaptive", "oracle"])
    res = replay_setting(sb, curve(), cfg, train_mean_curve(bank))
    tok, cost, pos, extra = res["vllm_adaptive"]
    tok = tok.sum(-1)  # [S] a step's tokens
    s = Setting(sb, curve(), cfg, train_mean_curve(bank))
    # never beats the oracle, step by step
    o_tok, o_cost = res["oracle"][0].sum(-1), res["oracle"][1]
    assert (tok / cost <= o_tok / o_cost + 1e-9).all()
    # it costs what it drafts (K passes) plus the verify pass over B + its verified positions
    np.testing.assert_allclose(cost, curve()(4 + pos) + s.draft(s.K), rtol=1e-12)
    assert (tok >= 4).all() and (tok <= 4 + pos).all() and extra["refits"] == 0
    # no raw confidences (an n-gram bank): not applicable
    sb.p_raw = None
    assert vllm_adaptive(Setting(sb, curve(), cfg, train_mean_curve(bank))) is None


def test_policy_rows_in_the_full_replay(bank):  # noqa: F811
    cfg = ReplayConfig(batch_sizes=(1, 2, 4), min_steps=8, max_steps=8)
    assert "vllm_adaptive" in cfg.policies and policy("vllm_adaptive").kind == "step"
    rows = replay([bank], {"parametric": curve()}, cfg, progress=False)
    for cat in ("chat", "all"):
        for b in (1, 2, 4):
            r = {x["policy"]: x for x in rows if x["category"] == cat and x["batch_size"] == b}
            assert r["vllm_adaptive"]["goodput"] <= r["oracle"]["goodput"] * (1 + 1e-12)
