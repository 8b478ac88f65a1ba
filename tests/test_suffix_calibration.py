"""The real suffix chain's tables beat its own raw probability estimate on prompts they were not fitted on (issue 45,
Target): fitted by train.py on the shipped bank of vLLM's suffix decoding over data/prompts (greedy), scored on the
shipped held-out bank (data/prompts/holdout/), greedy and at T = 0.8, at every position the verified suffix chain
reached."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

ROOT = Path(__file__).resolve().parents[1]
BANKS = ROOT / "data/banks"


@pytest.mark.parametrize("temperature", ["t0", "t0.8"])
def test_tables_beat_the_trees_own_estimate_on_held_out_prompts(tmp_path, temperature):
    TRAIN, HOLDOUT = BANKS / f"suffix-chat_code-{temperature}", BANKS / f"suffix-holdout-{temperature}"
    from calib.evaluate.data import load_eval_bank
    from calib.labels import censored
    from calib.metrics import ece, nll
    from calib.tables import load
    from calib.training import run

    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("train", overrides=[f"data.train=[{TRAIN}]", f"out_dir={tmp_path / 'tables'}", "logger=none",
                                          "~ngram_model", "+suffix_model=logistic", "trainer.progress=false"])
    tables = load(run(OmegaConf.to_container(cfg, resolve=True)))
    assert "suffix" in tables.meta["chains"]
    bank = load_eval_bank(HOLDOUT, tables)
    chain = bank.chains["suffix"]
    reached, label = censored(chain.acc)
    p_cal, p_raw, y = chain.p_cal[reached], chain.p_raw[reached], label[reached].astype(np.float64)
    assert reached.sum() > 10000 and np.isfinite(p_cal).all() and np.isfinite(p_raw).all()
    e_cal, e_raw, n_cal, n_raw = ece(p_cal, y), ece(p_raw, y), nll(p_cal, y), nll(p_raw, y)
    print(f"held-out suffix chain: ECE {e_cal:.4f} vs raw {e_raw:.4f}, NLL {n_cal:.4f} vs raw {n_raw:.4f}")
    assert e_cal < e_raw and n_cal < n_raw

