"""The rounds' content: acceptance.parquet's acc columns against its accept counts, and speculator.parquet's
confidences and other per-depth and per-round columns against the drafted width."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from calib.bank import schema
from calib.bank.arrays import floats, nan_not_null, valid_mask
from calib.bank.checker import Checker


def prefix_mask(ck: Checker, file: str, table: pa.Table, acc: np.ndarray, accept: np.ndarray,
                acc_prefix: str = schema.ACC) -> np.ndarray:
    """Check an accept count against its acc mask; return the drafted width per row."""
    drafted = ~np.isnan(acc)
    width = drafted.sum(axis=1)
    depth = np.arange(acc.shape[1])
    # by depth, not by position: a missing middle column (acc1 of acc0, acc2) leaves a NaN depth in ``acc``
    present = {int(c[len(acc_prefix):]): c for c in schema.depth_columns(table.column_names, acc_prefix)}
    cols = [present.get(k, f"{acc_prefix}{k}") for k in depth]
    for k in depth:
        if k not in present:
            ck.add(file, cols[k], None, f"column missing: the {acc_prefix} columns must run {acc_prefix}0.."
                   f"{acc_prefix}{acc.shape[1] - 1} (a chain's drafted depths are a prefix)")
    # Values other than 0/1.
    bad_val = drafted & (acc != 0) & (acc != 1)
    for k in np.flatnonzero(bad_val.any(axis=0)):
        ck.first_bad(file, cols[k], bad_val[:, k], table, "acc value is not 0, 1 or null")
    # Drafted depths must be a prefix: no null followed by a non-null.
    gap = drafted & (np.cumsum(~drafted, axis=1) > 0)  # set after some shallower null
    for k in np.flatnonzero(gap.any(axis=0)):
        ck.first_bad(file, cols[k], gap[:, k], table,
                     "acc is set after a null depth (drafted depths must be a prefix)")
    ck.first_bad(file, "accept", accept < 0, table, "accept is negative")
    ck.first_bad(file, "accept", accept > width, table,
                 "accept exceeds the drafted width (non-null acc columns)")
    expect = (depth[None, :] < accept[:, None]).astype(float)
    wrong = drafted & ~bad_val & (acc != expect)
    for k in np.flatnonzero(wrong.any(axis=0)):
        ck.first_bad(file, cols[k], wrong[:, k], table,
                     "acc disagrees with accept (acc_k must be 1 iff k < accept, 0 at every "
                     "other drafted depth)")
    return width


def confidences(ck: Checker, file: str, table: pa.Table, width: np.ndarray):
    cols = schema.depth_columns(table.column_names, schema.CONF)
    if not cols:
        ck.add(file, "conf0", None, "missing column (no conf{k} columns)")
        return
    conf = np.stack([floats(table.column(c)) for c in cols], axis=1)
    present = ~np.isnan(conf) | nan_not_null(table, cols)
    for k, c in enumerate(cols):
        v = table.column(c)
        raw = floats(v, nulls_as_nan=False)
        valid = valid_mask(v)
        ck.first_bad(file, c, valid & np.isnan(raw), table, "NaN confidence (use null for 'none')")
        ck.first_bad(file, c, valid & np.isinf(raw), table, "infinite confidence")
        with np.errstate(invalid="ignore"):
            ck.first_bad(file, c, valid & ((raw < 0) | (raw > 1)), table,
                         "confidence outside [0, 1]")
    depth = np.arange(conf.shape[1])
    beyond = present & (depth[None, :] >= width[:, None])
    for k in np.flatnonzero(beyond.any(axis=0)):
        ck.first_bad(file, cols[k], beyond[:, k], table,
                     "confidence at a depth that was not drafted (acc is null there)")
    # A drafter either reports a confidence for every drafted token of a round or none.
    any_conf = present.any(axis=1)
    hole = any_conf[:, None] & ~present & (depth[None, :] < width[:, None])
    for k in np.flatnonzero(hole.any(axis=0)):
        ck.first_bad(file, cols[k], hole[:, k], table,
                     "null confidence at a drafted depth of a round that has confidences")


def extensions(ck: Checker, file: str, table: pa.Table, width: np.ndarray):
    rules = {"entropy": (0.0, np.inf), "margin": (0.0, 1.0), "tok": (0, np.inf)}
    for prefix, (lo, hi) in rules.items():
        for k, c in enumerate(schema.depth_columns(table.column_names, prefix)):
            v = floats(table.column(c))
            with np.errstate(invalid="ignore"):
                ck.first_bad(file, c, ~np.isnan(v) & ((v < lo) | (v > hi)) | np.isinf(v) & (hi != np.inf),
                             table, f"{prefix} outside [{lo}, {hi}]")
            ck.first_bad(file, c, ~np.isnan(v) & (k >= width), table,
                         f"{prefix} at a depth that was not drafted")
    if "batch_size" in table.column_names:
        bs = floats(table.column("batch_size"))
        ck.first_bad(file, "batch_size", bs < 1, table, "batch_size below 1")
    if "logit_transforms" in table.column_names:  # null: not recorded; else known names, comma-joined
        from calib.transforms import NAMES, decode

        vals = table.column("logit_transforms").to_pylist()
        bad = np.array([v is not None and any(n not in NAMES for n in decode(v)) for v in vals], dtype=bool)
        ck.first_bad(file, "logit_transforms", bad, table,
                     f"names other than {', '.join(NAMES)} (comma-joined; '' for none)")
    if "temperature" in table.column_names:  # null: not recorded; a value must be a temperature
        v = table.column("temperature")
        raw, valid = floats(v, nulls_as_nan=False), valid_mask(v)
        ck.first_bad(file, "temperature", valid & np.isnan(raw), table,
                     "NaN temperature (write null where it is not known)")
        ck.first_bad(file, "temperature", valid & np.isinf(raw), table, "infinite temperature")
        with np.errstate(invalid="ignore"):
            ck.first_bad(file, "temperature", valid & (raw < 0), table,
                         "negative temperature (a sampling temperature is >= 0; 0 is greedy)")
