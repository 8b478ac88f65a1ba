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

**Read from the text** (``RequestHistory(from_text=True)``, what serving keeps). A bank's collector verifies
each round's whole chain, so its ``accept`` is the chain's accepted length; calib verifies a prefix of it, or
none, so the accepted count a step reports is cut at the depth calib chose, and a chain calib emptied is no
round at all. Histories counted from those outcomes drift from the values the tables were fitted on, and each
cut lowers the next prediction (code edits at c = 16 on one EPYC core: 1,975 tokens accepted over the rounds'
whole chains, 1,281 at the depths calib verified; docs/serving.md, "December 7"). Read from the text, a round is a step at which the request was offered a chain
(:meth:`open_rounds`: the chain it verified, else the engine's own), and its accepted length is that chain's
longest common prefix with the tokens the request then generated (:meth:`settle`, from the request's token ids
at a later step), which is what verifying the whole chain would have accepted (greedy; under sampling the same
in distribution: each token of the text is the target's draw). Until the text reaches past a round's first
mismatch, or its last token, the round counts its common prefix so far. ``position`` counts what the round's
step emitted (its verified accepted tokens and the step's own token): the request's output length less its
steps without a round, as in a bank. :meth:`observe` then changes nothing; a step's outcomes still reach the
online correction (:class:`calib.serve.decide.SafeDecider`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from calib.labels import HISTORY_COLUMNS


@dataclass
class _Round:
    """A round read from the text whose accepted length is not final yet (:meth:`RequestHistory.settle`)."""

    start: int  # the request's tokens before the round's first draft position
    chain: tuple  # every token of the round's chain, verified or not
    verified: int  # how many of them the step verified
    accepted: int = 0  # the chain's common prefix with the text so far: a lower bound until final


@dataclass
class _State:
    rounds: int = 0  # rounds observed (verify steps with >= 1 draft token)
    accepted: int = 0  # accepted draft tokens over them
    last: int = -1  # accepted length of the latest round
    position: int = 0  # tokens the rounds' steps emitted
    open: list = field(default_factory=list)  # [_Round]: from the text, rounds not final yet (oldest first)
    latest: _Round | None = None  # from the text: the latest round (its accepted length is ``last``)


class RequestHistory:
    """Per-request history context, keyed by the engine's request id.

    ``observe(req_id, accepted, drafted)`` after each verify step, ``finish(req_id)`` when the request
    ends (finished, aborted, preempted for good); ``values(req_ids)`` before a decision.
    """

    def __init__(self, from_text: bool = False) -> None:
        self.from_text = bool(from_text)  # rounds read from the text (open_rounds, settle), not from observe
        self._state: dict[str, _State] = {}
        self._unsettled: set[str] = set()  # from the text: request ids with a round not final yet
        # from the text, over the rounds settled so far: how many, their whole chains' accepted tokens, and the
        # accepted tokens at the depth verified (what counting the steps' outcomes would have read)
        self.settled = {"rounds": 0, "whole": 0, "verified": 0}
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
        if self.from_text:
            return
        self._changes += 1
        s = self._state.setdefault(req_id, _State())
        s.rounds += 1
        s.accepted += int(accepted)
        s.last = int(accepted)
        s.position += int(accepted) + 1

    def observe_rounds(self, req_ids: Sequence[str], accepted: Sequence[int]) -> None:
        """:meth:`observe` of one round per request (``drafted >= 1`` each), ``accepted`` ints already checked
        (``0 <= accepted <= drafted``): a step's verified requests in one pass."""
        if self.from_text:
            return
        self._changes += 1
        state = self._state
        for r, a in zip(req_ids, accepted):
            s = state.get(r)
            if s is None:
                s = state[r] = _State()
            s.rounds += 1
            s.accepted += a
            s.last = a
            s.position += a + 1

    def open_rounds(self, req_ids: Sequence[str], starts: Sequence[int], chains: Sequence[Sequence[int]],
                    verified: Sequence[int]) -> None:
        """From the text: a round for each request offered a chain this step (``chains[i]``, empty: no round),
        starting after its first ``starts[i]`` tokens, ``verified[i]`` of its tokens verified. Each counts its
        common prefix with the text as :meth:`settle` reads it, 0 until then."""
        state = self._state
        for r, x, c, d in zip(req_ids, starts, chains, verified):
            if not c:
                continue
            s = state.get(r)
            if s is None:
                s = state[r] = _State()
            rd = _Round(int(x), tuple(c), int(d))
            s.rounds += 1
            s.last = 0
            s.position += 1  # the step's own token; its accepted ones once settled
            s.open.append(rd)
            s.latest = rd
            self._unsettled.add(r)
        self._changes += 1

    def settle(self, req_ids: Sequence[str], tokens_of) -> None:
        """From the text: each open round of ``req_ids`` read against its request's tokens (``tokens_of(i)``: request
        ``i``'s token ids, prompt included, a numpy array or a list), final once the text passes its first mismatch
        or its last token. A request not in ``req_ids`` waits for a later call."""
        if not self._unsettled:
            return
        changed, tally = False, self.settled
        for i, r in enumerate(req_ids):
            if r not in self._unsettled:
                continue
            s, toks = self._state[r], tokens_of(i)
            kept = []
            for rd in s.open:
                seen = max(0, min(len(rd.chain), len(toks) - rd.start))
                a = rd.accepted
                if seen > a:
                    for want, got in zip(rd.chain[a:seen], toks[rd.start + a: rd.start + seen]):
                        if want != int(got):
                            break
                        a += 1
                    if a != rd.accepted:
                        s.accepted += a - rd.accepted
                        s.position += min(a, rd.verified) - min(rd.accepted, rd.verified)
                        if rd is s.latest:
                            s.last = a
                        rd.accepted, changed = a, True
                if a == seen < len(rd.chain):  # the text has not passed this round yet
                    kept.append(rd)
                else:
                    tally["rounds"] += 1
                    tally["whole"] += a
                    tally["verified"] += min(a, rd.verified)
            s.open = kept
            if not kept:
                self._unsettled.discard(r)
        if changed:
            self._changes += 1

    def finish(self, req_id: str) -> None:
        """Forget ``req_id`` (a later request with the same id starts afresh). Unknown ids are fine."""
        self._changes += 1
        self._state.pop(req_id, None)
        self._unsettled.discard(req_id)

    def context(self, req_id: str) -> dict[str, float]:
        """``{prev_accept, mean_accept, position}`` of ``req_id`` before its next round (a request never
        observed is in its first round)."""
        s = self._state.get(req_id)
        if s is None or s.rounds == 0:
            return {"prev_accept": math.nan, "mean_accept": math.nan, "position": 0.0}
        return {"prev_accept": float(s.last), "mean_accept": s.accepted / s.rounds, "position": float(s.position)}

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
                        else (float(s.last), s.accepted / s.rounds, float(s.position)))
        cols = np.array(rows, dtype=np.float64).reshape(len(rows), 3).T.copy()  # [3, B], each column contiguous
        return {"prev_accept": cols[0], "mean_accept": cols[1], "position": cols[2]}


def round_chains(drafts: Sequence[Sequence[int]], chosen: Sequence[str | None], engine: Sequence[Sequence[int]],
                 offers: Mapping, engine_chain: str) -> list[list[int]]:
    """Each request's round chain at a decided step, for :meth:`RequestHistory.open_rounds`: the chain it verifies,
    whole (``chosen[i]``: its name; the engine's own list where that is the engine's chain, else the offer's
    tokens), else the engine's own draft (empty: no round). A chain that does not begin with the verified tokens
    (it should) gives way to them."""
    out = []
    for i, (d, name) in enumerate(zip(drafts, chosen)):
        if not d or name is None:
            out.append(list(engine[i]))
            continue
        whole = engine[i] if name == engine_chain else offers[name].tokens[i]
        out.append(list(whole) if list(whole[: len(d)]) == list(d) else list(d))
    return out
