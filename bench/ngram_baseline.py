"""The n-gram chain's tables against the match-length baseline on banks the tables never saw.

The baseline is train.py's (conf/ngram_model/_export.yaml ``transfer.baseline``): a logistic on the
match length per depth, fitted here on the train and validation prompts of the training banks (the
split of conf/split/by_prompt.yaml). Both are scored by Brier and AUROC at every depth a round reached,
per bank and category, over the whole of each bank given (give it banks of prompts the tables did not
see: the held-out banks, data/banks/eagle-holdout-t0 and its kin). A measurement, not a speed benchmark.

    python bench/ngram_baseline.py data/banks/eagle-holdout-t0 data/banks/ngram-holdout-t0.8 ...

Why argparse, not Hydra like train.py/eval.py: a measurement over given folders with two flags, not a
config tree from conf/.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from calib.cli import parser as plain_parser

TRAIN_BANKS = ["data/banks/eagle-chat_code-t0", "data/banks/eagle-chat_code-t0.8",
               "data/banks/ngram-chat_code-t0", "data/banks/ngram-chat_code-t0.8"]  # conf/data/sample.yaml
BASELINE_FEATURES = ["match_n"]


def rows(tables_dir: str, train_banks: list[str], banks: list[str], by_depth: bool = False) -> list[dict]:
    """One row per (bank, category, and "all"; with ``by_depth`` also per depth): n, Brier and AUROC of the tables
    and of the baseline."""
    from calib.bank.io import load  # here, not at the top: --help answers without pandas or scikit-learn
    from calib.calibrators.base import with_depth
    from calib.calibrators.features import LogisticAcceptance
    from calib.chains import chain
    from calib.labels import prompt_split
    from calib.metrics import auroc, brier
    from calib.tables import load as load_tables
    from calib.tables.export import table_predict

    kind = chain("ngram")
    fit = kind.samples(load(train_banks))
    fit = fit[prompt_split(fit.category, fit.prompt_idx) != "test"]
    base = LogisticAcceptance(features=BASELINE_FEATURES).fit(
        with_depth(fit[BASELINE_FEATURES], fit.depth.to_numpy()), fit.label.to_numpy())
    table = load_tables(tables_dir).table("ngram")
    axes = [a.name for a in table.axes]
    out = []
    for path in banks:
        s = kind.samples(load([path]))
        if s.empty:
            raise SystemExit(f"{path}: no labelled n-gram rounds (ngram.parquet) to score")
        p_base = base.accept_proba(with_depth(s[BASELINE_FEATURES], s.depth.to_numpy()))
        p_tab = table_predict(table, s[axes].to_numpy(dtype=np.float64), s.depth.to_numpy())
        y = s.label.to_numpy()
        depths = ["all", *sorted(int(d) for d in s.depth.unique())] if by_depth else ["all"]
        for cat in ["all", *sorted(s.category.unique())]:
            for depth in depths:
                m = np.ones(len(s), bool) if cat == "all" else (s.category == cat).to_numpy()
                if depth != "all":
                    m = m & (s.depth == depth).to_numpy()
                if len(np.unique(y[m])) < 2:  # AUROC needs both labels
                    continue
                out.append({"bank": Path(path).name, "category": cat, "depth": depth, "n": int(m.sum()),
                            "brier_tables": brier(p_tab[m], y[m]), "brier_baseline": brier(p_base[m], y[m]),
                            "auroc_tables": auroc(p_tab[m], y[m]), "auroc_baseline": auroc(p_base[m], y[m])})
    return out


def main(argv=None) -> None:
    ap = plain_parser(__doc__)
    ap.add_argument("banks", nargs="+", help="bank folders to score whole (prompts the tables did not see)")
    ap.add_argument("--tables", default="runs/train/default", help="tables folder (python train.py)")
    ap.add_argument("--train-banks", nargs="+", default=TRAIN_BANKS,
                    help="the banks the tables were trained on (the baseline is fitted on their train/val prompts)")
    ap.add_argument("--by-depth", action="store_true", help="a row per depth too (where a chain is cut)")
    args = ap.parse_args(argv)
    print(f"{'bank':24s} {'category':10s} {'depth':>5s} {'n':>7s}  Brier tables | baseline   AUROC tables | baseline")
    for r in rows(args.tables, args.train_banks, args.banks, args.by_depth):
        print(f"{r['bank']:24s} {r['category']:10s} {r['depth']!s:>5s} {r['n']:7d}  {r['brier_tables']:.4f} | "
              f"{r['brier_baseline']:.4f}"
              f"       {r['auroc_tables']:.3f} | {r['auroc_baseline']:.3f}"
              f"{'' if r['brier_tables'] <= r['brier_baseline'] else '   <- the baseline is better'}")


if __name__ == "__main__":
    main()
