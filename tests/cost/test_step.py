"""The engine step-cost model (calib.cost.step) and the replay charging it. SYNTHETIC profile rows and
banks: made by hand here from known coefficients, not engine data."""

import json

import numpy as np
import pytest

from calib.cost import make_curve
from calib.cost.step import EngineStepCurve, Linear, StepCost, fit_step_cost, load_step_cost, save_step_cost
from calib.evaluate.data import load_eval_bank
from calib.evaluate.replay import ReplayConfig, replay_setting, train_mean_curve
from calib.policies.setting import StepBatch
from tests.evaluate.test_replay import forecast_tables, tiny_bank

# seconds: verify = 20 ms + 2 ms/position + 1 ms/request; idle = 3 ms + 0.1 ms/position;
# lm_head = 4 ms + 0.5 ms/row; more = 2 ms + 0.2 ms/row; chain = 0.3 ms; calib = 1 ms + 0.1 ms/request
TRUE = StepCost(Linear(0.020, {"T": 0.002, "B": 0.001}), Linear(0.003, {"T": 0.0001}),
                Linear(0.004, {"B": 0.0005}), Linear(0.002, {"B": 0.0002}), Linear(0.0003, {"B": 0.0}),
                Linear(0.001, {"B": 0.0001}), {"what": "SYNTHETIC"})


def profile_rows(rng, n=300):
    """Rows as bench/profile_step.py writes them, from TRUE plus a little noise (SYNTHETIC)."""
    rows = []
    for _ in range(n):
        B = int(rng.choice([1, 4, 16]))
        T = int(B + rng.integers(0, 4 * B + 1))
        passes = int(rng.integers(0, 5))
        ms = {"drafter_first_pass": 1e3 * float(TRUE.idle(T=T)),
              "drafter_lm_head": 1e3 * passes * float(TRUE.lm_head(B=B)),
              "drafter_more_passes": 1e3 * max(passes - 1, 0) * float(TRUE.more(B=B)),
              "ngram_propose": 1e3 * float(TRUE.chain(B=B)), "calib": 1e3 * float(TRUE.calib(B=B))}
        verify = 1e3 * float(TRUE.verify(T=T, B=B)) * (1 + rng.normal(0, 0.01))
        rows.append({"batch": B, "tokens": T, "passes": passes, "ms": ms, "step_ms": verify + sum(ms.values())})
    return rows


def test_the_fit_recovers_the_engine_it_was_measured_on():
    fit = fit_step_cost(profile_rows(np.random.default_rng(0)), {"what": "SYNTHETIC"})
    for T, B in [(1, 1), (20, 4), (80, 16)]:
        assert float(fit.verify(T=T, B=B)) == pytest.approx(float(TRUE.verify(T=T, B=B)), rel=0.02)
        assert float(fit.idle(T=T)) == pytest.approx(float(TRUE.idle(T=T)), rel=1e-6)
    for passes in range(5):
        assert float(fit.draft(passes, 4)) == pytest.approx(float(TRUE.draft(passes, 4)), rel=1e-6)
    assert float(fit.calib(B=16)) == pytest.approx(float(TRUE.calib(B=16)))


def test_a_saved_model_reads_back_and_a_broken_one_names_the_key(tmp_path):
    path = tmp_path / "step.json"
    save_step_cost(TRUE, path)
    back = load_step_cost(path)
    assert back.verify.slopes == TRUE.verify.slopes and back.source == {"what": "SYNTHETIC"}
    doc = json.loads(path.read_text())
    doc["more"]["intercept"] = -1.0
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match=r"step\.json: more: expected"):
        load_step_cost(path)
    doc["version"] = 99
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="version 99"):
        load_step_cost(path)


def test_the_curve_adds_the_idle_drafter_only_when_one_is_loaded(tmp_path):
    save_step_cost(TRUE, tmp_path / "step.json")
    curve = make_curve("engine", {"kind": "engine", "path": "step.json"}, 40, root=tmp_path).for_batch(4)
    assert isinstance(curve, EngineStepCurve)
    loaded = curve.with_drafter(True)
    assert curve.values[10] == pytest.approx(0.020 + 0.002 * 10 + 0.004)
    assert loaded.values[10] - curve.values[10] == pytest.approx(0.003 + 0.0001 * 10)
    assert loaded.draft(0) == 0 and loaded.draft(3) == pytest.approx(3 * 0.006 + 2 * 0.0028)


def test_the_replay_charges_what_the_engine_spends(tmp_path):
    save_step_cost(TRUE, tmp_path / "step.json")
    curve = make_curve("engine", {"kind": "engine", "path": "step.json"}, 64, root=tmp_path)
    bank = load_eval_bank(tiny_bank(tmp_path), forecast_tables(tmp_path, 0.95), fractions=(0, 0, 1))
    sb = StepBatch(bank, np.arange(4), np.array([[0, 1, 2, 3]]))
    res = replay_setting(sb, curve.for_batch(4), ReplayConfig(), train_mean_curve(bank))
    plain, loaded = curve.for_batch(4), curve.for_batch(4).with_drafter(True)
    assert float(res["no_spec"].cost[0]) == pytest.approx(plain.values[4])  # nothing loaded, nothing drafted
    pos = float(res["fixed_3"].positions[0])
    assert float(res["fixed_3"].cost[0]) == pytest.approx(loaded.values[4 + int(pos)] + loaded.draft(3))
    two = res["two_drafter"]
    run = two.extra["draft_passes"]
    expected = (loaded.values[4 + int(two.positions[0])] + loaded.draft(run) + loaded.chain() + loaded.calib())
    assert float(two.cost[0]) == pytest.approx(expected)  # + the n-gram proposer and calib's hooks


def test_planned_once_per_step_the_passes_cannot_depend_on_what_they_draft(tmp_path):
    """plan=step (the served loop) chooses a step's passes before drafting: changing what the passes
    would draft changes nothing; plan=pass re-plans after each pass, so it can stop early."""
    bank = load_eval_bank(tiny_bank(tmp_path), forecast_tables(tmp_path, 0.9), fractions=(0, 0, 1))
    rng = np.random.default_rng(1)
    idx = np.stack([rng.permutation(4) for _ in range(16)])
    curve = make_curve("p", {"kind": "parametric", "weight_read": 1.0, "per_position": 0.01}, 64)
    passes = {}
    for plan in ("step", "pass"):
        for drafted in ("as banked", "hopeless"):
            sb = StepBatch(bank, np.arange(4), idx)
            if drafted == "hopeless":
                sb.p_cal[sb.ids[0]] = np.where(np.isnan(sb.p_cal[sb.ids[0]]), np.nan, 0.01)
            res = replay_setting(sb, curve, ReplayConfig(draft_cost={"model": 0.02, "ngram": 0.0}, plan=plan),
                                 train_mean_curve(bank))
            passes[plan, drafted] = res["ragged_calibrated"].extra["draft_passes"]
    assert passes["step", "as banked"] == passes["step", "hopeless"] > 0
    assert passes["pass", "hopeless"] < passes["pass", "as banked"]
    with pytest.raises(ValueError, match="plan"):
        ReplayConfig(plan="request")


def test_serving_prices_with_the_same_step_cost(tmp_path):
    """serve.cost = PATH.json: serving's curve is the replay's (verify, plus the idle drafter on an EAGLE
    engine) and a pass is priced as the replay's plan weighs it."""
    import torch

    from calib.cost.serving import cost_curve, step_pass_price
    from calib.serve.knobs import ServeKnobs

    path = tmp_path / "step.json"
    save_step_cost(TRUE, path)
    ServeKnobs(tables="t", cost=str(path))  # a valid knob
    plain, loaded = cost_curve(str(path), 20), cost_curve(str(path), 20, drafter_loaded=True)
    replay = make_curve("engine", {"kind": "engine", "path": str(path)}, 20).for_batch(0)
    assert torch.allclose(plain, torch.from_numpy(replay.values).float())
    assert torch.allclose(loaded - plain, torch.from_numpy(TRUE.idle(T=np.maximum(np.arange(21), 1))).float())
    assert step_pass_price(str(path), 4, 4) == pytest.approx(float(TRUE.draft(4, 4)) / 4)
    assert step_pass_price("data/cost/x.csv:seconds", 4, 4) is None


def test_a_step_cost_from_another_machine_is_named_once_in_the_engine_line(tmp_path, caplog):
    """The fit records the CPU it was measured on; serving on another one says so once, in the engine line,
    naming both and how to refit (reading the cost logs nothing of its own)."""
    import logging
    from dataclasses import replace

    from calib.cost.serving import serving_step_cost
    from calib.cost.step import other_machine, this_machine

    assert other_machine(TRUE) is None  # no CPU recorded: nothing to compare
    assert other_machine(replace(TRUE, source={"cpu": this_machine()})) is None
    elsewhere = replace(TRUE, source={"cpu": "Some CPU, 64 cores, no AVX-512"})
    assert "Some CPU, 64 cores" in other_machine(elsewhere) and this_machine() in other_machine(elsewhere)
    # a GPU engine (issue 43): a CPU's step cost is not its own, whatever the host CPU; a cost fitted on cuda is
    assert "fitted on cpu (Some CPU, 64 cores" in other_machine(elsewhere, "cuda")
    assert other_machine(replace(TRUE, source={"cpu": this_machine()}), "cuda") is not None
    assert other_machine(replace(TRUE, source={"cpu": "Host", "device": "cuda"}), "cuda") is None
    assert "fitted on 'cuda (Host)'" in other_machine(replace(TRUE, source={"cpu": "Host", "device": "cuda"}))
    path = tmp_path / "elsewhere.json"
    save_step_cost(elsewhere, path)
    with caplog.at_level(logging.WARNING, logger="calib.serve"):
        serving_step_cost(str(path))
    assert not [r for r in caplog.records if "fitted on" in r.getMessage()]
    from calib.vllm.engine_line import cost_note

    note = cost_note("cpu", json.dumps({"tables": "unused", "cost": str(path)}))
    assert str(path) in note and "fitted on" in note and "bench/profile_step.py" in note
