"""The n-gram feature layout an engine passes to the tables: ``[R, L, F]`` float32.

F features in the order of ``tables.feature_names("ngram")`` (names of ngram.parquet round columns,
see :data:`calib.bank.schema.NGRAM_FEATURES`); depth = column of L; feature 0 NaN = no token.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import torch

from calib.bank import schema

NGRAM_FEATURE_ORDER = tuple(schema.NGRAM_FEATURES)


def ngram_feature_tensor(table: pa.Table, names, width: int, prefix: str = "") -> torch.Tensor:
    """n-gram features ``[R, L, F]`` (float32) in the order ``names`` from ngram.parquet round columns.

    The chain's features are per round, so they are repeated across depths ``j < ngram_len``;
    every feature is NaN at depths beyond the chain (feature 0 NaN = "no token", as the tables read
    it). ``in_prompt`` becomes 0/1. ``prefix`` is ``"ng_"`` for ``Bank.rounds(with_ngram=True)``.
    """
    n = table.num_rows
    length = np.nan_to_num(table.column(f"{prefix}ngram_len").to_numpy(zero_copy_only=False).astype(np.float64))
    feats = np.empty((n, len(names)), dtype=np.float64)
    for f, name in enumerate(names):
        if name not in NGRAM_FEATURE_ORDER:
            raise KeyError(f"unknown n-gram feature {name!r}; known: {NGRAM_FEATURE_ORDER}")
        col = table.column(f"{prefix}{name}")
        if pa.types.is_boolean(col.type):
            col = col.cast(pa.int8())
        feats[:, f] = col.to_numpy(zero_copy_only=False).astype(np.float64)
    out = np.repeat(feats[:, None, :], width, axis=1)
    beyond = np.arange(width)[None, :] >= length[:, None]
    out[beyond] = np.nan
    return torch.from_numpy(out.astype(np.float32))


def ngram_round_data(rounds: pa.Table, axis_names=None):
    """The n-gram chain over a bank's rounds joined with ngram.parquet (``Bank.rounds(with_ngram=True)``,
    columns ``ng_*``); None without it. Unlabelled chains (label_source none) are NaN in the mask."""
    from calib.chains import RoundData

    if "ng_ngram_len" not in rounds.column_names:
        return None
    width = schema.width([c[3:] for c in rounds.column_names if c.startswith("ng_")], schema.NGRAM_TOK)
    acc = schema.depth_matrix(rounds, "ng_acc", width)
    src = np.asarray(rounds.column("ng_label_source").to_pylist(), dtype=object)
    acc[src == "none"] = np.nan  # an unlabelled chain cannot be scored or verified in replay
    inputs = None if axis_names is None else ngram_feature_tensor(rounds, axis_names, width, prefix="ng_").numpy()
    return RoundData(acc, inputs)
