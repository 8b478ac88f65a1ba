"""A step's recomputed chains (calib/vllm/recomputed.py), on SYNTHETIC token buffers: the plan (before bookkeeping,
this step's tokens still in vLLM's sampled ids) and the decision (after it) see the same contexts, so a chain is
computed once per step and both read the same lists; what is computed equals the kind's own recomputation."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from calib.chains import chain, recomputed_chains
from calib.vllm.recomputed import Recomputed, StepContexts

NGRAM = next(k for k in recomputed_chains() if k.propose_batch is not None)


def _batch(requests, width: int = 64):
    """Stands for vLLM's InputBatch: (prompt, output) token lists per row (int32 buffer, as vLLM's)."""
    buf = np.zeros((len(requests), width), dtype=np.int32)
    for i, (p, o) in enumerate(requests):
        buf[i, : len(p) + len(o)] = p + o
    return SimpleNamespace(req_ids=[f"r{i}" for i in range(len(requests))], token_ids_cpu=buf,
                           num_tokens_no_spec=np.array([len(p) + len(o) for p, o in requests]),
                           num_prompt_tokens=np.array([len(p) for p, _ in requests]))


REQS = [([7, 8, 9, 10, 7, 8, 9, 10, 7], [8, 9]), ([3, 4, 5, 3, 4], [5, 3]), ([1, 2], [1]), ([5, 6, 5], [])]
SAMPLED = [[8, 9], [5, 3], [1, -1], [-1, -1]]  # this step's tokens per request (vLLM's sampled ids, -1: none)


def _before_and_after():
    before = _batch([(p, o[: len(o) - sum(t >= 0 for t in s)]) for (p, o), s in zip(REQS, SAMPLED)])
    return before, _batch(REQS)


def test_the_plans_contexts_are_the_decisions():
    before, after = _before_and_after()
    rows = list(range(len(REQS)))
    decision = StepContexts(after, rows)
    as_array = StepContexts(before, rows, np.array(SAMPLED))
    as_lists = StepContexts(before, rows, [[t for t in s if t >= 0] for s in SAMPLED])
    as_rows = StepContexts(before, rows, SAMPLED)  # a tensor's tolist, -1 padded (the plan reads these)
    assert as_array.keys == decision.keys == as_lists.keys == as_rows.keys
    assert decision.keys[0] == ("r0", 11, 9) and decision.keys[3] == ("r3", 3, 5)
    for b, (p, o) in enumerate(REQS):
        assert as_array.tokens(b).tolist() == as_lists.tokens(b).tolist() == decision.tokens(b).tolist() == p + o
        assert as_rows.tokens(b).tolist() == p + o
    # a row whose tokens do not lead it (never from vLLM): read token by token, as the lists are
    odd = StepContexts(before, rows, np.array([[-1, 8, 9], [5, -1, 3], [1, -1, -1], [-1, -1, -1]]))
    assert odd.keys == decision.keys and odd.tokens(1).tolist() == REQS[1][0] + REQS[1][1]


def test_a_step_is_recomputed_once_and_as_the_kind_recomputes_it():
    before, after = _before_and_after()
    rows = list(range(len(REQS)))
    rec = Recomputed(NGRAM, None, 3, ["match_n", "context_len"], 2048)
    plan = rec.chains(StepContexts(before, rows, np.array(SAMPLED)))
    decision = rec.chains(StepContexts(after, rows))
    assert decision[0] is plan[0] and decision[1] is plan[1]  # the plan's lists and tensor: not computed again
    mine = NGRAM.recompute(None, 3)
    for b, (p, o) in enumerate(REQS):
        want, feats = mine.propose(f"r{b}", np.array(p + o), len(p), 2048)
        assert plan[0][b] == want
        n = len(want)
        if n:
            assert plan[1][b, :n].tolist() == [[np.float32(feats["match_n"]), np.float32(feats["context_len"])]] * n
        assert np.isnan(np.asarray(plan[1][b, n:])).all()
    # a request whose context moved on is recomputed alone; the others keep their chains
    after.token_ids_cpu[3, 3] = 5
    after.num_tokens_no_spec[3] += 1
    again = rec.chains(StepContexts(after, rows))
    assert again[0][:3] == plan[0][:3] and again[0][3] == mine.propose("r3", np.array([5, 6, 5, 5]), 3, 2048)[0]
    rec.end_step()  # the batch path keeps each request's chain until its context moves
    assert rec.chains(StepContexts(after, rows))[0] is again[0]
    rec.finish("r0")
    assert "r0" not in rec.matches


def test_settings_come_from_the_kind():
    rec = Recomputed(NGRAM, (2, 3, 8), 4, [], None)  # a serving knob's settings, k capped at the engine's K
    assert rec.settings == (2, 3, 4)
    assert Recomputed(NGRAM, NGRAM.engine_settings(SimpleNamespace(prompt_lookup_min=1, prompt_lookup_max=5,
                                                                    num_speculative_tokens=3)), 3, [], None).settings \
        == (1, 5, 3)
    assert chain(NGRAM.name).serve_knob == "ngram"


def test_the_plans_lookup_inputs_are_the_decisions():
    """The plan reads its chain's lookup inputs without copying its token lists (chain_inputs_host lists=False):
    the same signals and context columns as the decision's, chains longer than k_max included (SYNTHETIC)."""
    from calib.serve.inputs import chain_inputs_host
    from tests.serve.decide_cases import random_inputs, synthetic_history, synthetic_tables

    tables = synthetic_tables()
    for seed in range(4):
        inputs = random_inputs(B=7, K=5, L=5, seed=seed)
        history = synthetic_history(inputs.req_ids, seed)
        cols_a, cols_b = {}, {}
        full, toks = chain_inputs_host(tables, inputs, history, k_max=4, columns=cols_a)
        lean, none = chain_inputs_host(tables, inputs, history, k_max=4, columns=cols_b, lists=False)
        assert none == {} and toks and sorted(full) == sorted(lean) and sorted(cols_a) == sorted(cols_b)
        for name in full:
            assert full[name].dtype == lean[name].dtype == np.float32
            assert np.array_equal(full[name], lean[name], equal_nan=True)
        for key, col in cols_a.items():
            assert np.array_equal(col, cols_b[key], equal_nan=True)
