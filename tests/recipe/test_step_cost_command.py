"""The one command that refits serving's step cost on the user's engine (issue 43, Must 2), without an engine.

``python bench/profile_step.py --step-cost PATH`` fits calib/cost/step.py's model to the profiled steps and records
where they ran: the CPU (``source.cpu``) and the device the engine stepped on (``source.device``, vLLM's
``device_config.device_type``, taken from the profile's cells). The engine line's cost note
(calib/vllm/engine_line.py ``cost_note``) then stays silent on that engine and speaks on another. The profile here
is SYNTHETIC (rows made from a known cost, as tests/cost/test_step.py does); the real profile of an engine is in
tests/recipe/test_my_model_engine.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests.bench_scripts import load_bench
from tests.cost.test_step import profile_rows


def _profile(tmp_path, devices: list[str]) -> str:
    """An ``--out`` file as bench/profile_step.py writes it, one cell per device in ``devices`` (SYNTHETIC rows)."""
    from calib.cost.step import this_machine

    rng = np.random.default_rng(0)
    cells = []
    for i, device in enumerate(devices):
        rows = [{**r, "running": r["batch"]} for r in profile_rows(rng, 60)]
        cells.append({"arm": f"arm{i}", "concurrency": 4, "device": device, "steps": rows})
    path = tmp_path / "profile.json"
    path.write_text(json.dumps({"command": "python bench/profile_step.py (SYNTHETIC)", "date": "2026-12-04",
                                "cpu": this_machine(), "dtype": "float32", "prompts": "code_edit",
                                "sampling": "greedy", "max_tokens": 8, "summary": [], "cells": cells}))
    return str(path)


def _note(path, device: str) -> str:
    from calib.vllm.engine_line import cost_note

    return cost_note(device, json.dumps({"tables": "unused", "cost": str(path)}))


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_the_refit_records_its_device_and_the_engine_line_goes_quiet_there(tmp_path, device, capsys):
    from calib.cost.step import load_step_cost

    bench = load_bench("profile_step")
    out = tmp_path / "step-cost.json"
    bench.main(["--from-json", _profile(tmp_path, [device, device]), "--step-cost", str(out)])
    assert f"wrote {out}" in capsys.readouterr().out
    cost = load_step_cost(out)
    assert cost.source["device"] == device and cost.source["steps"] > 0
    assert _note(out, device) == ""  # fitted on this engine: nothing to say
    other = "cuda" if device == "cpu" else "cpu"
    note = _note(out, other)  # the same file on an engine of the other kind: said once, with how to refit
    assert note.startswith(f"step cost {out}: ") and "bench/profile_step.py --step-cost" in note, note


def test_a_profile_of_two_devices_fits_no_step_cost(tmp_path):
    bench = load_bench("profile_step")
    out = tmp_path / "step-cost.json"
    with pytest.raises(SystemExit, match=r"\['cpu', 'cuda'\].*fresh --out"):
        bench.main(["--from-json", _profile(tmp_path, ["cpu", "cuda"]), "--step-cost", str(out)])
    assert not out.exists()


def test_a_profile_written_before_devices_were_recorded_reads_as_cpu(tmp_path):
    from calib.cost.step import load_step_cost

    bench = load_bench("profile_step")
    doc = json.loads(Path(_profile(tmp_path, ["cpu"])).read_text())
    for cell in doc["cells"]:
        del cell["device"]
    (tmp_path / "old.json").write_text(json.dumps(doc))
    bench.main(["--from-json", str(tmp_path / "old.json"), "--step-cost", str(tmp_path / "c.json")])
    assert load_step_cost(tmp_path / "c.json").source["device"] == "cpu"
