"""Standing aside (calib/serve/aside.py): stretches of one batch whose decisions change nothing are taken without
deciding, re-checked every few steps, ended by another batch or another kind of decision. SYNTHETIC decisions;
the server-level case drives the real serving state through bench/hot_path.py's stand-in runner (real tables,
real code-edit prompts, no engine)."""

from __future__ import annotations

import pytest

from calib.serve.aside import EMPTY, StandAside, batch_key, decision_kind, proposal_price


def test_a_stretch_begins_after_the_streak_and_is_rechecked():
    aside, key = StandAside(after=3, every=4), batch_key([0.0, 0.0])
    began = [aside.record(key, "engine") for _ in range(3)]
    assert began == [False, False, True]  # logged once, when the stretch first begins
    assert [aside.verdict(key) for _ in range(3)] == ["engine"] * 3
    assert aside.verdict(key) is None  # the 4th step of the stretch is decided again
    assert aside.record(key, "engine") is False  # same kind: the stretch goes on, not logged again
    assert aside.verdict(key) == "engine"


def test_another_batch_or_kind_ends_the_stretch():
    aside, key = StandAside(after=2, every=8), batch_key([0.8] * 4)
    aside.record(key, "none")
    aside.record(key, "none")
    assert aside.verdict(key) == "none"
    assert aside.verdict(batch_key([0.8] * 5)) is None  # a request joined
    assert aside.verdict(batch_key([0.0] * 4)) is None  # other temperatures: another price
    aside.record(key, None)  # the re-check changed something
    assert aside.verdict(key) is None
    assert StandAside(after=0).verdict(key) is None  # after=0: always decide


def test_a_step_without_a_proposal_neither_extends_nor_ends_a_stretch():
    """Chat at concurrency 1 has no n-gram match on many steps: those must not make a "none" stretch that then drops
    the matches of the steps after (0.94x vLLM's n-gram arm on the clock before this)."""
    aside, key = StandAside(after=2, every=8), batch_key([0.0])
    assert decision_kind([[]], [[]]) == EMPTY
    for _ in range(5):
        aside.record(key, decision_kind([[]], [[]]))
    assert aside.verdict(key) is None  # no stretch from empty steps
    aside.record(key, "engine")
    aside.record(key, EMPTY)
    aside.record(key, "engine")
    assert aside.verdict(key) == "engine"  # the empty step between did not break the streak


def test_a_step_the_plan_ran_no_pass_on_is_calibs_own_and_ends_an_engine_stretch():
    """On a model-drafter engine vLLM proposes nothing where calib's plan ran no pass: that is calib's decision, not
    a step without a proposal. Counted as EMPTY, it kept an "engine" stretch (vLLM's K EAGLE passes, handed through)
    alive through every re-check: code edits c = 4 greedy served 74 of 81 steps so, 0.53x (bench/serve.py, Dec 5)."""
    assert decision_kind([[5, 6], []], [[], []], planned_passes=0) is None  # another chain verified: its own lists
    assert decision_kind([[], []], [[], []], planned_passes=0) == "none"
    assert decision_kind([[], []], [[], []], planned_passes=None) == EMPTY  # no plan: vLLM found nothing to draft
    aside, key = StandAside(after=2, every=4), batch_key([0.0, 0.0])
    for _ in range(2):
        aside.record(key, "engine")
    while aside.verdict(key) == "engine":
        pass
    aside.record(key, decision_kind([[5, 6], [7]], [[], []], planned_passes=0))  # the re-check: the plan ran none
    assert aside.verdict(key) is None  # the stretch is over


def test_vllms_lists_under_a_plan_of_fewer_passes_are_not_vllms_own():
    """Kept whole, the head's 2-pass draft is the plan's, not vLLM's K = 4: an "engine" stretch would run 4 passes."""
    assert decision_kind([[5, 6]], [[5, 6]], planned_passes=2, k=4) is None
    assert decision_kind([[5, 6, 7, 8]], [[5, 6, 7, 8]], planned_passes=4, k=4) == "engine"
    assert decision_kind([[5, 6]], [[5, 6]]) == "engine"  # no plan (the n-gram engine): vLLM's own


def test_forget_ends_the_stretch():
    aside, key = StandAside(after=2, every=8), batch_key([0.0])
    aside.record(key, "engine")
    aside.record(key, "engine")
    assert aside.verdict(key) == "engine"
    aside.forget()
    assert aside.verdict(key) is None


def test_decision_kinds():
    assert decision_kind([[], []], [[1, 2], []]) == "none"
    assert decision_kind([[1, 2], []], [[1, 2], []]) == "engine"
    assert decision_kind([[1], []], [[1, 2], []]) is None  # truncated
    with pytest.raises(ValueError, match="after >= 0, every >= 1"):
        StandAside(after=2, every=0)


def _sure_tables(path):
    """SYNTHETIC n-gram tables for SmolLM2-135M-Instruct that accept every draft token with probability 0.99: priced
    cheaply, every decision verifies vLLM's chains whole."""
    import math

    import torch

    from calib.chains import Axis
    from calib.tables.io import save
    from calib.tables.layout import ChainTable, GridTables

    axes = (Axis("match_n", edges=(1.5, 2.5)), Axis("temperature", edges=(0.4,)))
    table = ChainTable.build(axes, torch.full((4, 6), 0.99), torch.tensor([[1.5, 2.5], [0.4, math.inf]]),
                             torch.tensor([2, 1]))
    meta = {"target_models": ["SmolLM2-135M-Instruct"], "chains": {"ngram": {"ids": ["ngram"], "k": 4}}}
    return str(save(path, GridTables({"ngram": table}), meta))


def test_the_server_hands_vllms_own_lists_through_while_aside(tmp_path):
    """On the n-gram stand-in every decision verifies vLLM's chains whole; after the streak the server hands vLLM's
    own lists through without deciding, decides again every aside_every steps, and counts both."""
    from tests.bench_scripts import load_bench

    hot = load_bench("hot_path")
    tables = _sure_tables(tmp_path / "tables")
    on = hot.run("ngram", 4, 45, 0.0, tables, "1.0,0.001", seed=0, aside_after=4)
    assert on["errors"] == 0 and on["decided"] + on["aside_engine"] + on["aside_none"] == 45
    # 4 decisions to begin, then 15 steps aside and 1 re-check per 16: 6 decided, 39 aside
    assert (on["decided"], on["aside_engine"]) == (6, 39), on
    off = hot.run("ngram", 4, 45, 0.0, tables, "1.0,0.001", seed=0, aside_after=0)
    assert off["aside_engine"] == 0 and off["decided"] == 45
    # each position a tenth of the step's fixed price: the whole proposal would add 114 %, so calib decides every step
    steep = hot.run("ngram", 4, 45, 0.0, tables, "1.0,0.1", seed=0, aside_after=4)
    assert steep["errors"] == 0 and steep["aside_engine"] == 0 and steep["decided"] == 45, steep


def test_a_stretch_of_vllms_lists_begins_only_where_its_whole_proposal_is_cheap(caplog):
    """A streak of whole chains says the drafts were good lately, not that they stay so: where vLLM's whole proposal
    (K tokens for every request) adds more than ``engine_price`` to a step's price, calib decides every step."""
    import logging

    import numpy as np

    flat = np.full(21, 0.05)  # a single request's step on the EPYC: verifying K more positions costs nothing
    steep = 0.04 + 0.004 * np.arange(21)  # a batch of 4: K tokens each add 0.064 s to a 0.056-s step
    assert proposal_price(flat, 1, 4) == 0.0 and proposal_price(steep, 4, 4) == pytest.approx(0.064 / 0.056)
    assert proposal_price(steep, 8, 4) == pytest.approx(steep[20] / steep[8] - 1)  # longer than the curve: its end
    whole = [[5, 6, 7, 8]] * 4
    cheap, costly = StandAside(after=4), StandAside(after=4)
    with caplog.at_level(logging.INFO, logger="calib.serve"):
        for _ in range(4):
            assert cheap.kind_of(whole[:1], whole[:1], None, 4, flat) == "engine"
            cheap.record(batch_key([0.0]), "engine")
            kind = costly.kind_of(whole, whole, None, 4, steep)
            assert kind is None  # never "engine": the streak does not grow
            costly.record(batch_key([0.0] * 4), kind)
    assert cheap.verdict(batch_key([0.0])) == "engine" and costly.verdict(batch_key([0.0] * 4)) is None
    assert sum("deciding every step at batch 4" in r.message for r in caplog.records) == 1  # logged once per batch
    # no draft tokens at all is another matter (no speculation pays): a "none" stretch needs no cheap proposal
    assert costly.kind_of([[]] * 4, whole, None, 4, steep) == "none"
    # a loose enough limit, or no price at all (budget mode), stands aside as before
    assert StandAside(engine_price=1.5).kind_of(whole, whole, None, 4, steep) == "engine"
    assert costly.kind_of(whole, whole, None, 4, None) == "engine"
    with pytest.raises(ValueError, match="engine_price"):
        StandAside(engine_price=-0.1)
