"""``python -m calib.bank validate PATH [PATH ...]`` / ``python -m calib.bank stats PATH``."""

from __future__ import annotations

import argparse
import json
import sys

from calib.bank.io import find_banks, load
from calib.bank.validate import validate


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m calib.bank", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    v = sub.add_parser("validate", help="check banks; exit 1 naming file, column and row if invalid")
    v.add_argument("paths", nargs="+", help="bank folders, or folders holding bank folders")
    v.add_argument("--max-problems", type=int, default=50)
    s = sub.add_parser("stats", help="print the stats of a bank (or union) as JSON")
    s.add_argument("paths", nargs="+")
    args = ap.parse_args(argv)

    if args.cmd == "validate":
        bad = 0
        for path in args.paths:
            try:
                banks = find_banks(path)
            except FileNotFoundError as exc:
                print(f"INVALID {path}: {exc}", file=sys.stderr)
                bad += 1
                continue
            for bank in banks:
                problems = validate(str(bank), args.max_problems)
                if problems:
                    bad += 1
                    print(f"INVALID {bank} ({len(problems)} problem(s))", file=sys.stderr)
                    for p in problems:
                        print(f"  {p}", file=sys.stderr)
                else:
                    print(f"ok {bank}")
        return 1 if bad else 0
    from calib.bank.stats import compute_stats

    print(json.dumps(compute_stats(load(args.paths).table("acceptance.parquet")), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
