"""eval.py through Hydra's compose API on a tiny SYNTHETIC bank and stand-in tables."""

import json
from pathlib import Path

from hydra import compose, initialize_config_dir

from calib.bank import write_bank
from calib.evaluate.run import run
from tests.evaluate.fit_tables import fit_tables
from tests.synthetic import synthetic_tables

ROOT = Path(__file__).resolve().parents[2]


def test_eval_compose_run(tmp_path):
    bank = write_bank(tmp_path / "bank", *synthetic_tables(n_prompts=24, rounds_per_prompt=12, width=4, seed=3))
    fit_tables([bank], tmp_path / "tables", split="train")
    out = tmp_path / "out"
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("eval", overrides=[f"root={ROOT}", f"data.test=[{bank}]", f"tables={tmp_path / 'tables'}",
                                         f"out_dir={out}", "logger=csv", "metrics.n_boot=20",
                                         "replay.batch_sizes=[1,4]", "replay.max_steps=8", "replay.min_steps=4",
                                         "replay.progress=false"])
    assert set(cfg.cost) == {"parametric", "measured"}  # both curves by default
    run(cfg)
    m = json.loads((out / "metrics.json").read_text())
    cal = m["calibration"][0]
    assert {"drafter", "variant", "category", "depth", "n", "ece", "ece_ci", "ece_equal_mass", "ece_debiased",
            "mce", "brier", "nll", "auroc"} <= set(cal)
    assert {r["variant"] for r in m["calibration"] if r["drafter"] == "model"} == {"raw", "calibrated"}
    assert {r["variant"] for r in m["calibration"] if r["drafter"] == "ngram"} == {"calibrated"}
    assert {"drafter", "variant", "category", "predicted_mean", "actual_mean", "mae", "pearson"} <= set(
        m["accept_length"][0])
    lad = m["ladder"]
    assert {"policy", "batch_size", "category", "cost_model", "goodput", "vs_best_fixed",
            "headroom_captured"} <= set(lad[0])
    assert {r["cost_model"] for r in lad} == {"parametric", "measured"}
    assert {r["policy"] for r in lad} >= {"no_spec", "fixed_1", "best_fixed", "homogeneous", "gated_uniform",
                                          "ragged_raw", "ragged_calibrated", "two_drafter", "oracle"}
    report = (out / "report.md").read_text()
    assert "Policy ladder" in report and "reliability_" in report
    assert len(list(out.glob("*.png"))) >= 5
    assert (out / "csv" / "ladder.csv").exists()
