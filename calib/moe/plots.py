"""Pictures of the routing analysis (PNG, written atomically)."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from calib.atomic import atomic_path

COLORS = {"measured": "k", "uniform": "tab:gray", "independent": "tab:blue", "maxent": "tab:red"}
TAG = " (PROXY)"  # set by the analysis from the capture's manifest (routing.proxy)
FAMILY_STYLE = {"depth": "tab:red", "same_seq_random": "tab:orange", "width": "tab:blue", "mixed": "tab:green"}


def _save(fig, path) -> str:
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=110, format="png")
    plt.close(fig)
    return str(path)


def popularity(tr, fits, path) -> str:
    layers = sorted({0, tr.layers // 3, 2 * tr.layers // 3, tr.layers - 1})
    fig, axes = plt.subplots(1, len(layers) + 1, figsize=(4 * (len(layers) + 1), 3.6), constrained_layout=True)
    marg = tr.marginals()
    for ax, l in zip(axes, layers):
        share = np.sort(marg[l] / tr.top_k)[::-1]
        r = np.arange(1, share.size + 1)
        ax.semilogy(r, share, "ko", ms=4, label="measured")
        f = fits[l]
        for name, x, col in (("exp", r, "tab:blue"), ("power", np.log(r), "tab:red")):
            y = np.log(share[share > 0])
            xs = x[share > 0]
            slope, icpt = np.polyfit(xs, y, 1)
            ax.semilogy(r, np.exp(slope * x + icpt), color=col, label=f"{name} fit R²={f[f'{name}_r2']:.2f}")
        ax.axhline(1 / tr.n_experts, color="gray", ls=":", label="uniform")
        ax.set(title=f"layer {l}", xlabel="rank", ylabel="share of routings")
        ax.legend(fontsize=7)
    ax = axes[-1]
    ax.plot([f["exp_r2"] for f in fits], "b.-", label="exponential R²")
    ax.plot([f["power_r2"] for f in fits], "r.-", label="power law R²")
    ax.set(title="fit quality by layer", xlabel="layer", ylabel="R² (log share)", ylim=(0, 1.02))
    ax.legend(fontsize=7)
    fig.suptitle("Expert popularity" + TAG)
    return _save(fig, path)


def distinct_by_shape(curves, tr, path) -> str:
    fig, ax = plt.subplots(figsize=(7, 4.5), constrained_layout=True)
    for fam in ("depth", "same_seq_random", "width"):
        rows = [r for r in curves if r["family"] == fam]
        ax.plot([r["n"] for r in rows], [r["measured"].mean() for r in rows], "o-", color=FAMILY_STYLE[fam],
                label={"depth": "depth (N consecutive, one sequence)", "same_seq_random":
                       "same sequence, random positions", "width": "width (N sequences)"}[fam])
    n = np.arange(1, max(r["n"] for r in curves) + 1)
    E, k = tr.n_experts, tr.top_k
    ax.plot(n, E * (1 - (1 - k / E) ** n), "k--", label="coupon collector E(1-(1-k/E)^N)")
    rows = [r for r in curves if r["family"] == "mixed"]
    ax.plot([r["positions"] for r in rows], [r["measured"].mean() for r in rows], "s", color=FAMILY_STYLE["mixed"],
            label="mixed (B sequences, depths 1..5), x = mean positions")
    ax.set(xlabel="positions N", ylabel="distinct experts per layer (mean over layers)",
           title=f"Distinct experts by verify shape ({E} experts, top-{k}){TAG}")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return _save(fig, path)


def models_vs_measured(curves, path) -> str:
    fams = ("depth", "width", "mixed")
    fig, axes = plt.subplots(1, 3, figsize=(14, 4), constrained_layout=True)
    for ax, fam in zip(axes, fams):
        rows = [r for r in curves if r["family"] == fam]
        x = [r["n"] for r in rows]
        for name in ("measured", "uniform", "independent", "maxent"):
            ax.plot(x, [r[name].mean() for r in rows], "o-" if name == "measured" else ".--",
                    color=COLORS[name], label=name)
        ax.set(title=fam, xlabel="B (sequences)" if fam == "mixed" else "N", ylabel="distinct experts / layer")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("Models vs held-out measurement" + TAG)
    return _save(fig, path)


def overlap(same, cross, tr, path) -> str:
    fig, ax = plt.subplots(figsize=(6.5, 4), constrained_layout=True)
    ax.plot(np.arange(1, len(same) + 1), same, "ro-", ms=3, label="same sequence, distance δ")
    ax.axhline(cross, color="tab:blue", label="different sequences")
    ax.axhline(tr.top_k / tr.n_experts, color="gray", ls=":", label="uniform k/E")
    ax.set(xlabel="distance δ (positions)", ylabel="|S_p ∩ S_p+δ| / k (mean over layers)",
           title="Expert-set overlap vs distance" + TAG)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return _save(fig, path)


def break_even(be, acc0, path) -> str:
    m = be["measured"]
    alpha = np.linspace(0, 1, 101)
    fig, ax = plt.subplots(figsize=(6.5, 4), constrained_layout=True)
    ax.plot(alpha, np.full_like(alpha, 2 / m["width2_experts"]), color="tab:blue",
            label=f"(i) 2 sequences: 2 tokens / {m['width2_experts']:.1f} experts")
    ax.plot(alpha, (1 + alpha) / m["depth2_experts"], color="tab:red",
            label=f"(ii) 1 sequence + 1 draft: (1+α) / {m['depth2_experts']:.1f} experts")
    ax.axvline(m["alpha"], color="k", ls="--", label=f"break-even α = {m['alpha']:.3f}")
    if acc0 is not None:
        ax.axvline(acc0, color="tab:green", ls=":", label=f"capture's first-draft acceptance {acc0:.2f}")
    ax.set(xlabel="acceptance α of the draft", ylabel="output tokens per expert read (all layers)",
           title="Width vs depth at 2 positions, batch 1" + TAG)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return _save(fig, path)


def cost_curves(cost_models, path) -> str:
    fig, axes = plt.subplots(1, len(cost_models), figsize=(6.5 * len(cost_models), 4.2), constrained_layout=True,
                             squeeze=False)
    for ax, (name, cm) in zip(axes[0], cost_models.items()):
        t = np.arange(1, 129)
        ax.plot(t, 1e3 * cm.even_curve(1, 128)[1:], color="tab:red", label="depth: 1 sequence, T positions")
        for b, col in ((4, "tab:orange"), (16, "tab:green"), (64, "tab:purple")):
            tt = t[t >= b]
            ax.plot(tt, 1e3 * cm.even_curve(b, 128)[tt], color=col, label=f"B={b}, T spread evenly")
        ax.plot(t, 1e3 * np.array([cm.shape_cost([1] * int(x)) for x in t]), color="tab:blue",
                label="width: T sequences, 1 position each")
        ax.set(xlabel="positions T in the verify pass", ylabel="verify cost (ms, roofline)",
               title=f"{name}: {cm.layers}x{cm.n_experts} experts, top-{cm.top_k}, distinct={cm.model_name}"
                     + (" (PROXY)" if cm.cfg.get("proxy") else ""))
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    return _save(fig, path)
