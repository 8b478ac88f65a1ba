"""Validation of banks: every problem names the file, the column and the row."""

from __future__ import annotations

import math
import numbers
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from calib.bank import schema
from calib.bank.stats import acc_matrix, compare_stats, compute_stats
from calib.params import Interval, validate_params
from calib.sidefiles import SideFileError, field, read_json

# The optional side files are metadata: what is wrong with one is a finding, and the way out is
# to fix it or delete it (both are optional) or to recollect the bank.
_SIDE_HINT = "fix or delete the file (it is optional), or recollect the bank"
# run_manifest.json fields the validator compares with the data, and their JSON types.
MANIFEST_FIELDS: dict[str, type] = {"n_rounds": int, "model": str, "speculator": str, "config": str,
                                    "categories": list, "num_speculative_tokens": int, "routing": dict,
                                    "identity": dict}
# run_manifest.json "identity" (calib/fingerprint.py): the target's and drafter's fingerprints, method, K.
IDENTITY_ROLES = ("target", "drafter")
JOBS = ("train.py", "eval.py", "serve.py")  # the jobs whose output folders calib.atomic.staged_output publishes
TEMPERATURE_TOL = 1e-6  # a row's temperature and the manifest's are the same setting within this


@dataclass(frozen=True)
class Problem:
    file: str
    column: str | None
    row: int | None
    message: str

    def __str__(self) -> str:
        where = self.file
        if self.column is not None:
            where += f", column {self.column}"
        if self.row is not None:
            where += f", row {self.row}"
        return f"{where}: {self.message}"


class BankError(ValueError):
    """A bank that does not satisfy the layout. ``problems`` lists every finding."""

    def __init__(self, problems: list[Problem]):
        self.problems = problems
        head = "\n  ".join(str(p) for p in problems[:20])
        more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
        super().__init__(f"invalid bank ({len(problems)} problem(s)):\n  {head}{more}")


def _is_string(t: pa.DataType) -> bool:
    return pa.types.is_string(t) or pa.types.is_large_string(t) or (
        pa.types.is_dictionary(t) and _is_string(t.value_type)
    )


def _type_ok(actual: pa.DataType, expected: pa.DataType) -> bool:
    return _is_string(actual) if pa.types.is_string(expected) else actual == expected


class _Checker:
    def __init__(self, bank_dir: str, max_problems: int = 50):
        self.dir = bank_dir
        self.max = max_problems
        self.problems: list[Problem] = []
        self._json: dict[str, dict | None] = {}

    def add(self, file, column, row, message):
        if len(self.problems) < self.max:
            self.problems.append(Problem(os.path.join(self.dir, file), column, row, message))

    def first_bad(self, file, column, mask: np.ndarray, table: pa.Table, message: str) -> bool:
        """Report the first row where ``mask`` holds (with its keys and the count). True if any."""
        bad = np.flatnonzero(mask)
        if bad.size == 0:
            return False
        i = int(bad[0])
        keys = _row_keys(table, i)
        more = f" ({bad.size} rows in all)" if bad.size > 1 else ""
        self.add(file, column, i, f"{message} [{keys}]{more}")
        return True

    # -- structure ---------------------------------------------------------------------------
    def read(self, file: str, required: bool) -> pa.Table | None:
        path = os.path.join(self.dir, file)
        if not os.path.exists(path):
            if required:
                self.add(file, None, None, "missing file (a bank needs acceptance.parquet and "
                         "speculator.parquet)")
            return None
        try:
            return pq.read_table(path)
        except Exception as exc:  # noqa: BLE001 - any unreadable file is a finding, not a crash
            self.add(file, None, None, f"not a readable parquet file: {exc}")
            return None

    def columns(self, file: str, table: pa.Table, expected: dict[str, pa.DataType],
                required: bool = True) -> bool:
        ok = True
        for name, typ in expected.items():
            if name not in table.column_names:
                if required:
                    self.add(file, name, None, "missing column")
                    ok = False
                continue
            actual = table.schema.field(name).type
            if not _type_ok(actual, typ):
                self.add(file, name, None, f"dtype is {actual}, expected {typ}")
                ok = False
        return ok

    def keys(self, file: str, table: pa.Table) -> bool:
        if not self.columns(file, table, schema.KEY_TYPES):
            return False
        for k in schema.KEYS:
            self.first_bad(file, k, _null_mask(table.column(k)), table, "null key")
        dup = _duplicate_mask(table)
        self.first_bad(file, ",".join(schema.KEYS), dup, table, "duplicate key")
        return True

    def partners(self, file_a, a: pa.Table, file_b, b: pa.Table):
        """Every row of ``a`` must have a row with the same keys in ``b``."""
        ka, kb = _key_ids(a, b)
        missing = ~np.isin(ka, kb)
        self.first_bad(file_a, ",".join(schema.KEYS), missing, a, f"row has no partner in {file_b}")

    def per_depth_types(self, file: str, table: pa.Table):
        for prefix, (typ, home) in schema.PER_DEPTH.items():
            if home != file:
                continue
            for c in schema.depth_columns(table.column_names, prefix):
                actual = table.schema.field(c).type
                if actual != typ:
                    self.add(file, c, None, f"dtype is {actual}, expected {typ}")

    # -- content -----------------------------------------------------------------------------
    def prefix_mask(self, file: str, table: pa.Table, acc: np.ndarray, accept: np.ndarray,
                    acc_prefix: str = schema.ACC) -> np.ndarray:
        """Check an accept count against its acc mask; return the drafted width per row."""
        drafted = ~np.isnan(acc)
        width = drafted.sum(axis=1)
        depth = np.arange(acc.shape[1])
        cols = schema.depth_columns(table.column_names, acc_prefix)
        # Values other than 0/1.
        bad_val = drafted & (acc != 0) & (acc != 1)
        for k in np.flatnonzero(bad_val.any(axis=0)):
            self.first_bad(file, cols[k], bad_val[:, k], table, "acc value is not 0, 1 or null")
        # Drafted depths must be a prefix: no null followed by a non-null.
        gap = drafted & (np.cumsum(~drafted, axis=1) > 0)  # set after some shallower null
        for k in np.flatnonzero(gap.any(axis=0)):
            self.first_bad(file, cols[k], gap[:, k], table,
                           "acc is set after a null depth (drafted depths must be a prefix)")
        self.first_bad(file, "accept", accept < 0, table, "accept is negative")
        self.first_bad(file, "accept", accept > width, table,
                       "accept exceeds the drafted width (non-null acc columns)")
        expect = (depth[None, :] < accept[:, None]).astype(float)
        wrong = drafted & ~bad_val & (acc != expect)
        for k in np.flatnonzero(wrong.any(axis=0)):
            self.first_bad(file, cols[k], wrong[:, k], table,
                           "acc disagrees with accept (acc_k must be 1 iff k < accept, 0 at every "
                           "other drafted depth)")
        return width

    def confidences(self, file: str, table: pa.Table, width: np.ndarray):
        cols = schema.depth_columns(table.column_names, schema.CONF)
        if not cols:
            self.add(file, "conf0", None, "missing column (no conf{k} columns)")
            return
        conf = np.stack([_floats(table.column(c)) for c in cols], axis=1)
        present = ~np.isnan(conf) | _nan_not_null(table, cols)
        for k, c in enumerate(cols):
            v = table.column(c)
            raw = _floats(v, nulls_as_nan=False)
            valid = _valid_mask(v)
            self.first_bad(file, c, valid & np.isnan(raw), table, "NaN confidence (use null for 'none')")
            self.first_bad(file, c, valid & np.isinf(raw), table, "infinite confidence")
            with np.errstate(invalid="ignore"):
                self.first_bad(file, c, valid & ((raw < 0) | (raw > 1)), table,
                               "confidence outside [0, 1]")
        depth = np.arange(conf.shape[1])
        beyond = present & (depth[None, :] >= width[:, None])
        for k in np.flatnonzero(beyond.any(axis=0)):
            self.first_bad(file, cols[k], beyond[:, k], table,
                           "confidence at a depth that was not drafted (acc is null there)")
        # A drafter either reports a confidence for every drafted token of a round or none.
        any_conf = present.any(axis=1)
        hole = any_conf[:, None] & ~present & (depth[None, :] < width[:, None])
        for k in np.flatnonzero(hole.any(axis=0)):
            self.first_bad(file, cols[k], hole[:, k], table,
                           "null confidence at a drafted depth of a round that has confidences")

    def extensions(self, file: str, table: pa.Table, width: np.ndarray):
        rules = {"entropy": (0.0, np.inf), "margin": (0.0, 1.0), "tok": (0, np.inf)}
        for prefix, (lo, hi) in rules.items():
            for k, c in enumerate(schema.depth_columns(table.column_names, prefix)):
                v = _floats(table.column(c))
                with np.errstate(invalid="ignore"):
                    self.first_bad(file, c, ~np.isnan(v) & ((v < lo) | (v > hi)) | np.isinf(v) & (hi != np.inf),
                                   table, f"{prefix} outside [{lo}, {hi}]")
                self.first_bad(file, c, ~np.isnan(v) & (k >= width), table,
                               f"{prefix} at a depth that was not drafted")
        if "batch_size" in table.column_names:
            bs = _floats(table.column("batch_size"))
            self.first_bad(file, "batch_size", bs < 1, table, "batch_size below 1")
        if "logit_transforms" in table.column_names:  # null: not recorded; else known names, comma-joined
            from calib.transforms import NAMES, decode

            vals = table.column("logit_transforms").to_pylist()
            bad = np.array([v is not None and any(n not in NAMES for n in decode(v)) for v in vals], dtype=bool)
            self.first_bad(file, "logit_transforms", bad, table,
                           f"names other than {', '.join(NAMES)} (comma-joined; '' for none)")
        if "temperature" in table.column_names:  # null: not recorded; a value must be a temperature
            v = table.column("temperature")
            raw, valid = _floats(v, nulls_as_nan=False), _valid_mask(v)
            self.first_bad(file, "temperature", valid & np.isnan(raw), table,
                           "NaN temperature (write null where it is not known)")
            self.first_bad(file, "temperature", valid & np.isinf(raw), table, "infinite temperature")
            with np.errstate(invalid="ignore"):
                self.first_bad(file, "temperature", valid & (raw < 0), table,
                               "negative temperature (a sampling temperature is >= 0; 0 is greedy)")

    def chain_layouts(self) -> list:
        """The registered chain file layouts, and those the bank's run_manifest.json records (``chain_files``:
        what write_bank wrote) for files no registered kind describes here."""
        specs = {s.file: s for s in schema.chain_files()}
        recorded = (self.read_json(schema.MANIFEST) or {}).get("chain_files") or {}
        for file, d in recorded.items() if isinstance(recorded, dict) else ():
            if file in specs:
                continue
            try:
                specs[file] = schema.ChainFile.from_json(file, d)
            except (KeyError, TypeError, ValueError) as exc:
                self.add(schema.MANIFEST, "chain_files", None, f"{file}: not a chain file layout ({exc!r})")
        return list(specs.values())

    def chain_file(self, spec: schema.ChainFile, table: pa.Table, acceptance: pa.Table):
        """A chain kind's own bank file against its registered layout (:class:`calib.bank.schema.ChainFile`)."""
        f, length = spec.file, spec.length
        if not self.keys(f, table):
            return
        self.columns(f, table, spec.round_columns())
        if any(c not in table.column_names for c in (length, "accept", "label_source")):
            return
        self.partners(f, table, schema.ACCEPTANCE, acceptance)
        self.partners(schema.ACCEPTANCE, acceptance, f, table)
        n = _floats(table.column(length))
        self.first_bad(f, length, np.isnan(n) | (n < 0), table, f"{length} is null or negative")
        n = np.nan_to_num(n).astype(np.int64)
        toks = schema.depth_columns(table.column_names, spec.token)
        if toks:
            present = np.stack([~np.isnan(_floats(table.column(c))) for c in toks], axis=1)
            depth = np.arange(len(toks))
            self.first_bad(f, length, n > len(toks), table, f"{length} exceeds the {len(toks)} "
                           f"{spec.token} columns")
            wrong = present != (depth[None, :] < n[:, None])
            for k in np.flatnonzero(wrong.any(axis=0)):
                self.first_bad(f, toks[k], wrong[:, k], table,
                               f"{spec.token} must be set exactly on the first {length} depths")
            for prefix, (lo, hi) in spec.depth_features.items():
                for k, c in enumerate(schema.depth_columns(table.column_names, prefix)):
                    v = _floats(table.column(c))
                    on = k < n
                    self.first_bad(f, c, on & np.isnan(v), table, f"{prefix} is null at a depth of the chain")
                    self.first_bad(f, c, ~on & ~np.isnan(v), table, f"{prefix} is set beyond {length}")
                    with np.errstate(invalid="ignore"):
                        self.first_bad(f, c, (v < lo) | (v > hi) | np.isinf(v), table, f"{prefix} outside [{lo}, {hi}]")
        else:
            self.first_bad(f, length, n > 0, table, f"{length} is above 0 but the file has no "
                           f"{spec.token} columns (the chain's tokens)")
        src = np.asarray(table.column("label_source").to_pylist(), dtype=object)
        self.first_bad(f, "label_source", ~np.isin(src, schema.LABEL_SOURCES), table,
                       f"label_source not one of {schema.LABEL_SOURCES}")
        accept_raw = _floats(table.column("accept"))
        labelled = src != "none"
        self.first_bad(f, "accept", labelled & np.isnan(accept_raw), table,
                       "accept is null on a labelled chain")
        self.first_bad(f, "accept", ~labelled & ~np.isnan(accept_raw), table,
                       "accept is set but label_source is 'none'")
        if "verified" in table.column_names:
            ver = np.asarray(table.column("verified").to_pylist(), dtype=object) == True
            self.first_bad(f, "verified", ver & (src != "verified"), table,
                           "verified chain must have label_source 'verified'")
        acc = acc_matrix(table)
        if acc.shape[1]:
            width = self.prefix_mask(f, table, np.where(labelled[:, None], acc, np.nan),
                                     np.where(labelled, np.nan_to_num(accept_raw), 0).astype(np.int64))
            self.first_bad(f, length, labelled & (width > n), table, f"acc is set beyond {length}")
            self.first_bad(f, "acc0", ~labelled & ~np.isnan(acc).all(axis=1), table,
                           "acc is set but label_source is 'none'")
        for name, (typ, lo, hi) in spec.features.items():
            if name not in table.column_names or pa.types.is_boolean(typ):
                continue
            v = _floats(table.column(name))
            self.first_bad(f, name, (n > 0) & np.isnan(v), table, "feature is null on a non-empty chain")
            with np.errstate(invalid="ignore"):
                self.first_bad(f, name, (v < lo) | (v > hi) | np.isinf(v), table, f"feature outside [{lo:g}, {hi}]")

    def routing(self, acceptance: pa.Table, width: np.ndarray):
        has_npy = os.path.exists(os.path.join(self.dir, schema.ROUTING))
        meta = self.read(schema.ROUTING_META, required=has_npy)
        if not has_npy:
            if meta is not None:
                self.add(schema.ROUTING, None, None, "missing file (routing_meta.parquet is present)")
            return
        try:
            arr = np.load(os.path.join(self.dir, schema.ROUTING), mmap_mode="r", allow_pickle=False)
        except Exception as exc:  # noqa: BLE001
            self.add(schema.ROUTING, None, None, f"not a readable .npy array: {exc}")
            return
        if arr.dtype != np.uint8 or arr.ndim != 3:
            self.add(schema.ROUTING, None, None,
                     f"expected uint8 [N, layers, top_k], found {arr.dtype} with shape {arr.shape}")
            return
        self.routing_array(arr)
        if meta is None:
            return
        f = schema.ROUTING_META
        if not self.columns(f, meta, {**schema.KEY_TYPES, **schema.ROUTING_META_COLUMNS}):
            return
        before = len(self.problems)  # the meta checks below need sound columns, not a sound array
        for name in schema.ROUTING_META_COLUMNS:
            self.first_bad(f, name, _null_mask(meta.column(name)), meta, "null value")
        if len(self.problems) > before:
            return
        idx = _floats(meta.column("routing_idx"))
        self.first_bad(f, "routing_idx", (idx < 0) | (idx >= arr.shape[0]), meta,
                       f"routing_idx outside [0, {arr.shape[0]})")
        _, first = np.unique(idx, return_index=True)
        dup = np.ones(len(idx), dtype=bool)
        dup[first] = False
        self.first_bad(f, "routing_idx", dup, meta, "duplicate routing_idx")
        if meta.num_rows != arr.shape[0]:
            self.add(f, "routing_idx", None, f"{meta.num_rows} rows describe the {arr.shape[0]} rows of "
                     f"{schema.ROUTING} (every routing row needs exactly one meta row)")
        for name in ("routing_block_idx", "request_idx", "position"):
            self.first_bad(f, name, _floats(meta.column(name)) < 0, meta, f"{name} is negative")
        self.partners(f, meta, schema.ACCEPTANCE, acceptance)
        if len(self.problems) > before:
            return
        self.routing_blocks(meta, acceptance, width)

    def routing_array(self, arr: np.ndarray):
        """Expert ids: distinct within a (position, layer), below the manifest's n_experts."""
        info = (self.read_json(schema.MANIFEST) or {}).get("routing")
        info = info if isinstance(info, dict) else {}
        f = schema.ROUTING
        for name, axis in (("layers", 1), ("top_k", 2)):
            if isinstance(info.get(name), int) and info[name] != arr.shape[axis]:
                self.add(schema.MANIFEST, f"routing.{name}", None,
                         f"says {info[name]}, {f} has {arr.shape[axis]} (shape {arr.shape})")
        if arr.shape[0] == 0 or arr.shape[2] == 0:
            return
        for lo in range(0, arr.shape[0], 1 << 16):  # chunks: a large capture stays memory-mapped
            chunk = np.sort(np.asarray(arr[lo: lo + (1 << 16)]), axis=2)
            rep = (np.diff(chunk, axis=2) == 0).any(axis=2)
            if rep.any():
                i, layer = np.argwhere(rep)[0]
                self.add(f, f"layer {layer}", int(lo + i), "the same expert id appears twice among the top_k")
                break
            n_exp = info.get("n_experts")
            if isinstance(n_exp, int) and (chunk[..., -1] >= n_exp).any():
                i, layer = np.argwhere(chunk[..., -1] >= n_exp)[0]
                self.add(f, f"layer {layer}", int(lo + i),
                         f"expert id {int(chunk[i, layer, -1])} >= n_experts {n_exp} (run_manifest.json)")
                break

    def routing_blocks(self, meta: pa.Table, acceptance: pa.Table, width: np.ndarray):
        """Per round: one request, distinct block indices within the verified width, consecutive
        positions, and an ``accepted`` prefix that agrees with the round's accept count."""
        import pandas as pd

        f = schema.ROUTING_META
        rows = _partner_rows(meta, acceptance)
        accept = acceptance.column("accept").to_numpy(zero_copy_only=False).astype(np.int64)
        df = pd.DataFrame({
            "round": rows,
            "block": meta.column("routing_block_idx").to_numpy(zero_copy_only=False).astype(np.int64),
            "request": meta.column("request_idx").to_numpy(zero_copy_only=False).astype(np.int64),
            "position": meta.column("position").to_numpy(zero_copy_only=False).astype(np.int64),
            "accepted": meta.column("accepted").to_numpy(zero_copy_only=False).astype(bool),
        })
        block = df["block"].to_numpy()
        self.first_bad(f, "routing_block_idx", block > width[rows], meta,
                       "routing_block_idx beyond the round's drafted width (block = 1 + drafted positions)")
        dup = df.duplicated(["round", "block"]).to_numpy()
        self.first_bad(f, "routing_block_idx", dup, meta, "duplicate routing_block_idx within a round")
        g = df.groupby("round")
        self.first_bad(f, "request_idx", (g["request"].transform("nunique") > 1).to_numpy(), meta,
                       "a round's rows name more than one request_idx")
        start = df["position"] - df["block"]
        self.first_bad(f, "position", (start.groupby(df["round"]).transform("nunique") > 1).to_numpy(), meta,
                       "positions of a round are not block start + routing_block_idx")
        # accepted must be a prefix in block order: no accepted row after a rejected one.
        order = df.sort_values(["round", "block"])
        rejected_before = (~order["accepted"]).astype(int).groupby(order["round"]).cumsum() - (~order["accepted"])
        gap = pd.Series(order["accepted"].to_numpy() & (rejected_before.to_numpy() > 0), index=order.index)
        self.first_bad(f, "accepted", gap.sort_index().to_numpy(), meta,
                       "accepted after a rejected position of the same round (must be a prefix)")
        n_acc = g["accepted"].transform("sum").to_numpy()
        want = accept[rows]
        self.first_bad(f, "accepted", (n_acc != want) & (n_acc != want + 1), meta,
                       "the round's accepted positions disagree with acceptance.parquet's accept "
                       "(expected accept or accept + 1)")

    def read_json(self, file: str) -> dict | None:
        """An optional JSON object beside the parquet files (None if absent or unusable: then a
        finding names the file and what is wrong). Read once per validation."""
        if file not in self._json:
            try:
                self._json[file] = read_json(os.path.join(self.dir, file), dict, missing_ok=True)
            except SideFileError as exc:
                self.add(file, None, None, f"{exc.problem}; {_SIDE_HINT}")
                self._json[file] = None
        return self._json[file]

    def manifest(self, acceptance: pa.Table):
        m = self.read_json(schema.MANIFEST)
        if m is None:
            return
        typed = {}
        for key, kind in MANIFEST_FIELDS.items():
            try:
                typed[key] = field(m, key, kind, schema.MANIFEST)
            except SideFileError as exc:
                self.add(schema.MANIFEST, key, None, f"{exc.problem}; {_SIDE_HINT}")
        cats = typed.get("categories")
        if cats is not None and not all(isinstance(c, str) for c in cats):
            bad = next(c for c in cats if not isinstance(c, str))
            self.add(schema.MANIFEST, "categories", None,
                     f"holds {bad!r} ({type(bad).__name__}); expected a list of category names (strings)")
            cats = None
        routing = typed.get("routing")
        for key, kind in schema.ROUTING_INFO.items():
            if routing is None:
                break
            try:
                value = field(routing, key, kind, schema.MANIFEST)
            except SideFileError as exc:
                self.add(schema.MANIFEST, f"routing.{key}", None,
                         f"{exc.problem.replace(repr(key), repr('routing.' + key))}; {_SIDE_HINT}")
                continue
            if kind is int and value is not None and value < 1:
                self.add(schema.MANIFEST, f"routing.{key}", None, f"is {value}, expected an integer >= 1")
        self.identity(typed.get("identity"), typed.get("num_speculative_tokens"))
        n = typed.get("n_rounds")
        if n is not None and n != acceptance.num_rows:
            self.add(schema.MANIFEST, "n_rounds", None,
                     f"says {n} rounds, acceptance.parquet has {acceptance.num_rows}")
        for key in ("model", "speculator", "config"):
            if typed.get(key) is not None:
                values = set(pc.unique(acceptance.column(key)).to_pylist())
                if values != {typed[key]}:
                    self.add(schema.MANIFEST, key, None,
                             f"says {typed[key]!r}, the data hold {sorted(map(str, values))}")
        if cats is not None:
            values = set(pc.unique(acceptance.column("category")).to_pylist())
            if not values <= set(cats):
                self.add(schema.MANIFEST, "categories", None,
                         f"lists {cats}, the data hold {sorted(values)}")
        k = typed.get("num_speculative_tokens")
        if k is not None:
            d = schema.width(acceptance.column_names)
            if k < 1:
                self.add(schema.MANIFEST, "num_speculative_tokens", None, f"is {k}, expected an integer >= 1")
            elif k > d:
                self.add(schema.MANIFEST, "num_speculative_tokens", None,
                         f"says {k}, the bank has {d} acc columns")

    def sampling(self, spec: pa.Table):
        """The manifest's ``sampling.temperature`` against speculator.parquet's ``temperature`` column: rows at
        another temperature than the manifest says are two collections under one name (the tables would fit
        a temperature axis the bank's name and config deny)."""
        m = self.read_json(schema.MANIFEST)
        sampling = m.get("sampling") if m is not None else None
        if not isinstance(sampling, dict) or sampling.get("temperature") is None:
            return
        t = sampling["temperature"]
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            self.add(schema.MANIFEST, "sampling.temperature", None,
                     f"is {t!r}, expected a finite number >= 0 (0: greedy); {_SIDE_HINT}")
            return
        if "temperature" not in spec.column_names:
            return
        v = spec.column("temperature")
        raw, valid = _floats(v, nulls_as_nan=False), _valid_mask(v)
        with np.errstate(invalid="ignore"):
            off = valid & np.isfinite(raw) & (np.abs(raw - t) > TEMPERATURE_TOL)
        if off.any():
            i = int(np.flatnonzero(off)[0])
            self.first_bad(schema.SPECULATOR, "temperature", off, spec,
                           f"temperature {raw[i]:g}, but {schema.MANIFEST} says sampling.temperature = {t:g}: "
                           "rows of another collection in this bank, or a wrong manifest; recollect the bank or "
                           "keep the two temperatures in two banks")

    def outputs_inside(self):
        """A job's output folder inside the bank (``train.py out_dir=<bank>/sub`` wrote tables there before calib
        refused outputs inside inputs, calib.atomic.check_not_inside_an_input): named, with its job."""
        from calib.atomic import OWNED, owner

        for record in sorted(Path(self.dir).rglob(OWNED)):
            job = owner(record.parent)
            if record.parent != Path(self.dir) and job in JOBS:  # the bank's own record (write_bank) is at its top
                rel = record.parent.relative_to(self.dir).as_posix()
                self.add(rel, None, None, f"holds the output of {job} inside this bank; move that folder out of "
                                          "the bank (outputs never go inside an input)")

    def identity(self, ident: dict | None, k: int | None):
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
                self.add(schema.MANIFEST, f"identity.{role}", None,
                         f"is {str(fp)[:80]!r}; expected null or a fingerprint object with {', '.join(IDENTITY_KEYS)} "
                         f"(calib/fingerprint.py); {_SIDE_HINT}")
        n = ident.get("num_speculative_tokens")
        if n is not None and k is not None and n != k:
            self.add(schema.MANIFEST, "identity.num_speculative_tokens", None,
                     f"says {n}, num_speculative_tokens says {k}")

    def stats(self, acceptance: pa.Table):
        claimed = self.read_json(schema.STATS)
        if claimed is None:
            return
        for d in compare_stats(claimed, compute_stats(acceptance)):
            self.add(schema.STATS, d.split(" ")[0].removeprefix("stats."), None, d)


def validate(bank_dir: str, max_problems: int = 50) -> list[Problem]:
    """All problems found in the bank at ``bank_dir`` (empty list: valid), at most ``max_problems``
    (>= 1: a validator that may report nothing would call every bank valid)."""
    validate_params("calib.bank.validate", {"max_problems": max_problems},
                    {"max_problems": [Interval(numbers.Integral, 1, None)]})
    ck = _Checker(str(bank_dir), max_problems)
    if not os.path.isdir(bank_dir):
        ck.add("", None, None, "not a directory")
        return ck.problems
    acc_t = ck.read(schema.ACCEPTANCE, required=True)
    spec_t = ck.read(schema.SPECULATOR, required=True)
    if acc_t is None or spec_t is None:
        return ck.problems
    A, S = schema.ACCEPTANCE, schema.SPECULATOR
    if acc_t.num_rows == 0:
        ck.add(A, None, None, "empty bank (no rounds)")
    keys_ok = ck.keys(A, acc_t) & ck.keys(S, spec_t)
    d = schema.width(acc_t.column_names)
    if d == 0:
        ck.add(A, "acc0", None, "missing column (no acc{k} columns)")
    for k in range(d):
        if schema.col(schema.ACC, k) not in acc_t.column_names:
            ck.add(A, schema.col(schema.ACC, k), None, f"missing column (bank width is {d})")
        if schema.col(schema.CONF, k) not in spec_t.column_names:
            ck.add(S, schema.col(schema.CONF, k), None, f"missing column (bank width is {d})")
    if schema.width(spec_t.column_names, schema.CONF) > d:
        ck.add(S, schema.col(schema.CONF, schema.width(spec_t.column_names, schema.CONF) - 1), None,
               f"more conf columns than acc columns ({d})")
    accept_ok = ck.columns(A, acc_t, {"accept": pa.int64()})
    ck.per_depth_types(A, acc_t)
    ck.per_depth_types(S, spec_t)
    ck.columns(S, spec_t, {n: t for n, (t, f, _) in schema.ROUND_COLUMNS.items() if f == S}, required=False)
    if ck.problems:  # content checks need sound structure
        return ck.problems
    ck.first_bad(A, "accept", _null_mask(acc_t.column("accept")), acc_t, "null accept")
    if keys_ok:
        ck.partners(A, acc_t, S, spec_t)
        ck.partners(S, spec_t, A, acc_t)
    if ck.problems or not accept_ok:
        return ck.problems
    accept = acc_t.column("accept").to_numpy(zero_copy_only=False).astype(np.int64)
    width = ck.prefix_mask(A, acc_t, acc_matrix(acc_t), accept)
    # Drafted widths in speculator row order, so findings name speculator.parquet's own rows.
    spec_width = width[_partner_rows(spec_t, acc_t)]
    ck.confidences(S, spec_t, spec_width)
    ck.extensions(S, spec_t, spec_width)
    for spec in ck.chain_layouts():  # each chain kind's own file, by its registered (or recorded) layout
        chain_t = ck.read(spec.file, required=False)
        if chain_t is not None:
            ck.chain_file(spec, chain_t, acc_t)
    ck.routing(acc_t, width)
    ck.manifest(acc_t)
    ck.sampling(spec_t)
    ck.outputs_inside()
    if not ck.problems:  # stats are recomputed from data already known to be sound
        ck.stats(acc_t)
    return ck.problems


def check(bank_dir: str) -> None:
    """Raise :class:`BankError` if the bank at ``bank_dir`` is invalid."""
    problems = validate(bank_dir)
    if problems:
        raise BankError(problems)


# -- helpers -------------------------------------------------------------------------------------
def _null_mask(column: pa.ChunkedArray) -> np.ndarray:
    return column.is_null().to_numpy(zero_copy_only=False)


def _valid_mask(column: pa.ChunkedArray) -> np.ndarray:
    return ~_null_mask(column)


def _floats(column: pa.ChunkedArray, nulls_as_nan: bool = True) -> np.ndarray:
    """A numeric column as float64 with nulls as NaN (genuine NaN values stay NaN too)."""
    arr = column.to_numpy(zero_copy_only=False)
    if arr.dtype == object:
        arr = np.array([np.nan if v is None else v for v in arr], dtype=np.float64)
    return arr.astype(np.float64)


def _nan_not_null(table: pa.Table, cols: list[str]) -> np.ndarray:
    """True where a float column holds a genuine NaN (not a null): those count as present."""
    out = []
    for c in cols:
        v = table.column(c)
        out.append(_valid_mask(v) & np.isnan(_floats(v)))
    return np.stack(out, axis=1)


def _key_ids(*tables: pa.Table) -> list[np.ndarray]:
    """One int64 id per row for the bank keys, comparable across ``tables`` (vectorised: a
    million-row bank is checked in seconds, not minutes)."""
    import pandas as pd

    sizes = [t.num_rows for t in tables]
    ids = np.zeros(sum(sizes), dtype=np.int64)
    for k in schema.KEYS:
        if pa.types.is_string(schema.KEY_TYPES[k]):  # strings are coded by Arrow, not as Python objects
            col = pa.chunked_array([c for t in tables for c in pc.cast(t.column(k), pa.string()).chunks],
                                   type=pa.string()).combine_chunks()
            enc = pc.dictionary_encode(col)
            codes, n_unique = enc.indices.to_numpy(zero_copy_only=False), len(enc.dictionary)
        else:
            values = np.concatenate([t.column(k).to_numpy(zero_copy_only=False) for t in tables])
            codes, uniques = pd.factorize(values, use_na_sentinel=False)
            n_unique = len(uniques)
        # Re-factorise the running id after each column so it never overflows.
        ids, _ = pd.factorize(ids * (n_unique + 1) + codes)
        ids = ids.astype(np.int64)
    return np.split(ids, np.cumsum(sizes)[:-1])


def _duplicate_mask(table: pa.Table) -> np.ndarray:
    (ids,) = _key_ids(table)
    _, first = np.unique(ids, return_index=True)
    dup = np.ones(len(ids), dtype=bool)
    dup[first] = False
    return dup


def _partner_rows(table: pa.Table, acceptance: pa.Table) -> np.ndarray:
    """For each row of ``table``, the acceptance row with the same keys (verified to exist)."""
    import pandas as pd

    ids_t, ids_a = _key_ids(table, acceptance)
    return pd.Index(ids_a).get_indexer(ids_t)


def _row_keys(table: pa.Table, i: int) -> str:
    parts = []
    for k in ("category", "prompt_idx", "turn", "round_idx"):
        if k in table.column_names:
            parts.append(f"{k}={table.column(k)[i].as_py()}")
    return ", ".join(parts)
