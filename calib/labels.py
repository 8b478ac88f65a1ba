"""Censored per-depth samples from banks, and splits by prompt.

Depth k of a round yields a sample only if the round reached it — every shallower drafted token
was accepted: label 1 if the token at k was accepted, else 0; deeper depths are censored (no
sample). The conditional probability P(accept at k | reached k) is what calibrators estimate and
what the allocator multiplies into survival curves.

Splits are by prompt, never by row: a prompt's rounds all land in one split, and the assignment
depends only on (category, prompt_idx) and a seed, so banks collected on the same prompt set (e.g.
an n-gram and a model-based run) share their test prompts.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa

from calib.bank import Bank, schema

GROUP_KEYS = ("model", "speculator", "config", "category")


def censored(acc: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(reached, label) masks [N, D] from an acc matrix (1/0, NaN where not drafted)."""
    drafted = ~np.isnan(acc)
    accepted = np.nan_to_num(acc, nan=0.0) == 1
    # reached k  <=>  drafted at k and accepted at every j < k
    prefix_ok = np.concatenate([np.ones((acc.shape[0], 1), bool), np.cumprod(accepted, axis=1)[:, :-1] == 1],
                               axis=1)
    return drafted & prefix_ok, accepted


def per_depth_samples(table: pa.Table, acc: np.ndarray, per_depth: dict[str, np.ndarray],
                      round_cols: dict[str, np.ndarray]) -> pd.DataFrame:
    """Censored samples of one chain: one row per (round of ``table``, depth reached by ``acc`` [N, D])
    with the bank keys, ``depth``, each ``per_depth`` matrix [N, D] read at that depth, each
    ``round_cols`` array [N], and ``label``. A chain kind's sample extraction (:mod:`calib.chains`)
    gathers its columns and calls this."""
    reached, label = censored(acc)
    rows, depth = np.nonzero(reached)
    out = {k: np.asarray(table.column(k).to_pylist(), dtype=object)[rows] if k in GROUP_KEYS
           else table.column(k).to_numpy(zero_copy_only=False)[rows]
           for k in (*GROUP_KEYS, "prompt_idx", "round_idx")}
    out["depth"] = depth.astype(np.int64)
    for name, mat in per_depth.items():
        out[name] = mat[rows, depth]
    for name, vals in round_cols.items():
        out[name] = vals[rows]
    out["label"] = label[rows, depth].astype(np.int8)
    df = pd.DataFrame(out)
    for k in GROUP_KEYS:
        df[k] = df[k].astype("category")
    return df


def model_samples(bank: Bank) -> pd.DataFrame:
    """One row per (round, depth reached): keys, depth, conf (+ entropy/margin/temperature if
    present), label. Rounds without confidences (an n-gram drafter) yield nothing."""
    t = bank.rounds()
    width = schema.width(t.column_names)
    conf = schema.depth_matrix(t, schema.CONF, width)
    has_conf = ~np.isnan(conf).all(axis=1)
    t = t.filter(pa.array(has_conf))
    acc = schema.depth_matrix(t, schema.ACC, width)
    per_depth = {"conf": conf[has_conf]}
    for extra in ("entropy", "margin"):
        if f"{extra}0" in t.column_names:
            per_depth[extra] = schema.depth_matrix(t, extra, width)
    rounds = {}
    if "temperature" in t.column_names:
        rounds["temperature"] = t.column("temperature").to_numpy(zero_copy_only=False).astype(float)
    return per_depth_samples(t, acc, per_depth, rounds)


NGRAM_SAMPLE_FEATURES = tuple(schema.NGRAM_FEATURES)


def ngram_samples(bank: Bank) -> pd.DataFrame:
    """One row per (labelled n-gram chain, depth reached): keys, depth, match features, label.
    A bank without ngram.parquet yields nothing."""
    if not bank.has(schema.NGRAM):
        return pd.DataFrame()
    t = bank.table(schema.NGRAM)
    src = np.asarray(t.column("label_source").to_pylist(), dtype=object)
    t = t.filter(pa.array(src != "none"))
    width = schema.width(t.column_names, schema.NGRAM_TOK)
    acc = schema.depth_matrix(t, schema.ACC, width)
    rounds = {f: t.column(f).to_numpy(zero_copy_only=False).astype(np.float64) for f in NGRAM_SAMPLE_FEATURES}
    rounds["counterfactual"] = np.asarray(t.column("label_source").to_pylist(), dtype=object) == "counterfactual"
    if "temperature" in t.column_names:
        rounds["temperature"] = t.column("temperature").to_numpy(zero_copy_only=False).astype(float)
    return per_depth_samples(t, acc, {}, rounds)


def model_drafted_depth(bank_dir) -> int:
    """Drafted depth K of the model chain in one bank folder: the widest conf columns holding data."""
    import pyarrow.parquet as pq

    spec = Path(bank_dir) / schema.SPECULATOR
    w = schema.width(pq.read_schema(spec).names, schema.CONF)
    if not w:
        return 0
    conf0 = pq.read_table(spec, columns=[schema.col(schema.CONF, 0)]).column(0)
    return w if conf0.null_count < len(conf0) else 0


def ngram_drafted_depth(bank_dir) -> int:
    """Drafted depth K of the n-gram chain in one bank folder: the widest chain (ngram_tok columns)."""
    import pyarrow.parquet as pq

    ng = Path(bank_dir) / schema.NGRAM
    return schema.width(pq.read_schema(ng).names, schema.NGRAM_TOK) if ng.exists() else 0


def model_round_data(rounds: pa.Table, axis_names=None):
    """The model chain over a bank's rounds (:class:`calib.chains.RoundData`; None for a bank without
    confidences): the verified accept mask, raw confidences, and as table input the confidence."""
    from calib.chains import RoundData

    width = schema.width(rounds.column_names)
    conf = schema.depth_matrix(rounds, schema.CONF, width)
    if not (~np.isnan(conf)).any():
        return None
    inputs = None if axis_names is None else conf.astype(np.float32)[..., None]
    return RoundData(schema.depth_matrix(rounds, schema.ACC, width), inputs, conf)


def prompt_split(category, prompt_idx, fractions=(0.7, 0.15, 0.15), seed: int = 0) -> np.ndarray:
    """'train' / 'val' / 'test' per row, a deterministic function of (category, prompt_idx, seed)."""
    cats = np.asarray(category, dtype=object)
    idx = np.asarray(prompt_idx)
    pairs = pd.Series(list(zip(cats.tolist(), idx.tolist())))
    uniq = pairs.unique()
    u = np.array([int(hashlib.sha256(f"{seed}/{c}/{i}".encode()).hexdigest()[:12], 16) / 16**12
                  for c, i in uniq])
    edges = np.cumsum(fractions) / np.sum(fractions)
    names = np.array(["train", "val", "test"])[np.searchsorted(edges, u, side="right").clip(0, 2)]
    lookup = dict(zip(uniq, names))
    return pairs.map(lookup).to_numpy()
