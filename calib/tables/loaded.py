"""Loaded tables: the allocator's grids with their ``tables.json`` metadata, and the checks of a bank, an
engine's temperature or a context against what the tables were fitted on (:class:`Tables`;
:func:`calib.tables.io.load` makes one)."""

from __future__ import annotations

import math
import numbers
import os
import warnings
from pathlib import Path

import numpy as np
import torch

from calib.bank import schema
from calib.chains import CONTEXT, chain_names, verified_chain
from calib.chains import chain as chain_kind
from calib.fingerprint import describe, is_fingerprint, same_model
from calib.params import finite_number
from calib.tables.layout import ChainTable, GridTables
from calib.tables.meta import TEMPERATURE_TOL, TablesError, TablesWarning
from calib.tables.provenance import _bank_facts, _has_confidence


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
        tdir, bdir, problems, notes = facts["tables"], facts["path"], [], []
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
            # a per-depth feature is its {name}{j} columns; one the chain kind fills in for older banks is noted
            missing = [f for f in feats if f not in cols and not schema.depth_columns(cols, f)]
            filled = [f for f in missing if name in chain_names() and f in chain_kind(name).filled_features]
            if filled:
                notes.append(f"bank {bdir}'s {file} was collected before calib recorded {filled}: the {name} "
                             f"chain reads them filled in (calib/chains/{name}.py); recollect it for tables that see them")
            missing = [f for f in missing if f not in filled]
            if missing:
                problems.append(f"{name} features: tables {tdir} read {feats}, bank {bdir}'s {file} lacks {missing}")
        return problems, notes

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


