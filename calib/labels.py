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
           for k in (*GROUP_KEYS, "prompt_idx", "turn", "round_idx") if k in table.column_names}
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
    """One row per (round, depth reached): keys, depth, conf (+ entropy/margin if present), the context
    columns (:func:`round_context`), label. Rounds without confidences (an n-gram drafter) yield nothing."""
    t = bank.rounds()
    width = schema.width(t.column_names)
    conf = schema.depth_matrix(t, schema.CONF, width)
    has_conf = ~np.isnan(conf).all(axis=1)
    context = {n: v[has_conf] for n, v in round_context(t).items()}  # before the filter: every round counts
    t = t.filter(pa.array(has_conf))
    acc = schema.depth_matrix(t, schema.ACC, width)
    per_depth = {"conf": conf[has_conf]}
    for extra in ("entropy", "margin"):
        if f"{extra}0" in t.column_names:
            per_depth[extra] = schema.depth_matrix(t, extra, width)
    return per_depth_samples(t, acc, per_depth, context)


NGRAM_SAMPLE_FEATURES = tuple(schema.NGRAM_FEATURES)


def ngram_samples(bank: Bank) -> pd.DataFrame:
    """One row per (labelled n-gram chain, depth reached): keys, depth, match features, the context
    columns (:func:`round_context` of the verified rounds), label.
    A bank without ngram.parquet yields nothing."""
    if not bank.has(schema.NGRAM):
        return pd.DataFrame()
    t = _with_context(bank.table(schema.NGRAM), bank)
    src = np.asarray(t.column("label_source").to_pylist(), dtype=object)
    t = t.filter(pa.array(src != "none"))
    width = schema.width(t.column_names, schema.NGRAM_TOK)
    acc = schema.depth_matrix(t, schema.ACC, width)
    rounds = {f: t.column(f).to_numpy(zero_copy_only=False).astype(np.float64) for f in NGRAM_SAMPLE_FEATURES}
    rounds["counterfactual"] = np.asarray(t.column("label_source").to_pylist(), dtype=object) == "counterfactual"
    rounds.update({n: t.column(f"ctx_{n}").to_numpy(zero_copy_only=False).astype(np.float64) for n in CONTEXT_COLUMNS})
    return per_depth_samples(t, acc, {}, rounds)


CONTEXT_COLUMNS = ("temperature", "prev_accept", "mean_accept", "position")  # calib.chains.CONTEXT, computed here
HISTORY_COLUMNS = ("prev_accept", "mean_accept", "position")  # read from the request's earlier rounds


def round_context(rounds: pa.Table, names=CONTEXT_COLUMNS) -> dict[str, np.ndarray]:
    """Context per round of a bank's ``rounds`` (acceptance ⋈ speculator, sorted by the bank keys, as
    :meth:`Bank.rounds` returns them): ``temperature`` (NaN where not recorded) and what the request's
    earlier rounds say (:func:`_request_history`: ``prev_accept``, ``mean_accept``, ``position``), i.e.
    what an engine knows when it drafts. float64 [R] each."""
    out = {}
    n = rounds.num_rows
    history = [h for h in HISTORY_COLUMNS if h in names]
    if history:  # one sort of the request's rounds for every column read from its earlier rounds
        out.update(_request_history(rounds, history))
    for name in names:
        if name in out:
            continue
        if name == "temperature":
            out[name] = (rounds.column("temperature").to_numpy(zero_copy_only=False).astype(np.float64)
                         if "temperature" in rounds.column_names else np.full(n, np.nan))
        else:
            raise KeyError(f"no context column {name!r}; known: {CONTEXT_COLUMNS}")
    return out


def _request_history(rounds: pa.Table, names) -> dict[str, np.ndarray]:
    """Per round, from the same request's earlier rounds (rounds of one (model, speculator, config,
    category, prompt_idx, turn) ordered by round_idx): ``prev_accept`` (the previous round's accepted
    length), ``mean_accept`` (their mean), NaN in a request's first round; ``position`` (the tokens
    they emitted, accepted + 1 each: the request's output length in this turn so far), 0 in its first."""
    keys = [k for k in schema.KEYS if k != "round_idx"]
    df = pd.DataFrame({k: rounds.column(k).to_numpy(zero_copy_only=False) for k in (*keys, "round_idx")})
    df["accept"] = rounds.column("accept").to_numpy(zero_copy_only=False).astype(np.float64)
    order = df.sort_values([*keys, "round_idx"], kind="stable").index.to_numpy()
    s = df.iloc[order]
    g = s.groupby(keys, sort=False, observed=True)["accept"]
    found = {}
    if "mean_accept" in names or "position" in names:
        earlier = (g.cumsum() - s["accept"]).to_numpy()  # accepted over the earlier rounds
        n = g.cumcount().to_numpy().astype(np.float64)
        if "mean_accept" in names:
            with np.errstate(invalid="ignore", divide="ignore"):
                found["mean_accept"] = np.where(n > 0, earlier / np.maximum(n, 1), np.nan)
        if "position" in names:
            found["position"] = earlier + n
    if "prev_accept" in names:
        found["prev_accept"] = g.shift(1).to_numpy()
    outs = {}
    for k, v in found.items():
        outs[k] = np.empty(len(df))
        outs[k][order] = v
    return outs


def _with_context(t: pa.Table, bank: Bank) -> pa.Table:
    """``t`` (rows keyed by the bank keys) with ``ctx_<name>`` columns of :func:`round_context`, read from
    the bank's verified rounds (NaN where a key has no such round)."""
    r = bank.rounds(columns=["accept", *(["temperature"] if _has_temperature(bank) else [])])
    ctx = round_context(r)
    keys = list(schema.KEYS)
    side = pa.table({**{k: r.column(k) for k in keys}, **{f"ctx_{n}": pa.array(v) for n, v in ctx.items()}})
    return t.join(side, keys=keys, join_type="left outer").sort_by([(k, "ascending") for k in keys])


def _has_temperature(bank: Bank) -> bool:
    import pyarrow.parquet as pq

    return all("temperature" in pq.read_schema(Path(p) / schema.SPECULATOR).names for p in bank.paths)


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
