"""Context axes (issue 13 item 2) on SYNTHETIC data with a planted effect: the fit must recover it."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

from calib.chains import chain, context_axes, resolve_edges
from calib.labels import round_context
from calib.tables.export import encode_chain, table_predict
from calib.training import fit_chain

CTX = {"axes": {"temperature": {"edges": "auto"}}, "candidates": {"prev_accept": {"edges": [0, 1, 2]}},
       "min_cell_samples": 200}
ISO = {"isotonic": {"_target_": "calib.calibrators.binning.IsotonicPerDepth"}}


def _samples(n=12000, temps=(0.0, 1.0), prev_effect=False, seed=0) -> pd.DataFrame:
    """Model-chain samples: P(accept) = conf at T=0 and conf / 2 at T>0 (the planted temperature effect);
    with ``prev_effect`` also halved where the previous round accepted nothing."""
    rng = np.random.default_rng(seed)
    conf = rng.uniform(0, 1, n)
    temp = rng.choice(np.asarray(temps), n)
    prev = rng.choice([np.nan, 0.0, 1.0, 3.0], n)
    p = np.where(temp > 0.5, conf / 2, conf)
    if prev_effect:
        p = np.where(prev == 0, p / 2, p)
    prompt = rng.integers(0, 300, n)
    return pd.DataFrame({"conf": conf, "temperature": temp, "prev_accept": prev, "depth": rng.integers(0, 2, n),
                         "label": (rng.uniform(0, 1, n) < p).astype(np.int8), "category": "chat",
                         "prompt_idx": prompt,
                         "split": np.where(prompt % 5 == 0, "val", np.where(prompt % 5 == 1, "test", "train"))})


def _fit(samples, ctx=CTX, candidates=ISO, baseline=None, out=None):
    kind = chain("model")
    res = fit_chain(kind, samples, {"candidates": candidates, "grid_points": 65, "context": ctx,
                                    **({"baseline": baseline} if baseline else {})})
    cfg = res["chain_cfg"]
    fitted_on = samples[samples.split.isin(["train", "val"])]  # grouped CV fits on train + val; test held out
    table, info = encode_chain(kind, res["estimator"], fitted_on, cfg, 2, res["uses_context"])
    if out is not None:
        out.update(res)
    return cfg, table, info


def test_planted_temperature_effect_is_recovered():
    s = _samples()
    cfg, table, info = _fit(s)
    assert [a.name for a in table.axes] == ["conf", "temperature"]
    assert list(context_axes(cfg)[0].edges) == [0.5]  # auto: between the two training temperatures
    conf = np.linspace(0.05, 0.95, 10)
    for temp, truth in ((0.0, conf), (1.0, conf / 2)):
        x = np.column_stack([conf, np.full(10, temp)])
        p = table_predict(table, x, np.zeros(10, int))
        assert np.abs(p - truth).max() < 0.12, (temp, p, truth)
    g = table.grid.numpy()
    assert (np.diff(g.reshape(2, 2, -1), axis=2) >= 0).all()  # monotone in confidence in every cell
    assert info["context"]["cells"] == 2


def test_single_temperature_gives_a_one_bin_axis():
    cfg, table, _ = _fit(_samples(temps=(0.7,)))
    assert context_axes(cfg)[0].edges == () and table.grid.shape[1] == 65


def test_previous_accept_axis_kept_only_where_it_pays():
    # isotonic is the only candidate (so the baseline): the optional axis is tried on it
    res = {}
    cfg, _, _ = _fit(_samples(prev_effect=True), out=res)
    assert cfg["context"]["selected"] == ["temperature", "prev_accept"]
    t = res["context_trials"]["prev_accept"]
    assert t["cv_nll_without"] - t["cv_nll_with"] > t["se"]  # kept by the one-SE rule
    cfg, _, _ = _fit(_samples(prev_effect=False, seed=3), out=res)
    assert cfg["context"]["selected"] == ["temperature"]
    assert "prev_accept" in res["context_trials"]  # tried, and dropped


def test_optional_axis_tried_on_the_calibrator_chosen_over_the_raw_confidence():
    # the production set-up: identity (the raw confidence) is the baseline, isotonic a richer candidate;
    # the planted effects make the raw confidence miscalibrated, so isotonic is chosen and the axis tried on it
    identity = {"identity": {"_target_": "calib.calibrators.identity.Identity"}}
    res = {}
    cfg, _, _ = _fit(_samples(prev_effect=True), baseline=identity, out=res)
    assert cfg["context"]["selected"] == ["temperature", "prev_accept"]
    assert "isotonic" in {n for cell in res["choice"].values() for n in cell.values()}
    assert set(res["cv_nll"]) == {"identity", "isotonic"}


def test_resolve_edges():
    assert resolve_edges([0.0, 0.8, 0.8, np.nan], "auto") == [0.4]
    assert resolve_edges([0.8], "auto") == []
    assert resolve_edges([1, 2], [0.5]) == [0.5]
    assert len(resolve_edges(np.linspace(0, 2, 50), "auto", max_bins=4)) == 3
    with pytest.raises(ValueError, match="auto"):
        resolve_edges([1.0], "quantiles")


def test_round_context_orders_a_requests_rounds():
    # rounds of one request out of order, a second turn and a second prompt: prev_accept follows round_idx
    t = pa.table({"model": ["m"] * 5, "speculator": ["s"] * 5, "config": ["c"] * 5, "category": ["chat"] * 5,
                  "prompt_idx": [0, 0, 0, 0, 1], "turn": [0, 0, 0, 1, 0], "round_idx": [2, 0, 1, 0, 0],
                  "accept": [3, 1, 2, 4, 0], "temperature": [0.8] * 5})
    ctx = round_context(t)
    assert np.array_equal(ctx["prev_accept"], [2, np.nan, 1, np.nan, np.nan], equal_nan=True)
    # running mean over the request's earlier rounds: round 2 of prompt 0 turn 0 saw accepts 1 and 2
    assert np.array_equal(ctx["mean_accept"], [1.5, np.nan, 1, np.nan, np.nan], equal_nan=True)
    # position: tokens emitted by the request's earlier rounds (accepted + 1 each), 0 in its first
    assert np.array_equal(ctx["position"], [5, 0, 2, 0, 0])
    assert np.allclose(ctx["temperature"], 0.8)


def test_planted_temperature_effect_on_the_ngram_chain():
    """The n-gram models read the context as features (one pooled fit) and the table is distilled per
    temperature cell: acceptance halved at T > 0 must show in the T=1 cells."""
    rng = np.random.default_rng(1)
    n = 20000
    match = rng.integers(1, 6, n).astype(float)
    temp = rng.choice([0.0, 1.0], n)
    p = np.clip(0.15 * match, 0, 0.9) * np.where(temp > 0.5, 0.5, 1.0)
    prompt = rng.integers(0, 400, n)
    s = pd.DataFrame({"match_n": match, "occurrences": rng.integers(1, 10, n).astype(float),
                      "distance": rng.integers(1, 300, n).astype(float), "in_prompt": rng.integers(0, 2, n) * 1.0,
                      "distinct_next": np.ones(n), "agreement": rng.uniform(0, 1, n),
                      "depth_agreement": rng.uniform(0, 1, n), "cont_len": rng.integers(1, 20, n) * 1.0, "context_len": rng.integers(50, 500, n) * 1.0,
                      "temperature": temp, "prev_accept": np.full(n, np.nan), "depth": np.zeros(n, int),
                      "label": (rng.uniform(0, 1, n) < p).astype(np.int8), "category": "chat", "prompt_idx": prompt,
                      "split": np.where(prompt % 5 == 0, "val", np.where(prompt % 5 == 1, "test", "train"))})
    kind = chain("ngram")
    cfg = {"candidates": {"logistic": {"_target_": "calib.calibrators.features.LogisticAcceptance"}},
           "table": {"features": ["match_n"], "edges": [[1.5, 2.5, 3.5, 4.5]]},
           "context": {"axes": {"temperature": {"edges": "auto"}}}}
    res = fit_chain(kind, s, cfg)
    est = res["estimator"]
    assert res["choice"] == {0: "logistic"}
    assert "temperature" in est.chosen_estimators_["logistic"].features  # the context axes join its features
    table, _ = encode_chain(kind, est, s[s.split.isin(["train", "val"])], res["chain_cfg"], 1)
    assert [a.name for a in table.axes] == ["match_n", "temperature"] and table.grid.shape == (1, 10)
    g = table.grid.numpy()[0].reshape(2, 5)  # [temperature bucket, match_n bucket]
    assert (g[1] < g[0]).all() and np.abs(g[1] / g[0] - 0.5).max() < 0.25


def test_optional_axis_decided_on_a_sample_of_a_large_split():
    # context.trial_samples: both variants fitted on a row sample; a kept axis is refitted on all rows
    s, res = _samples(prev_effect=True), {}
    cfg, table, _ = _fit(s, {**CTX, "trial_samples": 3000}, out=res)
    assert cfg["context"]["selected"] == ["temperature", "prev_accept"]
    assert [a.name for a in table.axes] == ["conf", "temperature", "prev_accept"]
    # decided on whole prompts up to 3000 rows (one prompt holds ~40), the kept axis fitted on every row
    assert 3000 <= res["context_trials"]["prev_accept"]["n_rows"] < 3200
    assert sum(res["estimator"].cell_samples_) == int(s.split.isin(["train", "val"]).sum())
