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
    accepted = acc == 1  # NaN (not drafted) compares unequal: not accepted
    # reached k  <=>  drafted at k and accepted at every j < k (a running AND over the booleans: no int64
    # cumulative product, ~30x less work on a 1M-round part)
    prefix_ok = np.ones(acc.shape, bool)
    if acc.shape[1] > 1:
        np.logical_and.accumulate(accepted[:, :-1], axis=1, out=prefix_ok[:, 1:])
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


CONTEXT_COLUMNS = ("temperature", "prev_accept", "mean_accept", "position")  # calib.chains.CONTEXT, computed here
HISTORY_COLUMNS = ("prev_accept", "mean_accept", "position")  # read from the request's earlier rounds


def round_context(rounds: pa.Table, names=CONTEXT_COLUMNS) -> dict[str, np.ndarray]:
    """Context per round of a bank's ``rounds`` (acceptance ⋈ speculator, sorted by the bank keys, as
    :meth:`Bank.rounds` returns them): ``temperature`` (NaN where not recorded) and what the request's
    earlier rounds say (:func:`request_history`: ``prev_accept``, ``mean_accept``, ``position``), i.e.
    what an engine knows when it drafts. float64 [R] each."""
    out = {}
    n = rounds.num_rows
    history = [h for h in HISTORY_COLUMNS if h in names]
    if history:  # one sort of the request's rounds for every column read from its earlier rounds
        out.update(request_history(rounds, history))
    for name in names:
        if name in out:
            continue
        if name == "temperature":
            out[name] = (rounds.column("temperature").to_numpy(zero_copy_only=False).astype(np.float64)
                         if "temperature" in rounds.column_names else np.full(n, np.nan))
        else:
            raise KeyError(f"no context column {name!r}; known: {CONTEXT_COLUMNS}")
    return out


def request_history(rounds: pa.Table, names) -> dict[str, np.ndarray]:
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


def with_round_context(t: pa.Table, bank: Bank) -> pa.Table:
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
