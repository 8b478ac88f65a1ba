"""Exported tables on disk: ``tables.safetensors`` + ``tables.json``, written atomically, verified on load.

``tables.safetensors`` holds float32/int64 tensors in the layout of :mod:`calib.tables.layout`:

===============  ==============  =========================================================
name             dtype, shape    meaning
===============  ==============  =========================================================
model_grid       float32 [D, G]  calibrated P(accept at depth k | reached) at raw conf g/(G-1)
ngram_edges      float32 [F, E]  inner bin edges per n-gram feature, +inf padded
ngram_strides    int64 [F]       cell = Σ_f bucket_f · stride_f
ngram_grid       float32 [Dn, C] P(accept at depth k | reached) per feature cell
===============  ==============  =========================================================

``tables.json`` carries ``schema_version``, ``tensors_sha256`` (of the tensor file),
``ngram_features`` (the F feature names, in order: an engine passes features [B, L, F] in this
order; feature 0 is NaN where there is no token), ``drafters`` (ids, depths, calibrator, metrics),
``banks`` (identity and size of the banks fitted on), ``calib_version`` and ``git_commit``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from calib.tables.layout import GridTables

SCHEMA_VERSION = 1
TENSORS = "tables.safetensors"
META = "tables.json"
NAMES = ("model_grid", "ngram_edges", "ngram_strides", "ngram_grid")


class TablesError(ValueError):
    """Tables that cannot be trusted: wrong schema version, checksum mismatch, missing pieces."""


class Tables(GridTables):
    """Loaded tables: the allocator's :class:`GridTables` plus their metadata."""

    def __init__(self, model_grid, ngram_edges, ngram_strides, ngram_grid, meta: dict | None = None):
        super().__init__(model_grid, ngram_edges, ngram_strides, ngram_grid)
        self.meta = dict(meta or {})

    @property
    def ngram_feature_names(self) -> list[str]:
        return list(self.meta.get("ngram_features", []))

    @property
    def has_model(self) -> bool:
        return "model" in self.meta.get("drafters", {})

    @property
    def has_ngram(self) -> bool:
        return "ngram" in self.meta.get("drafters", {})

    def model_accept_prob(self, conf: torch.Tensor, depth: int | None = None) -> torch.Tensor:
        """Calibrated P(accept | reached) for raw confidences [rounds, K] (column = depth), NaN kept.

        With ``depth`` given, ``conf`` is any shape and every value is read at that depth.
        """
        if depth is None:
            return super().model_accept_prob(conf)
        flat = conf.reshape(-1, 1)
        grid = self.model_grid[min(depth, self.model_grid.shape[0] - 1)][None, :]
        from calib.tables.layout import model_grid_lookup

        return model_grid_lookup(grid, flat).reshape(conf.shape)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=Path(__file__).resolve().parent)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def save(out_dir: str | os.PathLike, tables: GridTables, meta: dict) -> Path:
    """Write ``tables.safetensors`` + ``tables.json`` into ``out_dir`` atomically (temp, then rename).

    Both files are replaced together: they are written into a temp folder beside ``out_dir`` and
    moved in one by one, the JSON (which names the tensor file's checksum) last.
    """
    from calib import __version__

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tables.tmp-", dir=out))
    try:
        tensors = {n: getattr(tables, n).detach().cpu().contiguous() for n in NAMES}
        tensors = {n: t.to(torch.int64 if n == "ngram_strides" else torch.float32) for n, t in tensors.items()}
        save_file(tensors, tmp / TENSORS, metadata={"schema_version": str(SCHEMA_VERSION)})
        full = {"schema_version": SCHEMA_VERSION, "calib_version": __version__, "git_commit": git_commit(),
                **meta, "tensors_sha256": _sha256(tmp / TENSORS),
                "shapes": {n: list(t.shape) for n, t in tensors.items()}}
        (tmp / META).write_text(json.dumps(full, indent=2, sort_keys=True, default=float) + "\n")
        os.replace(tmp / TENSORS, out / TENSORS)
        os.replace(tmp / META, out / META)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def load(path: str | os.PathLike) -> Tables:
    """Load and verify tables from a folder (or its ``tables.json``); refuse anything off."""
    d = Path(path)
    if d.name == META:
        d = d.parent
    meta_path, tensor_path = d / META, d / TENSORS
    for p in (meta_path, tensor_path):
        if not p.exists():
            raise TablesError(f"{p} not found: a tables folder holds {TENSORS} and {META} "
                              "(written by `python train.py out_dir=...`)")
    try:
        meta = json.loads(meta_path.read_text())
    except json.JSONDecodeError as exc:
        raise TablesError(f"{meta_path}: not valid JSON ({exc})") from exc
    version = meta.get("schema_version")
    if version != SCHEMA_VERSION:
        raise TablesError(f"{meta_path}: schema_version {version!r}, this calib reads {SCHEMA_VERSION}; "
                          "re-export the tables with this calib version (python train.py ...)")
    digest = _sha256(tensor_path)
    if digest != meta.get("tensors_sha256"):
        raise TablesError(f"{tensor_path}: sha256 {digest[:12]}… does not match tables.json "
                          f"({str(meta.get('tensors_sha256'))[:12]}…); the files are from different "
                          "exports or were modified")
    tensors = load_file(tensor_path)
    missing = [n for n in NAMES if n not in tensors]
    if missing:
        raise TablesError(f"{tensor_path}: missing tensors {missing}")
    return Tables(*(tensors[n] for n in NAMES), meta=meta)
