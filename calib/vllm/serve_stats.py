"""What serving did in a worker process (:class:`ServeStats`), and two pieces of a step's bookkeeping
:class:`calib.vllm.server.Server` uses: the rows left to vLLM put back, the engine's identity by content."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch


@dataclass
class ServeStats:
    """What serving did in this process (the worker)."""

    steps: int = 0  # take_draft_token_ids calls with drafts
    decided: int = 0  # steps calib decided (not passed through, not stood aside)
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
    ngram_mismatch: int = 0  # a recomputed chain's engine: calib's recomputation != vLLM's own draft (should stay 0)
    chains_left_out: int = 0  # recomputed chains not offered at a step (more than two chains: Server.two_chains)
    allocator_ms: list[float] = field(default_factory=list)  # per decided step: SafeDecider (inputs + allocate)
    hook_ms: list[float] = field(default_factory=list)  # per decided step: the whole hook (n-gram recompute too)
    planned: int = 0  # steps whose draft passes calib chose (plan_draft)
    plan_decided: int = 0  # decided steps whose allocation was the plan's own (0 passes: no second allocation)
    passes_engine: int = 0  # draft passes vLLM would have run on those steps
    passes_planned: int = 0  # ... and the passes calib ran instead
    head_skipped: int = 0  # steps whose model drafter's idle pass was skipped (calib/vllm/retire.py)
    retired: int = 0  # requests retired from the model chain (its head then skips their steps)
    retired_at_admission: int = 0  # ... of them, before their first step (the plan said a newcomer would not pay)
    kept_head_block: int = 0  # prefix-cache lookups that kept the block vLLM drops for the head (retired requests)
    plan_ms: list[float] = field(default_factory=list)  # per planned step: n-gram chains + forecast + plan_draft
    draft_ms: list[float] = field(default_factory=list)  # per step: vLLM's drafting (propose_draft_token_ids)
    step_ms: list[float] = field(default_factory=list)  # wall time between consecutive decisions (one engine step)
    observe_ms: list[float] = field(default_factory=list)  # per verified step: history and online correction
    left_to_vllm: int = 0  # request-steps left to vLLM: target-only logit transforms (calib/transforms.py)
    oracle_known: int = 0  # the clock oracle (knob oracle): request-steps it decided from the reference continuation
    oracle_unknown: int = 0  # ... whose continuation it did not know (vLLM's own draft kept)
    oracle_padded: int = 0  # ... draft tokens it verified past an accepted prefix, for a cheaper step (pad_to_cheapest)
    oracle: bool = False  # the clock oracle decided this process's steps (knob oracle)
    aside_engine: int = 0  # steps calib stood aside on, handing vLLM's own drafts through (calib/serve/aside.py)
    aside_none: int = 0  # ... scheduling no draft tokens (and, with a model drafter, no draft pass)
    clock_steps: int = 0  # steps the step clock timed (knob clock; calib/serve/step_clock.py)
    clock_probes: int = 0  # steps scheduled without draft tokens for the step clock (knob clock_probe)
    # {"B=<size> <greedy|sampled>": [ms beyond the curve at no draft token, ms once for any, ms per draft token,
    # steps]}: the step clock's correction of each batch's price
    clock: dict = field(default_factory=dict)
    # the history read from the text (calib.serve.history): its settled rounds, their whole chains' accepted tokens,
    # and the accepted tokens at the depth calib verified (what the history would have read from the outcomes)
    history: dict = field(default_factory=dict)
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
                f"({self.plan_decided} allocated by the plan; the head's idle pass skipped on {self.head_skipped}, "
                f"{self.retired} requests retired from the model chain, {self.retired_at_admission} at admission; "
                f"{self.kept_head_block} prefix-cache lookups kept the head's block) "
                f"(plan_ms mean {(sum(self.plan_ms) / len(self.plan_ms)) if self.plan_ms else math.nan:.2f}); "
                f"{self.left_to_vllm} request-steps left to vLLM (logit transforms); "
                f"stood aside on {self.aside_engine} steps (vLLM's drafts) and {self.aside_none} (no drafts); "
                f"{self.clock_probes} steps without drafts for the step clock; "
                + (f"oracle {self.oracle_known} known / {self.oracle_unknown} unknown, {self.oracle_padded} "
                   f"tokens padded; " if self.oracle else "") +
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
