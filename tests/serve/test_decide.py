"""calib.serve.decide's step on SYNTHETIC tables (tests/serve/decide_cases.py): draft lists within k_max and the
proposal, n-gram substitution, nothing when nothing pays, decisions identical to calib.allocate.allocate on
hand-built inputs, one-chain engines and tables. SafeDecider: tests/serve/test_safe_decider.py."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from calib.allocate import allocate
from calib.chains import chain
from calib.chains.ngram import step_feature_tensor
from calib.serve import RequestHistory, chain_inputs, decide_step
from calib.serve import decide as decide_mod
from tests.serve.decide_cases import (
    NAN,
    NG_OWN,
    cheap_curve,
    check_drafts,
    offered_tokens,
    random_inputs,
    step_inputs,
    synthetic_history,
    synthetic_tables,
    with_probs,
)


@pytest.mark.parametrize("seed", range(6))
def test_drafts_within_k_max_and_the_proposal(seed):
    t = synthetic_tables(seed)
    inputs = random_inputs(B=7, seed=seed)
    h = synthetic_history(inputs.req_ids, seed)
    for k_max in (1, 3, 4):
        out = decide_step(t, inputs, h, k_max=k_max, cost=cheap_curve(7))
        check_drafts(out, inputs, k_max)
        assert out.allocator_ms >= 0 and not out.passthrough
        out = decide_step(t, inputs, h, k_max=k_max, budget=100)  # budget mode: every token it can use
        check_drafts(out, inputs, k_max)


def test_substitution_returns_the_ngram_tokens():
    t = synthetic_tables()
    t.chains["ngram"].grid.fill_(0.95)  # n-gram chains accept more often than model drafts
    t.chains["model"].grid.fill_(0.6)
    B = 3
    inputs = step_inputs(["a", "b", "c"], [0.0, 0.8, 0.0],
                   model_tokens=[[1, 2, 3], [4, 5], []], model_conf=torch.full((B, 3), 0.9),
                   ngram_tokens=[[7, 8, 9, 10, 11], [], [12, 13]],
                   ngram_features=step_feature_tensor([{"match_n": 3, "agreement": 1.0}, None,
                                                       {"match_n": 3, "agreement": 1.0}], [5, 0, 2], NG_OWN, 5))
    out = decide_step(t, inputs, RequestHistory(), k_max=4, cost=cheap_curve(B))
    assert out.drafts == [[7, 8, 9, 10], [4, 5], [12, 13]]  # n-gram cut to k_max; b has no n-gram chain
    assert out.chain.tolist() == [chain("ngram").id, chain("model").id, chain("ngram").id]


def test_nothing_pays_nothing_drafted():
    t = synthetic_tables(1)
    inputs = random_inputs(B=5, seed=1)
    B = 5
    steep = torch.cat([torch.ones(B + 1), torch.full((50,), 1e6)])  # any draft token costs a million passes
    out = decide_step(t, inputs, synthetic_history(inputs.req_ids), k_max=4, cost=steep)
    assert out.drafts == [[]] * B and out.depth.tolist() == [0] * B and out.chain.tolist() == [0] * B
    out = decide_step(t, inputs, synthetic_history(inputs.req_ids), k_max=4, budget=0)
    assert out.drafts == [[]] * B


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("impl", ["host", "reference"])
def test_a_step_with_nothing_offered_decides_without_a_lookup_what_the_lookup_decides(seed, impl, monkeypatch):
    """No request has a token on any chain (no n-gram match anywhere): the decision is made without the tables, and
    it is the full path's, field for field and type for type."""
    t = synthetic_tables(seed + 40)
    ids = [f"r{i}" for i in range(5)]
    B, K = 5, 5
    temps = [0.0, 0.8, 0.0, 0.8, 0.0][: B]
    empty = step_inputs(ids, temps, [[] for _ in range(B)], torch.full((B, K), NAN), [[] for _ in range(B)],
                  torch.full((B, K, 2), NAN))
    h = synthetic_history(ids, seed)
    lean = decide_mod._decide_step(t, empty, h, k_max=4, cost=cheap_curve(B), budget=None, impl=impl)
    monkeypatch.setattr(decide_mod, "nothing_offered", lambda inputs, offered: False)
    full = decide_mod._decide_step(t, empty, h, k_max=4, cost=cheap_curve(B), budget=None, impl=impl)
    assert lean.drafts == full.drafts == [[]] * B
    for name in ("chain", "depth", "expected_accepted", "probs"):
        a, b = lean.host(name), full.host(name)
        assert a.dtype == b.dtype and a.shape == b.shape and ((a == b) | (np.isnan(a) & np.isnan(b))).all(), name
    monkeypatch.undo()
    one = step_inputs(ids, temps, [[] for _ in range(B)], torch.full((B, K), NAN), [[], [], [7], [], []],
                step_feature_tensor([None, None, {"match_n": 3, "agreement": 1.0}, None, None], [0, 0, 1, 0, 0],
                                    NG_OWN, K))
    assert not decide_mod.nothing_offered(one, ["model", "ngram"]) and decide_mod.nothing_offered(empty, ["ngram"])
    assert not decide_mod.nothing_offered(empty, [])  # no chain the tables calibrate: the full path says so


def _by_hand(t, inputs, h, k_max):
    """The per-chain inputs written out cell by cell from the README's recipe."""
    B = len(inputs.req_ids)
    temp = torch.as_tensor(inputs.temperature, dtype=torch.float64)
    hist = {r: h.context(r) for r in inputs.req_ids}
    sig = {}
    if "model" in inputs.offers and "model" in t.chains:
        tokens, conf = inputs.offers["model"].tokens, inputs.offers["model"].signal
        W = max(1, max(min(len(x), k_max) for x in tokens))
        x = torch.full((B, W, 3), NAN)
        for i, r in enumerate(inputs.req_ids):
            for k in range(W):
                c = float(conf[i, k]) if k < min(len(tokens[i]), k_max) else NAN
                x[i, k] = torch.tensor([c, float(temp[i]), hist[r]["prev_accept"]])
        sig["model"] = x
    if "ngram" in inputs.offers and "ngram" in t.chains:
        tokens, feats = inputs.offers["ngram"].tokens, inputs.offers["ngram"].signal
        W = max(1, max(min(len(x), k_max) for x in tokens))
        x = torch.full((B, W, 5), NAN)
        for i, r in enumerate(inputs.req_ids):
            for k in range(W):
                on = k < min(len(tokens[i]), k_max)
                f = feats[i, k] if on else torch.tensor([NAN, NAN])
                x[i, k] = torch.tensor([float(f[0]), float(f[1]), float(temp[i]), hist[r]["mean_accept"],
                                        hist[r]["position"]])
        sig["ngram"] = x
    return sig


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("offered", [("model", "ngram"), ("model",), ("ngram",)])
def test_identical_to_allocate_on_hand_built_inputs(seed, offered):
    t = synthetic_tables(seed + 10)
    inputs = random_inputs(B=6, seed=seed, model="model" in offered, ngram="ngram" in offered)
    h = synthetic_history(inputs.req_ids, seed)
    k_max = 4
    sig = _by_hand(t, inputs, h, k_max)
    built, _ = chain_inputs(t, inputs, h, k_max=k_max)
    assert built.keys() == sig.keys()
    for k in sig:
        assert torch.equal(built[k].isnan(), sig[k].isnan()) and torch.equal(built[k].nan_to_num(), sig[k].nan_to_num())
    for mode in ({"cost": cheap_curve(6)}, {"cost": torch.linspace(1.0, 4.0, 60)}, {"budget": 5}):
        ref = allocate(t, sig, **mode)
        out = decide_step(t, inputs, h, k_max=k_max, **mode)
        assert torch.equal(out.chain, ref.drafter) and torch.equal(out.depth, ref.depth)
        assert torch.equal(out.expected_accepted, ref.expected_accepted)


@pytest.mark.parametrize("seed", range(4))
def test_given_ngram_probs_decide_as_the_lookup(seed):
    """An engine that looked the n-gram chain up already (the serving plan) passes its probabilities:
    the same decision as decide_step's own lookup."""
    from calib.allocate import calibrated_probs

    t = synthetic_tables(seed + 20)
    inputs = random_inputs(B=6, seed=seed)
    h = synthetic_history(inputs.req_ids, seed)
    sig, _ = chain_inputs(t, inputs, h, k_max=4)
    given = with_probs(inputs, "ngram", calibrated_probs(t, {"ngram": sig["ngram"]})["ngram"])
    for mode in ({"cost": cheap_curve(6)}, {"cost": torch.linspace(1.0, 4.0, 60)}, {"budget": 5}):
        ref = decide_step(t, inputs, h, k_max=4, **mode)
        out = decide_step(t, given, h, k_max=4, **mode)
        assert out.drafts == ref.drafts and torch.equal(out.chain, ref.chain)
        assert torch.equal(out.expected_accepted, ref.expected_accepted)
    wrong = with_probs(inputs, "ngram", torch.zeros(6, 5))  # probabilities are used, not recomputed
    assert all(c != chain("ngram").id for c in decide_step(t, wrong, h, k_max=4, budget=5).chain.tolist())


@pytest.mark.parametrize("seed", range(6))
def test_a_chain_with_no_token_left_out_decides_the_same(seed):
    """calib/vllm/server.py leaves the model chain out of a step where it drafted nothing (0 passes
    planned): the one-chain rule on the n-gram chain decides what the two-chain rule decides."""
    t = synthetic_tables(seed + 30)
    inputs = random_inputs(B=6, seed=seed)
    h = synthetic_history(inputs.req_ids, seed)
    B, K = 6, 5
    empty = step_inputs(inputs.req_ids, inputs.temperature, [[] for _ in range(B)], torch.full((B, K), NAN),
                  offered_tokens(inputs, "ngram"), inputs.offers["ngram"].signal)
    alone = step_inputs(inputs.req_ids, inputs.temperature, ngram_tokens=offered_tokens(inputs, "ngram"),
                  ngram_features=inputs.offers["ngram"].signal)
    for mode in ({"cost": cheap_curve(B)}, {"cost": torch.linspace(1.0, 4.0, 60)}, {"budget": 5}):
        two, one = decide_step(t, empty, h, k_max=4, **mode), decide_step(t, alone, h, k_max=4, **mode)
        assert one.drafts == two.drafts and torch.equal(one.chain, two.chain)
        assert torch.equal(one.expected_accepted, two.expected_accepted)


def test_one_chain_tables_and_engines():
    inputs = random_inputs(B=5, seed=3)
    h = synthetic_history(inputs.req_ids, 3)
    only_model = synthetic_tables(3, chains=("model",))  # tables without the n-gram chain: the n-gram offer is unused
    out = decide_step(only_model, inputs, h, k_max=4, cost=cheap_curve(5))
    assert set(out.chain.tolist()) <= {0, chain("model").id}
    check_drafts(out, inputs, 4)
    eagle_only = random_inputs(B=5, seed=3, ngram=False)  # an EAGLE-only engine with two-chain tables
    out = decide_step(synthetic_tables(3), eagle_only, h, k_max=4, cost=cheap_curve(5))
    assert set(out.chain.tolist()) <= {0, chain("model").id}
    with pytest.raises(ValueError, match=r"no chain to decide on: the engine offers \['ngram'\], the tables "
                                         r"calibrate \['model'\]"):
        decide_step(only_model, random_inputs(B=5, seed=3, model=False), h, k_max=4, cost=cheap_curve(5))


def test_context_columns_follow_the_history():
    t = synthetic_tables(0)
    inputs = random_inputs(B=2, seed=0)
    h = RequestHistory()
    h.observe("req-1", 3, 4)
    sig, _ = chain_inputs(t, inputs, h, k_max=4)
    assert math.isnan(sig["model"][0, 0, 2]) and sig["model"][1, 0, 2] == 3.0  # prev_accept
    assert sig["model"][:, 0, 1].tolist() == pytest.approx([float(x) for x in inputs.temperature])
