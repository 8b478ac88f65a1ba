"""Reliability diagrams: predicted vs observed acceptance, with sample counts beneath."""

from __future__ import annotations

import os
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import matplotlib.ticker
import numpy as np

from calib import metrics as M
from calib.atomic import atomic_path

COLORS = {"raw": "tab:red", "calibrated": "tab:blue"}


def reliability_figure(panels: dict[str, dict[str, tuple]], path: str | os.PathLike, title: str,
                       n_bins: int = M.ECE_BINS) -> Path:
    """One column per panel (e.g. per depth, then pooled); each overlays variants (raw, calibrated).

    ``panels[name][variant] = (p, y)``. Top row: observed accept rate per equal-width bin against
    the mean prediction there, with the diagonal and each variant's ECE; bottom row: samples per bin.
    """
    names = list(panels)
    fig, axes = plt.subplots(2, len(names), figsize=(3.0 * len(names), 4.6), squeeze=False, sharex=True,
                             gridspec_kw={"height_ratios": [3, 1]},
                             layout="constrained")  # the title clears two-line panel names (bank, chain)
    width = 1.0 / n_bins
    for j, name in enumerate(names):
        ax, axc = axes[0, j], axes[1, j]
        ax.plot([0, 1], [0, 1], ls="--", color="0.6", lw=1, label="perfect")
        variants = panels[name]
        for v_i, (variant, (p, y)) in enumerate(variants.items()):
            p, y = np.asarray(p, float), np.asarray(y, float)
            centres, conf, acc, count = M.reliability(p, y, n_bins)
            nz = count > 0
            color = COLORS.get(variant, f"C{v_i}")
            ece = M.ece(p, y, n_bins) if p.size else float("nan")
            ax.plot(conf[nz], acc[nz], marker="o", ms=4, color=color,
                    label=f"{variant} (ECE {ece:.3f}, n={p.size:,})")
            share = 0.9 / max(len(variants), 1)
            axc.bar(centres + (v_i - (len(variants) - 1) / 2) * width * share, count, width=width * share,
                    color=color, alpha=0.8)
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1)
        ax.set_title(name)
        ax.legend(fontsize=7, loc="upper left")
        ax.grid(alpha=0.3)
        axc.set_xlabel("predicted P(accept | reached)")
        axc.set_yscale("log")
        axc.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())  # minor labels overlap
        axc.grid(alpha=0.3)
        if j == 0:
            ax.set_ylabel("observed accept rate")
            axc.set_ylabel("samples (log)")
    fig.suptitle(f"{title} — {n_bins} equal-width bins")
    path = Path(path)
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=110, bbox_inches="tight", format=path.suffix.lstrip(".") or "png")
    plt.close(fig)
    return path
