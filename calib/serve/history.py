"""What the engine knows about each running request before a round: the history context axes.

:class:`RequestHistory` holds, per request id, the running values of the context axes that come
from the request's earlier rounds (:data:`calib.labels.HISTORY_COLUMNS`): ``prev_accept``,
``mean_accept`` and ``position``. Their definitions are those of
:func:`calib.labels.request_history` (one definition; ``tests/serve/test_history.py`` feeds the
same rounds through both and gets identical values):

* ``prev_accept``: the accepted length of the request's previous round; NaN in its first round;
* ``mean_accept``: the mean accepted length over its earlier rounds; NaN in its first round;
* ``position``: the tokens its earlier rounds emitted, ``accepted + 1`` each; 0 in its first round.

A *round* is what the bank records as one (:mod:`calib.vllm.capture`): a verify step in which the
request had at least one draft token. A step in which the request verified no draft token (no
n-gram match, or calib chose ``[]``) is not a round of the bank, so :meth:`RequestHistory.observe`
with ``drafted=0`` leaves the history unchanged. Nor is the token sampled at prefill counted: the
tables were fitted on these values, so the engine must pass the same, not its own output length.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from calib.labels import HISTORY_COLUMNS


@dataclass
class _State:
    rounds: int = 0  # rounds observed (verify steps with >= 1 draft token)
    accepted: int = 0  # accepted draft tokens over them
    last: int = -1  # accepted length of the latest round


class RequestHistory:
    """Per-request history context, keyed by the engine's request id.

    ``observe(req_id, accepted, drafted)`` after each verify step, ``finish(req_id)`` when the request
    ends (finished, aborted, preempted for good); ``values(req_ids)`` before a decision.
    """

    def __init__(self) -> None:
        self._state: dict[str, _State] = {}
        # the last values() read and the state it read (a step reads them for its plan, its decision and its
        # online bookkeeping, all before its outcome changes them): (changes seen, req ids, every column)
        self._changes = 0  # observe / finish calls that may have changed a state
        self._read: tuple | None = None

    def __len__(self) -> int:
        return len(self._state)

    def __contains__(self, req_id) -> bool:
        return req_id in self._state

    def observe(self, req_id: str, accepted: int, drafted: int | None = None) -> None:
        """Record one verify step of ``req_id``: ``accepted`` draft tokens accepted out of ``drafted``
        (None: at least one, i.e. a round). ``drafted == 0`` is no round and changes nothing."""
        if isinstance(accepted, bool) or int(accepted) != accepted or accepted < 0:
            raise ValueError(f"request {req_id!r}: accepted must be an integer >= 0, got {accepted!r}")
        if drafted is not None:
            if drafted == 0:
                return
            if accepted > drafted:
                raise ValueError(f"request {req_id!r}: accepted={accepted} > drafted={drafted}")
        self._changes += 1
        s = self._state.setdefault(req_id, _State())
        s.rounds += 1
        s.accepted += int(accepted)
        s.last = int(accepted)

    def observe_rounds(self, req_ids: Sequence[str], accepted: Sequence[int]) -> None:
        """:meth:`observe` of one round per request (``drafted >= 1`` each), ``accepted`` ints already checked
        (``0 <= accepted <= drafted``): a step's verified requests in one pass."""
        self._changes += 1
        state = self._state
        for r, a in zip(req_ids, accepted):
            s = state.get(r)
            if s is None:
                s = state[r] = _State()
            s.rounds += 1
            s.accepted += a
            s.last = a

    def finish(self, req_id: str) -> None:
        """Forget ``req_id`` (a later request with the same id starts afresh). Unknown ids are fine."""
        self._changes += 1
        self._state.pop(req_id, None)

    def context(self, req_id: str) -> dict[str, float]:
        """``{prev_accept, mean_accept, position}`` of ``req_id`` before its next round (a request never
        observed is in its first round)."""
        s = self._state.get(req_id)
        if s is None or s.rounds == 0:
            return {"prev_accept": math.nan, "mean_accept": math.nan, "position": 0.0}
        return {"prev_accept": float(s.last), "mean_accept": s.accepted / s.rounds,
                "position": float(s.accepted + s.rounds)}

    def values(self, req_ids: Sequence[str], names: Sequence[str] = HISTORY_COLUMNS) -> dict[str, np.ndarray]:
        """``{name: float64 [B]}`` for the history columns in ``names``, in ``req_ids`` order."""
        unknown = [n for n in names if n not in HISTORY_COLUMNS]
        if unknown:
            raise KeyError(f"no history column {unknown}; known: {HISTORY_COLUMNS}")
        if not names:  # tables whose context is the temperature alone (the shipped ones): no state read
            return {}
        key = tuple(req_ids)
        read = self._read
        if read is None or read[0] != self._changes or read[1] != key:
            read = self._read = (self._changes, key, self._columns(req_ids))
        return {n: read[2][n] for n in names}  # arrays shared by the reads until the next change: read only

    def _columns(self, req_ids: Sequence[str]) -> dict[str, np.ndarray]:
        """Every history column of ``req_ids`` (float64 ``[B]`` each), in one pass over the states and one numpy call
        (inside an engine each numpy op starts cold; Python's float division and sums are numpy's float64 ones)."""
        get, nan = self._state.get, math.nan
        rows = []
        for r in req_ids:
            s = get(r)
            rows.append((nan, nan, 0.0) if s is None or s.rounds == 0  # a request in its first round (never observed)
                        else (float(s.last), s.accepted / s.rounds, float(s.accepted + s.rounds)))
        cols = np.array(rows, dtype=np.float64).reshape(len(rows), 3).T.copy()  # [3, B], each column contiguous
        return {"prev_accept": cols[0], "mean_accept": cols[1], "position": cols[2]}
