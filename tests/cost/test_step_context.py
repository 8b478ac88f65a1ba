"""A step cost that reads each step's context (calib.cost.step, verify's ``Q`` input) and the replay charging it.
SYNTHETIC profile rows and banks: made by hand here from known coefficients, not engine data."""

import json

import numpy as np
import pyarrow as pa
import pytest
import torch

from calib.cost import make_curve
from calib.cost.step import EngineStepCurve, Linear, StepCost, fit_step_cost, load_step_cost, save_step_cost
from calib.evaluate.data import load_eval_bank
from calib.evaluate.replay import ReplayConfig, replay_setting, train_mean_curve
from calib.policies.setting import StepBatch
from tests.cost.test_step import TRUE, profile_rows
from tests.evaluate.test_replay import forecast_tables, tiny_bank

# verify = 20 ms + 1 ms/position + 1 ms/request + 3 ms per thousand tokens cached + 4 ms per thousand (query, key) pairs
KEYED = StepCost(Linear(0.020, {"T": 0.001, "B": 0.001, "C": 0.003, "Q": 0.004}), TRUE.idle, TRUE.lm_head, TRUE.more,
                 TRUE.chain, TRUE.calib, {"what": "SYNTHETIC"})


def verify(T, B, cached, q):
    """KEYED's verify of a step whose requests verify ``q`` positions over ``cached`` tokens each (arrays)."""
    keys = (q * cached + q * (q + 1) / 2).sum() / 1e3
    return float(KEYED.verify(T=T, B=B, C=cached.sum() / 1e3, Q=keys))


def keyed_rows(rng, n=400):
    """Profile rows with each step's context, as bench/profile_step.py now writes them (SYNTHETIC)."""
    rows = []
    for _ in range(n):
        B = int(rng.choice([1, 4, 16, 64]))
        q = rng.integers(1, 6, size=B)  # positions per request
        cached = rng.integers(30, 900, size=B)  # tokens in each request's KV cache
        keys = int((q * cached + q * (q + 1) // 2).sum())
        T = int(q.sum())
        rows.append({"batch": B, "tokens": T, "passes": 0, "ms": {},
                     "step_ms": 1e3 * verify(T, B, cached, q) * (1 + rng.normal(0, 0.005)),
                     "context": int(cached.sum()), "query_keys": keys})
    return rows


def test_the_fit_recovers_the_attention_term_and_records_the_mean_context():
    fit = fit_step_cost(keyed_rows(np.random.default_rng(0)), {"what": "SYNTHETIC"})
    assert fit.verify.slopes["Q"] == pytest.approx(0.004, rel=0.1)
    assert fit.verify.slopes["C"] == pytest.approx(0.003, rel=0.15)
    rows = keyed_rows(np.random.default_rng(0))
    mean = sum(r["context"] for r in rows) / sum(r["batch"] for r in rows)
    assert fit.context_mean == pytest.approx(mean)
    # where a step's context is not known, C and Q are read at the profile's mean context per request
    expected = fit.verify(T=20, B=4, C=4 * mean / 1e3, Q=20 * mean / 1e3) + fit.t_residual_at(20)
    assert float(fit.verify_at(20, 4)) == pytest.approx(float(expected))


def test_an_older_profile_lends_its_drafter_parts_not_its_verify():
    rng = np.random.default_rng(1)
    old = profile_rows(rng)  # no context recorded: its verify is TRUE's, far from KEYED's
    fit = fit_step_cost(keyed_rows(rng) + old, {"what": "SYNTHETIC"})
    assert fit.verify.slopes["Q"] == pytest.approx(0.004, rel=0.1)
    assert float(fit.draft(3, 4)) == pytest.approx(float(TRUE.draft(3, 4)), rel=1e-6)
    assert float(fit.idle(T=10)) == pytest.approx(float(TRUE.idle(T=10)), rel=1e-6)


def test_a_verify_over_an_unknown_input_is_refused_by_name(tmp_path):
    path = tmp_path / "step.json"
    save_step_cost(KEYED, path)
    assert load_step_cost(path).verify.slopes == KEYED.verify.slopes
    doc = json.loads(path.read_text())
    doc["verify"]["slopes"]["ctx"] = 0.1
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match=r"step\.json: verify: slopes over .*'ctx'"):
        load_step_cost(path)


def test_the_curve_prices_as_serving_and_charges_each_step_its_own_context():
    curve = EngineStepCurve("engine", KEYED, 40, batch=2)
    long = curve.with_context(np.array([[900.0, 800.0]]))
    short = curve.with_context(np.array([[40.0, 50.0]]))
    assert np.array_equal(long.values, curve.values) and np.array_equal(short.values, curve.values)
    depth = np.array([[3, 1]])
    for c, ctx in ((long, [900.0, 800.0]), (short, [40.0, 50.0])):
        assert float(c.charge(depth)[0]) == pytest.approx(verify(6, 2, np.array(ctx), 1 + depth[0]))
    assert float(long.charge(depth)[0]) > float(short.charge(depth)[0])


def test_a_charging_model_charges_while_the_served_one_prices(tmp_path):
    save_step_cost(TRUE, tmp_path / "served.json")
    save_step_cost(KEYED, tmp_path / "clock.json")
    curve = make_curve("engine", {"kind": "engine", "path": "served.json", "charge": "clock.json"}, 40,
                       root=tmp_path).for_batch(2)
    served = make_curve("engine", {"kind": "engine", "path": "served.json"}, 40, root=tmp_path).for_batch(2)
    assert np.array_equal(curve.values, served.values)  # decisions: serving's prices
    ctx = np.array([[100.0, 300.0]])
    depth = np.array([[2, 0]])
    assert float(curve.with_context(ctx).charge(depth)[0]) == pytest.approx(verify(4, 2, ctx[0], 1 + depth[0]))
    assert float(served.with_context(ctx).charge(depth)[0]) == pytest.approx(served.values[4])  # reads no context


def _with_context_len(bank, values):
    """``bank`` (tests.evaluate.test_replay.tiny_bank) with its n-gram file's context_len set to ``values``
    (None: not looked up there)."""
    import pyarrow.parquet as pq

    path = bank / "ngram.parquet"
    t = pq.read_table(path)
    i = t.column_names.index("context_len")
    pq.write_table(t.set_column(i, t.schema.field(i), pa.array(values, pa.int64())), path)
    return bank


def test_the_replay_charges_a_long_context_more_and_fills_a_round_the_chain_did_not_look_up(tmp_path):
    bank_dir = _with_context_len(tiny_bank(tmp_path), [500, 504, None, 42])  # round 2 offered no chain
    bank = load_eval_bank(bank_dir, forecast_tables(tmp_path, 0.95), fractions=(0, 0, 1))
    # prompt 1's first round: its second round's context less what the first committed (accept + 1)
    accept = int(bank.chains[bank.primary].accept[2])
    assert bank.cached.tolist() == [500, 504, 42 - (accept + 1), 42]
    save_step_cost(KEYED, tmp_path / "clock.json")
    curve = make_curve("engine", {"kind": "engine", "path": "clock.json"}, 64, root=tmp_path).for_batch(2)
    cost = {}
    for name, rows in (("long", [0, 1]), ("short", [2, 3])):
        sb = StepBatch(bank, np.array(rows), np.array([[0, 1]]))
        res = replay_setting(sb, curve.with_context(sb.cached), ReplayConfig(), train_mean_curve(bank))
        cost[name] = float(res["no_spec"].cost[0])
        assert cost[name] == pytest.approx(verify(2, 2, sb.cached[0], np.ones(2)))  # one position each
    assert cost["long"] > cost["short"]



def test_a_request_whose_chain_was_never_looked_up_is_placed_at_the_banks_median_prompt():
    """Prompt 1 offered no chain in either round: its context is the bank's median offset plus what it committed
    (pandas may hand the offsets back read-only: they are written here; a held-out bank first raised it)."""
    from calib.bank import schema
    from calib.evaluate.data import _context_len

    keys = {k: ["m"] * 4 for k in ("model", "speculator", "config", "category")}
    t = pa.table({**keys, "prompt_idx": [0, 0, 1, 1], "turn": [0] * 4, "round_idx": [0, 1, 0, 1],
                  "accept": [1, 2, 0, 3], "ng_context_len": pa.array([500, 504, None, None], pa.int64())})
    assert set(schema.KEYS) <= set(t.column_names)
    notes = []
    got = _context_len(t, notes)
    median = np.median([500 - 0, 504 - 2])  # prompt 0's context less the tokens committed before each round
    assert got.tolist() == [500, 504, median, median + 1]
    assert notes and "records no context_len" in notes[0]


def test_serving_prices_each_step_at_its_own_batch_and_context(tmp_path):
    """calib.cost.serving.ContextCurves: the step's price at its batch and its requests' mean context (bucketed),
    each position dearer on a longer context; a cost without context terms, or a CSV/parametric one, has none."""
    from calib.cost.serving import CONTEXT_BUCKET, ContextCurves

    save_step_cost(KEYED, tmp_path / "keyed.json")
    curves = ContextCurves.of(str(tmp_path / "keyed.json"), 80)
    short64 = curves.at(4, 4 * 50)[1]
    long, long64 = curves.at(4, 4 * 800)
    per = 800 // CONTEXT_BUCKET * CONTEXT_BUCKET + CONTEXT_BUCKET // 2  # the bucket's middle
    assert long64[10] == pytest.approx(float(KEYED.verify(T=10, B=4, C=4 * per / 1e3, Q=10 * per / 1e3)))
    assert long.dtype == torch.float32 and np.allclose(long.numpy(), long64, rtol=1e-6)
    assert long64[10] - long64[4] > short64[10] - short64[4] > 0  # a position reads more cache on a long context
    assert curves.at(4, 4 * 800 + 3)[1] is long64  # the same bucket: the same curve, not rebuilt
    save_step_cost(TRUE, tmp_path / "plain.json")  # fitted without the steps' context
    assert ContextCurves.of(str(tmp_path / "plain.json"), 80) is None
    assert ContextCurves.of("1.0,0.01", 80) is None
