"""Serving when the model drafter samples its chain from q (docs/serving_hooks.md, "Sampled serving").

:func:`decide_sampled` cuts the sampled model chain causally (a decision never sees the drawn tokens it
decides on); :func:`verified_draft_probs` makes the q rows vLLM's rejection sampler reads follow the lists
calib hands back, so that verification stays lossless under substitution. :class:`calib.vllm.server.Server`
calls both.
"""

from __future__ import annotations

import math

import torch


def decide_sampled(dec, inputs):
    """The decision when the drafter sampled its chain from q: the model chain is verified to depth
    ``>= j`` only where the decisions seeing depths ``<= j`` of every model draft (their max q, known
    before the draw at ``j``; placeholder tokens, never the drawn ones) each took all of it, a
    stopping rule; a request the first of them gives no model token takes that one's choice."""
    from calib.chains import NO_CHAIN, Offer, chain
    from calib.serve import StepDecision, StepInputs

    model = dec.engine_chain
    offer = inputs.offers.get(model)
    if offer is None or chain(model).confidence is None:
        return dec.decide(inputs)
    tokens, conf = offer.tokens, offer.signal  # [B][<= K], float [B, K] (max q per depth)
    B, model_id = len(tokens), chain(model).id
    depth = torch.zeros(B, dtype=torch.int32)  # [B]: the model prefix verified
    alive = torch.ones(B, dtype=torch.bool)  # [B]: every decision so far took the whole cut
    first, ms = None, 0.0
    model_probs: dict[int, torch.Tensor] = {}  # row -> the model prefix's probabilities as decided
    for j in range(1, max((len(t) for t in tokens), default=0) + 1):
        cut = Offer([[0] * min(j, len(t)) for t in tokens], conf[:, :j])
        d = dec.decide(StepInputs(inputs.req_ids, inputs.temperature, {**inputs.offers, model: cut}))
        ms += float(d.allocator_ms)
        if d.passthrough:  # Server.step then keeps vLLM's own drafts with their own q rows
            return d
        first = d if first is None else first
        alive &= (d.chain == model_id) & (d.depth == j)
        depth[alive] = j
        if d.probs is not None:
            for b in torch.nonzero(alive).flatten().tolist():
                model_probs[b] = d.probs[b, :j]
        if not bool(alive.any()):
            break
    if first is None:  # no model token anywhere: nothing to cut
        return dec.decide(inputs)
    on_model = depth > 0  # [B]
    drafts = [tokens[b][: int(depth[b])] if on_model[b] else list(first.drafts[b]) for b in range(B)]
    ids = torch.where(on_model, torch.tensor(model_id, dtype=first.chain.dtype), first.chain)
    ids = torch.where(torch.tensor([bool(x) for x in drafts]), ids, torch.tensor(NO_CHAIN, dtype=ids.dtype))
    expected = torch.where(on_model, torch.tensor(math.nan), first.expected_accepted.to(torch.float32))
    probs = None
    if first.probs is not None and all(b in model_probs for b in torch.nonzero(on_model).flatten().tolist()):
        probs = torch.full((B, max([1, *map(len, drafts)])), math.nan)
        for b, x in enumerate(drafts):
            row = model_probs[b] if on_model[b] else first.probs[b, : len(x)]
            probs[b, : len(x)] = row[: len(x)]
    return StepDecision(list(inputs.req_ids), drafts, ids, torch.tensor([len(x) for x in drafts],
                        dtype=torch.int32), expected, ms, probs=probs)


def follow_drafts(runner, engine_chain: str, req_ids: list[str], drafts: list[list[int]], chain_ids) -> None:
    """Make the q rows vLLM's rejection sampler reads next step (``runner._draft_probs`` by
    ``_draft_prob_req_ids``, ``[:num_draft]`` per request) follow ``drafts``: model prefixes keep their rows,
    another chain's tokens get one-hot rows (:func:`verified_draft_probs`). ``chain_ids``: int8 ``[B]`` numpy."""
    from calib.chains import chain

    model_id = chain(engine_chain).id
    from_model = [int(c) == model_id for c in chain_ids.tolist()]
    runner._draft_probs, runner._draft_prob_req_ids = verified_draft_probs(
        runner._draft_probs, list(runner._draft_prob_req_ids), req_ids, drafts, from_model)


def verified_draft_probs(probs: torch.Tensor, prob_req_ids: list[str], req_ids: list[str],
                         drafts: list[list[int]], from_model: list[bool]) -> tuple[torch.Tensor, list[str]]:
    """The draft probabilities ``[R, W, V]`` (rows by the returned request ids) that verify ``drafts``
    losslessly, from the drafter's ``probs [R, W0, V]`` (rows by ``prob_req_ids``): a model prefix keeps
    its rows (vLLM reads ``[:num_draft]``), a substituted chain gets one-hot rows (q = 1 on its token:
    accepted with p(token), the residual p without it), an empty list needs none. In place where the
    substitutes fit ``W0`` columns and every request has a row; else a new tensor, rows by ``req_ids``."""
    if probs.ndim != 3 or probs.shape[0] < len(prob_req_ids):  # vLLM indexes the first R rows by id
        raise ValueError(f"draft probs {tuple(probs.shape)} for {len(prob_req_ids)} requests: want [R, W, V]")
    if not len(req_ids) == len(drafts) == len(from_model):
        raise ValueError(f"{len(req_ids)} requests, {len(drafts)} draft lists, {len(from_model)} chain flags")
    _, W0, V = probs.shape
    row_of = {r: i for i, r in enumerate(prob_req_ids)}
    for r, x, m in zip(req_ids, drafts, from_model):
        if m and x and (r not in row_of or len(x) > W0):
            raise ValueError(f"request {r}: {len(x)} model tokens but no q rows for them (width {W0})")
        if any(t < 0 or t >= V for t in x):
            raise ValueError(f"request {r}: a token id outside the drafter's vocabulary of {V}: {x}")
    # vLLM drafts under inference mode: its tensor is written (or replaced) under the same mode
    with torch.inference_mode(probs.is_inference()):
        return _one_hot_substitutes(probs, prob_req_ids, req_ids, drafts, from_model, row_of)


def _one_hot_substitutes(probs, prob_req_ids, req_ids, drafts, from_model, row_of):
    """:func:`verified_draft_probs` once its inputs are checked."""
    _, W0, V = probs.shape
    subs = [b for b, (x, m) in enumerate(zip(drafts, from_model)) if x and not m]
    ids = list(prob_req_ids)
    width = max([W0, *(len(drafts[b]) for b in subs)])
    if width > W0 or any(req_ids[b] not in row_of for b in subs):
        out = probs.new_zeros((len(req_ids), width, V))  # [B, W, V]
        keep = [b for b, r in enumerate(req_ids) if r in row_of]
        out[keep, :W0] = probs[[row_of[req_ids[b]] for b in keep]]
        probs, ids, row_of = out, list(req_ids), {r: b for b, r in enumerate(req_ids)}
    for b in subs:
        row, x = row_of[req_ids[b]], drafts[b]
        probs[row, : len(x)] = 0
        probs[row, torch.arange(len(x)), torch.tensor(x, device=probs.device)] = 1
    return probs, ids


def sample_recovered_tokens(max_spec_len, num_draft_tokens, cu_num_draft_tokens, draft_token_ids, draft_probs,
                            target_probs, sampling_metadata, device, use_fp64_gumbel=False):
    """vLLM's ``rejection_sampler.sample_recovered_tokens`` (same contract, same kernel), drawing its vocabulary of
    exponentials only for the requests that have draft tokens, and nothing at all on a step without any.

    vLLM draws ``q [batch_size, vocab_size]`` for every request of a step under sampling (and a speculative engine
    runs the rejection sampler on every step, draft tokens or none), while its kernel reads ``inv_q`` only at a
    request's draft positions. On a CPU that draw was most of a sampled step's extra cost (1.1 ms per request at
    SmolLM2's 49,152 tokens, docs/profile.md), paid even when calib verified nothing. The rows read are drawn as
    vLLM draws them (a seeded request from its own generator, the same values; the others from the global
    generator, in fewer calls), so what is sampled keeps its distribution."""
    import torch
    from vllm.v1.sample import rejection_sampler as rs

    recovered = torch.empty_like(draft_token_ids)  # [num_tokens]
    if draft_token_ids.numel() == 0:
        return recovered
    vocab_size = target_probs.shape[-1]
    dtype = torch.float64 if use_fp64_gumbel else torch.float32
    inv_q = torch.ones((len(num_draft_tokens), vocab_size), dtype=dtype, device=device)  # [B, V]; unread rows: 1
    drafting = [i for i, n in enumerate(num_draft_tokens) if n > 0]
    unseeded = [i for i in drafting if i not in sampling_metadata.generators]
    if unseeded:
        draw = torch.empty((len(unseeded), vocab_size), dtype=dtype, device=device).exponential_()
        inv_q[torch.tensor(unseeded, device=device)] = draw.reciprocal_()
    for i, generator in sampling_metadata.generators.items():
        if num_draft_tokens[i] > 0:
            inv_q[i] = torch.empty(vocab_size, dtype=dtype, device=device).exponential_(generator=generator).reciprocal_()
    rs._sample_recovered_tokens(recovered, cu_num_draft_tokens, draft_token_ids, draft_probs, target_probs, inv_q,
                                max_spec_len=max_spec_len)
    return recovered


def apply_lean_recovered_draw() -> bool:
    """Replace vLLM's ``sample_recovered_tokens`` by :func:`sample_recovered_tokens` (serving only: calib's arms,
    never vLLM's own; ``CALIB_LEAN_RECOVERED_DRAW=0`` keeps vLLM's). Returns whether it replaced it."""
    from calib import envs

    if not envs.CALIB_LEAN_RECOVERED_DRAW:
        return False
    from vllm.v1.sample import rejection_sampler as rs

    rs.sample_recovered_tokens = sample_recovered_tokens
    return True
