"""Replay a setting as the bench serves it (``replay.lanes``): B clients, each following its request through the text.

The dealt replay (:func:`calib.evaluate.replay.draw_steps`) deals recorded rounds to steps at random and counts each
for the stretch of text it covered. A round's stretch starts where the *collecting* engine's previous round ended;
a policy that commits more or less than the collector lands elsewhere, and counting its rate at the collector's
starting points is biased wherever the rate changes along the text (at the end of a copied span, a policy starting
a token before the end commits 2 where one in step with its own rounds committed 5). Here instead:

* the setting's prompts form a queue in collection order (bench/serve.py's cell serves the same ones, in that
  order, from the top again where its category holds fewer than the cell serves: :func:`served_order`), and each of
  B lanes takes the next prompt when its request is done, as the bench's B clients do;
* a lane at text position ``x`` of its request serves the recorded round whose stretch holds ``x``, read from
  ``x`` on (:func:`calib.evaluate.replay.redecide.shifted_batch`: every chain shifted by ``x`` minus the round's
  start), or, between rounds, a step without a draft (a model-free drafter found no match there);
* each step the policy decides on the lanes' rounds at once, on the cost curve of the lanes in flight, and each lane
  moves on by what it committed; a request is done at the end of its recorded text.

A round's position is its context length (``cached``); banks that record none, or whose rounds overlap, are
replayed dealt (None here). The totals count the *steady* steps, every lane busy (the bench's steady decode state),
where the queue fills all B lanes at first; else every step. Stateful policies (:attr:`Policy.stateful`: an estimator
that learns across steps) keep what they learn in the run's :class:`LaneStep` memory from one step to the next.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, replace

import numpy as np

from calib.evaluate.replay.redecide import shifted_batch
from calib.policies.setting import Setting, StepBatch


@dataclass
class Requests:
    """The setting's requests in queue order: per request, its rounds' positions in ``base`` (a one-step
    :class:`StepBatch` over every row of the setting) and text offsets, and where its text ends."""

    base: StepBatch
    rounds: list[np.ndarray]  # per request [n_r] positions in base's rows, in text order
    start: list[np.ndarray]  # per request [n_r] each round's text offset (its context length)
    covered: list[np.ndarray]  # per request [n_r] each round's stretch
    end: np.ndarray  # [n_requests] where each request's recorded text ends


def requests_of(bank, rows: np.ndarray) -> Requests | None:
    """The requests of a setting's ``rows`` of ``bank`` (drafted rounds only: undrafted ones are the gaps), or None
    where the bank records no context length or a request's rounds overlap."""
    if bank.cached is None:
        return None
    drafted = rows[bank.chains[bank.primary].length[rows] > 0]
    if drafted.size == 0:
        return None
    base = StepBatch(bank, drafted, np.arange(drafted.size)[None, :])
    pos = bank.cached[drafted].astype(np.int64)
    covered = base.covered[0]
    out_rounds, out_start, out_cov, ends = [], [], [], []
    for prompt in np.unique(bank.prompt_idx[drafted]):  # sorted: the collection's order
        mine = np.flatnonzero(bank.prompt_idx[drafted] == prompt)
        mine = mine[np.argsort(pos[mine], kind="stable")]
        x, c = pos[mine], covered[mine]
        if np.any(x[1:] < x[:-1] + c[:-1]):
            return None  # rounds that overlap: more than one request under this prompt, or a broken bank
        out_rounds.append(mine)
        out_start.append(x)
        out_cov.append(c)
        ends.append(int(x[-1] + c[-1]))
    return Requests(base, out_rounds, out_start, out_cov, np.asarray(ends))


@dataclass
class LaneStep:
    """What a step of a lane run tells a stateful policy (``Setting.lanes``): ``index`` [m] the lane of each row,
    ``fresh`` [m] whether its request is new this step, ``count`` the lanes, ``memory`` kept across the run."""

    index: np.ndarray  # [m]
    fresh: np.ndarray  # [m] bool
    count: int
    memory: dict


def _at(req: Requests, r: int, x: int) -> tuple[int, int, int, bool]:
    """What request ``r`` serves at text position ``x``: (its round's position in ``req.base``, the shift into it, the
    stretch left, whether ``x`` lies between rounds: a step without a draft)."""
    j = int(np.searchsorted(req.start[r], x, side="right")) - 1
    inside = j >= 0 and x < req.start[r][j] + req.covered[r][j]
    j = max(j, 0)
    if not inside:
        return int(req.rounds[r][j]), 0, 1, True
    return int(req.rounds[r][j]), x - int(req.start[r][j]), int(req.start[r][j] + req.covered[r][j]) - x, False


def _served(req: Requests, at: list[tuple[int, int, int, bool]], x: list[int], shape: tuple[int, int]) -> StepBatch:
    """The :class:`StepBatch` of ``shape`` [S, B] of the rounds ``at`` (:func:`_at`) served at positions ``x``."""
    pick, shift, rest, blank = (np.asarray(v) for v in zip(*at))
    sb = shifted_batch(req.base, pick, shift.astype(np.int64), rest.astype(np.int64).reshape(shape), blank)
    if sb.cached is not None:  # each lane's context is its position in the text
        sb.cached = np.asarray(x, dtype=sb.cached.dtype).reshape(shape)
    return sb


def run_lanes(req: Requests, B: int, name: str, compute, curve, cfg, train_curve, stateful: bool = False) -> dict:
    """Totals (as :func:`calib.evaluate.replay.summarise` writes them) of row ``name`` served on ``B`` lanes;
    ``compute(policy_setting) -> {row: PolicyResult}`` runs its policy on a setting (a step policy decides each of
    its steps alone, a ``stateful`` one reads ``Setting.lanes``), ``curve`` the unbatched cost curve. The row's
    extras (a policy's per-setting figures) are the caller's to add."""
    step_cfg = replace(cfg, weighting="rounds")  # a lane's step writes what it commits: no stretch to weigh
    if B == 1 and not stateful:
        return _one_lane(req, name, compute, curve, step_cfg, train_curve)
    return _lanes(req, B, name, compute, curve, step_cfg, train_curve)


def served_order(n: int, B: int, cell_prompts: tuple[int, int] | None) -> list[int]:
    """The setting's ``n`` requests in the order the bench's cell at concurrency ``B`` serves them: each once, or
    with ``cell_prompts`` = ``(min, per_request)`` ``max(min, per_request · B)`` of them, from the top again where ``n``
    is fewer (bench.lib.serve_arms.cell_prompts: at c = 64 a 60-prompt category serves 128 requests, so that its 64
    clients stay busy for a while, the steady state the clock's prediction basis measures)."""
    if cell_prompts is None or n == 0:
        return list(range(n))
    low, per_request = cell_prompts
    return [i % n for i in range(max(n, low, per_request * B))]


def _lanes(req: Requests, B: int, name: str, compute, curve, step_cfg, train_curve) -> dict:
    """:func:`run_lanes`, a step at a time."""
    memory: dict = {}
    queue = deque(served_order(len(req.rounds), B, step_cfg.cell_prompts))
    steady_possible = len(queue) >= B
    lane_req = [queue.popleft() if queue else -1 for _ in range(B)]
    x = [int(req.start[r][0]) if r >= 0 else 0 for r in lane_req]
    tot = dict.fromkeys(("tokens", "cost", "positions", "steps"), 0.0)
    every = dict(tot)
    fresh = [True] * B  # each lane's request is new at its first step
    while any(r >= 0 for r in lane_req):
        busy = [b for b in range(B) if lane_req[b] >= 0]
        m = len(busy)
        sb = _served(req, [_at(req, lane_req[b], x[b]) for b in busy], [x[b] for b in busy], (1, m))
        setting = Setting(sb, curve.for_batch(m).with_context(sb.cached), step_cfg, train_curve)
        setting.lanes = LaneStep(np.asarray(busy), np.asarray([fresh[b] for b in busy]), B, memory)
        fresh = [False] * B
        tok, cost, pos, _ = compute(setting)[name]
        done = np.minimum(tok[0], [req.end[lane_req[b]] - x[b] for b in busy])
        for acc in ((tot,) if (m == B and steady_possible) else ()) + (every,):
            acc["tokens"] += float(done.sum())
            acc["cost"] += float(cost[0])
            acc["positions"] += float(pos[0])
            acc["steps"] += 1.0
        for i, b in enumerate(busy):
            x[b] += int(done[i])
            if x[b] >= req.end[lane_req[b]]:
                lane_req[b] = queue.popleft() if queue else -1
                if lane_req[b] >= 0:
                    x[b] = int(req.start[lane_req[b]][0])
                    fresh[b] = True
    out = tot if tot["steps"] > 0 else every
    return {**out, "rounds": out["steps"] * B}


def _one_lane(req: Requests, name: str, compute, curve, step_cfg, train_curve) -> dict:
    """:func:`run_lanes` at B = 1: one request at a time, so the requests are independent and their steps are
    decided together, each request's next step as one row of a setting of batch 1 (the same decisions as one lane
    taking them in turn, in far fewer calls). Every step is steady. Each request is served once: where a category holds
    fewer prompts than the bench's cell at c = 1 serves (``cell_prompts``' minimum), the bench serves its first ones
    twice and :func:`served_order` would too; here they are not weighed twice."""
    x = [int(s[0]) for s in req.start]
    live = list(range(len(req.rounds)))
    tot = dict.fromkeys(("tokens", "cost", "positions", "steps"), 0.0)
    b_curve = curve.for_batch(1)
    while live:
        sb = _served(req, [_at(req, r, x[r]) for r in live], [x[r] for r in live], (len(live), 1))
        tok, cost, pos, _ = compute(Setting(sb, b_curve.with_context(sb.cached), step_cfg, train_curve))[name]
        done = np.minimum(tok[:, 0], [req.end[r] - x[r] for r in live])
        tot["tokens"] += float(done.sum())
        tot["cost"] += float(np.sum(cost))
        tot["positions"] += float(np.sum(pos))
        tot["steps"] += float(len(live))
        for i, r in enumerate(live):
            x[r] += int(done[i])
        live = [r for r in live if x[r] < req.end[r]]
    return {**tot, "rounds": tot["steps"]}
