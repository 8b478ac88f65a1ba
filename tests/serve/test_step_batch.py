"""A serving step's batch paths decide and learn as their one-by-one forms, on SYNTHETIC tables
(tests/serve/decide_cases.py's): the numpy lookup is the tensor lookup bit for bit (binned and interpolated
tables, read through an online correction too); a step's rounds observed at once
(:meth:`SafeDecider.observe_step`, :meth:`RequestHistory.observe_rounds`) leave the history, the correction and
the next decisions as observing them one by one, and as a plain per-request formulation of the correction's
bookkeeping (each round's table probabilities kept per request, learnt in the order observed), rounds
observed out of order, a step late, or with another draft length than decided included."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from calib.chains import chain
from calib.serve import RequestHistory
from calib.serve.decide import context_columns
from calib.tables.io import load, save
from calib.tables.layout import ChainTable, chain_lookup, chain_lookup_host
from calib.tables.online import OnlineSettings, outcome_rows
from tests.serve.decide_cases import META, random_inputs, synthetic_decider, synthetic_tables

SETTINGS = OnlineSettings(decay=0.99, prior=4.0)


@pytest.fixture
def saved(tmp_path):
    return save(tmp_path / "tables", synthetic_tables(5), META)


def _tensor_path(t: ChainTable) -> ChainTable:
    """``t`` looked up with torch ops: a table with a ``read`` and no ``read_host`` takes the tensor path."""
    grid = t.grid
    return ChainTable(t.axes, t.grid, t.edges, t.strides, read=t.read or (lambda r, c: grid[r, c]))


def _rounds(inputs, out, step: int) -> list[tuple]:
    """(request, accepted, drafted) of the step's drafted requests (SYNTHETIC outcomes)."""
    return [(r, step % (len(d) + 1), len(d)) for r, d in zip(inputs.req_ids, out.drafts) if d]


def _remember_by_hand(dec, inputs, out, skip, pending: dict) -> None:
    """The correction's view of a decided step, request by request: (chain, cell, table probabilities [depth])."""
    for b, r in enumerate(inputs.req_ids):
        d = int(out.depth[b])
        name = chain(int(out.chain[b])).name if d else None
        if not d or (b < len(skip) and skip[b]) or name not in dec.online.chains:
            continue
        values = context_columns(dec.online.chains[name]["context"], inputs, dec.history)[b: b + 1]
        cell = dec.online.cells(name, values)
        table = dec.online.table_of(name, out.probs[b: b + 1].double().numpy(), cell)
        pending[r] = (name, int(cell[0]), table[0, :d])


def _learn_by_hand(dec, rounds, pending: dict) -> None:
    """The rounds observed, then learnt per chain in the order observed (one update per chain)."""
    by_chain: dict[str, list] = {}
    for r, acc, drafted in rounds:
        dec.history.observe(r, acc, drafted)
        got = pending.pop(r, None)
        if got is not None and drafted == len(got[2]):
            by_chain.setdefault(got[0], []).append((got[1], got[2], min(acc, len(got[2]))))
    for name, kept in by_chain.items():
        width = max(len(p) for _, p, _ in kept)
        p = np.full((len(kept), width), np.nan)
        for i, (_, row, _) in enumerate(kept):
            p[i, : len(row)] = row
        drafted = np.array([len(row) for _, row, _ in kept])
        accepted = np.array([a for _, _, a in kept])
        dec.online.observe(name, p, outcome_rows(accepted, drafted, width), [c for c, _, _ in kept])
    dec.online.refresh(lazy=True)


def test_a_step_observed_at_once_learns_as_request_by_request(saved):
    one, batch, by_hand = (synthetic_decider(saved, online=SETTINGS) for _ in range(3))
    pending: dict = {}
    rng = np.random.default_rng(0)
    late = None  # a round decided a step ago, observed a step late
    learnt = 0
    for step in range(8):
        inputs = random_inputs(B=6, seed=40 + step)
        outs = [d.decide(inputs) for d in (one, batch, by_hand)]
        assert outs[0].drafts == outs[1].drafts == outs[2].drafts
        skip = [late is not None and r == late[0] for r in inputs.req_ids]  # not decided again while it waits
        for d, out in zip((one, batch), outs):
            d.remember(inputs, out, skip=skip)
        _remember_by_hand(by_hand, inputs, outs[2], skip, pending)
        rounds = [x for x in _rounds(inputs, outs[0], step) if not (late and x[0] == late[0])]
        rounds = [rounds[i] for i in rng.permutation(len(rounds))]  # observed in another order than decided
        if late is not None:
            rounds.append(late)
            late = None
        if step in (1, 4) and len(rounds) > 1:
            late, rounds = rounds[0], rounds[1:]
        if step == 5 and rounds:  # another draft length than decided: counted in the history, not learnt
            r, acc, d = rounds[0]
            rounds[0] = (r, acc, d + 1)
        for r, acc, d in rounds:
            one.observe(r, acc, d)
        if rounds:
            batch.observe_step(*zip(*rounds))
        _learn_by_hand(by_hand, rounds, pending)
        one.refresh()
        batch.refresh()
        states = [repr(d.online.state()) for d in (one, batch, by_hand)]
        assert states[0] == states[1] == states[2]
        assert one.history._state == batch.history._state == by_hand.history._state
        learnt += len(rounds)
    assert learnt > 10 and one.failures == batch.failures == 0
    assert any(v["n"][0] for c in batch.online.chains.values() for v in c["correction"].state().values())


def test_a_refused_round_in_a_step_is_refused_as_alone(saved):
    one, batch = synthetic_decider(saved, online=SETTINGS), synthetic_decider(saved, online=SETTINGS)
    rounds = [("req-0", 1, 2), ("req-1", 3, 2), ("req-2", 0, 1)]  # req-1: more accepted than drafted
    for r, a, d in rounds:
        one.observe(r, a, d)
    batch.observe_step(*zip(*rounds))
    assert one.failures == batch.failures == 1
    assert one.history._state == batch.history._state and "req-1" not in batch.history


def test_observe_rounds_is_observe_round_by_round():
    rng = np.random.default_rng(1)
    one, many = RequestHistory(), RequestHistory()
    for _ in range(20):
        ids = [f"r{i}" for i in rng.choice(8, size=int(rng.integers(1, 6)), replace=False)]
        drafted = rng.integers(1, 5, size=len(ids))
        accepted = [int(rng.integers(0, d + 1)) for d in drafted]
        for r, a, d in zip(ids, accepted, drafted):
            one.observe(r, a, int(d))
        many.observe_rounds(ids, accepted)
        if rng.random() < 0.3:
            one.finish(ids[0])
            many.finish(ids[0])
    names = [f"r{i}" for i in range(9)]
    got, want = many.values(names), one.values(names)
    assert all(np.array_equal(got[n], want[n], equal_nan=True) for n in want)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("online", [False, True])
def test_the_numpy_lookup_is_the_tensor_lookup(saved, seed, online):
    dec = synthetic_decider(saved, online=SETTINGS if online else None)
    for step in range(3 if online else 0):  # the correction learns first: lookups read corrected values
        inputs = random_inputs(B=6, seed=60 + step)
        out = dec.decide(inputs)
        dec.remember(inputs, out)
        rounds = _rounds(inputs, out, step + 1)
        if rounds:
            dec.observe_step(*zip(*rounds))
        dec.refresh()
    if online:
        assert any(c["correction"]._learnt for c in dec.online.chains.values())
    rng = np.random.default_rng(seed)
    for t in dec.tables.chains.values():
        A = len(t.axes)
        x = rng.uniform(-0.5, 4.0, size=(7, 5, A)).astype(np.float32)  # below, between and past the edges
        if t.interpolated:
            x[..., 0] = rng.uniform(0, 1, size=(7, 5))
            x[0, :3, 0] = (0.0, 1.0, 0.5)
        x[rng.random((7, 5)) < 0.2, 0] = np.nan  # no token
        x[..., 1:][rng.random((7, 5, A - 1)) < 0.1] = np.nan  # a context value not recorded: bucket 0
        x[1, 1, -1] = np.inf
        want = chain_lookup(_tensor_path(t), torch.from_numpy(x)).numpy()
        got = chain_lookup_host(t, x)
        assert got.dtype == np.float32 and np.isnan(want).any() and not np.isnan(want).all()
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(chain_lookup(t, torch.from_numpy(x)).numpy(), want)  # CPU: the numpy path
        if t.interpolated:
            x[2, 0, 0] = 1.5  # a logit passed by mistake: refused alike
            with pytest.raises(ValueError, match=r"\[2, 0\] = 1.5"):
                chain_lookup_host(t, x)
            with pytest.raises(ValueError, match=r"\[2, 0\] = 1.5"):
                chain_lookup(_tensor_path(t), torch.from_numpy(x))


def test_a_grid_rewritten_in_place_is_read_by_the_numpy_lookup(saved):
    t = load(saved).chains["ngram"]
    x = np.full((1, 2, len(t.axes)), 0.0, dtype=np.float32)
    before = chain_lookup_host(t, x)
    t.grid.mul_(0.5)  # what OnlineTables._write does to a host grid
    np.testing.assert_array_equal(chain_lookup_host(t, x), before * np.float32(0.5))
    t.grid = t.grid * 2  # a new grid tensor
    np.testing.assert_array_equal(chain_lookup_host(t, x), before)


def test_the_decider_logs_each_unfitted_temperature_once_across_steps(tmp_path, caplog):
    """SafeDecider keeps the sets of temperatures it checked (a set checked once logs nothing new): a new
    temperature beside ones already seen is still logged, once."""
    import logging

    from tests.serve.decide_cases import D

    temps = {"values": [0.0, 0.8], "n_values": 2, "min": 0.0, "max": 0.8, "unrecorded_samples": 0}
    meta = {**META, "chains": {"model": {"ids": ["eagle:head"], "k": D, "temperatures": temps},
                               "ngram": {"ids": ["ngram"], "k": D, "temperatures": temps}}}
    dec = synthetic_decider(save(tmp_path / "t", synthetic_tables(6), meta))
    inputs = random_inputs(B=4, seed=3)
    with caplog.at_level(logging.WARNING, logger="calib.serve"):
        for t in ([0.0, 1.3, 0.8, 1.3], [0.0, 1.3, 0.8, 1.3], [1.3, 0.0, 0.0, 2.0], [2.0, 1.3, 0.8, 0.0]):
            inputs.temperature = torch.tensor(t)
            assert not dec.decide(inputs).passthrough
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 2 and "temperature 1.3 outside" in warned[0] and "temperature 2 outside" in warned[1]
