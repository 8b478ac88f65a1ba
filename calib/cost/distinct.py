"""Models of the number of distinct experts a verify shape routes to, per MoE layer.

Three models (uniform coupon collector, independent non-uniform, pairwise maximum entropy), as
scikit-learn-style estimators fitted on routing trajectories, and :class:`ChainTransfer`, which carries a
fitted model's depth sharing onto another MoE shape. Design notes: docs/cost.md, docs/moe.md.
"""

from __future__ import annotations

import numpy as np


class _DistinctModel:
    name = "base"

    def get_params(self) -> dict:
        """Constructor parameters (scikit-learn convention), for an unfitted copy."""
        import inspect

        return {k: getattr(self, k) for k in inspect.signature(type(self).__init__).parameters if k != "self"}

    def log_absent(self, d: int) -> np.ndarray:  # pragma: no cover - abstract
        raise NotImplementedError

    def log_absent_table(self, d_max: int) -> np.ndarray:
        """[d_max + 1, layers, E]; row 0 is 0 (a sequence verifying nothing uses nothing)."""
        rows = [np.zeros_like(self.log_absent(1))] + [self.log_absent(d) for d in range(1, d_max + 1)]
        return np.stack(rows)

    def predict(self, shape) -> np.ndarray:
        """Expected distinct experts per layer [layers] for one shape (positions per sequence)."""
        shape = [int(d) for d in shape if int(d) > 0]
        log_abs = sum((self.log_absent(d) for d in shape), start=np.zeros_like(self.log_absent(1)))
        return (1.0 - np.exp(log_abs)).sum(axis=-1)

    def predict_counts(self, counts: np.ndarray) -> np.ndarray:
        """Vectorised :meth:`predict`: ``counts`` [S, D + 1] = number of sequences verifying d positions
        (column d), per shape; returns [S, layers]."""
        counts = np.asarray(counts, dtype=np.float64)
        table = self.log_absent_table(counts.shape[1] - 1)  # [D + 1, L, E]
        log_abs = np.tensordot(counts, table, axes=(1, 0))  # [S, L, E]
        return (1.0 - np.exp(log_abs)).sum(axis=-1)


class UniformCoupon(_DistinctModel):
    """(a) k of E experts uniformly at random per position (needs no data; ``fit`` reads E, k, layers)."""

    name = "uniform"

    def __init__(self, n_experts: int | None = None, top_k: int | None = None, layers: int | None = None):
        self.n_experts, self.top_k, self.layers = n_experts, top_k, layers

    def fit(self, trajectories=None):
        self.n_experts_ = int(self.n_experts or trajectories.n_experts)
        self.top_k_ = int(self.top_k or trajectories.top_k)
        self.layers_ = int(self.layers or trajectories.layers)
        if not 0 < self.top_k_ <= self.n_experts_:
            raise ValueError(f"top_k must be in [1, n_experts={self.n_experts_}], got {self.top_k_}")
        return self

    def log_absent(self, d: int) -> np.ndarray:
        p = 1.0 - self.top_k_ / self.n_experts_
        return np.full((self.layers_, self.n_experts_), d * np.log(p) if p > 0 else -np.inf)


class IndependentNonUniform(_DistinctModel):
    """(b) independent positions with the measured per-layer expert popularity."""

    name = "independent"

    def __init__(self, eps: float = 1e-12):
        self.eps = eps

    def fit(self, trajectories):
        self.marginals_ = np.clip(trajectories.marginals(), 0.0, 1.0 - self.eps)
        return self

    def log_absent(self, d: int) -> np.ndarray:
        return d * np.log1p(-self.marginals_)


class MaxEntPairwise(_DistinctModel):
    """(c) maximum entropy over a sequence's use pattern given marginals and co-use by distance."""

    name = "maxent"

    def __init__(self, max_chain: int = 8, max_iter: int = 200, tol: float = 1e-9, eps: float = 1e-9):
        self.max_chain, self.max_iter, self.tol, self.eps = max_chain, max_iter, tol, eps

    def fit(self, trajectories):
        rates = trajectories.pair_rates(self.max_chain - 1)
        self.marginals_ = rates[..., 0]
        self.pair_rates_ = rates
        self.ipf_ = {}  # d -> (log P_absent [L, E], iterations, max constraint error)
        return self

    def fit_rates(self, marginals: np.ndarray, pair_rates: np.ndarray):
        """Fit from given rates: ``marginals`` [L, E], ``pair_rates`` [L, E, D] (δ = 0 .. D−1, δ=0 ignored)."""
        self.marginals_ = np.asarray(marginals, dtype=np.float64)
        self.pair_rates_ = np.concatenate([self.marginals_[..., None], np.asarray(pair_rates)[..., 1:]], axis=-1)
        self.ipf_ = {}
        return self

    def log_absent(self, d: int) -> np.ndarray:
        if d <= 0:
            return np.zeros_like(self.marginals_)
        m = min(d, self.max_chain, self.pair_rates_.shape[-1])
        if m not in self.ipf_:
            table, it, err = ipf_chain(self.marginals_, self.pair_rates_[..., 1:m], m, self.max_iter, self.tol,
                                       self.eps)
            self.ipf_[m] = (np.log(np.maximum(table[..., 0], 1e-300)), it, err)
        if d == m:
            return self.ipf_[m][0]
        # Beyond the fitted chain: each further position keeps the last conditional absence rate.
        prev = self.log_absent(m - 1)
        return self.ipf_[m][0] + (d - m) * np.minimum(self.ipf_[m][0] - prev, 0.0)

    def joint(self, d: int) -> np.ndarray:
        """The fitted distribution over the 2^d use patterns [L, E, 2^d] (bit i = position i)."""
        table, _, _ = ipf_chain(self.marginals_, self.pair_rates_[..., 1:d], d, self.max_iter, self.tol, self.eps)
        return table


def ipf_chain(marginals: np.ndarray, pair_rates: np.ndarray, d: int, max_iter: int = 200, tol: float = 1e-9,
              eps: float = 1e-9) -> tuple[np.ndarray, int, float]:
    """Iterative proportional fitting of the max-entropy distribution over ``{0,1}^d`` per cell.

    ``marginals`` [..., ] P(x_i = 1) for every i; ``pair_rates`` [..., d − 1]: P(x_i = 1, x_j = 1)
    for j − i = δ (column δ − 1). Starting from the uniform table, each sweep rescales the table to
    every pair's 2×2 marginal in turn (which also fixes the single marginals). IPF converges to the
    max-entropy distribution matching the constraints when they are feasible; rates are clipped to
    the Fréchet bounds so each 2×2 target is a distribution. Returns (table [..., 2^d], sweeps, max
    absolute constraint error).
    """
    pi = np.clip(np.asarray(marginals, dtype=np.float64), eps, 1 - eps)
    shape = pi.shape
    pi = pi.reshape(-1)
    states = np.arange(1 << d)
    bits = ((states[:, None] >> np.arange(d)[None, :]) & 1).astype(np.int64)  # [S, d]
    table = np.full((pi.size, 1 << d), 1.0 / (1 << d))
    if d == 1:
        table[:, 1], table[:, 0] = pi, 1 - pi
        return table.reshape(shape + (2,)), 1, 0.0
    rates = np.asarray(pair_rates, dtype=np.float64).reshape(pi.size, -1)
    pairs, cells, targets = [], [], []
    for i in range(d):
        for j in range(i + 1, d):
            c = np.clip(rates[:, j - i - 1], np.maximum(0.0, 2 * pi - 1) + eps, pi - eps)
            target = np.stack([1 - 2 * pi + c, pi - c, pi - c, c], axis=1)  # cells 00, 01, 10, 11
            target = np.maximum(target, eps)
            pairs.append((i, j))
            cells.append(2 * bits[:, i] + bits[:, j])
            targets.append(target / target.sum(1, keepdims=True))
    onehots = [np.eye(4)[c] for c in cells]  # [S, 4]
    err = np.inf
    it = 0
    for it in range(1, max_iter + 1):
        for cell, onehot, target in zip(cells, onehots, targets):
            current = table @ onehot  # [M, 4]
            table *= (target / np.maximum(current, 1e-300))[:, cell]
        if it % 5 == 0 or it == max_iter:  # the check costs a sweep's worth of marginals
            err = max(float(np.abs(table @ oh - t).max()) for oh, t in zip(onehots, targets))
            if err < tol:
                break
    return table.reshape(shape + (1 << d,)), it, err


class ChainTransfer(_DistinctModel):
    """(d) a capture's depth sharing carried onto another MoE shape (a target whose routing is not at hand).

    From a model fitted on a capture of ``L_s`` layers x ``E_s`` experts, top-``k_s`` (``source``), the
    *novelty* of the n-th position of one sequence, ``nu(l, n) = (D_s(l, n) - D_s(l, n - 1)) / k_s`` (the
    share of its k experts no earlier position of the chain used; ``nu(l, 1) = 1``), is read per source
    layer; the target's layer ``l'`` takes source layer ``floor(l' * L_s / L)``, and one sequence of ``n``
    positions uses ``D(l', n) = min(E, k * sum_{j<=n} nu(l_s, j))`` experts, each expert alike:
    ``P_absent = 1 - D / E``. Sequences stay independent (the cross-sequence union is the coupon
    collector's), and the capture's expert popularity is not carried over (every target expert alike).
    """

    name = "transfer"

    def __init__(self, source: _DistinctModel, layers: int, n_experts: int, top_k: int, source_top_k: int,
                 max_positions: int = 64):
        self.source, self.layers, self.n_experts, self.top_k = source, layers, n_experts, top_k
        self.source_top_k, self.max_positions = source_top_k, max_positions

    def fit(self, trajectories=None):
        if not 0 < self.top_k <= self.n_experts:
            raise ValueError(f"top_k must be in [1, n_experts={self.n_experts}], got {self.top_k}")
        single = np.stack([(1.0 - np.exp(self.source.log_absent(n))).sum(axis=-1)
                           for n in range(1, self.max_positions + 1)])  # [N, L_s]: one chain's distinct
        novelty = np.diff(single, axis=0, prepend=0.0) / self.source_top_k  # [N, L_s]
        src_layers = single.shape[1]
        pick = (np.arange(self.layers) * src_layers) // self.layers
        self.novelty_ = np.clip(novelty[:, pick], 0.0, 1.0)  # [N, L]
        self.distinct_ = np.minimum(self.n_experts, self.top_k * np.cumsum(self.novelty_, axis=0))  # [N, L]
        return self

    def log_absent(self, d: int) -> np.ndarray:
        if d <= 0:
            return np.zeros((self.layers, self.n_experts))
        row = self.distinct_[min(d, self.max_positions) - 1]  # beyond: the last novelty repeats
        if d > self.max_positions:
            row = np.minimum(self.n_experts, row + (d - self.max_positions) * self.top_k * self.novelty_[-1])
        absent = np.maximum(1.0 - row / self.n_experts, 1e-300)
        return np.repeat(np.log(absent)[:, None], self.n_experts, axis=1)


MODELS = {"uniform": UniformCoupon, "independent": IndependentNonUniform, "maxent": MaxEntPairwise}
