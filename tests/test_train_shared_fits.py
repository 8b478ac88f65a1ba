"""What train.py shares or computes in fewer steps (issue 46's fixed cost) gives what the longer way gave
(SYNTHETIC data): prompt groups as integers sort as the prompts' names, the censoring by a running AND, the
transfer baseline fitted once per way, a gradient-boosting prediction on one thread."""

from __future__ import annotations

import numpy as np
import pandas as pd
from sklearn.model_selection import GroupKFold

from calib.bank import load, write_bank
from calib.calibrators.features import GradientBoostingAcceptance, LogisticAcceptance
from calib.calibrators.selection import group_sample
from calib.chains import chain
from calib.labels import censored, prompt_split
from calib.training import prompt_groups, transfer_check
from calib.training_transfer import transfer_checks, ways
from tests.synthetic import synthetic_tables


def _names(df: pd.DataFrame) -> np.ndarray:  # the groups as they were: one string per row
    return (df.category.astype(str) + "/" + df.prompt_idx.astype(str)).to_numpy()


def test_prompt_groups_sort_as_the_prompt_names_and_give_the_same_folds_and_samples():
    rng = np.random.default_rng(1)
    n = 20_000
    # "chat/10" sorts before "chat/9", "Z" before "a": an integer order would differ from the names'
    df = pd.DataFrame({"category": rng.choice(["chat", "code_edit", "Z", "a"], n), "prompt_idx": rng.integers(0, 400, n)})
    for frame in (df, df.assign(category=df.category.astype("category"))):
        ints, names = prompt_groups(frame), _names(frame)
        assert ints.dtype == np.int64
        assert np.array_equal(ints, np.unique(names, return_inverse=True)[1])
        for (_, a), (_, b) in zip(GroupKFold(5).split(ints, groups=ints), GroupKFold(5).split(names, groups=names),
                                  strict=True):
            assert np.array_equal(a, b)
        assert np.array_equal(group_sample(ints, 5000, seed=3), group_sample(names, 5000, seed=3))


def test_censoring_equals_the_cumulative_product_definition():
    rng = np.random.default_rng(2)
    acc = (rng.uniform(size=(5000, 7)) < 0.7).astype(np.float64)
    acc[rng.uniform(size=acc.shape) < 0.1] = np.nan  # not drafted (anywhere: the definition does not assume a prefix)
    accepted = np.nan_to_num(acc, nan=0.0) == 1
    prefix = np.concatenate([np.ones((len(acc), 1), bool), np.cumprod(accepted, axis=1)[:, :-1] == 1], axis=1)
    reached, label = censored(acc)
    assert np.array_equal(reached, ~np.isnan(acc) & prefix) and np.array_equal(label, accepted)
    assert censored(np.ones((3, 1)))[0].all() and censored(np.zeros((3, 0)))[0].shape == (3, 0)


def _ngram_samples(tmp_path):
    bank = load(write_bank(tmp_path / "b", *synthetic_tables(n_prompts=40, rounds_per_prompt=30, width=4, seed=5)))
    s = chain("ngram").samples(bank)
    s["split"] = prompt_split(s.category, s.prompt_idx)
    return s


def test_transfer_checks_fit_the_baseline_once_per_way_and_equal_whole_checks(tmp_path):
    kind, samples = chain("ngram"), _ngram_samples(tmp_path)
    transfer = {"fit_on": ["chat"], "eval_on": ["code_edit"],
                "baseline": {"_target_": "calib.calibrators.features.LogisticAcceptance", "features": ["match_n"]}}
    models = [LogisticAcceptance(features=("match_n", "agreement")), GradientBoostingAcceptance(max_iter=20)]
    asked = []

    def counting(*args, which, **kw):
        asked.append(which)
        return transfer_check(*args, which=which, **kw)

    got = transfer_checks(counting, kind, samples, {}, models, transfer)
    assert asked.count(("baseline",)) == 2 and asked.count(("model",)) == 4  # not 4 baseline fits: 2, one a way
    whole = [transfer_check(kind, samples, {}, m, transfer["baseline"], src, dst, context=True) for m in models
             for src, dst in ways(transfer)]
    assert got == whole and all(r["baseline"]["brier"] > 0 for r in got)


def test_transfer_checks_pass_on_a_side_without_rows_or_a_baseline_that_cannot_fit(tmp_path):
    kind, samples = chain("ngram"), _ngram_samples(tmp_path)
    empty = {"fit_on": ["chat"], "eval_on": ["no_such_category"],
             "baseline": {"_target_": "calib.calibrators.features.LogisticAcceptance", "features": ["match_n"]}}
    assert transfer_checks(transfer_check, kind, samples, {}, [LogisticAcceptance()], empty) == [None, None]
    bad = {**empty, "eval_on": ["code_edit"], "baseline": {"_target_": "calib.calibrators.features.LogisticAcceptance",
                                                          "C": -1.0}}  # refused by its parameter check
    got = transfer_checks(transfer_check, kind, samples, {}, [LogisticAcceptance(), LogisticAcceptance()], bad)
    assert len(got) == 4 and all(isinstance(r, ValueError) for r in got)


def test_gradient_boosting_predicts_the_same_on_one_thread_as_on_every_thread(monkeypatch):
    from calib.calibrators.features import models

    rng = np.random.default_rng(3)
    X = pd.DataFrame({"match_n": rng.integers(1, 6, 4000).astype(float), "agreement": rng.uniform(size=4000)})
    depth = rng.integers(0, 4, 4000)
    y = (rng.uniform(size=4000) < 0.2 + 0.1 * X.match_n).astype(int)
    m = GradientBoostingAcceptance(features=("match_n", "agreement"), max_iter=40).fit(X.assign(depth=depth), y)
    one = m.accept_proba(X.assign(depth=depth))
    monkeypatch.setattr(models, "PREDICT_THREADS", None)  # threadpoolctl: None leaves every thread
    assert np.array_equal(one, m.accept_proba(X.assign(depth=depth)))


def test_part_statistics_read_with_dictionary_keys_equal_those_of_a_part_that_needs_the_join(tmp_path):
    """A part whose speculator rows are not in acceptance's order is joined on the keys' values: the same
    samples, so the same counts (and sums up to their order), context read from the request's history."""
    import shutil
    from pathlib import Path

    import pyarrow.parquet as pq

    from calib.bank import schema
    from calib.training_stats import FLOAT_STATS, INT_STATS, StatsSpec, part_stats

    shipped = Path(__file__).resolve().parents[1] / "data/banks/eagle-chat_code-t0.8"
    part = tmp_path / "shuffled"
    shutil.copytree(shipped, part)
    spc = pq.read_table(part / schema.SPECULATOR)
    pq.write_table(spc.take(np.random.default_rng(0).permutation(spc.num_rows)), part / schema.SPECULATOR)
    spec = StatsSpec(depths=4, bins=1920, axes=("temperature", "prev_accept"), edges=((0.4,), (0.0, 1.0, 2.0, 4.0)),
                     validate=False)
    a, b = part_stats(shipped, spec), part_stats(part, spec)
    assert a["n"].sum() > 10_000
    for k in INT_STATS:
        assert np.array_equal(a[k], b[k]), k
    for k in FLOAT_STATS:
        assert np.allclose(a[k], b[k], rtol=1e-12, atol=1e-9), k


def test_mlp_batches_by_tensor_index_train_the_weights_the_samplers_trained(monkeypatch):
    """The MLP's batches (calib.calibrators.features.models.batch_loaders): the same rows in the same order
    as BatchSampler over RandomSampler / SequentialSampler, the same draws from torch's generator: the same
    weights, bit for bit."""
    import torch
    from torch.utils.data import BatchSampler, DataLoader, RandomSampler, SequentialSampler

    from calib.calibrators.features import MLPAcceptance, models

    def per_row(train, valset, batch_size, val_batch_size=65536):  # the samplers, as the MLP used them before
        return (DataLoader(train, sampler=BatchSampler(RandomSampler(train), batch_size, drop_last=False), batch_size=None),
                DataLoader(valset, sampler=BatchSampler(SequentialSampler(valset), val_batch_size, drop_last=False),
                           batch_size=None))

    rng = np.random.default_rng(4)
    X = pd.DataFrame({"match_n": rng.integers(1, 6, 3000).astype(float), "agreement": rng.uniform(size=3000)})
    X["depth"] = rng.integers(0, 3, 3000)
    y = (rng.uniform(size=3000) < 0.2 + 0.1 * X.match_n).astype(int)

    def fit():
        m = MLPAcceptance(features=("match_n", "agreement"), max_epochs=3, batch_size=256, progress=False)
        return m.fit(X, y)

    fast = fit()
    monkeypatch.setattr(models, "batch_loaders", per_row)
    slow = fit()
    assert fast.epochs_ == slow.epochs_ == 3
    for a, b in zip(fast.net_.state_dict().values(), slow.net_.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    assert len(list(models._IndexBatches(1000, 256, True))) == len(models._IndexBatches(1000, 256, True)) == 4


def test_the_mlp_predicts_on_one_thread_whatever_torch_s_own_thread_count(monkeypatch):
    """The MLP's prediction does depend on the thread count (float32 sums split differently: ~6e-8 on the
    shipped model bank), so it is pinned to PREDICT_THREADS: the same values whatever the process set."""
    from pathlib import Path

    import torch

    from calib.calibrators.base import with_depth
    from calib.calibrators.features import MLPAcceptance, models

    banks = Path(__file__).resolve().parents[1] / "data/banks"
    s = chain("model").samples(load([banks / "eagle-chat_code-t0", banks / "eagle-chat_code-t0.8"]))
    X, y = with_depth(s[["conf"]], s.depth.to_numpy()), s.label.to_numpy()
    m = MLPAcceptance(features=("conf",), max_epochs=3, progress=False).fit(X, y)
    before = torch.get_num_threads()
    try:
        got = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            got.append(m.accept_proba(X))
        assert np.array_equal(*got)
        monkeypatch.setattr(models, "PREDICT_THREADS", None)  # torch's own count: these shapes differ by it
        got = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            got.append(m.accept_proba(X))
        assert not np.array_equal(*got)
    finally:
        torch.set_num_threads(before)
