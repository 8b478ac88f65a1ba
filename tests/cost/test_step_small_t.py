"""The step cost at a few positions, as measured (calib.cost.step ``small_t``): SYNTHETIC profile rows from a known
engine whose verify is a line except at small T, where it dips (as one AMD EPYC's f32 matrix products did: T = 5
positions stepped faster than T = 1). Not engine data."""

import itertools
import json

import numpy as np
import pytest
import torch

from calib.cost.serving import cost_curve
from calib.cost.step import SMALL_T_MAX, SMALL_T_MIN_STEPS, fit_step_cost, load_step_cost, save_step_cost
from tests.cost.test_step import TRUE

DIP = {1: 0.006, 2: 0.008, 3: -0.005, 4: -0.010, 5: -0.014}  # seconds off TRUE's line at B = 1, T = 1..5


def dipped_rows(rng, per_t=40):
    """Steady steps at B = 1 (T = 1..5) with the dip, and at B = 16 (T = 16..80) on the line (SYNTHETIC)."""
    rows = []
    for T in range(1, 6):
        for _ in range(per_t):
            rows.append({"batch": 1, "tokens": T, "passes": 0, "ms": {},
                         "step_ms": 1e3 * (float(TRUE.verify(T=T, B=1)) + DIP[T]) * (1 + rng.normal(0, 0.005))})
    for _ in range(20 * per_t):
        B, T = 16, int(rng.integers(16, 81))
        rows.append({"batch": B, "tokens": T, "passes": 0, "ms": {},
                     "step_ms": 1e3 * float(TRUE.verify(T=T, B=B)) * (1 + rng.normal(0, 0.005))})
    return rows


def test_the_fit_keeps_what_the_line_misses_at_a_few_positions():
    fit = fit_step_cost(dipped_rows(np.random.default_rng(0)), {"what": "SYNTHETIC"})
    assert sorted(fit.small_t) == [1, 2, 3, 4, 5]
    for T in range(1, 6):  # the measured step at each T, not the line's
        want = float(TRUE.verify(T=T, B=1)) + DIP[T]
        assert float(fit.verify_at(T, 1)) == pytest.approx(want, abs=0.0015)
    assert float(fit.verify_at(5, 1)) < float(fit.verify_at(1, 1))  # 5 positions cheaper than 1, as measured
    # past the last measured T the residual fades to the line over SMALL_T_MAX positions, and is the line beyond
    far = 5 + SMALL_T_MAX
    assert float(fit.verify_at(far, 16)) == pytest.approx(float(fit.verify(T=far, B=16)))
    between = [float(fit.small_t_residual(t)) for t in range(5, far + 1)]
    assert all(abs(b) <= abs(a) + 1e-12 for a, b in itertools.pairwise(between))


def test_a_t_with_few_steps_keeps_the_line():
    rows = dipped_rows(np.random.default_rng(1))
    at_3 = [r for r in rows if r["batch"] == 1 and r["tokens"] == 3]
    rows = [r for r in rows if r not in at_3] + at_3[: SMALL_T_MIN_STEPS - 1]  # one step short of kept
    fit = fit_step_cost(rows, {"what": "SYNTHETIC"})
    assert 3 not in fit.small_t and {1, 2, 4, 5} <= set(fit.small_t)
    assert float(fit.small_t_residual(3)) == pytest.approx((fit.small_t[2] + fit.small_t[4]) / 2)


def test_serving_prices_the_measured_steps_and_a_file_without_them_reads_as_before(tmp_path):
    fit = fit_step_cost(dipped_rows(np.random.default_rng(3)), {"what": "SYNTHETIC"})
    save_step_cost(fit, tmp_path / "step.json")
    curve = cost_curve(str(tmp_path / "step.json"), 8).double().numpy()
    assert curve[5] < curve[1]  # serving verifies 4 draft tokens for less than none, as the profile measured
    back = load_step_cost(tmp_path / "step.json")
    assert back.small_t == pytest.approx(fit.small_t)
    doc = json.loads((tmp_path / "step.json").read_text())
    del doc["small_t"]
    doc["version"] = 3  # a file from before small_t: the line alone
    (tmp_path / "old.json").write_text(json.dumps(doc))
    old = load_step_cost(tmp_path / "old.json")
    assert old.small_t == {} and float(old.verify_at(5, 1)) == pytest.approx(float(old.verify(T=5, B=1)))


@pytest.mark.parametrize("bad", [{"0": 0.001}, {str(SMALL_T_MAX + 1): 0.001}, {"2": float("nan")}, {"x": 0.0},
                                 {"2": True}, [0.001]])
def test_a_broken_small_t_names_the_file_and_key(tmp_path, bad):
    save_step_cost(TRUE, tmp_path / "step.json")
    doc = json.loads((tmp_path / "step.json").read_text())
    doc["small_t"] = bad
    (tmp_path / "step.json").write_text(json.dumps(doc, allow_nan=True))
    with pytest.raises(ValueError, match=r"step\.json: small_t: expected"):
        load_step_cost(tmp_path / "step.json")


def test_a_sampled_step_prices_drafts_by_the_batch_range_not_the_first_step():
    from calib.cost.serving import SampledPrice, batch_slope, sampled_price_table, sampled_shape_price

    line = np.float32(0.05) + np.float32(0.002) * np.arange(40, dtype=np.float32)
    assert batch_slope(line, 4, 4) == pytest.approx(0.002, rel=1e-4)  # a line: its slope, as before
    fit = fit_step_cost(dipped_rows(np.random.default_rng(4)), {"what": "SYNTHETIC"})
    dipped = np.asarray(fit.verify_at(np.maximum(np.arange(40), 1), 0), dtype=np.float32)
    assert dipped[2] > dipped[1] > dipped[5]  # the first step up, the batch's range down (B = 1, K = 4)
    assert batch_slope(dipped, 1, 4) == 0.0  # drafts priced free, not at the first difference
    price = SampledPrice(0.001, 0.002)
    base, table = sampled_price_table(dipped, price, 1, 4)
    t_base, t_table = sampled_shape_price(torch.from_numpy(dipped), price, 1, 4)
    assert base == t_base and np.array_equal(table, t_table.numpy())  # serving's two paths price alike
    assert table.tolist() == pytest.approx([0.0, 0.003, 0.004, 0.005, 0.006])  # the sampler's jump alone
