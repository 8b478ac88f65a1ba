"""Serving: calib decides every step's drafts inside vLLM, a subscriber of :mod:`calib.vllm.patches`.

The events feed :class:`calib.vllm.server.Server` (the decision, the plan of draft passes, the
drafter's confidences, the request history); docs/serving_hooks.md describes what each one does.
"""

from __future__ import annotations

import atexit
import logging
import os
import time

from calib import envs
from calib.serve.knobs import ServeKnobs
from calib.vllm.patches import RunnerSubscriber
from calib.vllm.server import Server, ServeStats

log = logging.getLogger("calib.serve")


class ServingSubscriber(RunnerSubscriber):
    """The serving state's side of the patch set; it never raises into the engine."""

    def __init__(self, server: Server):
        self.server = server
        self.draft_start = 0.0
        self.drafted_s = 0.0  # the last draft proposal's seconds (left out of the step clock's time)
        self.plain_draw = bool(envs.CALIB_PLAIN_DRAW)  # read once: the patch set asks every step

    def before_take(self, runner) -> None:
        srv = self.server
        now = time.perf_counter()
        if srv.last_take is not None:
            srv.stats.step_ms.append((now - srv.last_take) * 1e3)
        srv.last_take = now

    def take_drafts(self, runner, out):
        srv = self.server
        if srv.ranks is not None:
            srv.ranks.checked = False
        decided = out
        try:
            decided = srv.step(runner, out)
        except Exception as exc:  # noqa: BLE001 - serving never raises into the engine
            srv.error("take_draft_token_ids", exc)
            decided = None
        if srv.ranks is not None and not srv.ranks.checked:
            # step() returned (or raised) before its own check: take part in it all the same (calib.vllm.ranks)
            from calib.vllm.ranks import FAILED, digest

            mine = FAILED if decided is None else digest(None if decided is out else decided.draft_token_ids)
            if not srv.ranks_agree(mine, "drafts"):
                return out
        return out if decided is None else decided

    def after_verify(self, runner, spec_decode_metadata, output) -> None:
        if spec_decode_metadata is not None:
            try:
                self.server.observe(runner, spec_decode_metadata, output.sampled_token_ids)
            except Exception as exc:  # noqa: BLE001
                self.server.error("_sample", exc)

    def before_propose(self, runner, scheduler_output, sampled_token_ids) -> None:
        srv = self.server
        try:
            srv.time_step(scheduler_output, time.perf_counter(), self.drafted_s)
        except Exception as exc:  # noqa: BLE001 - the curve stays as it was
            srv.error("step clock", exc)
        engine_k = getattr(scheduler_output, "num_spec_tokens_to_schedule", None)
        srv.retirement.skip_now = False  # set again below for this step only
        srv.passes_now = None  # the plan sets it when it runs
        planned = True
        try:
            if srv.planning:
                srv.plan_passes(runner, scheduler_output, sampled_token_ids)
        except Exception as exc:  # noqa: BLE001 - vLLM keeps its own K for this step
            srv.error("plan_passes", exc)
            planned = False
        if srv.ranks is not None:  # the draft passes run collectives: every rank must run as many (calib.vllm.ranks)
            from calib.vllm.ranks import FAILED

            passes = getattr(scheduler_output, "num_spec_tokens_to_schedule", None)
            mine = FAILED if not planned else (-2 if passes is None else int(passes))  # -2: no such field
            if not srv.ranks_agree(mine, "draft passes") and engine_k is not None:
                scheduler_output.num_spec_tokens_to_schedule = engine_k
        if planned and srv.planning and srv.oracle is None:  # the clock oracle keeps every request's head in step
            try:
                srv.note_passes(runner, scheduler_output)
            except Exception as exc:  # noqa: BLE001 - the head runs as vLLM runs it
                srv.retirement.skip_now = False
                srv.error("note_passes", exc)
        srv.rows = []
        self.draft_start = time.perf_counter()

    def after_propose(self, runner) -> None:
        srv = self.server
        self.drafted_s = time.perf_counter() - self.draft_start
        srv.stats.draft_ms.append(self.drafted_s * 1e3)
        try:
            srv.finish_drafting(list(runner.input_batch.req_ids))
        except Exception as exc:  # noqa: BLE001
            srv.rows = None
            srv.error("propose_draft_token_ids", exc)

    def skips_idle_pass(self) -> bool:
        return self.server.retirement.take_skip()

    def samples_plainly(self) -> bool:
        return self.plain_draw

    def keeps_head_block(self, request_id: str) -> bool:
        srv = self.server
        try:
            keep = bool(srv.planning and srv.oracle is None and srv.retirement.preadmit(request_id))
        except Exception as exc:  # noqa: BLE001 - the lookup goes as vLLM makes it
            srv.error("get_computed_blocks", exc)
            return False
        srv.stats.kept_head_block += keep
        return keep

    def wants_depths(self) -> bool:
        return self.server.rows is not None

    def wants_distribution(self) -> bool:
        return False  # max q only: the patch set skips the vocabulary-wide softmax for serving alone

    def draft_depth(self, token_ids, probs, max_q) -> None:
        # The offered confidence is max q: known before the draw (a sampled draft's own q is not, and
        # cutting on it would bias what is verified); on the greedy path it is the argmax token's q.
        try:
            self.server.record_depth(token_ids, max_q)
        except Exception as exc:  # noqa: BLE001
            self.server.error("_sample_draft_tokens", exc)

    def before_update_states(self, runner, scheduler_output) -> None:
        try:
            self.server.finished(scheduler_output.finished_req_ids)
        except Exception as exc:  # noqa: BLE001
            self.server.error("_update_states", exc)


_SERVER: Server | None = None


def server() -> Server | None:
    """This process's serving state (None: serving is off here)."""
    return _SERVER


def stats() -> ServeStats | None:
    """This process's serving statistics (None: serving hooks not installed here)."""
    return _SERVER.stats if _SERVER is not None else None


def start_serving(knobs: ServeKnobs) -> ServingSubscriber:
    """This process's serving state for ``knobs``, as a subscriber of the patch set (once per process)."""
    global _SERVER
    if _SERVER is None:
        _SERVER = Server(knobs)
        from calib.vllm.sampled import apply_lean_recovered_draw

        apply_lean_recovered_draw()  # a step calib drafts nothing on costs what a plain step costs, sampled too
        _ensure_log_handler()
        atexit.register(_log_summary)
        # debug only: whether the hooks act in this engine is the engine line's to say (calib.vllm.engine_line)
        log.debug("calib serving hooks installed (pid %d), tables %s", os.getpid(), knobs.tables)
    return ServingSubscriber(_SERVER)


def _ensure_log_handler() -> None:
    """Under ``vllm serve`` nothing configures the root logger (vLLM configures its own ``vllm`` logger),
    so calib's INFO lines (hooks installed, tables in use, the exit summary) would be dropped: give
    ``calib.serve`` a stderr handler at INFO there. Where a handler exists (Hydra, pytest), change nothing."""
    if log.hasHandlers():
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s [calib.serve] %(message)s", "%m-%d %H:%M:%S"))
    log.addHandler(handler)
    if log.level == logging.NOTSET:
        log.setLevel(logging.INFO)


def _log_summary() -> None:
    srv = _SERVER
    if srv is None or srv.stats.steps == 0:
        return
    s = srv.stats
    (log.warning if (s.errors or srv.failed or (srv.decider is not None and srv.decider.failures)) else log.info)(
        s.summary())
