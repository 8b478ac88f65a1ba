"""The step cost at each T, as measured (calib.cost.step ``t_residual``): SYNTHETIC profile rows from a known engine
whose verify is a line except at small T, where it dips (as one AMD EPYC's f32 matrix products did: T = 5 positions
stepped faster than T = 1), or in a middle range of T, where it bends below the line. Not engine data."""

import itertools
import json

import numpy as np
import pytest
import torch

from calib.cost.serving import cost_curve
from calib.cost.step import (
    SMALL_T_MAX,
    T_BIN_EDGES,
    T_FADE,
    T_MIN_STEPS,
    fit_step_cost,
    load_step_cost,
    save_step_cost,
)
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
    assert [t for t in sorted(fit.t_residual) if t <= SMALL_T_MAX] == [1, 2, 3, 4, 5]
    for T in range(1, 6):  # the measured step at each T, not the line's
        want = float(TRUE.verify(T=T, B=1)) + DIP[T]
        assert float(fit.verify_at(T, 1)) == pytest.approx(want, abs=0.0015)
    assert float(fit.verify_at(5, 1)) < float(fit.verify_at(1, 1))  # 5 positions cheaper than 1, as measured
    # on the line where the profile's steps are (B = 16, T = 16..80: each bin's residual near 0)
    for T in (20, 40, 70):
        assert float(fit.verify_at(T, 16)) == pytest.approx(float(TRUE.verify(T=T, B=16)), abs=0.0015)
    # past the last measured T the residual fades to the line over T_FADE positions, and is the line beyond
    last = max(fit.t_residual)
    assert 64 < last <= 80
    far = last + T_FADE
    assert float(fit.verify_at(far, 16)) == pytest.approx(float(fit.verify(T=far, B=16)))
    between = [float(fit.t_residual_at(t)) for t in range(last, far + 1)]
    assert all(abs(b) <= abs(a) + 1e-12 for a, b in itertools.pairwise(between))


def test_a_t_with_few_steps_keeps_the_line():
    rows = dipped_rows(np.random.default_rng(1))
    at_3 = [r for r in rows if r["batch"] == 1 and r["tokens"] == 3]
    rows = [r for r in rows if r not in at_3] + at_3[: T_MIN_STEPS - 1]  # one step short of kept
    fit = fit_step_cost(rows, {"what": "SYNTHETIC"})
    assert 3 not in fit.t_residual and {1, 2, 4, 5} <= set(fit.t_residual)
    assert float(fit.t_residual_at(3)) == pytest.approx((fit.t_residual[2] + fit.t_residual[4]) / 2)


BEND = 0.010  # seconds below TRUE's line at B = 4, T = 9..20 (SYNTHETIC)


def bent_rows(rng, per_t=30):
    """Steady steps at B = 4 (T = 4..20: 9..20 bent below the line) and B = 16 (T = 16..80, on it) (SYNTHETIC)."""
    rows = []
    for T in range(4, 21):
        off = -BEND if T >= 9 else 0.0
        for _ in range(per_t):
            rows.append({"batch": 4, "tokens": T, "passes": 0, "ms": {},
                         "step_ms": 1e3 * (float(TRUE.verify(T=T, B=4)) + off) * (1 + rng.normal(0, 0.005))})
    for _ in range(600):
        T = int(rng.integers(16, 81))
        rows.append({"batch": 16, "tokens": T, "passes": 0, "ms": {},
                     "step_ms": 1e3 * float(TRUE.verify(T=T, B=16)) * (1 + rng.normal(0, 0.005))})
    return rows


def test_a_bend_above_a_few_positions_is_kept():
    fit = fit_step_cost(bent_rows(np.random.default_rng(5)), {"what": "SYNTHETIC"})
    assert any(SMALL_T_MAX < t <= 20 for t in fit.t_residual)  # a bin between 8 and 20 positions
    for T in (10, 12, 14):
        want = float(TRUE.verify(T=T, B=4)) - BEND
        line_miss, fit_miss = (abs(float(f) - want) for f in (fit.verify(T=T, B=4), fit.verify_at(T, 4)))
        assert line_miss > 0.0025 and fit_miss < line_miss / 3, (T, line_miss, fit_miss)


def test_serving_prices_the_measured_steps_and_a_file_without_them_reads_as_before(tmp_path):
    fit = fit_step_cost(dipped_rows(np.random.default_rng(3)), {"what": "SYNTHETIC"})
    save_step_cost(fit, tmp_path / "step.json")
    curve = cost_curve(str(tmp_path / "step.json"), 8).double().numpy()
    assert curve[5] < curve[1]  # serving verifies 4 draft tokens for less than none, as the profile measured
    back = load_step_cost(tmp_path / "step.json")
    assert back.t_residual == pytest.approx(fit.t_residual)
    doc = json.loads((tmp_path / "step.json").read_text())
    v4 = {**{k: v for k, v in doc.items() if k != "t_residual"}, "version": 4,
          "small_t": {t: r for t, r in doc["t_residual"].items() if int(t) <= SMALL_T_MAX}}
    (tmp_path / "v4.json").write_text(json.dumps(v4))  # a file of version 4: its residuals at T <= 8, read as then
    assert load_step_cost(tmp_path / "v4.json").t_residual == pytest.approx(
        {t: r for t, r in fit.t_residual.items() if t <= SMALL_T_MAX})
    del doc["t_residual"]
    doc["version"] = 3  # a file from before small_t: the line alone
    (tmp_path / "old.json").write_text(json.dumps(doc))
    old = load_step_cost(tmp_path / "old.json")
    assert old.t_residual == {} and float(old.verify_at(5, 1)) == pytest.approx(float(old.verify(T=5, B=1)))


@pytest.mark.parametrize(("version", "key", "bad"), [
    *((5, "t_residual", bad) for bad in ({"0": 0.001}, {str(T_BIN_EDGES[-1] + 1): 0.001}, {"2": float("nan")},
                                          {"x": 0.0}, {"2": True}, [0.001])),
    (4, "small_t", {str(SMALL_T_MAX + 1): 0.001})])  # version 4 held T <= 8 only
def test_a_broken_residual_names_the_file_and_key(tmp_path, version, key, bad):
    save_step_cost(TRUE, tmp_path / "step.json")
    doc = json.loads((tmp_path / "step.json").read_text())
    doc.pop("t_residual", None)
    doc.update({"version": version, key: bad})
    (tmp_path / "step.json").write_text(json.dumps(doc, allow_nan=True))
    with pytest.raises(ValueError, match=rf"step\.json: {key}: expected"):
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
