"""The policy registry (calib.policies) and vllm_dsd, on the hand-made replay bank (SYNTHETIC: four
rounds written by hand in tests/evaluate/test_replay.py, not engine data). No assertion depends on a
floating-point result a different CPU could round differently: only orderings that hold by construction,
equalities of values computed from the same sums, names and messages."""

from pathlib import Path

import numpy as np
import pytest

from calib.evaluate import plots, report
from calib.evaluate.data import load_eval_bank
from calib.evaluate.replay import ReplayConfig, replay
from calib.policies import (
    Policy,
    PolicyResult,
    display_order,
    policy,
    policy_names,
    register_policy,
    unregister_policy,
)
from calib.policies.hindsight import vllm_dsd
from tests.evaluate.test_replay import curve, identity_tables, tiny_bank

SYNTH = "synthetic_depth1"  # a SYNTHETIC throwaway policy: verify depth 1 on every request, pay one draft pass


def _synthetic_compute(s):
    tok, cost, pos = s.uniform(np.full(s.S, 1), s.draft(1))
    return PolicyResult(tok, cost, pos, {"synthetic_marker": 1})


@pytest.fixture
def synthetic_policy():
    p = register_policy(Policy(SYNTH, 15, "tab:pink", "SYNTHETIC throwaway policy for the registry test",
                               _synthetic_compute, below_no_spec="SYNTHETIC reason it loses"))
    try:
        yield p
    finally:
        unregister_policy(SYNTH)


@pytest.fixture
def bank2(tmp_path):
    """The tiny bank with two categories (prompt 0: chat, prompt 1: code)."""
    return load_eval_bank(tiny_bank(tmp_path, categories=("chat", "chat", "code", "code")),
                          identity_tables(tmp_path), fractions=(0, 0, 1))


def test_synthetic_policy_flows_into_rows_plot_and_report(synthetic_policy, bank2, tmp_path):
    # Registered here and nowhere else: the config accepts it, the replay computes it, the ladder rows,
    # the plot's bar order and the report's tables, policy list and notes carry it.
    cfg = ReplayConfig(batch_sizes=(1, 2), policies=["no_spec", SYNTH, "best_fixed", "oracle"], min_steps=4,
                       max_steps=4)
    rows = replay([bank2], {"parametric": curve()}, cfg, progress=False)
    mine = [r for r in rows if r["policy"] == SYNTH]
    assert {(r["category"], r["batch_size"]) for r in mine} == {(c, b) for c in ("chat", "code", "all") for b in (1, 2)}
    assert all(r["synthetic_marker"] == 1 for r in mine if r["category"] != "all")
    assert {"goodput", "vs_best_fixed", "headroom_captured", "tokens_per_round"} <= set(mine[0])
    # order 15 puts it between no_spec (10) and best_fixed (20)
    bars = [p for p, _ in plots.ladder_policies(rows)]
    assert bars == ["no_spec", SYNTH, "best_fixed", "oracle"]
    assert dict(plots.ladder_policies(rows))[SYNTH] == "tab:pink"
    assert plots.ladder(rows, bank2.name, "parametric", tmp_path / "ladder.png").exists()
    assert report.ladder_policy_rows(rows) == ["no_spec", SYNTH, "best_fixed", "oracle"]
    assert f"- `{SYNTH}`: SYNTHETIC throwaway policy for the registry test" in report.policy_lines(rows)
    meta = {"bank": "b", "category": "c", "batch_size": 1, "cost_model": "m"}
    notes = report.ladder_notes([{**meta, "policy": "no_spec", "goodput": 1.0},
                                 {**meta, "policy": SYNTH, "goodput": 0.5}])
    assert any(n.startswith(f"`{SYNTH}` is below `no_spec`") and "SYNTHETIC reason it loses" in n for n in notes)


def test_unregistered_policy_is_refused(synthetic_policy):
    assert SYNTH in policy_names()
    unregister_policy(SYNTH)
    try:
        with pytest.raises(ValueError, match=f"unknown policies \\['{SYNTH}'\\]"):
            ReplayConfig(policies=["no_spec", SYNTH])
    finally:
        register_policy(synthetic_policy)


def test_unknown_policy_is_refused_with_the_known_ones():
    with pytest.raises(ValueError) as e:
        ReplayConfig(policies=["no_spec", "dynamic_sd"])
    msg = str(e.value)
    assert "unknown policies ['dynamic_sd']" in msg
    # serving's old name is an alias of the replay's: one vocabulary
    assert ReplayConfig(policies=["none", "vllm_dynamic"]).policies == ("no_spec", "vllm_dsd")
    assert all(repr(n) in msg for n in policy_names())
    with pytest.raises(ValueError, match="mode='prices' is invalid; it must be one of 'price', 'budget'"):
        ReplayConfig(mode="prices")
    with pytest.raises(KeyError, match="unknown policy 'nope'; registered policies"):
        policy("nope")
    with pytest.raises(ValueError, match="already registered"):
        register_policy(policy("oracle"))


def test_unknown_policy_in_the_hydra_config_is_refused():
    from pathlib import Path

    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    conf = Path(__file__).resolve().parents[2] / "conf"
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        cfg = compose("eval", overrides=["replay.policies=[no_spec,dsd]"])
    rc = OmegaConf.to_container(cfg.replay, resolve=True)
    with pytest.raises(ValueError, match=r"unknown policies \['dsd'\]; the registered policies are \[.*'vllm_dsd'"):
        ReplayConfig(**{k: v for k, v in rc.items() if k != "progress"},
                     draft_cost=OmegaConf.to_container(cfg.draft_cost, resolve=True))


def test_every_default_policy_is_registered_and_ordered():
    cfg = ReplayConfig()
    assert "vllm_dsd" in cfg.policies
    names = [p.name for p in display_order()]
    assert set(cfg.policies) <= set(names)
    assert names.index("best_fixed") < names.index("vllm_dsd") < names.index("oracle")


def _tot(tokens, cost, gamma=None):
    t = {"tokens": float(tokens), "cost": float(cost), "positions": 0.0, "steps": 1, "rounds": 1}
    return t if gamma is None else {**t, "gamma": gamma}


def test_vllm_dsd_picks_one_k_from_the_pooled_stream():
    # Hand-made totals: chat prefers γ=2, code prefers no_spec; pooled, γ=2 wins -> code is served γ=2.
    chat = {"no_spec": _tot(10, 10), "fixed_1": _tot(14, 10, 1), "fixed_2": _tot(20, 10, 2)}
    code = {"no_spec": _tot(10, 10), "fixed_1": _tot(9, 10, 1), "fixed_2": _tot(8, 10, 2)}
    pooled = {k: {**_tot(chat[k]["tokens"] + code[k]["tokens"], 20), **({"gamma": chat[k]["gamma"]}
                                                                        if "gamma" in chat[k] else {})}
              for k in chat}
    for rows in (chat, code):
        got = vllm_dsd(rows, pooled)
        assert got["gamma"] == 2 and got["tokens"] == rows["fixed_2"]["tokens"]
    assert vllm_dsd(pooled, pooled)["tokens"] == pooled["fixed_2"]["tokens"]
    # table K = 0 serves no_spec
    code_only = vllm_dsd(code, code)
    assert code_only["gamma"] == 0 and code_only["tokens"] == code["no_spec"]["tokens"]


def test_vllm_dsd_in_the_replay(bank2):
    cfg = ReplayConfig(batch_sizes=(1, 2, 4), min_steps=6, max_steps=6)
    rows = replay([bank2], {"parametric": curve()}, cfg, progress=False)
    at = {(r["category"], r["batch_size"], r["policy"]): r for r in rows}
    for b in (1, 2, 4):
        # one K per batch size: the same for every category, the pooled best_fixed's γ
        ks = {at[(c, b, "vllm_dsd")]["gamma"] for c in ("chat", "code", "all")}
        assert ks == {at[("all", b, "best_fixed")]["gamma"]}
        k = ks.pop()
        for c in ("chat", "code", "all"):
            r = at[(c, b, "vllm_dsd")]
            served = at[(c, b, "no_spec" if k == 0 else f"fixed_{k}")]
            assert r["_tokens"] == served["_tokens"] and r["_cost"] == served["_cost"]  # it is that fixed K
            assert r["goodput"] <= at[(c, b, "best_fixed")]["goodput"]  # best_fixed picks per category
            assert r["goodput"] <= at[(c, b, "oracle")]["goodput"] + 1e-12 * abs(r["goodput"])
        assert at[("all", b, "vllm_dsd")]["goodput"] == at[("all", b, "best_fixed")]["goodput"]


def test_one_entry_is_a_replay_policy_and_a_serving_policy(bank2, tmp_path):
    """A SYNTHETIC policy registered once, with a replay function and a serving spec (and an old name as an
    alias): the replay computes its rows, serve.py's config group offers it (under both names) and the
    serve runner's check accepts it; unregistered, serving refuses it again."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from calib.policies import Arm, Serving, aliases, servable
    from calib.policies.config_store import store_policy_configs
    from calib.vllm.serve_runner import check_config, servable_policy

    name, old = "synthetic_served", "synthetic_old_name"
    register_policy(Policy(name, 16, "tab:pink", "SYNTHETIC served policy", _synthetic_compute,
                           serving=Serving(speculate=True, arms=(Arm("synthetic_arm", "ngram"),)), aliases=(old,)))
    try:
        rows = replay([bank2], {"parametric": curve()}, ReplayConfig(batch_sizes=(1,), policies=[name, "best_fixed"],
                                                                     min_steps=2, max_steps=2), progress=False)
        assert {r["policy"] for r in rows} == {name, "best_fixed"}
        assert name in [p.name for p in servable()] and aliases()[old] == name
        assert {name, old} <= set(store_policy_configs())
        conf = str(Path(__file__).resolve().parents[2] / "conf")
        for asked in (name, old):
            with initialize_config_dir(config_dir=conf, version_base="1.3"):
                cfg = OmegaConf.to_container(compose("serve", overrides=[f"policy={asked}", "speculative=ngram",
                                                                         f"root={tmp_path}"]), resolve=True)
            assert cfg["policy"]["name"] == name and cfg["policy"]["alias"] == (None if asked == name else old)
            check_config(cfg)
            assert servable_policy(cfg["policy"]).name == name
    finally:
        unregister_policy(name)
    with pytest.raises(ValueError, match=f"policy={name!r}: choose one of"):
        servable_policy({"name": name})
