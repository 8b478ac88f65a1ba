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
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import numbers
import os
import subprocess
import warnings
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from calib.atomic import atomic_path, sha256_file, write_text_atomic
from calib.chains import CONTEXT, Axis, chain_names, chains, verified_chain
from calib.chains import chain as chain_kind
from calib.fingerprint import describe, is_fingerprint, same_model
from calib.params import TEXT, Boolean, Fractions, Interval, NoneValue, Options, Satisfies, finite_number
from calib.sidefiles import SideFileError, read_json
from calib.tables.layout import ChainTable, GridTables

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


class Tables(GridTables):
    """Loaded tables: the allocator's :class:`GridTables` plus their metadata.

    Attributes:
        meta: the content of ``tables.json``.
        path: the tables folder (set by :func:`load`; None for tables built in memory), named in errors.
        reuse_last_row: see :mod:`calib.tables.layout`; saved in tables.json and restored by :func:`load`.
    """

    def __init__(self, chains: dict, meta: dict | None = None, path: str | os.PathLike | None = None,
                 reuse_last_row: bool = False):
        super().__init__(chains, reuse_last_row=bool(reuse_last_row))
        self.meta = dict(meta or {})
        self.path = None if path is None else Path(path)
        self._reported_temperatures: set = set()  # (chains, temperature) unfitted_temperatures returned

    @property
    def target_models(self) -> list[str] | None:
        """Target models of the banks the tables were fitted on (None: not recorded)."""
        t = self.meta.get("target_models")
        return None if t is None else list(t)

    def fitted_temperatures(self, chain: str) -> dict | None:
        """The sampling temperatures ``chain``'s table was fitted on, as tables.json records them
        (``{"values", "n_values", "min", "max", ...}``, :func:`calib.tables.export.fitted_temperatures`);
        None where it records none (tables exported before calib recorded them, or fitted on banks
        that record no temperature)."""
        rec = (self.meta.get("chains") or {}).get(chain, {}).get("temperatures")
        if not isinstance(rec, dict) or rec.get("min") is None or rec.get("max") is None:
            return None
        return rec

    def _where(self) -> str:
        return str(self.path) if self.path is not None else "(tables not loaded from a folder)"

    def _temperature_findings(self, temps, chains, who: str, action: str) -> tuple[list[str], list[str]]:
        """``(problems, notes)`` of the temperatures ``temps`` (floats) that ``who`` samples at against
        what ``chains`` were fitted on: outside a chain's fitted range is a problem; between its fitted
        values, or a chain that records none, a note. Chains fitted on the same temperatures share one line."""
        tdir, problems, notes = self._where(), [], []
        temps = sorted(set(temps))
        shown = _temps_text(temps)
        invalid = [t for t in temps if not (math.isfinite(t) and t >= 0)]
        if invalid:
            problems.append(f"temperature: {who} holds temperature {_temps_text(invalid)}, which no sampler uses (a "
                            "sampling temperature is finite and >= 0); fix or recollect it")
            temps = [t for t in temps if t not in invalid]
        unrecorded, groups = [], {}
        for c in chains:
            rec = self.fitted_temperatures(c)
            if rec is None:
                unrecorded.append(c)
                continue
            values = tuple(rec.get("values") or ())
            key = (values, float(rec["min"]), float(rec["max"]), int(rec.get("n_values", len(values))))
            groups.setdefault(key, []).append(c)
        if unrecorded:
            notes.append(f"tables {tdir}: tables.json records no fitted temperatures for the "
                         f"{' and '.join(unrecorded)} chain{'s' if len(unrecorded) > 1 else ''} (exported before calib recorded them, or fitted on "
                         f"banks without a temperature); cannot check {who}'s temperature {shown} against "
                         "them; re-export the tables (python train.py out_dir=DIR) to have it checked")
        for (values, lo, hi, n_values), cs in groups.items():
            fitted = _fitted_text(values, lo, hi, n_values)
            outside = [t for t in temps if not (lo - TEMPERATURE_TOL <= t <= hi + TEMPERATURE_TOL)]
            if outside:
                problems.append(f"temperature: tables {tdir} were fitted at {fitted} ({' and '.join(cs)} "
                                f"chain{'s' if len(cs) > 1 else ''}), {who} samples at temperature "
                                f"{_temps_text(outside)}, outside that range: the tables would silently reuse the "
                                "calibration of their nearest fitted temperature; " + action)
            elif n_values == len(values):  # every fitted value listed: tell one in between too
                between = [t for t in temps if not any(abs(t - v) <= TEMPERATURE_TOL for v in values)]
                if between:
                    notes.append(f"tables {tdir}: {who} samples at temperature {_temps_text(between)}, between the "
                                 f"temperatures the {' and '.join(cs)} chain was fitted at ({fitted}); the tables "
                                 "read the temperature bin it falls in")
        return problems, notes

    def check_temperature(self, temperature, where: str = "the engine", chains=None) -> list[str]:
        """Refuse serving at a sampling ``temperature`` (a number, or several) outside the range the
        tables' ``chains`` (names; default: every chain of these tables) were fitted at; return (and
        warn, :class:`TablesWarning`) what could not be checked or lies between fitted temperatures.

        serve.py calls it with its ``sampling.temperature`` before the engine starts (``where`` names
        the setting in messages). A temperature that is not a finite number >= 0 is a ``ValueError``.

        Raises:
            TablesError: naming the tables folder and their fitted temperatures, ``where`` and its value,
                and what to do.
        """
        scalar = temperature is None or isinstance(temperature, (numbers.Number, str, bytes))
        values = [temperature] if scalar else list(temperature)
        for t in values:
            if isinstance(t, bool) or not finite_number(t) or t < 0:
                raise ValueError(f"{where}: temperature={t!r} is invalid; a sampling temperature is a finite "
                                 "number >= 0 (0 = greedy)")
        names = list(self.chains) if chains is None else [c for c in chains if c in self.chains]
        problems, notes = self._temperature_findings(
            [float(t) for t in values], names, where,
            "serve at a temperature the tables were fitted at, or train tables on banks collected at "
            "this one too (python collect.py sampling.temperature=T, then python train.py data.train=[BANK,...])")
        if problems:
            raise TablesError("tables and serving temperature do not match:\n  - " + "\n  - ".join(problems))
        for n in notes:
            warnings.warn(n, TablesWarning, stacklevel=2)
        return notes

    def unfitted_temperatures(self, temperatures, chains=None) -> list[float]:
        """The distinct values of ``temperatures`` (a float tensor, array or list; finite, checked by the
        caller) outside the range ``chains`` (default: all) were fitted at, each returned once per
        Tables object (the serving decider logs each once). [] where nothing is recorded. Cheap: one
        min/max when every value is inside."""
        names = tuple(self.chains if chains is None else (c for c in chains if c in self.chains))
        ranges = [r for r in (self.fitted_temperatures(c) for c in names) if r is not None]
        if not ranges:
            return []
        lo = max(float(r["min"]) for r in ranges) - TEMPERATURE_TOL
        hi = min(float(r["max"]) for r in ranges) + TEMPERATURE_TOL
        t = temperatures.detach().cpu().numpy() if isinstance(temperatures, torch.Tensor) else np.asarray(temperatures)
        t = t.astype(np.float64).reshape(-1)
        if not t.size or (t.min() >= lo and t.max() <= hi):
            return []
        new = []
        for v in np.unique(t[(t < lo) | (t > hi)]):
            key = (names, round(float(v), 6))
            if key not in self._reported_temperatures:
                self._reported_temperatures.add(key)
                new.append(float(v))
        return new

    def temperature_range_text(self, chains=None) -> str:
        """What ``chains`` (default: all) were fitted at, for a message ("not recorded" where none says)."""
        names = list(self.chains) if chains is None else [c for c in chains if c in self.chains]
        parts = []
        for c in names:
            r = self.fitted_temperatures(c)
            parts.append(f"{c}: " + ("not recorded" if r is None else _fitted_text(
                tuple(r.get("values") or ()), float(r["min"]), float(r["max"]), int(r.get("n_values", 0)))))
        return "; ".join(parts)

    def chain_depth(self, chain: str) -> int | None:
        """The drafted depth K the tables cover for ``chain`` (a chain name): the recorded ``k``
        (the training banks' drafted width), else the rows of its grid, or None (any depth) for
        tables without a record that say ``reuse_last_row``."""
        k = self.meta.get("chains", {}).get(chain, {}).get("k")
        if k is not None:
            return int(k)
        if self.reuse_last_row:
            return None
        return self.table(chain).depths

    def forecast(self, chain: str) -> dict | None:
        """``chain``'s forecast as tables.json records it (``{"axes": [...], "values": [D][cells]}``, the
        calibrated acceptance expected per depth in each context cell: :func:`calib.allocate.forecast_probs`
        reads it), None where it records none (another chain, or tables exported before forecasts)."""
        return (self.meta.get("chains") or {}).get(chain, {}).get("forecast")

    def check_bank(self, bank, path: str | os.PathLike | None = None) -> list[str]:
        """Refuse a bank these tables were not fitted for; return (and warn) what could not be checked.

        ``bank`` is a bank folder, a :class:`calib.bank.Bank` (each of its folders is checked) or a
        bank's ``run_manifest.json`` content as a dict (then ``path`` names it in messages). Checked:

        - the bank's target model is one the tables were fitted for: by fingerprint where both sides
          record one (manifest ``identity.target``, tables.json ``banks[].identity``; a renamed folder
          passes, another model of the same name is refused), else by the manifest's ``model`` name (with
          a :class:`TablesWarning` where only one side records fingerprints);
        - the tables calibrate the bank's verified chain (the n-gram chain for ``speculator: ngram``,
          else the model drafter), and for the model drafter the bank's ``speculator`` is one of the
          tables' drafter ids (EAGLE tables on a draft_model bank are refused) — by the drafter's
          fingerprint instead where both sides record one, as for the target;
        - the bank's drafted depth K (acceptance.parquet width; manifest ``num_speculative_tokens``
          for a dict) is at most the tables' K for that chain: a deeper bank would read its extra
          depths from the last row, fitted on another depth. A shallower bank is fine (its depths
          are all calibrated, and acceptance at depth d does not depend on how deep drafting goes);
        - every other chain the tables calibrate that the bank records (the n-gram chain of a model
          bank; any registered kind, by its ``drafted_depth`` hook): its depth; for a chain kind with a
          bank file of its own (``bank_file``: the n-gram chain's ngram.parquet) also the tables' own
          feature columns (its axes, in that file).

        - the bank's sampling temperatures (the distinct values of speculator.parquet's ``temperature``
          column; a manifest's ``sampling.temperature`` where it has none) lie inside the range each
          checked chain was fitted at (tables.json ``chains.<name>.temperatures``): a T = 0.8 bank on
          tables fitted at T = 0 is refused. One between the fitted values is a warning (the tables read
          the temperature bin it falls in). A manifest dict without a temperature (an engine's: serve
          checks its temperature with :meth:`check_temperature`) is not checked for it.

        Where the bank's manifest lacks ``model`` or ``speculator``, or the tables do not record a
        field (temperatures: tables exported before they were recorded), that check is skipped with a
        :class:`TablesWarning` naming it.

        Raises:
            TablesError: listing every mismatch with the tables folder, the bank path and both values.
        """
        if hasattr(bank, "paths") and hasattr(bank, "manifests"):  # a calib.bank.Bank: check each folder
            return [w for p in bank.paths for w in self.check_bank(p)]
        facts = _bank_facts(bank, path)
        facts["tables"] = self._where()
        problems, notes = [], []
        for check in (self._check_target, self._check_verified_chain, self._check_other_chains,
                      self._check_bank_temperatures):
            found, unchecked = check(facts)
            problems += found
            notes += unchecked
        if problems:
            raise TablesError("tables and bank do not match:\n  - " + "\n  - ".join(problems)
                              + "\nuse tables fitted on banks of this target and drafter (python train.py "
                              "data.train=[BANK,...] out_dir=DIR), or evaluate the banks these tables were fitted for")
        for n in notes:
            warnings.warn(n, TablesWarning, stacklevel=2)
        return notes

    def fitted_fingerprints(self, role: str, chain: str | None = None) -> tuple[list[dict], list[str]]:
        """The fingerprints of the ``role`` (``"target"`` or ``"drafter"``) of the banks these tables were
        fitted on (tables.json ``banks[].identity``), for ``"drafter"`` only the banks whose verified chain
        is ``chain``; and the names of those banks' ``role`` that record none (banks collected before
        fingerprints; their name is all that can be compared). Distinct fingerprints, in bank order."""
        fps, legacy = [], []
        for entry in self.meta.get("banks") or []:
            entry = entry if isinstance(entry, dict) else {}
            ident = entry.get("identity") if isinstance(entry.get("identity"), dict) else {}
            spec = entry.get("speculator")
            if role == "drafter":
                method = entry.get("method") or ident.get("method")
                method = method if isinstance(method, str) else None
                spec = spec if isinstance(spec, str) else method  # a manifest without `speculator`: its method
                if spec is None or verified_chain(spec, method) != chain:
                    continue
            fp = ident.get(role)
            if is_fingerprint(fp):
                if not any(same_model(fp, f) for f in fps):
                    fps.append(fp)
            else:
                legacy.append(str(entry.get("model" if role == "target" else "speculator")))
        return fps, legacy

    def _by_content(self, role: str, what: str, theirs: dict | None, chain: str | None, tdir, bdir,
                    fallback: str) -> tuple[bool | None, list[str], list[str]]:
        """Compare ``theirs`` (the bank's or engine's ``role`` fingerprint) with the fitted ones:
        ``(decided, problems, notes)``; ``decided`` None: by name instead (``notes`` says so where one
        side has fingerprints)."""
        fitted, legacy = self.fitted_fingerprints(role, chain)
        if is_fingerprint(theirs) and fitted:
            if any(same_model(theirs, f) for f in fitted):
                return True, [], []
            if not legacy:
                same_name = any(f.get("name") == theirs.get("name") for f in fitted)
                return False, [(f"{what}: tables {tdir} were fitted for {', '.join(describe(f) for f in fitted)}, "
                                f"{bdir} has {describe(theirs)}: another model by content"
                                + (" under the same name" if same_name else ""))], []
        if is_fingerprint(theirs) or fitted:
            side = f"tables {tdir}" if not fitted else bdir
            return None, [], [(f"{what}: {side} records no fingerprint (made before calib recorded them); "
                               f"compared by name only ({fallback}); {'re-export the tables' if not fitted else 'recollect the bank'} "
                               "to compare by content")]
        return None, [], []

    def _check_target(self, facts: dict) -> tuple[list[str], list[str]]:
        """:meth:`check_bank`'s target model check: ``(problems, notes)``."""
        tdir, bdir, model, targets = facts["tables"], facts["path"], facts["model"], self.target_models
        decided, problems, notes = self._by_content("target", "target model", facts["identity"].get("target"),
                                                    None, tdir, f"bank {bdir}", f"{model!r} vs {targets}")
        if decided is not None:
            return problems, notes
        found, unchecked = self._check_target_name(facts)
        return found, notes + unchecked

    def _check_target_name(self, facts: dict) -> tuple[list[str], list[str]]:
        tdir, bdir, model, targets = facts["tables"], facts["path"], facts["model"], self.target_models
        if model is None:
            return [], [(f"bank {bdir}: run_manifest.json records no `model`; cannot check that it was "
                        f"collected with the target the tables {tdir} were fitted for "
                        f"({targets if targets is not None else 'not recorded either'})")]
        if targets is None:
            return [], [(f"tables {tdir}: tables.json records no target_models; cannot check the bank "
                        f"{bdir}'s target {model!r}")]
        if model not in targets:
            return [(f"target model: tables {tdir} were fitted for {targets}, bank {bdir} was "
                    f"collected with {model!r}")], []
        return [], []

    def _check_verified_chain(self, facts: dict) -> tuple[list[str], list[str]]:
        """:meth:`check_bank`'s check of the bank's verified chain: calibrated, its drafter, its depth."""
        tdir, bdir, spec, chain = facts["tables"], facts["path"], facts["speculator"], facts["chain"]
        drafters = self.meta.get("chains", {})
        problems, notes = [], []
        if chain is None:
            return [], [(f"bank {bdir}: run_manifest.json records no `speculator`; cannot check its "
                        f"drafter against the tables {tdir} ({self._ids_text()})")]
        if chain not in drafters:
            return [(f"drafter: tables {tdir} calibrate {sorted(drafters) or 'no drafter'}, bank {bdir}'s "
                    f"verified chain is the {chain} drafter ({spec!r})")], []
        ids = drafters[chain].get("ids")
        by_content = None
        if _has_confidence(chain):  # a model drafter: by fingerprint where both sides record one
            by_content, found, unchecked = self._by_content(
                "drafter", "drafter", facts["identity"].get("drafter"), chain, tdir, f"bank {bdir}",
                f"{spec!r} vs {list(ids) if ids is not None else 'not recorded'}")
            problems += found
            notes += unchecked
        if _has_confidence(chain) and by_content is None:  # else its speculator name must be one fitted on
            if ids is None:
                notes.append(f"tables {tdir}: tables.json records no model drafter ids; cannot check the "
                             f"bank {bdir}'s speculator {spec!r}")
            elif spec not in ids:
                problems.append(f"drafter: tables {tdir} were fitted for the model drafter(s) {list(ids)}, "
                                f"bank {bdir} was drafted by {spec!r}")
        k_bank, k_tab = facts["k"], self.chain_depth(chain)
        if k_bank is not None and k_tab is not None and k_bank > k_tab:
            problems.append(f"depth: tables {tdir} cover {chain}-drafter depths 0..{k_tab - 1} (K={k_tab}), "
                            f"bank {bdir} drafts K={k_bank}; depths {k_tab}..{k_bank - 1} would silently "
                            f"reuse depth {k_tab - 1}'s calibration")
        return problems, notes

    def _check_other_chains(self, facts: dict) -> tuple[list[str], list[str]]:
        """:meth:`check_bank`'s check of the other chains a bank records (the n-gram chain of a model bank,
        ...): their depth, and the table's own features among the columns of the chain's bank file."""
        tdir, bdir, problems = facts["tables"], facts["path"], []
        drafters = self.meta.get("chains", {})
        for other in drafters:
            k_bank, k_tab = facts["chain_k"].get(other), self.chain_depth(other) if other in self.chains else None
            if other != facts["chain"] and k_bank and k_tab is not None and k_bank > k_tab:
                problems.append(f"depth: tables {tdir} cover {other}-chain depths 0..{k_tab - 1} (K={k_tab}), bank "
                                f"{bdir}'s {other} chain is {k_bank} deep")
        for name, (file, cols) in facts["bank_columns"].items():
            if name not in drafters or cols is None:
                continue
            # context axes (temperature, ...) are read from the verified rounds, not the chain's file
            feats = [f for f in self.feature_names(name) if f not in CONTEXT]
            missing = [f for f in feats if f not in cols]
            if missing:
                problems.append(f"{name} features: tables {tdir} read {feats}, bank {bdir}'s {file} lacks {missing}")
        return problems, []

    def _check_bank_temperatures(self, facts: dict) -> tuple[list[str], list[str]]:
        """:meth:`check_bank`'s sampling temperature check: every chain checked before that the tables
        calibrate and the bank records."""
        tdir, bdir, drafters = facts["tables"], facts["path"], self.meta.get("chains", {})
        checked = [c for c in drafters if c == facts["chain"] or (c in self.chains and facts["chain_k"].get(c))]
        temps, problems, notes = facts["temperatures"], [], []
        if temps is None:
            if facts["folder"]:  # an engine's manifest dict is checked with check_temperature instead
                notes.append(f"bank {bdir}: speculator.parquet has no temperature column and run_manifest.json no "
                             f"sampling.temperature; cannot check it against the temperatures the tables {tdir} "
                             f"were fitted at ({self.temperature_range_text(checked)})")
        elif checked:
            problems, notes = self._temperature_findings(
                temps, checked, f"bank {bdir}",
                f"evaluate banks at the tables' temperatures, or train tables on banks at that temperature "
                f"too (python train.py data.train=[...,{bdir}] out_dir=DIR)")
        if facts["unrecorded_temperatures"]:
            notes.append(f"bank {bdir}: {facts['unrecorded_temperatures']} rounds of speculator.parquet have no "
                         "temperature (null or NaN); they were not checked against the tables' temperatures")
        return problems, notes

    def _ids_text(self) -> str:
        d = self.meta.get("chains", {})
        return "; ".join(f"{c}: {d[c].get('ids', 'ids not recorded')}" for c in sorted(d)) or "no drafter"

    def has_chain(self, chain: str) -> bool:
        """Whether these tables calibrate ``chain`` (a chain name)."""
        return chain in self.chains

    def feature_names(self, chain: str) -> list[str]:
        """The input features of ``chain``'s table, in the order an engine passes them ([] if absent)."""
        return [a.name for a in self.chains[chain].axes] if chain in self.chains else []

    def accept_prob(self, chain: str, inputs, depth: int | None = None) -> torch.Tensor:
        """Calibrated P(accept | reached) of ``chain`` for ``inputs`` [rounds, L, A] (or [rounds, L] for a
        one-axis chain; column = depth), NaN kept.

        With ``depth`` given, ``inputs`` is any shape ``[..., A]`` (``[...]`` for one axis) and every
        row is read at that depth, which must be one the tables hold (``0 <= depth < D``; any
        ``depth >= 0`` when ``reuse_last_row``). Inputs are float tensors, numpy arrays or lists
        (converted to float32); confidences are probabilities in ``[0, 1]`` (NaN = no token); anything
        else is a ``ValueError``. Returns float32 ``[rounds, L]`` (with ``depth``: ``inputs``' leading shape).
        """
        from calib.tables.layout import as_float_tensor

        table = self.table(chain)
        if depth is None:
            return table.lookup(inputs, chain)
        x = as_float_tensor(inputs, chain)
        n_depths = table.depths
        if isinstance(depth, bool) or not isinstance(depth, (int, np.integer)):
            raise TypeError(f"depth must be an int, got {depth!r}")
        if depth < 0 or (depth >= n_depths and not self.reuse_last_row):
            raise ValueError(f"depth={depth}: these tables hold {chain} depths 0..{n_depths - 1} "
                             f"({chain}.grid is [D={n_depths}, C]); deeper depths need tables fitted on "
                             "them, or tables built with reuse_last_row=True")
        one_axis = len(table.axes) == 1
        lead = x.shape if one_axis else x.shape[:-1]
        flat = x.reshape(-1, 1, *(() if one_axis else (x.shape[-1],)))
        row = ChainTable(table.axes, table.grid[min(int(depth), n_depths - 1)][None, :], table.edges, table.strides)
        return row.lookup(flat, chain).reshape(lead)


def _temps_text(temps) -> str:
    return "[" + ", ".join(f"{t:g}" for t in temps) + "]"


def _fitted_text(values, lo: float, hi: float, n_values: int) -> str:
    if n_values == len(values):
        return f"temperatures {_temps_text(values)}"
    return f"{n_values} temperatures in {lo:g}..{hi:g}"


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
