"""Item 3 of issue 13 on SYNTHETIC model-chain samples with planted effects: a small model on the chain's
features (confidence, entropy, + context) is one more candidate, selected on validation NLL and distilled
into the confidence grid per context cell."""

from __future__ import annotations

import logging

import numpy as np
import pandas as pd
import pytest

from calib.chains import chain
from calib.tables.export import encode_chain, table_predict
from calib.training import fit_chain

ISO = {"_target_": "calib.calibrators.binning.IsotonicPerDepth"}
LOGISTIC = {"_target_": "calib.calibrators.features.LogisticAcceptance", "features": ["conf", "entropy"]}
CTX = {"axes": {"temperature": {"edges": "auto"}}, "min_cell_samples": 200}


def _samples(n=20000, seed=0, entropy_effect=True) -> pd.DataFrame:
    """logit P(accept) = 3 logit(conf) - 1.5 entropy (when planted) - 1 at T > 0: entropy carries what the
    confidence does not, so a model reading it beats any map of the confidence alone."""
    rng = np.random.default_rng(seed)
    conf = rng.uniform(0.02, 0.98, n)
    entropy = rng.uniform(0, 2, n)
    temp = rng.choice([0.0, 1.0], n)
    z = 3 * (np.log(conf) - np.log1p(-conf)) - (1.5 * (entropy - 1) if entropy_effect else 0) - (temp > 0.5)
    prompt = rng.integers(0, 300, n)
    return pd.DataFrame({"conf": conf, "entropy": entropy, "temperature": temp, "depth": rng.integers(0, 2, n),
                         "label": (rng.uniform(0, 1, n) < 1 / (1 + np.exp(-z))).astype(np.int8),
                         "category": "chat", "prompt_idx": prompt,
                         "split": np.where(prompt % 5 == 0, "val", np.where(prompt % 5 == 1, "test", "train"))})


def _fit(s, candidates):
    kind = chain("model")
    res = fit_chain(kind, s, {"candidates": candidates, "grid_points": 65, "context": CTX})
    best = res["fits"][res["best"]]
    table, info = encode_chain(kind, best["estimator"], s[s.split == "train"], res["chain_cfg"], 2,
                               best["uses_context"])
    return res, table, info


def test_feature_model_selected_where_the_features_pay_and_distilled_per_cell():
    s = _samples()
    res, table, _ = _fit(s, {"isotonic": ISO, "logistic": LOGISTIC})
    assert res["best"] == "logistic" and res["fits"]["logistic"]["val_nll"] < res["fits"]["isotonic"]["val_nll"]
    est = res["fits"]["logistic"]["estimator"]
    assert est.features == ("conf", "entropy", "temperature")  # the context axes join its features
    assert [a.name for a in table.axes] == ["conf", "temperature"]
    g = table.grid.numpy().reshape(2, 2, -1)  # [depth, temperature cell, conf]
    assert (np.diff(g, axis=2) >= 0).all()  # monotone in confidence in every cell
    # the grid is the model averaged over each cell's entropy: it matches the model's mean prediction
    te = s[s.split == "test"]
    p_table = table_predict(table, te[["conf", "temperature"]], te.depth)
    p_model = est.predict_proba(te[["conf", "entropy", "temperature"]], te.depth)
    for temp in (0.0, 1.0):
        m = (te.temperature == temp).to_numpy()
        assert abs(p_table[m].mean() - p_model[m].mean()) < 0.02
        assert abs(p_table[m].mean() - te.label[m].mean()) < 0.03  # and the planted acceptance
    assert (g[:, 1] <= g[:, 0] + 1e-6).all()  # T > 0 was planted lower


def test_no_gain_where_the_extra_feature_carries_nothing():
    res, _, _ = _fit(_samples(entropy_effect=False, seed=1), {"isotonic": ISO, "logistic": LOGISTIC})
    # both fit the truth (logistic in logit(conf) is the planted form); neither may be far off
    assert abs(res["fits"]["logistic"]["val_nll"] - res["fits"]["isotonic"]["val_nll"]) < 0.01


def test_features_the_banks_lack_are_left_out_with_a_warning(caplog):
    s = _samples().drop(columns=["entropy"])
    with caplog.at_level(logging.WARNING, logger="calib.train"):
        res, _, _ = _fit(s, {"logistic": {**LOGISTIC, "features": ["conf", "entropy", "margin"]}})
    assert res["fits"]["logistic"]["estimator"].features == ("conf", "temperature")
    assert any("record no ['entropy', 'margin']" in r.getMessage() for r in caplog.records)


def test_model_chain_features_must_start_with_the_confidence():
    with pytest.raises(ValueError, match="must start with 'conf'"):
        _fit(_samples(n=3000), {"logistic": {**LOGISTIC, "features": ["entropy", "conf"]}})
