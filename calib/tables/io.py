"""Exported tables on disk: ``tables.safetensors`` + ``tables.json``, written atomically, verified on load.

``tables.safetensors`` holds, per chain ``<name>`` the tables calibrate (:mod:`calib.chains`), the
tensors of its :class:`calib.tables.layout.ChainTable`:

=================  ================  =========================================================
name               dtype, shape      meaning
=================  ================  =========================================================
<name>.grid        float32 [D, C]    P(accept at depth k | reached) per cell (and grid point)
<name>.edges       float32 [A_b, E]  inner bin edges of the chain's binned axes, +inf padded
<name>.strides     int64 [A_b]       cell = Σ_a bucket_a · stride_a
=================  ================  =========================================================

``tables.json`` carries ``schema_version``, ``tensors_sha256`` (of the tensor file), ``json_sha256``
(of the JSON's own content, see :func:`json_digest`), ``target_models`` (the target models of the
banks fitted on), ``chains`` (per chain: its registry ``id`` = the allocator's ``drafter`` value,
``axes`` = the input features in the order an engine passes them, with their edges or grid points,
``ids`` of the drafters fitted on, ``k`` = the drafted depth the tables cover, ``temperatures`` = the
sampling temperatures its training samples were drawn at (:func:`calib.tables.export.fitted_temperatures`:
distinct ``values``, ``min``, ``max``; absent in tables exported before calib recorded them), the
estimator and its metrics), ``banks`` (identity of the banks fitted on: path, ``acceptance_sha256``, rounds; eval uses
the fingerprint to tell a training bank from an unseen one), ``split``, ``calib_version`` and
``git_commit``.

:func:`load` refuses tables whose schema version, tensor checksum or JSON digest is off: an edited
feature order or bin edge changes what the tensors mean without any error downstream, so tables
are re-exported, never edited. Behind the digests it refuses, with a :class:`TablesError` naming the
file, the chain, the key or tensor and the first bad index and value: a tables.json that is not a
calib tables.json (binary, not JSON or not strict JSON (NaN, Infinity), nested too deep, a mistyped field:
:func:`calib.sidefiles.read_json` and :data:`META_CONSTRAINTS`, a chain this calib does not know), a folder
where either file belongs, tensor shapes or dtypes other than tables.json's ``shapes``, grid values
outside [0, 1] (NaN included: a grid cell always holds a probability; "no token" is the input's NaN,
never the grid's), edges that are NaN, -inf, unsorted or finite after the +inf padding, or differ from
the axes tables.json lists, and negative strides (or a zero stride on an axis that has edges).
:meth:`Tables.check_bank` refuses a bank the tables do not fit (target model, drafter, depth, n-gram
features, sampling temperature), naming both sides; :meth:`Tables.check_temperature` does the same for
an engine's temperature. Target and model drafter are compared by content where both sides record
fingerprints (``banks[].identity`` here, ``identity`` in a bank's run_manifest.json or an engine's manifest;
:mod:`calib.fingerprint`): a renamed folder passes, another model under the same name is refused. Where one
side records none (banks and tables made before fingerprints) the names are compared, with a warning.

The pieces: :mod:`calib.tables.meta` (the schema of tables.json and its errors), :mod:`calib.tables.provenance`
(what tables record of their banks), :mod:`calib.tables.loaded` (:class:`Tables` and its checks); this module
writes and reads the two files.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from calib.atomic import atomic_path, sha256_file, write_text_atomic
from calib.chains import Axis
from calib.chains import chain as chain_kind
from calib.sidefiles import SideFileError, read_json
from calib.tables.layout import ChainTable, GridTables
from calib.tables.loaded import Tables
from calib.tables.meta import (
    DTYPES,
    META,
    PARTS,
    REEXPORT,
    SCHEMA_VERSION,
    TENSORS,
    TablesError,
    TablesWarning,
    check_meta,
)
from calib.tables.provenance import _finite, bank_fingerprint, git_commit, json_digest

# the module's names, as callers import them (the schema, the provenance and the loaded tables live beside it)
__all__ = ["META", "SCHEMA_VERSION", "TENSORS", "Tables", "TablesError", "TablesWarning", "bank_fingerprint",
           "check_chain_tensors", "json_digest", "load", "save"]


def save(out_dir: str | os.PathLike, tables: GridTables, meta: dict) -> Path:
    """Write ``tables.safetensors`` + ``tables.json`` into ``out_dir``, each via a temp file + rename.

    The tensor file goes in first and the JSON (which carries the tensor file's checksum) last, so
    a reader sees the old pair, the new pair, or (killed between the two renames) a pair that
    :func:`load` refuses by checksum, never a silent mix. For the pair *and* what goes with it
    (summary, pictures) to land as one unit, save into a staging folder and publish that
    (:func:`calib.atomic.staged_output`, as ``train.py`` does). Files get mode 0644.
    """
    from calib import __version__

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors, chain_meta = {}, {k: dict(v) for k, v in (meta.get("chains") or {}).items()}
    for name, table in tables.chains.items():
        for part in PARTS:
            tensors[f"{name}.{part}"] = getattr(table, part).detach().cpu().contiguous().to(
                torch.int64 if part == "strides" else torch.float32)
        entry = chain_meta.setdefault(name, {})
        entry["axes"] = [a.to_json() for a in table.axes]
        entry.setdefault("id", _chain_id(name))
    meta = {**meta, "chains": chain_meta}
    with atomic_path(out / TENSORS) as tmp:
        save_file(tensors, tmp, metadata={"schema_version": str(SCHEMA_VERSION)})
        full = {"schema_version": SCHEMA_VERSION, "calib_version": __version__, "git_commit": git_commit(),
                **meta, "reuse_last_row": bool(getattr(tables, "reuse_last_row", False)),
                "tensors_sha256": sha256_file(tmp),
                "shapes": {n: list(t.shape) for n, t in tensors.items()}}
    full.pop("json_sha256", None)
    # the digest is over what a reader parses back; strict JSON (a NaN metric is written as null)
    full = _finite(json.loads(json.dumps(full, default=float)))
    full["json_sha256"] = json_digest(full)
    write_text_atomic(out / META, json.dumps(full, indent=2, sort_keys=True, allow_nan=False) + "\n")
    return out


def load(path: str | os.PathLike) -> Tables:
    """Load and verify tables from a folder (or its ``tables.json``); refuse anything off.

    In order: both files present; tables.json readable as JSON (:func:`calib.sidefiles.read_json`), of
    this :data:`SCHEMA_VERSION`, matching its own digest, then every field of the types calib writes
    (:func:`check_meta`); the tensor file matching tables.json's checksum, a safetensors file holding
    exactly the tensors and shapes tables.json lists, each chain's tensors consistent with its axes and
    their values in range (:func:`check_chain_tensors`). Each refusal is a :class:`TablesError` naming
    the file, and the chain, key or tensor, and the first bad value.
    """
    d = Path(path)
    if d.name == META:
        d = d.parent
    meta_path, tensor_path = d / META, d / TENSORS
    for p in (meta_path, tensor_path):
        if not p.exists():
            raise TablesError(f"{p} not found: a tables folder holds {TENSORS} and {META} "
                              "(written by `python train.py out_dir=...`)")
        if p.is_dir():
            raise TablesError(f"{p} is a folder, not a file: a tables folder holds the files {TENSORS} and {META} "
                              "(written by `python train.py out_dir=...`); point tables= at that folder")
    try:  # strict JSON: calib writes null for a missing number, never NaN or Infinity
        meta = read_json(meta_path, dict, allow_nan=False,
                         hint="re-export the tables (python train.py out_dir=DIR overwrite=true)")
    except SideFileError as exc:
        raise TablesError(str(exc)) from exc
    version = meta.get("schema_version")
    if isinstance(version, bool) or version != SCHEMA_VERSION:
        raise TablesError(f"{meta_path}: schema_version {version!r}, this calib reads {SCHEMA_VERSION}; "
                          "re-export the tables with this calib version (python train.py out_dir=DIR)")
    recorded, actual = meta.get("json_sha256"), json_digest(meta)
    if actual != recorded:
        raise TablesError(f"{meta_path}: content sha256 {actual[:12]}… does not match its json_sha256 "
                          f"({str(recorded)[:12]}…): tables.json was edited after export. A changed feature "
                          "order, edge or depth changes what the tensors mean without any other error; "
                          "re-export the tables (python train.py out_dir=DIR overwrite=true) instead of "
                          "editing them")
    check_meta(meta, meta_path)
    digest = sha256_file(tensor_path)
    if digest != meta["tensors_sha256"]:
        raise TablesError(f"{tensor_path}: sha256 {digest[:12]}… does not match tables.json "
                          f"({str(meta.get('tensors_sha256'))[:12]}…); the files are from different "
                          "exports or were modified; re-export the tables (python train.py out_dir=DIR)")
    try:
        tensors = load_file(tensor_path)
    except Exception as exc:  # safetensors raises its own error types for a corrupt file
        raise TablesError(f"{tensor_path}: not a readable safetensors file ({type(exc).__name__}: {exc}); "
                          f"{REEXPORT}") from exc
    _check_shapes(meta["shapes"], tensors, meta_path, tensor_path)
    chain_tables = {}
    for name, entry in meta["chains"].items():
        missing = [f"{name}.{p}" for p in PARTS if f"{name}.{p}" not in tensors]
        if missing:
            raise TablesError(f"{tensor_path}: missing tensors {missing}")
        parts = {p: tensors[f"{name}.{p}"] for p in PARTS}
        axes = tuple(Axis.from_json(a) for a in entry["axes"])
        check_chain_tensors(name, axes, parts, entry, tensor_path)
        try:
            chain_tables[name] = ChainTable(axes, *(parts[p] for p in PARTS))
        except (KeyError, TypeError, ValueError) as exc:
            raise TablesError(f"{d}: chain {name!r}: its axes in tables.json do not describe its tensors "
                              f"({exc}); re-export the tables") from exc
    return Tables(chain_tables, meta=meta, path=d, reuse_last_row=meta.get("reuse_last_row", False))


def _check_shapes(shapes: dict, tensors: dict, meta_path: Path, tensor_path: Path) -> None:
    """The tensor file holds exactly the tensors tables.json's ``shapes`` lists, each of that shape."""
    listed, held = set(shapes), set(tensors)
    if listed != held:
        raise TablesError(f"{tensor_path}: holds tensors {sorted(held)}, {meta_path.name}'s shapes list "
                          f"{sorted(listed)} (not in the file: {sorted(listed - held)}, not listed: "
                          f"{sorted(held - listed)}); {REEXPORT}")
    for name in sorted(held):
        if list(tensors[name].shape) != shapes[name]:
            raise TablesError(f"{tensor_path}: tensor {name} has shape {list(tensors[name].shape)}, "
                              f"{meta_path.name}'s shapes.{name} says {shapes[name]}; {REEXPORT}")


def _first(bad: torch.Tensor) -> tuple[int, ...]:
    return tuple(int(i) for i in bad.nonzero()[0])


def check_chain_tensors(name: str, axes: tuple, parts: dict, entry: dict, where) -> None:
    """Refuse chain ``name``'s tensors (``parts``: grid, edges, strides) where they cannot mean what the
    layout says (:mod:`calib.tables.layout`), naming ``where`` (the tensor file), the tensor and the
    first bad index and value:

    * dtypes: grid and edges float32, strides int64;
    * grid values in [0, 1]: every cell holds a probability (NaN too is refused: "no token" is an
      input's NaN, and a NaN cell would silently drop that cell's chains from every allocation);
      its rows match tables.json's ``depths`` where recorded;
    * edges: one row per binned axis, each ascending finite edges then ``+inf`` padding only (NaN,
      ``-inf`` or a finite edge after the padding is refused), equal to the axis' edges in tables.json;
    * strides: none negative, none zero on an axis that has edges (its buckets would all read one cell).
    """
    for part, dtype in DTYPES.items():
        if parts[part].dtype != dtype:
            raise TablesError(f"{where}: tensor {name}.{part} is {parts[part].dtype}, the layout's is {dtype}; "
                              f"{REEXPORT}")
    grid, edges, strides = parts["grid"], parts["edges"], parts["strides"]
    if grid.ndim == 2:
        bad = ~((grid >= 0) & (grid <= 1))
        if bool(bad.any()):
            at = _first(bad)
            raise TablesError(f"{where}: chain {name!r}: tensor {name}.grid{list(at)} = {float(grid[at])!r} is not a "
                              f"probability in [0, 1] ({int(bad.sum())} of {grid.numel()} cells are off); {REEXPORT}")
        depths = entry.get("depths")
        if depths is not None and grid.shape[0] != depths:
            raise TablesError(f"{where}: chain {name!r}: tensor {name}.grid has {grid.shape[0]} depth rows, "
                              f"tables.json's chains.{name}.depths says {depths}; {REEXPORT}")
    binned = [a for a in axes if not a.interpolated]
    if edges.ndim != 2 or edges.shape[0] != len(binned) or strides.ndim != 1 or strides.shape[0] != len(binned):
        raise TablesError(f"{where}: chain {name!r}: {name}.edges {list(edges.shape)} and {name}.strides "
                          f"{list(strides.shape)} must be [A_b, E] and [A_b] with A_b = {len(binned)} binned axes "
                          f"({[a.name for a in binned]}); {REEXPORT}")
    for a, axis in enumerate(binned):
        _check_edges_row(name, a, axis, edges[a], int(strides[a]), where)


def _check_edges_row(name: str, a: int, axis, row: torch.Tensor, s: int, where) -> None:
    """:func:`check_chain_tensors` on binned axis ``a``: its edges row (ascending finite, then +inf
    padding, equal to tables.json's) and its stride ``s``."""
    finite = torch.isfinite(row)
    padding = (~finite).nonzero()
    n = int(padding[0, 0]) if padding.numel() else int(row.numel())  # the finite edges before the padding
    problem = None
    if bool(torch.isnan(row).any()):
        problem, at = "NaN", int(torch.isnan(row).nonzero()[0, 0])
    elif bool((row == -torch.inf).any()):
        problem, at = "-inf", int((row == -torch.inf).nonzero()[0, 0])
    elif bool(finite[n:].any()):
        problem, at = "a finite edge after the +inf padding", n + int(finite[n:].nonzero()[0, 0])
    elif n > 1 and not bool((row[1:n] >= row[: n - 1]).all()):
        at = int((row[1:n] < row[: n - 1]).nonzero()[0, 0]) + 1
        problem = "smaller than the edge before it (edges must ascend)"
    if problem is not None:
        raise TablesError(f"{where}: chain {name!r}: tensor {name}.edges[{a}, {at}] = {float(row[at])!r} "
                          f"(axis {axis.name!r}): {problem}; edges are ascending finite values padded with +inf; "
                          f"{REEXPORT}")
    listed = torch.tensor(axis.edges, dtype=torch.float32)
    if n != len(axis.edges) or not torch.equal(row[:n], listed):
        raise TablesError(f"{where}: chain {name!r}: tensor {name}.edges[{a}] holds {row[:n].tolist()}, "
                          f"tables.json's axis {axis.name!r} says {list(axis.edges)}; {REEXPORT}")
    if s < 0 or (s == 0 and n):
        raise TablesError(f"{where}: chain {name!r}: tensor {name}.strides[{a}] = {s} (axis {axis.name!r}) "
                          f"{'is negative' if s < 0 else 'is 0 on an axis with edges: every bucket would read one cell'}"
                          f"; {REEXPORT}")


def _chain_id(name: str) -> int | None:
    """The registry id of chain ``name`` (None for a chain kind this process has not registered)."""
    try:
        return chain_kind(name).id
    except KeyError:
        return None
