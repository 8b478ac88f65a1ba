"""The serving knobs (calib.serve.knobs.ServeKnobs): one validated value carried in CALIB_SERVE; the
`vllm serve` default cost is serve.py's; calib/envs.pyi types every registered variable."""

import ast
import json
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


# --- the online correction's settings: one nested value (conf/online/default.yaml), one schema (OnlineSettings) ---

def _compose(conf: Path, name: str, *overrides: str) -> dict:
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from calib.policies.config_store import store_policy_configs

    store_policy_configs()  # conf/serve.yaml's policy group comes from the policy registry
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        return OmegaConf.to_container(compose(name, overrides=[f"root={ROOT}", *overrides]), resolve=True)


def _served(cfg: dict):
    """What calib serves with: serve.py's knobs, through CALIB_SERVE's JSON as an engine worker reads them."""
    from calib.vllm.serve_runner import serve_knobs

    return ServeKnobs.from_json(serve_knobs(cfg, ROOT).to_json()).online_settings()


def _replayed(cfg: dict, tmp_path):
    """What eval.py's replay corrects with (metrics.json's online.settings; no bank needed to read them)."""
    from omegaconf import OmegaConf

    from calib.evaluate.online import online_metrics
    from calib.tables.online import OnlineSettings

    settings = online_metrics(OmegaConf.create(cfg), [], None, tmp_path)["settings"]
    return OnlineSettings.from_config({k: v for k, v in settings.items() if k in OnlineSettings().to_config()})


def test_one_edit_of_the_online_group_reaches_serving_and_the_replay(tmp_path):
    """serve.py and eval.py compose the same conf/online/default.yaml: one edit of it is what both read."""
    import shutil

    conf = tmp_path / "conf"
    shutil.copytree(ROOT / "conf", conf)
    group = conf / "online" / "default.yaml"
    group.write_text(group.read_text().replace("decay: 0.99", "decay: 0.95").replace("prior: 50.0", "prior: 7.0")
                     .replace("slope: true", "slope: false"))
    served, replayed = _served(_compose(conf, "serve")), _replayed(_compose(conf, "eval"), tmp_path)
    assert served == replayed
    assert (served.decay, served.prior, served.slope) == (0.95, 7.0, False)
    # the shipped group: the same default on both sides, and one key spelled the same under each node
    assert _served(_compose(ROOT / "conf", "serve")) == _replayed(_compose(ROOT / "conf", "eval"), tmp_path)
    a = _served(_compose(ROOT / "conf", "serve", "serve.online.decay=0.9"))
    assert a == _replayed(_compose(ROOT / "conf", "eval", "online.decay=0.9"), tmp_path) and a.decay == 0.9


@pytest.mark.parametrize("node, key", [({"decay": 2.0}, "online.decay=2.0"), ({"prior": 0}, "online.prior=0"),
                                       ({"slope": "garbage"}, "online.slope='garbage'"),
                                       ({"dekay": 0.5}, "online.dekay is not a setting")])
def test_a_bad_online_setting_is_refused_by_key_on_both_sides(node, key, tmp_path):
    from calib.config_checks import check_serve

    with pytest.raises(ValueError, match=key.replace("(", r"\(")):
        ServeKnobs.from_json(json.dumps({"tables": "t", "online": node}))
    with pytest.raises(ValueError, match=key.replace("(", r"\(")):
        _replayed({"online": node, "metrics": {"n_bins": 15}, "split": {"name": "test"}}, tmp_path)
    if "dekay" not in node:  # serve.py's config check, before any engine starts, reuses the same declaration
        (name, value), = node.items()
        with pytest.raises(ValueError, match=f"serve.online.{name}="):
            check_serve(_compose(ROOT / "conf", "serve", f"serve.online.{name}={value}"))


def test_old_flat_online_spellings_work_for_a_release_with_a_warning():
    with pytest.warns(FutureWarning, match=r"serve.online_decay=0.9 is deprecated: write serve.online.decay=0.9"):
        old = _served(_compose(ROOT / "conf", "serve", "serve.online_decay=0.9", "serve.online_pooled=false"))
    assert (old.decay, old.pooled) == (0.9, False)
    with pytest.warns(FutureWarning, match="write serve.online.enabled=false"):
        assert _served(_compose(ROOT / "conf", "serve", "serve.online=false")) is None
    with pytest.warns(FutureWarning, match="online_prior"):
        assert ServeKnobs.from_json('{"tables": "t", "online_prior": 10}').online.prior == 10.0
    with pytest.raises(ValueError, match="online_decay=0.9 and online.decay=0.95 set one setting twice"):
        ServeKnobs("t", online={"decay": 0.95}, online_decay=0.9)
