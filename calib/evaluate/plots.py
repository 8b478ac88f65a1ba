"""Evaluation pictures (matplotlib, Agg): reliability, predicted vs actual accepted length,
accepted-length histograms, and the policy ladder. Every function writes one PNG and returns it."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from calib import metrics as M
from calib.evaluate.calibration import samples, temperature_groups, variants
from calib.policies import camp_of, display_order
from calib.presentation import reliability_figure


def ladder_policies(rows) -> list[tuple[str, str | None]]:
    """(policy, colour) of the ladder plot's bars: registered policies drawn in plots (``Policy.plot``)
    that have rows, in the registry's display order."""
    present = {r["policy"] for r in rows}
    return [(p.name, p.colour) for p in display_order() if p.plot and p.name in present]


def _save(fig, path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def reliability(bank, drafter: str, path, n_bins: int = M.ECE_BINS, split: str = "test") -> Path:
    """One column per depth plus pooled; raw and calibrated overlaid; sample counts beneath."""
    chain = bank.chains[drafter]
    panels: dict[str, dict[str, tuple]] = {}
    for variant, p in variants(chain).items():
        p_s, y, depth, _, _ = samples(bank, drafter, p, split)
        for d in [*range(chain.acc.shape[1]), "all"]:
            m = np.ones_like(y, bool) if d == "all" else depth == d
            panels.setdefault("all depths" if d == "all" else f"depth {d}", {})[variant] = (p_s[m], y[m])
    return reliability_figure(panels, path, f"Reliability — {bank.name}, {drafter} chain ({split} split)", n_bins)


def temperatures(banks) -> list[float | None]:
    """The temperatures the banks' rounds were sampled at (rounded), lowest first; None = not recorded."""
    found = {t for b in banks for t, m in temperature_groups(b) if m.any()}
    return sorted(found - {None}) + ([None] if None in found else [])


def temperature_label(temperature: float | None) -> str:
    return "T unknown" if temperature is None else f"T={temperature:g}"


def reliability_by_temperature(banks, temperature: float | None, path, n_bins: int = M.ECE_BINS,
                               split: str = "test") -> Path | None:
    """One panel per chain of every bank with rounds at ``temperature`` (all depths pooled), raw and
    calibrated overlaid: how calibration holds across drafters at one sampling temperature, the setting
    an engine serves with. None when no bank has scored rounds at that temperature."""
    panels: dict[str, dict[str, tuple]] = {}
    for bank in banks:
        at_t = [m for t, m in temperature_groups(bank) if t == temperature]
        if not at_t:
            continue
        sub = bank.subset(at_t[0])
        for drafter, chain in sub.chains.items():
            role = "" if drafter == sub.primary else " (counterfactual)"  # the engine verified the other chain
            for variant, p in variants(chain).items():
                p_s, y, *_ = samples(sub, drafter, p, split)
                if p_s.size:
                    panels.setdefault(f"{bank.name}\n{drafter} chain{role}", {})[variant] = (p_s, y)
    if not panels:
        return None
    return reliability_figure(panels, path, f"Reliability at {temperature_label(temperature)}, every chain "
                                            f"(all depths, {split} split)", n_bins)


def length_scatter(bank, path, split: str = "test") -> Path:
    """2-D histogram of expected vs actual accepted length; points above the diagonal = under-confident."""
    panels = [(d, v, p) for d, c in bank.chains.items() for v, p in variants(c).items()]
    fig, axes = plt.subplots(1, len(panels), figsize=(5.0 * len(panels), 4.2), squeeze=False,
                             layout="constrained")  # keeps colorbars clear of the next panel's labels
    for i, (ax, (drafter, variant, p)) in enumerate(zip(axes[0], panels)):
        chain = bank.chains[drafter]
        keep = (bank.split == split) & chain.labelled
        pred = M.expected_accepted_length(p[keep])
        actual = chain.accept[keep]
        K = chain.acc.shape[1]
        h = ax.hist2d(pred, actual, bins=[np.linspace(0, K, 4 * K + 1), np.arange(K + 2) - 0.5], cmin=1,
                      cmap="viridis", norm=matplotlib.colors.LogNorm())
        fig.colorbar(h[3], ax=ax, label="rounds" if i == len(panels) - 1 else None)
        ax.plot([0, K], [0, K], color="w", ls="--", lw=1.5)
        ax.plot([0, K], [0, K], color="k", ls=":", lw=1)
        # mean actual per predicted bin: a curve below the diagonal = over-confident
        edges = np.linspace(0, K, 2 * K + 1)
        b = np.clip(np.digitize(pred, edges) - 1, 0, len(edges) - 2)
        cnt = np.bincount(b, minlength=len(edges) - 1)
        mean = np.bincount(b, weights=actual, minlength=len(edges) - 1) / np.maximum(cnt, 1)
        mid = (edges[:-1] + edges[1:]) / 2
        ax.plot(mid[cnt > 0], mean[cnt > 0], color="tab:orange", marker="o", label="mean actual per bin")
        s = M.accept_length_summary(pred, actual)
        ax.set_title(f"{drafter} / {variant}: bias {s['bias']:+.2f}, r={s['pearson']:.2f}", fontsize=10)
        ax.set_xlabel("predicted Σ_k Π_j≤k p_j (tokens)")
        if i == 0:
            ax.set_ylabel("actual accepted length (tokens)")
        ax.set_xlim(0, K)
        ax.legend(fontsize=7, loc="upper left")
        ax.text(0.98, 0.02, "below diagonal: over-confident", transform=ax.transAxes, ha="right", fontsize=7)
    fig.suptitle(f"Predicted vs actual accepted length — {bank.name} ({split} split)")
    return _save(fig, path)


def accept_histograms(banks, path, split: str = "test") -> Path:
    """Share of rounds by accepted length, per category and drafter: the early-miss/clean-sweep shape."""
    panels = [(b, d) for b in banks for d in b.chains]
    fig, axes = plt.subplots(1, len(panels), figsize=(3.8 * len(panels), 3.4), squeeze=False, sharey=True)
    for ax, (bank, drafter) in zip(axes[0], panels):
        chain = bank.chains[drafter]
        keep = (bank.split == split) & chain.labelled
        K = chain.acc.shape[1]
        cats = sorted(set(bank.category[keep].tolist()))
        w = 0.8 / max(len(cats), 1)
        for i, c in enumerate(cats):
            a = chain.accept[keep & (bank.category == c)]
            share = np.bincount(a, minlength=K + 1) / max(len(a), 1)
            ax.bar(np.arange(K + 1) + (i - (len(cats) - 1) / 2) * w, share, width=w,
                   label=f"{c} (n={len(a)}, mean {a.mean():.2f})")
        ax.set_xticks(range(K + 1))
        ax.set_xlabel("accepted draft tokens per round")
        ax.set_title(f"{bank.name}\n{drafter} chain", fontsize=9)
        ax.legend(fontsize=7)
        ax.grid(axis="y", alpha=0.3)
    axes[0, 0].set_ylabel("share of rounds")
    fig.suptitle(f"Accepted-length distribution ({split} split)", y=1.04)
    return _save(fig, path)


def ladder(rows, bank: str, cost_model: str, path) -> Path:
    """Goodput relative to best_fixed per batch size, one panel per category."""
    rows = [r for r in rows if r["bank"] == bank and r["cost_model"] == cost_model]
    cats = sorted({r["category"] for r in rows}, key=lambda c: (c == "all", c))
    bs = sorted({r["batch_size"] for r in rows})
    bars = ladder_policies(rows)
    pols = [p for p, _ in bars]
    fig, axes = plt.subplots(1, len(cats), figsize=(5.2 * len(cats), 3.8), squeeze=False, sharey=True)
    w = 0.85 / max(len(pols), 1)
    for ax, c in zip(axes[0], cats):
        for i, (pol, colour) in enumerate(bars):
            vals = []
            for b in bs:
                r = [x for x in rows if x["category"] == c and x["batch_size"] == b and x["policy"] == pol]
                vals.append(r[0]["vs_best_fixed"] if r else np.nan)
            # a ratio drawn from the 1.0 line (a bar's length is its gain or loss, whatever the axis range);
            # the peers hatched, so a policy is told apart by camp as well as by colour
            ax.bar(np.arange(len(bs)) + (i - (len(pols) - 1) / 2) * w, np.asarray(vals) - 1.0, bottom=1.0, width=w,
                   label=pol, color=colour, hatch="//" if camp_of(pol) == "peer" else None, edgecolor="white", lw=0.3)
        ax.axhline(1.0, color="k", lw=0.8, ls="--")
        ax.set_xticks(range(len(bs)))
        ax.set_xticklabels([f"B={b}" for b in bs])
        ax.set_title(f"category: {c}")
        ax.grid(axis="y", alpha=0.3)
    # the panels share their y axis: one range holding every bar of every panel (none clipped)
    lo = np.nanmin([r["vs_best_fixed"] for r in rows] + [1.0])
    hi = np.nanmax([r["vs_best_fixed"] for r in rows] + [1.0])
    axes[0, 0].set_ylim(max(0.0, lo - 0.05), hi + 0.05)
    axes[0, 0].set_ylabel("goodput / best fixed γ")
    axes[0, -1].legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
    fig.suptitle(f"Policy ladder, replayed (a prediction) — {bank}, cost curve: {cost_model} (goodput / the best fixed γ; "
                 "bars from the 1.0 line, peers hatched)", y=1.03)
    return _save(fig, path)


def answer(answer_rows, path) -> Path | None:
    """The report's *Answer* as bars: goodput of the best calib policy / the best peer per (bank, cost curve),
    mean over batch sizes on category ``all``, with the minimum over every (category, B) as a marker. None
    when no pair has both camps."""
    rows = [a for a in answer_rows if a.get("ratio_mean") is not None]
    if not rows:
        return None
    x = np.arange(len(rows))
    fig, ax = plt.subplots(figsize=(max(4.0, 1.7 * len(rows) + 1.5), 4.0))
    ax.bar(x, [a["ratio_mean"] - 1.0 for a in rows], bottom=1.0, width=0.6,  # from the 1.0 line: gain or loss
           color=["tab:blue" if a["ratio_mean"] > 1 else "tab:red" for a in rows], label="mean over B (all)")
    for xi, a in zip(x, rows):
        ax.annotate(f"{a['ratio_mean']:.2f}×", (xi, a["ratio_mean"]), ha="center", fontsize=7,
                    va="bottom" if a["ratio_mean"] >= 1 else "top", xytext=(0, 2 if a["ratio_mean"] >= 1 else -2),
                    textcoords="offset points")
    mins = [a["ratio_min"] if a.get("ratio_min") is not None else np.nan for a in rows]
    ax.scatter(x, mins, color="k", marker="v", zorder=3, label="min over (category, B)")
    ax.axhline(1.0, color="k", lw=0.8, ls="--")
    ax.set_xticks(x)
    ax.set_xticklabels([f"{a['bank']}\n{a['cost_model']}\n{a['calib_policy']}\n/ {a['peer_policy']}" for a in rows],
                       fontsize=7)
    vals = [a["ratio_mean"] for a in rows] + [m for m in mins if np.isfinite(m)] + [1.0]
    ax.set_ylim(max(0.0, min(vals) - 0.08), max(vals) + 0.08)
    ax.set_ylabel("goodput: best calib / best peer (replay)")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # outside the data
    ax.set_title("Answer (replayed, a prediction): calib's best policy against the best peer", fontsize=10)
    return _save(fig, path)


def warmup_figure(curve: list[dict], target: float):
    """The figure of :func:`warmup_curve`: one panel per chain (its banks one colour each, tables alone dashed,
    corrected online solid) on a shared error axis, the target drawn and labelled in every panel."""
    chains = list(dict.fromkeys(r["chain"] for r in curve))
    banks = list(dict.fromkeys(r["bank"] for r in curve))
    colours = plt.get_cmap("tab10")
    fig, axes = plt.subplots(1, len(chains), figsize=(4.6 * len(chains) + 1.0, 4.2), sharey=True, squeeze=False)
    for ax, chain in zip(axes[0], chains):
        for bank in [b for b in banks if any((r["bank"], r["chain"]) == (b, chain) for r in curve)]:
            pts = [r for r in curve if (r["bank"], r["chain"]) == (bank, chain)]
            x = [r["rounds_seen"] for r in pts]
            colour = colours(banks.index(bank) % 10)
            for v, style in (("tables", "--"), ("online", "-")):
                y = [np.nan if r[f"error_{v}"] is None else r[f"error_{v}"] for r in pts]
                ax.plot(x, y, style, color=colour, label=bank if v == "online" else None)  # one legend entry a bank
        ax.axhline(target, color="black", lw=1.0, ls=":")
        ax.annotate(f"target {target:.0%}", xy=(1.0, target), xycoords=("axes fraction", "data"), xytext=(-4, 3),
                    textcoords="offset points", ha="right", va="bottom", fontsize=8)
        ax.set_title(f"chain {chain}")
        ax.set_xlabel("rounds seen (window ending there)")
        ax.legend(fontsize=6, loc="upper right")
    axes[0][0].set_ylim(bottom=0)
    axes[0][0].set_ylabel("|predicted − actual| / actual\nmean accepted length")
    fig.suptitle("Online correction warm-up (replay): dashed = tables alone, solid = corrected online")
    fig.tight_layout()
    return fig


def warmup_curve(curve: list[dict], path, target: float = 0.05) -> Path:
    """The online correction's warm-up: relative error of the predicted mean accepted length per window of
    rounds against rounds seen, one panel per chain (:func:`warmup_figure`); ``target`` is the error the
    report holds a slice to (:data:`calib.evaluate.report.SLICE_MAX_ERROR`)."""
    return _save(warmup_figure(curve, target), path)
