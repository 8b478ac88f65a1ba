"""The step clock (calib/serve/step_clock.py) and its wiring in the Server (calib/vllm/server.py ``time_step``).

Every curve, time and scheduler output here is SYNTHETIC (made-up seconds and a stand-in of vLLM's
``SchedulerOutput``); the served runs are bench/serve.py's (docs/serving.md).
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from calib.serve.knobs import ServeKnobs
from calib.serve.step_clock import MAX_RESIDUAL, StepClock, predicted_gain

CURVE = 0.050 + 0.003 * np.arange(81, dtype=np.float64)  # [T_max + 1] seconds: 50 ms + 3 ms per position
KEY = (16, False)


def test_learns_what_the_clock_adds_to_the_curve():
    """Steps that take 10 ms less than the curve at no draft token, 6 ms more once for any and 2 ms more per draft
    token: learned."""
    rng = np.random.default_rng(0)
    clock = StepClock(CURVE, decay=0.99, prior=8.0)
    for _ in range(400):
        x = int(rng.integers(1, 12)) if rng.random() < 0.5 else 0  # half the steps verify no draft token
        T = 16 + x
        assert clock.observe(KEY, 16, T, CURVE[T] - 0.010 + 0.006 * (x > 0) + 0.002 * x + rng.normal(0, 0.002))
    a, j, b = clock.correction(KEY)
    assert a == pytest.approx(-0.010, abs=0.001) and j == pytest.approx(0.006, abs=0.0015)
    assert b == pytest.approx(0.002, abs=0.0003)
    price = clock.price(KEY, 16)
    assert price.dtype == torch.float32 and price.shape == (81,)
    assert float(price[20]) == pytest.approx(CURVE[20] + a + j + 4 * b, rel=1e-6)
    assert float(price[16]) == pytest.approx(CURVE[16] + a, rel=1e-6)
    assert clock.price(KEY, 16) is price  # the same tensor until the next refresh: derived once by the decider
    assert clock.summary(KEY) == [round(a * 1e3, 3), round(j * 1e3, 3), round(b * 1e3, 3), 400]


def test_the_curve_is_a_prior_and_steps_without_drafts_keep_its_jump_and_slope():
    clock = StepClock(CURVE, prior=8.0, min_steps=4)
    assert clock.price(KEY, 16) is None and clock.correction(KEY) == (0.0, 0.0, 0.0)  # nothing seen yet
    for _ in range(3):
        clock.observe(KEY, 16, 16, CURVE[16] + 0.008)
    assert clock.price(KEY, 16) is None  # fewer than min_steps
    for _ in range(200):
        clock.observe(KEY, 16, 16, CURVE[16] + 0.008)  # 8 ms more, never a draft token
    # no drafted step: the base is learned, the jump and the slope stay the curve's
    assert clock.correction(KEY) == (pytest.approx(0.008), 0.0, 0.0)
    assert clock.correction((4, False)) == (0.0, 0.0, 0.0)  # another batch size learns apart
    drafting = StepClock(CURVE)  # every step drafts: nothing tells a jump from the base, which takes it all
    for x in [1, 3, 2, 4] * 50:
        drafting.observe(KEY, 16, 16 + x, CURVE[16 + x] + 0.004)
    a, j, b = drafting.correction(KEY)
    assert a == pytest.approx(0.004, rel=0.01) and abs(j) < 1e-4 and abs(b) < 1e-5


def test_outliers_are_clipped_and_the_price_stays_positive():
    clock = StepClock(CURVE, decay=0.5, prior=0.01, min_steps=1, refresh=1)
    assert clock.observe(KEY, 16, 20, 5.0)  # a step that waited on the host for seconds
    a, j, b = clock.correction(KEY)
    assert a + j + 4 * b <= MAX_RESIDUAL * CURVE[20] + 1e-9
    for _ in range(30):
        clock.observe(KEY, 16, 16, 1e-4)  # absurdly fast steps: clipped, and the price never reaches 0
    assert (clock.price(KEY, 16) > 0).all()
    # steps the curve does not price are refused
    assert not clock.observe(KEY, 16, 15, 0.05) and not clock.observe(KEY, 16, 81, 0.05)
    assert not clock.observe(KEY, 16, 16, float("nan")) and not clock.observe(KEY, 16, 16, 0.0)


def _so(tokens: dict, spec: dict):
    return SimpleNamespace(num_scheduled_tokens=tokens, total_num_scheduled_tokens=sum(tokens.values()),
                           scheduled_spec_decode_tokens=spec)


def test_server_times_pure_decode_steps_of_the_batch_it_decided_for():
    from calib.vllm.server import Server

    srv = Server(ServeKnobs("unused-tables"))
    srv.clock = StepClock(CURVE, min_steps=1, refresh=1)
    srv.time_step(_so({"a": 3, "b": 1}, {"a": [1, 2]}), 10.0, 0.0)  # the first: nothing to time it from
    assert srv.stats.clock_steps == 0 and srv.clock_last == 10.0
    srv.clock_pending = (2, False)
    srv.time_step(_so({"a": 3, "b": 1}, {"a": [1, 2]}), 10.2, 0.05)  # 200 ms less 50 of drafting, T = 4
    assert srv.stats.clock_steps == 1 and srv.clock.steps[(2, False)] == 1
    assert srv.clock.sums[(2, False)][4] == pytest.approx(min(0.15 - CURVE[4], MAX_RESIDUAL * CURVE[4]))
    assert set(srv.stats.clock) == {"B=2 greedy"}
    for so in (_so({"a": 3, "b": 9}, {"a": [1, 2]}),  # a prompt chunk rode along
               _so({"a": 1, "b": 1, "c": 1}, {})):  # another batch size than the decision's
        srv.clock_pending = (2, False)
        srv.time_step(so, 10.4, 0.0)
    assert srv.stats.clock_steps == 1
    srv.time_step(_so({"a": 1, "b": 1}, {}), 10.5, 0.0)  # no decision since (stood aside before it, or none)
    assert srv.stats.clock_steps == 1


def test_knobs():
    assert ServeKnobs("t").clock is True and ServeKnobs("t", clock=False).clock is False
    for bad in ({"clock": "yes"}, {"clock_decay": 0.0}, {"clock_decay": 1.5}, {"clock_prior": 0.0}):
        with pytest.raises((TypeError, ValueError), match=next(iter(bad))):
            ServeKnobs("t", **bad)


def test_a_step_priced_at_its_own_context_is_corrected_on_that_price():
    """Serving prices each step at its own context (knob context_price, calib.cost.serving.ContextCurves): the clock
    reads each step's residual from the curve that step was priced by, and corrects the curve it is given."""
    flat = np.full(50, 0.1)
    clock = StepClock(flat, decay=1.0, prior=8.0, refresh=1, min_steps=1)
    dear = flat + 0.05  # the step's own price: 50 ms dearer than the clock's curve
    for _ in range(20):
        assert clock.observe((4, False), 4, 4, 0.15, dear)  # took what its own price said
    a, j, b = clock.correction((4, False))
    assert abs(a) < 1e-9 and abs(j) < 1e-9 and abs(b) < 1e-9  # nothing beyond its own price
    got = clock.price((4, False), 4, dear)
    assert np.allclose(got.numpy(), dear) and clock.price((4, False), 4, dear) is got  # kept while the curve is
    assert np.allclose(clock.price((4, False), 4, flat).numpy(), flat)  # another step's price: rebuilt on it
    assert ServeKnobs("t").context_price is True and ServeKnobs("t", context_price=False).context_price is False
    with pytest.raises((TypeError, ValueError), match="context_price"):
        ServeKnobs("t", context_price="yes")


def _serve(clock: StepClock, steps: int, accepted: float, rng) -> tuple[int, np.ndarray, float]:
    """A SYNTHETIC engine whose steps with draft tokens pay 15 ms once beyond its base, where the curve prices a
    step without any 15 ms too dear, served by a decider that verifies 3 draft tokens (``accepted`` of them expected)
    where the clock's price says it pays. Returns the probes, the draft tokens per step and the tokens a second."""
    probes, drafted, seconds = 0, [], 0.0
    for _ in range(steps):
        if clock.probe(KEY):
            probes, x = probes + 1, 0
        else:
            price = clock.price(KEY, 16)
            gain = predicted_gain(CURVE if price is None else price, 16, np.array([3]), np.array([accepted]))
            clock.note_gain(KEY, gain)
            x = 3 if gain > 0 else 0
        drafted.append(x)
        took = CURVE[16 + x] - 0.015 + 0.015 * (x > 0) + rng.normal(0, 0.002)
        seconds += took
        clock.observe(KEY, 16, 16 + x, took)
    drafted = np.array(drafted)
    return probes, drafted, (16 * steps + accepted * (drafted > 0).sum()) / seconds


def test_a_batch_that_always_drafts_is_probed_until_the_clock_tells_the_jump():
    """The jump is learned only from steps both with and without draft tokens: where decisions expect little (below
    probe_gain), one step without drafts after probe_every drafted ones shows it, and the decider stops verifying
    draft tokens that cost more than they commit; where they expect much, or with probe_every 0, no probe."""
    rng = np.random.default_rng(1)
    probes, drafted, speed = _serve(StepClock(CURVE, probe_every=16, probe_gain=0.25), 300, 2.0, rng)
    blind = _serve(StepClock(CURVE, probe_every=0), 300, 2.0, rng)
    assert probes >= 1 and drafted[16] == 0 and (drafted[:16] > 0).all()  # the first after 16 drafted steps
    assert (blind[1] > 0).all() and blind[0] == 0  # never told: a step with 3 draft tokens looks worth it
    assert (drafted[100:] > 0).mean() < 0.2  # told: mostly none (a few drafted steps as the jump's evidence fades)
    none = 16 / (CURVE[16] - 0.015)  # tokens a second without speculation
    assert speed > 0.97 * none and blind[2] < 0.9 * none
    clock = StepClock(CURVE, probe_every=16, probe_gain=0.25)
    assert _serve(clock, 100, 12.0, rng)[0] == 0  # drafting wins clearly (gain > probe_gain): never probed


def test_predicted_gain():
    price = np.array([0.0, 0.05, 0.05, 0.06, 0.07, 0.08])  # [T_max + 1] seconds
    # 2 requests, 2 draft tokens, 1.5 expected accepted: 3.5 / 0.07 against 2 / 0.05
    assert predicted_gain(price, 2, np.array([2, 0]), np.array([1.5, np.nan])) == pytest.approx(3.5 / 0.07 / 40 - 1)
    assert predicted_gain(torch.tensor(price), 2, np.array([0, 0]), np.array([0.0, 0.0])) == 0.0  # nothing verified
    assert predicted_gain(price, 2, np.array([4, 0]), np.array([3.0, 0.0])) == 0.0  # past the curve: no figure


def test_server_probes_for_the_clock_and_says_so():
    from calib.vllm.server import Server

    srv = Server(ServeKnobs("unused-tables"))
    srv.clock = StepClock(CURVE, min_steps=1, probe_every=2)
    key = (16, tuple([0.0] * 16))  # calib.serve.aside.batch_key of 16 greedy requests
    assert srv.fresh_verdict(key) is None  # nothing timed yet
    for _ in range(2):
        srv.clock.observe(KEY, 16, 18, CURVE[18])
    srv.clock.note_gain(KEY, 0.1)
    assert srv.fresh_verdict(key) == "probe" and srv.fresh_verdict(key) is None  # one, then probe_every more steps
    srv.clock.observe(KEY, 16, 16, CURVE[16])
    assert srv.clock.drafted_run[KEY] == 0
    assert ServeKnobs("t").clock_probe == 16 and ServeKnobs("t", clock_probe=0).clock_probe == 0
    for bad in ({"clock_probe": -1}, {"clock_probe_gain": -0.1}):
        with pytest.raises((TypeError, ValueError), match=next(iter(bad))):
            ServeKnobs("t", **bad)
