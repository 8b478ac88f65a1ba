"""The online correction where serving reads (:class:`OnlineTables`): each chain's table read through its
:class:`calib.tables.online.OnlineCorrection`, entry by entry for a lookup and block by block for a grid a kernel
reads whole."""

from __future__ import annotations

import numpy as np

from calib.tables.online import OnlineCorrection, OnlineSettings, context_cells, context_of
from calib.tables.online_kernels import cut, edge_grid, kept, logit, sigmoid


def _host_values(c: dict, rows, cols, scale, delta) -> np.ndarray:
    """float64 corrected values of an :class:`OnlineTables` chain ``c`` at grid entries ``(rows, cols)`` (index
    arrays that broadcast): ``σ(scale·logit prior + delta)``, the prior where kept (:func:`corrected` on the
    chain's precomputed host logits). What a lookup reads and what a rewrite writes: one formula."""
    out = sigmoid(c["host_logit"][rows, cols] * scale + delta)
    return np.where(c["host_keep"][rows, cols], c["host_prior"][rows, cols], out)


class OnlineTables:
    """The correction where serving reads: each chain's grid kept at ``σ((1 + β[depth])·logit prior +
    δ[depth, cell])`` per context cell (the table's context axes, :data:`calib.chains.CONTEXT`; the whole grid is one cell for
    a table without them). Every lookup (the allocator's, the plan's, the Triton kernel's) then reads the
    corrected values: a lookup reads them through :meth:`read` (the step's few entries, computed as the grid
    would hold them), and the grid itself is rewritten where the correction moved by ``refresh(lazy=False)``
    (for the kernel, which reads the grid without a lookup); ``tables`` is modified in place, its original
    grids kept as the prior."""

    def __init__(self, tables, settings: OnlineSettings):
        import torch

        self.tables, self.settings = tables, settings
        self.chains: dict[str, dict] = {}
        for name, t in tables.chains.items():
            ctx, edges = context_of(t, name)
            n_cells = int(np.prod([len(e) + 1 for e in edges])) if edges else 1
            prior = t.grid.detach().clone()  # [D, n_cells * width]
            host = prior.double().cpu().numpy()
            self.chains[name] = {"table": t, "prior": prior, "context": ctx, "edges": edges, "n_cells": n_cells,
                                 "width": t.grid.shape[1] // n_cells,
                                 # [D, n_cells * width]; float32: torch's float64 sigmoid is ~10x slower on CPU
                                 "logit": torch.from_numpy(logit(host)).float().to(prior.device),
                                 "keep": torch.from_numpy(kept(host)).to(prior.device),  # never corrected
                                 "correction": OnlineCorrection(t.grid.shape[0], settings),
                                 "stale": np.zeros(n_cells, dtype=bool)}  # [n_cells]: to rewrite when read
            # the same on the host, in the grid's dtype: a CPU grid is rewritten in numpy (OnlineTables._write)
            self.chains[name].update(host_logit=logit(host).astype(np.float32), host_keep=kept(host),
                                     host_prior=host.astype(np.float32))
            grid, strides = edge_grid(edges)  # [A_ctx, E], [A_ctx]: context_cells' cut, precomputed
            self.chains[name].update(edge_grid=grid, strides=strides)
            t.read = lambda rows, cols, name=name: self.read(name, rows, cols)
            t.read_host = lambda rows, cols, name=name: self.read_host(name, rows, cols)
            t.read_arrays = lambda name=name: self.read_arrays(name)
        self._dirty: set[tuple[str, int]] = set()
        self._whole: set[str] = set()  # chains whose pooled level moved: every cell is rewritten

    def cells(self, name: str, context) -> np.ndarray:
        """Context cell ``[B]`` of chain ``name`` for context values ``[B, A_ctx]`` (its context axes' order):
        :func:`context_cells`, cut in one comparison with the chain's precomputed edges."""
        c = self.chains[name]
        if not c["edges"]:
            return context_cells(context, [])
        values = np.asarray(context, dtype=np.float64).reshape(-1, len(c["edges"]))  # [B, A_ctx]
        kernels = c["correction"]._kernels
        if kernels is not None:  # one compiled call
            return kernels["cut_loops"](np.ascontiguousarray(values), c["edge_grid"], c["strides"])
        return cut(values, c["edge_grid"], c["strides"])

    def remembered(self, name: str, values: np.ndarray, rows: np.ndarray, probs: np.ndarray,
                   depth: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(cells int64 [R], table float64 [R, W])`` of a step's ``rows`` on chain ``name``: :meth:`cells` of
        their context ``values[rows]`` and :meth:`table_of` of the float32 ``probs[rows]`` served there, NaN from
        each row's ``depth[rows]`` on; one compiled call where numba is installed."""
        c = self.chains[name]
        corr = c["correction"]
        if corr._kernels is not None and probs.ndim == 2 and values.ndim == 2 and values.shape[1] == len(c["edges"]):
            moved = corr.settings.enabled and corr._learnt
            return corr._kernels["remembered_loops"](values, rows, probs, depth, c["edge_grid"], c["strides"], moved,
                                                     corr._offset_table(), corr._scale_all())
        cells = self.cells(name, values[rows])
        table = self.table_of(name, probs[rows].astype(np.float64), cells)
        table[np.arange(table.shape[1])[None, :] >= depth[rows][:, None]] = np.nan  # a round ends at its depth
        return cells, table

    def table_of(self, name: str, q, cells) -> np.ndarray:
        """The table probabilities ``[B, K]`` behind probabilities ``q [B, K]`` chain ``name`` served in ``cells``
        since the last :meth:`refresh` (:meth:`OnlineCorrection.table_of`): what :meth:`observe` takes."""
        return self.chains[name]["correction"].table_of(q, cells)

    def observe(self, name: str, p, acc, cells) -> int:
        """:meth:`OnlineCorrection.update` of chain ``name`` on table probabilities ``p`` (:meth:`table_of` of
        what was served); the cells it moved are rewritten at :meth:`refresh` (all of them when the pooled
        level moved)."""
        c = self.chains.get(name)
        if c is None:
            return 0
        n = c["correction"].update(p, acc, cells)
        if n and self.settings.pooled:
            self._whole.add(name)
        elif n:
            self._dirty.update((name, int(x)) for x in np.unique(np.asarray(cells, dtype=np.int64)))
        return n

    def observe_rounds(self, name: str, table, rows, accepted, depth, cells) -> int:
        """:meth:`observe` of rounds ``rows`` of one step as serving remembers them
        (:meth:`OnlineCorrection.update_rounds`: table probabilities ``table[rows]``, ``depth[rows]`` drafted,
        ``accepted`` of them accepted, context ``cells[rows]``)."""
        c = self.chains.get(name)
        if c is None:
            return 0
        n = c["correction"].update_rounds(table, rows, accepted, depth, cells)
        if n and self.settings.pooled:
            self._whole.add(name)
        elif n:
            self._dirty.update((name, int(x)) for x in np.unique(cells[rows]))
        return n

    def refresh(self, lazy: bool = True) -> None:
        """Mark the grid blocks the correction moved since the last call (one engine step's worth) as stale.
        Lookups read corrected values through :meth:`read` whatever the grid holds; ``lazy=False`` also rewrites
        the stale blocks now, for a reader of the grid itself (the Triton kernel's copy on a device)."""
        for name in self._whole:
            self.chains[name]["stale"][:] = True
        for name, cell in self._dirty:  # cells kept apart (observe fills one set or the other)
            self.chains[name]["stale"][cell] = True
        self._dirty.clear()
        self._whole.clear()
        if not lazy:
            for name in self.chains:
                self.materialize(name)

    def materialize(self, name: str) -> None:
        """Rewrite chain ``name``'s stale context cells in its grid at ``σ(scale·logit prior + δ)``."""
        c = self.chains[name]
        cells = np.flatnonzero(c["stale"])
        if cells.size:
            c["stale"][cells] = False
            self._write(c, cells)

    def read(self, name: str, rows, cols):
        """float32 ``[B, L]``: chain ``name``'s corrected values at grid entries ``(rows, cols)`` (int64 tensors
        ``[B, L]``), what :meth:`materialize` writes there (to float32 rounding: the same float64 formula); a
        lookup reads these (a step's few entries), not a rewritten grid."""
        import torch

        c = self.chains[name]
        if not c["correction"]._learnt:
            return c["prior"][rows, cols]
        value = self.read_host(name, rows.cpu().numpy(), cols.cpu().numpy())
        return torch.from_numpy(value).to(c["prior"].device)

    def read_host(self, name: str, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
        """:meth:`read` on int64 numpy index arrays ``[B, L]`` (depth rows, grid columns), in numpy."""
        c = self.chains[name]
        corr = c["correction"]
        if not corr._learnt:
            return c["host_prior"][rows, cols]
        delta = corr._offset_table()[corr._rows_of(cols // c["width"]), rows]  # [B, L]: corr.offset's, entry by entry
        return _host_values(c, rows, cols, corr._scale_all()[rows], delta).astype(np.float32)

    def read_arrays(self, name: str) -> tuple | None:
        """What the compiled lookup (:mod:`calib.tables.lookup_compiled`) reads :meth:`read_host`'s values from:
        chain ``name``'s host logits, kept entries and prior ``[D, C]``, the correction's offsets by cell
        ``[cells + 1, D]`` and scale ``[D]``, and the grid columns per context cell; None while the correction has
        learnt nothing (the prior is read then)."""
        c = self.chains[name]
        corr = c["correction"]
        if not corr._learnt:
            return None
        return (c["host_logit"], c["host_keep"], c["host_prior"], corr._offset_table(), corr._scale_all(),
                c["width"])

    def _write(self, c: dict, cells: np.ndarray) -> None:
        """The grid columns of context ``cells`` at ``σ(scale·logit prior + δ)`` (one offset per depth and cell,
        the pooled slope per depth), the prior where kept; in numpy on a host grid (a step rewrites a few
        cells: torch's per-call cost would dominate), in torch on a device's."""
        corr = c["correction"]
        D, w = c["logit"].shape[0], c["width"]
        cols = (cells[:, None] * w + np.arange(w)[None, :]).ravel()  # [cells * w]
        delta = np.repeat(corr.offset(cells, D).T, w, axis=1)  # [D, cells * w]
        scale = corr.scale(D)[:, None]  # [D, 1]
        grid = c["table"].grid
        if grid.device.type == "cpu" and grid.dtype == c["host_logit"].dtype:
            grid.numpy()[:, cols] = _host_values(c, np.arange(D)[:, None], cols[None, :], scale, delta)
            return
        import torch

        idx = torch.from_numpy(cols).to(grid.device)
        logit, prior = c["logit"][:, idx], c["prior"][:, idx]
        out = torch.sigmoid(logit * torch.from_numpy(scale).to(logit) + torch.from_numpy(delta).to(logit))
        grid[:, idx] = torch.where(c["keep"][:, idx], prior, out.to(prior.dtype))

    def state(self) -> dict:
        return {name: c["correction"].state() for name, c in self.chains.items()}

    def reset(self) -> None:
        """The tables alone again: every chain's grid back to its prior, its correction unlearnt (a bench's cells
        each start from the same state)."""
        for c in self.chains.values():
            c["table"].grid.copy_(c["prior"])
            c["correction"] = OnlineCorrection(c["correction"].n_depths, self.settings)  # as __init__ makes it
            c["stale"][:] = False
        self._dirty.clear()
        self._whole.clear()
