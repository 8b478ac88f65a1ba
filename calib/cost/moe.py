"""MoE verify cost: from the predicted distinct experts of a verify shape to seconds.

Roofline per verify pass: the dense weights and every expert a shape routes to read once, against the
positions' FLOPs; the distinct experts from :mod:`calib.cost.distinct`. Design notes: docs/cost.md.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from calib.cost.distinct import MODELS, ChainTransfer, UniformCoupon


class MoECost:
    """Roofline cost of MoE verify shapes (config: ``conf/cost/moe*.yaml``)."""

    def __init__(self, cfg: dict, root: str | Path = "."):
        self.cfg = dict(cfg)
        need = ("layers", "n_experts", "top_k", "expert_params", "dense_params", "bytes_per_param",
                "bandwidth_gbs", "flops_per_position", "peak_tflops")
        missing = [k for k in need if k not in cfg]
        if missing:
            raise ValueError(f"MoE cost config is missing {missing} (see conf/cost/moe.yaml)")
        self.layers, self.n_experts, self.top_k = int(cfg["layers"]), int(cfg["n_experts"]), int(cfg["top_k"])
        self.expert_bytes = float(cfg["expert_params"]) * float(cfg["bytes_per_param"])
        self.dense_bytes = float(cfg["dense_params"]) * float(cfg["bytes_per_param"])
        self.bandwidth = float(cfg["bandwidth_gbs"]) * 1e9
        self.flops = float(cfg["flops_per_position"])
        self.peak = float(cfg["peak_tflops"]) * 1e12
        d = dict(cfg.get("distinct") or {})
        self.model_name = d.get("model", "uniform")
        if self.model_name not in MODELS:
            raise ValueError(f"distinct.model={self.model_name!r}: expected one of {sorted(MODELS)}")
        routing = d.get("routing")
        if self.model_name == "uniform" or not routing:
            if self.model_name != "uniform":
                raise ValueError(f"distinct.model={self.model_name!r} needs distinct.routing (a capture)")
            self.model = UniformCoupon(self.n_experts, self.top_k, self.layers).fit()
        else:
            from calib.cost.trajectories import Trajectories

            path = Path(routing) if Path(routing).is_absolute() else Path(root) / routing
            tr = Trajectories.from_bank(path)
            kwargs = {"max_chain": int(d.get("max_chain", 8))} if self.model_name == "maxent" else {}
            same = (tr.n_experts, tr.top_k, tr.layers) == (self.n_experts, self.top_k, self.layers)
            if not same and not d.get("transfer", False):
                raise ValueError(f"{path}: capture has {tr.layers} layers x {tr.n_experts} experts, top-{tr.top_k}; "
                                 f"the cost config says {self.layers} x {self.n_experts}, top-{self.top_k} "
                                 "(distinct.transfer: true carries its depth sharing over, docs/moe.md)")
            self.model = MODELS[self.model_name](**kwargs).fit(tr)
            if not same:  # the capture's depth sharing on this target's shape (calib.cost.distinct.ChainTransfer)
                self.model = ChainTransfer(self.model, self.layers, self.n_experts, self.top_k, tr.top_k).fit()
                self.model_name = f"transfer({self.model_name})"

    # -- shapes ------------------------------------------------------------------------------------
    def log_absent_table(self, positions: int) -> np.ndarray:
        """The distinct model's ``log P_absent`` [positions + 1, L, E] (row n: one sequence of n positions), kept."""
        cached = getattr(self, "_log_absent", None)
        if cached is None or cached.shape[0] < positions + 1:
            cached = self._log_absent = self.model.log_absent_table(max(positions, 8))
        return cached[: positions + 1]

    def experts_read(self, counts: np.ndarray) -> np.ndarray:
        """[S] distinct experts summed over layers for each shape (counts [S, D + 1])."""
        counts = np.atleast_2d(np.asarray(counts, dtype=np.float64))
        return self.model.predict_counts(counts).sum(axis=-1)

    def step_cost(self, counts: np.ndarray) -> np.ndarray:
        """[S] seconds per verify pass for shapes given as counts [S, D + 1]."""
        counts = np.atleast_2d(np.asarray(counts, dtype=np.float64))
        positions = counts @ np.arange(counts.shape[1])
        memory = (self.dense_bytes + self.expert_bytes * self.experts_read(counts)) / self.bandwidth
        return np.maximum(memory, positions * self.flops / self.peak)

    def shape_cost(self, positions_per_sequence) -> float:
        return float(self.step_cost(shape_counts([positions_per_sequence]))[0])

    def memory_bound(self, counts: np.ndarray) -> np.ndarray:
        """[S] whether each shape's pass is limited by its weight reads (not by its FLOPs)."""
        counts = np.atleast_2d(np.asarray(counts, dtype=np.float64))
        positions = counts @ np.arange(counts.shape[1])
        memory = (self.dense_bytes + self.expert_bytes * self.experts_read(counts)) / self.bandwidth
        return memory >= positions * self.flops / self.peak

    def tangent_price(self, reference: np.ndarray, width: int) -> tuple[float, np.ndarray]:
        """A separable price for the allocator (``calib.allocate.ShapePrice``'s ``(base, table [width + 1])``,
        seconds) from the step's reference draft depths ``reference`` int [B].

        The expected experts read, ``sum_{l,e} 1 - exp(x_le)`` with ``x_le = sum_i log P_absent(l, e, 1 + d_i)``,
        is concave in ``x``; its tangent at the reference shape's ``x0`` is linear in ``x``, hence a sum over
        requests, an upper bound everywhere and exact at the reference: request ``i`` verifying ``d`` drafts
        adds ``-sum_le w_le (log P_absent(1 + d) - log P_absent(1))`` experts, ``w = exp(x0)`` the chance the
        reference shape leaves the expert unread (experts the batch reads anyway cost nothing more). Where
        the reference pass is compute-bound the price is its FLOPs line instead (exact: linear in positions).
        """
        ref = np.asarray(reference, dtype=np.int64)
        const, per_sequence = self.tangent_per_sequence(1 + ref, width + 1)
        base = const + ref.size * per_sequence[1]  # every request at its bonus position
        return base, np.maximum(per_sequence[1:] - per_sequence[1], 0.0)

    def tangent_per_sequence(self, positions: np.ndarray, n_max: int) -> tuple[float, np.ndarray]:
        """The tangent of :meth:`tangent_price` per sequence: ``(const, phi [n_max + 1])`` seconds, a step whose
        sequences verify ``n_s`` positions costing ``const + sum_s phi[n_s]`` (``phi[0] = 0``: not in the step),
        exact at the reference shape ``positions`` int [B] (positions per sequence) and above the cost elsewhere
        (memory-bound there; else the FLOPs line, ``const = 0``)."""
        ref = np.asarray(positions, dtype=np.int64)
        top = max(n_max, int(ref.max(initial=0)))
        table = self.log_absent_table(top)  # [top + 1, L, E]: row n = n positions of one sequence
        counts = np.bincount(ref, minlength=top + 1).astype(np.float64)  # sequences by positions
        if not self.memory_bound(counts[None])[0]:
            return 0.0, self.flops / self.peak * np.arange(n_max + 1, dtype=np.float64)
        x0 = np.tensordot(counts, table, axes=(0, 0))  # [L, E]
        w = np.exp(x0)
        scale = self.expert_bytes / self.bandwidth
        phi = -scale * (w[None] * table[: n_max + 1]).sum(axis=(1, 2))  # [n_max + 1] experts -> seconds
        return self.dense_bytes / self.bandwidth + scale * (1.0 - w + w * x0).sum(), phi

    def even_curve(self, batch: int, t_max: int) -> np.ndarray:
        """[t_max + 1] cost of ``batch`` sequences verifying T positions in all, spread as evenly as
        possible (depths differ by at most one); entries T < batch repeat T = batch."""
        t = np.maximum(np.arange(t_max + 1), batch)
        base, extra = t // batch, t % batch
        counts = np.zeros((t.size, int(base.max()) + 2))
        rows = np.arange(t.size)
        counts[rows, base] += batch - extra
        counts[rows, base + 1] += extra
        return self.step_cost(counts)


def shape_counts(shapes, width: int | None = None) -> np.ndarray:
    """Shapes (lists of positions per sequence) -> counts [S, width + 1]."""
    width = width or max((max(s) for s in shapes if len(s)), default=0)
    out = np.zeros((len(shapes), width + 1))
    for i, s in enumerate(shapes):
        for d in s:
            out[i, int(d)] += 1
    return out


def depth_counts(depth: np.ndarray, width: int) -> np.ndarray:
    """Verified draft depths [S, B] (each request also verifies its bonus position) -> counts
    [S, width + 2] of sequences by positions verified (1 + depth)."""
    depth = np.asarray(depth, dtype=np.int64)
    S = depth.shape[0]
    out = np.zeros((S, width + 2))
    np.add.at(out, (np.repeat(np.arange(S), depth.shape[1]), 1 + depth.reshape(-1)), 1.0)
    return out


def break_even_alpha(depth2: float, width2: float) -> float:
    """Acceptance α at which 1 sequence verifying 2 positions (1 + α tokens for ``depth2`` experts)
    matches 2 sequences verifying 1 each (2 tokens for ``width2`` experts) in tokens per expert read."""
    return 2.0 * depth2 / width2 - 1.0
