"""The n-gram chain fitted per context cell (``ngram_model.per_cell``) on SYNTHETIC samples with a planted
interaction: the match length predicts acceptance at T = 0 and barely at T = 1. One logistic fit reading the
temperature as an additive feature cannot hold both; one fit per temperature cell can."""

from __future__ import annotations

import numpy as np
import pandas as pd

from calib.calibrators.context import PerContextCell
from calib.chains import chain
from calib.chains.ngram import NGRAM_SAMPLE_FEATURES
from calib.tables.export import encode_chain, table_predict
from calib.training import fit_chain

TABLE = ["match_n", "agreement"]
LOGISTIC = {"_target_": "calib.calibrators.features.LogisticAcceptance", "features": TABLE}
CTX = {"axes": {"temperature": {"edges": "auto"}}, "min_cell_samples": 200}


def _samples(n=16000, seed=0) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    temp = rng.choice([0.0, 1.0], n)
    match_n = rng.integers(1, 5, n).astype(np.float64)
    agreement = rng.uniform(0, 1, n)
    z = np.where(temp < 0.5, 2.0 * (match_n - 2.5) + 1.5 * (agreement - 0.5), -0.5 + 0.1 * (match_n - 2.5))
    prompt = rng.integers(0, 300, n)
    cols = {f: rng.uniform(0, 1, n) for f in NGRAM_SAMPLE_FEATURES}  # unread by the candidates
    cols.update(match_n=match_n, agreement=agreement)
    return pd.DataFrame({**cols, "temperature": temp, "depth": rng.integers(0, 2, n),
                         "label": (rng.uniform(0, 1, n) < 1 / (1 + np.exp(-z))).astype(np.int8), "category": "chat",
                         "prompt_idx": prompt,
                         "split": np.where(prompt % 5 == 0, "val", np.where(prompt % 5 == 1, "test", "train"))})


def _fit(s, per_cell: bool):
    kind = chain("ngram")
    cfg = {"candidates": {"logistic": LOGISTIC}, "context": CTX, "per_cell": per_cell,
           "table": {"features": TABLE, "edges": [[1.5, 2.5, 3.5], [0.25, 0.5, 0.75]]}}
    res = fit_chain(kind, s, cfg)
    table, _ = encode_chain(kind, res["estimator"], s[s.split.isin(["train", "val"])], res["chain_cfg"], 2,
                            res["uses_context"])
    return res, table


def _brier(table, s) -> float:
    te = s[s.split == "test"]
    p = table_predict(table, te[[*TABLE, "temperature"]], te.depth.to_numpy())
    return float(np.mean((p - te.label.to_numpy()) ** 2))


def test_per_cell_fits_each_temperature_apart_and_holds_the_interaction():
    s = _samples()
    pooled, pooled_table = _fit(s, per_cell=False)
    cells, cells_table = _fit(s, per_cell=True)
    assert not isinstance(pooled["estimator"], PerContextCell)
    assert pooled["estimator"].candidates["logistic"].features == (*TABLE, "temperature")  # read as a feature
    est = cells["estimator"]
    assert isinstance(est, PerContextCell) and set(est.cells_) == {0, 1}
    assert all(c.chosen_estimators_["logistic"].features == tuple(TABLE) for c in est.cells_.values())
    assert [a.name for a in cells_table.axes] == [*TABLE, "temperature"]
    assert _brier(cells_table, s) < _brier(pooled_table, s) - 0.005
    # T = 1 was planted flat in the match length: its cell's table nearly so, T = 0's steep
    te = pd.DataFrame({"match_n": [1.0, 4.0] * 2, "agreement": [0.5] * 4, "temperature": [0.0, 0.0, 1.0, 1.0]})
    p = table_predict(cells_table, te, np.zeros(4, dtype=np.int64))
    assert p[1] - p[0] > 0.6 and abs(p[3] - p[2]) < 0.15
