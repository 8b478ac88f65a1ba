"""Quick stand-in tables for evaluation tests and for trying eval.py before train.py's tables exist.

NOT the project's calibrators (those live in calib/calibrators/): the model grid is an isotonic fit
per depth read at the grid points, the n-gram grid an empirical accept rate per feature cell with a
Beta(1, 1) prior. Good enough to exercise the evaluation end to end.

    python -m tests.evaluate.fit_tables OUT_DIR BANK [BANK ...]
"""

from __future__ import annotations

import sys

import numpy as np
import torch

from calib.labels import censored
from calib.tables import GridTables, save
from tests.synthetic import two_chain_tables

NGRAM_FEATURES = ("match_n", "agreement")
NGRAM_EDGES = ((2, 3, 4), (0.5, 0.99))


def fit_tables(banks, out_dir, grid_points: int = 21, split: str = "train", ngram_features=NGRAM_FEATURES,
               ngram_edges=NGRAM_EDGES):
    from sklearn.isotonic import IsotonicRegression

    from calib.bank import load
    from calib.chains import chain
    from calib.chains.ngram import round_feature_tensor
    from calib.evaluate.data import load_eval_bank

    model_conf, model_acc, ng_feat, ng_acc = [], [], [], []
    targets, model_ids = set(), set()
    for path in banks:
        eb = load_eval_bank(path, None)
        keys = load(path).table("acceptance.parquet")
        targets |= set(keys.column("model").to_pylist())
        if "model" in eb.chains:
            model_ids |= set(keys.column("speculator").to_pylist())
        keep = eb.split == split
        if "model" in eb.chains:
            model_conf.append(eb.chains["model"].p_raw[keep])
            model_acc.append(eb.chains["model"].acc[keep])
        if "ngram" in eb.chains:
            t = load(path).rounds(chains=[chain("ngram")])
            feats = round_feature_tensor(t, ngram_features, eb.chains["ngram"].acc.shape[1], prefix="ng_").numpy()
            ng_feat.append(feats[keep])
            ng_acc.append(eb.chains["ngram"].acc[keep])
    K = 4
    grid = torch.full((K, grid_points), 0.5)
    drafters = {}
    if model_conf:
        conf, acc = np.concatenate(model_conf), np.concatenate(model_acc)
        K = conf.shape[1]
        grid = torch.zeros(K, grid_points)
        reached, label = censored(acc)
        xs = np.linspace(0, 1, grid_points)
        for k in range(K):
            m = reached[:, k] & ~np.isnan(conf[:, k])
            iso = IsotonicRegression(y_min=0.0, y_max=1.0, out_of_bounds="clip").fit(conf[m, k], label[m, k])
            grid[k] = torch.from_numpy(iso.predict(xs)).float()
        drafters["model"] = {"estimator": "isotonic (test stand-in)", "depths": K, "k": K,
                             "ids": sorted(model_ids)}
    edges = torch.full((len(ngram_features), 3), float("inf"))
    for f, e in enumerate(ngram_edges):
        edges[f, : len(e)] = torch.tensor(e)
    n_b = [len(e) + 1 for e in ngram_edges]
    strides = torch.tensor([int(np.prod(n_b[f + 1:])) for f in range(len(n_b))], dtype=torch.int64)
    cells = int(np.prod(n_b))
    ng_grid = torch.full((K, cells), 0.5)
    if ng_feat:
        feats, acc = np.concatenate(ng_feat), np.concatenate(ng_acc)
        reached, label = censored(acc)
        buckets = np.stack([np.searchsorted(np.asarray(e), feats[:, 0, f], side="right")
                            for f, e in enumerate(ngram_edges)], axis=1)
        cell = (np.nan_to_num(buckets) * strides.numpy()).sum(axis=1)
        for k in range(min(K, acc.shape[1])):
            m = reached[:, k]
            n = np.bincount(cell[m], minlength=cells)
            a = np.bincount(cell[m], weights=label[m, k], minlength=cells)
            ng_grid[k] = torch.from_numpy((a + 1) / (n + 2)).float()
        drafters["ngram"] = {"estimator": "cell rate (test stand-in)", "depths": K, "k": K, "ids": ["ngram"]}
    tables = two_chain_tables(grid, edges, strides, ng_grid, features=list(ngram_features))
    tables = GridTables({name: t for name, t in tables.chains.items() if name in drafters})
    return save(out_dir, tables,
                meta={"chains": drafters,
                      "target_models": sorted(targets),
                      "banks": [str(b) for b in banks], "note": "stand-in tables from tests/evaluate/fit_tables.py"})


if __name__ == "__main__":
    fit_tables(sys.argv[2:], sys.argv[1])
