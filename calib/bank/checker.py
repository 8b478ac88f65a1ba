"""What one validation of a bank holds: its findings (each a :class:`Problem`, at most ``max_problems``;
:class:`BankError` raises them), the bank's files as read once, and the checks of columns and keys that
every file of a bank shares. The checks of each file's content take a :class:`Checker` and add to it."""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from calib.bank import schema
from calib.bank.arrays import duplicate_mask, key_ids, null_mask, row_keys
from calib.sidefiles import SideFileError, read_json

# The optional side files are metadata: what is wrong with one is a finding, and the way out is
# to fix it or delete it (both are optional) or to recollect the bank.
SIDE_HINT = "fix or delete the file (it is optional), or recollect the bank"


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


class Checker:
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
        keys = row_keys(table, i)
        more = f" ({bad.size} rows in all)" if bad.size > 1 else ""
        self.add(file, column, i, f"{message} [{keys}]{more}")
        return True

    # -- the bank's files ----------------------------------------------------------------------
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

    def read_json(self, file: str) -> dict | None:
        """An optional JSON object beside the parquet files (None if absent or unusable: then a
        finding names the file and what is wrong). Read once per validation."""
        if file not in self._json:
            try:
                self._json[file] = read_json(os.path.join(self.dir, file), dict, missing_ok=True)
            except SideFileError as exc:
                self.add(file, None, None, f"{exc.problem}; {SIDE_HINT}")
                self._json[file] = None
        return self._json[file]

    # -- structure -----------------------------------------------------------------------------
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
            self.first_bad(file, k, null_mask(table.column(k)), table, "null key")
        dup = duplicate_mask(table)
        self.first_bad(file, ",".join(schema.KEYS), dup, table, "duplicate key")
        return True

    def partners(self, file_a, a: pa.Table, file_b, b: pa.Table):
        """Every row of ``a`` must have a row with the same keys in ``b``."""
        ka, kb = key_ids(a, b)
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
