"""The MoE replay: shape-aware against even-spread pricing of calib's allocator, every bank x batch size x MoE
target (calib/evaluate/replay/moe.py, docs/moe.md); writes ``<out>.json`` (every row, the command, the config)
and ``<out>.png`` (the goodput gain against batch size).

    python bench/moe_replay.py                                 # conf/eval_moe.yaml
    python bench/moe_replay.py replay.max_steps=24 out=/tmp/x  # OmegaConf dot-list overrides

Why argparse, not Hydra: one config file and a few dot-list overrides, no config groups, no run folder;
OmegaConf reads the same YAML.
"""

from __future__ import annotations

import json
import os
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def load_banks(cfg, tables):
    """Every bank of the config; one the tables refuse (another drafter) is read without them, its model chain
    priced on the drafter's raw confidences (said so in the bank's name)."""
    from calib.evaluate.data import load_eval_bank
    from calib.tables import TablesError

    banks = []
    for path in cfg.banks:
        p = ROOT / path
        try:
            banks.append(load_eval_bank(p, tables, tuple(cfg.split.fractions), int(cfg.split.seed)))
        except TablesError:
            bank = load_eval_bank(p, None, tuple(cfg.split.fractions), int(cfg.split.seed))
            for c in bank.chains.values():
                c.p_cal = c.p_raw  # raw confidences (None for a chain without them: not allocated)
            bank.name += " (raw)"
            banks.append(bank)
    return banks


def width_depth_rows(banks, costs, cfg) -> list[dict]:
    """The width-against-depth policy (calib/evaluate/replay/width_depth.py) on each bank's primary chain, per
    (running requests, budget) and MoE cost: goodput of the policy, width first and depth first."""
    from calib.evaluate.replay.width_depth import break_even, replay_budget

    out = []
    for bank in banks:
        c = bank.chains[bank.primary]
        if c.p_cal is None:
            continue
        test = bank.split == "test"
        for cname, cost in costs.items():
            for running, budget in cfg.width_depth.settings:
                res = replay_budget(cost, c.p_cal[test], c.accept[test], int(running), int(budget),
                                    int(cfg.width_depth.steps), int(cfg.replay.seed))
                out.append({"bank": bank.name, "cost_model": cname, "running": int(running), "budget": int(budget),
                            "break_even_alpha": break_even(cost),
                            **{f"{k}_goodput": v["goodput"] for k, v in res.items()},
                            "gain_vs_width_first": res["policy"]["goodput"] / res["width_first"]["goodput"] - 1,
                            "gain_vs_depth_first": res["policy"]["goodput"] / res["depth_first"]["goodput"] - 1})
                print(f"width/depth {bank.name:<28} {cname:<18} R={running} T={budget}: "
                      f"{100 * out[-1]['gain_vs_width_first']:+.2f}% vs width first", flush=True)
    return out


def figure(rows, path: Path, wd_rows=()) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    costs = sorted({r["cost_model"] for r in rows})
    n_rows = 2 if wd_rows else 1
    fig, axes = plt.subplots(n_rows, len(costs), figsize=(6 * len(costs), 4.2 * n_rows), squeeze=False)
    for ax, cname in zip(axes[0], costs):
        for pol, style in (("shape_primary", "-o"), ("shape_both", "-s"), ("oracle_shape_primary", ":o"),
                           ("oracle_shape_both", ":s")):
            sel = [r for r in rows if r["cost_model"] == cname and r["policy"] == pol]
            if not sel:
                continue
            bs = sorted({r["batch_size"] for r in sel})
            gains = [[100 * r["gain_vs_even"] for r in sel if r["batch_size"] == b] for b in bs]
            mean = [float(np.mean(g)) for g in gains]
            label = pol.replace("_", " ") + (" (exact 2-chain rule)" if pol == "oracle_shape_both" else "")
            line = ax.plot(bs, mean, style, label=label)[0]
            ax.fill_between(bs, [min(g) for g in gains], [max(g) for g in gains], color=line.get_color(), alpha=0.12)
        ax.axhline(0, color="k", lw=0.6)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch size B")
        ax.set_title(cname)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("goodput gain vs even-spread pricing (%)\nmean over banks, band = min..max")
    axes[0][-1].legend(fontsize=8)
    for ax, cname in zip(axes[1] if wd_rows else [], costs):
        sel = [r for r in wd_rows if r["cost_model"] == cname]
        keys = sorted({(r["running"], r["budget"]) for r in sel})
        for col, label in (("gain_vs_width_first", "policy vs width first"), ("gain_vs_depth_first", "policy vs depth first")):
            vals = [[100 * r[col] for r in sel if (r["running"], r["budget"]) == k] for k in keys]
            x = np.arange(len(keys))
            line = ax.plot(x, [float(np.mean(v)) for v in vals], "-o", label=label)[0]
            ax.fill_between(x, [min(v) for v in vals], [max(v) for v in vals], color=line.get_color(), alpha=0.12)
        ax.set_xticks(np.arange(len(keys)), [f"R={r}\nT={t}" for r, t in keys])
        ax.axhline(0, color="k", lw=0.6)
        ax.set_title(f"{cname}: width vs depth, budget T")
        ax.grid(alpha=0.3)
        ax.set_yscale("symlog", linthresh=10)
    if wd_rows:
        axes[1][0].set_ylabel("goodput gain (%), mean over banks\n(R running requests, queue never empty)")
        axes[1][-1].legend(fontsize=8)
    fig.suptitle("Shape-aware vs even-spread MoE pricing (calib allocator, replay, roofline on H200; testbed routing)")
    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=120)
    os.replace(tmp, path)


def main(argv: list[str]) -> None:
    from calib.cli import parser as plain_parser

    ap = plain_parser(__doc__)
    ap.add_argument("overrides", nargs="*", help="OmegaConf dot-list overrides of conf/eval_moe.yaml (key=value)")
    argv = ap.parse_args(argv).overrides
    from omegaconf import OmegaConf

    cfg = OmegaConf.merge(OmegaConf.load(ROOT / "conf" / "eval_moe.yaml"), OmegaConf.from_dotlist(argv))
    import yaml

    import calib.tables
    from calib.cost.moe import MoECost
    from calib.evaluate.replay.moe import MoEReplayConfig, replay_moe

    warnings.simplefilter("ignore")  # the tables' cross-check notes (kept in each bank's notes)
    t0 = time.time()
    tables = calib.tables.load(ROOT / cfg.tables)
    banks = load_banks(cfg, tables)
    costs = {}
    for name in cfg.costs:
        costs[name] = MoECost(yaml.safe_load((ROOT / "conf" / "cost" / f"{name}.yaml").read_text())[name], ROOT)
    rcfg = MoEReplayConfig(**OmegaConf.to_container(cfg.replay, resolve=True))

    def progress(meta, res):
        gains = {k: f"{100 * (v['goodput'] / res[k.replace('shape_', 'even_')]['goodput'] - 1):+.2f}%"
                 for k, v in res.items() if k.startswith("shape_")}
        print(f"[{time.time() - t0:6.0f}s] {meta['bank']:<28} B={meta['batch_size']:<4} {meta['cost_model']:<18} "
              f"{gains}", flush=True)

    rows = replay_moe(banks, costs, rcfg, progress=progress)
    wd_rows = width_depth_rows(banks, costs, cfg)
    out = ROOT / cfg.out
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = {"command": "python bench/moe_replay.py " + " ".join(argv), "config": OmegaConf.to_container(cfg),
           "seconds": round(time.time() - t0, 1), "rows": rows, "width_depth": wd_rows}
    tmp = out.with_suffix(".tmp.json")
    tmp.write_text(json.dumps(doc, indent=1))
    os.replace(tmp, out.with_suffix(".json"))
    figure(rows, out.with_suffix(".png"), wd_rows)
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.png')} in {time.time() - t0:.0f}s")


if __name__ == "__main__":
    main(sys.argv[1:])
