"""The online warm-up figure (issue 43, Must 6): one panel per chain, one legend entry per bank, the target
drawn and labelled in every panel (it was twelve overlapping lines and an unlabelled grey rule)."""

from __future__ import annotations

import matplotlib.pyplot as plt

from calib.evaluate import plots


def _curve():
    rows = []
    for bank, chains in (("eagle-t0", ("model", "ngram")), ("eagle-t0.8", ("model", "ngram")), ("ngram-t0", ("ngram",))):
        for chain in chains:
            for seen in (100, 200, 300):
                rows.append({"bank": bank, "chain": chain, "rounds_seen": seen, "error_tables": 0.3,
                             "error_online": None if seen == 100 else 0.04})
    return rows


def test_one_panel_per_chain_with_its_banks_and_the_target():
    fig = plots.warmup_figure(_curve(), target=0.05)
    try:
        axes = fig.axes
        assert [ax.get_title() for ax in axes] == ["chain model", "chain ngram"]
        legends = [[t.get_text() for t in ax.get_legend().get_texts()] for ax in axes]
        assert legends == [["eagle-t0", "eagle-t0.8"], ["eagle-t0", "eagle-t0.8", "ngram-t0"]]
        for ax in axes:
            assert [t.get_text() for t in ax.texts] == ["target 5%"]
            assert any(list(line.get_ydata()) == [0.05, 0.05] for line in ax.lines)  # the target rule
            assert len(ax.lines) == 2 * len(ax.get_legend().get_texts()) + 1  # tables + online a bank, the rule
    finally:
        plt.close(fig)


def test_the_figure_is_written(tmp_path):
    assert plots.warmup_curve(_curve(), tmp_path / "online_warmup.png").stat().st_size > 0
