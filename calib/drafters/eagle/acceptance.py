"""How a drafter did in a collected bank, on its *raw* confidences:
``python -m calib.drafters.eagle.acceptance BANK [BANK ...] [--json OUT]``.

Prints, overall and per category: rounds, mean accepted tokens per round, per-depth acceptance
(conditional on the depth being reached), the raw confidences' ECE on those conditional samples, and
the mean accepted length the raw confidences predict (Σ_k Π_{j≤k} conf_j) next to the actual one.
Calibrating those confidences is train.py's job; this is the drafter's report card.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from calib.atomic import write_json_atomic
from calib.bank import load, schema
from calib.chains.model import model_samples
from calib.cli import parser as plain_parser
from calib.metrics import ece, expected_accepted_length


def report(paths) -> dict:
    bank = load(paths)
    rounds = bank.rounds()
    width = schema.width(rounds.column_names)
    accept = rounds.column("accept").to_numpy(zero_copy_only=False).astype(float)
    conf = schema.depth_matrix(rounds, schema.CONF, width)
    cats = np.asarray(rounds.column("category").to_pylist(), dtype=object)
    samples = model_samples(bank)
    out = {}
    for cat in ["all", *sorted(set(cats.tolist()))]:
        sel = np.ones(len(cats), bool) if cat == "all" else cats == cat
        s = samples if cat == "all" else samples[samples["category"] == cat]
        by_depth = s.groupby("depth", observed=True).agg(n=("label", "size"), accept=("label", "mean"),
                                                         conf=("conf", "mean"))
        out[cat] = {
            "rounds": int(sel.sum()),
            "mean_accepted": float(accept[sel].mean()),
            "predicted_mean_accepted_raw": float(expected_accepted_length(conf[sel]).mean()),
            "ece_raw": ece(s["conf"].to_numpy(), s["label"].to_numpy()),
            "n_samples": len(s),
            "by_depth": {int(d): {"n": int(r.n), "accept_rate": float(r.accept), "mean_conf": float(r.conf)}
                         for d, r in by_depth.iterrows()},
        }
    return out


def main(argv=None) -> None:
    ap = plain_parser(__doc__)
    ap.add_argument("banks", nargs="+")
    ap.add_argument("--json", type=Path, help="also write the report here")
    args = ap.parse_args(argv)
    rep = report(args.banks)
    print(f"{'category':<10} {'rounds':>7} {'accepted':>9} {'predicted(raw)':>15} {'ECE raw':>8}  "
          "accept rate | reached, by depth")
    for cat, r in rep.items():
        depths = "  ".join(f"d{d}:{v['accept_rate']:.3f}" for d, v in r["by_depth"].items())
        print(f"{cat:<10} {r['rounds']:>7} {r['mean_accepted']:>9.3f} {r['predicted_mean_accepted_raw']:>15.3f} "
              f"{r['ece_raw']:>8.4f}  {depths}")
    if args.json:
        write_json_atomic(args.json, rep)


if __name__ == "__main__":
    main()
