"""When calib stands aside: stretches of steps on which deciding would change nothing.

Inside vLLM's step calib's decision costs time (docs/profile.md); on many steps it hands back exactly what
vLLM proposed (the n-gram engine at low concurrency: every chain verified whole), or nothing at all (high
concurrency under sampling: the tables price every draft token above its expected gain, so no speculation is
the step's best). :class:`StandAside` notices such a stretch and skips the decision for a while:

* after ``after`` consecutive decided steps with the same batch (its size and temperatures: what the price
  of a draft token turns on) whose decision was of one kind, ``"engine"`` (vLLM's own lists, unchanged) or
  ``"none"`` (vLLM proposed draft tokens and calib verified none; a step without any proposal counts for
  neither), the next steps of that batch take that kind without a decision:
  vLLM's proposal handed through untouched, or no draft tokens scheduled (with a model drafter: no draft
  pass planned either);
* every ``every``-th step of the stretch is decided again, and any other batch, or a decision of another
  kind, ends the stretch at once.

A stretch of vLLM's own lists begins only where handing them through unchecked can cost little
(:func:`proposal_price`): where vLLM's whole proposal adds at most ``engine_price`` (knob ``aside_engine_price``) to
the price of a step verifying none. A streak of whole chains says the drafts were good lately, not that they stay
so, and in a batch a token the decision would have cut costs more than deciding (one EPYC core, c = 4: a draft
token ~4-6 ms of an ~85-ms step, a decision ~1 ms). At code edits c = 4 greedy calib on the n-gram engine stood
aside on 18 of 51 steps and verified 9.25 draft tokens a step; deciding every step of the batch, 7.4-8.2 for about
the same accepted (6.6-7.0 against 6.9; docs/serving.md, "December 7, late night"). A single request's step prices
its whole proposal at -9 to +24 % on the CPUs profiled and stands aside as before, a batch of 3 or more at +44 to
+300 %.

A skipped step costs a dictionary lookup. What it gives up: a request that joins a batch of the same size and
temperatures mid-stretch is decided at the next re-check, up to ``every - 1`` steps later; the online
correction learns nothing from a skipped step (the history context counts the rounds of a step handed through, none
on a step without draft tokens). Serving logs one line when a
stretch of each kind first begins, and counts the skipped steps (:class:`calib.vllm.server.ServeStats`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

log = logging.getLogger("calib.serve")

KINDS = ("engine", "none")  # vLLM's own lists handed through; no draft tokens
# A step on which vLLM proposed no draft token at all (no n-gram match anywhere): calib's decision is empty
# whatever it would decide, so the step neither extends nor ends a stretch. Counted as "none", chat at
# concurrency 1 (no match on ~40 % of steps) stood aside with "none" and dropped the matches that followed.
EMPTY = "empty"


def batch_key(temperatures: Sequence[float]) -> tuple:
    """What a stretch is kept for: the batch size and its temperatures (sorted, rounded: the tables' axis)."""
    return (len(temperatures), tuple(sorted(round(float(t), 3) for t in temperatures)))


def decision_kind(drafts: Sequence[Sequence[int]], engine: Sequence[Sequence[int]],
                  planned_passes: int | None = None, k: int | None = None) -> str | None:
    """:data:`EMPTY` when vLLM proposed nothing, ``"none"`` when nothing is verified, ``"engine"`` when every
    list is vLLM's own, else None. ``planned_passes``: the model-drafter passes calib's plan ran this step (None: it
    set none). Where it ran none, vLLM proposed nothing because calib said so: the step is calib's own decision
    (``"none"``, or None where it verified another chain's tokens), never :data:`EMPTY`, which would keep an
    ``"engine"`` stretch, and with it vLLM's K passes, alive through every re-check. Nor is a step whose plan ran
    fewer than ``k`` (vLLM's K) passes ``"engine"`` when calib kept vLLM's lists: they were the plan's, and a stretch
    would hand back vLLM's K passes instead (chat c = 1 greedy: 154 of 272 steps so, 0.90×)."""
    if not any(engine):
        if planned_passes == 0:
            return None if any(drafts) else "none"
        return EMPTY
    if not any(drafts):
        return "none"
    if all(list(x) == list(e) for x, e in zip(drafts, engine)):
        planned_fewer = planned_passes is not None and k is not None and planned_passes < k
        return None if planned_fewer else "engine"
    return None


def proposal_price(price, batch: int, k: int) -> float:
    """What vLLM's whole proposal at its longest, ``k`` draft tokens for each of ``batch`` requests, adds to the price
    of the step verifying none, relative: ``price[B·(k+1)] / price[B] − 1``. ``price``: float ``[T_max + 1]`` the
    decision read (numpy or a CPU tensor; a longer proposal than it spans is read at its end)."""
    price = np.asarray(price)  # a view of a CPU tensor: two entries are read
    base = float(price[min(batch, len(price) - 1)])
    return float(price[min(batch * (k + 1), len(price) - 1)]) / base - 1.0 if base > 0 else float("inf")


@dataclass
class StandAside:
    """The stretch in progress (see the module docstring); ``after = 0`` never stands aside."""

    after: int = 4  # consecutive decided steps of one kind and batch before standing aside
    every: int = 16  # while aside, every every-th step is decided again
    engine_price: float = 0.3  # the most vLLM's whole proposal may add to a step's price for a stretch of its lists
    key: tuple | None = field(default=None, init=False)  # the batch of the current streak
    kind: str | None = field(default=None, init=False)  # its decisions' kind
    streak: int = field(default=0, init=False)  # consecutive decided steps of that batch and kind
    skipped: int = field(default=0, init=False)  # steps skipped since the last decided one
    began: set = field(default_factory=set, init=False)  # kinds whose first stretch has begun (logged once)
    costly: set = field(default_factory=set, init=False)  # batch sizes whose proposal was too costly (logged once)

    def __post_init__(self):
        if int(self.after) < 0 or int(self.every) < 1 or not float(self.engine_price) >= 0:
            raise ValueError(f"stand-aside needs after >= 0, every >= 1 and engine_price >= 0, got after={self.after}, "
                             f"every={self.every}, engine_price={self.engine_price}")

    def kind_of(self, drafts: Sequence[Sequence[int]], engine: Sequence[Sequence[int]], planned_passes: int | None,
                k: int, price) -> str | None:
        """A decided step's kind for :meth:`record` (:func:`decision_kind`); vLLM's own lists (``"engine"``) count
        only where handing them through unchecked would cost little (:meth:`engine_pays`), else None: decide every
        step where a token the decision would have cut costs more than deciding."""
        kind = decision_kind(drafts, engine, planned_passes, k)
        if kind == "engine" and price is not None and not self.engine_pays(price, len(engine), k):
            return None
        return kind

    def engine_pays(self, price, batch: int, k: int) -> bool:
        """Whether a stretch of vLLM's own lists may begin at this batch: its whole proposal adds at most
        ``engine_price`` to the step's price (:func:`proposal_price`); one log line per batch size where not."""
        if proposal_price(price, batch, k) <= self.engine_price:
            return True
        if batch not in self.costly:
            self.costly.add(batch)
            log.info("calib serve: deciding every step at batch %d, even where it keeps vLLM's drafts whole: their "
                     "whole proposal would add more than %.0f%% to the step's price unchecked (knob "
                     "aside_engine_price)", batch, 100 * self.engine_price)
        return False

    def forget(self) -> None:
        """End the stretch in progress (between a bench's cells; the kinds already logged stay logged)."""
        self.key, self.kind, self.streak, self.skipped = None, None, 0, 0

    def verdict(self, key: tuple) -> str | None:
        """The kind this step takes without a decision, or None (decide). Counts the step when skipped."""
        if not self.after or self.kind is None or key != self.key or self.streak < self.after:
            return None
        if self.skipped + 1 >= self.every:  # the stretch's re-check
            return None
        self.skipped += 1
        return self.kind

    def record(self, key: tuple, kind: str | None) -> bool:
        """A decided step of batch ``key`` and decision ``kind``; True when a stretch of that kind begins for
        the first time in this process (the caller logs it). An :data:`EMPTY` step says nothing of either kind:
        the streak stands as it was."""
        self.skipped = 0
        if kind == EMPTY:
            return False
        if kind is None or key != self.key or kind != self.kind:
            self.key, self.kind, self.streak = key, kind, (1 if kind is not None else 0)
            return False
        self.streak += 1
        if self.streak == self.after and kind not in self.began:
            self.began.add(kind)
            return True
        return False
