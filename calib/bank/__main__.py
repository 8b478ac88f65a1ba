"""python -m calib.bank validate PATH [PATH ...] | python -m calib.bank stats PATH [PATH ...]

Check banks of speculative-decoding rounds, or print the stats of a bank (or of a union of banks).
A PATH is a bank folder or a folder holding bank folders. validate checks each folder once (a
symlink to a listed folder is the same folder). stats counts a bank named twice (the same folder,
a symlink to it, or a copy of it) once, with a warning naming both paths, and refuses banks that
share round keys (the same rounds collected twice).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import warnings

from calib.bank.io import DuplicateBankWarning, find_banks, load, unique_banks
from calib.bank.validate import validate
from calib.cli import parser as plain_parser

log = logging.getLogger("calib.bank")


def _at_least_one(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} would report no problems, so every bank would "
                                         "look valid: use a number >= 1 (default 50)")
    return value


def main(argv=None) -> int:
    ap = plain_parser(__doc__, prog="python -m calib.bank")
    sub = ap.add_subparsers(dest="cmd", required=True)
    v = sub.add_parser("validate", help="check banks; exit 1 naming file, column and row if invalid")
    v.add_argument("paths", nargs="+", help="bank folders, or folders holding bank folders")
    v.add_argument("--max-problems", type=_at_least_one, default=50, metavar="N",
                   help="report at most N (>= 1) problems per bank (default 50)")
    s = sub.add_parser("stats", help="print the stats of a bank (or union) as JSON")
    s.add_argument("paths", nargs="+", help="bank folders, or folders holding bank folders")
    args = ap.parse_args(argv)
    if not logging.getLogger().handlers and not log.handlers:
        logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    # A dropped duplicate is reported by the "calib.bank" logger; its Python warning twin would only
    # print the same sentence again.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DuplicateBankWarning)
        return _validate(args) if args.cmd == "validate" else _stats(args)


def _validate(args) -> int:
    bad = 0
    banks = []
    for path in args.paths:
        try:
            banks += find_banks(path, dedupe=False)
        except FileNotFoundError as exc:
            print(f"INVALID {path}: {exc}", file=sys.stderr)
            bad += 1
    # Each folder is checked once; a copy is a folder of its own and is checked too.
    for bank in unique_banks(banks, by_content=False):
        problems = validate(str(bank), args.max_problems)
        if problems:
            bad += 1
            print(f"INVALID {bank} ({len(problems)} problem(s))", file=sys.stderr)
            for p in problems:
                print(f"  {p}", file=sys.stderr)
        else:
            print(f"ok {bank}")
    return 1 if bad else 0


def _stats(args) -> int:
    from calib.bank.stats import compute_stats

    try:
        bank = load(args.paths)
    except (FileNotFoundError, ValueError) as exc:  # not a bank, an invalid bank, overlapping banks
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(compute_stats(bank.table("acceptance.parquet")), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
