"""The step's price as this engine's clock says: a correction of the cost curve, learned from the steps it serves.

calib prices a step by a cost curve measured elsewhere (``serve.cost``: a profile's fit, calib/cost/step.py), on
another machine or day, by timers inside the step. On one AMD EPYC core at concurrency 16, served steps with a few
draft tokens cost 4-6 ms more per position than no speculation's (bench/serve.py's steady steps), where the curve
priced 2.8 ms, and even the clock oracle, verifying only accepted tokens, served 0.94x of no speculation
(docs/serving.md). The engine serving now is the answer, so :class:`StepClock` measures each pure decode step's wall
time (from one draft proposal to the next: the verify forward of the step's ``T`` positions, calib's decision, the
engine's bookkeeping; a model drafter's passes left out, they are priced apart) and fits, per batch (its size, and
whether it samples), the residual from the curve in the step's draft tokens ``x = T - B``::

    seconds - curve[T] = a + j * [x > 0] + b * x

``a`` the base the curve mispriced, ``j`` what a step pays once for verifying any draft token (the engine's
speculative path: the rejection sampler, the scheduler's and the output's bookkeeping of draft tokens), ``b`` per
draft token; by least squares over the batch's recent steps (each step's weight decays by ``decay`` per later step of
that batch), the curve's slope a ridge prior on ``b`` worth ``prior`` steps of one draft token (``j`` gets a ridge of
one step, :data:`JUMP_PRIOR`: it is learned where steps with and without draft tokens both occur, ``b`` from the steps
that verify draft tokens, ``a`` from all). The decision then reads
``curve[T] + a + j [T > B] + b (T - B)`` (:meth:`StepClock.price`). A batch that stops speculating keeps its ``j``
and ``b`` until its drafted steps decay below the prior, then drafts again by the curve's and re-learns them.

A batch that drafts every step never shows ``j``: ``a`` takes it whole, and the price of not speculating reads as
high as a drafted step's. On one AMD EPYC core shared with other work (chat at concurrency 16, greedy, the morning of
December 7) no speculation's steps took 82 ms where the curve priced 97 ms, and steps verifying 2-4 draft tokens
101-114 ms: calib, pricing the first draft token at a few ms, verified ~2.5 a step and served 0.86x of no speculation
(on the same machine alone, 1.03x: docs/serving.md, "December 7, later"). So where a batch has gone ``probe_every``
steps without one at no draft token, and its last decision expected to gain less than ``probe_gain`` (a share of the
step's goodput, :func:`predicted_gain`) over verifying nothing, :meth:`StepClock.probe` asks for one step without draft
tokens: what the clock needs to tell ``j`` from ``a``. Where drafting wins clearly (code edits: 2-3x the tokens a
step) it never asks. Engine-independent: no vLLM import.
"""

from __future__ import annotations

import math

import numpy as np
import torch

# a step's residual counts at most this share of the curve's price, either way: one step that waited on the host
# (a page fault, a collection) must not reprice the next hundred
MAX_RESIDUAL = 0.5
# the ridge on the jump j, in steps: enough to leave j at 0 where no step tells it from the base a
JUMP_PRIOR = 1.0
# the corrected price stays at least this share of the curve's (positive, as the allocator requires)
MIN_PRICE_SHARE = 0.05


def clock_key(temperatures) -> tuple:
    """What the clock keeps a batch's correction by: its size and whether any of its requests samples."""
    return (len(temperatures), any(t > 0 for t in temperatures))


class StepClock:
    """Per batch key: decayed sums over its steps (``z = [x > 0]``, ``x`` draft tokens, ``r`` seconds beyond the
    curve) of what the least squares of ``r`` on ``(1, z, x)`` needs, the fitted correction, and the corrected curve
    handed to the decider, rebuilt every ``refresh`` steps of that key once it has ``min_steps``.

    ``curve``: float ``[T_max + 1]`` serving's price of a step by its positions ``T`` (seconds, as
    :func:`calib.cost.serving.cost_curve` builds it)."""

    def __init__(self, curve, decay: float = 0.95, prior: float = 8.0, refresh: int = 4, min_steps: int = 4,
                 probe_every: int = 16, probe_gain: float = 0.25):
        self.curve = np.asarray(curve, dtype=np.float64)  # [T_max + 1]
        self.decay, self.prior, self.refresh, self.min_steps = float(decay), float(prior), int(refresh), int(min_steps)
        self.probe_every, self.probe_gain = int(probe_every), float(probe_gain)  # probe_every 0: never probe
        self.sums: dict[tuple, np.ndarray] = {}  # key -> [7] decayed sums of 1, z, x, x*x, r, z*r, x*r
        self.steps: dict[tuple, int] = {}  # key -> steps observed
        self.drafted_run: dict[tuple, int] = {}  # key -> steps observed since its last one at no draft token
        self.gain: dict[tuple, float] = {}  # key -> the last decision's predicted_gain
        # key -> (the base curve, float32 [T_max + 1] it corrected), while fresh
        self.curves: dict[tuple, tuple[np.ndarray, torch.Tensor]] = {}

    def observe(self, key: tuple, batch: int, positions: int, seconds: float, curve=None) -> bool:
        """Count one pure decode step of ``batch`` requests verifying ``positions`` in all, that took ``seconds``;
        False where it is not one the curve prices (no position past the curve, fewer positions than requests, a
        time that is not a positive number). ``curve``: float64 ``[T_max + 1]`` the step was priced by, where serving
        prices each step at its own context (:class:`calib.cost.serving.ContextCurves`; None: :attr:`curve`)."""
        curve = self.curve if curve is None else curve
        x = int(positions) - int(batch)
        if not (0 <= x and int(positions) < len(curve) and batch >= 1 and np.isfinite(seconds) and seconds > 0):
            return False
        price = float(curve[int(positions)])
        r = min(max(seconds - price, -MAX_RESIDUAL * price), MAX_RESIDUAL * price)  # scalars: no numpy call per step
        z = float(x > 0)
        sums = self.sums.get(key)
        if sums is None:
            sums = self.sums[key] = np.zeros(7)
        sums *= self.decay
        sums += (1.0, z, x, x * x, r, z * r, x * r)
        n = self.steps[key] = self.steps.get(key, 0) + 1
        self.drafted_run[key] = self.drafted_run.get(key, 0) + 1 if x > 0 else 0
        if n % self.refresh == 0:
            self.curves.pop(key, None)
        return True

    def correction(self, key: tuple) -> tuple[float, float, float]:
        """``(a, j, b)`` seconds: the batch's steps beyond the curve at no draft token, once for any, and per draft
        token (zeros for a key not observed): the ridge least squares of the module docstring."""
        sums = self.sums.get(key)
        if sums is None:
            return 0.0, 0.0, 0.0
        w, wz, wx, wxx, wr, wzr, wxr = sums
        # z*z = z and z*x = x: a step with draft tokens is one with z = 1. The jump's ridge is one step: where every
        # step drafts (or none), a and j cannot be told apart and j stays 0; the slope's is the prior.
        gram = np.array([[w, wz, wx], [wz, wz + JUMP_PRIOR, wx], [wx, wx, wxx + self.prior]])
        a, j, b = np.linalg.solve(gram, np.array([wr, wzr, wxr]))
        return float(a), float(j), float(b)

    def price(self, key: tuple, batch: int, curve=None) -> torch.Tensor | None:
        """The corrected curve for a step of this key, float32 ``[T_max + 1]`` (the same tensor until the key's next
        refresh or another ``curve``, so that what the decider derives from it is derived once), or None before
        ``min_steps`` steps. ``curve``: float64 ``[T_max + 1]`` this step's own price (None: :attr:`curve`)."""
        if self.steps.get(key, 0) < self.min_steps:
            return None
        base = self.curve if curve is None else curve
        held = self.curves.get(key)
        if held is None or held[0] is not base:
            a, j, b = self.correction(key)
            x = np.arange(len(base), dtype=np.float64) - batch
            corrected = np.maximum(base + a + j * (x > 0) + b * x, MIN_PRICE_SHARE * base)
            held = self.curves[key] = (base, torch.from_numpy(corrected.astype(np.float32)))
        return held[1]

    def forget(self) -> None:
        """Every batch's steps forgotten: the curve as given again (a bench's cells each start from the same state)."""
        for held in (self.sums, self.steps, self.drafted_run, self.gain, self.curves):
            held.clear()

    def note_gain(self, key: tuple, gain: float) -> None:
        """The goodput a decision for this key expected over verifying nothing (:func:`predicted_gain`)."""
        self.gain[key] = float(gain)

    def probe(self, key: tuple) -> bool:
        """Whether this key's next step should verify no draft token (module docstring): it has been timed
        ``min_steps`` times, its last ``probe_every`` timed steps all verified draft tokens, and its last decision
        expected less than ``probe_gain`` from them. True restarts the count: one probe, then ``probe_every`` steps."""
        if (self.probe_every <= 0 or self.steps.get(key, 0) < self.min_steps
                or self.drafted_run.get(key, 0) < self.probe_every
                or not self.gain.get(key, math.inf) < self.probe_gain):
            return False
        self.drafted_run[key] = 0
        return True

    def summary(self, key: tuple) -> list[float]:
        """``[a, j, b]`` in milliseconds and the key's steps: what the serving statistics keep per batch."""
        return [*(round(v * 1e3, 3) for v in self.correction(key)), self.steps.get(key, 0)]


def predicted_gain(price, batch: int, depth, expected_accepted) -> float:
    """The share of goodput a decision expects beyond verifying nothing: ``(B + Σ accepted) / price[B + Σ depth]``
    over ``B / price[B]``, less one. ``price``: float ``[T_max + 1]`` the decision read (numpy or a CPU tensor);
    ``depth`` int ``[B]``; ``expected_accepted`` float ``[B]`` (NaN, a request not decided, counts 0)."""
    price = np.asarray(price)  # a view of a CPU tensor: two entries are read, no copy of the curve
    verified = int(np.sum(depth))
    if verified <= 0 or batch + verified >= len(price):
        return 0.0
    accepted = float(np.nansum(np.asarray(expected_accepted, dtype=np.float64)))
    return (batch + accepted) / float(price[batch + verified]) * float(price[batch]) / batch - 1.0
