"""eval's measure of the online correction (:mod:`calib.tables.online`): the tables alone vs the tables
corrected by what verification revealed, replayed over each bank's scored rounds in collection order.

Per (temperature, chain, category) slice, after the first ``warmup`` rounds of the stream (a serving
run mixes categories and temperatures as the bank does; the correction is keyed per depth and per the
table's context cell, as serving keys it): the mean accepted length predicted with the
tables alone and with the correction against the actual, and the ECE of both at the verified
positions. The warm-up curve is the relative length error in consecutive windows of rounds, against
rounds seen. Synthetic data never enters here: these are the banks eval was given.
"""

from __future__ import annotations

import numbers
from pathlib import Path

import numpy as np

from calib import metrics as M
from calib.evaluate.depths import DEPTH_MIN_LABELS, depth_rows, depth_verdict
from calib.labels import censored
from calib.tables.online import OnlineSettings, context_cells, context_of, replay_online

WARMUP_ROUNDS = 200  # the "after the first 200 verified rounds of the run" (metrics.online_warmup_rounds)
CURVE_WINDOW = 100  # rounds per point of the warm-up curve


def replays(banks, tables, settings: OnlineSettings, split: str = "test") -> list[dict]:
    """Every bank chain with calibrated probabilities, its ``split`` rounds replayed in collection order once:
    ``bank``, ``chain``, ``keep`` (round indices ``[R]``), ``temperature`` ``[R]`` (NaN: not recorded),
    ``acc`` ``[R, K]``, ``raw`` (the drafter's own confidence ``[R, K]``, None without one), ``tables`` and
    ``online`` ``[R, K]`` (the tables alone, corrected online as serving reads them). The correction is
    keyed per depth and per the ``tables``' context cell of the round (:class:`calib.tables.online_tables.OnlineTables`)."""
    out = []
    for bank in banks:
        temps = (bank.round_temperature if bank.round_temperature is not None
                 else np.full(len(bank.category), np.nan if bank.temperature is None else bank.temperature))
        for drafter, chain in bank.chains.items():
            if chain.p_cal is None:
                continue
            keep = np.flatnonzero((bank.split == split) & chain.labelled)
            if keep.size == 0:
                continue
            p, acc = chain.p_cal[keep], chain.acc[keep]
            _, edges = context_of(tables.table(drafter), drafter)
            cells = context_cells(chain.context[keep], edges)
            out.append({"bank": bank, "chain": drafter, "keep": keep, "temperature": np.round(temps[keep], 6),
                        "acc": acc, "raw": None if chain.p_raw is None else chain.p_raw[keep], "tables": p,
                        "online": replay_online(p, acc, cells, settings)})
    return out


def with_online(banks: list, replayed: list[dict]) -> list:
    """``banks`` with each replayed chain's calibrated probabilities at its replayed rounds replaced by the online
    correction's (:func:`replays`' ``online``): what the replay's policies decide by under ``replay.online``, as
    serving decides by the corrected tables. The banks given are not changed (copies where a chain is replaced)."""
    import dataclasses

    by_bank: dict[int, list[dict]] = {}
    for rec in replayed:
        by_bank.setdefault(id(rec["bank"]), []).append(rec)
    out = []
    for bank in banks:
        recs = by_bank.get(id(bank))
        if not recs:
            out.append(bank)
            continue
        chains = dict(bank.chains)
        for rec in recs:
            chain = chains[rec["chain"]]
            p = chain.p_cal.copy()  # [R, K]
            p[rec["keep"]] = rec["online"]
            chains[rec["chain"]] = dataclasses.replace(chain, p_cal=p)
        out.append(dataclasses.replace(bank, chains=chains))
    return out


def online_rows(replayed: list[dict], warmup: int = WARMUP_ROUNDS, n_bins: int = 15) -> tuple[list[dict], list[dict]]:
    """``(slice rows, warm-up curve rows)`` of :func:`replays`' records."""
    rows, curve = [], []
    for rec in replayed:
        bank, drafter, keep, t_keep = rec["bank"], rec["chain"], rec["keep"], rec["temperature"]
        p, p_on, acc = rec["tables"], rec["online"], rec["acc"]
        actual = bank.chains[drafter].accept[keep].astype(np.float64)
        pred = {"tables": M.expected_accepted_length(p), "online": M.expected_accepted_length(p_on)}
        reached, label = censored(acc)
        after = np.arange(keep.size) >= warmup
        for t in np.unique(t_keep[np.isfinite(t_keep)]) if np.isfinite(t_keep).any() else [np.nan]:
            in_t = (t_keep == t) if np.isfinite(t) else ~np.isfinite(t_keep)
            for c in [*sorted(set(bank.category[keep][in_t].tolist())), "all"]:
                m = after & in_t & (True if c == "all" else bank.category[keep] == c)
                if not m.any():
                    continue
                row = {"bank": bank.name, "chain": drafter, "temperature": float(t) if np.isfinite(t) else None,
                       "category": c, "rounds": int(m.sum()), "actual_mean": float(actual[m].mean())}
                for v, q in (("tables", p), ("online", p_on)):
                    row[f"predicted_{v}"] = float(pred[v][m].mean())
                    row[f"error_{v}"] = (abs(row[f"predicted_{v}"] - row["actual_mean"]) / row["actual_mean"]
                                         if row["actual_mean"] else None)
                    r = reached[m] & ~np.isnan(q[m])
                    row[f"ece_{v}"] = M.ece(q[m][r], label[m][r].astype(np.float64), n_bins) if r.any() else None
                rows.append(row)
        for s in range(0, keep.size - CURVE_WINDOW + 1, CURVE_WINDOW):
            w = slice(s, s + CURVE_WINDOW)
            a = float(actual[w].mean())
            curve.append({"bank": bank.name, "chain": drafter, "rounds_seen": s + CURVE_WINDOW,
                          **{f"error_{v}": (abs(float(pred[v][w].mean()) - a) / a if a else None) for v in pred}})
    return rows, curve


def online_settings(cfg) -> OnlineSettings:
    """``cfg.online`` read by the schema serving reads ``serve.online`` with."""
    return OnlineSettings.from_config(cfg.get("online") or {}, key="online", owner="eval.py config")


def online_metrics(cfg, banks, tables, out: Path, replayed: list[dict] | None = None) -> dict:
    """metrics.json's ``online``: the tables alone vs corrected online, per slice, and the warm-up curve (with its
    figure in ``out``). The settings are ``cfg.online``, read by the schema serving reads ``serve.online`` with
    (:meth:`calib.tables.online.OnlineSettings.from_config`; both compose conf/online/default.yaml)."""
    from calib.evaluate import plots
    from calib.evaluate.report import SLICE_MAX_ERROR
    from calib.params import Interval, validate_params

    settings = online_settings(cfg)
    warmup = cfg.metrics.get("online_warmup_rounds", WARMUP_ROUNDS)
    validate_params("eval.py config", {"metrics.online_warmup_rounds": warmup},
                    {"metrics.online_warmup_rounds": [Interval(numbers.Integral, 0, None)]})
    if replayed is None:
        replayed = replays(banks, tables, settings, split=cfg.split.get("name", "test"))
    rows, curve = online_rows(replayed, warmup=int(warmup), n_bins=int(cfg.metrics.n_bins))
    pic = plots.warmup_curve(curve, out / "online_warmup.png", target=SLICE_MAX_ERROR) if curve else None
    cells = ("the table's context cell, under a per-depth offset every cell shares"
             + (" and a slope on the table's logit" if settings.slope else "")
             if settings.pooled else "the table's context cell")
    depths = depth_rows(replayed, int(cfg.metrics.n_bins), int(cfg.metrics.get("n_boot", 200)),
                        int(cfg.metrics.get("seed", 0)), int(cfg.metrics.get("depth_min_labels", DEPTH_MIN_LABELS)))
    return {"settings": {**settings.to_config(), "warmup_rounds": int(warmup), "cells": cells},
            "slices": rows, "warmup_curve": curve, "figure": pic and str(Path(pic).relative_to(out)),
            "depths": depths, "depth_verdict": depth_verdict(depths)}
