"""train.py with calibrator=identity, through Hydra's compose API on a tiny SYNTHETIC bank."""

from pathlib import Path

from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from calib.bank import write_bank
from calib.tables import load
from calib.training import run
from tests.synthetic import synthetic_tables

CONF = str(Path(__file__).resolve().parents[2] / "conf")


def test_train_with_the_identity_calibrator(tmp_path):
    # Before: 'Identity' object has no attribute 'args' after all fitting (get_params for the metadata).
    bank = write_bank(tmp_path / "bank", *synthetic_tables(n_prompts=24, rounds_per_prompt=20))
    with initialize_config_dir(CONF, version_base="1.3"):
        cfg = compose("train", overrides=[f"data.train=[{bank}]", f"out_dir={tmp_path / 'out'}", "logger=none",
                                          "calibrator=identity", "ngram_model=logistic", "trainer.progress=false"])
    tables = load(run(OmegaConf.to_container(cfg, resolve=True)))
    model = tables.meta["chains"]["model"]
    # params: per candidate (identity is the baseline and the only one here), chosen at every depth
    assert model["estimator"] == "identity" and model["params"] == {"identity": {}}
    for per_depth in model["choice"].values():  # per context cell (temperature axis)
        assert per_depth == {str(d): "identity" for d in range(model["depths"])}
