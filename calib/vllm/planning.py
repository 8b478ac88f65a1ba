"""The plan of a step's draft passes and the n-gram chains it and the decision share (a part of
:class:`calib.vllm.server.Server`, which inherits it; docs/serving_hooks.md, design note claim 4).

Before the drafter runs, :meth:`DraftPlanning.plan_passes` sets the step's number of model-drafter passes from
the n-gram chain each request will offer (known in full, :meth:`DraftPlanning.ngram_chains`) and the tables'
forecast of the model chain; when it runs none, :meth:`DraftPlanning.planned_decision` is the step's decision.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from calib.cost.serving import step_pass_price
from calib.serve.aside import batch_key


class DraftPlanning:
    """The planning half of the serving state (mixed into :class:`calib.vllm.server.Server`, whose attributes it
    reads: ``decider``, ``lookup``, ``k``, ``ngram``, ``matches``, ``planned``, ``pass_prices``, ``oracle``,
    ``aside``, ``stats``)."""

    def ngram_chains(self, batch, rows: list[int], extra: list[list[int]] | None = None):
        """Per batch row in ``rows``: the n-gram chain (``[B][<= K]``) vLLM's proposer would draft from the
        request's tokens (``token_ids_cpu[:num_tokens_no_spec]``, then ``extra[b]`` when bookkeeping has
        not appended this step's tokens yet), and its features float32 ``[B, L, F]`` for the tables. The plan
        (before bookkeeping) and the decision (after it) see the same context: matched once, for every
        request that needs it in one call (:attr:`calib.chains.ChainKind.propose_batch`)."""
        from calib.chains import chain
        from calib.chains.ngram import batch_feature_tensor

        B = len(rows)
        n_extra = np.array([len(extra[b]) if extra is not None else 0 for b in range(B)], dtype=np.int64)
        n_buf = np.asarray(batch.num_tokens_no_spec)[rows].astype(np.int64)
        total = n_buf + n_extra
        last = [int(extra[b][-1]) if n_extra[b] else (int(batch.token_ids_cpu[i, n_buf[b] - 1]) if n_buf[b] else -1)
                for b, i in enumerate(rows)]
        keys = [(batch.req_ids[i], int(total[b]), last[b]) for b, i in enumerate(rows)]
        miss = [b for b, key in enumerate(keys) if (self.matches.get(key[0]) or (None,))[0] != key]
        if miss:
            pad = np.zeros((len(miss), max(1, int(n_extra.max(initial=0)))), dtype=np.int64)
            for j, b in enumerate(miss):
                pad[j, : n_extra[b]] = extra[b] if n_extra[b] else []
            toks, feats = chain(self.lookup).propose_batch(
                batch.token_ids_cpu, [rows[b] for b in miss], n_buf[miss],
                np.asarray(batch.num_prompt_tokens)[[rows[b] for b in miss]], self.ngram, self.max_model_len,
                pad, n_extra[miss])
            for j, b in enumerate(miss):
                self.matches[keys[b][0]] = (keys[b], toks[j][: self.k], feats[j])
        hits = [self.matches[key[0]] for key in keys]
        tokens = [h[1] for h in hits]
        width = max(1, max((len(t) for t in tokens), default=0))
        feats = np.stack([h[2] for h in hits]) if hits else np.zeros((0, 8))
        return tokens, batch_feature_tensor(feats, [len(t) for t in tokens], self.ngram_own, width)

    def planned_probs(self, req_ids: list[str]) -> torch.Tensor | None:
        """float32 ``[B, W]``: the n-gram probabilities the plan looked up this step, when it did so for
        every request on the chain the decision sees now (same match); else None (look them up)."""
        rows = []
        for r in req_ids:
            hit, match = self.planned.get(r), self.matches.get(r)
            if hit is None or match is None or hit[0] != match[0]:
                return None
            rows.append(hit[1])
        if not rows:
            return None
        width = max(x.shape[0] for x in rows)
        out = np.full((len(rows), width), np.nan, dtype=np.float32)  # numpy rows: no torch call per request
        for b, x in enumerate(rows):
            out[b, : x.shape[0]] = x
        return torch.from_numpy(out)

    # -- the number of draft passes ----------------------------------------------------------------
    def plan_passes(self, runner, scheduler_output, sampled_token_ids) -> None:
        """Before the drafter runs: set this step's draft passes (``num_spec_tokens_to_schedule``,
        batch-wide, 0..K) to :func:`calib.allocate.plan_draft`'s choice, from the n-gram chain each
        request will offer (known in full) and the tables' forecast of the model chain in each request's
        context (design note claim 4). Leaves vLLM's K on anything unexpected.

        The clock oracle (knob ``oracle``) runs no pass where every request's n-gram chain already commits
        ``min(K, what is left of its reference)`` (no model draft could commit more), else leaves vLLM's K:
        it cannot know an EAGLE draft before drafting."""
        dec = self.decider
        if dec is None or not dec.enabled or not self.planning:
            return
        k_sched = int(getattr(scheduler_output, "num_spec_tokens_to_schedule", self.k) or 0)
        if k_sched <= 0:
            return
        start = time.perf_counter()
        from calib.allocate import forecast_probs, plan_draft
        from calib.chains import Offer
        from calib.serve.allocation import host_probs
        from calib.serve.decide import chain_inputs_host, context_columns

        batch = runner.input_batch
        req_ids = list(batch.req_ids)
        B = len(req_ids)
        if B == 0 or any(self.left_to_vllm(runner, req_ids)):  # a request left to vLLM keeps vLLM's K
            return
        rows = list(range(B))
        temps = [float(batch.temperature_cpu[i]) for i in rows]
        verdict = self.fresh_verdict(batch_key(temps))
        self.aside_now = (tuple(req_ids), verdict)  # the decision after drafting takes the same verdict
        if verdict == "none":
            return self.set_passes(scheduler_output, 0, k_sched, start)
        if verdict == "engine":  # vLLM's K passes, its drafts handed through
            return
        extra = None
        if isinstance(sampled_token_ids, torch.Tensor):  # padded EAGLE: drafting runs before bookkeeping
            sampled = sampled_token_ids.detach().cpu().tolist()
            extra = [[t for t in r if t >= 0] for r in sampled[:B]]
        tables, drafted, lookup = dec.tables, dec.engine_chain, self.lookup
        if self.oracle is not None:
            conts = self.oracle.continuations(batch, rows, req_ids, temps, k_sched, extra)
            toks = self.ngram_chains(batch, rows, extra)[0] if lookup in dec.chains else None
            return self.set_passes(scheduler_output, self.oracle.passes(toks, conts, k_sched), k_sched, start)
        known = {drafted: torch.zeros(B, 0)}
        from calib.serve import StepInputs

        if lookup in dec.chains:
            toks, feats = self.ngram_chains(batch, rows, extra)
            inputs = StepInputs(req_ids, temps, {lookup: Offer(toks, feats)})
            signals, _ = chain_inputs_host(tables, inputs, dec.history, k_max=self.k)  # temperatures checked there
            known[lookup] = torch.from_numpy(host_probs(tables, {lookup: signals[lookup]})[lookup])  # float32, numpy
        else:
            inputs = StepInputs(req_ids, temps)
        axes = [a["name"] for a in tables.forecast(drafted)["axes"]]
        ctx = torch.from_numpy(context_columns(axes, inputs, dec.history))
        forecast = forecast_probs(tables, drafted, ctx, depths=k_sched)  # [B, k_sched]
        cost = dec.cost
        pass_cost = self.pass_prices.get(B)
        if pass_cost is None:  # an engine step-cost model prices a pass itself; else a fraction of C(B)
            step = step_pass_price(self.cost_text, B, self.k)
            pass_cost = self.pass_prices[B] = (step if step is not None
                                               else self.draft_cost * float(cost[min(B, cost.numel() - 1)]))
        plan = plan_draft(known, forecast, cost=cost, pass_cost=pass_cost, chain=drafted)
        passes = max(0, min(int(plan.passes), k_sched))
        if lookup in known:  # the decision after drafting sees the same chains and history: it reuses these
            # no pass: the model drafts nothing and the plan's allocation of the n-gram chain is the step's
            depth = plan.free_depth.tolist() if passes == 0 and plan.free_depth is not None else None
            probs = known[lookup].numpy()  # [B, W] rows as numpy views: no torch call per request
            self.planned = {r: (self.matches[r][0], probs[b], None if depth is None else depth[b])
                            for b, r in enumerate(req_ids) if r in self.matches}
        self.set_passes(scheduler_output, passes, k_sched, start)

    def set_passes(self, scheduler_output, passes: int, k_sched: int, start: float) -> None:
        """Run ``passes`` draft passes this step (vLLM would run ``k_sched``); counted in the statistics."""
        scheduler_output.num_spec_tokens_to_schedule = passes
        s = self.stats
        s.planned += 1
        s.passes_planned += passes
        s.passes_engine += k_sched
        s.plan_ms.append((time.perf_counter() - start) * 1e3)

    # -- the decision ----------------------------------------------------------------------------

    def planned_decision(self, inputs, planned: dict):
        """The plan's own allocation when it ran no draft pass (:attr:`calib.allocate.DraftPlan.free_depth`):
        the step then offers the recomputed chain alone, on the match the plan saw for every request, and
        the allocator on it would decide the same; None when any of that does not hold (decide as usual)."""
        from calib.chains import NO_CHAIN, chain
        from calib.metrics import expected_accepted_length
        from calib.serve import StepDecision

        offer = inputs.offers.get(self.lookup)
        if offer is None or len(inputs.offers) != 1 or not self.decider.enabled:
            return None
        if len(planned) != len(inputs.req_ids):  # another batch prices every slot differently (cost[B + m])
            return None
        start = time.perf_counter()
        drafts, probs = [], []
        for b, r in enumerate(inputs.req_ids):
            hit, match = planned.get(r), self.matches.get(r)
            if hit is None or hit[2] is None or match is None or hit[0] != match[0]:
                return None
            depth, toks = int(hit[2]), offer.tokens[b]
            if depth > len(toks):  # the allocator verifies only tokens it was given: a bug if not
                raise RuntimeError(f"request {r}: planned depth {depth} but the chain has {len(toks)} tokens")
            drafts.append(list(toks[:depth]))
            probs.append(hit[1][:depth].tolist())
        depth = torch.tensor([len(x) for x in drafts], dtype=torch.int32)
        taken = np.full((len(drafts), max([1, *map(len, drafts)])), np.nan)  # [B, W]: the verified prefixes
        for b, p in enumerate(probs):
            taken[b, : len(p)] = p
        ids = torch.where(depth > 0, chain(self.lookup).id, NO_CHAIN).to(torch.int8)
        self.stats.plan_decided += 1
        return StepDecision(list(inputs.req_ids), drafts, ids, depth,
                            torch.from_numpy(expected_accepted_length(taken)).to(torch.float32),
                            (time.perf_counter() - start) * 1e3, probs=torch.from_numpy(taken).to(torch.float32))
