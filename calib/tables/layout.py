"""The acceptance-table layout the allocator reads (an interface other engines implement).

The calibrators export their fitted models as small dense grids so that serving needs no
training code: the allocator only looks values up. Any object with the attributes and
methods of :class:`AcceptanceTables` will do; :class:`GridTables` is the in-memory
implementation (built from tensors) used by tests and by the Triton path's layout.

Model chain. ``model_grid`` is float32 ``[D, G]``: row ``k`` holds the calibrated
``P(accept at depth k | depth k reached)`` at raw confidence ``c = g / (G - 1)`` for
``g = 0..G-1``. A confidence is a probability: a value outside ``[0, 1]`` (a logit passed by
mistake) is an error; it is looked up by linear interpolation between its two neighbouring grid
points. A NaN confidence means "no token here" and gives NaN.

N-gram chain. ``ngram_edges`` is float32 ``[F, E]``: the inner bin edges of each feature,
right-padded with ``+inf``; feature ``f`` of value ``x`` falls in bucket ``#{e : edges[f, e] <= x}``
(so ``0..E``). ``ngram_strides`` is int64 ``[F]`` and the grid cell is
``sum_f bucket_f * stride_f``; ``ngram_grid`` is float32 ``[D_ng, C]``, one row per depth. Features
come in ``[B, L, F]`` with exactly the tables' ``F`` (another count is an error naming both). A depth
whose feature 0 is NaN has no token (NaN out).

Depths beyond the tables. Tables hold one row per depth they were fitted on (``D``, ``D_ng``). The
lookups here read row ``D - 1`` for deeper columns (the calibrators' own rule beyond the deepest depth
they saw: offline analysis of a bank against its tables relies on it). The serve-time entry point
:func:`calib.allocate.allocate` is stricter: a chain wider than the tables (``K > D`` or ``L > D_ng``)
is refused unless the tables say that their last row stands for every deeper depth, with
``reuse_last_row = True`` (a :class:`GridTables` field; an attribute other implementations may
carry, False when absent). An engine drafting deeper than its tables was fitted for has the wrong
tables far more often than it means the last row.

The Triton kernel performs these same lookups with the same float32 operations in the same
order, so its probabilities are bitwise equal to the ones computed here. It clamps confidences to
``[0, 1]`` instead of refusing them: a check of values would read back to the host, so
:func:`calib.allocate.allocate` checks them before the launch only where that costs no device sync.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np
import torch


@runtime_checkable
class AcceptanceTables(Protocol):
    """What :func:`calib.allocate.allocate` needs from exported tables."""

    model_grid: torch.Tensor  # float32 [D, G]
    ngram_edges: torch.Tensor  # float32 [F, E], +inf padded
    ngram_strides: torch.Tensor  # int64 [F]
    ngram_grid: torch.Tensor  # float32 [D_ng, C]
    # Optional (read with getattr, False when absent): reuse_last_row: bool, see the module docstring.

    def model_accept_prob(self, conf: torch.Tensor) -> torch.Tensor:
        """[B, K] raw confidences -> [B, K] conditional acceptance probabilities (NaN = no token)."""
        ...

    def ngram_accept_prob(self, features: torch.Tensor) -> torch.Tensor:
        """[B, L, F] match features -> [B, L] conditional acceptance probabilities (NaN = no token)."""
        ...


def as_float_tensor(x, name: str) -> torch.Tensor:
    """``x`` as a float tensor: tensors must be floating point already; numpy arrays and (nested)
    lists of numbers are converted to float32 (on the CPU)."""
    if isinstance(x, torch.Tensor):
        if not x.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got dtype {x.dtype}")
        return x
    try:
        return torch.from_numpy(np.asarray(x, dtype=np.float32))
    except (TypeError, ValueError) as err:
        raise ValueError(f"{name} must be a float tensor, a numpy array or a (nested) list of numbers; "
                         f"got {type(x).__name__} ({err})") from None


def check_confidences(conf: torch.Tensor, name: str = "conf") -> None:
    """Refuse confidences outside ``[0, 1]`` (NaN = no token is fine), naming the first one.

    Reads the tensor on the host: callers that must stay free of device syncs skip it.
    """
    bad = ~torch.isnan(conf) & ((conf < 0) | (conf > 1))
    if bool(bad.any()):
        where = tuple(int(i) for i in bad.nonzero()[0])
        raise ValueError(f"{name}{list(where)} = {float(conf[where])!r}: a drafter confidence is the "
                         "probability of the proposed token, in [0, 1] (NaN = no token); "
                         "were logits passed by mistake?")


def check_ngram_features(features: torch.Tensor, n_features: int, name: str = "ngram_features") -> None:
    """``features`` must be ``[B, L, F]`` with the tables' ``F``."""
    if features.ndim != 3:
        raise ValueError(f"{name} must be [B, L, F], got shape {tuple(features.shape)}")
    if features.shape[-1] != n_features:
        raise ValueError(f"{name} has F={features.shape[-1]} features per depth but the tables expect "
                         f"F={n_features} (ngram_edges is [F, E]); pass the features the tables were "
                         "exported with, in their order (tables.json: ngram_features)")


def model_grid_lookup(grid: torch.Tensor, conf: torch.Tensor) -> torch.Tensor:
    """Linear interpolation of ``grid`` ([D, G]) at confidences ``conf`` ([B, K] float tensor, numpy
    array or list; values in ``[0, 1]``, NaN = no token) -> float32 [B, K]; NaN stays NaN.

    Columns ``k >= D`` read row ``D - 1`` (see the module docstring).
    """
    conf = as_float_tensor(conf, "conf")
    if conf.ndim != 2:
        raise ValueError(f"conf must be [B, K], got shape {tuple(conf.shape)}")
    check_confidences(conf)
    n_depth, n_points = grid.shape
    grid = grid.to(device=conf.device, dtype=torch.float32)
    conf = conf.to(torch.float32)
    k = conf.shape[-1]
    rows = torch.arange(k, device=conf.device).clamp(max=n_depth - 1)  # deeper tokens reuse the last row
    no_token = torch.isnan(conf)
    c = torch.where(no_token, torch.zeros_like(conf), conf).clamp(0.0, 1.0)
    if n_points == 1:
        p = grid[rows, 0].expand_as(c).clone()
    else:
        pos = c * (n_points - 1)
        lo = torch.floor(pos).to(torch.int64).clamp(max=n_points - 2)
        frac = pos - lo.to(torch.float32)
        g_lo = grid[rows[None, :], lo]
        g_hi = grid[rows[None, :], lo + 1]
        p = g_lo + frac * (g_hi - g_lo)  # kept as two float32 ops: the kernel disables FMA to match
    return torch.where(no_token, torch.full_like(p, float("nan")), p)


def ngram_grid_lookup(
    edges: torch.Tensor, strides: torch.Tensor, grid: torch.Tensor, features: torch.Tensor
) -> torch.Tensor:
    """Bucketise ``features`` ([B, L, F], F = ``edges.shape[0]``) by ``edges`` and read ``grid`` per
    depth ([B, L]); depths ``>= D_ng`` read the last row (see the module docstring)."""
    features = as_float_tensor(features, "ngram_features")
    check_ngram_features(features, edges.shape[0])
    device = features.device
    edges = edges.to(device=device, dtype=torch.float32)
    strides = strides.to(device=device, dtype=torch.int64)
    grid = grid.to(device=device, dtype=torch.float32)
    x = features.to(torch.float32)
    n_depth = grid.shape[0]
    # bucket_f(x) = number of inner edges <= x; +inf padding never counts (not even for x = +inf,
    # which would index past the grid), NaN counts nothing.
    counted = (edges[None, None, :, :] <= x[..., None]) & torch.isfinite(edges)
    buckets = counted.sum(-1)  # [B, L, F]
    cell = (buckets * strides).sum(-1)  # [B, L]
    rows = torch.arange(x.shape[1], device=device).clamp(max=n_depth - 1)
    no_token = torch.isnan(x[..., 0])
    cell = torch.where(no_token, torch.zeros_like(cell), cell)
    p = grid[rows[None, :].expand_as(cell), cell]
    return torch.where(no_token, torch.full_like(p, float("nan")), p)


@dataclass
class GridTables:
    """In-memory :class:`AcceptanceTables` built from tensors (see module docstring for layout)."""

    model_grid: torch.Tensor  # float32 [D, G]
    ngram_edges: torch.Tensor  # float32 [F, E], +inf padded
    ngram_strides: torch.Tensor  # int64 [F]
    ngram_grid: torch.Tensor  # float32 [D_ng, C]
    reuse_last_row: bool = False  # True: depths >= D (D_ng) stand on row D - 1 at serve time too

    def __post_init__(self) -> None:
        if self.model_grid.ndim != 2 or min(self.model_grid.shape) < 1:
            raise ValueError(f"model_grid must be [D, G] with D, G >= 1, got {tuple(self.model_grid.shape)}")
        if self.ngram_edges.ndim != 2 or self.ngram_strides.shape != (self.ngram_edges.shape[0],):
            raise ValueError("ngram_edges must be [F, E] and ngram_strides [F]")
        if self.ngram_grid.ndim != 2 or min(self.ngram_grid.shape) < 1:
            raise ValueError("ngram_grid must be [D_ng, C] with D_ng, C >= 1")
        # +inf padding is never <= a feature, so a feature's top bucket is its number of finite edges.
        top_bucket = torch.isfinite(self.ngram_edges).sum(dim=1)
        largest_cell = int((top_bucket * self.ngram_strides).sum())
        if largest_cell >= self.ngram_grid.shape[1]:
            raise ValueError(f"ngram_grid has {self.ngram_grid.shape[1]} cells, strides reach {largest_cell}")

    def to(self, device: torch.device | str) -> GridTables:
        return GridTables(*(t.to(device) for t in (self.model_grid, self.ngram_edges,
                                                   self.ngram_strides, self.ngram_grid)),
                          reuse_last_row=self.reuse_last_row)

    def model_accept_prob(self, conf: torch.Tensor) -> torch.Tensor:
        return model_grid_lookup(self.model_grid, conf)

    def ngram_accept_prob(self, features: torch.Tensor) -> torch.Tensor:
        return ngram_grid_lookup(self.ngram_edges, self.ngram_strides, self.ngram_grid, features)
