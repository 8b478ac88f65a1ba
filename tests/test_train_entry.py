"""train.py through Hydra's compose API on a tiny SYNTHETIC bank (fast candidates only)."""

from pathlib import Path

from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from calib.bank import write_bank
from calib.tables import load
from calib.training import run
from tests.synthetic import synthetic_tables

CONF = str(Path(__file__).resolve().parents[1] / "conf")


def test_train_entry_point(tmp_path):
    bank = write_bank(tmp_path / "bank", *synthetic_tables(n_prompts=40, rounds_per_prompt=30))
    with initialize_config_dir(CONF, version_base="1.3"):
        cfg = compose("train", overrides=[f"data.train=[{bank}]", f"out_dir={tmp_path / 'out'}", "logger=csv",
                                          "calibrator=isotonic", "ngram_model=logistic", "trainer.progress=false"])
    out = run(OmegaConf.to_container(cfg, resolve=True))
    tables = load(out)
    assert tables.has_model and tables.has_ngram
    assert tables.meta["drafters"]["model"]["calibrator"] == "isotonic"
    assert tables.ngram_feature_names == list(cfg.ngram_model.table.features)
    assert (out / "reliability_test.png").exists() and (out / "csv" / "fit.csv").exists()
    assert "ECE raw" in (out / "summary.txt").read_text()


def test_train_config_groups_compose():
    with initialize_config_dir(CONF, version_base="1.3"):
        for group in ("auto", "temperature", "isotonic", "histogram", "identity"):
            cfg = compose("train", overrides=[f"calibrator={group}", "out_dir=x"])
            assert cfg.calibrator.candidates
        for group in ("auto", "logistic", "hgb", "mlp"):
            assert compose("train", overrides=[f"ngram_model={group}", "out_dir=x"]).ngram_model.table.features


def test_train_with_extra_inputs_exports_a_marginal_table(tmp_path):
    bank = write_bank(tmp_path / "bank", *synthetic_tables(n_prompts=40, rounds_per_prompt=30, extras=True))
    with initialize_config_dir(CONF, version_base="1.3"):
        cfg = compose("train", overrides=[f"data.train=[{bank}]", f"out_dir={tmp_path / 'out'}", "logger=none",
                                          "calibrator=temperature", "calibrator.extra=[entropy,margin]",
                                          "ngram_model=logistic", "trainer.progress=false", "trainer.max_epochs=5"])
    tables = load(run(OmegaConf.to_container(cfg, resolve=True)))
    grid = tables.model_grid
    assert not grid.isnan().any() and (grid.diff(dim=1) >= 0).all()
