"""The hostile probe of December 5 (bench/hostile_probe.py, docs/hostile.md): each input it found silent, crashing,
unclear or losing a user's file, refused now naming the file / key / row (or, where the input is valid, accepted).

SYNTHETIC inputs only: the shipped step cost edited in a temp folder, hand-written CSVs, prompt lines and bench JSON.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from calib.collect.runner import check_config as check_collect
from calib.config_checks import check_serve
from calib.cost import make_curve, read_curve_csv
from calib.cost.step import load_step_cost
from calib.evaluate import clock_blocks
from calib.evaluate.checks import check_eval
from calib.prompts import load_prompts
from tests.bench_scripts import load_bench
from tests.hostile.test_config import _compose

ROOT = Path(__file__).resolve().parents[2]
STEP = json.loads((ROOT / "data/cost/smollm2-135m-cpu-step.json").read_text())
LINE = {"id": "a-0", "category": "chat", "messages": [{"role": "user", "content": "Hi"}]}


def _step_file(tmp_path: Path, **terms) -> Path:
    doc = {**json.loads(json.dumps(STEP)), **terms}
    path = tmp_path / "step-cost.json"
    path.write_text(json.dumps(doc))
    return path


# --- step-cost files (cost.engine.path=, serve.cost=) ------------------------------------------------------------
@pytest.mark.parametrize("terms, expected", [
    ({"idle": {"intercept": 0.001, "slopes": {"X": 0.001}}}, "idle: slopes over ['X']; this calib prices idle over ['T']"),
    ({"lm_head": {"intercept": 0.001, "slopes": {"T": 0.001}}}, "this calib prices lm_head over ['B'] only"),
    ({"source": "my laptop"}, "source: 'my laptop' (str); expected an object"),
])
def test_a_step_cost_term_over_inputs_it_is_not_priced_by_is_refused(tmp_path, terms, expected):
    """A KeyError when charged (an unknown input) or a term silently never read (lm_head over T); a source that is not
    an object escaped as an AttributeError from the other-machine check."""
    path = _step_file(tmp_path, **terms)
    with pytest.raises(ValueError) as err:
        load_step_cost(path)
    assert str(path) in str(err.value) and expected in str(err.value) and "bench/profile_step.py" in str(err.value)


def test_a_step_cost_that_prices_a_step_at_zero_names_its_file(tmp_path):
    path = _step_file(tmp_path, verify={"intercept": 0.0, "slopes": {"T": 0.0}})
    with pytest.raises(ValueError, match=r"every verify cost must be finite and positive") as err:
        make_curve("engine", {"kind": "engine", "path": str(path)}, 16)
    assert str(err.value).startswith(f"{path}: ")


def test_the_shipped_step_cost_still_loads_and_charges():
    curve = make_curve("engine", {"kind": "engine", "path": str(ROOT / "data/cost/smollm2-135m-cpu-step.json")}, 16)
    assert np.all(curve.for_batch(2).with_drafter(True).charge(np.array([1, 3])) > 0)


# --- measured verify-cost CSVs ---------------------------------------------------------------------------------------
def test_a_csv_with_a_byte_order_mark_reads_as_without(tmp_path):
    (tmp_path / "a.csv").write_bytes(b"\xef\xbb\xbfT,seconds\r\n1,0.05\r\n2,0.06\r\n")
    ts, secs = read_curve_csv(tmp_path / "a.csv")
    assert ts.tolist() == [1.0, 2.0] and secs.tolist() == [0.05, 0.06]


@pytest.mark.parametrize("make, expected", [
    (lambda p: p.mkdir(), "is a folder, not a CSV file"),
    (lambda p: p.write_bytes(b"T,seconds\n1,0.05\n2,\xff\n"), "not UTF-8 text (byte 19)"),
    (lambda p: None, "cannot be read (No such file or directory)"),
])
def test_a_csv_that_cannot_be_read_is_named(tmp_path, make, expected):
    """IsADirectoryError / UnicodeDecodeError escaped."""
    path = tmp_path / "verify.csv"
    make(path)
    with pytest.raises(ValueError) as err:
        read_curve_csv(path)
    assert str(path) in str(err.value) and expected in str(err.value)


# --- prompt files --------------------------------------------------------------------------------------------------
def test_a_prompt_file_with_a_byte_order_mark_loads(tmp_path):
    (tmp_path / "p.jsonl").write_bytes(b"\xef\xbb\xbf" + json.dumps(LINE).encode() + b"\r\n")
    assert [p.id for p in load_prompts([tmp_path / "p.jsonl"])] == ["a-0"]


@pytest.mark.parametrize("messages, expected", [
    ([{"role": "system", "content": "Be brief."}], "messages hold no user message (roles ['system'])"),
    ([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}],
     "messages[1] is the assistant's turn"),
])
def test_a_conversation_with_nothing_to_answer_is_refused(tmp_path, messages, expected):
    (tmp_path / "p.jsonl").write_text(json.dumps(LINE) + "\n" + json.dumps({**LINE, "id": "a-1", "messages": messages}))
    with pytest.raises(ValueError) as err:
        load_prompts([tmp_path / "p.jsonl"])
    assert f"{tmp_path}/p.jsonl, line 2:" in str(err.value) and expected in str(err.value)


# --- collect.py's config -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("override, expected", [
    ("sampling.temperature=nan", "sampling.temperature=nan: expected a finite number >= 0"),
    ("sampling.temperature=inf", "sampling.temperature=inf"),
    ("sampling.top_p=high", "sampling.top_p='high': expected a number in (0, 1]"),
    ("sampling.max_tokens=true", "sampling.max_tokens=True: expected a whole number >= 1"),
    ("seed=-1", "seed=-1: expected a whole number >= 0"),
])
def test_collect_refuses_settings_it_passed(override, expected):
    """NaN and a bool passed and were recorded as the bank's; a word for top_p escaped from float()."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = OmegaConf.to_container(compose("collect", overrides=[f"root={ROOT}", "out_dir=x", override]), resolve=True)
    with pytest.raises(ValueError) as err:
        check_collect(cfg)
    assert str(err.value).startswith("collect config: ") and expected in str(err.value)


# --- eval.py's cost files, read by its config check ---------------------------------------------------------------
@pytest.mark.parametrize("overrides, expected", [
    (["cost=engine", "cost.engine.path=data/cost"], ["cost.engine.path='data/cost'", "is a folder, not a JSON file"]),
    (["cost=engine", "cost.engine.path=data/cost/smollm2-135m-cpu.csv"], ["cost.engine.path=", "is not valid JSON"]),
    (["cost=engine", "cost.engine.charge=data/cost/nope.json"], ["cost.engine.charge='data/cost/nope.json'",
                                                                  "missing file"]),
    (["cost=measured", "cost.measured.path=data/cost/nope.csv"], ["cost.measured.path='data/cost/nope.csv'",
                                                                   "cannot be read"]),
])
def test_eval_reads_its_cost_files_before_any_bank(overrides, expected):
    with pytest.raises(ValueError) as err:
        check_eval(_compose("eval", overrides))
    assert all(e in str(err.value) for e in expected), str(err.value)


# --- serve.py reference_out: never a user's file -------------------------------------------------------------------
def test_reference_out_onto_a_file_that_is_not_a_reference_is_refused(tmp_path):
    """The run wrote its reference over the prompt file named there, at its end."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps(LINE) + "\n")
    base = ["policy=no_spec", "speculative=none"]
    with pytest.raises(ValueError, match=r"reference_out=.*p.jsonl exists and is not a clock-oracle reference"):
        check_serve(_compose("serve", [*base, f"reference_out={prompts}"]))
    with pytest.raises(ValueError, match=r"is a folder; name the reference file"):
        check_serve(_compose("serve", [*base, f"reference_out={tmp_path}"]))
    from calib.serve.oracle import write_reference

    ref = write_reference(tmp_path / "ref.json", {}, max_tokens=8, dtype="float32")
    check_serve(_compose("serve", [*base, f"reference_out={ref}"]))  # a reference it wrote: replaced as before
    check_serve(_compose("serve", [*base, f"reference_out={tmp_path / 'new.json'}"]))
    assert prompts.read_text() == json.dumps(LINE) + "\n"


# --- bench/serve.py --from-json and grid manifests -------------------------------------------------------------------
@pytest.fixture(scope="module")
def bench():
    return load_bench("serve")


@pytest.mark.parametrize("make, expected", [
    (lambda p: None, "missing file"),
    (lambda p: p.mkdir(), "is a folder, not a JSON file"),
    (lambda p: p.write_text('{"table": [,]}'), "is not valid JSON (line 1, column 12"),
    (lambda p: p.write_text("[1, 2]"), "top level is list"),
    (lambda p: p.write_text('{"runs": []}'), "no `table` and `arms` lists (a run's result) nor `sources`"),
])
def test_from_json_names_a_file_that_is_not_a_result(bench, tmp_path, make, expected):
    """FileNotFoundError, IsADirectoryError, JSONDecodeError, TypeError and KeyError escaped."""
    path = tmp_path / "bench.json"
    make(path)
    with pytest.raises(SystemExit) as err:
        bench.main(["--from-json", str(path)])
    assert str(path) in str(err.value.code) and expected in str(err.value.code)


def test_retable_onto_its_own_input_is_refused(bench, tmp_path):
    path = tmp_path / "bench.json"
    path.write_text(json.dumps({"table": [], "arms": ["none"], "runs": []}))
    before = path.read_bytes()
    with pytest.raises(SystemExit, match=r"that is the --from-json file itself"):
        bench.main(["--from-json", str(path), "--retable", str(path)])
    assert path.read_bytes() == before


@pytest.mark.parametrize("rows, expected", [
    ([{"sampling": "greedy", "concurrency": 1}], "whose table row 0 names no cell (category, sampling, concurrency)"),
    (["greedy"], "whose table row 0 names no cell"),
    ([], "hold no cell (every `table` is empty)"),
])
def test_a_grid_source_without_cells_is_named(tmp_path, rows, expected):
    """A KeyError, and 'min() arg is an empty sequence', escaped."""
    (tmp_path / "src.json").write_text(json.dumps({"table": rows, "arms": []}))
    with pytest.raises(ValueError, match=r"the grid manifest") as err:
        clock_blocks.render_grid({"sources": ["src.json"]}, "grid.json", root=tmp_path)
    assert expected in str(err.value)


def test_the_probe_finds_nothing_silent_crashing_or_lost():
    """bench/hostile_probe.py's counts, as docs/hostile.md records them."""
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location("bench_hostile_probe", ROOT / "bench" / "hostile_probe.py")
    probe = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = probe  # its dataclass resolves its annotations through the module
    spec.loader.exec_module(probe)
    rows = [probe.run_case(c) for c in probe.CASES]
    bad = [r for r in rows if r["outcome"] not in ("ok", "clear", "warning")]
    assert not bad, bad
