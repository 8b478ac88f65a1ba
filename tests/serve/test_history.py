"""RequestHistory keeps calib.labels' definitions of the history context axes (one definition): a
SYNTHETIC sequence of engine steps goes through RequestHistory and, as a bank's rounds, through
calib.labels.round_context; both give identical values (NaN where NaN)."""

from __future__ import annotations

import math

import numpy as np
import pyarrow as pa
import pytest

from calib.labels import HISTORY_COLUMNS, round_context
from calib.serve import RequestHistory


def _simulate(seed: int):
    """SYNTHETIC interleaved steps of several requests (one id reused after finish); returns the bank
    rows of the rounds (drafted >= 1) in step order, each with what RequestHistory said before it."""
    rng = np.random.default_rng(seed)
    hist = RequestHistory()
    # engine request id -> (prompt_idx, turn); "r1" finishes and is reused for another prompt
    active = {"r0": (0, 0), "r1": (1, 0), "r2": (0, 1)}
    n_rounds = {k: 0 for k in active}
    rows = []
    for step in range(40):
        if step == 20:
            hist.finish("r1")
            active["r1"], n_rounds["r1"] = (2, 0), 0
        ids = [*active, "never-seen"]  # values(), vectorised over a step's requests, is context() per request
        got = hist.values(ids)
        for b, req in enumerate(ids):
            want = hist.context(req)
            assert all(np.array_equal(got[n][b], want[n], equal_nan=True) for n in HISTORY_COLUMNS), (req, got, want)
        for req, (prompt, turn) in active.items():
            if rng.uniform() < 0.2:
                continue  # not scheduled this step
            drafted = int(rng.integers(0, 5))  # 0: no draft this step (no round in the bank)
            accepted = int(rng.integers(0, drafted + 1))
            before = hist.context(req)
            hist.observe(req, accepted, drafted)
            if drafted:
                rows.append({"prompt_idx": prompt, "turn": turn, "round_idx": n_rounds[req],
                             "accept": accepted, **{f"h_{k}": v for k, v in before.items()}})
                n_rounds[req] += 1
            else:
                assert hist.context(req) == pytest.approx(before, nan_ok=True)
    return rows


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_history_equals_labels_definitions(seed):
    rows = _simulate(seed)
    order = np.random.default_rng(seed + 100).permutation(len(rows))  # a bank's rows in any order
    rows = [rows[i] for i in order]
    n = len(rows)
    t = pa.table({"model": ["m"] * n, "speculator": ["s"] * n, "config": ["c"] * n, "category": ["chat"] * n,
                  "prompt_idx": [r["prompt_idx"] for r in rows], "turn": [r["turn"] for r in rows],
                  "round_idx": [r["round_idx"] for r in rows], "accept": [r["accept"] for r in rows]})
    ctx = round_context(t, HISTORY_COLUMNS)
    for name in HISTORY_COLUMNS:
        mine = np.array([r[f"h_{name}"] for r in rows], dtype=np.float64)
        assert np.array_equal(mine, ctx[name], equal_nan=True), name
    assert np.isnan(ctx["prev_accept"]).any() and (ctx["position"] > 0).any()  # both cases exercised


def test_first_round_observe_and_finish():
    h = RequestHistory()
    first = h.context("a")
    assert math.isnan(first["prev_accept"]) and math.isnan(first["mean_accept"]) and first["position"] == 0
    h.observe("a", 2)
    h.observe("a", 0, drafted=3)
    h.observe("a", 0, drafted=0)  # no round
    assert h.context("a") == {"prev_accept": 0.0, "mean_accept": 1.0, "position": 4.0}
    v = h.values(["a", "b"])
    assert v["position"].tolist() == [4.0, 0.0] and np.isnan(v["prev_accept"][1])
    h.finish("a")
    h.finish("never-seen")
    assert "a" not in h and len(h) == 0
    with pytest.raises(ValueError, match="accepted=4 > drafted=3"):
        h.observe("a", 4, drafted=3)
    with pytest.raises(ValueError, match=">= 0"):
        h.observe("a", -1)
    with pytest.raises(KeyError, match="temperature"):
        h.values(["a"], ["temperature"])
