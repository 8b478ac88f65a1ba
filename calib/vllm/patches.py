"""One patch set over vLLM's V1 model runner (and its scheduler's prefix-cache lookup) that capture and serving
subscribe to (docs/vllm_wing.md).

Each hooked method is wrapped once; subscribers hear its events in the order they were declared, the
first one outermost: ``before`` events in that order, ``after`` events in the reverse (as nested
wrappers would run). A subscriber catches its own errors: nothing here may raise into the engine.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

log = logging.getLogger("calib.vllm")

# (owner, method): what the patch set wraps. CPUModelRunner subclasses GPUModelRunner: one patch covers both. The
# scheduler's KV cache manager ("cache") is wrapped where a class is given for it (vLLM: every process calls install,
# but only where the scheduler shares the runner's process does a subscriber there know anything of the requests).
HOOKED = (("runner", "take_draft_token_ids"), ("runner", "_sample"), ("runner", "propose_draft_token_ids"),
          ("runner", "_update_states"), ("proposer", "_sample_draft_tokens"), ("proposer", "propose"),
          ("cache", "get_computed_blocks"))


class RunnerSubscriber:
    """The events of the patched runner a subscriber may hear; each is a no-op here."""

    def before_take(self, runner) -> None:
        """``take_draft_token_ids`` is about to run (once per step, after bookkeeping)."""

    def take_drafts(self, runner, out):
        """vLLM's ``DraftTokenIds`` (not None) -> the lists handed to the scheduler (``out`` to keep them)."""
        return out

    def before_verify(self, runner) -> None:
        """``_sample`` (the rejection sampler) is about to run."""

    def after_verify(self, runner, spec_decode_metadata, output) -> None:
        """``_sample`` returned ``output`` (``sampled_token_ids`` ``[B, K+1]``, -1 padded);
        ``spec_decode_metadata`` is None on steps without drafts."""

    def before_propose(self, runner, scheduler_output, sampled_token_ids) -> None:
        """The drafter is about to run (``propose_draft_token_ids``)."""

    def after_propose(self, runner) -> None:
        """The drafter returned or raised."""

    def wants_depths(self) -> bool:
        """Whether :meth:`draft_depth` should hear the depths of the drafting pass in progress."""
        return False

    def wants_distribution(self) -> bool:
        """Whether :meth:`draft_depth` needs the whole draft distribution (``probs``), not only its max:
        on vLLM's greedy path the patch set then computes a softmax over the vocabulary per depth."""
        return True

    def draft_depth(self, token_ids: torch.Tensor, probs: torch.Tensor | None, max_q: torch.Tensor) -> None:
        """One depth of a drafting pass: ``token_ids`` [rows]; ``probs`` [rows, vocab] drawn from (None when
        no listener :meth:`wants_distribution`); ``max_q`` [rows], the distribution's largest probability."""

    def before_update_states(self, runner, scheduler_output) -> None:
        """``_update_states`` is about to run (finished requests are in ``scheduler_output``)."""

    def skips_idle_pass(self) -> bool:
        """Whether the drafter's pass about to run, which drafts no token (``num_speculative_tokens == 0``), may be
        skipped: vLLM runs it only to keep the head's KV cache in step. Skipped only when every subscriber says
        so (capture never does: its banks need every step's drafter)."""
        return False

    def keeps_head_block(self, request_id: str) -> bool:
        """The scheduler is about to look up ``request_id``'s prefix-cache hit, from which vLLM drops one block on an
        EAGLE engine so that the head recomputes its own cache there: whether the request is never drafted for by
        the head, so that the hit may keep that block (as on an engine without a model drafter). Kept only when
        every subscriber says so (capture never does)."""
        return False

    def samples_plainly(self) -> bool:
        """Whether a step of a speculative engine without any draft token may be sampled by vLLM's plain sampler
        instead of its rejection sampler (:func:`plain_draw_serves` says when that draw is the same). Taken only
        when every subscriber says so (capture never does: its banks record the engine as vLLM runs it)."""
        return False


def plain_draw_serves(spec_decode_metadata, sampling_metadata) -> bool:
    """Whether vLLM's plain sampler draws what its rejection sampler would on this step: no request has a draft
    token, and nothing is asked for that the rejection sampler's bonus draw treats otherwise (logprobs, penalties and
    bad words, which it reads with the draft tokens, a thinking budget).

    vLLM builds ``spec_decode_metadata`` on every step of a speculative engine, so a step without any draft token
    still runs the rejection sampler, which draws each request's bonus token through the same sampler on the same
    logits (``logits[bonus_logits_indices]`` is every row when no request has drafts) and the same generators, plus a
    copy of the logits for logprobs nobody asked for and the empty rejection: ~1 ms a step at c = 16 under sampling
    on a CPU (docs/serving.md)."""
    holder = getattr(sampling_metadata, "thinking_budget_state_holder", None)
    return (spec_decode_metadata.max_spec_len == 0 and sampling_metadata.max_num_logprobs is None
            and not getattr(sampling_metadata, "logprob_token_ids", None) and sampling_metadata.no_penalties
            and not sampling_metadata.bad_words_token_ids and (holder is None or not holder.has_tracked_requests()))


def takes_plain_argmax(proposer, sampling_metadata, base) -> bool:
    """Whether the proposer's ``_sample_draft_tokens`` takes vLLM's plain argmax path
    (``base._greedy_sample``, no draft probabilities): the one path whose logits the patch set may
    recompute to keep the drafter's distribution."""
    return ((not proposer._enable_probabilistic_draft_probs or sampling_metadata.all_greedy)
            and not proposer.use_local_argmax_reduction and not proposer.use_heterogeneous_vocab
            and type(proposer)._greedy_sample is base._greedy_sample)


def greedy_distribution(logits: torch.Tensor, full: bool) -> tuple[torch.Tensor | None, torch.Tensor]:
    """``(probs [rows, vocab] or None, max_q [rows])`` of the drafter's softmax over ``logits``; without
    ``full`` only the max, ``exp(max - logsumexp)``, which writes no [rows, vocab] tensor."""
    x = logits.float()
    if full:
        probs = torch.softmax(x, dim=-1)
        return probs, probs.amax(dim=-1)
    return None, torch.exp(x.amax(dim=-1) - torch.logsumexp(x, dim=-1))


class PatchSet:
    """The wrappers of :data:`HOOKED` over ``runner_cls`` and ``proposer_cls``, calling ``subscribers``."""

    def __init__(self, subscribers: Sequence[RunnerSubscriber]):
        self.subscribers = tuple(subscribers)
        self.originals: dict[tuple[str, str], object] = {}

    def install(self, runner_cls, proposer_cls, cache_cls=None) -> None:
        """Wrap each hooked method once (the cache manager's where ``cache_cls`` is given); a class already patched
        by a patch set is refused."""
        owners = {"runner": runner_cls, "proposer": proposer_cls}
        if cache_cls is not None:
            owners["cache"] = cache_cls
        for cls in owners.values():
            if getattr(cls, "_calib_patch_set", None) is not None:
                raise RuntimeError(f"{cls.__name__} is already patched by calib: one patch set per process")
        for owner, name in HOOKED:
            cls = owners.get(owner)
            if cls is None:
                continue
            self.originals[owner, name] = getattr(cls, name)
            wrap = getattr(self, "_wrap_" + name.lstrip("_"))
            setattr(cls, name, wrap(self.originals[owner, name], proposer_cls))
        for cls in owners.values():
            cls._calib_patch_set = self

    def stand_down(self, subscriber: RunnerSubscriber) -> None:
        """Stop calling ``subscriber`` (its mode cannot act in this engine: calib.vllm.engine_line)."""
        self.subscribers = tuple(s for s in self.subscribers if s is not subscriber)

    def uninstall(self, runner_cls, proposer_cls, cache_cls=None) -> None:
        """Put the original methods back (tests)."""
        owners = {"runner": runner_cls, "proposer": proposer_cls, "cache": cache_cls}
        for (owner, name), orig in self.originals.items():
            if owners[owner] is not None:
                setattr(owners[owner], name, orig)
        for cls in owners.values():
            if cls is not None:
                cls._calib_patch_set = None

    # -- the wrappers -----------------------------------------------------------------------------
    def _wrap_take_draft_token_ids(self, orig, proposer_cls):
        patch_set = self  # subscribers read at each call: a mode stood down at engine start leaves it

        def take_draft_token_ids(runner):
            for s in patch_set.subscribers:
                s.before_take(runner)
            out = orig(runner)
            if out is None:
                return out
            for s in reversed(patch_set.subscribers):
                out = s.take_drafts(runner, out)
            return out

        return take_draft_token_ids

    def _wrap_sample(self, orig, proposer_cls):
        patch_set = self  # subscribers read at each call: a mode stood down at engine start leaves it

        def _sample(runner, logits, spec_decode_metadata):
            subscribers = patch_set.subscribers
            for s in subscribers:
                s.before_verify(runner)
            drawn = spec_decode_metadata
            if drawn is not None and subscribers and all(s.samples_plainly() for s in subscribers):
                try:
                    if plain_draw_serves(drawn, runner.input_batch.sampling_metadata):
                        drawn = None  # the plain sampler's [B, 1] is the rejection sampler's output at max_spec_len 0
                except Exception as exc:  # noqa: BLE001 - the rejection sampler draws as vLLM does
                    log.debug("plain draw not checked: %r", exc)
            out = orig(runner, logits, drawn)
            for s in reversed(patch_set.subscribers):
                s.after_verify(runner, spec_decode_metadata, out)
            return out

        return _sample

    def _wrap_propose_draft_token_ids(self, orig, proposer_cls):
        patch_set = self  # subscribers read at each call: a mode stood down at engine start leaves it

        def propose_draft_token_ids(runner, scheduler_output, sampled_token_ids, *args, **kwargs):
            for s in patch_set.subscribers:
                s.before_propose(runner, scheduler_output, sampled_token_ids)
            try:
                return orig(runner, scheduler_output, sampled_token_ids, *args, **kwargs)
            finally:
                for s in reversed(patch_set.subscribers):
                    s.after_propose(runner)

        return propose_draft_token_ids

    def _wrap_update_states(self, orig, proposer_cls):
        patch_set = self  # subscribers read at each call: a mode stood down at engine start leaves it

        def _update_states(runner, scheduler_output):
            for s in patch_set.subscribers:
                s.before_update_states(runner, scheduler_output)
            return orig(runner, scheduler_output)

        return _update_states

    def _wrap_sample_draft_tokens(self, orig, proposer_cls):
        patch_set = self  # subscribers read at each call: a mode stood down at engine start leaves it

        def _sample_draft_tokens(proposer, hidden_states, sampling_metadata):
            listening = [s for s in patch_set.subscribers if s.wants_depths()]
            if not listening:
                return orig(proposer, hidden_states, sampling_metadata)
            if takes_plain_argmax(proposer, sampling_metadata, proposer_cls):
                # Exactly SpecDecodeBaseProposer._greedy_sample, keeping the logits it discards.
                logits = proposer.model.compute_logits(hidden_states)
                token_ids = logits.argmax(dim=-1)
                try:
                    probs, max_q = greedy_distribution(logits, any(s.wants_distribution() for s in listening))
                except Exception as exc:  # noqa: BLE001 - the draft itself is already computed
                    log.warning("calib: drafter distribution lost (draft unaffected): %s", exc)
                    return token_ids, None
                for s in listening:
                    s.draft_depth(token_ids, probs, max_q)
                return token_ids, None
            token_ids, probs = orig(proposer, hidden_states, sampling_metadata)
            if probs is not None:
                max_q = probs.float().amax(dim=-1)
                for s in listening:
                    s.draft_depth(token_ids, probs, max_q)
            return token_ids, probs

        return _sample_draft_tokens

    def _wrap_propose(self, orig, proposer_cls):
        patch_set = self  # subscribers read at each call: a mode stood down at engine start leaves it

        def propose(proposer, num_speculative_tokens, *args, **kwargs):
            subscribers = patch_set.subscribers
            # every subscriber is asked (each clears its own flag), and the pass is skipped if all of them say so
            votes = [s.skips_idle_pass() for s in subscribers] if num_speculative_tokens == 0 else [False]
            if subscribers and all(votes):
                cad = kwargs.get("common_attn_metadata")
                next_token_ids = kwargs.get("next_token_ids")
                if cad is not None and next_token_ids is not None:
                    # what vLLM's propose returns when it drafts nothing, without the head's forward
                    proposer.num_speculative_tokens = 0
                    proposer._last_draft_probs = None
                    return torch.empty(cad.batch_size(), 0, device=next_token_ids.device, dtype=torch.int64)
            return orig(proposer, num_speculative_tokens, *args, **kwargs)

        return propose

    def _wrap_get_computed_blocks(self, orig, proposer_cls):
        patch_set = self  # subscribers read at each call: a mode stood down at engine start leaves it

        def get_computed_blocks(manager, request, *args, **kwargs):
            coordinator = getattr(manager, "coordinator", None)
            dropped = getattr(coordinator, "eagle_group_ids", None)
            subscribers = patch_set.subscribers
            # one KV cache group (UnitaryKVCacheCoordinator reads the drop from eagle_group_ids alone); a hybrid
            # coordinator's drop is decided per spec group and is left as vLLM makes it
            if not dropped or not subscribers or type(coordinator).__name__ != "UnitaryKVCacheCoordinator":
                return orig(manager, request, *args, **kwargs)
            votes = [s.keeps_head_block(request.request_id) for s in subscribers]  # every subscriber is asked
            if not all(votes):
                return orig(manager, request, *args, **kwargs)
            coordinator.eagle_group_ids = set()  # the scheduler is single-threaded: put back before returning
            try:
                return orig(manager, request, *args, **kwargs)
            finally:
                coordinator.eagle_group_ids = dropped

        return get_computed_blocks


_INSTALLED: PatchSet | None = None


def install(subscribers: Sequence[RunnerSubscriber]) -> PatchSet:
    """Patch vLLM's V1 runner and proposer base class for ``subscribers``, once per process (a second
    call returns the patch set of the first)."""
    global _INSTALLED
    if _INSTALLED is not None:
        return _INSTALLED
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    patch_set = PatchSet(subscribers)
    patch_set.install(GPUModelRunner, SpecDecodeBaseProposer, KVCacheManager)
    _INSTALLED = patch_set
    return patch_set
