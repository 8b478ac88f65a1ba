"""The acceptance-table layout the allocator reads (an interface other engines implement).

The calibrators export their fitted models as small dense grids so that serving needs no
training code: the allocator only looks values up. Any object with the attributes and
methods of :class:`AcceptanceTables` will do; :class:`GridTables` is the in-memory
implementation (built from tensors) used by tests and by the Triton path's layout.

One layout for every chain kind (:mod:`calib.chains`). A chain's :class:`ChainTable` has ``axes``
(:class:`calib.chains.Axis`, one per input feature, in the order an engine passes them) and

* ``grid`` float32 ``[D, C]``: row ``k`` holds ``P(accept at depth k | depth k reached)`` per cell;
* ``edges`` float32 ``[A_b, E]``: the inner bin edges of the ``A_b`` *binned* axes, right-padded with
  ``+inf``; a value ``x`` falls in bucket ``#{e : edges[a, e] <= x}`` (so ``0..E``; NaN counts nothing);
* ``strides`` int64 ``[A_b]``: the binned axes' cell is ``cell = sum_a bucket_a * strides[a]``.

An *interpolated* axis (at most one, axis 0: the model chain's raw confidence) is a uniform grid of
``G`` points over ``[0, 1]``: the value at confidence ``c`` interpolates linearly between columns
``cell + lo`` and ``cell + lo + 1`` with ``lo = floor(c * (G - 1))`` (the binned axes' strides count in
units of ``G``). A confidence is a probability: a value outside ``[0, 1]`` (a logit passed by mistake)
is an error. The model chain today: the interpolated confidence, then binned context axes
(:data:`calib.chains.CONTEXT`: temperature, ...; one block of ``G`` columns per context cell, so
``C = G * cells``); the n-gram chain: binned match features, then the same context axes.

Inputs are ``[B, L, A]`` per chain (a chain with one axis may pass ``[B, L]``); feature 0 NaN means
"no token at this depth" and gives NaN. Another ``A`` than the table's is an error naming both.

Depths beyond the tables. Tables hold one row per depth they were fitted on (``D``). The lookups
here read row ``D - 1`` for deeper columns (the calibrators' own rule beyond the deepest depth they
saw: offline analysis of a bank against its tables relies on it). The serve-time entry point
:func:`calib.allocate.allocate` is stricter: a chain wider than its table is refused unless the
tables say that their last row stands for every deeper depth, with ``reuse_last_row = True`` (a
:class:`GridTables` field; an attribute other implementations may carry, False when absent).

The Triton kernel performs these same lookups with the same float32 operations in the same
order, so its probabilities are bitwise equal to the ones computed here. It clamps confidences to
``[0, 1]`` instead of refusing them: a check of values would read back to the host, so
:func:`calib.allocate.allocate` checks them before the launch only where that costs no device sync.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import numpy as np
import torch

from calib.tables.lookup_compiled import NO_CORRECTION, lookup_kernel


@runtime_checkable
class AcceptanceTables(Protocol):
    """What :func:`calib.allocate.allocate` needs from exported tables."""

    chains: dict  # chain name -> ChainTable
    # Optional (read with getattr, False when absent): reuse_last_row: bool, see the module docstring.

    def accept_prob(self, chain: str, inputs: torch.Tensor) -> torch.Tensor:
        """[B, L, A] (or [B, L]) chain inputs -> [B, L] conditional acceptance probabilities (NaN = no token)."""
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


def check_chain_inputs(x: torch.Tensor, table: ChainTable, name: str) -> torch.Tensor:
    """``x`` as ``[B, L, A]`` with the table's ``A`` (a ``[B, L]`` tensor is one axis)."""
    n_axes = len(table.axes)
    if x.ndim == 2 and n_axes == 1:
        x = x[..., None]
    if x.ndim != 3:
        raise ValueError(f"{name} must be [B, L, A] (A = {n_axes} features per depth), got shape {tuple(x.shape)}")
    if x.shape[-1] != n_axes:
        raise ValueError(f"{name} has F={x.shape[-1]} features per depth but the tables expect F={n_axes} "
                         f"({[a.name for a in table.axes]}); pass the features the tables were exported "
                         "with, in their order (tables.json: chains.<name>.axes)")
    return x


def chain_lookup(table: ChainTable, inputs, name: str = "inputs") -> torch.Tensor:
    """``table``'s P(accept | reached) for ``inputs`` ([B, L, A] or [B, L]; see the module docstring)
    -> float32 [B, L]; NaN (feature 0) stays NaN. Columns ``k >= D`` read row ``D - 1``.

    Inputs and a grid on the CPU are looked up in numpy (:func:`chain_lookup_host`, the same float32 operations,
    so the same values): a serving step looks up a few requests, where each torch call's fixed cost would be most
    of the time."""
    x = check_chain_inputs(as_float_tensor(inputs, name), table, name)
    if x.device.type == "cpu" and table.grid.device.type == "cpu" and not x.requires_grad and (
            table.read is None or table.read_host is not None):
        return torch.from_numpy(chain_lookup_host(table, x.to(torch.float32).numpy(), name, checked=True))
    interpolated = table.interpolated
    if interpolated:
        check_confidences(x[..., 0], name)
    device = x.device
    grid = table.grid.to(device=device, dtype=torch.float32)
    x = x.to(torch.float32)
    n_depth = grid.shape[0]
    rows = torch.arange(x.shape[1], device=device).clamp(max=n_depth - 1)  # deeper tokens reuse the last row
    no_token = torch.isnan(x[..., 0])
    cell = torch.zeros(x.shape[:2], dtype=torch.int64, device=device)
    if table.edges.shape[0]:
        edges = table.edges.to(device=device, dtype=torch.float32)
        strides = table.strides.to(device=device, dtype=torch.int64)
        binned = x[..., 1:] if interpolated else x
        # bucket = number of inner edges <= x; +inf padding never counts (not even for x = +inf,
        # which would index past the grid), NaN counts nothing.
        counted = (edges[None, None, :, :] <= binned[..., None]) & torch.isfinite(edges)
        cell = (counted.sum(-1) * strides).sum(-1)  # [B, L]
    cell = torch.where(no_token, torch.zeros_like(cell), cell)
    rows = rows[None, :].expand_as(cell)
    # a table whose values are read through a correction (calib.tables.online_tables.OnlineTables): the same values a
    # rewritten grid would hold, computed for the entries read only
    read = table.read if table.read is not None else (lambda r, c: grid[r, c])
    points = table.points
    if interpolated and points > 1:
        c = torch.where(no_token, torch.zeros_like(x[..., 0]), x[..., 0]).clamp(0.0, 1.0)
        pos = c * (points - 1)
        lo = torch.floor(pos).to(torch.int64).clamp(max=points - 2)
        frac = pos - lo.to(torch.float32)
        g_lo = read(rows, cell + lo)
        g_hi = read(rows, cell + lo + 1)
        p = g_lo + frac * (g_hi - g_lo)  # kept as two float32 ops: the kernel disables FMA to match
    else:
        p = read(rows, cell)
    return torch.where(no_token, torch.full_like(p, float("nan")), p)


def chain_lookup_host(table: ChainTable, x: np.ndarray, name: str = "inputs", checked: bool = False) -> np.ndarray:
    """:func:`chain_lookup` in numpy for a table on the CPU: float32 ``x [B, L, A]`` (or ``[B, L]`` with one axis)
    -> float32 ``[B, L]``, the same float32 operations in the same order, so the same values bit for bit.
    ``checked``: ``x`` is float32 and shaped for the table already (:func:`check_chain_inputs`)."""
    if not checked:
        x = check_chain_inputs(np.asarray(x, dtype=np.float32), table, name)  # numpy has what the checks read
    host = table.host_arrays()
    compiled = lookup_kernel()
    if compiled is not None and x.ndim == 3 and (table.read is None or table.read_arrays is not None):  # one call
        correction = table.read_arrays() if table.read_arrays is not None else None  # None: nothing learnt yet
        p, bad = compiled(np.ascontiguousarray(x), host["edges"], host["finite"], host["strides"],
                          table.interpolated, table.points, host["grid"],
                          correction is not None, *(correction or NO_CORRECTION))
        if not bad:  # else the numpy lookup below refuses the confidence by name
            return p
    first = x[..., 0]  # [B, L]
    no_token = np.isnan(first)
    interpolated = table.interpolated
    if interpolated:
        bad = ~no_token & ((first < 0) | (first > 1))
        if bad.any():
            check_confidences(torch.from_numpy(np.ascontiguousarray(first)), name)  # raises, naming the entry
    rows = np.minimum(np.arange(x.shape[1]), host["depths"] - 1)[None, :]  # [1, L]: deeper tokens reuse the last row
    if host["strides"].size:
        binned = x[..., 1:] if interpolated else x
        # bucket = number of inner edges <= x (the +inf padding is dropped: never counted, NaN counts nothing)
        counted = (host["edges"] <= binned[..., None]) & host["finite"]  # [B, L, A_b, E]
        cell = np.add.reduce(counted, axis=3, dtype=np.int64) @ host["strides"]  # [B, L]
        cell[no_token] = 0
    else:
        cell = np.zeros(x.shape[:2], dtype=np.int64)
    rows = np.broadcast_to(rows, cell.shape)
    read = table.read_host if table.read is not None else None
    grid = host["grid"]
    points = table.points
    if interpolated and points > 1:
        c = np.minimum(np.maximum(np.where(no_token, np.float32(0), first), np.float32(0)), np.float32(1))
        pos = c * np.float32(points - 1)
        lo = np.minimum(np.floor(pos).astype(np.int64), points - 2)
        frac = pos - lo.astype(np.float32)
        left = cell + lo
        if read is not None:  # both neighbours in one read: a read's cost is mostly per call
            g_lo, g_hi = read(np.stack([rows, rows]), np.stack([left, left + 1]))
        else:
            g_lo, g_hi = grid[rows, left], grid[rows, left + 1]
        p = g_lo + frac * (g_hi - g_lo)  # two float32 ops, as chain_lookup's (no FMA)
    else:
        p = read(rows, cell) if read is not None else grid[rows, cell]
    return np.where(no_token, np.float32(np.nan), p).astype(np.float32, copy=False)


@dataclass
class ChainTable:
    """One chain's exported table (see the module docstring)."""

    axes: tuple  # calib.chains.Axis per input feature, in input order
    grid: torch.Tensor  # float32 [D, C]
    edges: torch.Tensor  # float32 [A_b, E], +inf padded ([0, 1] without binned axes)
    strides: torch.Tensor  # int64 [A_b]
    # (depth rows, grid columns) int64 [B, L] each -> float32 [B, L]: the values a lookup reads, where they are
    # not the grid's own (an online correction's, calib.tables.online_tables.OnlineTables); None: the grid's
    read: Callable | None = field(default=None, repr=False, compare=False)
    # :attr:`read` in numpy ((rows, columns) int64 arrays -> float32 array) for :func:`chain_lookup_host`; a table
    # with a ``read`` but none is looked up in torch
    read_host: Callable | None = field(default=None, repr=False, compare=False)
    # what the compiled lookup (calib.tables.lookup_compiled) reads :attr:`read`'s values from: () -> the online
    # correction's arrays, or None while it has learnt nothing (the grid's values then); None: look up in numpy
    read_arrays: Callable | None = field(default=None, repr=False, compare=False)
    _host: dict | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.axes = tuple(self.axes)
        if not self.axes:
            raise ValueError("a chain table needs at least one axis")
        if any(a.interpolated for a in self.axes[1:]):
            raise ValueError("only axis 0 (the raw confidence) may be interpolated")
        n_binned = len(self.axes) - int(self.interpolated)
        if self.grid.ndim != 2 or min(self.grid.shape) < 1:
            raise ValueError(f"grid must be [D, C] with D, C >= 1, got {tuple(self.grid.shape)}")
        if self.edges.ndim != 2 or self.edges.shape[0] != n_binned or self.strides.shape != (n_binned,):
            raise ValueError(f"edges must be [A_b, E] and strides [A_b] with A_b = {n_binned} binned axes, got "
                             f"{tuple(self.edges.shape)} and {tuple(self.strides.shape)}")
        # +inf padding is never <= a feature, so an axis' top bucket is its number of finite edges.
        top = int((torch.isfinite(self.edges).sum(dim=1) * self.strides).sum()) if n_binned else 0
        largest = top + max(self.points, 1) - 1
        if largest >= self.grid.shape[1]:
            raise ValueError(f"grid has {self.grid.shape[1]} cells, the axes reach {largest}")

    def host_arrays(self) -> dict:
        """What :func:`chain_lookup_host` reads, as numpy views of a CPU table, built once: ``grid`` float32
        ``[D, C]`` (a view: an in-place rewrite shows), ``edges`` float32 ``[A_b, E]``, ``finite`` bool
        ``[A_b, E]``, ``strides`` int64 ``[A_b]``, ``depths``. Rebuilt when the grid tensor is replaced."""
        host = self._host
        if host is None or not all(a is b for a, b in zip(host["source"], (self.grid, self.edges, self.strides))):
            edges = self.edges.detach().to(torch.float32).cpu().numpy()
            host = {"source": (self.grid, self.edges, self.strides), "edges": edges, "finite": np.isfinite(edges),
                    "strides": self.strides.detach().to(torch.int64).cpu().numpy(), "depths": int(self.grid.shape[0]),
                    "grid": self.grid.detach().to(torch.float32).numpy()}
            if self.grid.dtype == torch.float32:  # a view, kept: an in-place rewrite of the grid shows in it
                self._host = host
        return host

    def host_view(self) -> dict | None:
        """:meth:`host_arrays` where the grid is on the CPU, else None: once built, a check that the tensors are the
        same objects, not a torch call (serving asks every step)."""
        host = self._host
        if host is not None:
            grid, edges, strides = host["source"]
            if grid is self.grid and edges is self.edges and strides is self.strides:
                return host
        return self.host_arrays() if self.grid.device.type == "cpu" else None

    @property
    def interpolated(self) -> bool:
        return self.axes[0].interpolated

    @property
    def points(self) -> int:
        """G, the interpolated axis' grid points (0 without one)."""
        return self.axes[0].points if self.interpolated else 0

    @property
    def depths(self) -> int:
        return int(self.grid.shape[0])

    def to(self, device) -> ChainTable:
        return ChainTable(self.axes, self.grid.to(device), self.edges.to(device), self.strides.to(device))

    @classmethod
    def build(cls, axes, grid, edges=None, strides=None) -> ChainTable:
        """From numpy arrays or tensors; ``edges``/``strides`` may be omitted without binned axes."""
        grid = torch.as_tensor(grid, dtype=torch.float32)
        if edges is None:
            edges, strides = torch.zeros((0, 1), dtype=torch.float32), torch.zeros(0, dtype=torch.int64)
        return cls(tuple(axes), grid, torch.as_tensor(edges, dtype=torch.float32),
                   torch.as_tensor(strides, dtype=torch.int64))

    def lookup(self, inputs, name: str = "inputs") -> torch.Tensor:
        return chain_lookup(self, inputs, name)


@dataclass
class GridTables:
    """In-memory :class:`AcceptanceTables`: one :class:`ChainTable` per chain name."""

    chains: dict  # chain name -> ChainTable
    reuse_last_row: bool = False  # True: depths >= D stand on row D - 1 at serve time too

    def __post_init__(self) -> None:
        self.chains = dict(self.chains)
        for name, t in self.chains.items():
            if not isinstance(t, ChainTable):
                raise TypeError(f"chains[{name!r}] must be a ChainTable, got {type(t).__name__}")

    def table(self, chain: str) -> ChainTable:
        try:
            return self.chains[chain]
        except KeyError:
            raise KeyError(f"these tables calibrate the chains {sorted(self.chains)}, not {chain!r}") from None

    def to(self, device: torch.device | str) -> GridTables:
        return GridTables({n: t.to(device) for n, t in self.chains.items()}, reuse_last_row=self.reuse_last_row)

    def accept_prob(self, chain: str, inputs) -> torch.Tensor:
        return self.table(chain).lookup(inputs, chain)
