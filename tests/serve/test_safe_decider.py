"""calib.serve.decide.SafeDecider on SYNTHETIC tables (tests/serve/decide_cases.py): construction checks against the
engine, decisions as decide_step's, pass-through, warn-once and disable-after-N, bad temperatures, and the online
correction it learns from what it decided."""

from __future__ import annotations

import logging
import math

import numpy as np
import pytest
import torch

from calib.chains import chain
from calib.serve import RequestHistory, chain_inputs, decide_step
from calib.serve import decide as decide_mod
from calib.tables.io import TablesError, load, save
from tests.serve.decide_cases import (
    META,
    NAN,
    D,
    cheap_curve,
    offered_tokens,
    random_inputs,
    step_inputs,
    synthetic_decider,
    synthetic_history,
    synthetic_tables,
)


@pytest.fixture
def saved(tmp_path):
    return save(tmp_path / "tables", synthetic_tables(5), META)


def test_construction_refuses_tables_the_engine_does_not_match(saved):
    assert synthetic_decider(saved).chains == ["model", "ngram"]
    assert synthetic_decider(load(saved), speculator="ngram", method="ngram").engine_chain == "ngram"
    with pytest.raises(TablesError, match=r"fitted for \['synthetic-model'\], bank engine \(model 'Other-7B'.*"
                                          r"was collected with 'Other-7B'"):
        synthetic_decider(saved, model_id="Other-7B")
    with pytest.raises(TablesError, match=r"\['eagle:head'\], bank engine .* was drafted by 'eagle:other'"):
        synthetic_decider(saved, speculator="eagle:other")
    with pytest.raises(TablesError, match=r"cover model-drafter depths 0..3 \(K=4\), bank engine .* drafts K=6"):
        synthetic_decider(saved, k_max=6)
    with pytest.raises(ValueError, match="cost"):
        synthetic_decider(saved, cost=torch.tensor([1.0, 0.0]))


def test_safe_decider_decides_like_decide_step(saved):
    dec = synthetic_decider(saved)
    inputs = random_inputs(B=6, seed=2)
    for r in inputs.req_ids[:3]:
        dec.observe(r, 2, 3)
    out = dec.decide(inputs)
    ref = decide_step(load(saved), inputs, dec.history, k_max=4, cost=cheap_curve(8))
    assert out.drafts == ref.drafts and not out.passthrough and dec.failures == 0


def test_safe_decider_passes_through_warns_once_and_disables(saved, monkeypatch, caplog):
    dec = synthetic_decider(saved, max_failures=3)
    inputs = random_inputs(B=4, seed=4)
    calls = []
    real = decide_mod._decide_step  # what SafeDecider calls (its arguments were checked at construction)

    def boom(*a, **k):
        calls.append(1)
        raise RuntimeError("injected")

    monkeypatch.setattr(decide_mod, "_decide_step", boom)
    with caplog.at_level(logging.WARNING, logger="calib.serve"):
        for _ in range(2):
            out = dec.decide(inputs)
            assert out.passthrough and out.drafts == offered_tokens(inputs, "model")
            assert out.depth.tolist() == [len(x) for x in offered_tokens(inputs, "model")]
        assert len(caplog.records) == 1 and "injected" in caplog.text and caplog.records[0].exc_info
        monkeypatch.setattr(decide_mod, "_decide_step", real)  # a good step resets the run of failures
        assert not dec.decide(inputs).passthrough and dec.consecutive_failures == 0
        bad = step_inputs(inputs.req_ids, inputs.temperature, [[5, 6, 7, 8]] * 4, inputs.offers["model"].signal * 10,
                    offered_tokens(inputs, "ngram"), inputs.offers["ngram"].signal)  # confidences > 1: allocate refuses
        for _ in range(3):
            out = dec.decide(bad)
            assert out.passthrough and out.drafts == offered_tokens(bad, "model")
        assert dec.disabled and dec.failures == 5 and len(caplog.records) == 2
        assert "disabled" in caplog.records[1].getMessage()
        monkeypatch.setattr(decide_mod, "_decide_step", boom)
        n = len(calls)
        assert dec.decide(inputs).passthrough and len(calls) == n  # disabled: not even tried
        dec.observe("x", -1)  # a bad history update never raises either
        assert len(caplog.records) == 2


def test_passthrough_of_an_ngram_engine(saved, monkeypatch):
    dec = synthetic_decider(saved, speculator="ngram", method="ngram")
    monkeypatch.setattr(decide_mod, "_decide_step", lambda *a, **k: 1 / 0)
    inputs = random_inputs(B=3, seed=1, model=False)
    out = dec.decide(inputs)
    assert out.passthrough and out.drafts == offered_tokens(inputs, "ngram")
    assert out.chain.tolist() == [chain("ngram").id if x else 0 for x in offered_tokens(inputs, "ngram")]


# --- request temperatures and declarative arguments (issue 25) ------------------------------------

@pytest.mark.parametrize("bad", [NAN, -0.3, math.inf])
def test_a_bad_request_temperature_is_refused_naming_the_request(bad):
    """Before: NaN and negative temperatures were binned into an end bin of the temperature axis."""
    inputs = random_inputs(B=4, seed=1)
    inputs.temperature = torch.tensor([0.0, 0.8, bad, 0.0])
    with pytest.raises(ValueError, match=rf"temperature\[2\] = {bad!r} \(request 'req-2'\): a sampling temperature "
                                         r"must be a finite number >= 0"):
        decide_step(synthetic_tables(), inputs, RequestHistory(), k_max=4, cost=cheap_curve(4))
    with pytest.raises(ValueError, match=r"temperature\[2\]"):  # the serving plan's path builds inputs the same way
        chain_inputs(synthetic_tables(), inputs, RequestHistory(), k_max=4)
    inputs.temperature = [0.0, "hot", 0.0, 0.0]
    with pytest.raises(ValueError, match="temperature must be B=4 numbers"):
        decide_step(synthetic_tables(), inputs, RequestHistory(), k_max=4, cost=cheap_curve(4))


def test_safe_decider_passes_a_step_with_a_bad_temperature_through(saved, caplog):
    dec = synthetic_decider(saved)
    inputs = random_inputs(B=3, seed=2)
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
        synthetic_decider(saved, **kw)


def test_decide_step_checks_its_arguments():
    inputs = random_inputs(B=2, seed=0)
    for kw, match in [({"k_max": 0, "budget": 2}, r"decide_step: parameter k_max=0"),
                      ({"k_max": 4, "budget": -2}, r"decide_step: parameter budget=-2"),
                      ({"k_max": 4, "budget": 2, "impl": "x"}, r"decide_step: parameter impl='x'")]:
        with pytest.raises(ValueError, match=match):
            decide_step(synthetic_tables(), inputs, RequestHistory(), **kw)


def test_a_temperature_outside_the_fitted_range_is_decided_and_logged_once(tmp_path, caplog):
    """Tables fitted at T = 0 and 0.8 serving a T = 1.3 request: decided on the nearest temperature bin
    (the same decision as at 0.8 here, the axis' top bin), logged once per temperature."""
    temps = {"values": [0.0, 0.8], "n_values": 2, "min": 0.0, "max": 0.8, "unrecorded_samples": 0}
    meta = {"target_models": ["synthetic-model"],
            "chains": {"model": {"ids": ["eagle:head"], "k": D, "temperatures": temps},
                       "ngram": {"ids": ["ngram"], "k": D, "temperatures": temps}}}
    t = load(save(tmp_path / "tables", synthetic_tables(6), meta))
    inputs = random_inputs(B=4, seed=3)
    h = synthetic_history(inputs.req_ids, 3)
    inputs.temperature = torch.tensor([0.0, 1.3, 0.8, 1.3])
    with caplog.at_level(logging.WARNING, logger="calib.serve"):
        out = decide_step(t, inputs, h, k_max=4, cost=cheap_curve(4))
        again = decide_step(t, inputs, h, k_max=4, cost=cheap_curve(4))
    assert not out.passthrough and out.drafts == again.drafts
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1 and "request temperature 1.3 outside the temperatures the tables" in warned[0]
    assert "model: temperatures [0, 0.8]" in warned[0] and str(tmp_path / "tables") in warned[0]
    inputs.temperature = torch.tensor([0.0, 0.8, 0.8, 0.8])  # what 1.3 reads: the top temperature bin
    assert decide_step(t, inputs, h, k_max=4, cost=cheap_curve(4)).drafts == out.drafts
    inputs.temperature = torch.tensor([2.0, 0.0, 0.0, 0.0])
    with caplog.at_level(logging.WARNING, logger="calib.serve"):
        decide_step(t, inputs, h, k_max=4, cost=cheap_curve(4))
    assert len(caplog.records) == 2 and "request temperature 2 outside" in caplog.records[1].getMessage()


# --- the online correction in serving (calib/tables/online.py) --------------------------------------

def test_online_correction_learns_from_what_it_decided_and_rewrites_only_its_chain(saved):
    from calib.tables.online import OnlineSettings

    # an offset only: with the slope, a flatter table may raise its lowest cells on rejections of its higher ones
    on = synthetic_decider(saved, online=OnlineSettings(decay=1.0, prior=4.0, slope=False))
    off = synthetic_decider(saved)
    inputs = random_inputs(B=6, seed=3)
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
    assert all(torch.equal(t.grid, synthetic_decider(saved).tables.chains[n].grid) for n, t in off.tables.chains.items())
    on.remember(inputs, first_on)
    for r in inputs.req_ids:  # the cell's requests finish (their history with them)
        on.finish(r)
    on.forget_learned()  # between a bench's cells: the tables alone again, nothing pending
    assert not on._pending and all(torch.equal(t.grid, before[n]) for n, t in on.tables.chains.items())
    assert on.decide(inputs).drafts == first_off.drafts


def test_online_positions_after_the_first_rejection_are_not_rejections(saved):
    from calib.tables.online import OnlineSettings

    dec = synthetic_decider(saved, online=OnlineSettings(decay=1.0, prior=4.0))
    inputs = random_inputs(B=6, seed=3)
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

    from calib.tables.online import OnlineSettings

    dec = synthetic_decider(saved, online=OnlineSettings(decay=0.99, prior=4.0, pooled=pooled, slope=slope))
    for step in range(4):
        inputs = random_inputs(B=6, seed=10 + step)
        out = dec.decide(inputs)
        dec.remember(inputs, out)
        for r, d in zip(inputs.req_ids, out.drafts):
            if d:
                dec.observe(r, step % (len(d) + 1), len(d))
        dec.refresh()
    dec.online.refresh(lazy=False)  # lookups read the correction entry by entry; the grid itself is rewritten here
    prior = synthetic_decider(saved).tables.chains
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
    lazy, whole = synthetic_decider(saved, online=settings), synthetic_decider(saved, online=settings)
    for t in whole.tables.chains.values():
        t.read = None  # the grid as rewritten
    for step in range(6):
        inputs = random_inputs(B=6, seed=20 + step)
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
