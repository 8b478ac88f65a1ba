"""The tables as a prior, corrected online by what verification reveals.

A static table cannot follow the workload: prompts that accept less than the training prompts make
every prediction too high, whatever the drafter's confidence says. :class:`OnlineCorrection` keeps,
per (chain, depth, context cell), an offset ``δ`` on the table's logit, fitted online as a logistic
regression's intercept (the table's logit the fixed offset) by one Newton step per engine step::

    p' = σ(logit p + δ)
    g = Σ (y − p'),  h = Σ p'(1 − p')          over the step's verified positions of the key
    H ← λ^n·H + h,   δ ← δ + g / (H + κ/4)

``H`` is the decayed Fisher information (``λ = decay`` per observed position: a memory of about
``1 / (1 − λ)`` positions per key) and ``κ = prior`` pseudo-positions of information at ``δ = 0``
hold a key at the table until it has evidence of its own. With nothing seen ``δ = 0`` and ``p' = p``:
a cold start is the tables alone.

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
    the pseudo-positions that hold a key at the table until it has seen that many of its own."""

    enabled: bool = True
    decay: float = 0.999
    prior: float = 50.0

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

    def _cell(self, c: int) -> np.ndarray:
        s = self._state.get(c)
        if s is None:
            s = self._state[c] = np.zeros((3, self.n_depths))
        return s

    def offset(self, cells, width: int | None = None) -> np.ndarray:
        """Logit offsets ``[B, width]`` for rows in context ``cells [B]`` (0 where nothing was seen; depths
        past the tracked ones take the deepest tracked depth's)."""
        cells = np.asarray(cells, dtype=np.int64).ravel()
        width = self.n_depths if width is None else int(width)
        out = np.zeros((cells.size, self.n_depths))
        if self.settings.enabled:
            for c in np.unique(cells):
                s = self._state.get(int(c))
                if s is not None:
                    out[cells == c] = s[0]
        return out[:, np.minimum(np.arange(width), self.n_depths - 1)]

    def apply(self, p, cells) -> np.ndarray:
        """Corrected probabilities ``[B, K]`` of table probabilities ``p [B, K]`` (NaN, 0 and 1 kept)."""
        p = np.asarray(p, dtype=np.float64)
        if not self.settings.enabled or p.size == 0 or not self._state:
            return p
        q = np.clip(p, EPS, 1 - EPS)
        out = 1.0 / (1.0 + np.exp(-(np.log(q) - np.log1p(-q) + self.offset(cells, p.shape[1]))))
        return np.where(np.isnan(p) | (p <= 0) | (p >= 1), p, out)

    def update(self, q, acc, cells) -> int:
        """One Newton step on the verified positions of rounds decided with probabilities ``q [B, K]`` (the
        corrected ones, as used: :meth:`apply` of the table's), outcomes ``acc [B, K]`` (1/0, NaN not
        drafted) in context ``cells [B]``; returns the positions used."""
        if not self.settings.enabled:
            return 0
        q, acc = np.asarray(q, dtype=np.float64), np.asarray(acc, dtype=np.float64)
        K = min(q.shape[1], self.n_depths)
        seen = (verified_mask(acc) & ~np.isnan(q))[:, :K]
        cells = np.asarray(cells, dtype=np.int64).ravel()
        q = np.clip(np.nan_to_num(q[:, :K], nan=0.5), EPS, 1 - EPS)
        lam, info0 = self.settings.decay, self.settings.prior / 4.0
        added = 0
        for c in np.unique(cells):
            rows = cells == c
            m = seen[rows]
            cnt = m.sum(axis=0)
            if not cnt.any():
                continue
            g = np.where(m, np.nan_to_num(acc[rows][:, :K]) - q[rows], 0.0).sum(axis=0)
            h = np.where(m, q[rows] * (1 - q[rows]), 0.0).sum(axis=0)
            s = self._cell(int(c))
            s[1, :K] = lam ** cnt * s[1, :K] + h
            s[0, :K] += g / (s[1, :K] + info0)
            s[2, :K] += cnt
            added += int(cnt.sum())
        return added

    def state(self) -> dict:
        """JSON-able per cell: logit offset, decayed information and positions seen per depth."""
        return {int(c): {"offset": s[0].tolist(), "information": s[1].tolist(), "n": s[2].tolist()}
                for c, s in sorted(self._state.items())}


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
        self.tables, self.settings = tables, settings
        self.chains: dict[str, dict] = {}
        for name, t in tables.chains.items():
            ctx, edges = context_of(t, name)
            n_cells = int(np.prod([len(e) + 1 for e in edges])) if edges else 1
            self.chains[name] = {"table": t, "prior": t.grid.detach().clone(), "context": ctx, "edges": edges,
                                 "width": t.grid.shape[1] // n_cells,
                                 "correction": OnlineCorrection(t.grid.shape[0], settings)}
        self._dirty: set[tuple[str, int]] = set()

    def cells(self, name: str, context) -> np.ndarray:
        """Context cell ``[B]`` of chain ``name`` for context values ``[B, A_ctx]`` (its context axes' order)."""
        return context_cells(context, self.chains[name]["edges"])

    def observe(self, name: str, q, acc, cells) -> int:
        """:meth:`OnlineCorrection.update` of chain ``name``; the touched cells are rewritten at :meth:`refresh`."""
        c = self.chains.get(name)
        if c is None:
            return 0
        n = c["correction"].update(q, acc, cells)
        if n:
            self._dirty.update((name, int(x)) for x in np.unique(np.asarray(cells, dtype=np.int64)))
        return n

    def refresh(self) -> None:
        """Rewrite the grid blocks of the cells learnt from since the last call (one engine step's worth)."""
        import torch

        for name, cell in sorted(self._dirty):
            c = self.chains[name]
            lo, hi = cell * c["width"], (cell + 1) * c["width"]
            prior = c["prior"][:, lo:hi].double()
            delta = torch.from_numpy(c["correction"].offset([cell], prior.shape[0])[0])[:, None]  # [D, 1]
            q = prior.clamp(EPS, 1 - EPS)
            out = torch.sigmoid(torch.log(q) - torch.log1p(-q) + delta)
            keep = torch.isnan(prior) | (prior <= 0) | (prior >= 1)
            c["table"].grid[:, lo:hi] = torch.where(keep, prior, out).to(c["table"].grid.dtype)
        self._dirty.clear()

    def state(self) -> dict:
        return {name: c["correction"].state() for name, c in self.chains.items()}
