"""calib.serve.decide on SYNTHETIC tables (random grids with context axes, tests/synthetic.py style):
draft lists within k_max and the proposal, n-gram substitution, nothing when nothing pays, decisions
identical to calib.allocate.allocate on hand-built inputs, one-chain engines and tables, SafeDecider's
construction checks, pass-through, warn-once and disable-after-N."""

from __future__ import annotations

import logging
import math

import numpy as np
import pytest
import torch

from calib.allocate import allocate
from calib.chains import Axis, Offer, chain
from calib.chains.ngram import step_feature_tensor
from calib.serve import (
    RequestHistory,
    SafeDecider,
    StepInputs,
    chain_inputs,
    decide_step,
)
from calib.serve import decide as decide_mod
from calib.tables.io import TablesError, load, save
from calib.tables.layout import ChainTable, GridTables

NAN = float("nan")
G, D = 9, 4
NG_OWN = ["match_n", "agreement"]


def _tables(seed: int = 0, model_scale=1.0, ngram_scale=1.0, chains=("model", "ngram")) -> GridTables:
    """SYNTHETIC tables: model = conf x temperature (2) x prev_accept (3); n-gram = match_n (3) x
    agreement (2) x temperature (2) x mean_accept (2) x position (2)."""
    g = torch.Generator().manual_seed(seed)
    m_axes = (Axis("conf", points=G), Axis("temperature", edges=(0.4,)), Axis("prev_accept", edges=(0.0, 2.0)))
    m = ChainTable.build(m_axes, model_scale * torch.rand(D, 6 * G, generator=g).sort(dim=1).values,
                         torch.tensor([[0.4, math.inf], [0.0, 2.0]]), torch.tensor([3 * G, G]))
    n_axes = (Axis("match_n", edges=(1.5, 2.5)), Axis("agreement", edges=(0.5,)), Axis("temperature", edges=(0.4,)),
              Axis("mean_accept", edges=(1.0,)), Axis("position", edges=(3.5,)))
    n = ChainTable.build(n_axes, ngram_scale * torch.rand(D, 48, generator=g),
                         torch.tensor([[1.5, 2.5], [0.5, math.inf], [0.4, math.inf], [1.0, math.inf], [3.5, math.inf]]),
                         torch.tensor([16, 8, 4, 2, 1]))
    both = {"model": m, "ngram": n}
    return GridTables({c: both[c] for c in chains})


def _history(req_ids, seed=0) -> RequestHistory:
    g = torch.Generator().manual_seed(seed)
    h = RequestHistory()
    for r in req_ids:
        for _ in range(int(torch.randint(0, 4, (1,), generator=g))):  # 0 rounds: first round, NaN
            d = int(torch.randint(1, 5, (1,), generator=g))
            h.observe(r, int(torch.randint(0, d + 1, (1,), generator=g)), d)
    return h


def _step(req_ids, temp, model_tokens=None, model_conf=None, ngram_tokens=None, ngram_features=None,
          ngram_probs=None) -> StepInputs:
    """StepInputs offering the model chain and/or the n-gram chain (None: not offered)."""
    offers = {}
    if model_tokens is not None:
        offers["model"] = Offer(model_tokens, model_conf)
    if ngram_tokens is not None:
        offers["ngram"] = Offer(ngram_tokens, ngram_features, ngram_probs)
    return StepInputs(req_ids, temp, offers)


def _toks(inputs, name):
    return inputs.offers[name].tokens if name in inputs.offers else None


def _with_probs(inputs, name, probs):
    from dataclasses import replace

    return StepInputs(inputs.req_ids, inputs.temperature,
                      {**inputs.offers, name: replace(inputs.offers[name], probs=probs)})


def _inputs(B=6, K=5, L=5, seed=0, model=True, ngram=True) -> StepInputs:
    g = torch.Generator().manual_seed(seed)
    req_ids = [f"req-{i}" for i in range(B)]
    mt = [torch.randint(0, 1000, (int(torch.randint(0, K + 1, (1,), generator=g)),), generator=g).tolist()
          for _ in range(B)]
    conf = torch.rand(B, K, generator=g)
    nt = [torch.randint(0, 1000, (int(torch.randint(0, L + 1, (1,), generator=g)),), generator=g).tolist()
          for _ in range(B)]
    feats = [{"match_n": int(torch.randint(1, 5, (1,), generator=g)), "agreement": float(torch.rand(1, generator=g))}
             if t else None for t in nt]
    temp = torch.where(torch.rand(B, generator=g) < 0.5, 0.0, 0.8)
    return _step(req_ids, temp, mt if model else None, conf if model else None,
                 nt if ngram else None,
                 step_feature_tensor(feats, [len(t) for t in nt], NG_OWN, L) if ngram else None)


def _cheap(B, K=5):
    return torch.linspace(1.0, 1.5, B + 2 * K * B + 1)


def _check_drafts(out, inputs, k_max):
    for i in range(len(inputs.req_ids)):
        d, c = out.drafts[i], int(out.chain[i])
        assert len(d) <= k_max and len(d) == int(out.depth[i])
        assert all(isinstance(x, int) and x >= 0 for x in d)
        if c == 0:
            assert d == []
        else:
            src = _toks(inputs, "model") if c == chain("model").id else _toks(inputs, "ngram")
            assert d == src[i][: len(d)] and len(d) <= len(src[i])


@pytest.mark.parametrize("seed", range(6))
def test_drafts_within_k_max_and_the_proposal(seed):
    t = _tables(seed)
    inputs = _inputs(B=7, seed=seed)
    h = _history(inputs.req_ids, seed)
    for k_max in (1, 3, 4):
        out = decide_step(t, inputs, h, k_max=k_max, cost=_cheap(7))
        _check_drafts(out, inputs, k_max)
        assert out.allocator_ms >= 0 and not out.passthrough
        out = decide_step(t, inputs, h, k_max=k_max, budget=100)  # budget mode: every token it can use
        _check_drafts(out, inputs, k_max)


def test_substitution_returns_the_ngram_tokens():
    t = _tables()
    t.chains["ngram"].grid.fill_(0.95)  # n-gram chains accept more often than model drafts
    t.chains["model"].grid.fill_(0.6)
    B = 3
    inputs = _step(["a", "b", "c"], [0.0, 0.8, 0.0],
                   model_tokens=[[1, 2, 3], [4, 5], []], model_conf=torch.full((B, 3), 0.9),
                   ngram_tokens=[[7, 8, 9, 10, 11], [], [12, 13]],
                   ngram_features=step_feature_tensor([{"match_n": 3, "agreement": 1.0}, None,
                                                       {"match_n": 3, "agreement": 1.0}], [5, 0, 2], NG_OWN, 5))
    out = decide_step(t, inputs, RequestHistory(), k_max=4, cost=_cheap(B))
    assert out.drafts == [[7, 8, 9, 10], [4, 5], [12, 13]]  # n-gram cut to k_max; b has no n-gram chain
    assert out.chain.tolist() == [chain("ngram").id, chain("model").id, chain("ngram").id]


def test_nothing_pays_nothing_drafted():
    t = _tables(1)
    inputs = _inputs(B=5, seed=1)
    B = 5
    steep = torch.cat([torch.ones(B + 1), torch.full((50,), 1e6)])  # any draft token costs a million passes
    out = decide_step(t, inputs, _history(inputs.req_ids), k_max=4, cost=steep)
    assert out.drafts == [[]] * B and out.depth.tolist() == [0] * B and out.chain.tolist() == [0] * B
    out = decide_step(t, inputs, _history(inputs.req_ids), k_max=4, budget=0)
    assert out.drafts == [[]] * B


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("impl", ["host", "reference"])
def test_a_step_with_nothing_offered_decides_without_a_lookup_what_the_lookup_decides(seed, impl, monkeypatch):
    """No request has a token on any chain (no n-gram match anywhere): the decision is made without the tables, and
    it is the full path's, field for field and type for type."""
    t = _tables(seed + 40)
    ids = [f"r{i}" for i in range(5)]
    B, K = 5, 5
    temps = [0.0, 0.8, 0.0, 0.8, 0.0][: B]
    empty = _step(ids, temps, [[] for _ in range(B)], torch.full((B, K), NAN), [[] for _ in range(B)],
                  torch.full((B, K, 2), NAN))
    h = _history(ids, seed)
    lean = decide_mod._decide_step(t, empty, h, k_max=4, cost=_cheap(B), budget=None, impl=impl)
    monkeypatch.setattr(decide_mod, "nothing_offered", lambda inputs, offered: False)
    full = decide_mod._decide_step(t, empty, h, k_max=4, cost=_cheap(B), budget=None, impl=impl)
    assert lean.drafts == full.drafts == [[]] * B
    for name in ("chain", "depth", "expected_accepted", "probs"):
        a, b = lean.host(name), full.host(name)
        assert a.dtype == b.dtype and a.shape == b.shape and ((a == b) | (np.isnan(a) & np.isnan(b))).all(), name
    monkeypatch.undo()
    one = _step(ids, temps, [[] for _ in range(B)], torch.full((B, K), NAN), [[], [], [7], [], []],
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
    t = _tables(seed + 10)
    inputs = _inputs(B=6, seed=seed, model="model" in offered, ngram="ngram" in offered)
    h = _history(inputs.req_ids, seed)
    k_max = 4
    sig = _by_hand(t, inputs, h, k_max)
    built, _ = chain_inputs(t, inputs, h, k_max=k_max)
    assert built.keys() == sig.keys()
    for k in sig:
        assert torch.equal(built[k].isnan(), sig[k].isnan()) and torch.equal(built[k].nan_to_num(), sig[k].nan_to_num())
    for mode in ({"cost": _cheap(6)}, {"cost": torch.linspace(1.0, 4.0, 60)}, {"budget": 5}):
        ref = allocate(t, sig, **mode)
        out = decide_step(t, inputs, h, k_max=k_max, **mode)
        assert torch.equal(out.chain, ref.drafter) and torch.equal(out.depth, ref.depth)
        assert torch.equal(out.expected_accepted, ref.expected_accepted)


@pytest.mark.parametrize("seed", range(4))
def test_given_ngram_probs_decide_as_the_lookup(seed):
    """An engine that looked the n-gram chain up already (the serving plan) passes its probabilities:
    the same decision as decide_step's own lookup."""
    from calib.allocate import calibrated_probs

    t = _tables(seed + 20)
    inputs = _inputs(B=6, seed=seed)
    h = _history(inputs.req_ids, seed)
    sig, _ = chain_inputs(t, inputs, h, k_max=4)
    given = _with_probs(inputs, "ngram", calibrated_probs(t, {"ngram": sig["ngram"]})["ngram"])
    for mode in ({"cost": _cheap(6)}, {"cost": torch.linspace(1.0, 4.0, 60)}, {"budget": 5}):
        ref = decide_step(t, inputs, h, k_max=4, **mode)
        out = decide_step(t, given, h, k_max=4, **mode)
        assert out.drafts == ref.drafts and torch.equal(out.chain, ref.chain)
        assert torch.equal(out.expected_accepted, ref.expected_accepted)
    wrong = _with_probs(inputs, "ngram", torch.zeros(6, 5))  # probabilities are used, not recomputed
    assert all(c != chain("ngram").id for c in decide_step(t, wrong, h, k_max=4, budget=5).chain.tolist())


@pytest.mark.parametrize("seed", range(6))
def test_a_chain_with_no_token_left_out_decides_the_same(seed):
    """calib/vllm/server.py leaves the model chain out of a step where it drafted nothing (0 passes
    planned): the one-chain rule on the n-gram chain decides what the two-chain rule decides."""
    t = _tables(seed + 30)
    inputs = _inputs(B=6, seed=seed)
    h = _history(inputs.req_ids, seed)
    B, K = 6, 5
    empty = _step(inputs.req_ids, inputs.temperature, [[] for _ in range(B)], torch.full((B, K), NAN),
                  _toks(inputs, "ngram"), inputs.offers["ngram"].signal)
    alone = _step(inputs.req_ids, inputs.temperature, ngram_tokens=_toks(inputs, "ngram"),
                  ngram_features=inputs.offers["ngram"].signal)
    for mode in ({"cost": _cheap(B)}, {"cost": torch.linspace(1.0, 4.0, 60)}, {"budget": 5}):
        two, one = decide_step(t, empty, h, k_max=4, **mode), decide_step(t, alone, h, k_max=4, **mode)
        assert one.drafts == two.drafts and torch.equal(one.chain, two.chain)
        assert torch.equal(one.expected_accepted, two.expected_accepted)


def test_one_chain_tables_and_engines():
    inputs = _inputs(B=5, seed=3)
    h = _history(inputs.req_ids, 3)
    only_model = _tables(3, chains=("model",))  # tables without the n-gram chain: the n-gram offer is unused
    out = decide_step(only_model, inputs, h, k_max=4, cost=_cheap(5))
    assert set(out.chain.tolist()) <= {0, chain("model").id}
    _check_drafts(out, inputs, 4)
    eagle_only = _inputs(B=5, seed=3, ngram=False)  # an EAGLE-only engine with two-chain tables
    out = decide_step(_tables(3), eagle_only, h, k_max=4, cost=_cheap(5))
    assert set(out.chain.tolist()) <= {0, chain("model").id}
    with pytest.raises(ValueError, match=r"no chain to decide on: the engine offers \['ngram'\], the tables "
                                         r"calibrate \['model'\]"):
        decide_step(only_model, _inputs(B=5, seed=3, model=False), h, k_max=4, cost=_cheap(5))


def test_context_columns_follow_the_history():
    t = _tables(0)
    inputs = _inputs(B=2, seed=0)
    h = RequestHistory()
    h.observe("req-1", 3, 4)
    sig, _ = chain_inputs(t, inputs, h, k_max=4)
    assert math.isnan(sig["model"][0, 0, 2]) and sig["model"][1, 0, 2] == 3.0  # prev_accept
    assert sig["model"][:, 0, 1].tolist() == pytest.approx([float(x) for x in inputs.temperature])


# --- SafeDecider ----------------------------------------------------------------------------------

META = {"target_models": ["synthetic-model"],
        "chains": {"model": {"ids": ["eagle:head"], "k": D}, "ngram": {"ids": ["ngram"], "k": D}}}


@pytest.fixture
def saved(tmp_path):
    return save(tmp_path / "tables", _tables(5), META)


def _decider(path, **kw):
    args = {"model_id": "synthetic-model", "speculator": "eagle:head", "method": "eagle", "k_max": 4,
            "cost": _cheap(8), **kw}
    return SafeDecider(path, **args)


def test_construction_refuses_tables_the_engine_does_not_match(saved):
    assert _decider(saved).chains == ["model", "ngram"]
    assert _decider(load(saved), speculator="ngram", method="ngram").engine_chain == "ngram"
    with pytest.raises(TablesError, match=r"fitted for \['synthetic-model'\], bank engine \(model 'Other-7B'.*"
                                          r"was collected with 'Other-7B'"):
        _decider(saved, model_id="Other-7B")
    with pytest.raises(TablesError, match=r"\['eagle:head'\], bank engine .* was drafted by 'eagle:other'"):
        _decider(saved, speculator="eagle:other")
    with pytest.raises(TablesError, match=r"cover model-drafter depths 0..3 \(K=4\), bank engine .* drafts K=6"):
        _decider(saved, k_max=6)
    with pytest.raises(ValueError, match="cost"):
        _decider(saved, cost=torch.tensor([1.0, 0.0]))


def test_safe_decider_decides_like_decide_step(saved):
    dec = _decider(saved)
    inputs = _inputs(B=6, seed=2)
    for r in inputs.req_ids[:3]:
        dec.observe(r, 2, 3)
    out = dec.decide(inputs)
    ref = decide_step(load(saved), inputs, dec.history, k_max=4, cost=_cheap(8))
    assert out.drafts == ref.drafts and not out.passthrough and dec.failures == 0


def test_safe_decider_passes_through_warns_once_and_disables(saved, monkeypatch, caplog):
    dec = _decider(saved, max_failures=3)
    inputs = _inputs(B=4, seed=4)
    calls = []
    real = decide_mod._decide_step  # what SafeDecider calls (its arguments were checked at construction)

    def boom(*a, **k):
        calls.append(1)
        raise RuntimeError("injected")

    monkeypatch.setattr(decide_mod, "_decide_step", boom)
    with caplog.at_level(logging.WARNING, logger="calib.serve"):
        for _ in range(2):
            out = dec.decide(inputs)
            assert out.passthrough and out.drafts == _toks(inputs, "model")
            assert out.depth.tolist() == [len(x) for x in _toks(inputs, "model")]
        assert len(caplog.records) == 1 and "injected" in caplog.text and caplog.records[0].exc_info
        monkeypatch.setattr(decide_mod, "_decide_step", real)  # a good step resets the run of failures
        assert not dec.decide(inputs).passthrough and dec.consecutive_failures == 0
        bad = _step(inputs.req_ids, inputs.temperature, [[5, 6, 7, 8]] * 4, inputs.offers["model"].signal * 10,
                    _toks(inputs, "ngram"), inputs.offers["ngram"].signal)  # confidences > 1: allocate refuses
        for _ in range(3):
            out = dec.decide(bad)
            assert out.passthrough and out.drafts == _toks(bad, "model")
        assert dec.disabled and dec.failures == 5 and len(caplog.records) == 2
        assert "disabled" in caplog.records[1].getMessage()
        monkeypatch.setattr(decide_mod, "_decide_step", boom)
        n = len(calls)
        assert dec.decide(inputs).passthrough and len(calls) == n  # disabled: not even tried
        dec.observe("x", -1)  # a bad history update never raises either
        assert len(caplog.records) == 2


def test_passthrough_of_an_ngram_engine(saved, monkeypatch):
    dec = _decider(saved, speculator="ngram", method="ngram")
    monkeypatch.setattr(decide_mod, "_decide_step", lambda *a, **k: 1 / 0)
    inputs = _inputs(B=3, seed=1, model=False)
    out = dec.decide(inputs)
    assert out.passthrough and out.drafts == _toks(inputs, "ngram")
    assert out.chain.tolist() == [chain("ngram").id if x else 0 for x in _toks(inputs, "ngram")]


# --- request temperatures and declarative arguments (issue 25) ------------------------------------

@pytest.mark.parametrize("bad", [NAN, -0.3, math.inf])
def test_a_bad_request_temperature_is_refused_naming_the_request(bad):
    """Before: NaN and negative temperatures were binned into an end bin of the temperature axis."""
    inputs = _inputs(B=4, seed=1)
    inputs.temperature = torch.tensor([0.0, 0.8, bad, 0.0])
    with pytest.raises(ValueError, match=rf"temperature\[2\] = {bad!r} \(request 'req-2'\): a sampling temperature "
                                         r"must be a finite number >= 0"):
        decide_step(_tables(), inputs, RequestHistory(), k_max=4, cost=_cheap(4))
    with pytest.raises(ValueError, match=r"temperature\[2\]"):  # the serving plan's path builds inputs the same way
        chain_inputs(_tables(), inputs, RequestHistory(), k_max=4)
    inputs.temperature = [0.0, "hot", 0.0, 0.0]
    with pytest.raises(ValueError, match="temperature must be B=4 numbers"):
        decide_step(_tables(), inputs, RequestHistory(), k_max=4, cost=_cheap(4))


def test_safe_decider_passes_a_step_with_a_bad_temperature_through(saved, caplog):
    dec = _decider(saved)
    inputs = _inputs(B=3, seed=2)
    inputs.temperature = [0.0, NAN, 0.8]
    with caplog.at_level(logging.WARNING, logger="calib.serve"):
        out = dec.decide(inputs)
    assert out.passthrough and dec.failures == 1 and "temperature[1] = nan (request 'req-1')" in caplog.text


@pytest.mark.parametrize("kw, match", [
    ({"k_max": 0}, r"SafeDecider: parameter k_max=0 is invalid; it must be an integer in \[1, inf\)"),
    ({"k_max": 2.0}, r"parameter k_max=2.0 is invalid"),
    ({"max_failures": 0}, r"parameter max_failures=0 is invalid"),
    ({"model_id": ""}, r"parameter model_id='' is invalid; it must be a non-empty string"),
    ({"impl": "gpu"}, r"parameter impl='gpu' is invalid; it must be one of 'reference', 'triton'"),
    ({"chains": ["model", "lookahead"]}, r"parameter chains=\['model', 'lookahead'\] is invalid; it must be a list of registered"),
    ({"cost": None, "budget": -1}, r"parameter budget=-1 is invalid; it must be None or an integer in \[0, inf\)"),
    ({"history": {}}, r"parameter history=\{\} is invalid; it must be None or a RequestHistory"),
])
def test_safe_decider_checks_its_arguments(saved, kw, match):
    with pytest.raises(ValueError, match=match):
        _decider(saved, **kw)


def test_decide_step_checks_its_arguments():
    inputs = _inputs(B=2, seed=0)
    for kw, match in [({"k_max": 0, "budget": 2}, r"decide_step: parameter k_max=0"),
                      ({"k_max": 4, "budget": -2}, r"decide_step: parameter budget=-2"),
                      ({"k_max": 4, "budget": 2, "impl": "x"}, r"decide_step: parameter impl='x'")]:
        with pytest.raises(ValueError, match=match):
            decide_step(_tables(), inputs, RequestHistory(), **kw)


def test_a_temperature_outside_the_fitted_range_is_decided_and_logged_once(tmp_path, caplog):
    """Tables fitted at T = 0 and 0.8 serving a T = 1.3 request: decided on the nearest temperature bin
    (the same decision as at 0.8 here, the axis' top bin), logged once per temperature."""
    temps = {"values": [0.0, 0.8], "n_values": 2, "min": 0.0, "max": 0.8, "unrecorded_samples": 0}
    meta = {"target_models": ["synthetic-model"],
            "chains": {"model": {"ids": ["eagle:head"], "k": D, "temperatures": temps},
                       "ngram": {"ids": ["ngram"], "k": D, "temperatures": temps}}}
    t = load(save(tmp_path / "tables", _tables(6), meta))
    inputs = _inputs(B=4, seed=3)
    h = _history(inputs.req_ids, 3)
    inputs.temperature = torch.tensor([0.0, 1.3, 0.8, 1.3])
    with caplog.at_level(logging.WARNING, logger="calib.serve"):
        out = decide_step(t, inputs, h, k_max=4, cost=_cheap(4))
        again = decide_step(t, inputs, h, k_max=4, cost=_cheap(4))
    assert not out.passthrough and out.drafts == again.drafts
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1 and "request temperature 1.3 outside the temperatures the tables" in warned[0]
    assert "model: temperatures [0, 0.8]" in warned[0] and str(tmp_path / "tables") in warned[0]
    inputs.temperature = torch.tensor([0.0, 0.8, 0.8, 0.8])  # what 1.3 reads: the top temperature bin
    assert decide_step(t, inputs, h, k_max=4, cost=_cheap(4)).drafts == out.drafts
    inputs.temperature = torch.tensor([2.0, 0.0, 0.0, 0.0])
    with caplog.at_level(logging.WARNING, logger="calib.serve"):
        decide_step(t, inputs, h, k_max=4, cost=_cheap(4))
    assert len(caplog.records) == 2 and "request temperature 2 outside" in caplog.records[1].getMessage()


# --- the online correction in serving (calib/tables/online.py) --------------------------------------

def test_online_correction_learns_from_what_it_decided_and_rewrites_only_its_chain(saved):
    from calib.tables.online import OnlineSettings

    # an offset only: with the slope, a flatter table may raise its lowest cells on rejections of its higher ones
    on = _decider(saved, online=OnlineSettings(decay=1.0, prior=4.0, slope=False))
    off = _decider(saved)
    inputs = _inputs(B=6, seed=3)
    first_on, first_off = on.decide(inputs), off.decide(inputs)
    assert first_on.drafts == first_off.drafts  # a cold start is the tables alone
    assert first_on.probs is not None and first_on.probs.shape[0] == 6
    before = {n: t.grid.clone() for n, t in on.tables.chains.items()}
    on.remember(inputs, first_on)
    drafted = [(r, len(d)) for r, d in zip(inputs.req_ids, first_on.drafts) if d]
    assert drafted, "the synthetic step should verify something"
    for _ in range(5):  # the same step, every drafted token rejected at once, five times
        on.remember(inputs, first_on)
        for r, n in drafted:
            on.observe(r, 0, n)
        on.refresh()
    on.online.refresh(lazy=False)  # lookups read the correction entry by entry; the grid itself is rewritten here
    changed = {n: ~torch.isclose(on.tables.chains[n].grid, before[n]) for n in before}
    chosen = {chain(int(c)).name for c, d in zip(first_on.chain.tolist(), first_on.drafts) if d}
    for name, diff in changed.items():
        assert bool(diff.any()) == (name in chosen)
        if name in chosen:  # lowered where it learnt (depth 0: every round was rejected there), never raised
            assert bool((on.tables.chains[name].grid[0] <= before[name][0] + 1e-7).all())
            assert bool((on.tables.chains[name].grid[0] < before[name][0] - 1e-4).any())
    assert all(torch.equal(t.grid, _decider(saved).tables.chains[n].grid) for n, t in off.tables.chains.items())


def test_online_positions_after_the_first_rejection_are_not_rejections(saved):
    from calib.tables.online import OnlineSettings

    dec = _decider(saved, online=OnlineSettings(decay=1.0, prior=4.0))
    inputs = _inputs(B=6, seed=3)
    out = dec.decide(inputs)
    dec.remember(inputs, out)
    r, n = next((r, len(d)) for r, d in zip(inputs.req_ids, out.drafts) if len(d) >= 2)
    name = chain(int(out.chain[inputs.req_ids.index(r)])).name
    dec.observe(r, 0, n)  # rejected at depth 0: depths 1.. were never judged
    assert not any(s["n"][0] for s in dec.online.state()[name].values())  # learnt with the step, at refresh
    dec.refresh()
    seen = dec.online.state()[name]
    assert all(s["n"][0] == 1 and not any(s["n"][1:]) for s in seen.values())


@pytest.mark.parametrize("pooled,slope", [(True, True), (True, False), (False, False)])
def test_the_served_grid_is_the_replayed_correction_of_the_prior(saved, pooled, slope):
    """Serving rewrites the grid; eval replays OnlineCorrection: the same numbers in every cell (with the
    pooled level every cell moves, the ones no round fell in too; without it only the cells rounds fell in)."""
    import numpy as np

    from calib.tables.online import OnlineSettings

    dec = _decider(saved, online=OnlineSettings(decay=0.99, prior=4.0, pooled=pooled, slope=slope))
    for step in range(4):
        inputs = _inputs(B=6, seed=10 + step)
        out = dec.decide(inputs)
        dec.remember(inputs, out)
        for r, d in zip(inputs.req_ids, out.drafts):
            if d:
                dec.observe(r, step % (len(d) + 1), len(d))
        dec.refresh()
    dec.online.refresh(lazy=False)  # lookups read the correction entry by entry; the grid itself is rewritten here
    prior = _decider(saved).tables.chains
    assert any(v["n"][0] for c in dec.online.chains.values() for v in c["correction"].state().values()), \
        "the steps should teach something"
    for name, c in dec.online.chains.items():
        cells = np.repeat(np.arange(c["n_cells"]), c["width"])  # the context cell of every grid column
        p = prior[name].grid.double().numpy()  # [D, columns]
        delta = c["correction"].offset(cells, p.shape[0]).T  # [D, columns]
        scale = c["correction"].scale(p.shape[0])[:, None]  # [D, 1]
        assert (scale != 1).any() == (slope and bool(c["correction"].state()["pooled"]["n"][0]))
        q = np.clip(p, 1e-6, 1 - 1e-6)
        keep = np.isnan(p) | (p <= 0) | (p >= 1)
        want = np.where(keep, p, 1 / (1 + np.exp(-((np.log(q) - np.log1p(-q)) * scale + delta))))
        np.testing.assert_allclose(c["table"].grid.double().numpy(), want, rtol=1e-5, atol=1e-6)
        seen = c["correction"].state()
        touched = {k for k, v in seen.items() if k != "pooled" and v["n"][0]}
        moved = ~np.isclose(c["table"].grid.double().numpy()[0], p[0], rtol=0, atol=1e-6) | keep[0]
        if pooled and seen["pooled"]["n"][0]:
            assert moved.all()
        elif not pooled:
            assert set(np.unique(cells[~keep[0] & moved])) <= touched


def test_lookups_through_the_correction_decide_as_a_rewritten_grid(saved):
    """Lookups read the online correction's values entry by entry (OnlineTables.read): every decision equals, and
    every probability is within float32 rounding of, those read from a grid rewritten whole after each step (the
    kernel's way; numpy's vectorised exp may round an array's lanes apart from a gather's)."""
    from calib.tables.online import OnlineSettings

    settings = OnlineSettings(decay=0.99, prior=4.0)
    lazy, whole = _decider(saved, online=settings), _decider(saved, online=settings)
    for t in whole.tables.chains.values():
        t.read = None  # the grid as rewritten
    for step in range(6):
        inputs = _inputs(B=6, seed=20 + step)
        a, b = lazy.decide(inputs), whole.decide(inputs)
        assert a.drafts == b.drafts and torch.equal(a.probs.isnan(), b.probs.isnan())
        assert torch.allclose(torch.nan_to_num(a.probs), torch.nan_to_num(b.probs), rtol=0, atol=2e-7)
        for dec, out in ((lazy, a), (whole, b)):
            dec.remember(inputs, out)
            for r, d in zip(inputs.req_ids, out.drafts):
                if d:
                    dec.observe(r, step % (len(d) + 1), len(d))
            dec.refresh()
        whole.online.refresh(lazy=False)
        stale = sum(int(c["stale"].sum()) for c in lazy.online.chains.values())
        assert step == 0 or stale > 0, "the lookups should have read corrected values the grid does not hold"
