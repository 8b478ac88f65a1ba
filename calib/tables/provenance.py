"""What tables record of the banks they were fitted on: content fingerprints, the JSON digest, the banks'
facts (depths, temperatures, identity) and the git commit (:func:`calib.tables.io.save` writes them;
:class:`calib.tables.loaded.Tables` checks a bank against them)."""

from __future__ import annotations

import hashlib
import json
import math
import numbers
import os
import subprocess
from pathlib import Path

import numpy as np

from calib.chains import chain as chain_kind
from calib.chains import chain_names, chains, verified_chain
from calib.sidefiles import read_json


def bank_fingerprint(bank_dir: str | os.PathLike) -> str:
    """A bank's content fingerprint (``banks[].acceptance_sha256`` in tables.json):
    :func:`calib.bank.io.fingerprint`, the sha256 of its acceptance.parquet. The same bank copied or
    moved elsewhere keeps it."""
    from calib.bank.io import fingerprint

    return fingerprint(bank_dir)


def _finite(obj):
    """``obj`` (parsed JSON) with NaN and infinities replaced by None: :func:`load` reads strict JSON."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_finite(v) for v in obj]
    return obj


def json_digest(meta: dict) -> str:
    """sha256 of ``meta`` without its ``json_sha256`` field, as canonical JSON (sorted keys, no spaces).

    Computed on the JSON as written (numbers already plain floats/ints), so a reader re-parsing the
    file gets the same digest; it covers ``tensors_sha256`` too, so one digest vouches for the pair.
    """
    body = {k: v for k, v in meta.items() if k != "json_sha256"}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(text.encode()).hexdigest()


def _has_confidence(chain: str) -> bool:
    """Whether ``chain`` is a registered kind with a raw confidence (a model drafter, named by its
    speculator)."""
    return chain in chain_names() and chain_kind(chain).confidence is not None


def _bank_facts(bank, path=None) -> dict:
    """What :meth:`Tables.check_bank` compares: from a bank folder (manifest + parquet schemas) or a
    manifest dict."""
    import pyarrow.parquet as pq

    from calib.bank import schema

    if isinstance(bank, dict):
        man, folder = bank, None
        where = str(path) if path is not None else "(a run_manifest.json given as a dict)"
    else:
        folder = Path(bank)
        where = str(folder)
        man = read_json(folder / schema.MANIFEST, dict, missing_ok=True,
                        hint="rewrite it (python -m calib.bank validate PATH says what a bank holds)") or {}
    spec = man.get("speculator")
    spec = spec if isinstance(spec, str) else None if spec is None else str(spec)
    method = man.get("method") if isinstance(man.get("method"), str) else None
    k = man.get("num_speculative_tokens")
    facts = {"path": where, "folder": folder is not None, "model": man.get("model"), "speculator": spec,
             "chain": None if spec is None else verified_chain(spec, method), "k": k if _count(k) else None,
             "chain_k": _manifest_depths(man),  # drafted depth per chain the bank records
             "bank_columns": {},  # chain -> (its own bank file, that file's columns or None: not read)
             "temperatures": _manifest_temperature(man), "unrecorded_temperatures": 0,
             "identity": man.get("identity") if isinstance(man.get("identity"), dict) else {}}
    if facts["temperatures"] is not None:
        facts["temperatures"] = [facts["temperatures"]]
    if folder is not None:  # the data's own widths beat the manifest's
        facts["k"] = schema.width(pq.read_schema(folder / schema.ACCEPTANCE).names) or facts["k"]
        facts["chain_k"] = {kind.name: kind.drafted_depth(folder) for kind in chains()}
        facts["bank_columns"] = {kind.name: (kind.bank_file, set(pq.read_schema(folder / kind.bank_file).names)
                                             if (folder / kind.bank_file).exists() else None)
                                 for kind in chains() if kind.bank_file is not None}
        spec_file = folder / schema.SPECULATOR
        if "temperature" in pq.read_schema(spec_file).names:  # the rounds' own temperatures beat the manifest's
            col = pq.read_table(spec_file, columns=["temperature"]).column(0)
            t = col.to_numpy(zero_copy_only=False).astype(np.float64)
            missing = np.isnan(t)
            facts["unrecorded_temperatures"] = int(missing.sum())
            facts["temperatures"] = [float(v) for v in np.unique(np.round(t[~missing], 6))] or None
    return facts


def _manifest_depths(man: dict) -> dict:
    """The drafted depth a manifest records per chain kind that has a manifest object of its own
    (``manifest_key``, e.g. ``ngram_chain.width``); None where it records none."""
    out = {}
    for kind in chains():
        if kind.manifest_key is not None:
            entry = man.get(kind.manifest_key) if isinstance(man.get(kind.manifest_key), dict) else {}
            width = entry.get("width")
            out[kind.name] = width if _count(width) else None
    return out


def _count(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _manifest_temperature(man: dict):
    """A manifest's sampling temperature (``sampling.temperature``, or a top-level ``temperature``), None
    where it records none."""
    sampling = man.get("sampling") if isinstance(man.get("sampling"), dict) else {}
    t = sampling.get("temperature", man.get("temperature"))
    return float(t) if isinstance(t, numbers.Real) and not isinstance(t, bool) else None


def git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], check=False, capture_output=True, text=True, timeout=5,
                             cwd=Path(__file__).resolve().parent)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


