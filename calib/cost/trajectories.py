"""Routing captures as per-request trajectories: the experts each committed position routed to.

A request's *trajectory* is its accepted positions in order (each position is committed exactly once,
as block index 0..accept of some round), so ``N`` consecutive trajectory positions are what one
sequence verifying ``N`` positions in one pass routes to. Rejected draft positions are left out:
they are wrong tokens at those positions (kept in the capture for whoever wants them). Where a
request decoded steps with nothing drafted (vLLM records no round then), its trajectory has gaps and
is kept as contiguous *segments*; ``request`` says which request each segment belongs to.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from calib.bank import read_routing


@dataclass
class Trajectories:
    """``seqs[r]``: bool [P_r, layers, n_experts] (True = expert used at that position) of segment
    ``r`` (consecutive positions), in position order; ``category[r]``, ``prompt_idx[r]``,
    ``request[r]`` per segment (``request`` defaults to one request per segment)."""

    seqs: list
    category: np.ndarray
    prompt_idx: np.ndarray
    n_experts: int
    top_k: int
    request: np.ndarray | None = None

    def __post_init__(self):
        if self.request is None:
            self.request = np.arange(len(self.seqs))

    @property
    def n_requests(self) -> int:
        return int(np.unique(self.request).size)

    @property
    def layers(self) -> int:
        return int(self.seqs[0].shape[1])

    def __len__(self) -> int:
        return len(self.seqs)

    @classmethod
    def from_bank(cls, bank_dir, validate_on_open: bool = True) -> Trajectories:
        rt = read_routing(bank_dir, validate_on_open)
        m = rt.meta
        acc = m.column("accepted").to_numpy(zero_copy_only=False).astype(bool)
        req = m.column("request_idx").to_numpy(zero_copy_only=False)[acc]
        pos = m.column("position").to_numpy(zero_copy_only=False)[acc]
        ridx = m.column("routing_idx").to_numpy(zero_copy_only=False)[acc]
        cat = np.asarray(m.column("category").to_pylist(), dtype=object)[acc]
        pidx = m.column("prompt_idx").to_numpy(zero_copy_only=False)[acc]
        experts = np.asarray(rt.experts)
        n_exp = rt.n_experts
        seqs, cats, prompts, reqs = [], [], [], []
        order = np.lexsort((pos, req))
        req, pos, ridx, cat, pidx = req[order], pos[order], ridx[order], cat[order], pidx[order]
        same_req = np.diff(req) == 0
        repeated = same_req & (np.diff(pos) == 0)
        if repeated.any():
            i = int(np.flatnonzero(repeated)[0])
            raise ValueError(f"{bank_dir}/routing_meta.parquet: request_idx {int(req[i])} has position "
                             f"{int(pos[i])} accepted twice (a trajectory holds every position once)")
        bounds = np.flatnonzero(~same_req | (np.diff(pos) != 1)) + 1  # new request or a gap
        for sl in np.split(np.arange(len(req)), bounds):
            if sl.size == 0:
                continue
            seqs.append(one_hot(experts[ridx[sl]], n_exp))
            cats.append(cat[sl[0]])
            prompts.append(int(pidx[sl[0]]))
            reqs.append(int(req[sl[0]]))
        return cls(seqs, np.asarray(cats, dtype=object), np.asarray(prompts), n_exp, rt.top_k, np.asarray(reqs))

    def subset(self, idx) -> Trajectories:
        idx = np.asarray(idx, dtype=np.int64)
        return Trajectories([self.seqs[i] for i in idx], self.category[idx], self.prompt_idx[idx],
                            self.n_experts, self.top_k, self.request[idx])

    def split(self, heldout_fraction: float, seed: int = 0) -> tuple[Trajectories, Trajectories]:
        """(fit, held-out) by request (all its segments together), stratified by category so both keep
        every category."""
        rng = np.random.default_rng(seed)
        held = np.zeros(len(self), dtype=bool)
        for c in sorted(set(self.category.tolist())):
            members = np.unique(self.request[self.category == c])
            n = round(heldout_fraction * members.size)
            held |= np.isin(self.request, rng.choice(members, size=n, replace=False))
        return self.subset(np.flatnonzero(~held)), self.subset(np.flatnonzero(held))

    def marginals(self) -> np.ndarray:
        """[layers, E] share of positions that use each expert (sums to top_k over experts)."""
        return np.concatenate(self.seqs).mean(axis=0)

    def pair_rates(self, max_distance: int) -> np.ndarray:
        """[layers, E, max_distance + 1]: P(expert used at p and at p + δ), same sequence (δ = 0: marginal)."""
        out = np.zeros((self.layers, self.n_experts, max_distance + 1))
        count = np.zeros(max_distance + 1)
        for s in self.seqs:
            s = s.astype(np.float64)
            for d in range(min(max_distance, s.shape[0] - 1) + 1):
                out[..., d] += (s[: s.shape[0] - d] * s[d:]).sum(axis=0)
                count[d] += s.shape[0] - d
        with np.errstate(invalid="ignore"):
            out = out / count
        # Distances no sequence reaches keep the farthest measured rate.
        for d in range(1, max_distance + 1):
            if count[d] == 0:
                out[..., d] = out[..., d - 1]
        return out


def one_hot(ids: np.ndarray, n_experts: int) -> np.ndarray:
    """uint8 ids [P, layers, k] -> bool [P, layers, n_experts]."""
    out = np.zeros(ids.shape[:2] + (n_experts,), dtype=bool)
    np.put_along_axis(out, ids.astype(np.int64), True, axis=2)
    return out
