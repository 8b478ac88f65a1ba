"""bench/ngram_baseline.py on SYNTHETIC banks and stand-in tables: it scores every reached n-gram depth of the
banks it is given, per category and overall, with the tables and with the match-length baseline."""

import numpy as np

from calib.bank import load, write_bank
from calib.chains import chain
from tests.bench_scripts import load_bench
from tests.evaluate.fit_tables import fit_tables
from tests.synthetic import synthetic_tables


def _script():
    return load_bench("ngram_baseline")


def test_it_scores_every_reached_ngram_depth_per_category(tmp_path, capsys):
    train = write_bank(tmp_path / "train", *synthetic_tables(n_prompts=24, rounds_per_prompt=12, width=4, seed=3),
                       manifest={"model": "synthetic-model", "speculator": "synthetic"})
    unseen = write_bank(tmp_path / "unseen", *synthetic_tables(n_prompts=12, rounds_per_prompt=12, width=4, seed=8),
                        manifest={"model": "synthetic-model", "speculator": "synthetic"})
    fit_tables([train], tmp_path / "tables")
    mod = _script()
    rows = mod.rows(str(tmp_path / "tables"), [str(train)], [str(unseen)])
    samples = chain("ngram").samples(load([unseen]))
    by = {r["category"]: r for r in rows}
    assert set(by) == {"all", *samples.category.unique()}
    assert by["all"]["n"] == len(samples) == sum(r["n"] for c, r in by.items() if c != "all")
    assert all(0 <= r[k] <= 1 for r in rows for k in ("brier_tables", "brier_baseline"))
    mod.main([str(unseen), "--tables", str(tmp_path / "tables"), "--train-banks", str(train)])
    out = capsys.readouterr().out.splitlines()
    assert out[0].split()[:4] == ["bank", "category", "depth", "n"] and len(out) == 1 + len(rows)
    assert np.isfinite(by["all"]["auroc_tables"])
    # per depth: every reached depth of the pooled rows (each holds both labels here), adding up to them
    deep = [r for r in mod.rows(str(tmp_path / "tables"), [str(train)], [str(unseen)], by_depth=True)
            if r["category"] == "all"]
    assert [r["depth"] for r in deep] == ["all", *sorted(samples.depth.unique())]
    assert sum(r["n"] for r in deep[1:]) == deep[0]["n"] == len(samples)
