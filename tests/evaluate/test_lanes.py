"""replay.lanes: B lanes each following a request through its text (SYNTHETIC banks written by hand, not engine data)."""

from pathlib import Path

import numpy as np
import pytest

from calib.cost import make_curve
from calib.evaluate.data import Chain, EvalBank
from calib.evaluate.replay import ReplayConfig, replay_setting, summarise, train_mean_curve
from calib.evaluate.replay.driver import _computed
from calib.evaluate.replay.lanes import _lanes, requests_of, run_lanes
from calib.policies import policy_of_row
from calib.policies.setting import StepBatch

K = 4
NO = [0.0] * K  # a chain rejected at its first token


def bank_of(requests: list[list[tuple[list, list | None]]]) -> EvalBank:
    """One round per text position: per request, [(model chain mask, n-gram chain mask or None), ...]."""
    acc_m, acc_n, prompt, pos = [], [], [], []
    for r, rounds in enumerate(requests):
        for x, (m, n) in enumerate(rounds):
            acc_m.append(m)
            acc_n.append([np.nan] * K if n is None else n)
            prompt.append(r)
            pos.append(100 + x)  # the prompt's 100 tokens, then the text
    R = len(prompt)
    chains = {"model": Chain("model", np.asarray(acc_m, float)),
              "ngram": Chain("ngram", np.asarray(acc_n, float))}
    return EvalBank("synthetic", Path("synthetic"), np.array(["chat"] * R, dtype=object), np.asarray(prompt),
                    np.array(["test"] * R, dtype=object), chains, "model", None, False, "synthetic",
                    cached=np.asarray(pos))


def cfg(**kw):
    return ReplayConfig(draft_cost={"model": 0.0, "ngram": 0.0}, policies=("no_spec", "second_fixed"), **kw)


CURVE = make_curve("parametric", {"kind": "parametric", "weight_read": 1.0, "per_position": 0.01}, 64)


def lanes(bank, B, name):
    req = requests_of(bank, np.arange(len(bank.prompt_idx)))
    return run_lanes(req, B, name, lambda s: _computed(policy_of_row(name), s), CURVE, cfg(), train_mean_curve(bank))


def test_a_lane_starts_each_step_where_its_last_ended():
    """A copied span the n-gram chain drafts from positions 0-7 (accepting min(4, 8 - x) tokens at x), recorded by an
    engine whose own chain committed one token a round. vLLM's n-gram arm at K = 4 starts at 0 (commits 5), at 5
    (commits 4), at 9 (1): 3 steps for the 10 tokens. Dealt, each recorded round counts for 1/p of a step wherever
    it starts, 4.08 steps: the rate at positions no lane of that arm starts from."""
    span = [([1.0] * min(4, 8 - x) + [0.0] * (K - min(4, 8 - x)))[:K] for x in range(10)]
    bank = bank_of([[(NO, s) for s in span]])
    row = lanes(bank, 1, "second_fixed_4")
    assert row["tokens"] == 10 and row["steps"] == 3
    sb = StepBatch(bank, np.arange(10), np.arange(10)[:, None])
    dealt = summarise(replay_setting(sb, CURVE, cfg(), train_mean_curve(bank)), 1, sb.covered)["second_fixed_4"]
    assert dealt["steps"] == pytest.approx(5 * 0.2 + 1 / 4 + 1 / 3 + 1 / 2 + 1 + 1)


def test_lanes_take_the_next_prompt_and_count_the_steady_steps():
    """Two lanes, three requests of 4, 2 and 3 tokens, no speculation: request 2 takes the lane request 1 leaves
    after step 2; steps 1-4 have both lanes busy (the steady state, 8 tokens), step 5 one."""
    bank = bank_of([[(NO, None)] * 4, [(NO, None)] * 2, [(NO, None)] * 3])
    row = lanes(bank, 2, "no_spec")
    assert row["steps"] == 4 and row["tokens"] == 8 and row["rounds"] == 8
    lone = lanes(bank_of([[(NO, None)] * 4]), 2, "no_spec")  # fewer requests than lanes: never steady, every step
    assert lone["steps"] == 4 and lone["tokens"] == 4


def test_a_category_with_fewer_prompts_than_the_cell_serves_is_served_again_from_the_top():
    """bench/serve.py's cell at c = 2 with cell_prompts (min 1, 2 a client) serves 4 requests; a category of 2 prompts
    serves each twice, so that both lanes stay busy: [0, 1, 0, 1] ends on both lanes at step 6, 12 tokens, every step
    steady, where one pass over the prompts was steady for 2 steps only."""
    from calib.evaluate.replay.lanes import served_order

    assert served_order(60, 64, (8, 2)) == [i % 60 for i in range(128)]  # the c = 64 cell of a 60-prompt category
    assert served_order(60, 4, (8, 2)) == list(range(60)) and served_order(3, 64, None) == [0, 1, 2]
    bank = bank_of([[(NO, None)] * 4, [(NO, None)] * 2])
    req = requests_of(bank, np.arange(6))
    once = run_lanes(req, 2, "no_spec", lambda s: _computed(policy_of_row("no_spec"), s), CURVE, cfg(),
                     train_mean_curve(bank))
    assert once["steps"] == 2 and once["tokens"] == 4  # 2 requests on 2 lanes: steady only until the short one ends
    again = run_lanes(req, 2, "no_spec", lambda s: _computed(policy_of_row("no_spec"), s), CURVE,
                      cfg(cell_prompts=(1, 2)), train_mean_curve(bank))
    assert again["steps"] == 6 and again["tokens"] == 12  # [0, 1, 0, 1]: lanes busy until the last request's end


def test_banks_without_positions_or_with_overlapping_rounds_are_replayed_dealt():
    bank = bank_of([[(NO, None)] * 3])
    assert requests_of(bank, np.arange(3)) is not None
    bank.cached = None
    assert requests_of(bank, np.arange(3)) is None
    overlapping = bank_of([[([1.0, 1.0, 0.0, 0.0], None), (NO, None)]])  # round 0 covers 3 tokens, round 1 starts at 1
    assert requests_of(overlapping, np.arange(2)) is None


def test_a_stateful_policy_is_told_its_lanes_and_keeps_its_memory_across_steps():
    """vLLM's adaptive verification learns across steps (its estimator; each request's stale confidences): on lanes
    it sees which lane each row is and whether its request is new, and one memory for the whole run. Three requests
    of 4, 2 and 3 tokens on two lanes: request 2 takes lane 1 at step 3, lane 1 serves alone at step 5."""
    bank = bank_of([[(NO, None)] * 4, [(NO, None)] * 2, [(NO, None)] * 3])
    bank.chains["model"].p_raw = np.full((9, K), 0.6)
    req = requests_of(bank, np.arange(9))
    seen = []

    def run(s):
        seen.append((s.lanes.index.tolist(), s.lanes.fresh.tolist(), s.lanes.memory))
        return _computed(policy_of_row("vllm_adaptive"), s)

    c = ReplayConfig(draft_cost={"model": 0.0, "ngram": 0.0}, policies=("no_spec", "vllm_adaptive"))
    row = run_lanes(req, 2, "vllm_adaptive", run, CURVE, c, train_mean_curve(bank), stateful=True)
    assert [(i, f) for i, f, _ in seen] == [([0, 1], [True, True]), ([0, 1], [False, False]),
                                            ([0, 1], [False, True]), ([0, 1], [False, False]), ([1], [False])]
    memory = seen[0][2]
    assert all(m is memory for _, _, m in seen) and memory["estimator"].steps_since_refit == 5
    assert memory["stale"].shape == (2, K) and row["steps"] == 4  # the steady steps


def test_one_lane_decides_its_requests_together_as_one_lane_would_in_turn():
    """At B = 1 the requests are independent: their steps are decided in one call per round of steps, which must
    total what one lane serving them in turn totals (two requests, an arm whose depth matters, and the oracle)."""
    span = [([1.0] * min(4, 8 - x) + [0.0] * (K - min(4, 8 - x)))[:K] for x in range(10)]
    bank = bank_of([[(NO, s) for s in span], [(NO, s) for s in span[3:]], [(NO, None)] * 3])
    req = requests_of(bank, np.arange(len(bank.prompt_idx)))
    c = ReplayConfig(draft_cost={"model": 0.0, "ngram": 0.0}, policies=("no_spec", "second_fixed", "oracle"),
                     weighting="rounds")
    for name in ("second_fixed_2", "oracle", "no_spec"):
        def run(s, name=name):
            return _computed(policy_of_row(name), s)
        together = run_lanes(req, 1, name, run, CURVE, c, train_mean_curve(bank))
        in_turn = _lanes(req, 1, name, run, CURVE, c, train_mean_curve(bank))
        for k in ("tokens", "cost", "positions", "steps"):
            assert together[k] == pytest.approx(in_turn[k]), (name, k)
