"""Replay accounting on a tiny hand-made bank (SYNTHETIC: four rounds written by hand, not engine data)."""

import itertools

import numpy as np
import pyarrow as pa
import pytest
import torch

from calib.bank import schema, write_bank
from calib.chains.ngram import round_feature_tensor
from calib.cost import CostCurve, make_curve
from calib.evaluate.data import load_eval_bank
from calib.evaluate.replay import ReplayConfig, replay, replay_setting, summarise, train_mean_curve
from calib.evaluate.replay.config import WEIGHTINGS
from calib.policies.setting import Setting, StepBatch, committed
from calib.tables import save
from tests.synthetic import two_chain_tables

# (accept mask, model confidences, n-gram chain mask) per round; K = 3
ROUNDS = [
    ((1, 1, 1), (0.9, 0.9, 0.9), (1, 0, 0)),
    ((0, 0, 0), (0.1, 0.1, 0.1), (1, 1, None)),
    ((1, 0, 0), (0.8, 0.3, 0.2), None),
    ((1, 1, None), (0.7, 0.6, None), (0, 0, 0)),
]


def tiny_bank(tmp_path, categories=("chat",) * 4):
    n = len(ROUNDS)
    keys = {"model": ["synthetic"] * n, "speculator": ["synthetic-draft"] * n, "config": ["synthetic-k3"] * n,
            "category": list(categories), "prompt_idx": [0, 0, 1, 1], "turn": [0] * n, "round_idx": [0, 1, 0, 1]}
    kf = [pa.field(k, schema.KEY_TYPES[k]) for k in schema.KEYS]
    acc = {**keys, "accept": [sum(1 for a in np.cumprod([x or 0 for x in m]) if a) for m, _, _ in ROUNDS]}
    spec = dict(keys)
    ng = dict(keys)
    ng_len = [0 if c is None else sum(x is not None for x in c) for _, _, c in ROUNDS]
    ng["ngram_len"] = ng_len
    for f, typ in schema.NGRAM_FEATURES.items():
        ng[f] = [None if l == 0 else (True if pa.types.is_boolean(typ) else 1) for l in ng_len]
    ng["accept"] = [None if c is None else int(sum(np.cumprod([x or 0 for x in c]))) for _, _, c in ROUNDS]
    ng["verified"] = [False] * n
    ng["label_source"] = ["none" if c is None else "counterfactual" for _, _, c in ROUNDS]
    for k in range(3):
        acc[f"acc{k}"] = [m[k] for m, _, _ in ROUNDS]
        spec[f"conf{k}"] = [c[k] for _, c, _ in ROUNDS]
        ng[f"ngram_tok{k}"] = [None if c is None or c[k] is None else 7 for _, _, c in ROUNDS]
        ng[f"acc{k}"] = [None if c is None else c[k] for _, _, c in ROUNDS]
    acc_t = pa.table(acc, schema=pa.schema(kf + [pa.field("accept", pa.int64())]
                                          + [pa.field(f"acc{k}", pa.int8()) for k in range(3)]))
    spec_t = pa.table(spec, schema=pa.schema(kf + [pa.field(f"conf{k}", pa.float64()) for k in range(3)]))
    ng_fields = kf + [pa.field(c, t) for c, t in schema.NGRAM_ROUND.items()]
    ng_fields += [pa.field(f"ngram_tok{k}", pa.int64()) for k in range(3)]
    ng_fields += [pa.field(f"acc{k}", pa.int8()) for k in range(3)]
    ng_t = pa.table(ng, schema=pa.schema(ng_fields))
    return write_bank(tmp_path / "bank", acc_t, spec_t, ng_t,
                      manifest={"model": "synthetic", "speculator": "synthetic-draft"})


def identity_tables(tmp_path, ngram_p=0.5):
    # calibrated == raw for the model chain; a constant for the n-gram chain (one cell)
    grid = torch.linspace(0, 1, 11).repeat(3, 1)
    t = two_chain_tables(grid, torch.full((1, 1), float("inf")), torch.zeros(1, dtype=torch.int64),
                         torch.full((3, 1), ngram_p), features=["match_n"])
    save(tmp_path / "tables", t, {"target_models": ["synthetic"],
                                  "chains": {"model": {"ids": ["synthetic-draft"], "k": 3},
                                             "ngram": {"ids": ["ngram"], "k": 3}}})
    import calib.tables

    return calib.tables.load(tmp_path / "tables")


@pytest.fixture
def bank(tmp_path):
    return load_eval_bank(tiny_bank(tmp_path), identity_tables(tmp_path), fractions=(0, 0, 1))


def curve():
    return make_curve("parametric", {"kind": "parametric", "weight_read": 1.0, "per_position": 0.01}, 64)


def test_bank_arrays(bank):
    m, ng = bank.chains["model"], bank.chains["ngram"]
    assert m.accept.tolist() == [3, 0, 1, 2] and m.length.tolist() == [3, 3, 3, 2]
    assert ng.accept.tolist() == [1, 2, 0, 0] and ng.length.tolist() == [3, 2, 0, 3]
    np.testing.assert_allclose(m.p_cal, m.p_raw, atol=1e-6)  # identity grid
    assert (bank.split == "test").all()


def test_committed_tokens_and_costs_are_exact(bank):
    sb = StepBatch(bank, np.arange(4), np.array([[0, 1, 2, 3]]))
    cfg = ReplayConfig(draft_cost={"model": 0.0, "ngram": 0.0})
    res = replay_setting(sb, curve(), cfg, train_mean_curve(bank))
    tok = {k: float(v[0][0].sum()) for k, v in res.items()}  # step 0's rounds
    cost = {k: float(v[1][0]) for k, v in res.items()}
    assert tok["no_spec"] == 4 and cost["no_spec"] == pytest.approx(1.04)
    # fixed_1: depths 1,1,1,1 commit min(1, accepted)+1 = 2,1,2,2
    assert tok["fixed_1"] == 7 and cost["fixed_1"] == pytest.approx(1 + 0.01 * 8)
    # fixed_3: depths 3,3,3,2 (round 3 drafted only 2) commit 4,1,2,3
    assert tok["fixed_3"] == 10 and cost["fixed_3"] == pytest.approx(1 + 0.01 * 15)
    # oracle on the model chain or the n-gram chain: round 1's n-gram chain accepts 2 where the model's
    # accepts 0 -> depths 3, 2 (n-gram), 1, 2 commit 4 + 3 + 2 + 3 = 12 over 8 draft positions
    assert tok["oracle"] == 12 and cost["oracle"] == pytest.approx(1 + 0.01 * 12)


def test_second_fixed_is_the_other_drafter_served_alone(bank):
    """vLLM's n-gram arm on a model-drafter bank (issue 41 Must 1): the n-gram chain at γ, its own lengths."""
    sb = StepBatch(bank, np.arange(4), np.array([[0, 1, 2, 3]]))
    cfg = ReplayConfig(draft_cost={"model": 0.5, "ngram": 0.0})
    res = replay_setting(sb, curve(), cfg, train_mean_curve(bank))
    tok = {k: float(v[0][0].sum()) for k, v in res.items()}  # step 0's rounds
    cost = {k: float(v[1][0]) for k, v in res.items()}
    # n-gram accepted 1, 2, 0, 0 over lengths 3, 2, 0, 3: γ=2 verifies 2, 2, 0, 2 and commits 2 + 3 + 1 + 1
    assert tok["second_fixed_2"] == 7 and cost["second_fixed_2"] == pytest.approx(1 + 0.01 * (4 + 6))
    assert tok["second_fixed_3"] == 7 and cost["second_fixed_3"] == pytest.approx(1 + 0.01 * (4 + 8))
    assert all(tok[f"second_fixed_{g}"] <= tok["oracle"] for g in (1, 2, 3))


def test_positions_weighting_counts_a_round_for_the_text_it_covered(bank):
    """A recorded round stands for the tokens its collecting engine committed: a policy committing p where the
    collector committed c crosses that text in c / p steps; the collector's own policy is unchanged (issue 41)."""
    sb = StepBatch(bank, np.arange(4), np.arange(4)[:, None])  # B = 1: one round a step
    res = replay_setting(sb, curve(), ReplayConfig(draft_cost={"model": 0.0, "ngram": 0.0}), train_mean_curve(bank))
    assert sb.covered[:, 0].tolist() == [4, 1, 2, 3]  # the model chain (verified) accepted 3, 0, 1, 2, each + 1
    rounds, positions = summarise(res, 1), summarise(res, 1, sb.covered)
    # fixed_3 commits what the collector committed: one step a round either way
    assert positions["fixed_3"] == pytest.approx(rounds["fixed_3"])
    # the oracle commits 3 in round 1 (its n-gram chain) where the collector committed 1: a third of a step there
    oracle, cost = positions["oracle"], res["oracle"][1]
    assert rounds["oracle"]["tokens"] == 12 and oracle["tokens"] == 10 and oracle["steps"] == pytest.approx(3 + 1 / 3)
    assert oracle["cost"] == pytest.approx(cost[0] + cost[1] / 3 + cost[2] + cost[3])
    # no speculation writes more text in proportionally more steps: the same speed either way
    speed = {k: v["no_spec"]["tokens"] / v["no_spec"]["cost"] for k, v in (("r", rounds), ("p", positions))}
    assert positions["no_spec"]["steps"] == 10 and speed["p"] == pytest.approx(speed["r"])


def test_throughput_weighting_pools_a_steps_text_over_its_tokens():
    """weighting=throughput: a step counts sum(covered) / sum(tokens) times (the batch writes its rounds' text at its
    total rate), where positions counts mean(covered / tokens) (each request crosses its own stretch). A policy whose
    gain sits in a few requests of a step is counted fewer steps by the first: 3 of 16 requests committing 5 tokens
    where the collector committed 1.5, the others 1."""
    from calib.policies.setting import step_weights

    tokens = np.array([[5.0] * 3 + [1.0] * 13, [1.5] * 16])
    covered = np.full((2, 16), 1.5)
    positions, throughput = step_weights(tokens, covered), step_weights(tokens, covered, "throughput")
    assert positions[0] == pytest.approx((3 * 1.5 / 5 + 13 * 1.5) / 16)  # 1.31
    assert throughput[0] == pytest.approx(16 * 1.5 / 28)  # 0.86
    assert positions[1] == throughput[1] == pytest.approx(1.0)  # the collector's own commits: one step either way
    assert step_weights(tokens, None).tolist() == [1.0, 1.0]
    assert "throughput" in WEIGHTINGS


def test_committed_uses_the_chosen_chain(bank):
    sb = StepBatch(bank, np.arange(4), np.array([[0, 1, 2, 3]]))
    drafter = np.array([[1, 2, 0, 2]])
    depth = np.array([[2, 2, 0, 3]])
    # round 0 model: min(2, 3)+1 = 3; round 1 n-gram: min(2, 2)+1 = 3; round 2 none: 1; round 3 n-gram: 0+1
    assert committed(sb, drafter, depth).tolist() == [[3, 3, 1, 1]]


def test_drafting_cost_is_charged_per_pass(bank):
    sb = StepBatch(bank, np.arange(4), np.array([[0, 1, 2, 3]]))
    cfg = ReplayConfig(draft_cost={"model": 0.5, "ngram": 0.0})
    res = replay_setting(sb, curve(), cfg, train_mean_curve(bank))
    c_b = 1.04  # C(B) with B = 4
    assert float(res["fixed_2"][1][0]) == pytest.approx(1 + 0.01 * (4 + 8) + 0.5 * 2 * c_b)
    assert float(res["ragged_calibrated"][1][0]) == pytest.approx(
        1 + 0.01 * (4 + float(res["ragged_calibrated"][2][0])) + 0.5 * 3 * c_b)  # K passes, sunk


def test_full_replay_orders_oracle_on_top(bank):
    cfg = ReplayConfig(batch_sizes=(1, 2, 4), min_steps=8, max_steps=8)
    rows = replay([bank], {"parametric": curve()}, cfg, progress=False)
    for cat in ("chat", "all"):
        for b in (1, 2, 4):
            r = {x["policy"]: x for x in rows if x["category"] == cat and x["batch_size"] == b}
            assert set(r) >= {"no_spec", "best_fixed", "ragged_raw", "ragged_calibrated", "two_drafter", "oracle"}
            assert all(r["oracle"]["goodput"] >= v["goodput"] - 1e-12 for v in r.values())
            assert r["best_fixed"]["goodput"] >= r["no_spec"]["goodput"]


def test_ngram_feature_tensor_layout():
    t = pa.table({"ngram_len": [2, 0], "match_n": [3, None], "in_prompt": [True, None], "agreement": [0.5, None]})
    x = round_feature_tensor(t, ["match_n", "in_prompt", "agreement"], width=3)
    assert x.shape == (2, 3, 3)
    np.testing.assert_allclose(x[0, :2].numpy(), [[3, 1, 0.5], [3, 1, 0.5]])
    assert torch.isnan(x[0, 2]).all() and torch.isnan(x[1]).all()


def test_measured_curve_interpolates_and_extrapolates(tmp_path):
    (tmp_path / "c.csv").write_text("T,seconds\n1,0.1\n3,0.3\n5,0.4\n")
    c = make_curve("measured", {"kind": "measured", "path": str(tmp_path / "c.csv")}, 7)
    np.testing.assert_allclose(c.values[1:], [0.1, 0.2, 0.3, 0.35, 0.4, 0.45, 0.5])
    assert isinstance(c, CostCurve) and c.values[0] == c.values[1]
    (tmp_path / "d.csv").write_text("T,seconds\n1,0.1\n2,0.3\n3,0.2\n")  # a faster shape at T = 3
    d = make_curve("measured", {"kind": "measured", "path": str(tmp_path / "d.csv")}, 3)
    np.testing.assert_allclose(d.values[1:], [0.1, 0.2, 0.2])  # T = 2 is padded up to the faster T = 3


def test_replay_config_defaults_are_the_yaml():
    # Before: the dataclass said max_steps=160 and a model draft cost of 0.1, conf/eval.yaml 128 and 0.24.
    from omegaconf import OmegaConf

    from calib.evaluate.replay import EVAL_YAML

    yaml = OmegaConf.load(EVAL_YAML)
    cfg = ReplayConfig()
    assert cfg.max_steps == yaml.replay.max_steps and cfg.draft_cost == dict(yaml.draft_cost)
    assert cfg.policies == tuple(yaml.replay.policies) and cfg.batch_sizes == tuple(yaml.replay.batch_sizes)
    assert ReplayConfig(min_steps=4, max_steps=9).max_steps == 9


@pytest.mark.parametrize("kwargs, match", [
    ({"mode": "prices"}, "parameter mode='prices' is invalid; it must be one of 'price', 'budget'"),
    ({"policies": ["no_spec", "ragged"]}, r"unknown policies \['ragged'\]; the registered policies are \[.*'ragged_calibrated'"),
    ({"impl": "cuda"}, "parameter impl='cuda' is invalid; it must be one of 'reference', 'triton'"),
    ({"batch_sizes": [4, 0]}, r"batch_sizes=\[4, 0\] is invalid"),
    ({"min_steps": 9, "max_steps": 8}, "min_steps=9 > max_steps=8"),
    ({"passes": 0.0}, "parameter passes=0.0 is invalid"),
    ({"draft_cost": {"eagle": 0.2}}, r"draft_cost names \['eagle'\]; the drafters are \['model', 'ngram'"),
    ({"draft_cost": {"model": -0.1}}, r"draft_cost\['model'\]=-0.1 is invalid"),
])
def test_replay_config_refuses_unknown_options(kwargs, match):
    # Before: mode="prices" silently meant budget mode; unknown policies were silently skipped.
    with pytest.raises(ValueError, match=match):
        ReplayConfig(**kwargs)


def test_eval_config_composes_into_replay_config():
    # run.py builds ReplayConfig(**replay, draft_cost=...) from the composed config: an override with an
    # unknown value fails there, before any replay.
    from pathlib import Path

    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    conf = Path(__file__).resolve().parents[2] / "conf"
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        good = compose("eval", overrides=["replay.min_steps=4", "replay.max_steps=8"])
        bad = compose("eval", overrides=["replay.mode=prices"])

    def build(cfg):
        rc = OmegaConf.to_container(cfg.replay, resolve=True)
        return ReplayConfig(**{k: v for k, v in rc.items() if k != "progress"},
                            draft_cost=OmegaConf.to_container(cfg.draft_cost, resolve=True))

    assert build(good).max_steps == 8
    with pytest.raises(ValueError, match="mode='prices'"):
        build(bad)


@pytest.mark.parametrize("rows, match", [
    ("T,seconds\n1,0.1\n2,abc\n", r"c.csv, line 3: T='2', seconds='abc': expected an integer T and a"),
    ("T,seconds\n1,0.1\n2,0\n", r"c.csv, line 3: seconds=0.0 at T=2; a verify cost must be finite and"),
    ("T,seconds\n1,0.1\n2,-0.3\n", r"line 3: seconds=-0.3"),
    ("T,seconds\n1,nan\n2,0.2\n", r"line 2: seconds=nan"),
    ("T,seconds\n1,0.1\n1,0.2\n", r"line 3: T=1 again \(first on line 2\)"),
    ("T,seconds\n1,0.1\n", r"c.csv: 1 row\(s\); a measured curve needs at least two"),
    ("T,secs\n1,0.1\n2,0.2\n", r"c.csv: no column \['seconds'\]"),
])
def test_measured_curve_rows_are_checked(tmp_path, rows, match):
    # Before: zero/negative rows reached the allocator (every request then verified nothing) or failed
    # with a bare float() error; a one-row file gave a flat curve.
    (tmp_path / "c.csv").write_text(rows)
    with pytest.raises(ValueError, match=match):
        make_curve("measured", {"kind": "measured", "path": str(tmp_path / "c.csv")}, 8)


@pytest.mark.parametrize("cfg, t_max, match", [
    ({"weight_read": 0.0, "per_position": 0.0}, 8, r"cost curve 'p': C\(0\) = 0.0; every verify cost"),
    ({"weight_read": 1.0, "per_position": -0.5}, 8, r"C\(2\) = 0.0"),
    ({"weight_read": float("nan"), "per_position": 0.01}, 8, r"C\(0\) = nan"),
    ({"weight_read": 1.0, "per_position": 0.01}, 0, r"t_max=0"),
])
def test_parametric_curve_is_checked(cfg, t_max, match):
    with pytest.raises(ValueError, match=match):
        make_curve("p", {"kind": "parametric", **cfg}, t_max)
    with pytest.raises(ValueError, match="every verify cost must be finite and positive"):
        CostCurve("direct", np.array([1.0, 1.0, 0.0]), "s")


def forecast_tables(tmp_path, forecast=0.9):
    """identity_tables with a flat forecast of the model chain (SYNTHETIC): what the draft-aware
    policies read before each pass."""
    import calib.tables

    old = identity_tables(tmp_path)
    meta = {k: v for k, v in old.meta.items() if k in ("target_models", "chains")}
    meta["chains"]["model"]["forecast"] = {"axes": [], "values": [[forecast]] * 3, "samples": [[1]] * 3}
    save(tmp_path / "forecast_tables", old, meta)
    return calib.tables.load(tmp_path / "forecast_tables")


@pytest.mark.parametrize("forecast, cost, passes", [(0.95, 0.02, None), (0.01, 0.5, 0)])
def test_draft_aware_policies_pay_the_passes_they_run(tmp_path, forecast, cost, passes):
    bank = load_eval_bank(tiny_bank(tmp_path), forecast_tables(tmp_path, forecast), fractions=(0, 0, 1))
    assert bank.chains["model"].p_forecast is not None
    sb = StepBatch(bank, np.arange(4), np.array([[0, 1, 2, 3]]))
    res = replay_setting(sb, curve(), ReplayConfig(draft_cost={"model": cost, "ngram": 0.0}), train_mean_curve(bank))
    c_b = 1.04  # C(B) with B = 4
    for name in ("ragged_calibrated", "two_drafter"):
        _tok, charged, pos, extra = res[name]
        run = extra["draft_passes"]
        assert 0 <= run <= 3 and (passes is None or run == passes)
        assert float(charged[0]) == pytest.approx(1 + 0.01 * (4 + float(pos[0])) + cost * run * c_b)
    if passes == 0:  # nothing pays: the model chain is not drafted at all
        assert float(res["ragged_calibrated"][0][0].sum()) == 4 and float(res["ragged_calibrated"][2][0]) == 0


def test_oracle_bounds_the_draft_aware_policies_step_by_step(tmp_path):
    bank = load_eval_bank(tiny_bank(tmp_path), forecast_tables(tmp_path, 0.7), fractions=(0, 0, 1))
    rng = np.random.default_rng(0)
    idx = np.stack([rng.permutation(4) for _ in range(24)])
    sb = StepBatch(bank, np.arange(4), idx)
    for cost, weighting in itertools.product((0.0, 0.1, 0.4), WEIGHTINGS):
        cfg = ReplayConfig(draft_cost={"model": cost, "ngram": 0.0}, weighting=weighting)
        res = replay_setting(sb, curve(), cfg, train_mean_curve(bank))
        s = Setting(sb, curve(), cfg, train_mean_curve(bank))  # each step counted as the totals count it
        oracle = s.step_goodput(*res["oracle"][:2])
        for name in ("ragged_calibrated", "two_drafter", "no_spec", "fixed_1", "fixed_3"):
            assert (s.step_goodput(*res[name][:2]) <= oracle + 1e-12).all(), (cost, weighting, name)


@pytest.mark.parametrize("n_rounds, batch, passes", [(347, 1, 1.0), (100, 4, 1.0), (30, 7, 3.0), (64, 16, 2.5)])
def test_steps_deal_every_round_once_per_pass(n_rounds, batch, passes):
    """A setting replays the cell's rounds, not a draw with replacement from them: one pass deals each round once
    (the cell's own mix of drafted and undrafted steps), rows distinct within a step."""
    import math

    from calib.evaluate.replay.driver import draw_steps

    cfg = ReplayConfig(passes=passes, min_steps=1, max_steps=10**6)
    idx = draw_steps(n_rounds, batch, cfg, np.random.default_rng(0))
    assert idx.shape == (math.ceil(passes * n_rounds / batch), batch)
    counts = np.bincount(idx.ravel(), minlength=n_rounds)
    full = int(passes * n_rounds) // n_rounds  # every round at least this often; none more than one extra
    assert counts.min() >= full and counts.max() <= full + 1
    assert all(len(np.unique(r)) == batch for r in idx)


def test_the_replays_oracle_pads_its_steps_as_the_served_oracle_does(tmp_path, monkeypatch):
    """Where the price falls with positions (SYNTHETIC curve, cheapest at T = 14 of B = 4), the oracle's steps are
    priced padded to the cheapest size their drafts reach (calib/serve/oracle.py pad_to_cheapest): the same tokens,
    never a higher price, and here a lower one; under a price that never falls, nothing changes."""
    import calib.policies.oracle as policy

    bank = load_eval_bank(tiny_bank(tmp_path), forecast_tables(tmp_path, 0.7), fractions=(0, 0, 1))
    rng = np.random.default_rng(0)
    sb = StepBatch(bank, np.arange(4), np.stack([rng.permutation(4) for _ in range(24)]))
    cfg = ReplayConfig(draft_cost={"model": 0.0, "ngram": 0.0})
    falling = CostCurve("falling", np.r_[2.0, np.linspace(2.0, 1.0, 14), np.linspace(1.1, 1.3, 3)], "s")
    curves = {"falling": falling, "rising": curve()}
    padded = {k: replay_setting(sb, c, cfg, train_mean_curve(bank)) for k, c in curves.items()}
    with monkeypatch.context() as m:
        m.setattr(policy, "_padded", lambda sb, i, gmax, dr, de, price: (dr, de))
        plain = {k: replay_setting(sb, c, cfg, train_mean_curve(bank)) for k, c in curves.items()}
    for name in ("oracle_served", "oracle"):
        (tok, cost, pos, _), (tok0, cost0, pos0, _) = padded["falling"][name], plain["falling"][name]
        assert (tok == tok0).all() and (cost <= cost0 + 1e-12).all() and (pos >= pos0).all(), name
        assert (cost < cost0).any() and (pos > pos0).any(), name
        assert all((a == b).all() for a, b in zip(padded["rising"][name][:3], plain["rising"][name][:3])), name
