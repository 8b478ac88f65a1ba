"""Validation of banks: every problem names the file, the column and the row.

:func:`validate` reads a bank's files and runs the checks in order, each from the module of what it checks:
the columns and keys every file shares (:class:`calib.bank.checker.Checker`, which also holds the findings),
the rounds' content (calib.bank.check_rounds), each chain kind's file (calib.bank.check_chains), a MoE bank's
routing (calib.bank.check_routing), and the optional side files (calib.bank.check_side_files)."""

from __future__ import annotations

import numbers
import os

import numpy as np
import pyarrow as pa

from calib.bank import check_chains, check_rounds, check_routing, check_side_files, schema
from calib.bank.arrays import null_mask, partner_rows
from calib.bank.check_side_files import IDENTITY_ROLES, JOBS, MANIFEST_FIELDS, TEMPERATURE_TOL
from calib.bank.checker import BankError, Checker, Problem
from calib.bank.stats import acc_matrix
from calib.params import Interval, validate_params

__all__ = ["IDENTITY_ROLES", "JOBS", "MANIFEST_FIELDS", "TEMPERATURE_TOL", "BankError", "Problem", "check",
           "validate"]


def validate(bank_dir: str, max_problems: int = 50) -> list[Problem]:
    """All problems found in the bank at ``bank_dir`` (empty list: valid), at most ``max_problems``
    (>= 1: a validator that may report nothing would call every bank valid)."""
    validate_params("calib.bank.validate", {"max_problems": max_problems},
                    {"max_problems": [Interval(numbers.Integral, 1, None)]})
    ck = Checker(str(bank_dir), max_problems)
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
    ck.first_bad(A, "accept", null_mask(acc_t.column("accept")), acc_t, "null accept")
    if keys_ok:
        ck.partners(A, acc_t, S, spec_t)
        ck.partners(S, spec_t, A, acc_t)
    if ck.problems or not accept_ok:
        return ck.problems
    accept = acc_t.column("accept").to_numpy(zero_copy_only=False).astype(np.int64)
    width = check_rounds.prefix_mask(ck, A, acc_t, acc_matrix(acc_t), accept)
    # Drafted widths in speculator row order, so findings name speculator.parquet's own rows.
    spec_width = width[partner_rows(spec_t, acc_t)]
    check_rounds.confidences(ck, S, spec_t, spec_width)
    check_rounds.extensions(ck, S, spec_t, spec_width)
    # each chain kind's own file, by its registered (or recorded) layout
    for spec in check_chains.chain_layouts(ck):
        chain_t = ck.read(spec.file, required=False)
        if chain_t is not None:
            check_chains.chain_file(ck, spec, chain_t, acc_t)
    check_routing.routing(ck, acc_t, width)
    check_side_files.manifest(ck, acc_t)
    check_side_files.sampling(ck, spec_t)
    check_side_files.outputs_inside(ck)
    if not ck.problems:  # stats are recomputed from data already known to be sound
        check_side_files.stats(ck, acc_t)
    return ck.problems


def check(bank_dir: str) -> None:
    """Raise :class:`BankError` if the bank at ``bank_dir`` is invalid."""
    problems = validate(bank_dir)
    if problems:
        raise BankError(problems)
