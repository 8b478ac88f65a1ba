"""The tables as a prior, corrected online by what verification reveals.

A static table cannot follow the workload: prompts that accept less than the training prompts make
every prediction too high, whatever the drafter's confidence says. :class:`OnlineCorrection` keeps,
per (chain, depth, context cell), an offset on the table's logit, fitted online as a logistic
regression's intercept (the table's logit the fixed offset) by one Newton step per engine step. The
offset has two levels (partial pooling, as the tables' thin cells take the pooled fit): a **pooled**
offset ``δ₀`` per depth that every position of the chain teaches, and a **cell** offset ``δ_c`` that
learns what the pooled one leaves over in its context cell::

    p' = σ(logit p + δ₀ + δ_c)
    per level, over the step's verified positions it sees (the cell's after the pooled step):
    g = Σ (y − p'),  h = Σ p'(1 − p')
    H ← λ^n·H + h,   δ ← δ + g / (H + κ/4)

``H`` is the decayed Fisher information (``λ = decay`` per observed position of the level's key: a
memory of about ``1 / (1 − λ)`` positions) and ``κ = prior`` pseudo-positions of information at
``δ = 0`` hold a level at the table until it has evidence of its own. A shift the whole workload shares
(the prompts accept less than the training prompts) is learnt at the pooled level from every position,
so a thin cell follows it at once instead of waiting for ``κ`` positions of its own; a cell that
differs learns its own residual. With nothing seen both are 0 and ``p' = p``: a cold start is the tables
alone. ``pooled=False`` keeps the cells apart (the cell level only).

Only verified positions are observations: a round's accepted depths (``y = 1``) and its first
rejected depth (``y = 0``); positions after the first rejection were never judged by the target and
are skipped, never counted as rejections. The same object runs in serving
(:class:`calib.serve.decide.SafeDecider`) and in eval's replay of a bank's rounds in collection order
(:func:`replay_online`), so eval measures what is served. numpy only: it runs on the serving path.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

EPS = 1e-6


@dataclass(frozen=True)
class OnlineSettings:
    """``enabled``: off = the tables alone; ``decay``: λ per observed position of a key; ``prior``: κ,
    the pseudo-positions that hold a key at the table until it has seen that many of its own;
    ``pooled``: a per-depth offset shared by every cell under the cells' own (off: cells kept apart)."""

    enabled: bool = True
    decay: float = 0.999
    prior: float = 50.0
    pooled: bool = True

    def __post_init__(self):
        if not (0.0 < self.decay <= 1.0):
            raise ValueError(f"online.decay must be in (0, 1], got {self.decay!r}")
        if not (self.prior > 0.0 and math.isfinite(self.prior)):
            raise ValueError(f"online.prior must be a finite number > 0, got {self.prior!r}")


def verified_mask(acc: np.ndarray) -> np.ndarray:
    """``[R, K]`` bool: the positions verification judged: accepted ones and the first rejection of each
    round (``acc`` 1/0, NaN where not drafted); everything after the first rejection is unobserved
    (the positions a round *reached*, :func:`calib.labels.censored`)."""
    from calib.labels import censored

    return censored(np.asarray(acc, dtype=np.float64))[0]


class OnlineCorrection:
    """Per (depth, cell) logit offsets for one chain, learnt online (see the module docstring)."""

    def __init__(self, n_depths: int, settings: OnlineSettings | None = None):
        self.settings = settings or OnlineSettings()
        self.n_depths = int(n_depths)
        self._state: dict[int, np.ndarray] = {}  # cell -> float64 [3, n_depths]: δ, H, positions seen
        self._pooled = np.zeros((3, self.n_depths))  # the same for the level every cell shares

    def _cell(self, c: int) -> np.ndarray:
        s = self._state.get(c)
        if s is None:
            s = self._state[c] = np.zeros((3, self.n_depths))
        return s

    def offset(self, cells, width: int | None = None) -> np.ndarray:
        """Logit offsets ``[B, width]`` for rows in context ``cells [B]`` (the pooled offset where a cell saw
        nothing of its own; depths past the tracked ones take the deepest tracked depth's)."""
        cells = np.asarray(cells, dtype=np.int64).ravel()
        width = self.n_depths if width is None else int(width)
        out = np.zeros((cells.size, self.n_depths))
        if self.settings.enabled:
            uniq, where = np.unique(cells, return_inverse=True)
            zero = np.zeros(self.n_depths)
            own = np.stack([self._state[c][0] if c in self._state else zero for c in uniq.tolist()])  # [cells, D]
            out += self._pooled[0] + own[where.ravel()]
        return out[:, np.minimum(np.arange(width), self.n_depths - 1)]

    def apply(self, p, cells) -> np.ndarray:
        """Corrected probabilities ``[B, K]`` of table probabilities ``p [B, K]`` (NaN, 0 and 1 kept)."""
        p = np.asarray(p, dtype=np.float64)
        if not self.settings.enabled or p.size == 0 or not (self._state or self._pooled[2].any()):
            return p
        return _shifted(p, self.offset(cells, p.shape[1]))

    def update(self, q, acc, cells) -> int:
        """One Newton step per level on the verified positions of rounds decided with probabilities ``q [B, K]``
        (the corrected ones, as used: :meth:`apply` of the table's), outcomes ``acc [B, K]`` (1/0, NaN not
        drafted) in context ``cells [B]``: the pooled level first, then each cell on what is left; returns
        the positions used."""
        if not self.settings.enabled:
            return 0
        q, acc = np.asarray(q, dtype=np.float64), np.asarray(acc, dtype=np.float64)
        K = min(q.shape[1], self.n_depths)
        seen = (verified_mask(acc) & ~np.isnan(q))[:, :K]
        cells = np.asarray(cells, dtype=np.int64).ravel()
        q = np.clip(np.nan_to_num(q[:, :K], nan=0.5), EPS, 1 - EPS)
        y = np.nan_to_num(acc[:, :K])
        if self.settings.pooled and seen.any():
            step = self._newton(self._pooled, seen, y, q, K)
            q = np.clip(_shifted(q, step[None, :]), EPS, 1 - EPS)  # the cells learn what the pooled step left
        added = 0
        for c in np.unique(cells):
            rows = cells == c
            if seen[rows].any():
                added += int(seen[rows].sum())
                self._newton(self._cell(int(c)), seen[rows], y[rows], q[rows], K, ridge=self.settings.pooled)
        return added

    def _newton(self, s: np.ndarray, seen, y, q, K: int, ridge: bool = False) -> np.ndarray:
        """One Newton step of a level's state ``s`` [3, n_depths] (δ, H, n) on positions ``seen`` [B, K] with
        outcomes ``y`` and probabilities ``q`` [B, K]; returns the step [K]. ``ridge``: the prior stays while
        the evidence decays, so its pull towards 0 (``(1 − λ^n)·κ/4·δ``: the part of the balancing evidence
        that decayed) is part of the gradient; under the pooled level this moves what the cells share to
        the pooled offset instead of leaving it split between them."""
        cnt = seen.sum(axis=0)
        g = np.where(seen, y - q, 0.0).sum(axis=0)
        h = np.where(seen, q * (1 - q), 0.0).sum(axis=0)
        info0, fade = self.settings.prior / 4.0, self.settings.decay ** cnt
        if ridge:
            g = g - (1.0 - fade) * info0 * s[0, :K]
        s[1, :K] = fade * s[1, :K] + h
        step = g / (s[1, :K] + info0)
        s[0, :K] += step
        s[2, :K] += cnt
        return step

    def state(self) -> dict:
        """JSON-able per cell (and ``"pooled"``, the shared level): logit offset, decayed information and
        positions seen per depth."""
        def level(s):
            return {"offset": s[0].tolist(), "information": s[1].tolist(), "n": s[2].tolist()}

        cells = {int(c): level(s) for c, s in sorted(self._state.items())}
        return {**cells, "pooled": level(self._pooled)} if self.settings.pooled else cells


def _shifted(p: np.ndarray, offset: np.ndarray) -> np.ndarray:
    """``σ(logit p + offset)`` where ``p`` is a probability strictly inside (0, 1); NaN, 0 and 1 kept."""
    q = np.clip(p, EPS, 1 - EPS)
    out = 1.0 / (1.0 + np.exp(-(np.log(q) - np.log1p(-q) + offset)))
    return np.where(np.isnan(p) | (p <= 0) | (p >= 1), p, out)


def replay_online(p, acc, cells, settings: OnlineSettings | None = None, batch: int = 1) -> np.ndarray:
    """The probabilities serving would have used over rounds in order: each round (``batch`` rounds at a
    time, as one engine step) read with the correction learnt from the rounds before it, then added.
    ``p [R, K]`` table probabilities, ``acc [R, K]`` outcomes, ``cells [R]``; returns ``[R, K]``."""
    p = np.asarray(p, dtype=np.float64)
    out = np.empty_like(p)
    corr = OnlineCorrection(p.shape[1] if p.ndim == 2 and p.shape[1] else 1, settings)
    cells = np.asarray(cells, dtype=np.int64).ravel()
    for s in range(0, len(p), max(1, int(batch))):
        e = min(len(p), s + max(1, int(batch)))
        out[s:e] = corr.apply(p[s:e], cells[s:e])
        corr.update(out[s:e], acc[s:e], cells[s:e])
    return out


def outcome_row(accepted: int, drafted: int) -> np.ndarray:
    """``[drafted]`` outcomes of one verified round: 1 for the accepted prefix, 0 at the first rejection,
    NaN after it (never judged)."""
    acc = np.full(max(0, int(drafted)), np.nan)
    acc[: int(accepted)] = 1.0
    if accepted < drafted:
        acc[int(accepted)] = 0.0
    return acc


def context_of(table, name: str) -> tuple[list[str], list[list[float]]]:
    """The context axes of chain ``name``'s table (names in table order, their inner edges): what keys the
    online correction's cells."""
    from calib.chains import split_context

    _, ctx = split_context([a.name for a in table.axes], name)
    return ctx, [list(a.edges) for a in table.axes if a.name in ctx]


def context_cells(values, edges) -> np.ndarray:
    """The online correction's cell ``[B]`` of context values ``[B, A_ctx]``: the table's context cell (the
    lookup's buckets; 0 for a table without context axes)."""
    from calib.calibrators.context import context_cells as cells

    values = np.asarray(values, dtype=np.float64)
    if not edges:
        return np.zeros(values.shape[0] if values.ndim else 1, dtype=np.int64)
    return cells(values.reshape(-1, len(edges)), edges)


class OnlineTables:
    """The correction where serving reads: each chain's grid kept at ``σ(logit prior + δ[depth, cell])`` per
    context cell (the table's context axes, :data:`calib.chains.CONTEXT`; the whole grid is one cell for
    a table without them). Every lookup (the allocator's, the plan's, the Triton kernel's) then reads the
    corrected values; ``tables`` is modified in place, its original grids kept as the prior."""

    def __init__(self, tables, settings: OnlineSettings):
        import torch

        self.tables, self.settings = tables, settings
        self.chains: dict[str, dict] = {}
        for name, t in tables.chains.items():
            ctx, edges = context_of(t, name)
            n_cells = int(np.prod([len(e) + 1 for e in edges])) if edges else 1
            prior = t.grid.detach().clone()  # [D, n_cells * width]
            q = prior.double().clamp(EPS, 1 - EPS)
            self.chains[name] = {"table": t, "prior": prior, "context": ctx, "edges": edges, "n_cells": n_cells,
                                 "width": t.grid.shape[1] // n_cells,
                                 # [D, n_cells * width]; float32: torch's float64 sigmoid is ~10x slower on CPU
                                 "logit": (torch.log(q) - torch.log1p(-q)).float(),
                                 "keep": torch.isnan(prior) | (prior <= 0) | (prior >= 1),  # never shifted
                                 "correction": OnlineCorrection(t.grid.shape[0], settings)}
        self._dirty: set[tuple[str, int]] = set()
        self._whole: set[str] = set()  # chains whose pooled offset moved: every cell is rewritten

    def cells(self, name: str, context) -> np.ndarray:
        """Context cell ``[B]`` of chain ``name`` for context values ``[B, A_ctx]`` (its context axes' order)."""
        return context_cells(context, self.chains[name]["edges"])

    def observe(self, name: str, q, acc, cells) -> int:
        """:meth:`OnlineCorrection.update` of chain ``name``; the cells it moved are rewritten at :meth:`refresh`
        (all of them when the pooled offset moved)."""
        c = self.chains.get(name)
        if c is None:
            return 0
        n = c["correction"].update(q, acc, cells)
        if n and self.settings.pooled:
            self._whole.add(name)
        elif n:
            self._dirty.update((name, int(x)) for x in np.unique(np.asarray(cells, dtype=np.int64)))
        return n

    def refresh(self) -> None:
        """Rewrite the grid blocks the correction moved since the last call (one engine step's worth)."""
        import torch

        for name in sorted(self._whole):
            c = self.chains[name]
            D, n_cells = c["logit"].shape[0], c["n_cells"]
            delta = torch.from_numpy(c["correction"].offset(np.arange(n_cells), D).T.copy())  # [D, n_cells]
            self._write(c, 0, n_cells, delta)
        for name, cell in sorted(self._dirty):
            c = self.chains[name]
            if name not in self._whole:
                self._write(c, cell, cell + 1, torch.from_numpy(c["correction"].offset([cell], c["logit"].shape[0]).T))
        self._dirty.clear()
        self._whole.clear()

    @staticmethod
    def _write(c: dict, first: int, stop: int, delta) -> None:
        """The grid columns of cells ``first .. stop - 1`` at ``σ(logit prior + delta)`` (``delta`` [D, cells],
        one offset per depth and cell), the prior where kept."""
        import torch

        D, w = c["logit"].shape[0], c["width"]
        cols = slice(first * w, stop * w)
        logit, prior = c["logit"][:, cols].view(D, stop - first, w), c["prior"][:, cols]
        out = torch.sigmoid(logit + delta.to(logit.device, torch.float32)[:, :, None]).view(D, -1)
        c["table"].grid[:, cols] = torch.where(c["keep"][:, cols], prior, out.to(prior.dtype))

    def state(self) -> dict:
        return {name: c["correction"].state() for name, c in self.chains.items()}
