"""Serving mode inside vLLM: every step, calib decides each request's draft (docs/serving_design.md).

Installed by the plugin (:func:`calib.collect.plugin.register`) when ``CALIB_SERVE_TABLES`` names a
tables folder; nothing is installed otherwise. Four wrappers on the V1 model runner (``CPUModelRunner``
subclasses ``GPUModelRunner``, so one patch covers both), all in the worker process:

* ``GPUModelRunner.take_draft_token_ids`` — **the decision point** (once per step, after bookkeeping,
  before the scheduler stores the lists): per request, the engine's draft (model chain) with its
  per-depth confidences, and the n-gram chain recomputed from the request's tokens with
  :func:`calib.ngram.find_match` (as the collector does), go through :class:`calib.serve.SafeDecider`;
  the returned :class:`DraftTokenIds` holds per request a prefix of the model draft, a prefix of the
  n-gram chain, or ``[]``, never more than ``num_speculative_tokens`` tokens (a longer list crashes
  vLLM's spec-decode metrics, design note claim 3).
* ``GPUModelRunner._sample`` — the rejection sampler's output: per request accepted / drafted, fed to
  the decider's :class:`~calib.serve.RequestHistory` (``prev_accept``, ``mean_accept``, ``position``).
* ``GPUModelRunner.propose_draft_token_ids`` + ``SpecDecodeBaseProposer._sample_draft_tokens`` — the
  drafter's probability of each token it proposed, per depth (EAGLE / draft model; the greedy path
  recomputes vLLM's own argmax on the same logits, as :mod:`calib.collect.hooks` does).
* ``GPUModelRunner._update_states`` — finished requests leave the history.
* Before the drafter runs (same ``propose_draft_token_ids`` wrapper, model drafter, ``CALIB_SERVE_PLAN``):
  this step's draft passes, ``scheduler_output.num_spec_tokens_to_schedule`` in 0..K, from
  :func:`calib.allocate.plan_draft` on the n-gram chains (known in full) and the tables' forecast of the
  model chain (:meth:`Server.plan_passes`; design note claim 4).

``CALIB_SERVE_CHAINS`` names the chains calib may verify (``model,ngram``: two drafters; ``model``: only
truncate the drafter's own chain).

The decider is built lazily at the first step (the API-server and engine-core processes load the
plugin too and never reach a runner), with the engine's model id (``CALIB_SERVE_MODEL_ID``, default
the model folder's name), speculator (``ngram`` or ``<method>:<drafter folder name>``) and K
(``num_speculative_tokens``), and the parametric verify cost ``CALIB_SERVE_COST`` =
``weight_read,per_position`` (``C(T) = weight_read + per_position * T``, conf/cost/parametric.yaml).

Never raises into the engine: a failed construction or check (wrong tables, async scheduling, a
non-standard rejection sampler) logs one error and leaves vLLM's own drafts untouched for the run; a
failing step passes vLLM's lists through (SafeDecider counts, warns once, disables after 3 in a row).
Probabilistic drafting (``draft_sample_method="probabilistic"`` at T > 0: ``runner._draft_probs`` set)
is passed through too: a substituted chain would be verified against the wrong q (claim 2).

With capture on as well (``CALIB_COLLECT_DIR``), both work: capture's ``_sample`` wrapper records the
tokens actually verified (``drafted``, i.e. calib's choice) next to the recomputed n-gram chain, and the
chain calib chose (``verified_chain``, from :attr:`Server.chosen`); the bank's speculator.parquet then
has a ``verified_chain`` column, a round whose n-gram chain was verified instead of the drafter's has
empty drafter columns and a "verified" n-gram row, so each chain's labels stay its own
(calib/collect/assemble.py). The greedy ``_sample_draft_tokens`` path here feeds capture's
:meth:`Recorder.record_depth` too. Truncation by calib censors the drafter's rounds on what it knew
(confidences, context), as vLLM's own K does.

Per-process statistics: :func:`stats` (:class:`ServeStats`: steps, decisions, replaced / truncated /
substituted / emptied lists, ``allocator_ms``), one log line at exit.
"""

from __future__ import annotations

import atexit
import logging
import math
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from calib.collect.hooks import takes_plain_argmax
from calib.cost.serving import cost_curve
from calib.ngram import find_match

log = logging.getLogger("calib.serve")

MODEL, NGRAM = "model", "ngram"


@dataclass
class ServeStats:
    """What serving did in this process (the worker)."""

    steps: int = 0  # take_draft_token_ids calls with drafts
    decided: int = 0  # steps calib decided (not passed through)
    passthrough: int = 0  # steps vLLM's own lists were kept (not ready, failed, disabled, probabilistic)
    probabilistic: int = 0  # of which: probabilistic draft probs (passed through by rule)
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
    passes_engine: int = 0  # draft passes vLLM would have run on those steps
    passes_planned: int = 0  # ... and the passes calib ran instead
    plan_ms: list[float] = field(default_factory=list)  # per planned step: n-gram chains + forecast + plan_draft
    draft_ms: list[float] = field(default_factory=list)  # per step: vLLM's drafting (propose_draft_token_ids)
    step_ms: list[float] = field(default_factory=list)  # wall time between consecutive decisions (one engine step)
    errors: int = 0  # exceptions caught in the hooks themselves
    disabled_reason: str | None = None  # why the decider was not built (None: built, or not reached)

    def as_dict(self) -> dict:
        return asdict(self)

    def summary(self) -> str:
        ms = self.allocator_ms
        hk = self.hook_ms
        mean = (sum(ms) / len(ms)) if ms else math.nan
        return (f"calib serve: {self.steps} steps, {self.decided} decided, {self.passthrough} passed through "
                f"({self.probabilistic} probabilistic); {self.requests} request-steps, {self.replaced} replaced "
                f"({self.truncated} truncated, {self.substituted} substituted, {self.emptied} emptied); draft "
                f"tokens {self.tokens_engine} -> {self.tokens_out}; allocator_ms mean {mean:.2f} max "
                f"{max(ms, default=math.nan):.2f}; hook_ms mean {(sum(hk) / len(hk)) if hk else math.nan:.2f}; "
                f"draft passes {self.passes_engine} -> {self.passes_planned} on {self.planned} planned steps "
                f"(plan_ms mean {(sum(self.plan_ms) / len(self.plan_ms)) if self.plan_ms else math.nan:.2f}); "
                f"{self.errors} hook errors" + (f"; OFF: {self.disabled_reason}" if self.disabled_reason else ""))


class Server:
    """Per-process serving state: the lazily built decider, drafter confidences, statistics."""

    def __init__(self, tables: str, cost: str = "1.0,0.01", model_id: str | None = None,
                 ngram: tuple[int, int, int] = (1, 4, 4), chains: str = "model,ngram", plan: bool = True,
                 draft_cost: float = 0.24):
        self.tables_dir = str(tables)
        self.cost_text = cost
        self.model_id = model_id
        self.default_ngram = tuple(int(x) for x in ngram)
        self.chains = tuple(c.strip() for c in str(chains).split(",") if c.strip())
        self.plan = bool(plan)
        if not (math.isfinite(float(draft_cost)) and float(draft_cost) >= 0):
            raise ValueError(f"CALIB_SERVE_DRAFT_COST={draft_cost!r}: must be a number >= 0")
        self.draft_cost = float(draft_cost)
        self.planning = False  # set at construction: a model drafter whose passes calib chooses
        self.decider = None
        self.failed = False  # construction failed: pass-through for the run
        self.stats = ServeStats()
        self.rows: list | None = None  # per-depth confidences of the drafting pass in progress
        self.conf: dict[str, list[float]] = {}  # req_id -> confidence per depth of its latest draft
        self.chosen: dict[str, str] = {}  # req_id -> the chain handed back for its next verify (capture reads it)
        self.last_take: float | None = None  # perf_counter at the previous decision (step_ms)
        self.matches: dict[str, tuple] = {}  # req_id -> ((req_id, context length, last token), chain, features)
        self.planned: dict[str, tuple] = {}  # req_id -> (match key, n-gram probs [L]) from this step's plan
        self._error_logged = 0

    # -- construction ----------------------------------------------------------------------------
    def ensure(self, runner):
        """The decider, built at first use from the runner's config; None (pass-through) if it cannot be."""
        if self.decider is not None or self.failed:
            return self.decider
        try:
            self.decider = self._build(runner)
            log.info("calib serve: deciding drafts with tables %s (engine chain %s, chains %s, K=%d, "
                     "ngram %s)", self.tables_dir, self.decider.engine_chain, self.decider.chains,
                     self.k, self.ngram)
        except Exception as exc:  # noqa: BLE001 - never raise into the engine
            self.failed = True
            self.stats.disabled_reason = f"{type(exc).__name__}: {exc}"
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
        method = sc.method
        if method not in ("ngram", "eagle", "eagle3", "draft_model"):
            raise RuntimeError(f"speculative method {method!r} is not supported (ngram, eagle, eagle3, draft_model)")
        rsm = getattr(sc, "rejection_sample_method", "standard")
        if rsm != "standard":
            raise RuntimeError(f"rejection_sample_method={rsm!r}: only 'standard' is lossless under substitution")
        self.k = int(sc.num_speculative_tokens)
        speculator = "ngram" if method == "ngram" else f"{method}:{Path(str(sc.model)).name}"
        model_id = self.model_id or Path(str(runner.model_config.model)).name
        if method == "ngram":
            self.ngram = (int(sc.prompt_lookup_min), int(sc.prompt_lookup_max), self.k)
        else:
            lo, hi, k = self.default_ngram
            self.ngram = (lo, hi, min(k, self.k))
        cost = cost_curve(self.cost_text, int(runner.max_num_reqs) * (self.k + 1))
        self.max_model_len = getattr(runner, "max_model_len", None)
        dec = SafeDecider(self.tables_dir, model_id=model_id, speculator=speculator, k_max=self.k,
                          method=method, chains=self.chains, cost=cost)
        self.ngram_own = []
        if NGRAM in dec.chains:
            from calib.serve.decide import feature_names, split_context

            self.ngram_own = split_context(feature_names(dec.tables, NGRAM), NGRAM)[0]
        self.planning = (self.plan and dec.engine_chain == MODEL
                         and dec.tables.meta["chains"].get(MODEL, {}).get("forecast") is not None)
        if self.plan and dec.engine_chain == MODEL and not self.planning:
            log.warning("calib serve: the tables hold no forecast of the model chain (re-run train.py): vLLM "
                        "keeps drafting K=%d passes per step; calib only truncates or substitutes", self.k)
        return dec

    def error(self, where: str, exc: BaseException) -> None:
        self.stats.errors += 1
        self._error_logged += 1
        if self._error_logged <= 3:
            log.warning("calib serve hook failed in %s (vLLM's own drafts kept): %s", where, exc, exc_info=exc)

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
        num_draft = spec_decode_metadata.num_draft_tokens
        sampled = sampled_token_ids.cpu()
        accepted = ((sampled != -1).sum(dim=1) - 1).tolist()
        for i, req_id in enumerate(runner.input_batch.req_ids[: len(num_draft)]):
            d = int(num_draft[i])
            if d:
                dec.observe(req_id, max(0, min(int(accepted[i]), d)), d)

    def finished(self, req_ids) -> None:
        for r in req_ids:
            self.conf.pop(r, None)
            self.matches.pop(r, None)
            self.chosen.pop(r, None)
            if self.decider is not None:
                self.decider.finish(r)

    def ngram_chains(self, batch, rows: list[int], extra: list[list[int]] | None = None):
        """Per batch row in ``rows``: the n-gram chain (``[B][<= K]``) vLLM's proposer would draft from the
        request's tokens (``token_ids_cpu[:num_tokens_no_spec]``, then ``extra[b]`` when bookkeeping has
        not appended this step's tokens yet), and its features float32 ``[B, L, F]`` for the tables."""
        from calib.serve.decide import ngram_feature_tensor

        lo, hi, k = self.ngram
        tokens, feats = [], []
        for b, i in enumerate(rows):
            n = int(batch.num_tokens_no_spec[i])
            ctx = batch.token_ids_cpu[i, :n]
            if extra is not None and extra[b]:
                ctx = np.concatenate([ctx, np.asarray(extra[b], dtype=ctx.dtype)])
            # The plan (before bookkeeping) and the decision (after it) see the same context: match once.
            key = (batch.req_ids[i], int(ctx.shape[0]), int(ctx[-1]) if ctx.shape[0] else -1)
            hit = self.matches.get(key[0])
            if hit is not None and hit[0] == key:
                toks, feat = hit[1], hit[2]
            else:
                m = find_match(ctx, lo, hi, k, int(batch.num_prompt_tokens[i]), self.max_model_len)
                toks = [int(t) for t in m.tokens][: self.k]
                feat = m.features() if toks else None
                self.matches[key[0]] = (key, toks, feat)
            tokens.append(toks)
            feats.append(feat)
        width = max(1, max((len(t) for t in tokens), default=0))
        return tokens, ngram_feature_tensor(feats, [len(t) for t in tokens], self.ngram_own, width)

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
        context (design note claim 4). Leaves vLLM's K on anything unexpected."""
        dec = self.decider
        if dec is None or not dec.enabled or not self.planning:
            return
        k_sched = int(getattr(scheduler_output, "num_spec_tokens_to_schedule", self.k) or 0)
        if k_sched <= 0:
            return
        start = time.perf_counter()
        from calib.allocate import calibrated_probs, forecast_probs, plan_draft
        from calib.serve.decide import _context_columns, chain_inputs

        batch = runner.input_batch
        req_ids = list(batch.req_ids)
        B = len(req_ids)
        if B == 0:
            return
        rows = list(range(B))
        temps = [float(batch.temperature_cpu[i]) for i in rows]
        extra = None
        if isinstance(sampled_token_ids, torch.Tensor):  # padded EAGLE: drafting runs before bookkeeping
            sampled = sampled_token_ids.detach().cpu().tolist()
            extra = [[t for t in r if t >= 0] for r in sampled[:B]]
        tables = dec.tables
        known = {MODEL: torch.zeros(B, 0)}
        from calib.serve import StepInputs

        if NGRAM in dec.chains:
            toks, feats = self.ngram_chains(batch, rows, extra)
            inputs = StepInputs(req_ids, temps, ngram_tokens=toks, ngram_features=feats)
            signals, _ = chain_inputs(tables, inputs, dec.history, k_max=self.k)
            known[NGRAM] = calibrated_probs(tables, {NGRAM: signals[NGRAM]})[NGRAM].to(torch.float32)
            # the decision after drafting sees the same chains and history: it reuses these
            self.planned = {r: (self.matches[r][0], known[NGRAM][b]) for b, r in enumerate(req_ids)
                            if r in self.matches}
        else:
            inputs = StepInputs(req_ids, temps)
        axes = [a["name"] for a in tables.meta["chains"][MODEL]["forecast"]["axes"]]
        ctx = torch.from_numpy(_context_columns(axes, inputs, dec.history))
        forecast = forecast_probs(tables, MODEL, ctx, depths=k_sched)  # [B, k_sched]
        cost = dec.cost
        pass_cost = self.draft_cost * float(cost[min(B, cost.numel() - 1)])
        plan = plan_draft(known, forecast, cost=cost, pass_cost=pass_cost, chain=MODEL)
        passes = max(0, min(int(plan.passes), k_sched))
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
        if getattr(runner, "_draft_probs", None) is not None:  # probabilistic drafting: not lossless to edit
            self.stats.passthrough += 1
            self.stats.probabilistic += 1
            return out
        req_ids = list(out.req_ids)
        engine = [list(map(int, t)) for t in out.draft_token_ids]
        if len(engine) != len(req_ids):
            raise RuntimeError(f"vLLM handed {len(engine)} draft lists for {len(req_ids)} requests")
        K = self.k
        batch = runner.input_batch
        rows = [batch.req_id_to_index[r] for r in req_ids]
        temps = [float(batch.temperature_cpu[i]) for i in rows]
        model_tokens = model_conf = ngram_tokens = ngram_feats = None
        if dec.engine_chain != NGRAM:
            model_tokens, conf = [], torch.full((len(req_ids), K), math.nan)
            for b, (r, toks) in enumerate(zip(req_ids, engine)):
                c = self.conf.get(r, [])[: len(toks)]
                model_tokens.append(toks[: len(c)])  # a depth without its confidence is not offered
                if c:
                    conf[b, : len(c)] = torch.tensor(c[:K])
            model_conf = conf
        ngram_probs = None
        if NGRAM in dec.chains:
            ngram_tokens, ngram_feats = self.ngram_chains(batch, rows)
            if dec.engine_chain == NGRAM:
                self.stats.ngram_mismatch += sum(a != b for a, b in zip(ngram_tokens, engine))
            ngram_probs = self.planned_probs(req_ids)
        self.planned = {}
        d = dec.decide(StepInputs(req_ids, temps, model_tokens, model_conf, ngram_tokens, ngram_feats,
                                  ngram_probs))
        if d.passthrough:
            self.stats.passthrough += 1
            return out
        drafts = d.drafts
        if len(drafts) != len(req_ids) or any(len(x) > K or any(t < 0 for t in x) for x in drafts):
            raise RuntimeError("decision out of bounds (more than K tokens, or a negative id)")
        from calib.chains import NO_CHAIN, chain

        for r, cid, x in zip(req_ids, d.chain.tolist(), drafts):
            self.chosen[r] = chain(int(cid)).name if (cid != NO_CHAIN and x) else None
        s = self.stats
        s.decided += 1
        s.requests += len(req_ids)
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
        s.allocator_ms.append(float(d.allocator_ms))
        s.hook_ms.append((time.perf_counter() - start) * 1e3)
        return type(out)(req_ids, drafts)


_SERVER: Server | None = None


def server() -> Server | None:
    return _SERVER


def stats() -> ServeStats | None:
    """This process's serving statistics (None: serving hooks not installed here)."""
    return _SERVER.stats if _SERVER is not None else None


def install(tables: str, cost: str = "1.0,0.01", model_id: str | None = None,
            ngram: tuple[int, int, int] = (1, 4, 4), *, chains: str = "model,ngram", plan: bool = True,
            draft_cost: float = 0.24) -> Server:
    """Patch the V1 model runner and the proposer base class for serving (idempotent).

    Install after :func:`calib.collect.hooks.install` when both are on (the plugin does): these
    wrappers then sit outside capture's and hand the greedy drafter's distribution to it.
    """
    global _SERVER
    if _SERVER is not None:
        return _SERVER
    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    srv = _SERVER = Server(tables, cost, model_id, ngram, chains, plan, draft_cost)
    _ensure_log_handler()

    orig_take = GPUModelRunner.take_draft_token_ids

    def take_draft_token_ids(self):
        now = time.perf_counter()
        if srv.last_take is not None:
            srv.stats.step_ms.append((now - srv.last_take) * 1e3)
        srv.last_take = now
        out = orig_take(self)
        if out is None:
            return out
        try:
            return srv.step(self, out)
        except Exception as exc:  # noqa: BLE001 - serving never raises into the engine
            srv.error("take_draft_token_ids", exc)
            return out

    orig_sample = GPUModelRunner._sample

    def _sample(self, logits, spec_decode_metadata):
        out = orig_sample(self, logits, spec_decode_metadata)
        if spec_decode_metadata is not None:
            try:
                srv.observe(self, spec_decode_metadata, out.sampled_token_ids)
            except Exception as exc:  # noqa: BLE001
                srv.error("_sample", exc)
        return out

    orig_propose = GPUModelRunner.propose_draft_token_ids

    def propose_draft_token_ids(self, scheduler_output, sampled_token_ids, *args, **kwargs):
        try:
            if srv.planning:
                srv.plan_passes(self, scheduler_output, sampled_token_ids)
        except Exception as exc:  # noqa: BLE001 - vLLM keeps its own K for this step
            srv.error("plan_passes", exc)
        srv.rows = []
        start = time.perf_counter()
        try:
            return orig_propose(self, scheduler_output, sampled_token_ids, *args, **kwargs)
        finally:
            srv.stats.draft_ms.append((time.perf_counter() - start) * 1e3)
            try:
                srv.finish_drafting(list(self.input_batch.req_ids))
            except Exception as exc:  # noqa: BLE001
                srv.rows = None
                srv.error("propose_draft_token_ids", exc)

    orig_update = GPUModelRunner._update_states

    def _update_states(self, scheduler_output):
        try:
            srv.finished(scheduler_output.finished_req_ids)
        except Exception as exc:  # noqa: BLE001
            srv.error("_update_states", exc)
        return orig_update(self, scheduler_output)

    orig_draft = SpecDecodeBaseProposer._sample_draft_tokens

    def _sample_draft_tokens(self, hidden_states, sampling_metadata):
        if srv.rows is None:
            return orig_draft(self, hidden_states, sampling_metadata)
        if takes_plain_argmax(self, sampling_metadata, SpecDecodeBaseProposer):
            # Exactly SpecDecodeBaseProposer._greedy_sample, keeping the logits it discards.
            logits = self.model.compute_logits(hidden_states)
            token_ids = logits.argmax(dim=-1)
            try:
                probs = torch.softmax(logits.float(), dim=-1)
                srv.record_depth(token_ids, probs.gather(-1, token_ids.view(-1, 1).long()).squeeze(-1))
                from calib.collect.hooks import recorder

                rec = recorder()
                if rec is not None and rec.depth_rows() is not None:  # capture on too: it sees this depth
                    rec.record_depth(token_ids, probs)
            except Exception as exc:  # noqa: BLE001
                srv.error("_sample_draft_tokens", exc)
            return token_ids, None
        token_ids, probs = orig_draft(self, hidden_states, sampling_metadata)
        if probs is not None:
            try:
                srv.record_depth(token_ids, probs.float().gather(-1, token_ids.view(-1, 1).long()).squeeze(-1))
            except Exception as exc:  # noqa: BLE001
                srv.error("_sample_draft_tokens", exc)
        return token_ids, probs

    GPUModelRunner.take_draft_token_ids = take_draft_token_ids
    GPUModelRunner._sample = _sample
    GPUModelRunner.propose_draft_token_ids = propose_draft_token_ids
    GPUModelRunner._update_states = _update_states
    SpecDecodeBaseProposer._sample_draft_tokens = _sample_draft_tokens
    atexit.register(_log_summary)
    log.info("calib serving hooks installed (pid %d), tables %s", os.getpid(), tables)
    return srv


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
