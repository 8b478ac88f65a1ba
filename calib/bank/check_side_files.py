"""The bank's optional side files against its data (run_manifest.json, stats.json), and the output of a
job left inside the bank's folder."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from calib.bank import schema
from calib.bank.arrays import floats, valid_mask
from calib.bank.checker import SIDE_HINT, Checker
from calib.bank.stats import compare_stats, compute_stats
from calib.sidefiles import SideFileError, field

# run_manifest.json fields the validator compares with the data, and their JSON types.
MANIFEST_FIELDS: dict[str, type] = {"n_rounds": int, "model": str, "speculator": str, "config": str,
                                    "categories": list, "num_speculative_tokens": int, "routing": dict,
                                    "identity": dict}
# run_manifest.json "identity" (calib/fingerprint.py): the target's and drafter's fingerprints, method, K.
IDENTITY_ROLES = ("target", "drafter")
JOBS = ("train.py", "eval.py", "serve.py")  # the jobs whose output folders calib.atomic.staged_output publishes
TEMPERATURE_TOL = 1e-6  # a row's temperature and the manifest's are the same setting within this


def manifest(ck: Checker, acceptance: pa.Table):
    m = ck.read_json(schema.MANIFEST)
    if m is None:
        return
    typed = {}
    for key, kind in MANIFEST_FIELDS.items():
        try:
            typed[key] = field(m, key, kind, schema.MANIFEST)
        except SideFileError as exc:
            ck.add(schema.MANIFEST, key, None, f"{exc.problem}; {SIDE_HINT}")
    cats = typed.get("categories")
    if cats is not None and not all(isinstance(c, str) for c in cats):
        bad = next(c for c in cats if not isinstance(c, str))
        ck.add(schema.MANIFEST, "categories", None,
               f"holds {bad!r} ({type(bad).__name__}); expected a list of category names (strings)")
        cats = None
    routing = typed.get("routing")
    for key, kind in schema.ROUTING_INFO.items():
        if routing is None:
            break
        try:
            value = field(routing, key, kind, schema.MANIFEST)
        except SideFileError as exc:
            ck.add(schema.MANIFEST, f"routing.{key}", None,
                   f"{exc.problem.replace(repr(key), repr('routing.' + key))}; {SIDE_HINT}")
            continue
        if kind is int and value is not None and value < 1:
            ck.add(schema.MANIFEST, f"routing.{key}", None, f"is {value}, expected an integer >= 1")
    _identity(ck, typed.get("identity"), typed.get("num_speculative_tokens"))
    n = typed.get("n_rounds")
    if n is not None and n != acceptance.num_rows:
        ck.add(schema.MANIFEST, "n_rounds", None,
               f"says {n} rounds, acceptance.parquet has {acceptance.num_rows}")
    for key in ("model", "speculator", "config"):
        if typed.get(key) is not None:
            values = set(pc.unique(acceptance.column(key)).to_pylist())
            if values != {typed[key]}:
                ck.add(schema.MANIFEST, key, None,
                       f"says {typed[key]!r}, the data hold {sorted(map(str, values))}")
    if cats is not None:
        values = set(pc.unique(acceptance.column("category")).to_pylist())
        if not values <= set(cats):
            ck.add(schema.MANIFEST, "categories", None,
                   f"lists {cats}, the data hold {sorted(values)}")
    k = typed.get("num_speculative_tokens")
    if k is not None:
        d = schema.width(acceptance.column_names)
        if k < 1:
            ck.add(schema.MANIFEST, "num_speculative_tokens", None, f"is {k}, expected an integer >= 1")
        elif k > d:
            ck.add(schema.MANIFEST, "num_speculative_tokens", None,
                   f"says {k}, the bank has {d} acc columns")


def sampling(ck: Checker, spec: pa.Table):
    """The manifest's ``sampling.temperature`` against speculator.parquet's ``temperature`` column: rows at
    another temperature than the manifest says are two collections under one name (the tables would fit
    a temperature axis the bank's name and config deny)."""
    m = ck.read_json(schema.MANIFEST)
    sampling = m.get("sampling") if m is not None else None
    if not isinstance(sampling, dict) or sampling.get("temperature") is None:
        return
    t = sampling["temperature"]
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
        ck.add(schema.MANIFEST, "sampling.temperature", None,
               f"is {t!r}, expected a finite number >= 0 (0: greedy); {SIDE_HINT}")
        return
    if "temperature" not in spec.column_names:
        return
    v = spec.column("temperature")
    raw, valid = floats(v, nulls_as_nan=False), valid_mask(v)
    with np.errstate(invalid="ignore"):
        off = valid & np.isfinite(raw) & (np.abs(raw - t) > TEMPERATURE_TOL)
    if off.any():
        i = int(np.flatnonzero(off)[0])
        ck.first_bad(schema.SPECULATOR, "temperature", off, spec,
                     f"temperature {raw[i]:g}, but {schema.MANIFEST} says sampling.temperature = {t:g}: "
                     "rows of another collection in this bank, or a wrong manifest; recollect the bank or "
                     "keep the two temperatures in two banks")


def outputs_inside(ck: Checker):
    """A job's output folder inside the bank (``train.py out_dir=<bank>/sub`` wrote tables there before calib
    refused outputs inside inputs, calib.atomic.check_not_inside_an_input): named, with its job."""
    from calib.atomic import OWNED, owner

    for record in sorted(Path(ck.dir).rglob(OWNED)):
        job = owner(record.parent)
        if record.parent != Path(ck.dir) and job in JOBS:  # the bank's own record (write_bank) is at its top
            rel = record.parent.relative_to(ck.dir).as_posix()
            ck.add(rel, None, None, f"holds the output of {job} inside this bank; move that folder out of "
                                    "the bank (outputs never go inside an input)")


def _identity(ck: Checker, ident: dict | None, k: int | None):
    """The manifest's ``identity``: each role a fingerprint (``calib.fingerprint``) or null, K as the manifest's."""
    from calib.fingerprint import IDENTITY_KEYS

    if ident is None:  # banks collected before fingerprints: check_bank compares names instead
        return
    for role in IDENTITY_ROLES:
        fp = ident.get(role)
        if fp is None:
            continue
        if not isinstance(fp, dict) or not isinstance(fp.get("config_sha256"), str) or any(
                key not in fp for key in IDENTITY_KEYS):
            ck.add(schema.MANIFEST, f"identity.{role}", None,
                   f"is {str(fp)[:80]!r}; expected null or a fingerprint object with {', '.join(IDENTITY_KEYS)} "
                   f"(calib/fingerprint.py); {SIDE_HINT}")
    n = ident.get("num_speculative_tokens")
    if n is not None and k is not None and n != k:
        ck.add(schema.MANIFEST, "identity.num_speculative_tokens", None,
               f"says {n}, num_speculative_tokens says {k}")


def stats(ck: Checker, acceptance: pa.Table):
    claimed = ck.read_json(schema.STATS)
    if claimed is None:
        return
    for d in compare_stats(claimed, compute_stats(acceptance)):
        ck.add(schema.STATS, d.split(" ")[0].removeprefix("stats."), None, d)
