"""Reliability diagrams: predicted vs observed acceptance, with sample counts beneath."""

from __future__ import annotations

import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


def _bins(p, y, n_bins):
    b = np.clip((np.asarray(p) * n_bins).astype(int), 0, n_bins - 1)
    n = np.bincount(b, minlength=n_bins)
    mean_p = np.bincount(b, weights=p, minlength=n_bins) / np.maximum(n, 1)
    mean_y = np.bincount(b, weights=y, minlength=n_bins) / np.maximum(n, 1)
    return n, mean_p, mean_y


def reliability_figure(panels: dict[str, dict[str, tuple]], path: str | os.PathLike, title: str,
                       n_bins: int = 15) -> str:
    """One column per panel (e.g. per depth); each panel overlays variants (e.g. raw, calibrated).

    ``panels[name][variant] = (p, y)``. Top row: observed accept rate per equal-width bin of the
    prediction (markers sized by count) against the diagonal; bottom row: samples per bin.
    """
    names = list(panels)
    fig, axes = plt.subplots(2, len(names), figsize=(3.2 * len(names), 4.6), squeeze=False,
                             gridspec_kw={"height_ratios": [3, 1]}, sharex=True)
    colors = {"raw": "tab:red", "calibrated": "tab:blue"}
    width = 1.0 / n_bins
    for j, name in enumerate(names):
        top, bottom = axes[0, j], axes[1, j]
        top.plot([0, 1], [0, 1], color="0.6", lw=1, ls="--", label="perfect")
        variants = panels[name]
        for v_i, (variant, (p, y)) in enumerate(variants.items()):
            p, y = np.asarray(p, float), np.asarray(y, float)
            n, mp, my = _bins(p, y, n_bins)
            seen = n > 0
            c = colors.get(variant, f"C{v_i}")
            top.plot(mp[seen], my[seen], "o-", color=c, ms=4, lw=1.2, label=f"{variant} (n={p.size:,})")
            offset = (v_i - (len(variants) - 1) / 2) * width / len(variants)
            bottom.bar((np.arange(n_bins) + 0.5) * width + offset, n, width=width / len(variants),
                       color=c, alpha=0.7)
        top.set_title(name)
        top.set_xlim(0, 1)
        top.set_ylim(0, 1)
        top.set_aspect("equal", adjustable="box")
        if j == 0:
            top.set_ylabel("observed accept rate")
            bottom.set_ylabel("samples")
            top.legend(fontsize=7, loc="upper left")
        bottom.set_xlabel("predicted P(accept | reached)")
        bottom.set_yscale("log")
    fig.suptitle(title)
    fig.tight_layout()
    tmp = f"{path}.tmp.png"
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)
    return str(path)
