"""Retiring the model drafter from requests it does not pay for, so that a step can skip its head's pass.

vLLM runs an EAGLE or draft-model head over every step's verified tokens even when it drafts nothing
(``num_speculative_tokens == 0``): the pass writes the head's KV cache for those positions, so that a later draft
can read them (vllm/v1/spec_decode/llm_base_proposer.py, ``propose``). On one CPU core that pass is 3.2–3.5 ms of a
~100 ms step at concurrency 4 (docs/deployment.md). Where the plan of draft passes has run no pass for a request in
``after`` consecutive steps, the request is *retired*: its model chain is never offered again (the head's cache
would miss the positions of every step it skips), and a step whose requests are all retired and whose plan runs no
pass skips the head's pass altogether (:meth:`calib.vllm.patches.RunnerSubscriber.skips_idle_pass`). A request that
has not yet retired keeps the pass running for the whole batch; the pass then fills every request's positions of
that step, retired ones included, which is harmless: they are never drafted for again.

A request can also be retired *at admission*: where the last plan ran no pass and would run none for one more,
fresh request either (``admitting``, :meth:`calib.vllm.planning.DraftPlanning.plan_passes`), a newcomer is retired
before its first step. Its prefill then skips the head's pass too, and, where the scheduler runs in this process,
its prefix-cache hit keeps the block vLLM drops for the head (``preadmit``; :mod:`calib.vllm.patches`), so that
it costs what it costs on an engine without a model drafter. Such a request's head cache misses its prompt, which
is harmless for the same reason, and a later request that hits the blocks it cached drafts from a head that
misses them: it may draft worse, never wrongly (the target verifies every token).
"""

from __future__ import annotations


class DrafterRetirement:
    """Per-request streaks of steps without a draft pass, and the requests retired from the model chain.

    ``after``: retire a request after this many consecutive steps its batch ran no draft pass (0: never, vLLM's
    own behaviour: the head runs every step)."""

    def __init__(self, after: int):
        self.after = int(after)
        self.streak: dict[str, int] = {}  # req_id -> consecutive steps without a draft pass, this one included
        self.retired: set[str] = set()  # requests the head skipped a step of: their model chain is never offered
        self.skip_now = False  # the step in progress skips the head's pass (read once by the propose hook)
        self._admitting = False  # bool, or the last plan's question, asked when a newcomer comes (see admitting)
        self.admitted: set[str] = set()  # requests the scheduler admitted without the head's block: retire them

    @property
    def admitting(self) -> bool:
        """Whether the last plan said a fresh request's model chain would not pay, so that newcomers are retired.
        The plan may leave it as a question (a callable), answered once on the first newcomer's arrival: most steps
        see none, and then nothing is planned for one (an answer that raises is no)."""
        answer = self._admitting
        if callable(answer):
            try:
                answer = bool(answer())
            except Exception:  # noqa: BLE001 - vLLM's own behaviour for the newcomer: the head runs for it
                answer = False
            self._admitting = answer
        return answer

    @admitting.setter
    def admitting(self, answer) -> None:
        self._admitting = answer

    def preadmit(self, req_id: str) -> bool:
        """The scheduler is about to look up ``req_id``'s prefix-cache hit: whether the request is (or will be, at
        its first step) retired, so that the hit may keep the block vLLM drops for the head."""
        if req_id in self.retired or req_id in self.admitted:
            return True
        if self.after > 0 and req_id not in self.streak and self.admitting:
            self.admitted.add(req_id)
            return True
        return False

    def admit(self, req_ids) -> int:
        """Before the step's plan (:meth:`calib.vllm.planning.DraftPlanning.admit_newcomers`): retire each request not
        seen before that the scheduler admitted without the head's block, or any while ``admitting``. Returns how
        many were retired."""
        if self.after <= 0:
            return 0
        streak, retired, admitted = self.streak, self.retired, self.admitted
        new = [r for r in req_ids if r not in streak and r not in retired and (self.admitting or r in admitted)]
        for r in new:
            retired.add(r)
            streak[r] = self.after
            admitted.discard(r)
        return len(new)

    def note_step(self, req_ids, passes: int) -> bool:
        """The step's requests and the draft passes it runs (after every rank agreed on them): whether it skips
        the head's pass, which it does when it runs none and every request has gone ``after`` steps without one.
        Its requests are then retired."""
        self.skip_now = False
        if self.after <= 0:
            return False
        if passes > 0:
            for r in req_ids:
                if r not in self.retired:
                    self.streak[r] = 0
            return False
        streak = self.streak
        for r in req_ids:
            streak[r] = streak.get(r, 0) + 1
        if req_ids and all(r in self.retired or streak[r] >= self.after for r in req_ids):
            self.retired.update(req_ids)
            self.skip_now = True
        return self.skip_now

    def take_skip(self) -> bool:
        """Whether the drafter's pass in progress is to be skipped (cleared on reading: one pass per step)."""
        skip, self.skip_now = self.skip_now, False
        return skip

    def is_retired(self, req_id: str) -> bool:
        return req_id in self.retired

    def finish(self, req_id: str) -> None:
        self.streak.pop(req_id, None)
        self.retired.discard(req_id)
        self.admitted.discard(req_id)
