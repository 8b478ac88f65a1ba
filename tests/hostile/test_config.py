"""Hostile overrides of the entry points' configs (issue 25): the real conf/ composed with Hydra's compose
API, then calib.config_checks' job check; each refusal names the job, the dotted key and the value."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from calib.config_checks import check_serve, check_train
from calib.evaluate.checks import check_eval
from calib.policies.config_store import store_policy_configs

ROOT = Path(__file__).resolve().parents[2]
CONF = str(ROOT / "conf")
BASE = {"train": ["out_dir=x"], "eval": [f"root={ROOT}"], "serve": [f"root={ROOT}"]}
CHECKS = {"train": check_train, "eval": check_eval, "serve": check_serve}


def _compose(job: str, overrides=()) -> dict:
    store_policy_configs()  # serve.yaml's `policy` group (serve.py stores it before Hydra composes)
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        cfg = compose(job, overrides=[*BASE[job], *overrides])
    return OmegaConf.to_container(cfg, resolve=True)


@pytest.mark.parametrize("job, overrides", [
    ("train", []), ("train", ["context=none"]), ("train", ["calibrator=temperature", "calibrator.extra=[entropy,margin]"]),
    ("eval", []), ("eval", ["cost=measured", "replay.mode=budget"]),
    ("serve", []), ("serve", ["policy=none", "speculative=none"]), ("serve", ["speculative=ngram", "sampling=sampled"]),
    ("serve", ["policy=calib_ragged"]), ("serve", ["policy=ragged_calibrated"]), ("serve", ["policy=vllm_dsd"]),
])
def test_shipped_configs_pass(job, overrides):
    CHECKS[job](_compose(job, overrides))


def test_an_omegaconf_config_is_checked_too():
    """The entry points may pass the composed DictConfig; only the checked keys are resolved."""
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        cfg = compose("eval", overrides=["metrics.n_bins=0"])  # root=${hydra:runtime.cwd} left unresolved
    with pytest.raises(ValueError, match=r"parameter metrics.n_bins=0 is invalid"):
        check_eval(cfg)


CASES = [
    # train.py
    ("train", "split.fractions=[0.5,0.5]", ["train.py config", "split.fractions=[0.5, 0.5]", "3 fractions in [0, 1] summing to 1"]),
    ("train", "split.fractions=[0.8,0.3,-0.1]", ["split.fractions=[0.8, 0.3, -0.1]", "summing to 1"]),
    ("train", "split.fractions=[0.7,0.2,0.2]", ["split.fractions=[0.7, 0.2, 0.2]"]),
    ("train", "split.seed=-1", ["split.seed=-1", "an integer in [0, inf)", "`python train.py split.seed=...`"]),
    ("train", "split.seed=1.5", ["split.seed=1.5", "an integer"]),
    ("train", "trainer.max_epochs=0", ["trainer.max_epochs=0", "an integer in [1, inf)"]),
    ("train", "trainer.patience=-1", ["trainer.patience=-1"]),
    ("train", "trainer.progress=maybe", ["trainer.progress='maybe'", "a bool"]),
    ("train", "calibrator.grid_points=1", ["calibrator.grid_points=1", "an integer in [2, inf)"]),
    ("train", "calibrator.extra=[entropy,logits]", ["calibrator.extra=['entropy', 'logits']", "'margin'"]),
    ("train", "ngram_model.table.features=[match_n,bogus]", ["ngram_model.table.features=['match_n', 'bogus']"]),
    ("train", "ngram_model.table.edges=[[3.5,1.5],[1],[0.5],[0.5],[16]]",
     ["ngram_model.table.edges=[[3.5, 1.5]", "ascending order"]),
    ("train", "ngram_model.table.edges=[[1.5]]", ["ngram_model.table.edges=[[1.5]]", "one list of edges per feature"]),
    ("train", "context.axes.temperature.edges=[0.8,0.2]", ["context.axes.temperature.edges=[0.8, 0.2]", "'auto'"]),
    ("train", "+context.axes.heat.edges=auto", ["context.axes.heat", "context axes are"]),
    ("train", "context.max_bins=0", ["context.max_bins=0"]),
    ("train", "context.min_cell_samples=0", ["context.min_cell_samples=0"]),
    ("train", "logger.kind=tensorboard", ["logger.kind='tensorboard'", "'wandb', 'csv', 'none'"]),
    ("train", "overwrite=yes", ["overwrite='yes'", "a bool"]),
    # eval.py
    ("eval", "metrics.n_bins=0", ["eval.py config", "metrics.n_bins=0", "an integer in [1, inf)"]),
    ("eval", "metrics.n_boot=0", ["metrics.n_boot=0", "`python eval.py metrics.n_boot=...`"]),
    ("eval", "metrics.length_n_boot=0", ["metrics.length_n_boot=0"]),
    ("eval", "metrics.n_bins=2.5", ["metrics.n_bins=2.5"]),
    ("eval", "plots.reliability_bins=0", ["plots.reliability_bins=0"]),
    ("eval", "split.name=holdout", ["split.name='holdout'", "'train', 'val', 'test'"]),
    ("eval", "split.fractions=[1,1,1]", ["split.fractions=[1, 1, 1]"]),
    ("eval", "replay.batch_sizes=[1,0]", ["replay.batch_sizes=[1, 0]", "each an integer in [1, inf)"]),
    ("eval", "replay.batch_sizes=[1,2.5]", ["replay.batch_sizes=[1, 2.5]"]),
    ("eval", "replay.batch_sizes=[]", ["replay.batch_sizes=[]"]),
    ("eval", "replay.budget_per_request=-1", ["replay.budget_per_request=-1"]),
    ("eval", "replay.min_steps=200", ["replay.min_steps=200", "at most replay.max_steps=128"]),
    ("eval", "replay.min_steps=0", ["replay.min_steps=0"]),
    ("eval", "replay.passes=0", ["replay.passes=0"]),
    ("eval", "replay.impl=cuda", ["replay.impl='cuda'", "'reference', 'triton'"]),
    ("eval", "replay.mode=tokens", ["replay.mode='tokens'", "'price', 'budget'"]),
    ("eval", "replay.policies=[no_spec,magic]", ["replay:", "unknown policies ['magic']"]),
    ("eval", "draft_cost.model=-0.1", ["draft_cost.model=-0.1", "a finite number in [0, inf)"]),
    ("eval", "draft_cost.model=inf", ["draft_cost.model=inf"]),
    ("eval", "+draft_cost.lookahead=0.1", ["draft_cost.lookahead=0.1", "draft costs are given for the chains"]),
    ("eval", "cost.parametric.weight_read=0", ["cost.parametric.weight_read=0"]),
    ("eval", "cost.parametric.per_position=-0.01", ["cost.parametric.per_position=-0.01"]),
    ("eval", "logger.kind=mlflow", ["logger.kind='mlflow'"]),
    ("eval", "online.slope=garbage", ["online.slope='garbage'", "a bool"]),  # issue 43: it published
    ("eval", "online.pooled=maybe", ["online.pooled='maybe'", "a bool"]),
    ("eval", "online.decay=0", ["online.decay=0"]),
    ("eval", "online.prior=0", ["online.prior=0"]),
    # serve.py
    ("serve", "concurrency=0", ["serve.py config", "concurrency=0", "an integer in [1, inf)"]),
    ("serve", "concurrency=2.5", ["concurrency=2.5"]),
    ("serve", "limit=0", ["limit=0", "None or an integer"]),
    ("serve", "sampling.temperature=-0.5", ["sampling.temperature=-0.5", "a finite number in [0, inf)"]),
    ("serve", "sampling.temperature=nan", ["sampling.temperature=nan"]),
    ("serve", "sampling.top_p=0", ["sampling.top_p=0", "(0, 1]"]),
    ("serve", "sampling.top_p=1.5", ["sampling.top_p=1.5"]),
    ("serve", "sampling.max_tokens=0", ["sampling.max_tokens=0"]),
    ("serve", "speculative.num_speculative_tokens=0", ["speculative.num_speculative_tokens=0", "[1, inf)"]),
    ("serve", "speculative.ngram.min_n=5", ["speculative.ngram.min_n=5", "at most speculative.ngram.max_n=4"]),
    ("serve", "serve.draft_cost=-1", ["serve.draft_cost=-1"]),
    ("serve", "serve.draft_cost=inf", ["serve.draft_cost=inf"]),
    ("serve", "serve.cost=[1.0,-0.1]", ["serve.cost=[1.0, -0.1]", "[weight_read, per_position]"]),
    ("serve", "policy.chains=[model,lookahead]", ["policy.chains=['model', 'lookahead']"]),
    ("serve", "engine.kv_cache_gb=0", ["engine.kv_cache_gb=0"]),
    ("serve", "engine.max_model_len=0", ["engine.max_model_len=0"]),
    ("serve", "serve.online_slope=garbage", ["serve.online_slope='garbage'", "a bool"]),  # deprecated flat key
    ("serve", "serve.online.decay=2", ["online.decay=2"]),
    ("serve", "serve.online.slope=garbage", ["online.slope='garbage'", "a bool"]),
    ("eval", "metrics.online_warmup_rounds=-1", ["metrics.online_warmup_rounds=-1"]),
]


@pytest.mark.parametrize("job, override, expected", CASES, ids=[f"{j}:{o}" for j, o, _ in CASES])
def test_a_bad_override_is_refused_naming_the_key(job, override, expected):
    cfg = _compose(job, [override])
    with pytest.raises(ValueError) as err:
        CHECKS[job](cfg)
    msg = str(err.value)
    for part in expected:
        assert part in msg, msg


def test_k_is_not_checked_where_nothing_speculates():
    check_serve(_compose("serve", ["policy=none", "speculative=none"]))  # num_speculative_tokens: 0
    with pytest.raises(ValueError, match=r"speculative.num_speculative_tokens=0"):
        check_serve(_compose("serve", ["policy=vllm", "speculative=eagle", "speculative.num_speculative_tokens=0"]))
    with pytest.raises(ValueError, match=r"speculative.prompt_lookup_min=5 is invalid; it must be at most "
                                         r"speculative.prompt_lookup_max=4"):
        check_serve(_compose("serve", ["speculative=ngram", "speculative.prompt_lookup_min=5"]))
