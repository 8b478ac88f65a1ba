"""The tables' forecast of a chain before it is drafted: the calibrated acceptance expected at each depth in a
request's context cell, before its confidence is known. :func:`calib.allocate.draft.plan_draft` prices the model
chain's later passes on it (the serving plan, :mod:`calib.vllm.planning`), and eval reads it as the plan would
(:mod:`calib.evaluate.data`)."""

from __future__ import annotations

import numbers

import numpy as np
import torch

from calib.allocate.api import TEMPERATURE
from calib.params import Interval, NoneValue, validate_params
from calib.tables.online_kernels import cut, edge_grid

FORECAST_CONSTRAINTS = {"depths": [NoneValue(), Interval(numbers.Integral, 1, None)]}  # forecast_probs' arguments


def forecast_probs(tables, chain: str, context, depths: int | None = None) -> torch.Tensor:
    """The tables' forecast of ``chain`` (:meth:`calib.tables.Tables.forecast`): float32 [B, K] of
    the calibrated acceptance expected at each depth in each request's context cell.

    ``context``: float [B, A_ctx], the request's values of the forecast's context axes in their
    order (``forecast["axes"]``: the chain's context axes, e.g. temperature); [B, 0] or None when
    there are none. Depths beyond the forecast's rows repeat its last row (``depths``: K >= 1, default D).

    A temperature column holding a negative or infinite value is a ``ValueError`` naming the request;
    NaN is "not recorded" (an offline bank's round without a temperature) and reads bucket 0, as the
    tables' lookups do. The serving path refuses NaN before it gets here (:mod:`calib.serve.decide`).
    """
    if not (depths is None or (type(depths) is int and depths >= 1)):
        validate_params("forecast_probs", {"depths": depths}, FORECAST_CONSTRAINTS)
    chains_meta = getattr(tables, "meta", {}).get("chains") or {}
    if chain not in chains_meta:
        raise ValueError(f"forecast_probs: the tables calibrate {sorted(chains_meta)}, not the {chain!r} chain")
    meta = tables.forecast(chain)
    if meta is None:
        raise ValueError(f"the tables hold no forecast for the {chain} chain (tables from before the "
                         "draft-aware allocator: re-run train.py)")
    values, grid, strides = _forecast_arrays(meta)
    edges = [a["edges"] for a in meta["axes"]]
    if context is None:
        ctx = np.zeros((0, 0))
    elif isinstance(context, torch.Tensor) and context.dtype == torch.float64 and context.device.type == "cpu":
        ctx = context.numpy()  # the serving plan's columns, as they are
    else:
        ctx = np.asarray(torch.as_tensor(context, dtype=torch.float64))
    n = ctx.shape[0] if context is not None else 1
    if edges and (ctx.ndim != 2 or ctx.shape[1] != len(edges)):
        names = [a["name"] for a in meta["axes"]]
        raise ValueError(f"context must be [B, {len(edges)}] holding {names}, got shape {tuple(ctx.shape)}")
    for j, axis in enumerate(meta["axes"]):
        if axis["name"] == TEMPERATURE and edges:
            t = ctx[:, j]
            bad = ~np.isnan(t) & ~((t >= 0) & np.isfinite(t))
            if bad.any():
                i = int(np.flatnonzero(bad)[0])
                raise ValueError(f"context[{i}, {j}] = {float(t[i])!r}: request {i}'s sampling temperature must be a "
                                 "finite number >= 0 (0 = greedy; NaN = not recorded)")
    cells = cut(ctx, grid, strides) if edges else np.zeros(n, dtype=np.int64)  # context_cells' cells
    D = values.shape[0]
    rows = np.minimum(np.arange(depths if depths is not None else D), D - 1)
    return torch.from_numpy(np.ascontiguousarray(values[rows][:, cells].T))


_FORECASTS: dict[int, tuple] = {}  # id(a forecast's values list) -> (that list, its arrays): built once per tables


def _forecast_arrays(meta: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A forecast's values float32 ``[D, cells]`` and its axes' cut (:func:`calib.tables.online_kernels.edge_grid`),
    kept for as long as its tables hold the same values list (a serving plan reads them every step)."""
    held = _FORECASTS.get(id(meta["values"]))
    if held is None or held[0] is not meta["values"]:
        if len(_FORECASTS) > 64:  # tables come and go in tests: keep the newest few
            _FORECASTS.clear()
        values = np.array(meta["values"], dtype=np.float32)
        held = _FORECASTS[id(meta["values"])] = (meta["values"], values, *edge_grid([a["edges"] for a in meta["axes"]]))
    return held[1], held[2], held[3]
