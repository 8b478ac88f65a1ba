"""The online correction's faster per-step path (calib/tables/online_kernels.py, the read caches of
calib/tables/online.py; its numpy update, ``compiled=False``) against the computation it replaced, bit for bit: the correction drives serving
decisions, so a faster step must decide the same. SYNTHETIC data throughout: seeded random probabilities,
outcomes, cells and context values, with the awkward values (NaN, 0, 1, ±inf) mixed in."""

import numpy as np
import pytest

from calib.calibrators.context import context_cells
from calib.tables.online import OnlineCorrection, OnlineSettings, verified_mask
from calib.tables.online_kernels import EPS, cut, edge_grid, kept, logit, moved, verified


def _same(a, b) -> bool:
    """Bit-identical float arrays (NaN where NaN, the sign of a zero included)."""
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


def _probs(rng, shape):
    """SYNTHETIC table probabilities with NaN (no token), 0 and 1 (certainties) and ±inf mixed in."""
    p = rng.uniform(size=shape)
    odd = rng.uniform(size=shape)
    p[odd < 0.1] = np.nan
    p[(odd >= 0.1) & (odd < 0.13)] = 0.0
    p[(odd >= 0.13) & (odd < 0.16)] = 1.0
    p[(odd >= 0.16) & (odd < 0.17)] = np.inf
    p[(odd >= 0.17) & (odd < 0.18)] = -np.inf
    return p


def _outcomes(rng, shape):
    """SYNTHETIC outcomes: 1/0, NaN where not drafted, and a few 0.5 (no round gives it: read as a rejection)."""
    acc = (rng.uniform(size=shape) < 0.6).astype(np.float64)
    odd = rng.uniform(size=shape)
    acc[odd < 0.15] = np.nan
    acc[(odd >= 0.15) & (odd < 0.17)] = 0.5
    return acc


class _Previous:
    """The per-(depth, cell) correction as calib/tables/online.py computed it before the read caches: a dict
    of cell states read with np.unique and np.stack, np.clip, np.nan_to_num, verified_mask, ndarray.sum."""

    def __init__(self, n_depths, settings):
        self.settings, self.n_depths = settings, n_depths
        self.state, self.pooled, self.slope = {}, np.zeros((3, n_depths)), np.zeros((3, n_depths))
        self.sloped = settings.pooled and settings.slope

    def cols(self, width):
        return np.minimum(np.arange(self.n_depths if width is None else width), self.n_depths - 1)

    def offset(self, cells, width=None):
        cells = np.asarray(cells, dtype=np.int64).ravel()
        out = np.zeros((cells.size, self.n_depths))
        uniq, where = np.unique(cells, return_inverse=True)
        zero = np.zeros(self.n_depths)
        own = np.stack([self.state[c][0] if c in self.state else zero for c in uniq.tolist()])
        out += self.pooled[0] + own[where.ravel()]
        return out[:, self.cols(width)]

    def scale(self, width=None):
        return (1.0 + self.slope[0])[self.cols(width)]

    def learnt(self):
        return bool(self.state or self.pooled[2].any())

    def apply(self, p, cells):
        p = np.asarray(p, dtype=np.float64)
        if p.size == 0 or not self.learnt():
            return p
        z = np.log(np.clip(p, EPS, 1 - EPS)) - np.log1p(-np.clip(p, EPS, 1 - EPS))
        return np.where(kept(p), p, 1.0 / (1.0 + np.exp(-(z * self.scale(p.shape[1]) + self.offset(cells, p.shape[1])))))

    def table_of(self, q, cells):
        q = np.asarray(q, dtype=np.float64)
        if q.size == 0 or not self.learnt():
            return q
        z = (np.log(np.clip(q, EPS, 1 - EPS)) - np.log1p(-np.clip(q, EPS, 1 - EPS)) - self.offset(cells, q.shape[1]))
        return np.where(kept(q), q, 1.0 / (1.0 + np.exp(-(z / self.scale(q.shape[1])))))

    def update(self, p, acc, cells):
        p, acc = np.asarray(p, dtype=np.float64), np.asarray(acc, dtype=np.float64)
        K = min(p.shape[1], self.n_depths)
        p, acc = p[:, :K], acc[:, :K]
        seen = verified_mask(acc) & ~kept(p)
        cells = np.asarray(cells, dtype=np.int64).ravel()
        q0 = np.clip(np.nan_to_num(p, nan=0.5), EPS, 1 - EPS)
        z = np.log(q0) - np.log1p(-q0)
        y = np.nan_to_num(acc)
        if self.settings.pooled and seen.any():
            self.newton(self.pooled, seen, y, z * self.scale(K) + self.offset(cells, K), K,
                        slope=z if self.sloped else None)
        base = z * self.scale(K) + self.pooled[0, :K]
        added = 0
        for c in np.unique(cells):
            rows = cells == c
            if seen[rows].any():
                added += int(seen[rows].sum())
                s = self.state.setdefault(int(c), np.zeros((3, self.n_depths)))
                self.newton(s, seen[rows], y[rows], base[rows] + s[0, :K], K, ridge=self.settings.pooled)
        return added

    def newton(self, s, seen, y, u, K, ridge=False, slope=None):
        q = np.clip(1.0 / (1.0 + np.exp(-u)), EPS, 1 - EPS)
        cnt = seen.sum(axis=0)
        r, w = np.where(seen, y - q, 0.0), np.where(seen, q * (1 - q), 0.0)
        g, h = r.sum(axis=0), w.sum(axis=0)
        info0, fade = self.settings.prior / 4.0, self.settings.decay ** cnt
        if ridge:
            g = g - (1.0 - fade) * info0 * s[0, :K]
        s[1, :K] = fade * s[1, :K] + h
        s[2, :K] += cnt
        if slope is None:
            s[0, :K] += g / (s[1, :K] + info0)
            return
        b = self.slope
        b[1, :K] = fade * b[1, :K] + (w * slope * slope).sum(axis=0)
        b[2, :K] = fade * b[2, :K] + (w * slope).sum(axis=0)
        g_b = (r * slope).sum(axis=0)
        h_aa, h_bb, h_ab = s[1, :K] + info0, b[1, :K] + info0, b[2, :K]
        det = h_aa * h_bb - h_ab * h_ab
        s[0, :K] += (h_bb * g - h_ab * g_b) / det
        b[0, :K] = np.maximum(b[0, :K] + (h_aa * g_b - h_ab * g) / det, 0.1 - 1.0)


@pytest.mark.parametrize("settings", [OnlineSettings(), OnlineSettings(decay=0.9, prior=4.0),
                                      OnlineSettings(slope=False), OnlineSettings(pooled=False),
                                      OnlineSettings(decay=1.0, prior=1.0)])
def test_the_correction_learns_and_reads_exactly_as_before(settings):
    rng = np.random.default_rng(11)
    D = 4
    new, old = OnlineCorrection(D, settings, compiled=False), _Previous(D, settings)  # the numpy update
    for step in range(150):
        B = int(rng.integers(1, 20))
        K = int(rng.integers(1, 7))  # past the tracked depths too
        # a step's rounds: one shared cell (the common case), a few cells, or cells never seen before
        cells = (np.full(B, rng.integers(0, 5)) if step % 3 == 0 else rng.integers(0, 12 if step % 3 == 1 else 200, B))
        p, acc = _probs(rng, (B, K)), _outcomes(rng, (B, K))
        served_cells = rng.integers(0, 250, B)
        for width in (None, 1, D, 6):
            assert _same(new.offset(served_cells, width), old.offset(served_cells, width))
            assert _same(new.scale(width), old.scale(width))
        assert _same(new.apply(p, served_cells), old.apply(p, served_cells))
        assert _same(new.table_of(p, served_cells), old.table_of(p, served_cells))
        assert new.update(p, acc, cells) == old.update(p, acc, cells)
    assert new.state() == {**{c: {"offset": s[0].tolist(), "information": s[1].tolist(), "n": s[2].tolist()}
                              for c, s in sorted(old.state.items())},
                           **({"pooled": {"offset": old.pooled[0].tolist(), "information": old.pooled[1].tolist(),
                                          "n": old.pooled[2].tolist(),
                                          **({"slope": old.slope[0].tolist()} if old.sloped else {})}}
                              if settings.pooled else {})}
    assert old.learnt() and any(s[2].any() for s in old.state.values())  # the stream taught something


def test_a_negative_cell_is_refused_not_misread():
    corr = OnlineCorrection(2)
    with pytest.raises(ValueError, match="negative"):
        corr.update(np.full((1, 2), 0.5), np.ones((1, 2)), [-1])


def test_the_kernels_give_the_plain_spellings_values():
    rng = np.random.default_rng(12)
    for B, K in ((0, 3), (1, 1), (5, 4), (40, 6)):
        p, acc = _probs(rng, (B, K)), _outcomes(rng, (B, K))
        assert _same(logit(p), np.log(np.clip(p, EPS, 1 - EPS)) - np.log1p(-np.clip(p, EPS, 1 - EPS)))
        assert _same(moved(p), ~kept(p))
        assert _same(verified(acc), verified_mask(acc))


@pytest.mark.parametrize("edges", [[[0.4]], [[0.4], [0.0, 0.25, 0.5, 1.0, 2.0], [8.0, 32.0, 128.0, 512.0]],
                                   [[], [1.0, 1.0, 3.0], [-np.inf, 0.0, np.inf]]])
def test_the_cut_gives_the_context_cells(edges):
    rng = np.random.default_rng(13)
    values = rng.normal(1.0, 3.0, size=(500, len(edges)))
    odd = rng.uniform(size=values.shape)
    values[odd < 0.05] = np.nan
    values[(odd >= 0.05) & (odd < 0.08)] = np.inf
    values[(odd >= 0.08) & (odd < 0.11)] = -np.inf
    flat = [e for axis in edges for e in axis if np.isfinite(e)]
    values[(odd >= 0.11) & (odd < 0.2)] = rng.choice(flat) if flat else 0.0  # on an edge
    grid, strides = edge_grid(edges)
    assert _same(cut(values, grid, strides), context_cells(values, edges))
