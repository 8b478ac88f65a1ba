"""A MoE bank's expert routing: routing.npy (expert ids per position and layer) and routing_meta.parquet
(which round and position each of its rows is), against the manifest and acceptance.parquet."""

from __future__ import annotations

import os

import numpy as np
import pyarrow as pa

from calib.bank import schema
from calib.bank.arrays import floats, null_mask, partner_rows
from calib.bank.checker import Checker


def routing(ck: Checker, acceptance: pa.Table, width: np.ndarray):
    has_npy = os.path.exists(os.path.join(ck.dir, schema.ROUTING))
    meta = ck.read(schema.ROUTING_META, required=has_npy)
    if not has_npy:
        if meta is not None:
            ck.add(schema.ROUTING, None, None, "missing file (routing_meta.parquet is present)")
        return
    try:
        arr = np.load(os.path.join(ck.dir, schema.ROUTING), mmap_mode="r", allow_pickle=False)
    except Exception as exc:  # noqa: BLE001
        ck.add(schema.ROUTING, None, None, f"not a readable .npy array: {exc}")
        return
    if arr.dtype != np.uint8 or arr.ndim != 3:
        ck.add(schema.ROUTING, None, None,
               f"expected uint8 [N, layers, top_k], found {arr.dtype} with shape {arr.shape}")
        return
    _routing_array(ck, arr)
    if meta is None:
        return
    f = schema.ROUTING_META
    if not ck.columns(f, meta, {**schema.KEY_TYPES, **schema.ROUTING_META_COLUMNS}):
        return
    before = len(ck.problems)  # the meta checks below need sound columns, not a sound array
    for name in schema.ROUTING_META_COLUMNS:
        ck.first_bad(f, name, null_mask(meta.column(name)), meta, "null value")
    if len(ck.problems) > before:
        return
    idx = floats(meta.column("routing_idx"))
    ck.first_bad(f, "routing_idx", (idx < 0) | (idx >= arr.shape[0]), meta,
                 f"routing_idx outside [0, {arr.shape[0]})")
    _, first = np.unique(idx, return_index=True)
    dup = np.ones(len(idx), dtype=bool)
    dup[first] = False
    ck.first_bad(f, "routing_idx", dup, meta, "duplicate routing_idx")
    if meta.num_rows != arr.shape[0]:
        ck.add(f, "routing_idx", None, f"{meta.num_rows} rows describe the {arr.shape[0]} rows of "
               f"{schema.ROUTING} (every routing row needs exactly one meta row)")
    for name in ("routing_block_idx", "request_idx", "position"):
        ck.first_bad(f, name, floats(meta.column(name)) < 0, meta, f"{name} is negative")
    ck.partners(f, meta, schema.ACCEPTANCE, acceptance)
    if len(ck.problems) > before:
        return
    _routing_blocks(ck, meta, acceptance, width)


def _routing_array(ck: Checker, arr: np.ndarray):
    """Expert ids: distinct within a (position, layer), below the manifest's n_experts."""
    info = (ck.read_json(schema.MANIFEST) or {}).get("routing")
    info = info if isinstance(info, dict) else {}
    f = schema.ROUTING
    for name, axis in (("layers", 1), ("top_k", 2)):
        if isinstance(info.get(name), int) and info[name] != arr.shape[axis]:
            ck.add(schema.MANIFEST, f"routing.{name}", None,
                   f"says {info[name]}, {f} has {arr.shape[axis]} (shape {arr.shape})")
    if arr.shape[0] == 0 or arr.shape[2] == 0:
        return
    for lo in range(0, arr.shape[0], 1 << 16):  # chunks: a large capture stays memory-mapped
        chunk = np.sort(np.asarray(arr[lo: lo + (1 << 16)]), axis=2)
        rep = (np.diff(chunk, axis=2) == 0).any(axis=2)
        if rep.any():
            i, layer = np.argwhere(rep)[0]
            ck.add(f, f"layer {layer}", int(lo + i), "the same expert id appears twice among the top_k")
            break
        n_exp = info.get("n_experts")
        if isinstance(n_exp, int) and (chunk[..., -1] >= n_exp).any():
            i, layer = np.argwhere(chunk[..., -1] >= n_exp)[0]
            ck.add(f, f"layer {layer}", int(lo + i),
                   f"expert id {int(chunk[i, layer, -1])} >= n_experts {n_exp} (run_manifest.json)")
            break


def _routing_blocks(ck: Checker, meta: pa.Table, acceptance: pa.Table, width: np.ndarray):
    """Per round: one request, distinct block indices within the verified width, consecutive
    positions, and an ``accepted`` prefix that agrees with the round's accept count."""
    import pandas as pd

    f = schema.ROUTING_META
    rows = partner_rows(meta, acceptance)
    accept = acceptance.column("accept").to_numpy(zero_copy_only=False).astype(np.int64)
    df = pd.DataFrame({
        "round": rows,
        "block": meta.column("routing_block_idx").to_numpy(zero_copy_only=False).astype(np.int64),
        "request": meta.column("request_idx").to_numpy(zero_copy_only=False).astype(np.int64),
        "position": meta.column("position").to_numpy(zero_copy_only=False).astype(np.int64),
        "accepted": meta.column("accepted").to_numpy(zero_copy_only=False).astype(bool),
    })
    block = df["block"].to_numpy()
    ck.first_bad(f, "routing_block_idx", block > width[rows], meta,
                 "routing_block_idx beyond the round's drafted width (block = 1 + drafted positions)")
    dup = df.duplicated(["round", "block"]).to_numpy()
    ck.first_bad(f, "routing_block_idx", dup, meta, "duplicate routing_block_idx within a round")
    g = df.groupby("round")
    ck.first_bad(f, "request_idx", (g["request"].transform("nunique") > 1).to_numpy(), meta,
                 "a round's rows name more than one request_idx")
    start = df["position"] - df["block"]
    ck.first_bad(f, "position", (start.groupby(df["round"]).transform("nunique") > 1).to_numpy(), meta,
                 "positions of a round are not block start + routing_block_idx")
    # accepted must be a prefix in block order: no accepted row after a rejected one.
    order = df.sort_values(["round", "block"])
    rejected_before = (~order["accepted"]).astype(int).groupby(order["round"]).cumsum() - (~order["accepted"])
    gap = pd.Series(order["accepted"].to_numpy() & (rejected_before.to_numpy() > 0), index=order.index)
    ck.first_bad(f, "accepted", gap.sort_index().to_numpy(), meta,
                 "accepted after a rejected position of the same round (must be a prefix)")
    n_acc = g["accepted"].transform("sum").to_numpy()
    want = accept[rows]
    ck.first_bad(f, "accepted", (n_acc != want) & (n_acc != want + 1), meta,
                 "the round's accepted positions disagree with acceptance.parquet's accept "
                 "(expected accept or accept + 1)")
