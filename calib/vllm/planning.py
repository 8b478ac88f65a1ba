"""The plan of a step's draft passes and the recomputed chain it shares with the decision (a part of
:class:`calib.vllm.server.Server`, which inherits it; docs/serving_hooks.md, design note claim 4).

Before the drafter runs, :meth:`DraftPlanning.plan_passes` sets the step's number of model-drafter passes from
the recomputed chain each request will offer (known in full before drafting: :attr:`DraftPlanning.plan_chain`, the
first recomputed chain kind the tables calibrate, :mod:`calib.vllm.recomputed`) and the tables' forecast of the model
chain; when it runs none, :meth:`DraftPlanning.planned_decision` is the step's decision. The chain is computed once
per step: the decision after drafting reads the plan's, with the probabilities it looked up and the context
columns it read (:class:`PlannedStep`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from calib.allocate import forecast_probs, plan_draft
from calib.allocate.draft import plan_first_pass_host
from calib.chains import NO_CHAIN, Offer, chain
from calib.cost.serving import step_pass_price
from calib.serve import StepDecision, StepInputs
from calib.serve.allocation import host_probs
from calib.serve.aside import batch_key
from calib.serve.decide import chain_inputs_host, context_columns
from calib.vllm.recomputed import StepContexts


@dataclass(frozen=True)
class PlannedStep:
    """What the plan of this step's draft passes looked up on its recomputed chain (``chain``), per request of the
    plan, for the decision after drafting."""

    chain: str
    keys: tuple  # each request's context key (StepContexts.keys): the decision reads these rows only on the same
    probs: np.ndarray  # float32 [B, W]: the chain's calibrated P(accept | reached), NaN beyond its tokens
    depth: np.ndarray | None  # int64 [B]: the plan's allocation of the chain when it ran no pass, else None
    columns: dict  # context axes -> float64 [B, A]: the history and temperature columns the plan read

    def rows(self, keys: tuple):
        """Where each of ``keys`` is in the plan (an index into its rows), None when a request's context is not
        one the plan saw."""
        if keys == self.keys:
            return slice(None)
        at = {key: b for b, key in enumerate(self.keys)}
        rows = [at.get(key) for key in keys]
        return None if None in rows else np.array(rows, dtype=np.int64)


def newcomer_drafts(known: dict, forecast: torch.Tensor, fresh: torch.Tensor, *, cost: torch.Tensor,
                    pass_cost: float, chain: str) -> bool:
    """Whether :func:`calib.allocate.plan_draft` runs a pass of ``chain`` for the batch ``known``/``forecast``
    ``[B, K]`` joined by one more request that offers nothing on the other chains and whose forecast of ``chain``
    is ``fresh`` ``[K]`` (``pass_cost``: the price of a pass in a batch of B + 1)."""
    from calib.allocate import plan_draft

    joined = {}
    for name, probs in known.items():
        row = torch.full((1, probs.shape[1]), float("nan"), dtype=probs.dtype)
        joined[name] = torch.cat([probs, row]) if name != chain else probs.new_zeros((probs.shape[0] + 1, 0))
    plan = plan_draft(joined, torch.cat([forecast, fresh[None].to(forecast.dtype)]), cost=cost, pass_cost=pass_cost,
                      chain=chain)
    return int(plan.passes) > 0


def best_case(known: dict, chain: str) -> dict:
    """``known`` (``{chain name: [B, W]}``) as its requests would offer it where a pass of ``chain`` pays most: nothing
    on the other chains (a step on which no request has an n-gram match)."""
    return {n: p if n == chain else torch.full((p.shape[0], 1), float("nan"), dtype=p.dtype) for n, p in known.items()}


class DraftPlanning:
    """The planning half of the serving state (mixed into :class:`calib.vllm.server.Server`, whose attributes it
    reads: ``knobs``, ``decider``, ``recomputed``, ``k``, ``planned``, ``step_keys``, ``pass_prices``,
    ``forecasts``, ``oracle``, ``aside``, ``retirement``, ``stats``; it sets ``passes_now`` and
    ``retirement.admitting``)."""

    @property
    def plan_chain(self) -> str | None:
        """The recomputed chain the plan of draft passes knows in full (the first the tables calibrate, registry
        order), None: none."""
        return next(iter(self.recomputed), None)

    def planned_probs(self, keys: tuple) -> np.ndarray | None:
        """numpy float32 ``[B, W]``: the probabilities the plan looked up this step on its chain, when it did so for every
        request on the chain the decision sees now (same contexts ``keys``); else None (look them up)."""
        planned = self.planned
        if planned is None or not keys:
            return None
        rows = planned.rows(keys)
        return None if rows is None else planned.probs[rows]

    # -- the number of draft passes ----------------------------------------------------------------
    def plan_passes(self, runner, scheduler_output, sampled_token_ids) -> None:
        """Before the drafter runs: set this step's draft passes (``num_spec_tokens_to_schedule``,
        batch-wide, 0..K) to :func:`calib.allocate.plan_draft`'s choice, from the recomputed chain each
        request will offer (:attr:`plan_chain`, known in full) and the tables' forecast of the model chain in each
        request's context (design note claim 4). Leaves vLLM's K on anything unexpected.

        The clock oracle (knob ``oracle``) runs no pass where every request's recomputed chain already commits
        ``min(K, what is left of its reference)`` (no model draft could commit more), else leaves vLLM's K:
        it cannot know an EAGLE draft before drafting."""
        dec = self.decider
        if dec is None or not dec.enabled or not self.planning:
            return
        if self.oracle is None:  # newcomers the last plan said would not pay: retired before this plan
            self.admit_newcomers(runner.input_batch.req_ids)
        k_sched = int(getattr(scheduler_output, "num_spec_tokens_to_schedule", self.k) or 0)
        if k_sched <= 0:
            return
        start = time.perf_counter()
        batch = runner.input_batch
        req_ids = list(batch.req_ids)
        B = len(req_ids)
        if B == 0:
            return
        retirement = self.retirement
        retirement.admitting = False  # set below where the plan says a newcomer's model chain would not pay
        if any(self.left_to_vllm(runner, req_ids)):  # a request left to vLLM keeps vLLM's K
            return
        rows = list(range(B))
        temps = [float(t) for t in batch.temperature_cpu[:B].tolist()]  # one numpy call, not one per request
        verdict = self.fresh_verdict(batch_key(temps))
        self.aside_now = (tuple(req_ids), verdict)  # the decision after drafting takes the same verdict
        if verdict in ("none", "probe"):  # the tables say nothing pays for this batch (or the step clock asks for a
            # step without drafts): no pass; where the tables said it, a newcomer's model chain pays neither
            retirement.admitting = verdict == "none" and self.admit_at_entry and self.oracle is None
            return self.set_passes(scheduler_output, 0, k_sched, start)
        if verdict == "engine":  # vLLM's K passes, its drafts handed through
            return
        retired = retirement.retired
        gone = [r in retired for r in req_ids] if retired else ()
        if self.oracle is None and not self.plans_for(gone):
            # every request retired: no pass can pay and nothing here is for the decision, which recomputes and
            # allocates the recomputed chain on its own (as on the n-gram engine); only a newcomer's question is left
            if self.admit_at_entry:
                inputs = StepInputs(req_ids, temps)
                retirement.admitting = self.admission_question(dec, inputs, None, B, k_sched)
            return self.set_passes(scheduler_output, 0, k_sched, start)
        extra = None
        held, self.sampled_rows = self.sampled_rows, None
        if isinstance(sampled_token_ids, torch.Tensor):  # padded EAGLE: drafting runs before bookkeeping
            # each row's tokens >= 0, -1 padded (StepContexts): as observe read them from the same tensor, else one
            # torch call
            extra = held[1] if held is not None and held[0] is sampled_token_ids else sampled_token_ids.tolist()
        tables, drafted, name = dec.tables, dec.engine_chain, self.plan_chain
        contexts = StepContexts(batch, rows, extra)  # the decision after bookkeeping sees the same contexts
        dec.history.settle(req_ids, contexts.tokens)  # before the plan reads the history (calib.serve.history)
        if self.oracle is not None:
            if extra is not None:
                extra = [[t for t in r if t >= 0] for r in extra[:B]]
            conts = self.oracle.continuations(batch, rows, req_ids, temps, k_sched, extra)
            toks = self.recomputed[name].chains(contexts)[0] if name is not None else None
            return self.set_passes(scheduler_output, self.oracle.passes(toks, conts, k_sched), k_sched, start)
        columns: dict = {}  # context axes -> their columns, read once (the decision's remember reads them too)
        probs = None  # float32 [B, W], numpy: the recomputed chain's calibrated probabilities
        if name is not None:
            toks, signal = self.recomputed[name].chains(contexts)
            inputs = StepInputs(req_ids, temps, {name: Offer(toks, signal)})
            signals, _ = chain_inputs_host(tables, inputs, dec.history, k_max=self.k,  # temperatures checked there
                                           columns=columns, lists=False)
            probs = host_probs(tables, {name: signals[name]})[name]
        else:
            inputs = StepInputs(req_ids, temps)
        meta = tables.forecast(drafted)
        axes = tuple(a["name"] for a in meta["axes"])
        if axes not in columns:
            columns[axes] = context_columns(axes, inputs, dec.history)
        batch_columns, cost = columns[axes], dec.cost

        # [B, k_sched], numpy from here: each torch call would start cold
        forecast = self.forecast(tables, drafted, meta, batch_columns, k_sched, host=True)
        if any(gone):  # their head misses positions: no pass is for them
            forecast = forecast.copy()  # the held forecast is shared between steps
            forecast[gone] = 0.0
        chain_first = name is None or chain(drafted).id < chain(name).id  # the allocator's tie order
        plan = plan_first_pass_host(forecast, probs, cost=self.host_cost(cost), pass_cost=self.pass_price(B),
                                    chain_first=chain_first)
        if plan is None:  # no numba, or something unusual: the torch plan, which says what is wrong
            known = {drafted: torch.zeros(B, 0), **({} if probs is None else {name: torch.from_numpy(probs)})}
            drawn = plan_draft(known, torch.from_numpy(forecast), cost=cost, pass_cost=self.pass_price(B),
                               chain=drafted)
            plan = (int(drawn.passes), None if drawn.free_depth is None else drawn.free_depth.numpy())
        passes = max(0, min(plan[0], k_sched))
        # no pass: the model drafts nothing and the plan's allocation of the recomputed chain is the step's
        depth = np.asarray(plan[1], dtype=np.int64) if passes == 0 and plan[1] is not None else None
        if passes == 0 and self.admit_at_entry:
            retirement.admitting = self.admission_question(dec, inputs, batch_columns, B, k_sched)
        if name is not None:  # the decision after drafting sees the same chains and history: it reuses these
            self.planned = PlannedStep(name, contexts.keys, probs, depth, columns)
        self.set_passes(scheduler_output, passes, k_sched, start)

    def admission_question(self, dec, inputs, columns: np.ndarray | None, B: int, k_sched: int):
        """The question a newcomer to this batch is asked (:attr:`calib.vllm.retire.DrafterRetirement.admitting`,
        asked only when one comes): would a pass pay for one more request even in the batch's best case, every
        request offering nothing on the other chains and none retired (their forecasts as fresh), the newcomer with the
        most favourable? If not, the model chain cannot pay at this batch size and a newcomer is retired at admission;
        where it can, the streak decides (retiring is for good, and a batch retired at admission would never pass
        again: one request's pass does not pay where a fresh batch's would).

        ``columns``: the forecast's context columns of ``inputs`` as the plan read them; None: read when asked, from
        the temperatures alone where the forecast has no other axis (else now: the history moves by then). The plan's
        probabilities of the recomputed chain are not needed: the best case offers nothing there."""
        tables, drafted, cost = dec.tables, dec.engine_chain, dec.cost
        meta = tables.forecast(drafted)
        axes = tuple(a["name"] for a in meta["axes"])
        if columns is None and any(a != "temperature" for a in axes):
            columns = context_columns(axes, inputs, dec.history)
        name = self.plan_chain

        def admitting() -> bool:
            cols = columns if columns is not None else context_columns(axes, inputs, dec.history)
            fresh = self.forecast(tables, drafted, meta, cols, k_sched)  # [B, k_sched], held
            chains = {drafted: torch.zeros(B, 0), **({} if name is None else {name: torch.zeros(B, 1)})}  # shapes
            return not newcomer_drafts(best_case(chains, drafted), fresh, fresh.amax(dim=0), cost=cost,
                                       pass_cost=self.pass_price(B + 1), chain=drafted)

        return admitting

    def admit_newcomers(self, req_ids) -> None:
        """Before the step's plan: retire the step's newcomers that the last plan said would not pay, or that the
        scheduler admitted without the head's block (:meth:`calib.vllm.retire.DrafterRetirement.admit`)."""
        admitted = self.retirement.admit(req_ids)
        self.stats.retired += admitted
        self.stats.retired_at_admission += admitted

    def plans_for(self, gone) -> bool:
        """Whether the step's plan of draft passes is made, ``gone`` the step's requests' retirement ([B] bools, or
        empty: none retired): not when every request is retired, as no request is offered the model chain and no pass
        can pay for one. Inside the engine each of the plan's torch calls starts cold (docs/profile.md)."""
        return not (gone and all(gone))

    @property
    def admit_at_entry(self) -> bool:
        """Whether newcomers may be retired at admission (knob ``retire_at_admission``, with retiring on)."""
        return self.knobs.retire_at_admission and self.retirement.after > 0

    def pass_price(self, B: int) -> float:
        """The price of one model-drafter pass in a batch of ``B`` requests, in the cost curve's unit: the engine
        step-cost model's where it prices a pass, else a fraction of ``C(B)``; kept per ``B``."""
        price = self.pass_prices.get(B)
        if price is None:
            step = step_pass_price(self.cost_text, B, self.k)
            cost = self.decider.cost
            price = self.pass_prices[B] = (step if step is not None
                                           else self.draft_cost * float(cost[min(B, cost.numel() - 1)]))
        return price

    def host_cost(self, cost: torch.Tensor) -> np.ndarray:
        """The verify-cost curve ``cost`` (checked at construction) as float64 numpy, made once per curve."""
        held = self.cost64
        if held is None or held[0] is not cost:
            held = self.cost64 = (cost, cost.detach().cpu().to(torch.float64).numpy())
        return held[1]

    def forecast(self, tables, drafted: str, meta: dict, columns: np.ndarray, k_sched: int,
                 host: bool = False) -> torch.Tensor | np.ndarray:
        """:func:`calib.allocate.forecast_probs` of the model chain ``[B, k_sched]`` in the requests' context cells
        (``columns``, float64 ``[B, A]``), kept per distinct columns while the tables hold the same forecast: its
        axes are few (the temperature, in the shipped tables), so a batch's forecast rarely changes between steps.
        ``host``: as a numpy view (kept too: no torch call in a step that finds it held)."""
        key = (drafted, k_sched, columns.shape, columns.tobytes())
        held = self.forecasts.get(key)
        if held is None or held[0] is not meta["values"]:
            if len(self.forecasts) >= 256:  # batches come and go: keep the newest few
                self.forecasts.clear()
            fresh = forecast_probs(tables, drafted, torch.from_numpy(columns), depths=k_sched)
            held = self.forecasts[key] = (meta["values"], fresh, fresh.detach().cpu().numpy())
        return held[2] if host else held[1]

    def set_passes(self, scheduler_output, passes: int, k_sched: int, start: float) -> None:
        """Run ``passes`` draft passes this step (vLLM would run ``k_sched``); counted in the statistics."""
        scheduler_output.num_spec_tokens_to_schedule = passes
        self.passes_now = passes  # this step's decision reads it (Server.step: a step vLLM drafted nothing on)
        s = self.stats
        s.planned += 1
        s.passes_planned += passes
        s.passes_engine += k_sched
        s.plan_ms.append((time.perf_counter() - start) * 1e3)

    # -- the decision ----------------------------------------------------------------------------

    def planned_decision(self, inputs, planned: PlannedStep | None):
        """The plan's own allocation when it ran no draft pass (:attr:`calib.allocate.DraftPlan.free_depth`):
        the step then offers the plan's recomputed chain alone, on the contexts the plan saw for every request
        (:attr:`step_keys`, set by the decision's offers), and the allocator on it would decide the same; None when
        any of that does not hold (decide as usual)."""
        if planned is None or planned.depth is None or not self.decider.enabled:  # the plan ran a pass: decide
            return None
        offer = inputs.offers.get(planned.chain)
        if offer is None or len(inputs.offers) != 1:
            return None
        if len(planned.keys) != len(inputs.req_ids):  # another batch prices every slot differently (cost[B + m])
            return None
        rows = planned.rows(self.step_keys)
        if rows is None or len(self.step_keys) != len(inputs.req_ids):
            return None
        start = time.perf_counter()
        depth, probs = planned.depth[rows], planned.probs[rows]  # int64 [B], float32 [B, W]
        drafts = []
        for b, (t, d) in enumerate(zip(offer.tokens, depth.tolist())):
            if d > len(t):  # the allocator verifies only tokens it was given: a bug if not
                raise RuntimeError(f"request {inputs.req_ids[b]}: planned depth {d} but the chain has {len(t)} tokens")
            drafts.append(list(t[:d]))
        width = max(1, int(depth.max(initial=0)))
        if probs.shape[1] < width:
            probs = np.pad(probs, ((0, 0), (0, width - probs.shape[1])), constant_values=np.nan)
        verified = np.arange(width)[None, :] < depth[:, None]  # [B, W]: the verified prefixes
        taken = np.where(verified, probs[:, :width], np.float32(np.nan))  # float32
        # calib.metrics.expected_accepted_length of the verified prefixes, its float64 sums: a chain ends at its depth
        # or at a NaN (fmax makes it 0, which keeps every later product 0), each value clipped to [0, 1]
        p = np.fmin(np.fmax(taken.astype(np.float64), 0.0), 1.0)
        expected = np.cumprod(p, axis=1).sum(axis=1).astype(np.float32)
        ids = np.where(depth > 0, np.int8(chain(planned.chain).id), np.int8(NO_CHAIN))
        self.stats.plan_decided += 1
        context = planned.columns if isinstance(rows, slice) else {k: v[rows] for k, v in planned.columns.items()}
        return StepDecision(list(inputs.req_ids), drafts, ids, depth.astype(np.int32), expected,  # numpy: no torch call
                            (time.perf_counter() - start) * 1e3, probs=taken, context=context)
