"""``oracle``: the allocator on the actual accept masks, a bound on every policy step by step; served (greedy
only), the clock oracle of calib/serve/oracle.py."""

from __future__ import annotations

import numpy as np

from calib.chains import NO_CHAIN
from calib.policies.base import Arm, Policy, PolicyResult, Serving, register_policy
from calib.policies.setting import Setting, allocate_chains, committed


def oracle(s: Setting) -> PolicyResult:
    """Allocator on the actual accept masks; per step it also chooses in hindsight how many primary
    draft passes to pay (0..K; with a free drafter always K). A second chain (the n-gram chain of a
    model-drafter bank) is drafted without a model pass, so it is available in full whatever the
    number of passes (its own drafting, ``draft_cost[ngram]``, is paid once). The best per-step goodput
    is kept, counted as the totals count it (:meth:`Setting.step_goodput`): a bound on the policies of its own
    engine, not on an engine without the drafter loaded (``no_spec``, ``second_fixed``)."""
    sb, curve, budget = s.sb, s.curve, s.budget
    S, B, K = sb.S, sb.B, sb.K
    free = s.draft(1) == 0
    depths_to_try = [K] if (free or budget is not None) else list(range(K + 1))
    second_cost = s.second_cost if sb.second else 0.0
    best = (np.ones((S, B)), curve.charge(np.zeros((S, B), dtype=np.int64)), np.zeros(S))  # no drafting at all
    best_gp = s.step_goodput(best[0], best[1])
    for gmax in depths_to_try:
        if gmax == 0 and not sb.second:
            continue  # no chain to verify: that is the no-drafting start
        extra = s.draft(gmax) + second_cost
        tok, cost, pos = _oracle_passes(s, gmax, extra)
        gp = s.step_goodput(tok, cost)  # the passes chosen by the accounting the totals use
        better = gp > best_gp if budget is None else np.ones(S, bool)
        best = tuple(np.where(better if new.ndim == 1 else better[:, None], new, old)
                     for new, old in zip((tok, cost, pos), best))
        best_gp = np.where(better, gp, best_gp)
    return PolicyResult(*best, {})


def oracle_served(s: Setting) -> PolicyResult:
    """The clock oracle as served (calib/serve/oracle.py ``passes``): it cannot know a model draft before drafting,
    so a step pays every draft pass (K), except where every request's second chain (the recomputed n-gram chain)
    already commits K tokens, where it pays none; then the allocator on the actual accept masks. Where drafting
    is free or there is no second chain, this is :func:`oracle` at K."""
    sb, K = s.sb, s.sb.K
    extra_k = s.draft(K) + (s.second_cost if sb.second else 0.0)
    tok, cost, pos = _oracle_passes(s, K, extra_k)
    if sb.second and s.draft(1) != 0 and s.budget is None:
        _, second = sb.ids
        skip = (sb.acc[second] >= K).all(axis=1)  # [S] the second chain commits K for every request
        if skip.any():
            t0, c0, p0 = _oracle_passes(s, 0, s.second_cost)
            tok, cost, pos = (np.where(skip if a.ndim == 1 else skip[:, None], a, b)
                              for a, b in ((t0, tok), (c0, cost), (p0, pos)))
    return PolicyResult(tok, cost, pos, {})


def _oracle_passes(s: Setting, gmax: int, extra: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(tokens [S, B], cost [S], positions [S]) of the allocator on the accept masks with ``gmax`` primary passes drafted."""
    sb, curve = s.sb, s.curve
    first, second = sb.ids
    cost_t = curve.tensor(extra=extra)
    p1 = sb.oracle[first].copy()
    p1[..., gmax:] = np.nan
    p2 = sb.oracle[second] if sb.second else None
    dr = np.zeros((sb.S, sb.B), np.int64)
    de = np.zeros((sb.S, sb.B), np.int64)
    for i in range(sb.S):
        dr[i], de[i] = allocate_chains(p1[i], None if p2 is None else p2[i], cost_t, s.budget, s.cfg.impl, sb.names)
        if s.budget is None:  # as served: the same tokens in the cheapest step the drafts reach
            dr[i], de[i] = _padded(sb, i, gmax, dr[i], de[i], curve.values)
    return committed(sb, dr, de), curve.charge(de) + extra, de.sum(axis=1)


def _padded(sb, i: int, gmax: int, dr: np.ndarray, de: np.ndarray, price: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Step ``i``'s (chain [B], depth [B]) padded as the clock oracle pads (calib/serve/oracle.py ``pad_to_cheapest``):
    each row's chosen chain's drafted tokens past its depth, or where it chose none the chain that drafted more (the
    primary's draft is ``gmax`` passes long), up to the cheapest step they reach. A padded token past the accepted
    prefix is rejected, so :func:`committed` counts the same tokens; only the step's price changes."""
    # here, not at the top: calib.allocate imports torch, and the entry points' --help import the policies
    from calib.allocate.padding import cheapest_padding

    first, second = sb.ids
    own = np.minimum(sb.length[first][i], gmax)  # [B] the primary's draft: gmax passes long
    other, alt = (second, sb.length[second][i]) if sb.second else (first, own)
    chosen = np.where(dr == NO_CHAIN, np.where(alt > own, other, first), dr)
    avail = np.where(chosen == first, own, alt)
    extra = cheapest_padding(avail - de, len(de) + int(de.sum()), price)
    return np.where(extra > 0, chosen, dr), de + extra


register_policy(Policy(
    "oracle", 80, "k", "allocator on the actual accept masks, also choosing per step in hindsight how many draft "
    "passes to pay (0..K): a bound on every policy, step by step", oracle, camp="reference",
    below_no_spec="pays drafting it cannot avoid",
    # Served (greedy only): the clock oracle, calib's hooks verifying exactly what a no-speculation reference output
    # accepts (calib/serve/oracle.py, serve.oracle=PATH): on the n-gram engine vLLM's n-gram chain, on the EAGLE
    # engine the better of EAGLE's draft and the recomputed n-gram chain. bench/serve.py writes the reference first.
    serving=Serving(speculate=True, calib=True, chains=("model", "ngram"), plan=False, oracle=True,
                    arms=(Arm("oracle_ngram", "ngram", default=False, replay="oracle_served"),
                          Arm("oracle_two_drafter", "eagle", default=False, replay="oracle_served")))))

register_policy(Policy(
    "oracle_served", 81, "k", "the clock oracle's rule: the allocator on the actual accept masks with every draft "
    "pass paid, none where the n-gram chain commits K for every request (a model draft is not known before "
    "drafting): what the oracle arms serve, and what predicts them", oracle_served, camp="reference",
    below_no_spec="pays drafting it cannot avoid"))
