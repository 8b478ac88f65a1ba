"""A SYNTHETIC chain kind, ``synthetic_suffix``, as one file: everything calib needs to know about it, from
collection to serving (the real suffix chain is calib/chains/suffix.py).

SYNTHETIC: its recomputation (:func:`propose`) drafts the tokens that followed the latest earlier occurrence of the
context's last token, scored by how recent that occurrence is; its bank file ``synthetic_suffix.parquet``
(:data:`LAYOUT`) holds per round the chain, ``suffix_score`` and its labels. Capture records it beside every round
and assembly labels it, like any recomputed kind; :func:`add_to_bank` instead writes a file whose score is the
round's accepted length plus noise (so that a table visibly rises with it). Registering :data:`SUFFIX`
(``calib.chains.register_chain``) takes it through capture, the bank writer and validator, training, export,
replay and serving (``tests/test_chains.py``); no other file names it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa

from calib.bank import schema
from calib.chains import Axis, ChainKind, RoundData

BANK_FILE = "synthetic_suffix.parquet"
PREFIX = "syn_"  # its columns in Bank.rounds(chains=...)
SCORE = "suffix_score"
EDGES = (0.25, 0.5, 0.75)
LAYOUT = schema.ChainFile(BANK_FILE, "synthetic_len", "synthetic_tok", {SCORE: (pa.float64(), 0.0, 1.0)})


def propose(context, settings: dict, prompt_len: int = 0, max_model_len: int | None = None):
    """SYNTHETIC ``(tokens, features)``: the ``k`` tokens after the latest earlier occurrence of the last token,
    scored 1 / (1 + how far back it is / 8); none without one."""
    context = np.asarray(context)
    if len(context) < 2:
        return [], None
    earlier = np.flatnonzero(context[:-1] == context[-1])
    if not len(earlier):
        return [], None
    at = int(earlier[-1]) + 1
    tokens = [int(t) for t in context[at: at + int(settings["k"])]]
    return tokens, {SCORE: 1.0 / (1.0 + (len(context) - at) / 8.0)}


def _own(table, width: int, prefix: str):
    """(accept mask [R, width] of the file's own labels, the score [R, width] over the chain's depths)."""
    length = np.nan_to_num(table.column(f"{prefix}synthetic_len").to_numpy(zero_copy_only=False).astype(np.float64))
    beyond = np.arange(width)[None, :] >= length[:, None]
    acc = schema.depth_matrix(table, f"{prefix}acc", width)
    src = np.asarray(table.column(f"{prefix}label_source").to_pylist(), dtype=object)
    acc[src == "none"] = np.nan
    score = np.repeat(table.column(f"{prefix}{SCORE}").to_numpy(zero_copy_only=False).astype(np.float64)[:, None],
                      width, axis=1)
    score[beyond] = np.nan
    return acc, score


def suffix_samples(bank):
    """Censored per-depth samples: one row per (labelled round, depth reached) with the round's score."""
    import pandas as pd

    from calib.labels import per_depth_samples

    if not bank.has(BANK_FILE):
        return pd.DataFrame()
    t = bank.table(BANK_FILE)
    acc, score = _own(t, schema.width(t.column_names, LAYOUT.token), "")
    return per_depth_samples(t, acc, {SCORE: score}, {})


def suffix_depth(bank_dir) -> int:
    """The drafted depth: the widest chain its bank file records (0: none)."""
    import pyarrow.parquet as pq

    path = Path(bank_dir) / BANK_FILE
    return schema.width(pq.read_schema(path).names, LAYOUT.token) if path.exists() else 0


def suffix_round_data(rounds, axis_names):
    """The chain over a bank's rounds: its own labels, and as table input its score over its depths."""
    if f"{PREFIX}{SCORE}" not in rounds.column_names:
        return None
    n = len(PREFIX)
    width = schema.width([c[n:] for c in rounds.column_names if c.startswith(PREFIX)], LAYOUT.token)
    acc, score = _own(rounds, width, PREFIX)
    return RoundData(acc) if axis_names is None else RoundData(acc, score[..., None].astype(np.float32))


def suffix_step_features(features, lengths, names, width: int):
    """float32 ``[B, width, 1]``: the score of each request's recomputed chain over its depths, NaN beyond."""
    import torch

    out = np.full((len(features), width, 1), np.nan, dtype=np.float32)
    for i, (f, n) in enumerate(zip(features, lengths)):
        if f is not None and n:
            out[i, : min(int(n), width), 0] = f[SCORE]
    return torch.from_numpy(out)


SUFFIX = ChainKind(
    id=9, name="synthetic_suffix", samples=suffix_samples, feature_names=lambda cfg: (SCORE,),
    table_axes=lambda cfg: (Axis(SCORE, edges=EDGES),), drafted_depth=suffix_depth, round_data=suffix_round_data,
    bank_file=BANK_FILE, column_prefix=PREFIX, bank=LAYOUT, propose=propose,
    settings=lambda given, k: {"k": int((given or {}).get("k", k))}, step_features=suffix_step_features,
    description="SYNTHETIC test chain: the continuation of the last token's latest earlier occurrence")


def add_to_bank(bank_dir, seed: int = 3) -> Path:
    """Write a SYNTHETIC synthetic_suffix.parquet into a bank folder: every round offers a chain as deep as the
    bank's drafts, labelled with the verified chain's mask and scored by its accepted length plus uniform noise
    (acceptance rises with the score)."""
    import pyarrow.parquet as pq

    acc = pq.read_table(Path(bank_dir) / schema.ACCEPTANCE)
    width = schema.width(acc.column_names)
    accept = acc.column("accept").to_numpy(zero_copy_only=False).astype(np.float64)
    mask = schema.depth_matrix(acc, schema.ACC, width)
    drafted = (~np.isnan(mask)).sum(axis=1)
    rng = np.random.default_rng(seed)
    score = np.clip(0.6 * accept / max(width, 1) + 0.4 * rng.uniform(size=acc.num_rows), 0, 1)
    cols = {**{k: acc.column(k) for k in schema.KEYS}, "synthetic_len": pa.array(drafted.astype(np.int64)),
            SCORE: pa.array(score), "accept": acc.column("accept"), "verified": pa.array(np.zeros(acc.num_rows, bool)),
            "label_source": pa.array(["counterfactual"] * acc.num_rows)}
    for j in range(width):
        cols[f"synthetic_tok{j}"] = pa.array([100 + j if j < d else None for d in drafted], pa.int64())
    for j in range(width):
        cols[f"acc{j}"] = acc.column(f"acc{j}")
    pq.write_table(pa.table(cols), Path(bank_dir) / BANK_FILE)
    return Path(bank_dir)
