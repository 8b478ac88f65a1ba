"""Censoring and splits by prompt (SYNTHETIC banks)."""

import numpy as np

from calib.bank import load, write_bank
from calib.chains.model import model_samples
from calib.chains.ngram import ngram_samples
from calib.labels import censored, prompt_split
from tests.synthetic import synthetic_tables


def test_censoring_by_hand():
    nan = np.nan
    acc = np.array([[1, 1, 0, 0], [0, 0, nan, nan], [1, 1, 1, 1], [1, nan, nan, nan]])
    reached, label = censored(acc)
    assert reached.tolist() == [[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]]
    assert label[reached].tolist() == [1, 1, 0, 0, 1, 1, 1, 1, 1]


def test_samples_from_bank(tmp_path):
    b = write_bank(tmp_path / "b", *synthetic_tables(n_prompts=6, rounds_per_prompt=8))
    bank = load(b)
    ms = model_samples(bank)
    acc = bank.table("acceptance.parquet")
    accept = np.array(acc.column("accept").to_pylist())
    drafted = np.array([sum(acc.column(f"acc{k}")[i].as_py() is not None for k in range(4)) for i in range(acc.num_rows)])
    assert len(ms) == int(np.minimum(accept + 1, drafted).sum())  # reached depths per round
    assert ms.label.sum() == accept.sum()
    ns = ngram_samples(bank)
    assert set(ns.columns) >= {"match_n", "agreement", "depth", "label"}


def test_split_is_by_prompt_and_deterministic():
    cats = np.array(["chat"] * 500 + ["code_edit"] * 500)
    idx = np.concatenate([np.arange(500) // 5, np.arange(500) // 5])  # 5 rows per prompt
    s1 = prompt_split(cats, idx, seed=3)
    assert (s1 == prompt_split(cats, idx, seed=3)).all()
    for c in ("chat", "code_edit"):
        for p in range(100):
            m = (cats == c) & (idx == p)
            assert len(set(s1[m])) == 1
    frac = {s: np.mean(s1 == s) for s in ("train", "val", "test")}
    assert 0.55 < frac["train"] < 0.85 and frac["test"] > 0.05
    assert (s1 != prompt_split(cats, idx, seed=4)).any()
