"""train.py carries the banks' fingerprints into tables.json and leaves out rounds of requests with
target-only logit transforms by default (issue 29, Musts 3 and 6); a tiny SYNTHETIC bank, fast candidates."""

import logging

import pyarrow as pa
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from calib.bank import write_bank
from calib.fingerprint import identity, same_model
from calib.tables import load
from calib.training import run
from tests.synthetic import synthetic_tables
from tests.test_fingerprint import _model
from tests.test_train_entry import CONF


def test_tables_record_the_banks_identity_and_skip_transformed_rounds(tmp_path, caplog):
    acc, spec, ng = synthetic_tables(n_prompts=40, rounds_per_prompt=30)
    marks = ["logit_bias" if i % 10 == 0 else "" for i in range(spec.num_rows)]
    spec = spec.append_column(pa.field("logit_transforms", pa.string()), pa.array(marks, pa.string()))
    ident = identity(_model(tmp_path / "target"), _model(tmp_path / "head", seed=1), "eagle", 4)
    bank = write_bank(tmp_path / "bank", acc, spec, ng, manifest={"identity": ident, "method": "eagle"})
    with initialize_config_dir(CONF, version_base="1.3"):
        cfg = compose("train", overrides=[f"data.train=[{bank}]", f"out_dir={tmp_path / 'out'}", "logger=csv",
                                          "calibrator=isotonic", "ngram_model=logistic", "trainer.progress=false"])
    with caplog.at_level(logging.INFO, logger="calib.train"):
        out = run(OmegaConf.to_container(cfg, resolve=True))
    n_out = marks.count("logit_bias")
    assert f"left out {n_out} rounds of requests with target-only logit transforms" in caplog.text
    tables = load(out)
    (entry,) = tables.meta["banks"]
    assert same_model(entry["identity"]["target"], ident["target"]) and entry["method"] == "eagle"
    fps, legacy = tables.fitted_fingerprints("drafter", "model")
    assert legacy == [] and len(fps) == 1 and same_model(fps[0], ident["drafter"])
