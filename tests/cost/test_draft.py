"""A drafter's draft cost: recorded in its export, read by calib.cost.draft and by conf/ (one value)."""

import json
import os

import pytest
from hydra import compose, initialize_config_dir

from calib.cost.draft import DEFAULT_DRAFT_COST, DRAFT_COST_KEY, PROJECT_ROOT, draft_cost

SHIPPED = "data/drafters/eagle-smollm2-135m"


def test_the_shipped_head_records_what_eval_and_serve_price_it_at():
    assert json.loads((PROJECT_ROOT / SHIPPED / "config.json").read_text())[DRAFT_COST_KEY] == 0.24
    assert draft_cost(SHIPPED) == draft_cost(PROJECT_ROOT / SHIPPED) == 0.24 == DEFAULT_DRAFT_COST


def test_a_drafter_that_records_none_gets_the_default(tmp_path):
    (tmp_path / "config.json").write_text('{"num_hidden_layers": 24}')
    assert draft_cost(tmp_path) == DEFAULT_DRAFT_COST
    assert draft_cost(tmp_path / "missing") == draft_cost(None) == DEFAULT_DRAFT_COST


@pytest.mark.parametrize("value", [-0.1, "0.3", None, True, float("inf")])
def test_a_recorded_cost_that_is_not_a_cost_is_refused(tmp_path, value):
    (tmp_path / "config.json").write_text(json.dumps({DRAFT_COST_KEY: value}))
    if value == "0.3":  # a number written as text is still a number
        assert draft_cost(tmp_path) == 0.3
        return
    with pytest.raises(ValueError, match=f"{DRAFT_COST_KEY}: draft cost"):
        draft_cost(tmp_path)


def test_conf_reads_the_drafters_record(tmp_path):
    from calib.policies.config_store import store_policy_configs

    store_policy_configs()  # conf/serve.yaml's policy group comes from the policy registry
    (tmp_path / "config.json").write_text(json.dumps({DRAFT_COST_KEY: 0.5}))
    with initialize_config_dir(config_dir=os.fspath(PROJECT_ROOT / "conf"), version_base="1.3"):
        assert compose("eval").draft_cost.model == 0.24
        assert compose("serve").serve.draft_cost == 0.24  # speculative=eagle: the shipped head
        assert compose("serve", overrides=["speculative=ngram"]).serve.draft_cost == DEFAULT_DRAFT_COST
        assert compose("serve", overrides=[f"speculative.model={tmp_path}"]).serve.draft_cost == 0.5
