"""Re-deciding inside a recorded round's stretch (``replay.redecide``).

A recorded round stands for the stretch of text its collecting engine crossed in it, ``c`` tokens
(:func:`calib.evaluate.replay.summarise`). A policy that commits ``p < c`` tokens there has not finished the
stretch; the weightings alone count it as crossing the rest at the same rate (``c / p`` steps), as if it decided
the same way at every token of the stretch. Served, it decides again at the next step, with the draft's accepted
tail still ahead: after ``p`` tokens of an n-gram match the match goes on, and so does a model drafter's chain.

Here the rest of the stretch is a *residual round*: every chain's accept mask and calibrated probabilities
shifted by the ``p`` committed tokens, its context ``p`` tokens longer, the tables' forecast unchanged (the same
context cell). A chain whose accepted prefix ended inside the committed tokens diverged from the text and offers
nothing. Past the recording a chain that was accepted through all K of its drafted tokens goes on being accepted,
at its last depth's probability (a copied span goes on; what the policy commits there beyond the stretch is the
next stretch's, counted as the stretch's share of the step); one that was rejected inside it ends at the
rejection, and one its drafter cut short (an n-gram match that ran out) ends where it ended. The policy decides again on residual rounds, dealt ``B`` to a step in the order
they arose, until every stretch is crossed: at most ``K + 1`` levels, as each commits at least one token. A step
counts ``min(c, p)`` of each of its rounds' text (:func:`calib.policies.setting.step_weights` on the capped
stretch), so every policy still writes the same text, ``Σ c``. A policy that commits at least the collector's
stretch (the collector's own fixed K, an oracle) is unchanged. Docs: docs/policies.md.
"""

from __future__ import annotations

import numpy as np

from calib.policies.setting import StepBatch


def _shifted(a: np.ndarray, t: np.ndarray, length: np.ndarray, fill) -> np.ndarray:
    """``a`` [N, K] with row n read from depth ``t[n]`` on, ``fill`` (scalar or [N]) past its drafted ``length[n]``."""
    K = a.shape[1]
    j = np.arange(K)[None, :] + t[:, None]
    out = np.take_along_axis(a, np.minimum(j, K - 1), axis=1)
    fill = np.broadcast_to(np.asarray(fill, dtype=float).reshape(-1, 1), out.shape)
    return np.where(j < length[:, None], out, fill)


def _last_drafted(a: np.ndarray, length: np.ndarray) -> np.ndarray:
    """[N] ``a`` [N, K] at each row's last drafted depth (``length`` [N] >= 1)."""
    return np.take_along_axis(a, np.maximum(length - 1, 0)[:, None], axis=1)[:, 0]


def residual_batch(sb: StepBatch, tokens: np.ndarray, covered: np.ndarray) -> tuple[StepBatch, np.ndarray] | None:
    """The residual rounds of the rows of ``sb`` where a policy committed ``tokens`` [S, B] < ``covered`` [S, B],
    dealt ``sb.B`` to a step in row order: (their :class:`StepBatch`, [S', B] the stretch each has left, 0 on the
    padding that fills the last step), or None when every stretch is crossed."""
    left = np.flatnonzero((tokens < covered).ravel())
    if left.size == 0:
        return None
    B = sb.B
    steps = -(-left.size // B)
    pick = np.concatenate([left, np.full(steps * B - left.size, left[0])])  # pad with a copy, counted for nothing
    t = tokens.ravel()[pick].astype(np.int64)  # [N] committed, so the shift
    rest = np.where(np.arange(pick.size) < left.size, covered.ravel()[pick] - t, 0).reshape(steps, B)
    return shifted_batch(sb, pick, t, rest), rest


def shifted_batch(sb: StepBatch, pick: np.ndarray, t: np.ndarray, rest: np.ndarray,
                  blank: np.ndarray | None = None) -> StepBatch:
    """A :class:`StepBatch` of ``rest.shape`` = [S', B'] rounds: the rounds ``pick`` [N] (flat positions in ``sb``'s
    [S, B]) each read ``t`` [N] tokens on (the module docstring says how every chain is shifted), standing for
    ``rest`` [S', B'] tokens of text each; ``blank`` [N]: rounds drafted by no chain (a step without a draft)."""
    steps, B = rest.shape

    def flat(a):  # [S, B, ...] -> [N, ...] at the picked rows
        return a.reshape(sb.S * sb.B, *a.shape[2:])[pick]

    def dealt(a):
        return a.reshape(steps, B, *a.shape[1:])

    out = StepBatch.__new__(StepBatch)
    out.bank, out.names, out.ids, out.second, out.K = sb.bank, sb.names, sb.ids, sb.second, sb.K
    out.S, out.B = steps, B
    out.idx = None  # shifted rounds are not rows of the bank
    out.acc, out.length, out.p_cal, out.p_forecast, out.oracle = {}, {}, {}, {}, {}
    for cid in sb.ids:
        if cid is None:
            continue
        acc, length = flat(sb.acc[cid]), flat(sb.length[cid])
        # accepted to the end of the recording's K (not cut short by its drafter): the span may go on
        goes_on = (acc == length) & (length == sb.K)
        mask = _shifted(flat(sb.oracle[cid]), t, length, np.where(goes_on, 1.0, np.nan))
        gone = acc < t  # its accepted prefix ended inside the committed tokens: it diverged
        if blank is not None:
            gone = gone | blank
        mask[gone] = np.nan
        out.oracle[cid] = dealt(mask)
        ok = np.nan_to_num(mask) == 1
        out.acc[cid] = dealt(np.cumprod(ok, axis=1).sum(axis=1))
        out.length[cid] = dealt((~np.isnan(mask)).sum(axis=1))
        p = sb.p_cal[cid]
        if p is not None:
            p = flat(p)
            p = _shifted(p, t, length, np.where(goes_on, _last_drafted(p, length), np.nan))
            p[gone] = np.nan
            p = dealt(p)
        out.p_cal[cid] = p
        out.p_forecast[cid] = None if sb.p_forecast[cid] is None else dealt(flat(sb.p_forecast[cid]))
    if sb.p_raw is not None:  # the primary chain's confidences, its last drafted one past the recording
        raw, length = flat(sb.p_raw), flat(sb.length[sb.ids[0]])
        raw = _shifted(raw, t, length, _last_drafted(raw, length))
        if blank is not None:
            raw[blank] = np.nan
        out.p_raw = dealt(raw)
    else:
        out.p_raw = None
    out.covered = rest  # the stretch each stands for: what is left of its round's (0: padding)
    out.cached = None if sb.cached is None else dealt(flat(sb.cached) + t)
    return out
