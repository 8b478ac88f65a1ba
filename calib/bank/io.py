"""Reading and writing banks: atomic writes, lazy null-padded unions of banks of any width."""

from __future__ import annotations

import logging
import os
import shutil
import warnings
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from calib.atomic import (
    check_replaceable,
    publish_dir,
    resolve_target,
    sha256_file,
    staging_dir,
    write_json_atomic,
)
from calib.bank import schema
from calib.bank.stats import compute_stats
from calib.bank.validate import BankError, Problem, validate
from calib.sidefiles import read_json

log = logging.getLogger("calib.bank")


def _canonical(table: pa.Table, file: str) -> pa.Table:
    """Cast known columns to their schema types (e.g. int64 -> int8 for acc); keys first."""
    fields = [pa.field(n, schema.column_type(n, file) or table.schema.field(n).type) for n in table.column_names]
    table = table.cast(pa.schema(fields))
    keys = [k for k in schema.KEYS if k in table.column_names]
    return table.select(keys + [c for c in table.column_names if c not in keys])


BANK_JOB = "calib.bank.write_bank"  # the job named in a bank folder's ownership record


def write_bank(bank_dir: str | os.PathLike, acceptance: pa.Table, speculator: pa.Table,
               *chain_tables: pa.Table | None, manifest: dict | None = None,
               overwrite: bool = False, routing: tuple[np.ndarray, pa.Table] | None = None) -> Path:
    """Write a bank atomically: a temp folder beside ``bank_dir``, validated, then renamed.

    An existing ``bank_dir`` is replaced only with ``overwrite`` and only if it is a bank this function
    wrote, unchanged since (:func:`calib.atomic.check_replaceable`); anything else is refused, naming
    what else the folder holds.

    ``chain_tables``: each chain kind's own file (None: skipped), named by the registered layout whose length
    column it holds (:func:`calib.bank.schema.chain_file_of`). ``stats.json`` is computed from the data. A bank that fails validation is not written.
    ``routing`` = (uint8 [N, layers, top_k] expert ids, routing_meta table) adds a routing capture
    (describe it in ``manifest["routing"]``, see :data:`schema.ROUTING_INFO`).
    """
    bank_dir = resolve_target(bank_dir)
    # Only a bank calib wrote (its ownership record lists exactly what the folder holds) is replaced.
    check_replaceable(bank_dir, job=BANK_JOB, overwrite=overwrite, what="bank folder")
    tmp = staging_dir(bank_dir)
    try:
        acceptance = _canonical(acceptance, schema.ACCEPTANCE)
        pq.write_table(acceptance, tmp / schema.ACCEPTANCE)
        pq.write_table(_canonical(speculator, schema.SPECULATOR), tmp / schema.SPECULATOR)
        layouts = {}  # file -> its layout, recorded in the manifest: the bank names its own chain files
        for table in chain_tables:
            if table is not None:
                spec = schema.chain_file_of(table)
                if spec.file in layouts:
                    raise ValueError(f"two chain tables for {spec.file}")
                layouts[spec.file] = spec.to_json()
                pq.write_table(_canonical(table, spec.file), tmp / spec.file)
        if manifest is not None and layouts:
            manifest = {**manifest, "chain_files": layouts}
        if routing is not None:
            experts, meta = routing
            if experts.dtype != np.uint8 or experts.ndim != 3:
                raise ValueError(f"routing: expected uint8 [N, layers, top_k], got {experts.dtype} "
                                 f"{experts.shape}")
            np.save(tmp / schema.ROUTING, np.ascontiguousarray(experts), allow_pickle=False)
            pq.write_table(_canonical(meta, schema.ROUTING_META), tmp / schema.ROUTING_META)
        if manifest is not None:
            write_json_atomic(tmp / schema.MANIFEST, {**manifest, "n_rounds": acceptance.num_rows})
        problems = validate(str(tmp))
        if problems:
            raise BankError([Problem(p.file.replace(str(tmp), str(bank_dir)), p.column, p.row, p.message)
                             for p in problems])
        write_json_atomic(tmp / schema.STATS, compute_stats(acceptance))
        publish_dir(tmp, bank_dir, job=BANK_JOB, overwrite=overwrite, what="bank folder")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return bank_dir


class Routing:
    """A bank's routing capture: ``experts`` uint8 [N, layers, top_k] (memory-mapped), ``meta``
    (routing_meta.parquet) and ``info`` (run_manifest.json's "routing" object, {} if absent)."""

    def __init__(self, experts: np.ndarray, meta: pa.Table, info: dict):
        self.experts, self.meta, self.info = experts, meta, info

    @property
    def n_experts(self) -> int:
        """From the manifest, else 1 + the largest id seen."""
        return int(self.info.get("n_experts") or int(np.asarray(self.experts).max()) + 1)

    @property
    def top_k(self) -> int:
        return int(self.experts.shape[2])

    @property
    def layers(self) -> int:
        return int(self.experts.shape[1])


def read_routing(bank_dir: str | os.PathLike, validate_on_open: bool = True) -> Routing:
    """The routing capture of the bank at ``bank_dir`` (validated with the bank by default)."""
    bank_dir = Path(bank_dir)
    if not (bank_dir / schema.ROUTING).exists():
        raise FileNotFoundError(f"{bank_dir / schema.ROUTING}: missing file (the bank has no routing capture)")
    if validate_on_open:
        problems = validate(str(bank_dir))
        if problems:
            raise BankError(problems)
    experts = np.load(bank_dir / schema.ROUTING, mmap_mode="r", allow_pickle=False)
    meta = pq.read_table(bank_dir / schema.ROUTING_META)
    manifest = read_json(bank_dir / schema.MANIFEST, missing_ok=True,
                         hint="fix or delete run_manifest.json, or recollect the bank") or {}
    info = manifest.get("routing", {})
    return Routing(experts, meta, info if isinstance(info, dict) else {})


def is_bank(path: str | os.PathLike) -> bool:
    return (Path(path) / schema.ACCEPTANCE).exists()


class DuplicateBankWarning(UserWarning):
    """A bank listed more than once (the same folder, a symlink to it, or a copy of it): counted once."""


def fingerprint(bank_dir: str | os.PathLike) -> str:
    """A bank's content identity: the sha256 of its acceptance.parquet (what tables.json records as
    ``banks[].acceptance_sha256``). A copy or a move of a bank keeps it."""
    return sha256_file(Path(bank_dir) / schema.ACCEPTANCE)


def _drop(dup: Path, kept: Path, why: str) -> None:
    if os.path.abspath(dup) == os.path.abspath(kept):
        msg = f"bank {dup} is listed twice; it is used once"
    else:
        msg = f"bank {dup} {why} bank {kept}; {dup} is dropped and {kept} used once"
    msg += " (its rounds would otherwise count twice; list each bank once to silence this)"
    log.warning("%s", msg)
    warnings.warn(msg, DuplicateBankWarning, stacklevel=4)


def unique_banks(banks: Iterable[str | os.PathLike], by_content: bool = True) -> list[Path]:
    """``banks`` with every repeat dropped (a :class:`DuplicateBankWarning` and a ``calib.bank`` log
    warning naming both paths): the same resolved path (the same folder twice, a symlink to it), then,
    with ``by_content``, the same content (a copy: identical acceptance.parquet). The first listed is
    kept. Only banks whose acceptance.parquet sizes collide are hashed."""
    by_path: dict[str, Path] = {}
    out: list[Path] = []
    for b in map(Path, banks):
        real = os.path.realpath(b)
        if real in by_path:
            kept = by_path[real]
            _drop(b, kept, f"resolves to {real}, the same folder as")
            continue
        by_path[real] = b
        out.append(b)
    if not by_content:
        return out
    sizes: dict[int, list[Path]] = {}
    for b in out:
        sizes.setdefault((b / schema.ACCEPTANCE).stat().st_size, []).append(b)
    dropped: set[Path] = set()
    for group in sizes.values():
        if len(group) < 2:
            continue
        seen: dict[str, Path] = {}
        for b in group:
            digest = fingerprint(b)
            if digest in seen:
                _drop(b, seen[digest], f"is a copy (the same {schema.ACCEPTANCE}, sha256 {digest[:12]}) of")
                dropped.add(b)
            else:
                seen[digest] = b
    return [b for b in out if b not in dropped]


def find_banks(paths: str | os.PathLike | Iterable[str | os.PathLike], dedupe: bool = True) -> list[Path]:
    """Bank folders named by ``paths``: bank folders themselves, or folders holding banks (1 level).

    A bank named twice (directly, through a symlink, or as a copy) is kept once (see
    :func:`unique_banks`) unless ``dedupe`` is False."""
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    found: list[Path] = []
    for p in map(Path, paths):
        if is_bank(p):
            found.append(p)
        elif p.is_dir() and (subs := sorted(s for s in p.iterdir() if is_bank(s))):
            found.extend(subs)
        else:
            raise FileNotFoundError(f"{p}: not a bank (no {schema.ACCEPTANCE}) and holds no bank folders")
    return unique_banks(found) if dedupe and len(found) > 1 else found


class OverlappingBanksError(ValueError):
    """Two banks hold rounds with the same keys: the same rounds collected (or copied) twice."""


def check_disjoint(banks: Sequence[str | os.PathLike]) -> None:
    """Refuse (:class:`OverlappingBanksError`, a ValueError) banks that share a round key
    (:data:`schema.KEYS`): the same rounds collected twice, which a union would count twice (and a
    join would multiply). Reads only the key columns of acceptance.parquet."""
    import pyarrow.compute as pc

    banks = [Path(b) for b in banks]
    if len(banks) < 2:
        return
    key_schema = pa.schema([pa.field(k, schema.KEY_TYPES[k]) for k in schema.KEYS])
    parts = []
    for i, b in enumerate(banks):
        path = b / schema.ACCEPTANCE
        names = pq.read_schema(path).names
        missing = [k for k in schema.KEYS if k not in names]
        if missing:
            raise ValueError(f"{path}: missing key column(s) {missing}; validate the bank "
                             f"(python -m calib.bank validate {b})")
        t = pq.read_table(path, columns=list(schema.KEYS))
        try:
            t = pa.table([pc.cast(t.column(k), schema.KEY_TYPES[k]) for k in schema.KEYS], schema=key_schema)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
            raise ValueError(f"{path}: key columns of the wrong type ({exc}); validate the bank "
                             f"(python -m calib.bank validate {b})") from exc
        parts.append(t.append_column("bank", pa.array(np.full(t.num_rows, i, dtype=np.int32))))
    table = pa.concat_tables(parts)
    groups = pa.TableGroupBy(table, list(schema.KEYS), use_threads=False).aggregate(
        [("bank", "min"), ("bank", "max")])
    shared = groups.filter(pc.not_equal(groups.column("bank_min"), groups.column("bank_max")))
    if shared.num_rows == 0:
        return
    a, b = shared.column("bank_min")[0].as_py(), shared.column("bank_max")[0].as_py()
    first = ", ".join(f"{k}={shared.column(k)[0].as_py()!r}" for k in schema.KEYS)
    pair = pc.and_(pc.equal(shared.column("bank_min"), a), pc.equal(shared.column("bank_max"), b))
    between = pc.sum(pair.cast(pa.int64())).as_py()
    others = (f" ({shared.num_rows} keys are shared among the {len(banks)} banks in all)"
              if shared.num_rows != between else "")
    raise OverlappingBanksError(
        f"banks {banks[a]} and {banks[b]} share {between} round key(s){others}; first: {first}. "
        f"The same rounds were collected (or copied) twice and would be counted twice: drop one of the two "
        f"banks from the list (or recollect one with another config / prompt set)")


class Bank:
    """One bank or a union of several, read lazily: nothing is loaded until a table is asked for.

    Banks of different widths D are null-padded to the widest; column subsets may be asked for so
    that a million rounds fit in a few GB.

    With ``judged_only`` every table leaves out the rounds whose request carried target-only logit
    transforms (speculator.parquet ``logit_transforms`` non-empty, calib/transforms.py): they accept
    differently from what calib's tables describe. Banks without the column lose nothing.
    """

    def __init__(self, paths, validate_on_open: bool = True, judged_only: bool = False):
        self.judged_only = bool(judged_only)
        self.paths = find_banks(paths)  # deduplicated: a bank listed twice (or a copy) counts once
        if validate_on_open:
            for p in self.paths:
                problems = validate(str(p))
                if problems:
                    raise BankError(problems)
        check_disjoint(self.paths)

    def __repr__(self) -> str:
        return f"Bank({[str(p) for p in self.paths]})"

    def manifests(self) -> list[dict]:
        return [read_json(p / schema.MANIFEST, missing_ok=True,
                          hint="fix or delete run_manifest.json, or recollect the bank") or {}
                for p in self.paths]

    def has(self, file: str) -> bool:
        return all((p / file).exists() for p in self.paths)

    def table(self, file: str, columns: Sequence[str] | None = None) -> pa.Table:
        """The union of ``file`` over the banks, null-padded; ``columns`` limits what is read."""
        parts = []
        for p in self.paths:
            path = p / file
            if not path.exists():
                raise FileNotFoundError(f"{path} is missing (needed for this union)")
            names = pq.read_schema(path).names
            cols = None if columns is None else [c for c in columns if c in names]
            parts.append(pq.read_table(path, columns=cols))
        table = pa.concat_tables(parts, promote_options="default")
        if columns is not None:
            for c in columns:
                if c not in table.column_names:
                    raise KeyError(f"column {c!r} is in none of {[str(p / file) for p in self.paths]}")
        return self._judged(table)

    def transformed_keys(self) -> pa.Table:
        """The keys of the rounds whose request carried target-only logit transforms (empty without any)."""
        import pyarrow.compute as pc

        from calib.transforms import COLUMN

        parts = []
        for p in self.paths:
            path = p / schema.SPECULATOR
            if COLUMN not in pq.read_schema(path).names:
                continue
            t = pq.read_table(path, columns=[*schema.KEYS, COLUMN])
            v = t.column(COLUMN)
            keep = pc.and_(pc.is_valid(v), pc.not_equal(pc.fill_null(v, ""), ""))
            parts.append(t.filter(keep).select(list(schema.KEYS)))
        if not parts:
            return pa.table({k: pa.array([], type=schema.KEY_TYPES[k]) for k in schema.KEYS})
        return pa.concat_tables(parts, promote_options="default")

    def _judged(self, table: pa.Table) -> pa.Table:
        """``table`` without the transformed rounds when ``judged_only`` (rows in their order)."""
        if not self.judged_only or not all(k in table.column_names for k in schema.KEYS):
            return table
        excluded = self.transformed_keys()
        if excluded.num_rows == 0:
            return table
        from calib.bank.arrays import key_ids as _key_ids

        ids, bad = _key_ids(table.select(list(schema.KEYS)), excluded)
        return table.filter(pa.array(~np.isin(ids, bad)))

    def rounds(self, columns: Sequence[str] | None = None, chains: Iterable = ()) -> pa.Table:
        """acceptance ⋈ speculator (⋈ each of ``chains``' own bank file) on the bank keys.

        ``chains`` are objects describing a chain's join (duck-typed: :class:`calib.chains.ChainKind`):
        ``bank_file`` (None: no file of its own) is left-joined where every folder of the bank has it,
        its columns renamed ``column_prefix + name`` (``ng_`` for ngram.parquet); a chain the bank does
        not record adds nothing.

        The join and sort of every column (``columns=None``, no chain file) is kept while the bank's
        acceptance and speculator files are unchanged (size and mtime): a later call, for every
        column or a subset, selects from it (same rows, order and column order as its own join would
        give; keys are unique in a valid bank) instead of joining and sorting again (~6 s per call at
        a million rounds; train.py asks three times)."""
        keys = list(schema.KEYS)
        joins = [(c.bank_file, c.column_prefix) for c in chains
                 if getattr(c, "bank_file", None) is not None and self.has(c.bank_file)]
        acc_cols = spec_cols = None
        if columns is not None:
            acc_cols = keys + [c for c in columns if c == "accept" or c.startswith(schema.ACC)]
            spec_cols = keys + [c for c in columns if c not in acc_cols]
        if not joins:
            cached = self._cached_rounds()
            if cached is not None:
                if columns is None:
                    return self._judged(cached)
                names = acc_cols + [c for c in spec_cols if c not in keys]
                if all(c in cached.column_names for c in names):
                    return self._judged(cached.select(names))
        judged, self.judged_only = self.judged_only, False  # the whole join is cached; filtered on return
        try:
            acc = self.table(schema.ACCEPTANCE, acc_cols)
            spec = self.table(schema.SPECULATOR, spec_cols)
        finally:
            self.judged_only = judged
        out = acc.join(spec, keys=keys, join_type="inner")
        for file, prefix in joins:
            own = self.table(file)
            own = own.rename_columns([c if c in keys else f"{prefix}{c}" for c in own.column_names])
            out = out.join(own, keys=keys, join_type="left outer")
        out = out.sort_by([(k, "ascending") for k in keys])
        if columns is None and not joins:
            self._rounds_cache = (self._rounds_stamp(), out)
        return self._judged(out)

    def _rounds_stamp(self) -> tuple:
        return tuple((str(p / f), (p / f).stat().st_size, (p / f).stat().st_mtime_ns)
                     for p in self.paths for f in (schema.ACCEPTANCE, schema.SPECULATOR))

    def _cached_rounds(self) -> pa.Table | None:
        cache = getattr(self, "_rounds_cache", None)
        if cache is None:
            return None
        try:
            fresh = cache[0] == self._rounds_stamp()
        except OSError:
            fresh = False
        if not fresh:
            self._rounds_cache = None
            return None
        return cache[1]

    def to_pandas(self, file: str = schema.ACCEPTANCE, columns: Sequence[str] | None = None):
        """A pandas frame; string keys become categoricals to keep memory low."""
        return self.table(file, columns).to_pandas(strings_to_categorical=True)

    def to_dataset(self, columns: Sequence[str] | None = None, chains: Iterable = ()):
        """The joined rounds (:meth:`rounds`) as a ``datasets.Dataset`` (Arrow-backed, zero-copy)."""
        import datasets

        return datasets.Dataset(self.rounds(columns, chains))


def load(paths, validate_on_open: bool = True, judged_only: bool = False) -> Bank:
    return Bank(paths, validate_on_open, judged_only)
