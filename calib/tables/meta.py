"""tables.json's schema: the format version, the file names, the errors, and the declared constraints every
field is checked by (:func:`check_meta`), shared by the writer (:mod:`calib.tables.io`) and the loaded
tables (:mod:`calib.tables.loaded`)."""

from __future__ import annotations

import itertools
import numbers
from pathlib import Path

import numpy as np
import torch

from calib.chains import chain_names
from calib.params import TEXT, Boolean, Fractions, Interval, NoneValue, Options, Satisfies, finite_number

# 2: tables.json carries json_sha256 (its own digest), target_models and per-chain ids / k.
# 3: one layout per registered chain (<name>.grid/.edges/.strides), tables.json lists `chains` with
#    their registry id and axes (was: drafters + ngram_features and four fixed tensor names).
SCHEMA_VERSION = 3
TENSORS = "tables.safetensors"
META = "tables.json"
PARTS = ("grid", "edges", "strides")  # a chain's tensors: "<chain>.<part>"
DTYPES = {"grid": torch.float32, "edges": torch.float32, "strides": torch.int64}
REEXPORT = "re-export the tables (python train.py out_dir=DIR overwrite=true) instead of editing them"
# Fitted and served temperatures are compared at the precision tables.json records them
# (calib.tables.export.TEMPERATURE_DECIMALS); a value this close to a fitted one is that one.
TEMPERATURE_TOL = 1e-6


class TablesError(ValueError):
    """Tables that cannot be trusted (wrong schema version, checksum mismatch, missing pieces) or that
    do not fit the bank they are applied to."""


class TablesWarning(UserWarning):
    """A tables/bank cross-check that could not be made (the bank or the tables do not record it)."""


# --- what a tables.json holds (declarative: calib.params' constraints, plus JSON shapes) ---------------

def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


OBJECT = Satisfies("an object ({...})", lambda v: isinstance(v, dict))
TEXTS = Satisfies("a list of strings", lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v))
ARRAY = Satisfies("a list", lambda v: isinstance(v, list))
EDGES = Satisfies("a list of finite numbers in ascending order",
                  lambda v: isinstance(v, list) and all(finite_number(x) for x in v)
                  and all(a <= b for a, b in itertools.pairwise(v)))
TEMPERATURES = Satisfies("a list of finite numbers >= 0 in ascending order",
                         lambda v: isinstance(v, list) and all(finite_number(x) and x >= 0 for x in v)
                         and all(a <= b for a, b in itertools.pairwise(v)))
SHAPE = Satisfies("a list of integers >= 0", lambda v: isinstance(v, list)
                  and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in v))
ROWS = Satisfies("a non-empty list of equally long non-empty lists of probabilities in [0, 1]",
                 lambda v: isinstance(v, list) and bool(v) and all(isinstance(r, list) and r and len(r) == len(v[0])
                                                                   and all(finite_number(x) and 0 <= x <= 1 for x in r)
                                                                   for r in v))
AXES = Satisfies("a non-empty list of axis objects", lambda v: isinstance(v, list) and bool(v)
                 and all(isinstance(a, dict) for a in v))
_INT1 = Interval(numbers.Integral, 1, None)

# tables.json's keys: top level, per chain (``chains.<name>.*``), per axis, and the nested records.
# Keys absent from a file are not checked here (the older fields are optional, as their readers are).
META_CONSTRAINTS = {
    "tensors_sha256": [TEXT], "chains": [OBJECT], "shapes": [OBJECT], "target_models": [NoneValue(), TEXTS],
    "reuse_last_row": [Boolean()], "banks": [NoneValue(), ARRAY], "split": [NoneValue(), OBJECT],
}
CHAIN_CONSTRAINTS = {
    "axes": [AXES], "id": [NoneValue(), Interval(numbers.Integral, 1, 127)], "k": [NoneValue(), _INT1],
    "depths": [NoneValue(), _INT1], "ids": [NoneValue(), TEXTS], "temperatures": [NoneValue(), OBJECT],
    "forecast": [NoneValue(), OBJECT],
}
AXIS_CONSTRAINTS = {"name": [TEXT], "kind": [Options(("interpolate", "bins"))]}
AXIS_KIND_CONSTRAINTS = {"interpolate": {"points": [_INT1]}, "bins": {"edges": [EDGES]}}
TEMPERATURE_CONSTRAINTS = {"values": [TEMPERATURES], "min": [NoneValue(), Interval(numbers.Real, 0, None)],
                           "max": [NoneValue(), Interval(numbers.Real, 0, None)]}
FORECAST_CONSTRAINTS = {"axes": [Satisfies("a list of axis objects", lambda v: isinstance(v, list)
                                           and all(isinstance(a, dict) for a in v))], "values": [ROWS]}
BANK_CONSTRAINTS = {"path": [NoneValue(), TEXT], "acceptance_sha256": [NoneValue(), TEXT],
                    "identity": [NoneValue(), OBJECT]}
SPLIT_CONSTRAINTS = {"fractions": [NoneValue(), Fractions(3)],
                     "seed": [NoneValue(), Interval(numbers.Integral, 0, None)]}


def _check_keys(where: Path, prefix: str, obj: dict, constraints: dict) -> None:
    """Refuse the first key of ``obj`` that none of its constraints accepts, naming file, key and value."""
    for key, allowed in constraints.items():
        if key not in obj:
            continue
        value = obj[key]
        if not any(c.accepts(value) for c in allowed):
            want = " or ".join(str(c) for c in allowed)
            raise TablesError(f"{where}: {prefix}{key} = {_short(value)} ({type(value).__name__}) is invalid; it "
                              f"must be {want}; {REEXPORT}")


def _check_axes(where: Path, prefix: str, axes: list, kinds=("interpolate", "bins")) -> None:
    for i, axis in enumerate(axes):
        at = f"{prefix}[{i}]."
        _check_keys(where, at, axis, AXIS_CONSTRAINTS)
        for key in ("name", "kind"):
            if key not in axis:
                raise TablesError(f"{where}: {at}{key} is missing; {REEXPORT}")
        if axis["kind"] not in kinds:
            raise TablesError(f"{where}: {at}kind = {axis['kind']!r} is invalid here; it must be one of {list(kinds)}; "
                              f"{REEXPORT}")
        need = AXIS_KIND_CONSTRAINTS[axis["kind"]]
        for key in need:
            if key not in axis:
                raise TablesError(f"{where}: {at}{key} is missing (a {axis['kind']!r} axis has one); {REEXPORT}")
        _check_keys(where, at, axis, need)
    if any(a["kind"] == "interpolate" for a in axes[1:]):
        raise TablesError(f"{where}: {prefix}: only axis 0 (the raw confidence) may be interpolated; {REEXPORT}")


def check_meta(meta: dict, where: Path) -> None:
    """Refuse a tables.json whose fields do not have the types and ranges calib writes
    (:data:`META_CONSTRAINTS` and the per-chain, per-axis and nested ones), naming the file and the
    dotted key (``chains.model.k``) with its value. Run behind the digest check: a hand edit is refused
    by digest first; this catches what a digest cannot (a file written by something else)."""
    _check_keys(where, "", meta, META_CONSTRAINTS)
    for key in ("chains", "shapes", "tensors_sha256"):
        if key not in meta:
            raise TablesError(f"{where}: key {key!r} is missing: not a tables.json calib wrote; {REEXPORT}")
    if not meta["chains"]:
        raise TablesError(f"{where}: chains = {{}}: these tables calibrate no chain; {REEXPORT}")
    for i, bank in enumerate(meta.get("banks") or []):  # a record per bank (stand-in tables list paths)
        if isinstance(bank, dict):
            _check_keys(where, f"banks[{i}].", bank, BANK_CONSTRAINTS)
    if meta.get("split") is not None:
        _check_keys(where, "split.", meta["split"], SPLIT_CONSTRAINTS)
    for name, shape in meta["shapes"].items():
        _check_keys(where, "shapes.", {name: shape}, {name: [SHAPE]})
    unknown = [name for name in meta["chains"] if name not in chain_names()]
    if unknown:
        raise TablesError(f"{where}: chains lists {unknown}, not a chain this calib knows (registered: "
                          f"{list(chain_names())}): tables from another calib version, or a chain registered by code "
                          f"this process did not import; {REEXPORT}")
    for name, entry in meta["chains"].items():
        at = f"chains.{name}."
        if not isinstance(entry, dict):
            raise TablesError(f"{where}: chains.{name} = {_short(entry)} ({type(entry).__name__}) is invalid; it "
                              f"must be an object ({{...}}) describing the chain; {REEXPORT}")
        if "axes" not in entry:
            raise TablesError(f"{where}: {at}axes is missing; {REEXPORT}")
        _check_keys(where, at, entry, CHAIN_CONSTRAINTS)
        _check_axes(where, f"{at}axes", entry["axes"])
        temps = entry.get("temperatures")
        if temps is not None:
            _check_keys(where, f"{at}temperatures.", temps, TEMPERATURE_CONSTRAINTS)
            values, lo, hi = temps.get("values") or [], temps.get("min"), temps.get("max")
            if (lo is None) != (hi is None) or (lo is not None and (lo > hi or not values)) or (
                    values and (lo is None or values[0] < lo - TEMPERATURE_TOL or values[-1] > hi + TEMPERATURE_TOL)):
                raise TablesError(f"{where}: {at}temperatures = {_short(temps)} is inconsistent: min <= every value "
                                  f"<= max, min and max None only without values; {REEXPORT}")
        fc = entry.get("forecast")
        if fc is not None:
            _check_keys(where, f"{at}forecast.", fc, FORECAST_CONSTRAINTS)
            for key in ("axes", "values"):
                if key not in fc:
                    raise TablesError(f"{where}: {at}forecast.{key} is missing; {REEXPORT}")
            _check_axes(where, f"{at}forecast.axes", fc["axes"], kinds=("bins",))
            cells = int(np.prod([len(a["edges"]) + 1 for a in fc["axes"]])) if fc["axes"] else 1
            if len(fc["values"][0]) != cells:
                raise TablesError(f"{where}: {at}forecast.values has {len(fc['values'][0])} cells per depth, its axes "
                                  f"cut {cells}; {REEXPORT}")


