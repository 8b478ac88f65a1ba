"""Banks from a fleet: several engine replicas' banks (each its own parquet parts and manifest), listed
together and validated as one, in bounded memory.

A *fleet* is a folder holding bank folders (one per replica, or one per slice of a replica's traffic);
``data.train`` may name fleets, banks, or both. :func:`bank_parts` lists every part once (a part listed
twice, through a symlink or as a byte copy is dropped with a warning, :func:`calib.bank.io.unique_banks`);
:func:`check_fleet` refuses a fleet whose replicas disagree on what they measured (the target and
drafter fingerprints, method and K of ``run_manifest.json``'s ``identity``, the model / speculator /
config keys, the drafted width), naming both parts and both values; :func:`check_disjoint_parts`
refuses parts sharing a round key, reading the key columns part by part (``pyarrow.dataset``) and
keeping one row per request (not per round), so a hundred million rounds are checked in a few hundred MB.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pyarrow.parquet as pq

from calib.bank import schema
from calib.bank.io import OverlappingBanksError, find_banks, is_bank
from calib.sidefiles import read_json

REQUEST_KEYS = tuple(k for k in schema.KEYS if k != "round_idx")  # one request's rounds share these
# What every replica of one fleet must share (run_manifest.json): what was measured, and how.
FLEET_FIELDS = ("model", "speculator", "config", "method", "num_speculative_tokens", "identity")


class FleetError(ValueError):
    """A fleet's replicas disagree on what they measured (named: both parts, the field, both values)."""


def fleets(paths: str | os.PathLike | Iterable[str | os.PathLike]) -> list[list[Path]]:
    """The parts each entry of ``paths`` names, one list per entry: a bank folder is a fleet of one, a
    folder holding bank folders a fleet of them (sorted)."""
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    out = []
    for p in map(Path, paths):
        if is_bank(p):
            out.append([p])
        else:
            out.append(find_banks([p], dedupe=False))
    return out


def bank_parts(paths, check: bool = True) -> list[Path]:
    """Every part named by ``paths`` (banks and fleets), each counted once; with ``check``, each fleet
    validated as one (:func:`check_fleet`) and all parts' round keys disjoint (:func:`check_disjoint_parts`)."""
    groups = fleets(paths)
    if check:
        for g in groups:
            check_fleet(g)
    parts = find_banks([p for g in groups for p in g])  # dedupe across entries (path, then content)
    if check:
        check_disjoint_parts(parts)
    return parts


def part_rounds(part: Path) -> int:
    """Rounds of one part, from its parquet footer (nothing else is read)."""
    return pq.read_metadata(Path(part) / schema.ACCEPTANCE).num_rows


def _manifest_fields(part: Path) -> dict:
    man = read_json(part / schema.MANIFEST, missing_ok=True,
                    hint="fix or delete run_manifest.json, or recollect the bank") or {}
    out = {k: man.get(k) for k in FLEET_FIELDS}
    out["width"] = schema.width(pq.read_schema(part / schema.ACCEPTANCE).names)
    return out


def check_fleet(parts: list[Path]) -> None:
    """Refuse (:class:`FleetError`) replicas of one fleet that disagree on a :data:`FLEET_FIELDS` field of
    their manifests or on the drafted width K of acceptance.parquet: the first part is the reference,
    the message names it, the other part, the field and both values."""
    if len(parts) < 2:
        return
    ref = _manifest_fields(parts[0])
    for p in parts[1:]:
        mine = _manifest_fields(p)
        for field in (*FLEET_FIELDS, "width"):
            if mine[field] != ref[field]:
                what = "drafted width K (acc columns)" if field == "width" else f"run_manifest.json {field!r}"
                raise FleetError(f"fleet parts {parts[0]} and {p} differ in {what}: {ref[field]!r} vs "
                                 f"{mine[field]!r}; replicas of one fleet must measure the same target, drafter "
                                 "and K (list the others as their own banks or fleets)")


def _requests(part: Path) -> pa.Table:
    """One row per request of ``part``: its :data:`REQUEST_KEYS`, first and last round_idx and rounds."""
    dset = ds.dataset(part / schema.ACCEPTANCE, format="parquet")
    missing = [k for k in schema.KEYS if k not in dset.schema.names]
    if missing:
        raise ValueError(f"{part / schema.ACCEPTANCE}: missing key column(s) {missing}; validate the bank "
                         f"(python -m calib.bank validate {part})")
    pieces = []
    for batch in dset.to_batches(columns=list(schema.KEYS), batch_size=1 << 20):
        t = pa.Table.from_batches([batch])
        t = pa.table([pc.cast(t.column(k), schema.KEY_TYPES[k]) for k in schema.KEYS], names=list(schema.KEYS))
        pieces.append(t.group_by(list(REQUEST_KEYS), use_threads=False).aggregate(
            [("round_idx", "min"), ("round_idx", "max"), ("round_idx", "count")]))
    t = pa.concat_tables(pieces)
    if len(pieces) > 1:  # a request split over batches: merge its pieces
        t = t.group_by(list(REQUEST_KEYS), use_threads=False).aggregate(
            [("round_idx_min", "min"), ("round_idx_max", "max"), ("round_idx_count", "sum")]).rename_columns(
            [*REQUEST_KEYS, "round_idx_min", "round_idx_max", "round_idx_count"])
    return t


def check_disjoint_parts(parts: list[Path]) -> None:
    """Refuse (:class:`calib.bank.io.OverlappingBanksError`) parts that share a round key, naming both
    parts and the first shared key. Requests are compared first (one row each); only a request found in
    two parts with overlapping round ranges has its rounds compared."""
    if len(parts) < 2:
        return
    reqs = []
    for i, p in enumerate(parts):
        r = _requests(p)
        reqs.append(r.append_column("part", pa.array(np.full(r.num_rows, i, dtype=np.int32))))
    t = pa.concat_tables(reqs)
    g = t.group_by(list(REQUEST_KEYS), use_threads=False).aggregate([("part", "count")])
    shared = g.filter(pc.greater(g.column("part_count"), 1))
    if shared.num_rows == 0:
        return
    both = t.join(shared.select(list(REQUEST_KEYS)), keys=list(REQUEST_KEYS), join_type="inner")
    both = both.sort_by([(k, "ascending") for k in (*REQUEST_KEYS, "part")])
    cols = {c: both.column(c).to_pylist() for c in both.column_names}
    start = 0
    for i in range(1, both.num_rows):
        if any(cols[k][i] != cols[k][start] for k in REQUEST_KEYS):
            start = i
            continue
        for j in range(start, i):  # every earlier part holding this request
            if cols["round_idx_min"][i] > cols["round_idx_max"][j] or cols["round_idx_min"][j] > cols["round_idx_max"][i]:
                continue  # round ranges apart: no key can be shared
            a, b = parts[cols["part"][j]], parts[cols["part"][i]]
            key = {k: cols[k][i] for k in REQUEST_KEYS}
            common = np.intersect1d(_rounds_of(a, key), _rounds_of(b, key))
            if common.size:
                first = ", ".join(f"{k}={v!r}" for k, v in {**key, "round_idx": int(common[0])}.items())
                raise OverlappingBanksError(
                    f"parts {a} and {b} share {common.size} round key(s) of one request; first: {first}. The "
                    "same rounds were collected (or copied) twice and would be counted twice: drop one of the two")


def _rounds_of(part: Path, key: dict) -> np.ndarray:
    expr = None
    for k, v in key.items():
        e = pc.field(k) == pa.scalar(v, schema.KEY_TYPES[k])
        expr = e if expr is None else expr & e
    t = ds.dataset(part / schema.ACCEPTANCE, format="parquet").to_table(columns=["round_idx"], filter=expr)
    return np.unique(t.column("round_idx").to_numpy())
