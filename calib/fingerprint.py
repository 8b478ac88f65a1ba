"""What a model folder *is*, by content: the identity calib records for a target and a drafter.

A bank, the tables fitted on it and the engine that serves them must describe the same target and the
same drafter. Folder names cannot say that: renaming a drafter folder changes its name and nothing else,
and a retrained head saved under the old folder name changes everything but the name. So calib
identifies a model folder by a :func:`fingerprint` and uses names only in messages:

* ``architecture`` — ``config.json``'s ``architectures`` (joined with ``+`` when several);
* ``config_sha256`` — sha256 of ``config.json`` as canonical JSON (sorted keys, no spaces), without the
  keys that record where or by which library version the folder was written (:data:`VOLATILE_CONFIG_KEYS`):
  the same model saved elsewhere keeps its digest;
* ``weights_sha256`` — a *cheap* digest of the weight files, not a full-file hash (a 70B checkpoint
  would take minutes to read): for each weight file (:data:`WEIGHT_SUFFIXES`, sorted by path inside the
  folder), its path, its size, its safetensors header (tensor names, dtypes, shapes, offsets) when it is
  a safetensors file, and the first and last :data:`EDGE_BYTES` bytes of its data. A retrained or
  re-initialised head of the same shapes differs in the first bytes of its first tensor; a corruption in
  the middle of a large file is not caught (that is not what the digest is for). None when the folder
  holds no weight files;
* ``name`` — the folder's name: for messages only, never compared.

Two fingerprints describe the same model when :data:`IDENTITY_KEYS` agree (:func:`same_model`). A model
given by hub id is resolved offline from the local Hugging Face cache (:func:`resolve_model_dir`); where it
cannot be resolved there is no fingerprint and callers fall back to comparing names, with a warning.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path

IDENTITY_KEYS = ("architecture", "config_sha256", "weights_sha256")
VOLATILE_CONFIG_KEYS = ("_name_or_path", "transformers_version", "_commit_hash", "_attn_implementation",
                        "_attn_implementation_autoset")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
EDGE_BYTES = 1 << 20  # bytes hashed at each end of a weight file's data
WEIGHTS_METHOD = "path+size+safetensors header+first/last 1 MiB of data per file"


def resolve_model_dir(model: str | os.PathLike) -> Path | None:
    """The local folder of ``model`` (a folder, or a hub id found in the local Hugging Face cache without
    network access); None where it is neither."""
    path = Path(str(model)).expanduser()
    if path.is_dir():
        return path.resolve()
    if path.is_file():  # a single-file model (a .gguf): its folder
        return path.parent.resolve()
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(str(model), local_files_only=True))
    except Exception:  # noqa: BLE001 - not a hub id, or not cached: no fingerprint, names are compared
        return None


def config_digest(config: dict) -> str:
    """sha256 of ``config`` as canonical JSON, without :data:`VOLATILE_CONFIG_KEYS`."""
    body = {k: v for k, v in config.items() if k not in VOLATILE_CONFIG_KEYS}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def _weight_files(folder: Path) -> list[Path]:
    return sorted((p for p in folder.rglob("*") if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES)
                   and not any(part.startswith(".") for part in p.relative_to(folder).parts)),
                  key=lambda p: p.relative_to(folder).as_posix())


def _safetensors_header_len(fh, size: int) -> int:
    """Bytes before a safetensors file's data (8 + header length), 0 when it is not one."""
    head = fh.read(8)
    fh.seek(0)
    if len(head) < 8:
        return 0
    (n,) = struct.unpack("<Q", head)
    return 8 + n if 8 + n <= size and n < (100 << 20) else 0


def weights_digest(folder: str | os.PathLike) -> str | None:
    """The cheap digest of the weight files under ``folder`` (module docstring); None without any."""
    folder = Path(folder)
    files = _weight_files(folder)
    if not files:
        return None
    h = hashlib.sha256()
    for f in files:
        size = f.stat().st_size
        h.update(f"{f.relative_to(folder).as_posix()}\0{size}\0".encode())
        with open(f, "rb") as fh:
            start = _safetensors_header_len(fh, size) if f.suffix == ".safetensors" else 0
            h.update(fh.read(start))  # the header: names, dtypes, shapes, offsets
            data = size - start
            if data <= 2 * EDGE_BYTES:
                h.update(fh.read(data))
            else:
                h.update(fh.read(EDGE_BYTES))
                fh.seek(size - EDGE_BYTES)
                h.update(fh.read(EDGE_BYTES))
    return h.hexdigest()


def fingerprint(model: str | os.PathLike | None) -> dict | None:
    """The fingerprint of a model folder (or a hub id in the local cache): ``{"name", "architecture",
    "config_sha256", "weights_sha256", "weights_method"}``; None where ``model`` is None or resolves to no
    folder holding a ``config.json``."""
    if model is None:
        return None
    folder = resolve_model_dir(model)
    if folder is None or not (folder / "config.json").is_file():
        return None
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    arch = config.get("architectures")
    arch = "+".join(map(str, arch)) if isinstance(arch, list) and arch else None
    name = Path(str(model)).name if Path(str(model)).expanduser().exists() else str(model)
    return {"name": name, "architecture": arch, "config_sha256": config_digest(config),
            "weights_sha256": weights_digest(folder), "weights_method": WEIGHTS_METHOD}


def is_fingerprint(value) -> bool:
    """Whether ``value`` is a fingerprint as :func:`fingerprint` writes it (a dict holding the identity keys)."""
    return isinstance(value, dict) and all(k in value for k in IDENTITY_KEYS) and isinstance(
        value.get("config_sha256"), str)


def same_model(a: dict, b: dict) -> bool:
    """Whether fingerprints ``a`` and ``b`` describe the same model (names are not compared)."""
    return all(a.get(k) == b.get(k) for k in IDENTITY_KEYS)


def describe(fp: dict) -> str:
    """A fingerprint for a message: ``'<name>' (<architecture>, config <12 hex>, weights <12 hex>)``."""
    w = fp.get("weights_sha256")
    return (f"{fp.get('name')!r} ({fp.get('architecture') or 'no architecture'}, config "
            f"{str(fp.get('config_sha256'))[:12]}, weights {w[:12] if w else 'none'})")


def identity(target, drafter, method: str | None, k: int | None) -> dict:
    """The identity block of a run (``run_manifest.json`` ``identity``; serving's engine manifest):
    the target's and drafter's fingerprints (folders or hub ids; the drafter None for model-free chains
    such as n-gram), the speculative method and K."""
    return {"target": fingerprint(target), "drafter": fingerprint(drafter), "method": method,
            "num_speculative_tokens": None if k is None else int(k)}
