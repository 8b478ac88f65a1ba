"""Tables: export grids, round trip, checksum and version refusal (SYNTHETIC fits)."""

import json

import numpy as np
import pandas as pd
import pytest
import torch

from calib.calibrators.binning import IsotonicPerDepth
from calib.calibrators.ngram import LogisticAcceptance
from calib.tables import GridTables, TablesError, load, save
from calib.tables.export import model_grid, ngram_grid, ngram_table_predict


@pytest.fixture
def tables():
    rng = np.random.default_rng(0)
    c = rng.uniform(size=5000)
    d = rng.integers(0, 3, 5000)
    y = (rng.uniform(size=5000) < c**2).astype(int)
    grid, change = model_grid(IsotonicPerDepth().fit(c, d, y), 3, 65)
    assert (np.diff(grid, axis=1) >= 0).all() and change < 1e-9  # isotonic is already monotone
    df = pd.DataFrame({"match_n": rng.integers(1, 5, 5000), "agreement": rng.uniform(size=5000),
                       "depth": rng.integers(0, 3, 5000)})
    yy = (rng.uniform(size=5000) < 0.2 * df.match_n).astype(int)
    model = LogisticAcceptance(features=["match_n", "agreement"]).fit(df, yy)
    edges, strides, ngrid, info = ngram_grid(model, df, ["match_n", "agreement"], [[1.5, 2.5, 3.5], [0.5]], 3)
    assert info["cells"] == 8 and strides.tolist() == [2, 1]
    # A cell's value is the mean prediction of the samples in it.
    pred = model.predict_proba(df)
    m = (df.depth == 1) & (df.match_n == 2) & (df.agreement >= 0.5)
    assert ngrid[1, 1 * 2 + 1] == pytest.approx(pred[m.to_numpy()].mean(), rel=1e-5)
    t = GridTables(torch.from_numpy(grid), torch.from_numpy(edges), torch.from_numpy(strides), torch.from_numpy(ngrid))
    table_p = ngram_table_predict(t, df, ["match_n", "agreement"])
    assert np.corrcoef(table_p, pred)[0, 1] > 0.95
    return t


def test_round_trip(tmp_path, tables):
    save(tmp_path, tables, {"drafters": {"model": {}, "ngram": {}}, "ngram_features": ["match_n", "agreement"]})
    t = load(tmp_path)
    assert torch.equal(t.model_grid, tables.model_grid) and torch.equal(t.ngram_grid, tables.ngram_grid)
    assert t.has_model and t.ngram_feature_names == ["match_n", "agreement"]
    conf = torch.tensor([[0.0, 0.5, float("nan")], [1.0, 0.25, 0.75]])
    p = t.model_accept_prob(conf)
    assert torch.isnan(p[0, 2]) and not torch.isnan(p[1]).any()
    assert t.model_accept_prob(conf[:, 1:2], depth=1)[1, 0] == p[1, 1]
    assert not list(tmp_path.glob(".tables.tmp-*"))


def test_checksum_refusal(tmp_path, tables):
    save(tmp_path, tables, {"drafters": {}})
    raw = bytearray((tmp_path / "tables.safetensors").read_bytes())
    raw[-1] ^= 0xFF
    (tmp_path / "tables.safetensors").write_bytes(bytes(raw))
    with pytest.raises(TablesError, match="sha256"):
        load(tmp_path)


def test_version_refusal(tmp_path, tables):
    save(tmp_path, tables, {"drafters": {}})
    meta = json.loads((tmp_path / "tables.json").read_text())
    meta["schema_version"] = 999
    (tmp_path / "tables.json").write_text(json.dumps(meta))
    with pytest.raises(TablesError, match="schema_version 999"):
        load(tmp_path)


def test_missing_files(tmp_path):
    with pytest.raises(TablesError, match="not found"):
        load(tmp_path)
