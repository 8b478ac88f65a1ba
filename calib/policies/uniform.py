"""Batch-uniform policies: ``homogeneous`` (one γ from training) and ``gated_uniform`` (one γ per step)."""

from __future__ import annotations

import numpy as np

from calib.chains import chain_names
from calib.policies.base import Policy, PolicyResult, register_policy
from calib.policies.setting import Setting, allocate_chains


def uniform_gamma(p_row: np.ndarray, batch: int, curve, draft: np.ndarray, impl: str) -> int:
    """Best batch-uniform γ for a batch of ``batch`` requests that all follow the curve ``p_row`` [K].

    One representative request with a rescaled price curve ``cost1[1 + d] = C(B(1 + d)) + draft[d]``
    has goodput ``(1 + E_d) / cost1[1 + d]`` = the batch's goodput / B, so the allocator's exact
    goodput rule on it returns the batch-uniform optimum.
    """
    import torch  # on first use (calib.policies.setting says why)

    K = p_row.shape[0]
    cost1 = np.empty(K + 2)
    cost1[0] = np.inf
    for d in range(K + 1):
        cost1[1 + d] = curve.values[batch * (1 + d)] + draft[d]
    _, depth = allocate_chains(p_row[None, :], None, torch.from_numpy(cost1), None, impl, (chain_names()[0], None))
    return int(depth[0])


def mean_conditional(p: np.ndarray) -> np.ndarray:
    """Batch-mean survival curve of ``p`` [B, K] as conditional probabilities [K] (NaN once the mean survival is 0)."""
    present = ~np.isnan(p)
    in_chain = np.cumprod(present, axis=-1).astype(bool)
    surv = np.cumprod(np.where(in_chain, np.clip(np.nan_to_num(p), 0, 1), 0.0), axis=-1).mean(axis=0)
    prev = np.concatenate([[1.0], surv[:-1]])
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(prev > 0, surv / prev, np.nan)


def homogeneous(s: Setting) -> PolicyResult:
    g = uniform_gamma(s.train_curve, s.B, s.curve, np.array([s.draft(d) for d in range(s.K + 1)]), s.cfg.impl)
    tok, cost, pos = s.uniform(np.full(s.S, g), s.draft(g))
    return PolicyResult(tok, cost, pos, {"gamma": g})


def gated_uniform(s: Setting) -> PolicyResult | None:
    p_cal = s.sb.p_cal[s.P]
    if p_cal is None:
        return None
    gammas = np.array([uniform_gamma(mean_conditional(p_cal[i]), s.B, s.curve, np.full(s.K + 1, s.sunk),
                                     s.cfg.impl) for i in range(s.S)])
    tok, cost, pos = s.uniform(gammas, s.sunk)
    return PolicyResult(tok, cost, pos, {"gamma_mean": float(gammas.mean())})


register_policy(Policy(
    "homogeneous", 30, "tab:olive", "one γ for every step, from the primary chain's mean acceptance curve on the "
    "training split (the goodput rule on one representative request)", homogeneous, camp="reference",
    below_no_spec="γ comes from the training split's pooled acceptance curve (both categories), not this "
                  "category's"))
register_policy(Policy(
    "gated_uniform", 40, "tab:cyan", "one γ per step from that step's mean calibrated survival curve; pays K "
    "draft passes first", gated_uniform, camp="reference",
    below_no_spec="pays for K draft passes to read the signal before choosing a uniform γ"))
