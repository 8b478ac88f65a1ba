"""The serving knobs (calib.serve.knobs.ServeKnobs): one validated value carried in CALIB_SERVE; the
`vllm serve` default cost is serve.py's; calib/envs.pyi types every registered variable."""

import ast
from pathlib import Path

import pytest
import yaml

from calib import envs
from calib.serve.knobs import DEFAULT_COST, DEFAULT_COST_FILE, PROJECT_ROOT, ServeKnobs

ROOT = Path(__file__).resolve().parents[2]


def test_knobs_round_trip_through_json():
    knobs = ServeKnobs("runs/train/default", cost="1.0,0.05", ngram=(2, 3, 4), chains=("model",), plan=False)
    assert ServeKnobs.from_json(knobs.to_json()) == knobs
    assert ServeKnobs.from_json('{"tables": "t"}') == ServeKnobs("t")


@pytest.mark.parametrize("bad, name", [({"cost": "1.0"}, "cost"), ({"draft_cost": -1.0}, "draft_cost"),
                                       ({"ngram": [4, 1, 4]}, "ngram"), ({"plan": "yes"}, "plan"),
                                       ({"tables": ""}, "tables"), ({"chains": []}, "chains")])
def test_bad_knobs_are_refused_by_name(bad, name):
    with pytest.raises(ValueError, match=f"parameter {name}="):
        ServeKnobs(**{"tables": "t", **bad})


def test_unknown_or_malformed_json_is_refused():
    with pytest.raises(ValueError, match="keys from tables"):
        ServeKnobs.from_json('{"tables": "t", "tabels": "u"}')
    with pytest.raises(ValueError, match="not JSON"):
        ServeKnobs.from_json("runs/train/default")


def test_vllm_serve_prices_with_serve_py_default_curve():
    conf = yaml.safe_load((ROOT / "conf" / "serve.yaml").read_text())
    assert conf["serve"]["cost"] == DEFAULT_COST_FILE
    assert DEFAULT_COST == str(PROJECT_ROOT / DEFAULT_COST_FILE)
    assert (PROJECT_ROOT / DEFAULT_COST_FILE).is_file()


def test_stub_types_every_registered_variable():
    stub = ast.parse((ROOT / "calib" / "envs.pyi").read_text())
    typed = {n.target.id for n in stub.body if isinstance(n, ast.AnnAssign)} - {"REGISTRY"}
    assert typed == set(envs.REGISTRY)
