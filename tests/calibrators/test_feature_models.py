"""Item 3 of issue 13 on SYNTHETIC model-chain samples with planted effects: a small model on the chain's
features (confidence, entropy, + context) is one more candidate, chosen per depth (per context cell) by
grouped cross-validation (one-SE rule) and distilled into the confidence grid per context cell."""

from __future__ import annotations

import logging

import numpy as np
import pandas as pd
import pytest

from calib.calibrators.base import with_depth
from calib.calibrators.context import PerContextCell
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
    table, info = encode_chain(kind, res["estimator"], s[s.split.isin(["train", "val"])], res["chain_cfg"], 2,
                               res["uses_context"])
    return res, table, info


def _chosen(res) -> set:
    """Every candidate chosen at some depth of some context cell."""
    return {n for cell in res["choice"].values() for n in cell.values()}


def test_feature_model_selected_where_the_features_pay_and_distilled_per_cell():
    s = _samples()
    res, table, _ = _fit(s, {"isotonic": ISO, "logistic": LOGISTIC})
    # isotonic (first listed) is the baseline; logistic reads the entropy that carries the planted effect and
    # wins at every depth of every temperature cell, by more than the fold-to-fold SE
    est = res["estimator"]
    assert isinstance(est, PerContextCell) and set(est.cells_) == {0, 1}
    assert res["choice"] == {"cell 0": {0: "logistic", 1: "logistic"}, "cell 1": {0: "logistic", 1: "logistic"}}
    assert res["cv_nll"]["logistic"] < res["cv_nll"]["isotonic"] - 0.02
    for cell in res["choice_why"].values():
        for why in cell.values():
            (step,) = why["steps"]
            assert step["candidate"] == "logistic" and step["won"] and step["nll_gain"] > step["se"]
    # per cell, each cell's model reads the confidence and the entropy (the cell stands for the temperature)
    assert all(c.chosen_estimators_["logistic"].features == ("conf", "entropy") for c in est.cells_.values())
    assert res["uses_context"]
    assert [a.name for a in table.axes] == ["conf", "temperature"]
    g = table.grid.numpy().reshape(2, 2, -1)  # [depth, temperature cell, conf]
    assert (np.diff(g, axis=2) >= 0).all()  # monotone in confidence in every cell
    # the grid is the model averaged over each cell's entropy: it matches the model's mean prediction
    te = s[s.split == "test"]
    p_table = table_predict(table, te[["conf", "temperature"]], te.depth)
    p_model = est.accept_proba(with_depth(te[["conf", "temperature", "entropy"]], te.depth))
    for temp in (0.0, 1.0):
        m = (te.temperature == temp).to_numpy()
        assert abs(p_table[m].mean() - p_model[m].mean()) < 0.02
        assert abs(p_table[m].mean() - te.label[m].mean()) < 0.03  # and the planted acceptance
    assert (g[:, 1] <= g[:, 0] + 1e-6).all()  # T > 0 was planted lower


def test_no_gain_where_the_extra_feature_carries_nothing():
    s = _samples(entropy_effect=False, seed=4)
    res, _, _ = _fit(s, {"isotonic": ISO, "logistic": LOGISTIC})
    # both fit the truth (logistic in logit(conf) is the planted form); neither may be far off
    assert abs(res["cv_nll"]["logistic"] - res["cv_nll"]["isotonic"]) < 0.01
    # against a baseline on the confidence alone (the planted form), reading the entropy buys nothing: the
    # baseline stays at every depth of every cell (the one-SE rule), and the table reads no entropy
    res, _, _ = _fit(s, {"logistic_conf": {**LOGISTIC, "features": ["conf"]}, "logistic": LOGISTIC})
    assert res["choice"] == {"cell 0": {0: "logistic_conf", 1: "logistic_conf"},
                             "cell 1": {0: "logistic_conf", 1: "logistic_conf"}}
    assert not res["uses_context"]
    assert abs(res["cv_nll"]["logistic"] - res["cv_nll"]["logistic_conf"]) < 0.001


def test_features_the_banks_lack_are_left_out_with_a_warning(caplog):
    s = _samples().drop(columns=["entropy"])
    with caplog.at_level(logging.WARNING, logger="calib.train"):
        res, _, _ = _fit(s, {"logistic": {**LOGISTIC, "features": ["conf", "entropy", "margin"]}})
    assert all(c.chosen_estimators_["logistic"].features == ("conf",) for c in res["estimator"].cells_.values())
    assert any("record no ['entropy', 'margin']" in r.getMessage() for r in caplog.records)


def test_model_chain_features_must_start_with_the_confidence():
    with pytest.raises(ValueError, match="must start with 'conf'"):
        _fit(_samples(n=3000), {"logistic": {**LOGISTIC, "features": ["entropy", "conf"]}})
