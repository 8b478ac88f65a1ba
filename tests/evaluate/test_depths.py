"""Per depth against raw (calib/evaluate/depths.py), on SYNTHETIC rounds: labels drawn from a known acceptance,
so which predictor is calibrated is known by construction."""

from types import SimpleNamespace

import numpy as np
import pytest

from calib.evaluate.depths import depth_rows, depth_section, depth_verdict


def _record(n_rounds=4000, n_prompts=80, K=3, shift=0.25, seed=0, temperature=0.0, raw=True):
    """Rounds whose depth-k acceptance is ``a``; raw = a (calibrated), tables = a + shift at depth 1 only,
    online = a everywhere."""
    rng = np.random.default_rng(seed)
    a = rng.uniform(0.2, 0.7, size=(n_rounds, K))
    acc = (rng.random((n_rounds, K)) < a).astype(np.float64)
    tables = a.copy()
    tables[:, 1] = np.clip(a[:, 1] + shift, 0.0, 1.0)
    bank = SimpleNamespace(name=f"bank{seed}", prompt_idx=rng.integers(0, n_prompts, n_rounds))
    return {"bank": bank, "chain": "model", "keep": np.arange(n_rounds),
            "temperature": np.full(n_rounds, temperature), "acc": acc, "raw": a if raw else None,
            "tables": tables, "online": a.copy()}


def test_a_shifted_depth_is_worse_than_raw_beyond_noise():
    rows = depth_rows([_record()], n_boot=50, min_labels=100)
    by_depth = {r["depth"]: r for r in rows}
    assert set(by_depth) == {0, 1, 2}
    shifted = by_depth[1]
    assert shifted["worse_tables"] and shifted["worse_tables_beyond_noise"]
    assert shifted["diff_tables"] > 0.15  # a 0.25 shift of a calibrated predictor, clipped at 1
    for d in (0, 2):  # identical to raw: no difference, in every bootstrap draw too
        assert by_depth[d]["diff_tables"] == 0.0 and not by_depth[d]["worse_tables"]
        assert by_depth[d]["diff_tables_lo"] == by_depth[d]["diff_tables_hi"] == 0.0
    assert not any(r["worse_online"] for r in rows)
    verdict = depth_verdict(rows)
    assert verdict["tables"] == ["T = 0, model depth 1"] and verdict["online"] == []


def test_the_label_floor_decides_what_counts():
    rows = depth_rows([_record(n_rounds=600)], n_boot=20, min_labels=10_000)
    assert not any(r["counted"] for r in rows)
    assert depth_verdict(rows) == {"counted": 0, "tables": [], "tables_beyond_noise": [], "online": [],
                                   "online_beyond_noise": []}
    lines = "\n".join(depth_section(rows, min_labels=10_000))
    assert "(under floor)" in lines and "**none**" in lines


def test_only_reached_positions_count_and_temperatures_stay_apart():
    hot, cold = _record(seed=1, temperature=0.8), _record(seed=2, temperature=0.0)
    rows = depth_rows([hot, cold], n_boot=10, min_labels=1)
    assert sorted({r["temperature"] for r in rows}) == [0.0, 0.8]
    acc = cold["acc"]
    reached1 = int(((acc[:, 0] == 1)).sum())  # depth 1 is verified only after depth 0 was accepted
    row = next(r for r in rows if r["temperature"] == 0.0 and r["depth"] == 1)
    assert row["n"] == reached1


def test_chains_without_a_raw_confidence_are_left_out():
    assert depth_rows([_record(raw=False)], n_boot=5) == []
    assert depth_section([]) == []


@pytest.mark.parametrize("n_boot", [0, 7])
def test_the_section_leads_with_its_answer(n_boot):
    rows = depth_rows([_record()], n_boot=n_boot, min_labels=100)
    lines = depth_section(rows, min_labels=100)
    assert lines[0] == "## Per depth against the raw confidence"
    assert lines[2].startswith("**Does any depth with ≥ 100 labels end worse than raw?** the tables alone: **1**")
