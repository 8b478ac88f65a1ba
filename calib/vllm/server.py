"""Serving's per-process state inside vLLM: the decider, drafter confidences, statistics (docs/serving_hooks.md).

:mod:`calib.vllm.serving` subscribes it to the patch set over vLLM's runner.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from calib.chains import chain_names
from calib.cost.serving import cost_curve, step_pass_price
from calib.serve.aside import StandAside, batch_key, decision_kind
from calib.serve.knobs import ServeKnobs
from calib.vllm.ranks import digest

log = logging.getLogger("calib.serve")



@dataclass
class ServeStats:
    """What serving did in this process (the worker)."""

    steps: int = 0  # take_draft_token_ids calls with drafts
    decided: int = 0  # steps calib decided (not passed through)
    passthrough: int = 0  # steps vLLM's own lists were kept (not ready, failed, disabled)
    probabilistic: int = 0  # steps with probabilistic draft probs (runner._draft_probs), decided or not
    probabilistic_decided: int = 0  # ... of which calib decided (causal cut, draft probs rebuilt)
    requests: int = 0  # request-steps decided
    replaced: int = 0  # request-steps whose list differs from vLLM's
    truncated: int = 0  # ... a strict non-empty prefix of vLLM's draft
    substituted: int = 0  # ... the other chain (n-gram for a model drafter, or the reverse)
    emptied: int = 0  # ... [] where vLLM had a draft
    tokens_engine: int = 0  # draft tokens vLLM proposed on decided steps
    tokens_out: int = 0  # draft tokens handed back on decided steps
    ngram_mismatch: int = 0  # n-gram engine: recomputed chain != vLLM's own (should stay 0)
    allocator_ms: list[float] = field(default_factory=list)  # per decided step: SafeDecider (inputs + allocate)
    hook_ms: list[float] = field(default_factory=list)  # per decided step: the whole hook (n-gram recompute too)
    planned: int = 0  # steps whose draft passes calib chose (plan_draft)
    plan_decided: int = 0  # decided steps whose allocation was the plan's own (0 passes: no second allocation)
    passes_engine: int = 0  # draft passes vLLM would have run on those steps
    passes_planned: int = 0  # ... and the passes calib ran instead
    plan_ms: list[float] = field(default_factory=list)  # per planned step: n-gram chains + forecast + plan_draft
    draft_ms: list[float] = field(default_factory=list)  # per step: vLLM's drafting (propose_draft_token_ids)
    step_ms: list[float] = field(default_factory=list)  # wall time between consecutive decisions (one engine step)
    observe_ms: list[float] = field(default_factory=list)  # per verified step: history and online correction
    left_to_vllm: int = 0  # request-steps left to vLLM: target-only logit transforms (calib/transforms.py)
    oracle_known: int = 0  # the clock oracle (knob oracle): request-steps it decided from the reference continuation
    oracle_unknown: int = 0  # ... whose continuation it did not know (vLLM's own draft kept)
    oracle: bool = False  # the clock oracle decided this process's steps (knob oracle)
    aside_engine: int = 0  # steps calib stood aside on, handing vLLM's own drafts through (calib/serve/aside.py)
    aside_none: int = 0  # ... scheduling no draft tokens (and, with a model drafter, no draft pass)
    errors: int = 0  # exceptions caught in the hooks themselves
    disabled_reason: str | None = None  # why the decider was not built (None: built, or not reached)

    def as_dict(self) -> dict:
        return asdict(self)

    def summary(self) -> str:
        ms = self.allocator_ms
        hk = self.hook_ms
        mean = (sum(ms) / len(ms)) if ms else math.nan
        return (f"calib serve: {self.steps} steps, {self.decided} decided, {self.passthrough} passed through "
                f"({self.probabilistic} probabilistic steps, {self.probabilistic_decided} decided); "
                f"{self.requests} request-steps, {self.replaced} replaced "
                f"({self.truncated} truncated, {self.substituted} substituted, {self.emptied} emptied); draft "
                f"tokens {self.tokens_engine} -> {self.tokens_out}; allocator_ms mean {mean:.2f} max "
                f"{max(ms, default=math.nan):.2f}; hook_ms mean {(sum(hk) / len(hk)) if hk else math.nan:.2f}; "
                f"draft passes {self.passes_engine} -> {self.passes_planned} on {self.planned} planned steps "
                f"({self.plan_decided} allocated by the plan) "
                f"(plan_ms mean {(sum(self.plan_ms) / len(self.plan_ms)) if self.plan_ms else math.nan:.2f}); "
                f"{self.left_to_vllm} request-steps left to vLLM (logit transforms); "
                f"stood aside on {self.aside_engine} steps (vLLM's drafts) and {self.aside_none} (no drafts); "
                + (f"oracle {self.oracle_known} known / {self.oracle_unknown} unknown; " if self.oracle else "") +
                f"{self.errors} hook errors" + (f"; OFF: {self.disabled_reason}" if self.disabled_reason else ""))


def keep_engine_rows(drafts: list[list[int]], chain_ids: torch.Tensor, engine: list[list[int]], left: list[bool],
                     engine_chain: str) -> tuple[list[list[int]], torch.Tensor]:
    """A step's decision with the rows ``left`` to vLLM put back to vLLM's own drafts: ``(drafts [B][<= K],
    chain ids int8 [B])``, those rows' chain the engine's (or none where vLLM drafted nothing)."""
    from calib.chains import NO_CHAIN, chain

    out = [list(e) if keep else list(x) for x, e, keep in zip(drafts, engine, left)]
    ids = chain_ids.clone()
    engine_id = chain(engine_chain).id
    for b, keep in enumerate(left):
        if keep:
            ids[b] = engine_id if engine[b] else NO_CHAIN
    return out, ids


def engine_identity(runner, sc) -> dict:
    """The engine's target and drafter by content (:func:`calib.fingerprint.identity`): what the tables'
    fingerprints are compared with; the drafter is the speculative config's model folder (None for n-gram)."""
    from calib.chains import chain_of_method
    from calib.fingerprint import identity

    method = getattr(sc, "method", None)
    try:
        model_free = chain_of_method(method).confidence is None  # n-gram: vLLM sets its draft config to the target's
    except KeyError:
        model_free = False
    draft = getattr(sc, "draft_model_config", None)
    drafter = None if model_free else (getattr(draft, "model", None) or getattr(sc, "model", None))
    return identity(runner.model_config.model, drafter, method,
                    getattr(sc, "num_speculative_tokens", None))


class Server:
    """Per-process serving state: the lazily built decider, drafter confidences, statistics."""

    def __init__(self, knobs: ServeKnobs):
        self.knobs = knobs  # validated at construction (calib.serve.knobs)
        self.tables_dir = knobs.tables
        self.cost_text = knobs.cost
        self.model_id = knobs.model_id
        self.default_ngram = knobs.ngram
        self.chains = tuple(knobs.chains or chain_names())
        self.plan = knobs.plan
        self.draft_cost = knobs.draft_cost
        self.planning = False  # set at construction: a model drafter whose passes calib chooses
        self.lookup: str | None = None  # set at construction: the chain recomputed from the request's tokens
        self.decider = None
        self.failed = False  # construction failed: pass-through for the run
        self.stats = ServeStats()
        self.rows: list | None = None  # per-depth confidences of the drafting pass in progress
        self.conf: dict[str, list[float]] = {}  # req_id -> confidence per depth of its latest draft
        self.chosen: dict[str, str] = {}  # req_id -> the chain handed back for its next verify (capture reads it)
        self.last_take: float | None = None  # perf_counter at the previous decision (step_ms)
        self.matches: dict[str, tuple] = {}  # req_id -> ((req_id, context length, last token), chain, features [F])
        # req_id -> (match key, n-gram probs [L], n-gram depth the plan verifies or None) from this step's plan
        self.planned: dict[str, tuple] = {}
        self.pass_prices: dict[int, float] = {}  # batch size -> the price of one draft pass (plan_passes)
        self.transformed: dict[str, bool] = {}  # req_id -> carries target-only logit transforms (left to vLLM)
        self.ranks = None  # calib.vllm.ranks.RankCheck under tensor parallelism (set at engine start), else None
        self.oracle = None  # calib.serve.oracle.Oracle when knobs.oracle names a reference (set at construction)
        self.aside = StandAside(knobs.aside_after, knobs.aside_every)  # stretches that need no decision
        self.aside_now: tuple | None = None  # (request ids, verdict) the plan of this step's draft passes took
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
                     "ngram %s)", self.tables_dir, self.decider.engine_chain, self.decider.chains,
                     self.k, self.ngram)
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
        from calib.chains import chain, chain_of_method, chains

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
        # the chain calib recomputes from each request's tokens (prompt lookup), None: none registered
        self.lookup = next((k.name for k in chains() if k.propose is not None), None)
        if drafted.name == self.lookup:
            self.ngram = (int(sc.prompt_lookup_min), int(sc.prompt_lookup_max), self.k)
        else:
            lo, hi, k = self.default_ngram
            self.ngram = (lo, hi, min(k, self.k))
        loaded = drafted.confidence is not None  # a model drafter: an engine step cost charges its idle forward
        cost = cost_curve(self.cost_text, int(runner.max_num_reqs) * (self.k + 1), drafter_loaded=loaded)
        self.max_model_len = getattr(runner, "max_model_len", None)
        dec = SafeDecider(self.tables_dir, model_id=model_id, speculator=speculator, k_max=self.k,
                          method=method, chains=self.chains, cost=cost, identity=engine_identity(runner, sc),
                          impl="host",  # numpy on the step's few requests (calib/allocate/host.py)
                          online=self.knobs.online_settings())
        self.ngram_own = []
        if self.lookup in dec.chains:
            from calib.chains import split_context
            from calib.serve.decide import feature_names

            self.ngram_own = split_context(feature_names(dec.tables, self.lookup), self.lookup)[0]
            warm = chain(self.lookup).propose_batch
            if warm is not None:  # compiled now (numba: ~1 s once), not in the first step; vLLM's buffer is int32
                warm(np.zeros((1, 8), dtype=np.int32), [0], [8], [0], self.ngram, self.max_model_len,
                     np.zeros((1, 1), dtype=np.int64), np.zeros(1, dtype=np.int64))
        model_drafter = chain(dec.engine_chain).confidence is not None  # its passes are calib's to plan
        if self.knobs.oracle:  # the clock oracle decides from a reference (plan_passes: 0 or vLLM's K)
            from calib.serve.oracle import Oracle, Reference

            self.oracle, self.stats.oracle = Oracle(Reference.load(self.knobs.oracle)), True
            self.planning = model_drafter
            return dec
        self.planning = self.plan and model_drafter and dec.tables.forecast(dec.engine_chain) is not None
        if self.plan and model_drafter and not self.planning:
            log.warning("calib serve: the tables hold no forecast of the model chain (re-run train.py): vLLM "
                        "keeps drafting K=%d passes per step; calib only truncates or substitutes", self.k)
        return dec

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
        self.failed, self.decider, self.planned = True, None, {}
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
        num_draft = spec_decode_metadata.num_draft_tokens
        sampled = sampled_token_ids.cpu()
        accepted = ((sampled != -1).sum(dim=1) - 1).tolist()
        for i, req_id in enumerate(runner.input_batch.req_ids[: len(num_draft)]):
            d = int(num_draft[i])
            if d:
                dec.observe(req_id, max(0, min(int(accepted[i]), d)), d)
        dec.refresh()  # the online correction learns the step's outcomes, once per step before the next lookup
        self.stats.observe_ms.append((time.perf_counter() - start) * 1e3)

    def left_to_vllm(self, runner, req_ids) -> list[bool]:
        """Per request: whether its sampling parameters apply target-only logit transforms
        (:func:`calib.transforms.target_only_transforms`), so that calib leaves its drafts to vLLM.
        Read once per request from the runner's request states."""
        from calib.transforms import target_only_transforms

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
            self.matches.pop(r, None)
            self.chosen.pop(r, None)
            if self.oracle is not None:
                self.oracle.finish(r)
            if self.decider is not None:
                self.decider.finish(r)

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
        out = torch.full((len(rows), width), math.nan)
        for b, x in enumerate(rows):
            out[b, : x.shape[0]] = x
        return out

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
        from calib.allocate import calibrated_probs, forecast_probs, plan_draft
        from calib.chains import Offer
        from calib.serve.decide import chain_inputs, context_columns

        batch = runner.input_batch
        req_ids = list(batch.req_ids)
        B = len(req_ids)
        if B == 0 or any(self.left_to_vllm(runner, req_ids)):  # a request left to vLLM keeps vLLM's K
            return
        rows = list(range(B))
        temps = [float(batch.temperature_cpu[i]) for i in rows]
        verdict = None if self.oracle is not None else self.aside.verdict(batch_key(temps))
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
            signals, _ = chain_inputs(tables, inputs, dec.history, k_max=self.k)
            known[lookup] = calibrated_probs(tables, {lookup: signals[lookup]})[lookup].to(torch.float32)
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
            self.planned = {r: (self.matches[r][0], known[lookup][b], None if depth is None else depth[b])
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
    def step(self, runner, out):
        """vLLM's ``DraftTokenIds`` -> calib's (or ``out`` itself when passing through)."""
        from calib.serve import StepInputs

        start = time.perf_counter()
        self.stats.steps += 1
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
        temps = [float(batch.temperature_cpu[i]) for i in rows]
        from calib.chains import NO_CHAIN, chain, chains

        key = batch_key(temps)
        verdict = self.aside_verdict(req_ids, key, any(left))
        if verdict == "engine":  # vLLM's own proposal, untouched (calib/serve/aside.py)
            self.stats.aside_engine += 1
            engine_chain = chain(dec.engine_chain).name
            for r, x in zip(req_ids, engine):
                self.chosen[r] = engine_chain if x else None
            self.planned = {}
            self.stats.hook_ms.append((time.perf_counter() - start) * 1e3)
            return out
        d = None
        if verdict == "none":  # no draft tokens: the step costs what a step without speculation costs
            self.stats.aside_none += 1
            self.planned = {}
            drafts, chain_ids = [[] for _ in req_ids], torch.full((len(req_ids),), NO_CHAIN, dtype=torch.int8)
        else:
            planned = self.planned  # offers() clears it
            inputs = StepInputs(req_ids, temps, self.offers(dec, req_ids, engine, batch, rows))
            if self.oracle is not None:  # the clock oracle: the accepted prefix of the chain that commits most
                d, known = self.oracle.decide(inputs, self.oracle.continuations(batch, rows, req_ids, temps, K),
                                              dec.engine_chain, engine)
                self.stats.oracle_known += sum(known)
                self.stats.oracle_unknown += len(known) - sum(known)
            else:
                d = self.decide_sampled(dec, inputs) if sampled else (self.planned_decision(inputs, planned)
                                                                       or dec.decide(inputs))
            if d.passthrough:
                self.stats.passthrough += 1
                return out
            drafts, chain_ids = d.drafts, d.chain
            if any(left):
                drafts, chain_ids = keep_engine_rows(drafts, chain_ids, engine, left, dec.engine_chain)
        if len(drafts) != len(req_ids) or any(len(x) > K or any(t < 0 for t in x) for x in drafts):
            raise RuntimeError("decision out of bounds (more than K tokens, or a negative id)")
        if not self.ranks_agree(digest(drafts), "drafts"):  # before anything this step changes
            return out
        names = {kind.id: kind.name for kind in chains()}  # one registry read per step, not per request
        for r, cid, x in zip(req_ids, chain_ids.tolist(), drafts):
            self.chosen[r] = names[int(cid)] if (cid != NO_CHAIN and x) else None
        # what the online correction learns from once the step is verified (never the requests left to vLLM)
        if d is not None and self.oracle is None:  # the oracle learns nothing
            dec.remember(inputs, d, skip=left)
            self.note_kind(key, decision_kind(drafts, engine) if not any(left) else None)
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
        if self.oracle is not None or any_left:
            return None
        return self.aside.verdict(key)

    def note_kind(self, key: tuple, kind: str | None) -> None:
        """A decided step's kind (:func:`calib.serve.aside.decision_kind`); one log line when a stretch of a
        kind first begins."""
        if self.aside.record(key, kind):
            what = ("hands vLLM's own drafts through" if kind == "engine"
                    else "schedules no draft tokens (no speculation pays at this batch)")
            log.info("calib serve: standing aside at batch %d (temperatures %s): the last %d decisions were %s, "
                     "so calib %s without deciding, deciding again every %d steps or when the batch changes",
                     key[0], sorted(set(key[1])), self.aside.after,
                     "vLLM's own drafts" if kind == "engine" else "no draft tokens", what, self.aside.every)

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

    # -- probabilistic drafting (docs/serving_hooks.md, "Sampled serving"; calib/vllm/sampled.py) ------
    def decide_sampled(self, dec, inputs):
        """:func:`calib.vllm.sampled.decide_sampled`: the causal cut of a sampled model chain."""
        from calib.vllm.sampled import decide_sampled

        return decide_sampled(dec, inputs)

    def rebuild_draft_probs(self, runner, req_ids: list[str], drafts: list[list[int]], chain_ids) -> None:
        """Make the q rows vLLM's rejection sampler reads next step (``runner._draft_probs`` by
        ``_draft_prob_req_ids``, ``[:num_draft]`` per request) follow ``drafts``: model prefixes keep
        their rows, another chain's tokens get one-hot rows (:func:`calib.vllm.sampled.verified_draft_probs`)."""
        from calib.chains import chain
        from calib.vllm import sampled

        model_id = chain(self.decider.engine_chain).id
        from_model = [int(c) == model_id for c in chain_ids.tolist()]
        runner._draft_probs, runner._draft_prob_req_ids = sampled.verified_draft_probs(
            runner._draft_probs, list(runner._draft_prob_req_ids), req_ids, drafts, from_model)
        self.stats.probabilistic_decided += 1

    def offers(self, dec, req_ids: list[str], engine: list[list[int]], batch, rows: list[int]) -> dict:
        """``{chain: Offer}`` at this step: the engine's draft with its confidences (a model drafter), and
        the chain calib recomputes from each request's tokens (with the plan's probabilities, if any)."""
        from calib.chains import Offer, chain

        K, offers = self.k, {}
        if chain(dec.engine_chain).confidence is not None:  # a model drafter: its draft with confidences
            model_tokens, conf = [], torch.full((len(req_ids), K), math.nan)
            for b, (r, toks) in enumerate(zip(req_ids, engine)):
                c = self.conf.get(r, [])[: len(toks)]
                model_tokens.append(toks[: len(c)])  # a depth without its confidence is not offered
                if c:
                    conf[b, : len(c)] = torch.tensor(c[:K])
            # a chain with no token anywhere cannot be chosen: beside the n-gram chain, leave it out and the
            # (cheaper) one-chain rule decides the same
            if any(model_tokens) or self.lookup not in dec.chains:
                offers[dec.engine_chain] = Offer(model_tokens, conf)
        if self.lookup in dec.chains:
            ngram_tokens, ngram_feats = self.ngram_chains(batch, rows)
            if dec.engine_chain == self.lookup:
                self.stats.ngram_mismatch += sum(a != b for a, b in zip(ngram_tokens, engine))
            offers[self.lookup] = Offer(ngram_tokens, ngram_feats, self.planned_probs(req_ids))
        self.planned = {}
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
