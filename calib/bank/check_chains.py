"""Each chain kind's own bank file (:class:`calib.bank.schema.ChainFile`): its layout, as registered or as
run_manifest.json records it, and its rows against acceptance.parquet's."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from calib.bank import schema
from calib.bank.arrays import floats
from calib.bank.check_rounds import prefix_mask
from calib.bank.checker import Checker
from calib.bank.stats import acc_matrix


def chain_layouts(ck: Checker) -> list:
    """The registered chain file layouts, and those the bank's run_manifest.json records (``chain_files``:
    what write_bank wrote) for files no registered kind describes here."""
    specs = {s.file: s for s in schema.chain_files()}
    recorded = (ck.read_json(schema.MANIFEST) or {}).get("chain_files") or {}
    for file, d in recorded.items() if isinstance(recorded, dict) else ():
        if file in specs:
            continue
        try:
            specs[file] = schema.ChainFile.from_json(file, d)
        except (KeyError, TypeError, ValueError) as exc:
            ck.add(schema.MANIFEST, "chain_files", None, f"{file}: not a chain file layout ({exc!r})")
    return list(specs.values())


def chain_file(ck: Checker, spec: schema.ChainFile, table: pa.Table, acceptance: pa.Table):
    """A chain kind's own bank file against its registered layout (:class:`calib.bank.schema.ChainFile`)."""
    f, length = spec.file, spec.length
    if not ck.keys(f, table):
        return
    ck.columns(f, table, spec.round_columns())
    if any(c not in table.column_names for c in (length, "accept", "label_source")):
        return
    ck.partners(f, table, schema.ACCEPTANCE, acceptance)
    ck.partners(schema.ACCEPTANCE, acceptance, f, table)
    n = floats(table.column(length))
    ck.first_bad(f, length, np.isnan(n) | (n < 0), table, f"{length} is null or negative")
    n = np.nan_to_num(n).astype(np.int64)
    toks = schema.depth_columns(table.column_names, spec.token)
    if toks:
        present = np.stack([~np.isnan(floats(table.column(c))) for c in toks], axis=1)
        depth = np.arange(len(toks))
        ck.first_bad(f, length, n > len(toks), table, f"{length} exceeds the {len(toks)} "
                     f"{spec.token} columns")
        wrong = present != (depth[None, :] < n[:, None])
        for k in np.flatnonzero(wrong.any(axis=0)):
            ck.first_bad(f, toks[k], wrong[:, k], table,
                         f"{spec.token} must be set exactly on the first {length} depths")
        for prefix, (lo, hi) in spec.depth_features.items():
            for k, c in enumerate(schema.depth_columns(table.column_names, prefix)):
                v = floats(table.column(c))
                on = k < n
                ck.first_bad(f, c, on & np.isnan(v), table, f"{prefix} is null at a depth of the chain")
                ck.first_bad(f, c, ~on & ~np.isnan(v), table, f"{prefix} is set beyond {length}")
                with np.errstate(invalid="ignore"):
                    ck.first_bad(f, c, (v < lo) | (v > hi) | np.isinf(v), table, f"{prefix} outside [{lo}, {hi}]")
    else:
        ck.first_bad(f, length, n > 0, table, f"{length} is above 0 but the file has no "
                     f"{spec.token} columns (the chain's tokens)")
    src = np.asarray(table.column("label_source").to_pylist(), dtype=object)
    ck.first_bad(f, "label_source", ~np.isin(src, schema.LABEL_SOURCES), table,
                 f"label_source not one of {schema.LABEL_SOURCES}")
    accept_raw = floats(table.column("accept"))
    labelled = src != "none"
    ck.first_bad(f, "accept", labelled & np.isnan(accept_raw), table,
                 "accept is null on a labelled chain")
    ck.first_bad(f, "accept", ~labelled & ~np.isnan(accept_raw), table,
                 "accept is set but label_source is 'none'")
    if "verified" in table.column_names:
        ver = np.asarray(table.column("verified").to_pylist(), dtype=object) == True
        ck.first_bad(f, "verified", ver & (src != "verified"), table,
                     "verified chain must have label_source 'verified'")
    acc = acc_matrix(table)
    if acc.shape[1]:
        width = prefix_mask(ck, f, table, np.where(labelled[:, None], acc, np.nan),
                            np.where(labelled, np.nan_to_num(accept_raw), 0).astype(np.int64))
        ck.first_bad(f, length, labelled & (width > n), table, f"acc is set beyond {length}")
        ck.first_bad(f, "acc0", ~labelled & ~np.isnan(acc).all(axis=1), table,
                     "acc is set but label_source is 'none'")
    for name, (typ, lo, hi) in spec.features.items():
        if name not in table.column_names or pa.types.is_boolean(typ):
            continue
        v = floats(table.column(name))
        ck.first_bad(f, name, (n > 0) & np.isnan(v), table, "feature is null on a non-empty chain")
        with np.errstate(invalid="ignore"):
            ck.first_bad(f, name, (v < lo) | (v > hi) | np.isinf(v), table, f"feature outside [{lo:g}, {hi}]")
