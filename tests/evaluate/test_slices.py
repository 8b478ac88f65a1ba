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
