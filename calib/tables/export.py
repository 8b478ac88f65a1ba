"""Fitted calibrators → the dense grids an engine looks up (no Python model at serve time).

Context axes (temperature, ...; :mod:`calib.chains`) cut any chain's table into cells, each encoded
as below from its own estimator (:func:`encode_chain`). Model drafter: each depth's calibrator is evaluated on a fine uniform grid of raw confidences and
projected onto non-decreasing values (a calibrated acceptance should not fall as the drafter grows
more confident; the projection's largest change is recorded). N-gram drafter: the feature space is
cut into cells by per-feature edges; a cell's value at depth k is the mean of the fitted model's
predictions over the training samples that fall in it (the model's expectation given the coarse
features), and the model's prediction at the cell's representative point where no sample does.
Every chain's record in tables.json also says which sampling temperatures its training samples were
drawn at (:func:`fitted_temperatures`): temperature is part of the tables' identity, checked against
banks and engines (:meth:`calib.tables.Tables.check_bank`, :meth:`calib.tables.Tables.check_temperature`).
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import torch
from sklearn.isotonic import IsotonicRegression

from calib.calibrators.base import with_depth
from calib.tables.layout import ChainTable

MARGINAL_ROWS = 256  # training rows per depth (and context cell) a model's other inputs are averaged over
MARGINAL_POINTS = 129  # confidences at which that average is taken (then interpolated onto the grid)
GRID_MAX_ROWS = 1_000_000  # training rows a binned table's cell means are taken over (a random sample of more)


def encode_chain(kind, estimator, train_samples: pd.DataFrame, chain_cfg: dict, n_depths: int,
                 uses_context: bool = False, seed: int = 0) -> tuple[ChainTable, dict]:
    """A fitted estimator of chain ``kind`` -> its :class:`ChainTable` and what tables.json says about it.

    The encoding follows the chain's axes (``kind.table_axes(chain_cfg)``): its own axes, then the
    context axes ``chain_cfg`` selected (:func:`calib.chains.context_axes`). Each context cell's block
    of the grid is the chain's own encoding of that cell's estimator
    (:meth:`calib.calibrators.context.PerContextCell.cell_estimator`; the one estimator for every cell
    otherwise) over that cell's training samples (all of them where none fell in the cell); the cells
    are the most significant part of the cell index, so the own axes' strides are unchanged and
    context axis ``a``'s stride is the own block's width times the later context axes' sizes.
    """
    from calib.calibrators.context import PerContextCell, context_cells
    from calib.chains import context_axes

    axes = tuple(kind.table_axes(chain_cfg))
    ctx_axes = context_axes(chain_cfg)
    own_axes = axes[: len(axes) - len(ctx_axes)]
    temperatures = fitted_temperatures(train_samples, kind.name)
    if not ctx_axes:
        table, info = _encode_own(kind, estimator, train_samples, chain_cfg, own_axes, n_depths, uses_context, seed)
        return table, {**info, "temperatures": temperatures}
    ctx_edges = [list(a.edges) for a in ctx_axes]
    sizes = [len(e) + 1 for e in ctx_edges]
    cells = context_cells(train_samples[[a.name for a in ctx_axes]].to_numpy(np.float64), ctx_edges)
    blocks, infos = [], []
    for c in range(int(np.prod(sizes))):
        est = estimator.cell_estimator(c) if isinstance(estimator, PerContextCell) else estimator
        sub = train_samples[cells == c]
        t, info = _encode_own(kind, est, sub if len(sub) else train_samples, chain_cfg, own_axes, n_depths,
                              uses_context, seed)
        blocks.append(t)
        infos.append(info)
    own = blocks[0]
    width = own.grid.shape[1]  # the own block: G points, or the own binned cells
    grid = torch.cat([b.grid for b in blocks], dim=1)  # [D, cells * width]
    ctx_strides = [width * int(np.prod(sizes[a + 1:])) for a in range(len(sizes))]
    e_cols = max([own.edges.shape[1] if own.edges.shape[0] else 0, *(len(e) for e in ctx_edges), 1])
    edges = np.full((own.edges.shape[0] + len(ctx_edges), e_cols), np.inf, dtype=np.float32)
    if own.edges.shape[0]:
        edges[: own.edges.shape[0], : own.edges.shape[1]] = own.edges.numpy()
    for a, e in enumerate(ctx_edges):
        edges[own.edges.shape[0] + a, : len(e)] = e
    strides = np.concatenate([own.strides.numpy(), np.asarray(ctx_strides, dtype=np.int64)])
    info = dict(infos[0])
    if "monotone_projection_max_change" in info:
        info["monotone_projection_max_change"] = max(i["monotone_projection_max_change"] for i in infos)
    info["context"] = {"axes": [a.to_json() for a in ctx_axes], "cells": len(blocks),
                       "train_samples_per_cell": np.bincount(cells, minlength=len(blocks)).tolist()}
    info["temperatures"] = temperatures
    return ChainTable.build(axes, grid, edges, strides), info


MAX_TEMPERATURES = 256  # distinct fitted temperatures listed in tables.json (the range is always kept)
TEMPERATURE_DECIMALS = 6  # fitted temperatures are recorded (and compared) at this precision


def fitted_temperatures(samples: pd.DataFrame, chain_name: str = "?") -> dict:
    """tables.json ``chains.<name>.temperatures``: the sampling temperatures of the training samples a
    chain's table was fitted on, ``{"values": distinct values (sorted, rounded to 6 decimals; at most
    256 listed), "n_values": how many distinct, "min", "max", "unrecorded_samples": samples without one}``.

    A single temperature is recorded too (``values: [0.0], min = max = 0.0``) although its context axis
    has one bin and no edges. Samples without a temperature (a bank that records none: the column is
    absent or NaN) are counted, not listed; with none recorded ``values`` is empty and ``min``/``max``
    are None (the tables then cannot tell which temperature they fit, and checks say so).
    A negative or infinite temperature is refused: a sampling temperature is finite and >= 0.
    """
    n = len(samples)
    if "temperature" not in getattr(samples, "columns", ()):
        return {"values": [], "n_values": 0, "min": None, "max": None, "unrecorded_samples": int(n)}
    t = pd.to_numeric(samples["temperature"], errors="coerce").to_numpy(np.float64)
    recorded = ~np.isnan(t)
    bad = recorded & ~(np.isfinite(t) & (t >= 0))
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        row = samples.iloc[i]
        where = ", ".join(f"{k}={row[k].item() if hasattr(row[k], 'item') else row[k]!r}"
                          for k in ("model", "speculator", "config", "category", "prompt_idx") if k in samples.columns)
        raise ValueError(f"chain {chain_name!r}: {int(bad.sum())} training samples have a sampling temperature "
                         f"that is not a finite number >= 0 (first: {float(t[i])!r} at {where}); fix or drop "
                         "that bank (python -m calib.bank validate PATH) before training")
    values = np.unique(np.round(t[recorded], TEMPERATURE_DECIMALS))
    listed = values if len(values) <= MAX_TEMPERATURES else values[:: max(1, len(values) // MAX_TEMPERATURES)]
    return {"values": [float(v) for v in listed[:MAX_TEMPERATURES]], "n_values": len(values),
            "min": float(values[0]) if len(values) else None, "max": float(values[-1]) if len(values) else None,
            "unrecorded_samples": int((~recorded).sum())}


def _encode_own(kind, estimator, train_samples, chain_cfg, axes, n_depths, uses_context, seed):
    """The chain's own axes: one interpolated axis (the raw confidence) -> ``grid [D, G]`` by
    :func:`model_grid`, context columns the estimator reads marginalised over (up to 256 training rows
    per depth, drawn with ``seed``); binned axes only -> ``edges``, ``strides``, ``grid [D, C]`` by
    :func:`ngram_grid`."""
    if len(axes) == 1 and axes[0].interpolated:
        context_by_depth = None
        names = None
        named = getattr(estimator, "features", None)  # a model on named features reads them by name
        if hasattr(estimator, "features_read"):  # a selection: what its chosen candidates read
            named = estimator.features_read(kind.feature_names(chain_cfg))
        if not uses_context and named is not None:  # the confidence alone, handed by name (a selection
            names = list(named[:1])                 # finds a candidate's named features only by name)
        if uses_context:  # tabulate E[p | conf, depth] over the (cell's) training rows of the other inputs
            if named is not None:
                if named[0] != axes[0].name:
                    raise ValueError(f"chain {kind.name!r}: {estimator.name} reads {list(named)}; its first "
                                     f"feature must be the table's axis {axes[0].name!r}")
                names, X = list(named), train_samples[list(named[1:])].to_numpy(np.float64)
            else:
                X = kind.X(train_samples, chain_cfg, context=False).to_numpy(np.float64)[:, 1:]
            depth = train_samples.depth.to_numpy()
            rng = np.random.default_rng(seed)
            context_by_depth = {}
            for d in range(n_depths):
                ex = X[depth == d]
                context_by_depth[d] = (ex[rng.choice(len(ex), min(len(ex), MARGINAL_ROWS), replace=False)]
                                       if len(ex) else context_by_depth.get(d - 1, X[:1]))  # no rounds reached d
        grid, change = model_grid(estimator, n_depths, axes[0].points, context_by_depth, names)
        return ChainTable.build(axes, grid), {"grid_points": int(grid.shape[1]),
                                "grid": "uniform raw confidence in [0, 1], linear interpolation",
                                "monotone_projection_max_change": change}
    if all(not a.interpolated for a in axes):
        feats, edges = [a.name for a in axes], [list(a.edges) for a in axes]
        e_arr, strides, grid, info = ngram_grid(estimator, train_samples, feats, edges, n_depths,
                                                lambda df: kind.X(df, chain_cfg))  # context: a feature for some
        return ChainTable.build(axes, grid, e_arr, strides), {"features": feats, "edges": edges, **info}
    raise NotImplementedError(f"chain {kind.name!r}: own axes mixing an interpolated axis and binned axes "
                              "are not encoded (context axes are: calib.chains.context_axes)")


def model_grid(calibrator, n_depths: int, grid_points: int = 1025,
               extra_by_depth: dict[int, np.ndarray] | None = None, names=None) -> tuple[np.ndarray, float]:
    """[n_depths, grid_points] calibrated probabilities, and the monotone projection's largest change.

    A calibrator fitted with context features (entropy, margin, temperature, ...) cannot be a function
    of the confidence alone; ``extra_by_depth[d]`` (rows of training context at depth d; columns
    ``names[1:]`` for a model reading named features, handed a DataFrame) is then averaged over, so the
    table holds E[p | conf, depth] under the training distribution of the context: the model distilled
    into the grid. That average is taken at :data:`MARGINAL_POINTS` confidences and interpolated
    linearly between them (the model is smooth in the confidence; every grid point would cost
    ``grid_points`` x rows predictions per depth). Without ``extra_by_depth``, ``names[0]`` (where given)
    names the confidence column (a selection finds a candidate's named features by name only).
    """
    conf = np.linspace(0.0, 1.0, grid_points)
    rows, change = [], 0.0
    for d in range(n_depths):
        if extra_by_depth is None:
            X = conf if names is None else pd.DataFrame({names[0]: conf})
            p = calibrator.accept_proba(with_depth(X, np.full(grid_points, d)))
        else:
            ex = extra_by_depth[min(d, max(extra_by_depth))]
            at = np.linspace(0.0, 1.0, min(grid_points, MARGINAL_POINTS))
            X = np.column_stack([np.repeat(at, len(ex)), np.tile(ex, (len(at), 1))])
            if names is not None:
                X = pd.DataFrame(X, columns=list(names))
            p = calibrator.accept_proba(with_depth(X, np.full(len(at) * len(ex), d))).reshape(len(at), len(ex)).mean(1)
            p = np.interp(conf, at, p)
        p = np.clip(p, 0.0, 1.0)
        mono = IsotonicRegression(increasing=True).fit_transform(conf, p)
        change = max(change, float(np.max(np.abs(mono - p))))
        rows.append(mono)
    return np.stack(rows).astype(np.float32), change


def buckets(values: np.ndarray, edges) -> np.ndarray:
    """Bucket index = number of edges <= value (the kernel's rule); NaN → 0."""
    e = np.asarray(edges, dtype=np.float64)
    return (np.nan_to_num(values, nan=-np.inf)[:, None] >= e[None, :]).sum(axis=1)


def ngram_grid(model, samples: pd.DataFrame, table_features: list[str], edges: list[list[float]],
               n_depths: int, design=None) -> tuple[np.ndarray, np.ndarray, np.ndarray, dict]:
    """(edges [F, E] +inf padded, strides [F], grid [n_depths, C], info) for a fitted estimator on
    binned axes. ``design(df)`` builds the estimator's X from samples (default: the samples frame,
    from which an n-gram model reads its features by name)."""
    design = design or (lambda df: df)
    sizes = [len(e) + 1 for e in edges]
    strides = np.array([int(np.prod(sizes[f + 1:])) for f in range(len(sizes))], dtype=np.int64)
    n_cells = int(np.prod(sizes))
    width = max(len(e) for e in edges)
    edge_arr = np.full((len(edges), width), np.inf, dtype=np.float32)
    for f, e in enumerate(edges):
        edge_arr[f, : len(e)] = e

    b = np.stack([buckets(samples[name].to_numpy(np.float64), edges[f]) for f, name in enumerate(table_features)],
                 axis=1)
    # Cell means of the model's predictions: over a random GRID_MAX_ROWS of the training rows where
    # there are more (an average, not a fit; a cell none of them falls in takes its representative point).
    scored = (np.arange(len(samples)) if len(samples) <= GRID_MAX_ROWS
              else np.sort(np.random.default_rng(0).choice(len(samples), GRID_MAX_ROWS, replace=False)))
    sub = samples.iloc[scored] if len(scored) < len(samples) else samples
    cell = (b[scored] * strides).sum(axis=1)
    pred = model.accept_proba(with_depth(design(sub), sub["depth"].to_numpy()))
    depth = np.minimum(sub["depth"].to_numpy(), n_depths - 1)

    # Representative point of every cell: per feature, the median training value in its bucket
    # (the bucket's midpoint when no training value falls there); other model features at their median.
    reps = []
    for f, name in enumerate(table_features):
        vals = samples[name].to_numpy(np.float64)
        e = np.asarray(edges[f], dtype=np.float64)
        rep = []
        for k in range(sizes[f]):
            inside = vals[b[:, f] == k]
            if inside.size:
                rep.append(float(np.median(inside)))
            else:
                lo = e[k - 1] if k > 0 else (e[0] - 1.0 if e.size else 0.0)
                hi = e[k] if k < e.size else (e[-1] + 1.0 if e.size else 0.0)
                rep.append(0.5 * (lo + hi))
        reps.append(rep)
    idx = np.array(np.unravel_index(np.arange(n_cells), sizes)).T  # [C, F] bucket per feature
    base = samples.median(numeric_only=True)
    grid = np.zeros((n_depths, n_cells), dtype=np.float64)
    filled = 0
    for d in range(n_depths):
        synth = pd.DataFrame({c: np.full(n_cells, base[c]) for c in base.index})
        for f, name in enumerate(table_features):
            synth[name] = np.asarray(reps[f])[idx[:, f]]
        synth["depth"] = d
        grid[d] = model.accept_proba(with_depth(design(synth), np.full(n_cells, d)))
        m = depth == d
        n = np.bincount(cell[m], minlength=n_cells)
        s = np.bincount(cell[m], weights=pred[m], minlength=n_cells)
        seen = n > 0
        grid[d, seen] = s[seen] / n[seen]
        filled += int(seen.sum())
    info = {"cells": n_cells, "cells_with_samples": filled, "depths": n_depths}
    return edge_arr, strides, grid.astype(np.float32), info


def table_predict(table: ChainTable, inputs, depth) -> np.ndarray:
    """The table's P(accept | reached) for single samples: ``inputs`` [n, A] (the table's axes, in
    order; [n] for one axis), each read at its own ``depth`` [n]."""
    x = torch.from_numpy(np.asarray(inputs, dtype=np.float64).astype(np.float32))
    if x.ndim == 1:
        x = x[:, None]
    depth = np.asarray(depth)
    out = np.empty(len(depth))
    for d in np.unique(depth):
        m = depth == d
        row = ChainTable(table.axes, table.grid[min(int(d), table.depths - 1)][None, :], table.edges, table.strides)
        out[m] = row.lookup(x[torch.from_numpy(m)][:, None, :])[:, 0].double().numpy()
    return out


def chain_forecast(table: ChainTable, samples: pd.DataFrame, ctx_axes, n_depths: int) -> dict:
    """tables.json ``chains.<name>.forecast``: the calibrated acceptance a chain's table gives, on average,
    at each depth in each context cell, over the training ``samples`` that reached that depth (what an
    engine can expect of the chain's next token before drafting it; :mod:`calib.allocate.draft`).

    Returns ``{"axes": the context axes (json), "values": [D][cells], "samples": [D][cells]}``; a
    (depth, cell) no sample reached takes the depth's mean over every cell (then the shallower depth's).
    """
    from calib.calibrators.context import context_cells

    names = [a.name for a in table.axes]
    p = table_predict(table, samples[names], samples.depth)
    edges = [list(a.edges) for a in ctx_axes]
    n_cells = int(np.prod([len(e) + 1 for e in edges])) if edges else 1
    cells = (context_cells(samples[[a.name for a in ctx_axes]].to_numpy(np.float64), edges) if edges
             else np.zeros(len(samples), dtype=np.int64))
    depth = samples.depth.to_numpy()
    values = np.full((n_depths, n_cells), np.nan)
    counts = np.zeros((n_depths, n_cells), dtype=np.int64)
    for d in range(n_depths):
        m = depth == d
        n = np.bincount(cells[m], minlength=n_cells)
        s = np.bincount(cells[m], weights=p[m], minlength=n_cells)
        counts[d] = n
        with np.errstate(invalid="ignore", divide="ignore"):
            values[d] = np.where(n > 0, s / np.maximum(n, 1), p[m].mean() if m.any() else np.nan)
        if np.isnan(values[d]).all():
            values[d] = values[d - 1] if d else 0.0
    return {"axes": [a.to_json() for a in ctx_axes], "values": np.round(values, 6).tolist(),
            "samples": counts.tolist()}
