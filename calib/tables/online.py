"""The tables as a prior, corrected online by what verification reveals.

A static table cannot follow the workload: prompts that accept less than the training prompts make
every prediction too high, whatever the drafter's confidence says. :class:`OnlineCorrection` keeps,
per (chain, depth, context cell), a correction of the table's logit ``z = logit p``, fitted online as a
logistic regression on ``z`` by one Newton step per observed round. It has two levels
(partial pooling, as the tables' thin cells take the pooled fit): a **pooled** level per depth that
every position of the chain teaches, an offset ``δ₀`` and a slope ``β`` on the table's logit (an online
Platt scaling of the table), and a **cell** offset ``δ_c`` that learns what the pooled level leaves
over in its context cell::

    p' = σ((1 + β)·z + δ₀ + δ_c)
    per level, over the verified positions it sees (the cell's after the pooled step), with x = 1 for
    an offset and x = (1, z) for the pooled level with its slope:
    g = Σ (y − p')·x,  h = Σ p'(1 − p')·x xᵀ
    H ← λ^n·H + h,   θ ← θ + (H + κ/4·I)⁻¹ g

``H`` is the decayed Fisher information (``λ = decay`` per observed position of the level's key: a
memory of about ``1 / (1 − λ)`` positions) and ``κ = prior`` pseudo-positions of information at
``δ = 0`` hold a level at the table until it has evidence of its own. A shift the whole workload shares
(the prompts accept less than the training prompts) is learnt at the pooled level from every position,
so a thin cell follows it at once instead of waiting for ``κ`` positions of its own; a cell that
differs learns its own residual. With nothing seen both are 0 and ``p' = p``: a cold start is the tables
alone. ``pooled=False`` keeps the cells apart (the cell level only, no slope); ``slope=False`` keeps
the pooled level an offset.

Why a slope: an offset moves every probability of a depth alike, so it matches each depth's mean, but
a table that is too sure of itself on a workload (its high probabilities too high and its low ones too
low, as the n-gram chain's are on chat at T = 0.8) keeps its spread; a round's expected accepted
length, a sum of products of its depths' probabilities, is then too long although every depth's mean
is right. The slope learns the spread, from the same positions.

Only verified positions are observations: a round's accepted depths (``y = 1``) and its first
rejected depth (``y = 0``); positions after the first rejection were never judged by the target and
are skipped, never counted as rejections. The same object runs in serving
(:class:`calib.serve.decide.SafeDecider`) and in eval's replay of a bank's rounds in collection order
(:func:`replay_online`), so eval measures what is served. numpy, and the per-step work compiled with numba where
it is installed (:mod:`calib.tables.online_compiled`): it runs on the serving path.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import ClassVar

import numpy as np

from calib.params import Boolean, Interval, Satisfies, validate_params
from calib.tables.online_kernels import (
    EPS,
    FMAX,
    MIN_SCALE,
    colsum,
    corrected,
    logit,
    moved,
    sigmoid,
    verified,
)


@dataclass(frozen=True)
class OnlineSettings:
    """``enabled``: off = the tables alone; ``decay``: λ per observed position of a key; ``prior``: κ,
    the pseudo-positions that hold a key at the table until it has seen that many of its own;
    ``pooled``: a per-depth offset shared by every cell under the cells' own (off: cells kept apart);
    ``slope``: the pooled level also learns a slope on the table's logit (only with ``pooled``).

    The one schema of the correction's settings: serving (``serve.online``, :class:`calib.serve.knobs.ServeKnobs`)
    and eval's replay (``online``) both compose conf/online/default.yaml and read it with :meth:`from_config`;
    the config checks reuse :attr:`_parameter_constraints`."""

    enabled: bool = True
    decay: float = 0.99
    prior: float = 50.0
    pooled: bool = True
    slope: bool = True

    _parameter_constraints: ClassVar[dict] = {
        "enabled": [Boolean()],
        "decay": [Interval(numbers.Real, 0, 1, closed="right")],
        "prior": [Interval(numbers.Real, 0, None, closed="neither")],
        "pooled": [Boolean()],
        "slope": [Boolean()],
    }

    def __post_init__(self):
        validate_params("online", asdict(self), self._parameter_constraints)
        object.__setattr__(self, "decay", float(self.decay))  # an integer from a config (decay=1) is the float
        object.__setattr__(self, "prior", float(self.prior))

    @classmethod
    def from_config(cls, node, key: str = "online", owner: str = "OnlineSettings") -> OnlineSettings:
        """The settings of a config node (a mapping: a dict, an OmegaConf node, the JSON of ``CALIB_SERVE``);
        a key it leaves out keeps its default. A node that is no mapping, an unknown key or a bad value is
        refused naming ``key`` (the node's dotted path, e.g. ``serve.online``) and the value."""
        if isinstance(node, cls):
            return node
        names = [f.name for f in fields(cls)]
        validate_params(owner, {key: node}, {key: [Satisfies(
            f"a mapping of the online correction's settings {', '.join(names)} (conf/online/default.yaml; e.g. "
            f"{key}.enabled=false)", lambda v: isinstance(v, Mapping))]})
        unknown = sorted(str(k) for k in node if k not in names)
        if unknown:
            raise ValueError(f"{owner}: {', '.join(f'{key}.{k}' for k in unknown)} is not a setting of the online "
                             f"correction; its settings are {', '.join(f'{key}.{n}' for n in names)} "
                             "(conf/online/default.yaml)")
        values = {n: node[n] for n in names if n in node}
        validate_params(owner, {f"{key}.{n}": v for n, v in values.items()},
                        {f"{key}.{n}": c for n, c in cls._parameter_constraints.items()}, missing_ok=True)
        return cls(**values)

    def to_config(self) -> dict:
        """The config node of these settings (what :meth:`from_config` reads back)."""
        return asdict(self)


def verified_mask(acc: np.ndarray) -> np.ndarray:
    """``[R, K]`` bool: the positions verification judged: accepted ones and the first rejection of each
    round (``acc`` 1/0, NaN where not drafted); everything after the first rejection is unobserved
    (the positions a round *reached*, :func:`calib.labels.censored`)."""
    from calib.labels import censored

    return censored(np.asarray(acc, dtype=np.float64))[0]


class OnlineCorrection:
    """Per (depth, cell) logit offsets, and a per-depth slope, for one chain, learnt online (see the module
    docstring). :meth:`apply` reads table probabilities through it; :meth:`update` learns from the outcomes
    of rounds decided with table probabilities ``p`` (what :meth:`apply` turned into what was used)."""

    def __init__(self, n_depths: int, settings: OnlineSettings | None = None, compiled: bool | None = None):
        self.settings = settings or OnlineSettings()
        self.n_depths = int(n_depths)
        # every cell's state, float64 [3, cells + 1, n_depths]: δ_c, H, positions seen; the last cell stands for
        # every id past them and stays 0 (a read of a cell no update saw is the pooled level alone)
        self._cells = np.zeros((3, 1, self.n_depths))
        self._pooled = np.zeros((3, self.n_depths))  # the same for the level every cell shares
        # the pooled level's slope: float64 [3, n_depths]: β, its information, the (δ₀, β) cross information
        self._slope = np.zeros((3, self.n_depths))
        self._sloped = self.settings.pooled and self.settings.slope
        self._learnt = False  # whether an update has seen a position: before it, the tables alone
        # what a read needs, kept between updates (a step reads many times and learns once): caches of δ₀ + δ_c
        # and of 1 + β, rebuilt after an update
        self._offsets: np.ndarray | None = None  # [cells + 1, n_depths]
        self._factor: np.ndarray | None = None  # [n_depths]
        self._columns: dict[int, np.ndarray] = {}  # width -> its columns' tracked depths
        # the update, table_of and the context cut each in one compiled call (calib.tables.online_compiled) where
        # numba is installed; compiled=False: the numpy versions (True: refuse to run without numba)
        self._kernels = None
        if compiled is not False:
            from calib.tables.online_compiled import kernels

            self._kernels = kernels()
            if compiled and self._kernels is None:
                raise RuntimeError("online correction: compiled=True needs numba (pip install numba)")

    @property
    def _own(self) -> np.ndarray:
        """``[cells + 1, n_depths]``: each cell's ``δ_c`` by cell id (0 in the last row: every id past them)."""
        return self._cells[0]

    def _cell(self, c: int) -> np.ndarray:
        """Cell ``c``'s state ``[3, n_depths]`` (a view; the cells grown to hold it)."""
        self._grow(c)
        return self._cells[:, c, :]

    def _grow(self, largest: int) -> None:
        """Room for cell ids up to ``largest`` (refusing a negative one)."""
        if largest < 0:
            raise ValueError(f"online correction: context cell {largest} is negative; cells are context cell indices")
        held = self._cells.shape[1] - 1
        if largest >= held:
            cells = np.zeros((3, max(largest + 1, 2 * held) + 1, self.n_depths))
            cells[:, :held] = self._cells[:, :held]
            self._cells, self._offsets = cells, None

    def _cols(self, width: int | None) -> np.ndarray:
        """Tracked depth of each of ``width`` columns (depths past the tracked ones take the deepest's)."""
        width = self.n_depths if width is None else int(width)
        cols = self._columns.get(width)
        if cols is None:
            cols = self._columns[width] = np.minimum(np.arange(width), self.n_depths - 1)
        return cols

    def _offset_table(self) -> np.ndarray:
        """``[cells + 1, n_depths]``: ``δ₀ + δ_c`` by cell id (``δ₀`` alone in the last row)."""
        if self._offsets is None:
            self._offsets = self._pooled[0] + self._own
        return self._offsets

    def _rows_of(self, cells: np.ndarray) -> np.ndarray:
        """Rows of :meth:`_offset_table` for int64 cell ids (any shape): an id no update saw (past the table,
        or negative: read as unsigned) takes the last row."""
        return np.minimum(cells.view(np.uint64), len(self._own) - 1)

    def _scale_all(self) -> np.ndarray:
        """``[n_depths]``: ``1 + β``."""
        if self._factor is None:
            self._factor = 1.0 + self._slope[0]
        return self._factor

    def offset(self, cells, width: int | None = None) -> np.ndarray:
        """Logit offsets ``[B, width]`` for rows in context ``cells [B]`` (the pooled offset where a cell saw
        nothing of its own; depths past the tracked ones take the deepest tracked depth's)."""
        cells = np.asarray(cells, dtype=np.int64).ravel()
        if not self.settings.enabled:
            return np.zeros((cells.size, self.n_depths))[:, self._cols(width)]
        out = self._offset_table()[self._rows_of(cells)]  # [B, n_depths]
        return out if width is None or width == self.n_depths else out[:, self._cols(width)]

    def scale(self, width: int | None = None) -> np.ndarray:
        """``[width]``: the factor ``1 + β`` on the table's logit per depth (1 without the slope)."""
        return self._scale_all().copy() if width is None or width == self.n_depths else self._scale_all()[self._cols(width)]

    def apply(self, p, cells) -> np.ndarray:
        """Corrected probabilities ``[B, K]`` of table probabilities ``p [B, K]`` (NaN, 0 and 1 kept)."""
        p = np.asarray(p, dtype=np.float64)
        if not self.settings.enabled or p.size == 0 or not self._learnt:
            return p
        return corrected(p, self.scale(p.shape[1]), self.offset(cells, p.shape[1]))

    def table_of(self, q, cells) -> np.ndarray:
        """The inverse of :meth:`apply`: the table probabilities ``[B, K]`` that read as ``q [B, K]`` in
        ``cells [B]`` now (serving keeps what it used, the corrected value; :meth:`update` takes the table's)."""
        q = np.asarray(q, dtype=np.float64)
        if not self.settings.enabled or q.size == 0 or not self._learnt:
            return q
        if self._kernels is not None and q.ndim == 2:  # one compiled call
            cells = np.asarray(cells, dtype=np.int64).ravel()
            if cells.size == q.shape[0]:
                return self._kernels["table_of_loops"](np.ascontiguousarray(q), cells, self._offset_table(),
                                                       self._scale_all())
        z = (logit(q) - self.offset(cells, q.shape[1])) / self.scale(q.shape[1])
        return np.where(moved(q), sigmoid(z), q)

    def update(self, p, acc, cells) -> int:
        """One Newton step per level on the verified positions of rounds decided with table probabilities
        ``p [B, K]`` (read through this correction as it stands: :meth:`apply`), outcomes ``acc [B, K]`` (1/0,
        NaN not drafted) in context ``cells [B]`` (context cell ids, ≥ 0): the pooled level first, then each
        cell on what is left; returns the positions used. Positions the correction never moves (NaN, 0 or 1)
        teach nothing."""
        if not self.settings.enabled:
            return 0
        p, acc = np.asarray(p, dtype=np.float64), np.asarray(acc, dtype=np.float64)
        K = min(p.shape[1], self.n_depths)
        p, acc = p[:, :K], acc[:, :K]
        cells = np.asarray(cells, dtype=np.int64).ravel()
        if self._kernels is not None and acc.shape == p.shape and cells.size == len(p):  # one compiled call, in loops
            return self._learn_compiled("update_loops", (np.ascontiguousarray(p), np.ascontiguousarray(acc), cells),
                                        lambda: cells)
        if cells.size:
            self._grow(int(cells.min()))  # a negative cell is refused, naming it, before anything is learnt
            self._grow(int(cells.max()))
        seen = verified(acc) & moved(p)  # [B, K]: verified_mask(acc) & ~kept(p)
        if not seen.any():
            return 0
        z = logit(np.where(np.isnan(p), 0.5, p))  # [B, K]; ±inf clip as np.nan_to_num's ±max would
        y = np.minimum(np.maximum(acc, -FMAX), FMAX)  # [B, K]: np.nan_to_num where seen (NaN only where not)
        if self.settings.pooled:
            self._newton(self._pooled, seen, y, z * self.scale(K) + self.offset(cells, K), K,
                         slope=z if self._sloped else None)
            self._factor = None  # the slope moved
        base = z * self.scale(K) + self._pooled[0, :K]  # the cells learn what the pooled step left
        if cells.size == len(seen) and (cells == cells[0]).all():
            groups = [(int(cells[0]), slice(None))]  # a step's rounds mostly share one cell: no row copies
        else:
            groups = [(c, cells == c) for c in sorted(set(cells.tolist()))]  # np.unique's order, without its cost
        added = 0
        for c, rows in groups:
            n = int(np.count_nonzero(seen[rows]))
            if n:
                added += n
                s = self._cell(c)  # a view: δ_c is its row of _own
                self._newton(s, seen[rows], y[rows], base[rows] + s[0, :K], K, ridge=self.settings.pooled)
        self._offsets, self._learnt = None, True
        return added

    def update_rounds(self, table: np.ndarray, rows: np.ndarray, accepted: np.ndarray, depth: np.ndarray,
                      cells: np.ndarray) -> int:
        """:meth:`update` on rounds ``rows`` (int64 ``[R]``) of one step as serving remembers them: table
        probabilities ``table[rows]`` (float64 ``[N, W]``, NaN past each round's depth), ``depth[rows]`` drafted,
        ``accepted [R]`` of them accepted, context ``cells[rows]`` (int64 ``[N]``). One compiled call where numba is
        installed (the outcomes built in its loops), else :func:`outcome_rows` and :meth:`update`."""
        if not self.settings.enabled:
            return 0
        if self._kernels is not None:
            return self._learn_compiled("update_rounds_loops", (table, rows, accepted, depth, cells),
                                        lambda: cells[rows])
        drafted = depth[rows]
        width = int(drafted.max())
        return self.update(table[rows, :width], outcome_rows(accepted, drafted, width), cells[rows])

    def _learn_compiled(self, entry: str, data: tuple, taught) -> int:
        """One compiled update (``entry`` of :mod:`calib.tables.online_compiled`) on ``data`` and the correction's
        settings and state; where a cell is past those held (the entry returns -1, having changed nothing), the
        cells ``taught()`` are grown to (a negative one refused) and the update made again. Returns the positions
        used."""
        update = self._kernels[entry]
        args = (*data, self.settings.pooled, self._sloped, self.settings.decay, self.settings.prior, self._pooled,
                self._slope)
        added = int(update(*args, self._cells))
        if added < 0:  # a cell past those held: grown (a negative one refused), then learnt
            cells = taught()
            self._grow(int(cells.min()))
            self._grow(int(cells.max()))
            added = int(update(*args, self._cells))
        if added:
            self._factor, self._offsets, self._learnt = None, None, True
        return added

    def _newton(self, s: np.ndarray, seen, y, u, K: int, ridge: bool = False, slope=None) -> None:
        """One Newton step of a level's state ``s`` [3, n_depths] (δ, H, n) on positions ``seen`` [B, K] with
        outcomes ``y`` and corrected logits ``u`` [B, K]; with ``slope`` (the table's logits [B, K]) the
        pooled slope ``β`` steps jointly with ``δ`` (a 2 × 2 Newton step per depth). ``ridge``: the prior stays
        while the evidence decays, so its pull towards 0 (``(1 − λ^n)·κ/4·δ``: the part of the balancing
        evidence that decayed) is part of the gradient; under the pooled level this moves what the cells
        share to the pooled offset instead of leaving it split between them."""
        q = np.minimum(np.maximum(sigmoid(u), EPS), 1 - EPS)  # np.clip's values, without its wrapper
        cnt = colsum(seen, axis=0, dtype=np.int64)  # [K] (seen.sum(axis=0))
        r, w = np.where(seen, y - q, 0.0), np.where(seen, q * (1 - q), 0.0)
        g, h = colsum(r), colsum(w)  # [K]
        info0, fade = self.settings.prior / 4.0, self.settings.decay ** cnt
        if ridge:
            g = g - (1.0 - fade) * info0 * s[0, :K]
        s[1, :K] = fade * s[1, :K] + h
        s[2, :K] += cnt
        if slope is None:
            s[0, :K] += g / (s[1, :K] + info0)
            return
        b = self._slope  # β, its information, the cross information
        b[1, :K] = fade * b[1, :K] + colsum(w * slope * slope)
        b[2, :K] = fade * b[2, :K] + colsum(w * slope)
        g_b = colsum(r * slope)
        h_aa, h_bb, h_ab = s[1, :K] + info0, b[1, :K] + info0, b[2, :K]
        det = h_aa * h_bb - h_ab * h_ab  # > 0: the information is positive semi-definite, the prior adds κ/4·I
        s[0, :K] += (h_bb * g - h_ab * g_b) / det
        b[0, :K] = np.maximum(b[0, :K] + (h_aa * g_b - h_ab * g) / det, MIN_SCALE - 1.0)

    def state(self) -> dict:
        """JSON-able per cell (and ``"pooled"``, the shared level, with its ``"slope"`` β): logit offset,
        decayed information and positions seen per depth."""
        def level(s):
            return {"offset": s[0].tolist(), "information": s[1].tolist(), "n": s[2].tolist()}

        held = self._cells.shape[1] - 1
        cells = {c: level(self._cells[:, c, :]) for c in range(held) if self._cells[2, c].any()}  # cells a round taught
        if not self.settings.pooled:
            return cells
        pooled = level(self._pooled)
        return {**cells, "pooled": {**pooled, "slope": self._slope[0].tolist()} if self._sloped else pooled}


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
        corr.update(p[s:e], acc[s:e], cells[s:e])
    return out


def outcome_row(accepted: int, drafted: int) -> np.ndarray:
    """``[drafted]`` outcomes of one verified round: 1 for the accepted prefix, 0 at the first rejection,
    NaN after it (never judged)."""
    acc = np.full(max(0, int(drafted)), np.nan)
    acc[: int(accepted)] = 1.0
    if accepted < drafted:
        acc[int(accepted)] = 0.0
    return acc


def outcome_rows(accepted, drafted, width: int) -> np.ndarray:
    """``[R, width]`` outcomes of ``R`` verified rounds (:func:`outcome_row` of each, NaN past its draft)."""
    accepted, drafted = np.asarray(accepted)[:, None], np.asarray(drafted)[:, None]
    col = np.arange(int(width))[None, :]
    return np.where(col < accepted, 1.0, np.where((col == accepted) & (col < drafted), 0.0, np.nan))


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
