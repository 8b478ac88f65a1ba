"""A bank table's columns as numpy arrays: null masks, floats with nulls as NaN, and one id per row for the
bank keys (to find duplicates and partner rows across tables)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from calib.bank import schema


def null_mask(column: pa.ChunkedArray) -> np.ndarray:
    return column.is_null().to_numpy(zero_copy_only=False)


def valid_mask(column: pa.ChunkedArray) -> np.ndarray:
    return ~null_mask(column)


def floats(column: pa.ChunkedArray, nulls_as_nan: bool = True) -> np.ndarray:
    """A numeric column as float64 with nulls as NaN (genuine NaN values stay NaN too)."""
    arr = column.to_numpy(zero_copy_only=False)
    if arr.dtype == object:
        arr = np.array([np.nan if v is None else v for v in arr], dtype=np.float64)
    return arr.astype(np.float64)


def nan_not_null(table: pa.Table, cols: list[str]) -> np.ndarray:
    """True where a float column holds a genuine NaN (not a null): those count as present."""
    out = []
    for c in cols:
        v = table.column(c)
        out.append(valid_mask(v) & np.isnan(floats(v)))
    return np.stack(out, axis=1)


def key_ids(*tables: pa.Table) -> list[np.ndarray]:
    """One int64 id per row for the bank keys, comparable across ``tables`` (vectorised: a
    million-row bank is checked in seconds, not minutes)."""
    import pandas as pd

    sizes = [t.num_rows for t in tables]
    ids = np.zeros(sum(sizes), dtype=np.int64)
    for k in schema.KEYS:
        if pa.types.is_string(schema.KEY_TYPES[k]):  # strings are coded by Arrow, not as Python objects
            col = pa.chunked_array([c for t in tables for c in pc.cast(t.column(k), pa.string()).chunks],
                                   type=pa.string()).combine_chunks()
            enc = pc.dictionary_encode(col)
            codes, n_unique = enc.indices.to_numpy(zero_copy_only=False), len(enc.dictionary)
        else:
            values = np.concatenate([t.column(k).to_numpy(zero_copy_only=False) for t in tables])
            codes, uniques = pd.factorize(values, use_na_sentinel=False)
            n_unique = len(uniques)
        # Re-factorise the running id after each column so it never overflows.
        ids, _ = pd.factorize(ids * (n_unique + 1) + codes)
        ids = ids.astype(np.int64)
    return np.split(ids, np.cumsum(sizes)[:-1])


def duplicate_mask(table: pa.Table) -> np.ndarray:
    (ids,) = key_ids(table)
    _, first = np.unique(ids, return_index=True)
    dup = np.ones(len(ids), dtype=bool)
    dup[first] = False
    return dup


def partner_rows(table: pa.Table, acceptance: pa.Table) -> np.ndarray:
    """For each row of ``table``, the acceptance row with the same keys (verified to exist)."""
    import pandas as pd

    ids_t, ids_a = key_ids(table, acceptance)
    return pd.Index(ids_a).get_indexer(ids_t)


def row_keys(table: pa.Table, i: int) -> str:
    parts = []
    for k in ("category", "prompt_idx", "turn", "round_idx"):
        if k in table.column_names:
            parts.append(f"{k}={table.column(k)[i].as_py()}")
    return ", ".join(parts)
