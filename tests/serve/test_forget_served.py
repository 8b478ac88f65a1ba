"""Every arm starts every timed cell from the same state (calib.vllm.cell_stats.forget_served, bench/serve.py's
warm-up): no prefix-cache entry or suffix-tree response left by the warm-up or an earlier cell. Stand-in engines
(no vLLM): what is asked of the engine, and what the warm-up serves."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from calib.prompts import load_prompts
from calib.vllm import cell_stats, serve_runner
from tests.bench_scripts import load_bench


class _Engine:
    def __init__(self, unfinished=False, reset_ok=True):
        self.calls, self.unfinished, self.reset_ok = [], unfinished, reset_ok
        self.llm_engine = SimpleNamespace(has_unfinished_requests=lambda: self.unfinished)

    def reset_prefix_cache(self):
        self.calls.append("reset_prefix_cache")
        return self.reset_ok

    def collective_rpc(self, method):
        self.calls.append(method)
        return [None]


def test_the_prefix_cache_is_emptied_and_the_workers_forget_their_suffix_responses():
    llm = _Engine()
    cell_stats.forget_served(llm)
    assert llm.calls == ["reset_prefix_cache", cell_stats._forget_in_worker]


def test_it_refuses_while_requests_are_in_flight():
    llm = _Engine(unfinished=True)
    with pytest.raises(RuntimeError, match="between cells"):
        cell_stats.forget_served(llm)
    assert llm.calls == []


def test_a_prefix_cache_vllm_would_not_reset_is_said(caplog):
    with caplog.at_level("WARNING", logger="calib.serve"):
        cell_stats.forget_served(_Engine(reset_ok=False))
    assert "did not reset its prefix cache" in caplog.text


def test_the_worker_ends_calibs_stand_aside_stretch(monkeypatch):
    """A stretch kept for a batch of one size and temperatures carried into the next cell of that batch shape (code
    edits c = 4 greedy after chat c = 4 greedy stood aside with vLLM's own lists)."""
    from calib.serve.aside import StandAside, batch_key
    from calib.vllm import serving

    aside, key = StandAside(after=1, every=16), batch_key([0.0] * 4)
    aside.record(key, "engine")
    assert aside.verdict(key) == "engine"
    monkeypatch.setattr(serving, "server", lambda: SimpleNamespace(aside=aside, recomputed={}, decider=None,
                                                                    clock=None))
    worker = SimpleNamespace(model_runner=SimpleNamespace(drafter=object()))
    assert cell_stats._forget_in_worker(worker) == {"vllm": 0, "calib": 0}
    assert aside.verdict(key) is None


def test_the_worker_forgets_what_calib_learnt_while_serving(monkeypatch):
    """The online correction and the step clock start every cell from the same state: a cell of code edits after one
    of chat read chat's acceptance and prices (December 7: 9 draft tokens a step after chat, 27 before it)."""
    import numpy as np

    from calib.serve.aside import StandAside
    from calib.serve.step_clock import StepClock
    from calib.vllm import serving

    forgot = []
    clock = StepClock(np.linspace(0.05, 0.1, 20), min_steps=1)
    clock.observe((2, False), 2, 4, 0.2)
    from calib.vllm.serve_stats import ServeStats

    stats = ServeStats(clock={"B=2 greedy": [1.0, 0.0, 0.0, 1]})
    srv = SimpleNamespace(aside=StandAside(), recomputed={}, clock=clock, stats=stats,
                          decider=SimpleNamespace(forget_learned=lambda: forgot.append(True)))
    monkeypatch.setattr(serving, "server", lambda: srv)
    cell_stats._forget_in_worker(SimpleNamespace(model_runner=SimpleNamespace(drafter=object())))
    assert forgot == [True] and clock.correction((2, False)) == (0.0, 0.0, 0.0) and clock.price((2, False), 2) is None
    assert stats.clock == {}  # the next cell's record shows its own batches only


def test_a_cells_statistics_are_its_own():
    """Counters, the history's tally of counters and per-step lists are the cell's own (the process keeps serving
    across cells); the clock's summaries (lists of figures, not counters) are taken as they stand."""
    before = {"steps": 10, "hook_ms": [1.0, 2.0], "history": {"rounds": 893, "whole": 857, "verified": 164},
              "clock": {"B=16 greedy": [1.0, 2.0, 3.0, 40]}, "oracle": False}
    after = {"steps": 25, "hook_ms": [1.0, 2.0, 3.0], "history": {"rounds": 1614, "whole": 2832, "verified": 1445},
             "clock": {"B=16 greedy": [4.0, 5.0, 6.0, 21]}, "oracle": False}
    cell = cell_stats.stats_delta(before, after)
    assert cell["steps"] == 15 and cell["hook_ms"] == [3.0] and cell["oracle"] is False
    assert cell["history"] == {"rounds": 721, "whole": 1975, "verified": 1281}
    assert cell["clock"] == {"B=16 greedy": [4.0, 5.0, 6.0, 21]}
    assert cell_stats.stats_delta(None, after)["history"] == after["history"]  # the first cell: all of it


def test_a_worker_without_a_suffix_drafter_or_calib_serving_forgets_nothing():
    worker = SimpleNamespace(model_runner=SimpleNamespace(drafter=object()))
    assert cell_stats._forget_in_worker(worker) == {"vllm": 0, "calib": 0}


@pytest.mark.parametrize("category", ["chat", "code_edit"])
def test_the_warm_up_serves_prompts_no_cell_serves(category):
    bench = load_bench("serve")
    warm = bench.warmup_prompts(category)
    served = load_prompts([f"data/prompts/{category}.jsonl"], root=bench.ROOT)
    assert len(warm) == 2
    assert {p.id for p in warm}.isdisjoint(p.id for p in served)
    assert {str(p.messages) for p in warm}.isdisjoint(str(p.messages) for p in served)


def test_a_category_without_held_out_prompts_warms_up_on_another_categorys():
    assert len(load_bench("serve").warmup_prompts("smoke")) == 2


def test_the_bench_worker_warms_up_off_the_cells_prompts_and_forgets_before_every_cell(tmp_path, monkeypatch):
    """bench/serve.py's worker, engine stood in: warm-up on held-out prompts, then the engine's state forgotten
    before each timed cell, whatever the cells' shuffled order; each repetition's engine seeded apart."""
    import json

    bench = load_bench("serve")
    calls, seeds = [], []
    monkeypatch.setattr(serve_runner, "build_engine", lambda cfg, root, max_num_seqs: seeds.append(cfg["seed"]))
    monkeypatch.setattr(cell_stats, "forget_served", lambda llm: calls.append("forget"))

    def serve_cell(llm, cfg, prompts, sampling, concurrency, category, progress=True, tokens=None):
        calls.append(("serve", sampling["max_tokens"], tuple(p.id for p in prompts)))
        return {"tok_s": 1.0}, {}

    monkeypatch.setattr(serve_runner, "serve_cell", serve_cell)
    cells = [{"category": "code_edit", "sampling": s, "concurrency": 1, "max_tokens": 4, "n_prompts": 2}
             for s in ("greedy", "sampled")]
    spec = {"arm": "none", "rep": 0, "seed": 0, "cells": cells, "reference": None,
            "overrides": [*bench.ARMS["none"]], "out": str(tmp_path / "out.json")}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    bench.worker(str(tmp_path / "spec.json"))
    warm = tuple(p.id for p in bench.warmup_prompts("code_edit"))
    assert calls[0] == ("serve", 8, warm)
    assert calls[1] == "forget" and calls[2][0] == "serve" and calls[3] == "forget" and calls[4][0] == "serve"
    assert len(calls) == 5 and not set(warm) & set(calls[2][2] + calls[4][2])
    assert len(json.loads((tmp_path / "out.json").read_text())) == 2
    spec.update(rep=3)  # a later repetition samples with a seed of its own
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    bench.worker(str(tmp_path / "spec.json"))
    assert seeds == [0, 3]
