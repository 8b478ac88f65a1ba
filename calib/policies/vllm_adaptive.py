"""``vllm_adaptive``: vLLM 0.32 Model Runner V2 adaptive verification, re-implemented for the replay.

What was followed in vLLM (file and line) and where the replay differs, and why: docs/policies.md.
"""

from __future__ import annotations

import numpy as np

from calib.policies.base import Policy, PolicyResult, register_policy
from calib.policies.setting import Setting, committed

MAX_LOG_ODDS = 40.0  # acceptance_estimator.py:13
INIT_SLOPE = 0.5  # acceptance_estimator.py:19
INIT_BIAS = -0.2  # acceptance_estimator.py:20


def log_odds_feature(conf: np.ndarray) -> np.ndarray:
    """``clamp(log(q / (1 - q)), ±40)`` (``_predict_kernel``, acceptance_estimator.py:280-302); NaN -> 0."""
    q = np.asarray(conf, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        f = np.log(q) - np.log1p(-q)
    return np.where(np.isnan(q), 0.0, np.clip(np.nan_to_num(f, nan=0.0), -MAX_LOG_ODDS, MAX_LOG_ODDS))


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * x))


class OnlineAcceptanceEstimator:
    """vLLM's ``OnlineAcceptanceEstimator`` (acceptance_estimator.py:313-502) over ``num_slots`` request slots.

    Per engine step: :meth:`predict` (this step's drafts, current coefficients) then, once the drafts are
    verified, :meth:`step` (accumulate; every ``REFIT_INTERVAL``-th call, one damped Newton step).
    """

    REFIT_INTERVAL = 100  # acceptance_estimator.py:330
    DAMPING_OBSERVATIONS = 50.0  # :336
    L2 = 1e-3  # :338

    def __init__(self, num_slots: int, num_speculative_steps: int):
        K = num_speculative_steps
        self.num_speculative_steps = K
        self.steps_since_refit = 0
        self.refits = 0
        self.slope = INIT_SLOPE
        self.intercepts = np.full(K, INIT_BIAS)
        self.features = np.zeros((num_slots, K))
        self.predictions = np.zeros((num_slots, K))
        self.info = np.zeros((K, 3))  # [a_k, b_k, c_k] of XᵀWX
        self.grad = np.zeros((K, 2))  # [g0_k, g1_k] of Xᵀ(y - p)
        self.counts = np.zeros(K)

    def predict(self, conf: np.ndarray) -> np.ndarray:
        """Acceptance probabilities [slots, K] of drafts whose drafter confidences are ``conf`` [slots, K];
        stores features and predictions for :meth:`step` (``_predict_kernel``)."""
        self.features = log_odds_feature(conf)
        self.predictions = _sigmoid(self.slope * self.features + self.intercepts[None, :])
        return self.predictions.copy()

    def step(self, num_sampled: np.ndarray, num_rejected: np.ndarray) -> None:
        """Fold the verdict on the last predicted drafts into the statistics (``_accumulate_kernel``) and
        refit every ``REFIT_INTERVAL`` calls (``step``, acceptance_estimator.py:405-449).

        ``num_sampled`` [slots]: tokens the verify pass emitted (accepted drafts + 1 bonus; 0 for a slot not
        sampled); ``num_rejected`` [slots]: verified drafts that were not accepted."""
        num_sampled = np.asarray(num_sampled, dtype=np.int64)
        num_accepted = np.maximum(num_sampled - 1, 0)[:, None]
        num_admitted = num_accepted + np.asarray(num_rejected, dtype=np.int64)[:, None]
        k = np.arange(self.num_speculative_steps)[None, :]
        observed = (k <= num_accepted) & (k < num_admitted)
        label = (k < num_accepted).astype(np.float64)
        pred, f = self.predictions, self.features
        w = np.where(observed, pred * (1.0 - pred), 0.0)
        resid = np.where(observed, label - pred, 0.0)
        self.info[:, 0] += (w * f * f).sum(axis=0)
        self.info[:, 1] += (w * f).sum(axis=0)
        self.info[:, 2] += w.sum(axis=0)
        self.grad[:, 0] += (resid * f).sum(axis=0)
        self.grad[:, 1] += resid.sum(axis=0)
        self.counts += observed.sum(axis=0)

        self.steps_since_refit += 1
        if self.steps_since_refit < self.REFIT_INTERVAL:
            return
        self.steps_since_refit = 0
        self._refit()
        self.refits += 1

    def _refit(self) -> None:
        """One damped Newton step on the round's statistics, then clear them (``_refit_kernel``)."""
        L2, D = self.L2, self.DAMPING_OBSERVATIONS
        a_k, b_k = self.info[:, 0], self.info[:, 1]
        c_k = self.info[:, 2] + L2
        a = a_k.sum() + L2
        g0 = self.grad[:, 0].sum()
        g1_k = self.grad[:, 1]
        n = self.counts
        with np.errstate(divide="ignore", invalid="ignore"):
            step_w = (g0 - (b_k * g1_k / c_k).sum()) / (a - (b_k * b_k / c_k).sum())
            total_n = n.sum()
            step_w *= total_n / (total_n + D)
            if np.isnan(step_w) or not self.slope + step_w >= 0.0:
                step_w = 0.0
            self.slope = float(self.slope + step_w)
            step_bias = (g1_k - b_k * step_w) / c_k
            step_bias *= n / (n + D)
        step_bias = np.where(np.isnan(step_bias), 0.0, step_bias)
        self.intercepts = self.intercepts + step_bias
        self.info[:] = 0.0
        self.grad[:] = 0.0
        self.counts[:] = 0.0


def build_cost_tables(draft_curve, verify_curve, max_num_reqs: int, max_batch_tokens: int,
                      cudagraph_limit: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``build_cost_tables_from_curves`` (adaptive_verification.py:80-128): (size, cost) samples ->
    ``draft_table[0..max_num_reqs]``, ``verify_table[0..max_batch_tokens]``."""

    def build_table(limit: int, curve) -> np.ndarray:
        xs, ys = np.asarray(curve, dtype=np.float64).T
        ys = np.maximum.accumulate(ys)
        values = np.arange(limit + 1)
        idx = np.searchsorted(xs, values, side="left")
        result = ys[np.minimum(idx, len(xs) - 1)]
        if cudagraph_limit:
            smooth = values > cudagraph_limit
            above = xs > cudagraph_limit
            if smooth.any() and above.any():
                result[smooth] = np.interp(values[smooth], xs[above], ys[above])
        if len(xs) > 1:
            after = values > xs[-1]
            slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
            result[after] = ys[-1] + slope * (values[after] - xs[-1])
        return result

    draft_table = np.maximum(build_table(max_num_reqs, draft_curve), 0.0)
    verify_table = np.maximum(build_table(max_batch_tokens, verify_curve), 1e-6)
    return draft_table, verify_table


def draft_budget(stale_conf: np.ndarray, scheduled_drafts: np.ndarray, draft_cost: float,
                 verify_table: np.ndarray, num_non_draft_tokens: int | None = None,
                 num_sampling_requests: int | None = None, max_total_logits: int | None = None,
                 num_bonus_tokens: int = 1) -> int:
    """The batch's draft budget (``get_num_tokens``, adaptive_verification.py:282-350).

    ``stale_conf`` [reqs, K]: the confidences the budget reads (the previous step's); ``scheduled_drafts``
    [reqs]; ``draft_cost`` = ``draft_table[num_reqs]``; ``num_non_draft_tokens`` and
    ``num_sampling_requests`` default to one per request (every request decoding);
    ``max_total_logits`` None = not binding."""
    stale_conf = np.asarray(stale_conf)
    num_reqs, K = stale_conf.shape
    scheduled_drafts = np.asarray(scheduled_drafts, dtype=np.int64)
    nd = num_reqs if num_non_draft_tokens is None else int(num_non_draft_tokens)
    n_sampling = num_reqs if num_sampling_requests is None else int(num_sampling_requests)
    survival = np.cumprod(stale_conf.astype(np.float64), axis=1)
    valid = np.arange(K)[None, :] < scheduled_drafts[:, None]
    scores = np.sort(survival[valid])[::-1]
    max_budget = int(scheduled_drafts.sum())
    if max_total_logits is not None:
        max_budget = min(max_budget, max(0, max_total_logits - num_reqs * num_bonus_tokens))
    scores = scores[:max_budget]
    expected = np.concatenate(([n_sampling], n_sampling + np.cumsum(scores)))
    costs = draft_cost + verify_table[nd: nd + max_budget + 1]
    return int(np.argmax(expected / costs))


def assign_drafts(conf: np.ndarray, scheduled_drafts: np.ndarray, budget: int) -> np.ndarray:
    """Verified drafts per request [reqs] (``reallocate_drafts`` + ``_assign_draft_token_budget``,
    adaptive_verification.py:392-447, 46-72): the global top-``budget`` slots by survival."""
    scheduled_drafts = np.asarray(scheduled_drafts, dtype=np.int64)
    if budget == 0:
        return np.zeros_like(scheduled_drafts)
    if budget >= int(scheduled_drafts.sum()):
        return scheduled_drafts.copy()
    conf = np.asarray(conf, dtype=np.float32)
    survival = np.cumprod(conf, axis=1, dtype=np.float32)
    out_of_range = np.arange(conf.shape[1])[None, :] >= scheduled_drafts[:, None]
    flat = np.where(out_of_range, -np.inf, survival).ravel()
    winners = np.argsort(-flat, kind="stable")[:budget]
    admitted = np.zeros(flat.shape, dtype=bool)
    admitted[winners] = True
    return admitted.reshape(conf.shape).sum(axis=1).astype(np.int64)


def adaptive_replay(p_raw: np.ndarray, accepted: np.ndarray, scheduled: np.ndarray, draft_cost: float,
                    verify_table: np.ndarray, est: OnlineAcceptanceEstimator | None = None,
                    stale: np.ndarray | None = None) -> tuple[np.ndarray, dict]:
    """vLLM adaptive verification over a stream of steps: verified depth [S, B] and a summary.

    ``p_raw`` [S, B, K] the drafter's confidences; ``accepted`` [S, B] accepted prefix length of each
    lane's chain; ``scheduled`` [S, B] drafted tokens; ``draft_cost`` the drafting term of the budget's
    cost; ``verify_table[T]`` the verify cost of ``T`` positions. Step ``s`` uses only outcomes of steps
    ``< s`` (the estimator) and predictions of steps ``<= s``. ``est`` and ``stale`` [B, K] (the confidences
    the first step's budget reads): a stream that goes on from earlier steps (the lane replay's); else fresh.
    The summary's ``stale`` is what the next step's budget would read.
    """
    S, B, K = p_raw.shape
    est = OnlineAcceptanceEstimator(B, K) if est is None else est
    stale = np.ones((B, K)) if stale is None else stale  # add_request: a new request's stale row is 1.0
    depth = np.zeros((S, B), np.int64)
    budgets = np.zeros(S, np.int64)
    for s in range(S):
        conf = est.predict(p_raw[s])  # drafting D_s: coefficients fitted on outcomes of steps < s
        budgets[s] = draft_budget(stale, scheduled[s], draft_cost, verify_table)
        depth[s] = assign_drafts(conf, scheduled[s], int(budgets[s]))
        n_acc = np.minimum(accepted[s], depth[s])
        est.step(num_sampled=n_acc + 1, num_rejected=depth[s] - n_acc)  # observe_verification
        stale = conf  # record_confidences: what the next step's budget reads
    return depth, {"refits": est.refits, "slope": est.slope, "intercepts": est.intercepts.copy(),
                   "budgets": budgets, "stale": stale}


def vllm_adaptive(s: Setting) -> PolicyResult | None:
    sb = s.sb
    if sb.p_raw is None:
        return None
    B, K = s.B, s.K
    t_max = min(len(s.curve.values) - 1, B * (K + 1))
    verify_points = [(t, float(s.curve.values[t])) for t in range(1, t_max + 1)]
    draft_table, verify_table = build_cost_tables([(B, s.sunk)], verify_points, B, t_max)
    scheduled = np.minimum(sb.length[s.P], K)
    lanes = s.lanes  # replayed a step at a time (calib.evaluate.replay.lanes): the estimator goes on across calls
    if lanes is None:
        depth, info = adaptive_replay(sb.p_raw, sb.acc[s.P], scheduled, float(draft_table[B]), verify_table)
    else:
        est = lanes.memory.setdefault("estimator", OnlineAcceptanceEstimator(B, K))
        stale_all = lanes.memory.setdefault("stale", np.ones((lanes.count, K)))  # [lanes, K]
        stale = np.where(lanes.fresh[:, None], 1.0, stale_all[lanes.index])  # add_request: a new request's row
        depth, info = adaptive_replay(sb.p_raw, sb.acc[s.P], scheduled, float(draft_table[B]), verify_table,
                                      est, stale)
        stale_all[lanes.index] = info["stale"]
    tokens = committed(sb, s.one, depth)
    cost = s.curve.charge(depth) + s.sunk
    return PolicyResult(tokens, cost, depth.sum(axis=1), {
        "refits": info["refits"],
        "budget_share": float(info["budgets"].sum() / max(scheduled.sum(), 1))})


register_policy(Policy(
    "vllm_adaptive", 45, "tab:orange", "vLLM 0.32 adaptive verification: online logistic estimator on the drafter's "
    "raw confidences (shared slope, per-position intercepts, IRLS refit every 100 steps), batch draft budget by "
    "expected-tokens/cost on the previous step's confidences, global top-k of survival; pays K draft passes",
    vllm_adaptive, stateful=True,
    below_no_spec="drafts every request's full chain before trimming (K draft passes), and serves mostly on its "
                  "cold-start coefficients (a setting's stream is shorter than a few refits)"))
