"""``bench/profile_step.py --with-json``: a sampled profile and a greedy one fitted together, the sampled path's
jump apart from verify. SYNTHETIC profile rows (tests/cost/test_step.py's known cost), no engine."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.bench_scripts import load_bench
from tests.cost.test_step import TRUE, profile_rows
from tests.cost.test_step_sampled import SAMPLED, sampled_rows


def _profile(tmp_path, name: str, sampling: str, rows: list[dict], cpu: str | None = None) -> str:
    from calib.cost.step import this_machine

    cells = [{"arm": "arm", "concurrency": 4, "device": "cpu", "steps": rows}]
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps({"command": f"python bench/profile_step.py --sampling {sampling} (SYNTHETIC)",
                                "date": "2026-12-04", "cpu": cpu or this_machine(), "dtype": "float32",
                                "prompts": "code_edit", "sampling": sampling, "max_tokens": 8, "summary": [],
                                "cells": cells}))
    return str(path)


def test_a_sampled_profile_beside_a_greedy_one_fits_the_jump(tmp_path):
    from calib.cost.step import load_step_cost

    rng = np.random.default_rng(3)
    # the rows as bench/profile_step.py records them: no "sampled" flag (the file's sampling says it)
    rows = [{k: v for k, v in r.items() if k != "sampled"} for r in sampled_rows(rng)]
    sampled = _profile(tmp_path, "sampled", "sampled", rows)
    greedy = _profile(tmp_path, "greedy", "greedy", profile_rows(rng))
    out = tmp_path / "step-cost.json"
    load_bench("profile_step").main(["--from-json", sampled, "--with-json", greedy, "--step-cost", str(out)])
    cost = load_step_cost(out)
    assert cost.source["sampling"] == ["greedy", "sampled"]
    assert float(cost.verify(T=20, B=4)) == pytest.approx(float(TRUE.verify(T=20, B=4)), rel=0.03)
    assert float(cost.speculating_sampled(8, 4)) == pytest.approx(float(SAMPLED.speculating_sampled(8, 4)), rel=0.1)


def test_profiles_of_two_machines_fit_nothing(tmp_path):
    rng = np.random.default_rng(4)
    sampled = _profile(tmp_path, "sampled", "sampled", sampled_rows(rng))
    greedy = _profile(tmp_path, "greedy", "greedy", profile_rows(rng), cpu="Some Other CPU, 64 cores")
    out = tmp_path / "step-cost.json"
    with pytest.raises(SystemExit, match="one engine's step cost"):
        load_bench("profile_step").main(["--from-json", sampled, "--with-json", greedy, "--step-cost", str(out)])
    assert not out.exists()


def test_a_timed_part_waits_for_the_device_before_and_after(monkeypatch):
    """Issue 43: on a GPU a part's time is its kernels' (the timer synchronises before and after), not their
    launch's. No GPU here: the synchronisation is counted, not run."""
    prof = load_bench("profile_step")
    waits = []
    monkeypatch.setattr(prof, "_sync", lambda: waits.append(len(prof.TIMER.parts)))

    class Runner:
        def execute(self, x):
            waits.append("ran")
            return x + 1

    prof._timed(Runner, "execute", "forward")
    prof.TIMER.parts = {}
    assert Runner().execute(1) == 2
    assert waits == [0, "ran", 0] and set(prof.TIMER.parts) == {"forward"}  # waited before timing and before adding
