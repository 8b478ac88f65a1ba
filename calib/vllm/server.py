"""Serving's per-process state inside vLLM: the decider, drafter confidences, statistics (docs/serving_hooks.md).

:mod:`calib.vllm.serving` subscribes it to the patch set over vLLM's runner.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import numpy as np
import torch

from calib.chains import NO_CHAIN, Offer, chain, chain_names, chains
from calib.cost.serving import ContextCurves, cost_curve, prices_greedy_only, sampled_price, step_cost_path
from calib.serve import RequestHistory, StepInputs
from calib.serve.aside import StandAside, batch_key
from calib.serve.history import round_chains
from calib.serve.knobs import ServeKnobs
from calib.serve.step_clock import StepClock, clock_key, predicted_gain
from calib.transforms import target_only_transforms
from calib.vllm.planning import DraftPlanning, PlannedStep
from calib.vllm.ranks import digest
from calib.vllm.recomputed import Recomputed, StepContexts, recomputed_for
from calib.vllm.retire import DrafterRetirement
from calib.vllm.serve_stats import ServeStats, engine_identity, keep_engine_rows

log = logging.getLogger("calib.serve")


class Server(DraftPlanning):
    """Per-process serving state: the lazily built decider, drafter confidences, statistics."""

    def __init__(self, knobs: ServeKnobs):
        self.knobs = knobs  # validated at construction (calib.serve.knobs)
        self.tables_dir = knobs.tables
        self.cost_text = knobs.cost
        self.model_id = knobs.model_id
        self.chains = tuple(knobs.chains or chain_names())
        self.plan = knobs.plan
        self.draft_cost = knobs.draft_cost
        self.planning = False  # set at construction: a model drafter whose passes calib chooses
        self.decider = None
        self.failed = False  # construction failed: pass-through for the run
        self.stats = ServeStats()
        self.rows: list | None = None  # per-depth confidences of the drafting pass in progress
        self.conf: dict[str, list[float]] = {}  # req_id -> confidence per depth of its latest draft
        self.chosen: dict[str, str] = {}  # req_id -> the chain handed back for its next verify (capture reads it)
        self.last_take: float | None = None  # perf_counter at the previous decision (step_ms)
        # the recomputed chain kinds the tables calibrate -> their recomputation (calib/vllm/recomputed.py)
        self.recomputed: dict[str, Recomputed] = {}
        self.planned: PlannedStep | None = None  # what this step's plan looked up on its recomputed chain
        self.step_keys: tuple = ()  # the decision's requests' context keys (StepContexts.keys), set by offers()
        self.pass_prices: dict[int, float] = {}  # batch size -> the price of one draft pass (plan_passes)
        self.forecasts: dict[tuple, tuple] = {}  # (chain, passes, context columns) -> the forecast (plan_passes)
        self.cost64: tuple | None = None  # (the decider's cost curve, it as float64 numpy): the plan's (host_cost)
        self.sampled_rows: tuple | None = None  # (vLLM's sampled ids, their rows as lists) observe read, for the plan
        self.transformed: dict[str, bool] = {}  # req_id -> carries target-only logit transforms (left to vLLM)
        self.ranks = None  # calib.vllm.ranks.RankCheck under tensor parallelism (set at engine start), else None
        self.oracle = None  # calib.serve.oracle.Oracle when knobs.oracle names a reference (set at construction)
        self.aside = StandAside(knobs.aside_after, knobs.aside_every, knobs.aside_engine_price)  # no decision needed
        # the cost curve corrected by this engine's own steps (knob clock; calib/serve/step_clock.py), set at
        # construction; the curve as given (the decider's price before the clock has seen enough of a batch)
        self.clock, self.base_cost = None, None
        self.clock_last: float | None = None  # perf_counter at the previous step's draft proposal
        self.clock_pending: tuple | None = None  # the batch key of the decision the next step verifies
        self.context_curves: ContextCurves | None = None  # each step's price at its own context (knob context_price)
        self.clock_curve = None  # float64 numpy [T_max + 1] the price that decision read (None: the clock's own)
        self.aside_now: tuple | None = None  # (request ids, verdict) the plan of this step's draft passes took
        self.passes_now: int | None = None  # the draft passes the plan set this step (None: it set none)
        # requests the model drafter no longer pays for: a step of only those that runs no pass skips the head's
        self.retirement = DrafterRetirement(knobs.retire_drafter_after)
        self.unpriced_sampling = False  # set at construction: a step cost without the sampled term (said once)
        self._error_logged = 0

    # -- construction ----------------------------------------------------------------------------
    def ensure(self, runner, log_failure: bool = True):
        """The decider, built at first use from the runner's config (at engine start by the plugin, from
        the engine's config: :func:`calib.vllm.plugin.runner_view`); None (pass-through) if it cannot be.
        ``log_failure=False``: the caller reports it (the plugin's engine line)."""
        if self.decider is not None or self.failed:
            return self.decider
        try:
            self.decider = self._build(runner)
            log.debug("calib serve: deciding drafts with tables %s (engine chain %s, chains %s, K=%d, "
                     "recomputed %s)", self.tables_dir, self.decider.engine_chain, self.decider.chains,
                     self.k, {n: r.settings for n, r in self.recomputed.items()})
        except Exception as exc:  # noqa: BLE001 - never raise into the engine
            self.failed = True
            self.stats.disabled_reason = f"{type(exc).__name__}: {exc}"
            if log_failure:
                log.error("calib serve: OFF for this run, vLLM drafts on its own: cannot serve with tables %s: %s",
                          self.tables_dir, self.stats.disabled_reason)
        return self.decider

    def _build(self, runner):
        from calib.serve import SafeDecider

        sc = getattr(runner, "speculative_config", None)
        if sc is None or not getattr(sc, "num_speculative_tokens", None):
            raise RuntimeError("the engine runs no speculative decoding")
        if getattr(runner, "use_async_scheduling", False):
            raise RuntimeError("async scheduling: take_draft_token_ids is never called (needs sync scheduling)")
        from calib.chains import chain, chain_of_method

        method = sc.method
        try:
            drafted = chain_of_method(method)  # the chain kind vLLM's drafter proposes
        except KeyError as exc:
            raise RuntimeError(exc.args[0]) from None
        rsm = getattr(sc, "rejection_sample_method", "standard")
        if rsm != "standard":
            raise RuntimeError(f"rejection_sample_method={rsm!r}: only 'standard' is lossless under substitution")
        self.k = int(sc.num_speculative_tokens)
        # a model-free chain is named by its kind, a model drafter by its method and folder
        speculator = drafted.name if drafted.confidence is None else f"{method}:{Path(str(sc.model)).name}"
        model_id = self.model_id or Path(str(runner.model_config.model)).name
        loaded = drafted.confidence is not None  # a model drafter: an engine step cost charges its idle forward
        cost = cost_curve(self.cost_text, int(runner.max_num_reqs) * (self.k + 1), drafter_loaded=loaded)
        self.unpriced_sampling = prices_greedy_only(self.cost_text)
        self.base_cost = cost
        if self.knobs.context_price and not self.knobs.oracle:  # each step at its own batch and context
            self.context_curves = ContextCurves.of(self.cost_text, len(cost) - 1, drafter_loaded=loaded)
        # the oracle prices as the curve does (pad_to_cheapest); under tensor parallelism each rank would time its own
        # steps and decide apart, and the ranks must decide alike (calib.vllm.ranks): the curve as given
        if self.knobs.clock and not self.knobs.oracle and self.ranks is None:
            self.clock = StepClock(cost.to(torch.float64).numpy(), self.knobs.clock_decay, self.knobs.clock_prior,
                                   probe_every=self.knobs.clock_probe, probe_gain=self.knobs.clock_probe_gain)
        self.max_model_len = getattr(runner, "max_model_len", None)
        history = RequestHistory(from_text=True)  # the rounds' whole chains, as a bank counts them
        self.stats.history = history.settled  # its tally, kept up to date by the history itself
        dec = SafeDecider(self.tables_dir, model_id=model_id, speculator=speculator, k_max=self.k,
                          method=method, chains=self.chains, cost=cost, identity=engine_identity(runner, sc),
                          history=history,
                          impl="host",  # numpy on the step's few requests (calib/allocate/host.py)
                          online=self.knobs.online_settings(),
                          sampled_price=sampled_price(self.cost_text))  # priced where a step samples
        from calib.allocate.compiled import warm
        from calib.tables.lookup_compiled import lookup_kernel

        warm()  # the allocator's compiled rules now, not in the first step (numba: seconds once per machine)
        lookup_kernel()  # the table lookup's too (the online correction's update compiled with the decider)
        self.recompute_chains(dec, drafted, sc)
        for rec in self.recomputed.values():
            rec.warm()  # compiled now (numba: ~1 s once), not in the first step
        model_drafter = chain(dec.engine_chain).confidence is not None  # its passes are calib's to plan
        if self.knobs.oracle:  # the clock oracle decides from a reference (plan_passes: 0 or vLLM's K)
            from calib.serve.oracle import Oracle, Reference

            # priced as calib is: it pads a step to the cheapest that commits the same tokens (pad_to_cheapest)
            price = cost.to(torch.float64).numpy()
            self.oracle, self.stats.oracle = Oracle(Reference.load(self.knobs.oracle), price), True
            self.planning = model_drafter
            return dec
        self.planning = self.plan and model_drafter and dec.tables.forecast(dec.engine_chain) is not None
        if self.plan and model_drafter and not self.planning:
            log.warning("calib serve: the tables hold no forecast of the model chain (re-run train.py): vLLM "
                        "keeps drafting K=%d passes per step; calib only truncates or substitutes", self.k)
        return dec

    def recompute_chains(self, dec, drafted, sc) -> None:
        """Every recomputed chain kind the tables calibrate (:func:`calib.chains.recomputed_chains`): its
        recomputation with the engine's settings where vLLM drafts it, else its serving knob's, and its table's own
        feature names (:func:`calib.vllm.recomputed.recomputed_for`). Offered beside the others at each decided
        step (:meth:`offers`); the first is the chain the plan of draft passes knows (:attr:`plan_chain`)."""
        self.recomputed = recomputed_for(dec.tables, dec.chains, drafted, sc, self.knobs, self.k, self.max_model_len)

    def two_chains(self, dec, offers: dict, req_ids: list[str], temps: list[float]) -> dict:
        """The allocator chooses between at most two chains per request (calib.allocate.MAX_CHAINS): with more
        offered, the model drafter's and the recomputed chain whose calibrated expected accepted length over this
        step's requests is the largest (all of them free to draft) stay; the others are left out this step."""
        if len(offers) <= 2:
            return offers
        from calib.allocate import calibrated_probs
        from calib.serve import StepInputs
        from calib.serve.decide import chain_inputs

        free = [n for n in offers if n in self.recomputed]
        fixed = [n for n in offers if n not in free]
        best, best_value = None, -1.0
        for name in free:
            offer = offers[name]
            if offer.probs is not None:
                probs = torch.as_tensor(offer.probs, dtype=torch.float64)
            else:
                signals, _ = chain_inputs(dec.tables, StepInputs(req_ids, temps, {name: offer}), dec.history,
                                          k_max=self.k)
                probs = calibrated_probs(dec.tables, {name: signals[name]})[name].to(torch.float64)
            value = float(torch.nan_to_num(torch.cumprod(torch.nan_to_num(probs, nan=0.0), dim=1)).sum())
            if value > best_value:
                best, best_value = name, value
        self.stats.chains_left_out += len(free) - 1
        return {n: offers[n] for n in (*fixed, best)}

    def note_unpriced_sampling(self) -> None:
        """Once per run: a request samples, and the step cost was fitted on greedy steps only (said, not warned:
        on the Xeon of December 5 a cost that priced the sampled jump served no faster, docs/serving.md)."""
        self.unpriced_sampling = False
        log.info("calib serve: serve.cost %s has no `sampled` term (fitted on greedy steps only): steps under sampling "
                 "are priced as greedy ones, without the rejection sampler's random path (docs/cost.md; "
                 "`python bench/prepare_replay.py` profiles both)", step_cost_path(self.cost_text))

    def error(self, where: str, exc: BaseException) -> None:
        self.stats.errors += 1
        self._error_logged += 1
        if self._error_logged <= 3:
            log.warning("calib serve hook failed in %s (vLLM's own drafts kept): %s", where, exc, exc_info=exc)

    def ranks_agree(self, value: int, what: str) -> bool:
        """At a hook that changes what the engine computes: whether every tensor-parallel rank chose the same
        ``value`` (:mod:`calib.vllm.ranks`). On a disagreement calib switches off on every rank at once (each
        sees the same all-reduce); the caller then keeps vLLM's own choice. True without tensor parallelism."""
        if self.ranks is None or self.ranks.agree(value):
            return True
        first = not self.failed
        self.failed, self.decider, self.planned = True, None, None
        self.stats.disabled_reason = (f"tensor-parallel ranks chose different {what} at step {self.stats.steps}; "
                                      "vLLM drafts on its own for the rest of the run")
        if first:
            log.error("calib serve: OFF — %s", self.stats.disabled_reason)
        return False

    # -- drafting --------------------------------------------------------------------------------
    def record_depth(self, token_ids: torch.Tensor, conf: torch.Tensor) -> None:
        if self.rows is not None:
            self.rows.append(conf.detach().float().reshape(-1).cpu())

    def finish_drafting(self, req_ids: list[str]) -> None:
        rows, self.rows = self.rows, None
        if not rows:
            return
        conf = torch.stack(rows, dim=1).tolist()  # [batch rows, depth]
        for i, req_id in enumerate(req_ids[: len(conf)]):
            self.conf[req_id] = conf[i]

    # -- verification ----------------------------------------------------------------------------
    def observe(self, runner, spec_decode_metadata, sampled_token_ids: torch.Tensor) -> None:
        dec = self.decider
        if dec is None:
            return
        start = time.perf_counter()
        num_draft = spec_decode_metadata.num_draft_tokens  # [B] ints
        if any(num_draft):
            # Python lists: a few short rows, where each numpy or torch op would start cold (docs/profile.md)
            sampled = sampled_token_ids.tolist()  # [B][K + 1], -1: none (from any device; no device read, cold)
            self.sampled_rows = (sampled_token_ids, sampled)  # the plan of the next passes reads the same rows
            rounds = [(r, max(0, min(len(row) - row.count(-1) - 1, int(d))), int(d))  # requests that verified drafts
                      for r, row, d in zip(runner.input_batch.req_ids, sampled, num_draft) if d]
            if rounds:
                dec.observe_step(*zip(*rounds))
        dec.refresh()  # the online correction learns the step's outcomes, once per step before the next lookup
        self.stats.observe_ms.append((time.perf_counter() - start) * 1e3)

    def note_passes(self, runner, scheduler_output) -> None:
        """Before the drafter runs, once every rank agreed on the step's draft passes: whether the step skips the
        head's pass and retires its requests from the model chain (:mod:`calib.vllm.retire`)."""
        passes = getattr(scheduler_output, "num_spec_tokens_to_schedule", None)
        if passes is None:
            return
        req_ids = list(runner.input_batch.req_ids)
        before = len(self.retirement.retired)
        skips = self.retirement.note_step(req_ids, int(passes))
        self.stats.retired += len(self.retirement.retired) - before
        if skips:
            self.stats.head_skipped += 1

    def left_to_vllm(self, runner, req_ids) -> list[bool]:
        """Per request: whether its sampling parameters apply target-only logit transforms
        (:func:`calib.transforms.target_only_transforms`), so that calib leaves its drafts to vLLM.
        Read once per request from the runner's request states."""
        requests = getattr(runner, "requests", None) or {}
        out = []
        for r in req_ids:
            hit = self.transformed.get(r)
            if hit is None:
                state = requests.get(r)
                hit = self.transformed[r] = bool(target_only_transforms(getattr(state, "sampling_params", None)))
            out.append(hit)
        return out

    def finished(self, req_ids) -> None:
        for r in req_ids:
            self.transformed.pop(r, None)
            self.conf.pop(r, None)
            self.chosen.pop(r, None)
            for rec in self.recomputed.values():
                rec.finish(r)
            if self.oracle is not None:
                self.oracle.finish(r)
            self.retirement.finish(r)
            if self.decider is not None:
                self.decider.finish(r)

    def time_step(self, so, now: float, drafted_s: float) -> None:
        """One observation of the step clock (calib/serve/step_clock.py) at a step's draft proposal: the wall time
        since the previous one's, less its drafting (``drafted_s``), for a pure decode step (no prompt chunk) of as
        many requests as calib last decided for."""
        last, self.clock_last = self.clock_last, now
        pending, self.clock_pending = self.clock_pending, None
        curve, self.clock_curve = self.clock_curve, None
        if self.clock is None or last is None or pending is None:
            return
        batch, T = len(so.num_scheduled_tokens), int(so.total_num_scheduled_tokens)
        pure = batch == pending[0] and T == batch + sum(len(v) for v in so.scheduled_spec_decode_tokens.values())
        if pure and self.clock.observe(pending, batch, T, now - last - drafted_s, curve):
            self.stats.clock_steps += 1
            if (self.clock.steps[pending] - 1) % self.clock.refresh == 0:  # as often as the price: steps 1, 5, 9...
                self.stats.clock[f"B={batch} {'sampled' if pending[1] else 'greedy'}"] = self.clock.summary(pending)

    def step(self, runner, out):
        """vLLM's ``DraftTokenIds`` -> calib's (or ``out`` itself when passing through)."""
        start = time.perf_counter()
        self.stats.steps += 1
        passes_now, self.passes_now = self.passes_now, None
        dec = self.ensure(runner)
        if dec is None or not dec.enabled:
            self.stats.passthrough += 1
            return out
        sampled = getattr(runner, "_draft_probs", None) is not None  # probabilistic drafting: q kept
        self.stats.probabilistic += sampled
        req_ids = list(out.req_ids)
        engine = [list(map(int, t)) for t in out.draft_token_ids]
        if len(engine) != len(req_ids):
            raise RuntimeError(f"vLLM handed {len(engine)} draft lists for {len(req_ids)} requests")
        left = self.left_to_vllm(runner, req_ids)
        self.stats.left_to_vllm += sum(left)
        if left and all(left):
            self.stats.passthrough += 1
            return out
        K = self.k
        batch = runner.input_batch
        rows = [batch.req_id_to_index[r] for r in req_ids]
        held = batch.temperature_cpu[: max(rows, default=-1) + 1].tolist()  # one numpy call, not one per request
        temps = [float(held[i]) for i in rows]
        if self.unpriced_sampling and any(t > 0 for t in temps):
            self.note_unpriced_sampling()
        key = batch_key(temps)
        self.clock_pending = clock_key(temps)  # what the step that verifies this is timed as
        lengths = [int(batch.num_tokens_no_spec[r]) for r in rows]  # each request's tokens: where its draft starts
        price, self.clock_curve = self.base_cost, None  # the step's price (ContextCurves: at its own context)
        if self.context_curves is not None:
            price, self.clock_curve = self.context_curves.at(len(rows), sum(lengths))
        corrected = self.clock.price(self.clock_pending, len(req_ids), self.clock_curve) if self.clock else None
        dec.cost = price if corrected is None else corrected
        verdict = self.aside_verdict(req_ids, key, any(left))
        if verdict == "engine":  # vLLM's own proposal, untouched (calib/serve/aside.py)
            self.stats.aside_engine += 1
            engine_chain = chain(dec.engine_chain).name
            for r, x in zip(req_ids, engine):
                self.chosen[r] = engine_chain if x else None
            dec.history.open_rounds(req_ids, lengths, engine, [len(x) for x in engine])  # calib.serve.history
            self.planned = None
            self.stats.hook_ms.append((time.perf_counter() - start) * 1e3)
            return out
        d = None
        if verdict in ("none", "probe"):  # no draft tokens: the step costs what a step without speculation costs
            self.stats.aside_none += verdict == "none"
            self.stats.clock_probes += verdict == "probe"
            self.planned = None
            drafts, chain_ids = [[] for _ in req_ids], np.full(len(req_ids), NO_CHAIN, dtype=np.int8)
        else:
            planned = self.planned  # offers() clears it
            inputs = StepInputs(req_ids, temps, self.offers(dec, req_ids, engine, batch, rows))
            if self.oracle is not None:  # the clock oracle: the accepted prefix of the chain that commits most
                d, known = self.oracle.decide(inputs, self.oracle.continuations(batch, rows, req_ids, temps, K),
                                              dec.engine_chain, engine)
                self.stats.oracle_known += sum(known)
                self.stats.oracle_unknown += len(known) - sum(known)
                self.stats.oracle_padded = self.oracle.padded
            else:
                d = self.decide_sampled(dec, inputs) if sampled else (self.planned_decision(inputs, planned)
                                                                       or dec.decide(inputs))
            if d.passthrough:
                self.stats.passthrough += 1
                return out
            if self.clock is not None and self.clock.probe_every:  # what its probe turns on (calib/serve/step_clock.py)
                self.clock.note_gain(self.clock_pending, predicted_gain(dec.cost, len(req_ids), d.host("depth"),
                                                                        d.host("expected_accepted")))
            drafts, chain_ids = d.drafts, d.host("chain")  # int8 [B], numpy: no torch call in the step
            if any(left):
                drafts, chain_ids = keep_engine_rows(drafts, d.chain, engine, left, dec.engine_chain)
        if len(drafts) != len(req_ids) or any(len(x) > K or any(t < 0 for t in x) for x in drafts):
            raise RuntimeError("decision out of bounds (more than K tokens, or a negative id)")
        if self.ranks is not None and not self.ranks_agree(digest(drafts), "drafts"):  # before anything changes
            return out
        names = {kind.id: kind.name for kind in chains()}  # one registry read per step, not per request
        for r, cid, x in zip(req_ids, chain_ids.tolist(), drafts):
            self.chosen[r] = names[int(cid)] if (cid != NO_CHAIN and x) else None
        # what the online correction learns from once the step is verified (never the requests left to vLLM)
        if d is not None and self.oracle is None:  # the oracle learns nothing
            dec.remember(inputs, d, skip=left)
            self.note_kind(key, self.aside.kind_of(drafts, engine, passes_now, K, dec.cost) if not any(left) else None)
            whole = round_chains(drafts, [self.chosen[r] for r in req_ids], engine, inputs.offers, dec.engine_chain)
            dec.history.open_rounds(req_ids, lengths, whole, [len(x) for x in drafts])
        if sampled:  # the rejection sampler's q rows must follow the lists handed back
            self.rebuild_draft_probs(runner, req_ids, drafts, chain_ids)
        self.count(drafts, engine, decided=d is not None)
        if d is not None:
            self.stats.allocator_ms.append(float(d.allocator_ms))
        self.stats.hook_ms.append((time.perf_counter() - start) * 1e3)
        return type(out)(req_ids, drafts)

    # -- standing aside (calib/serve/aside.py) -----------------------------------------------------
    def aside_verdict(self, req_ids: list[str], key: tuple, any_left: bool = False) -> str | None:
        """This engine step's stand-aside verdict ("engine", "none" or None: decide), taken once per step: by
        the plan of draft passes when it ran (same requests), else here. Never with the clock oracle."""
        seen, self.aside_now = self.aside_now, None
        if seen is not None and seen[0] == tuple(req_ids):
            return seen[1]
        return self.fresh_verdict(key, any_left)

    def fresh_verdict(self, key: tuple, any_left: bool = False) -> str | None:
        """:meth:`calib.serve.aside.StandAside.verdict` for batch ``key``; never with the clock oracle, nor with a
        request left to vLLM (decide)."""
        if self.oracle is not None or any_left:
            return None
        verdict = self.aside.verdict(key)
        if verdict != "none" and self.clock is not None and self.clock.probe(clock_key(key[1])):
            return "probe"  # one step without draft tokens, for the step clock (calib/serve/step_clock.py)
        return verdict

    def note_kind(self, key: tuple, kind: str | None) -> None:
        """A decided step's kind (:meth:`calib.serve.aside.StandAside.kind_of`); one log line when a stretch of a
        kind first begins."""
        if self.aside.record(key, kind):
            what = ("hands vLLM's own drafts through" if kind == "engine"
                    else "schedules no draft tokens (no speculation pays at this batch)")
            log.info("calib serve: standing aside at batch %d (temperatures %s): the last %d decisions were %s, "
                     "so calib %s without deciding, deciding again every %d steps or when the batch changes",
                     key[0], sorted(set(key[1])), self.aside.after,
                     "vLLM's own drafts" if kind == "engine" else "no draft tokens", what, self.aside.every)

    # -- probabilistic drafting (docs/serving_hooks.md, "Sampled serving"; calib/vllm/sampled.py) ------
    def decide_sampled(self, dec, inputs):
        """:func:`calib.vllm.sampled.decide_sampled`: the causal cut of a sampled model chain."""
        from calib.vllm.sampled import decide_sampled

        return decide_sampled(dec, inputs)

    def rebuild_draft_probs(self, runner, req_ids: list[str], drafts: list[list[int]], chain_ids) -> None:
        """:func:`calib.vllm.sampled.follow_drafts`: the rejection sampler's q rows made to follow ``drafts``."""
        from calib.vllm.sampled import follow_drafts

        follow_drafts(runner, self.decider.engine_chain, req_ids, drafts, chain_ids)
        self.stats.probabilistic_decided += 1

    def offers(self, dec, req_ids: list[str], engine: list[list[int]], batch, rows: list[int]) -> dict:
        """``{chain: Offer}`` at this step: the engine's draft with its confidences (a model drafter), and each
        chain calib recomputes from the requests' tokens (:attr:`recomputed`; the plan's chain with the
        probabilities the plan looked up, if any): at most two (:meth:`two_chains`)."""
        K, offers = self.k, {}
        # a model drafter: its draft with confidences (none drafted, beside a recomputed chain: left out, below)
        if chain(dec.engine_chain).confidence is not None and (any(engine) or not self.recomputed):
            model_tokens, conf = [], np.full((len(req_ids), K), np.nan, dtype=np.float32)
            retired = self.retirement.retired
            for b, (r, toks) in enumerate(zip(req_ids, engine)):
                # a retired request's head misses positions (calib/vllm/retire.py): its draft is not offered
                c = [] if r in retired else self.conf.get(r, [])[: len(toks)]
                model_tokens.append(toks[: len(c)])  # a depth without its confidence is not offered
                if c:
                    conf[b, : len(c)] = c[:K]
            # float32 [B, K], numpy: filled and read (calib.chains.base.offer_inputs) without a torch call
            # a chain with no token anywhere cannot be chosen: beside a recomputed chain, leave it out and the
            # (cheaper) one-chain rule decides the same
            if any(model_tokens) or not self.recomputed:
                offers[dec.engine_chain] = Offer(model_tokens, conf)
        contexts = StepContexts(batch, rows)
        self.step_keys = contexts.keys
        dec.history.settle(req_ids, contexts.tokens)  # the text since the requests' rounds: what they accepted
        planned = self.planned.chain if self.planned is not None else None
        for name, rec in self.recomputed.items():
            tokens, signal = rec.chains(contexts)  # the plan's, when it ran on the same contexts
            if dec.engine_chain == name:
                self.stats.ngram_mismatch += sum(a != b for a, b in zip(tokens, engine))
            offers[name] = Offer(tokens, signal, self.planned_probs(contexts.keys) if name == planned else None)
            rec.end_step()
        self.planned = None
        if len(offers) > 2:
            offers = self.two_chains(dec, offers, req_ids, [float(batch.temperature_cpu[i]) for i in rows])
        return offers

    def count(self, drafts: list[list[int]], engine: list[list[int]], decided: bool = True) -> None:
        """Statistics of one step calib handed lists back on (``decided``: by a decision, else standing aside):
        calib's lists against vLLM's."""
        s = self.stats
        s.decided += decided
        s.requests += len(drafts)
        for mine, theirs in zip(drafts, engine):
            s.tokens_engine += len(theirs)
            s.tokens_out += len(mine)
            if mine == theirs:
                continue
            s.replaced += 1
            if not mine:
                s.emptied += 1
            elif theirs[: len(mine)] == mine:
                s.truncated += 1
            else:
                s.substituted += 1
