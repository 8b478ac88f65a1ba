"""Accepted-length error by (temperature, chain, category) slice and reliability per temperature
(issue 13 item 4), on SYNTHETIC banks (tests/synthetic.py) with a sampling temperature added."""

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from hydra import compose, initialize_config_dir

import calib.tables
from calib.bank import write_bank
from calib.evaluate import plots
from calib.evaluate.calibration import calibration_rows
from calib.evaluate.data import load_eval_bank
from calib.evaluate.report import length_headline, length_slices
from calib.evaluate.run import run
from tests.evaluate.fit_tables import fit_tables
from tests.synthetic import synthetic_tables

ROOT = Path(__file__).resolve().parents[2]


def _bank(path, temperature, seed=3, speculator="synthetic"):
    """A SYNTHETIC bank whose rounds record ``temperature`` (a number, or one per round)."""
    acc, spec, ng = synthetic_tables(n_prompts=24, rounds_per_prompt=12, width=4, seed=seed, speculator=speculator)
    t = np.broadcast_to(np.asarray(temperature, dtype=np.float64), (spec.num_rows,))
    spec = spec.append_column(pa.field("temperature", pa.float64()), pa.array(t))
    return write_bank(path, acc, spec, ng, manifest={"model": "synthetic-model", "speculator": speculator,
                                                     "num_speculative_tokens": 4})


def test_accept_length_rows_carry_the_rounds_temperature(tmp_path):
    hot, cold = _bank(tmp_path / "hot", 0.8), _bank(tmp_path / "cold", 0.0, seed=4)
    plain = write_bank(tmp_path / "plain", *synthetic_tables(n_prompts=24, rounds_per_prompt=12, width=4, seed=5),
                       manifest={"model": "synthetic-model", "speculator": "synthetic"})
    banks = [load_eval_bank(b, None) for b in (hot, cold, plain)]
    _, length = calibration_rows(banks, n_bins=10, n_boot=0)
    temps = {}
    for r in length:
        temps.setdefault(r["bank"], set()).add(r["temperature"])
    assert temps == {"hot": {0.8}, "cold": {0.0}, "plain": {None}}  # None: the bank records no temperature
    assert len(length) == 3 * 3  # per bank, one row per category (2) and pooled: no new rows for one temperature


def test_a_bank_mixing_temperatures_gets_rows_per_temperature(tmp_path):
    per_round = np.where(np.arange(24 * 12) % 2, 0.8, 0.0)  # alternate rounds
    bank = load_eval_bank(_bank(tmp_path / "mixed", per_round), None)
    bank.split[:] = "test"
    _, length = calibration_rows([bank], n_bins=10, n_boot=0)
    pooled = [r for r in length if r["drafter"] == "model" and r["category"] == "all"]
    assert sorted(r["temperature"] for r in pooled) == [0.0, 0.8]  # was: one row at the median
    assert sum(r["n"] for r in pooled) == int(bank.chains["model"].labelled.sum())
    assert bank.subset(np.arange(len(per_round)) < 10).round_temperature.shape == (10,)


def _row(bank, drafter, variant, category, n, pred, actual, temperature=0.0):
    return {"bank": bank, "drafter": drafter, "variant": variant, "temperature": temperature, "category": category,
            "n": n, "predicted_mean": pred, "actual_mean": actual}


def test_length_slices_error_flag_and_headline():
    rows = [_row("eagle", "model", "raw", "chat", 2500, 0.60, 0.50),
            _row("eagle", "model", "calibrated", "chat", 2500, 0.54, 0.50),  # 8 % on 2,500 rounds: flagged
            _row("eagle", "model", "raw", "code", 900, 0.50, 0.50),
            _row("eagle", "model", "calibrated", "code", 900, 0.40, 0.50),  # 20 %, but too small to flag
            _row("eagle", "ngram", "calibrated", "chat", 2500, 0.51, 0.50),
            _row("ngram", "ngram", "calibrated", "chat", 3000, 0.30, 0.30, temperature=0.8),
            _row("ngram", "ngram", "calibrated", "code", 3000, 0.30, 0.0, temperature=0.8)]
    s = length_slices(rows)
    by = {(x["temperature"], x["chain"], x["category"], x["bank"]): x for x in s}
    chat = by[(0.0, "model", "chat", "eagle")]
    assert chat["error_calibrated"] == pytest.approx(0.08) and chat["error_raw"] == pytest.approx(0.2)
    assert chat["flagged"] and chat["rounds"] == 2500
    assert not by[(0.0, "model", "code", "eagle")]["flagged"]
    assert not by[(0.0, "ngram", "chat", "eagle")]["flagged"] and "error_raw" not in by[(0.0, "ngram", "chat",
                                                                                         "eagle")]
    assert by[(0.8, "ngram", "code", "ngram")]["error_calibrated"] is None  # actual mean 0: undefined
    assert [x["temperature"] for x in s] == [0.0, 0.0, 0.0, 0.8, 0.8]
    head = length_headline(s)
    assert head.startswith("**Accepted length: worst calibrated slice error 8.0% (T=0, model chain, chat")
    assert "1 of 4 such slices exceed the 5% target" in head and "Worst over all 5 slices: 20.0%" in head


def test_reliability_by_temperature_draws_every_chain_of_that_temperature(tmp_path, monkeypatch):
    paths = [_bank(tmp_path / "hot", 0.8), _bank(tmp_path / "hot2", 0.8, seed=6), _bank(tmp_path / "cold", 0.0, seed=4)]
    tables = calib.tables.load(fit_tables(paths, tmp_path / "tables"))
    banks = [load_eval_bank(b, tables) for b in paths]
    for b in banks:
        b.split[:] = "test"
    assert plots.temperatures(banks) == [0.0, 0.8]
    seen = {}
    monkeypatch.setattr(plots, "reliability_figure", lambda panels, path, title, n_bins: seen.update(
        panels=panels, title=title) or Path(path))
    plots.reliability_by_temperature(banks, 0.8, tmp_path / "r.png")
    assert list(seen["panels"]) == ["hot\nmodel chain", "hot\nngram chain (counterfactual)",
                                    "hot2\nmodel chain", "hot2\nngram chain (counterfactual)"]
    assert set(seen["panels"]["hot\nmodel chain"]) == {"raw", "calibrated"}
    assert set(seen["panels"]["hot\nngram chain (counterfactual)"]) == {"calibrated"}  # no n-gram confidence
    assert seen["title"].startswith("Reliability at T=0.8")
    assert plots.reliability_by_temperature(banks, 0.5, tmp_path / "none.png") is None


def test_eval_reports_slices_first_and_a_figure_per_temperature(tmp_path):
    hot, cold = _bank(tmp_path / "hot", 0.8), _bank(tmp_path / "cold", 0.0, seed=4)
    fit_tables([hot, cold], tmp_path / "tables")
    out = tmp_path / "out"
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("eval", overrides=[f"root={ROOT}", f"data.test=[{hot},{cold}]", f"tables={tmp_path / 'tables'}",
                                         f"out_dir={out}", "logger=csv", "metrics.n_boot=20", "cost=parametric",
                                         "replay.batch_sizes=[1]", "replay.max_steps=2", "replay.min_steps=2",
                                         "replay.progress=false"])
    run(cfg)
    m = json.loads((out / "metrics.json").read_text())
    assert {r["temperature"] for r in m["accept_length"]} == {0.0, 0.8}
    assert {(s["temperature"], s["chain"]) for s in m["length_slices"]} == {
        (0.0, "model"), (0.0, "ngram"), (0.8, "model"), (0.8, "ngram")}
    assert "re-centred on the estimate" in m["ece_ci_method"]
    for r in m["calibration"]:  # every ece_ci contains its own estimate
        assert r["ece_ci"][0] <= r["ece"] <= r["ece_ci"][1], r
    report = (out / "report.md").read_text()
    assert report.index("**Accepted length: ") < report.index("## Calibration")  # the answer leads
    assert report.index("## Accepted length by slice") < report.index("## Calibration")
    assert "| temperature | chain | category | bank | rounds |" in report
    assert "re-centred on the estimate" in report
    for t in ("0", "0.8"):
        assert (out / f"reliability_temperature_{t}.png").exists()
        assert f"](reliability_temperature_{t}.png)" in report
        assert (out / "csv" / f"eval_reliability_temperature_{t}.png").exists()  # logged to the tracker
    assert (out / "csv" / "length_slices.csv").exists()
    for s in m["length_slices"]:  # issue 13: prompt-sampling noise of every slice's actual mean
        assert s["prompts"] > 0 and s["actual_ci"][0] <= s["actual_mean"] <= s["actual_ci"][1], s
        assert isinstance(s["within_noise"], bool)
    assert {(r["temperature"], r["chain"]) for r in m["calibration_pooled"]} == {
        (0.0, "model"), (0.0, "ngram"), (0.8, "model"), (0.8, "ngram")}
    assert m["config"]["metrics"]["length_n_boot"] == 1000
    assert report.index("## Calibration pooled per (temperature, chain)") < report.index("## Calibration (all")
    assert "| actual_mean | prompts | actual_ci |" in report and "| temperature | chain | banks | n | ece_raw |" in report
    assert (out / "csv" / "calibration_pooled.csv").exists()


# --- issue 13: prompt-sampling noise of a slice's actual mean, and ECE pooled per (temperature, chain) ---


def _eval_bank(name, per_prompt_accept, temperature=0.0, rounds=20, width=4, category="chat"):
    """A SYNTHETIC EvalBank (all rounds test): prompt g's every round accepts ``per_prompt_accept[g]`` of
    ``width`` drafted tokens; calibrated probability 0.5 wherever a token was drafted."""
    from calib.evaluate.data import Chain, EvalBank

    a = np.repeat(np.asarray(per_prompt_accept), rounds)[:, None]
    k = np.arange(width)[None, :]
    acc = np.where(k < a, 1.0, np.where(k == a, 0.0, np.nan))  # accepted prefix, one rejection, not drafted
    p_cal = np.where(np.isnan(acc), np.nan, 0.5)
    n = len(a)
    return EvalBank(name, Path(name), np.full(n, category, dtype=object), np.repeat(np.arange(len(per_prompt_accept)),
                    rounds), np.full(n, "test", dtype=object), {"ngram": Chain("ngram", acc, p_cal)}, "ngram",
                    temperature, round_temperature=np.full(n, float(temperature)))


def test_prompt_bootstrap_interval_is_wide_when_prompts_differ_and_contains_the_mean():
    from calib.evaluate.calibration import length_noise, prompt_mean_ci

    # SYNTHETIC: 30 prompts of 20 identical rounds each; half accept 0 tokens, half 3
    mixed = _eval_bank("mixed", [0, 3] * 15)
    flat = _eval_bank("flat", [1, 2] * 15, temperature=0.8)  # 1 or 2: the prompts differ far less
    noise = length_noise([mixed, flat], n_boot=500, seed=0)
    m = noise[(0.0, "ngram", "chat", "mixed")]
    f = noise[(0.8, "ngram", "chat", "flat")]
    assert m["prompts"] == 30 and f["prompts"] == 30
    assert set(noise) == {(0.0, "ngram", "chat", "mixed"), (0.0, "ngram", "all", "mixed"),
                          (0.8, "ngram", "chat", "flat"), (0.8, "ngram", "all", "flat")}
    lo, hi = m["actual_ci"]
    assert lo < 1.5 < hi  # the actual mean (0 and 3 in equal shares)
    assert hi - lo > 0.5  # SE of the mean over 30 prompts ≈ 1.5 / sqrt(30) ≈ 0.27: interval ≈ ±0.54
    assert f["actual_ci"][1] - f["actual_ci"][0] < (hi - lo) / 2  # spread 0.5 vs 1.5 per prompt
    # rows, not prompts: 20 identical rounds per prompt must not narrow the interval like 600 rounds would
    assert hi - lo > 3 * 1.5 * 2 / np.sqrt(600)
    assert np.isnan(prompt_mean_ci([], [], 100)).all()  # nothing to resample
    assert prompt_mean_ci([5, 5], [5.0, 10.0], n_boot=200, seed=1) == prompt_mean_ci([5, 5], [5.0, 10.0], 200, 1)


def test_length_slices_carry_the_interval_and_say_whether_the_prediction_is_within_it():
    from calib.evaluate.calibration import length_noise

    banks = [_eval_bank("mixed", [0, 3] * 15), _eval_bank("flat", [1, 2] * 15, temperature=0.8)]
    _, length = calibration_rows(banks, n_bins=10, n_boot=0)
    plain = length_slices(length)
    s = length_slices(length, noise=length_noise(banks, n_boot=300))
    assert [{k: v for k, v in x.items() if k not in ("prompts", "actual_ci", "within_noise")} for x in s] == plain
    for x in s:  # additive keys on every slice
        assert x["prompts"] == 30 and len(x["actual_ci"]) == 2 and x["actual_ci"][0] <= x["actual_mean"]
        assert x["within_noise"] == (x["actual_ci"][0] <= x["predicted_calibrated"] <= x["actual_ci"][1])
    # p = 0.5 per drafted token predicts 0.5 + 0.25 + ... < 1: inside neither interval's range of 1.5 ± 0.6
    assert not any(x["within_noise"] for x in s)


def test_headline_counts_flagged_slices_within_prompt_noise():
    rows = [_row("eagle", "model", "calibrated", "chat", 2500, 0.54, 0.50),  # 8 %, inside [0.45, 0.56]
            _row("eagle", "model", "calibrated", "code", 2500, 0.40, 0.50),  # 20 %, outside [0.47, 0.53]
            _row("eagle", "model", "calibrated", "all", 5000, 0.47, 0.50)]   # 6 %, no interval given
    noise = {(0.0, "model", "chat", "eagle"): {"prompts": 20, "actual_ci": [0.45, 0.56]},
             (0.0, "model", "code", "eagle"): {"prompts": 25, "actual_ci": [0.47, 0.53]}}
    s = {x["category"]: x for x in length_slices(rows, noise=noise)}
    assert s["chat"]["within_noise"] is True and s["code"]["within_noise"] is False
    assert s["chat"]["prompts"] == 20 and s["code"]["actual_ci"] == [0.47, 0.53]
    assert "within_noise" not in s["all"]
    head = length_headline(list(s.values()))
    assert "3 of 3 such slices exceed the 5% target, 1 of the 2 with an interval within prompt-sampling noise" in head
    noise[(0.0, "model", "all", "eagle")] = {"prompts": 45, "actual_ci": [0.48, 0.52]}
    assert "target, 1 of them within prompt-sampling noise" in length_headline(length_slices(rows, noise=noise))


def test_pooled_calibration_combines_every_bank_of_one_temperature(tmp_path):
    from calib import metrics as M
    from calib.evaluate.calibration import pooled_calibration_rows, samples

    paths = [_bank(tmp_path / "hot", 0.8), _bank(tmp_path / "hot2", 0.8, seed=6), _bank(tmp_path / "cold", 0.0, seed=4)]
    banks = [load_eval_bank(b, None) for b in paths]
    for b in banks:  # SYNTHETIC calibrated probabilities: a constant per chain, so the two pooled banks differ
        b.split[:] = "test"
        for c in b.chains.values():
            c.p_cal = np.where(np.isnan(c.acc), np.nan, 0.3 if c.drafter == "ngram" else 0.6)
    rows = pooled_calibration_rows(banks, n_bins=10)
    by = {(r["temperature"], r["chain"]): r for r in rows}
    assert list(by) == [(0.0, "model"), (0.0, "ngram"), (0.8, "model"), (0.8, "ngram")]
    hot = by[(0.8, "ngram")]
    assert hot["banks"] == ["hot", "hot2"]
    parts = [samples(b, "ngram", b.chains["ngram"].p_cal) for b in banks[:2]]
    assert hot["n"] == sum(len(p[0]) for p in parts) > len(parts[0][0])
    assert hot["ece_calibrated"] == pytest.approx(M.ece(np.concatenate([p[0] for p in parts]),
                                                        np.concatenate([p[1] for p in parts]), 10))
    assert hot["ece_raw"] is None and hot["n_raw"] is None  # the n-gram chain has no raw confidence
    model = by[(0.8, "model")]
    assert model["ece_raw"] is not None and model["n_raw"] == model["n"]
    for r in rows:
        assert r["target_met"] == (r["ece_calibrated"] <= 0.02 and (r["ece_raw"] is None
                                                                     or r["ece_calibrated"] <= r["ece_raw"]))
