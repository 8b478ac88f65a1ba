"""A speculative step without any draft token, sampled by vLLM's plain sampler (calib.vllm.patches: the patch set's
``_sample`` and ``plain_draw_serves``): the same tokens as vLLM's rejection sampler, greedy and seeded; the rejection
sampler wherever a request has drafts, a subscriber declines, or the bonus draw would differ (logprobs, penalties).
vLLM's own ``_sample``, sampler and rejection sampler run on SYNTHETIC logits (no engine)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

from vllm.platforms.cpu import CpuPlatform

CpuPlatform.register_triton_kernel_overrides()  # the C++ kernels a CPU engine registers at start

from vllm.v1.sample.logits_processor import LogitsProcessors
from vllm.v1.sample.metadata import SamplingMetadata
from vllm.v1.sample.rejection_sampler import RejectionSampler
from vllm.v1.sample.sampler import Sampler
from vllm.v1.spec_decode.metadata import SpecDecodeMetadata
from vllm.v1.worker.gpu_model_runner import GPUModelRunner

from calib.vllm.patches import PatchSet, RunnerSubscriber, plain_draw_serves
from calib.vllm.serving import ServingSubscriber

VOCAB = 211


class Says(RunnerSubscriber):
    def __init__(self, plainly: bool):
        self.plainly, self.heard = plainly, []

    def samples_plainly(self) -> bool:
        return self.plainly

    def after_verify(self, runner, spec_decode_metadata, output) -> None:
        self.heard.append((spec_decode_metadata, output.sampled_token_ids))


class CountingRejection(RejectionSampler):
    calls = 0

    def forward(self, *args, **kwargs):
        CountingRejection.calls += 1
        return super().forward(*args, **kwargs)


def _sampling(B: int, temperature: float, seeded: bool, **over) -> SamplingMetadata:
    fields = {
        "temperature": None if temperature == 0 else torch.full((B,), temperature),  # [B]
        "all_greedy": temperature == 0, "all_random": temperature > 0, "top_p": None, "top_k": None,
        "generators": {i: torch.Generator().manual_seed(100 + i) for i in range(B)} if seeded else {},
        "max_num_logprobs": None, "no_penalties": True, "prompt_token_ids": None,
        "frequency_penalties": torch.zeros(B), "presence_penalties": torch.zeros(B), "repetition_penalties": torch.ones(B),
        "output_token_ids": [[] for _ in range(B)], "allowed_token_ids_mask": None, "bad_words_token_ids": {},
        "logitsprocs": LogitsProcessors(), "spec_token_ids": [[] for _ in range(B)]}
    fields.update(over)
    return SamplingMetadata(**fields)


def _spec(draft_counts: list[int]) -> SpecDecodeMetadata:
    """vLLM's layout: each request's draft positions, then its bonus position, flattened in one logits tensor."""
    n = sum(draft_counts)
    sampled = torch.tensor(draft_counts) + 1  # [B]
    cu_sampled = torch.cumsum(sampled, 0).to(torch.int32)  # [B]
    bonus = (cu_sampled - 1).to(torch.int32)  # [B]
    target = torch.tensor([int(cu_sampled[b] - sampled[b]) + j for b, k in enumerate(draft_counts) for j in range(k)],
                          dtype=torch.int32)  # [n]
    return SpecDecodeMetadata(
        draft_token_ids=torch.arange(n, dtype=torch.int32) % VOCAB, num_draft_tokens=list(draft_counts),
        cu_num_draft_tokens=torch.cumsum(torch.tensor(draft_counts), 0).to(torch.int32),
        cu_num_sampled_tokens=cu_sampled, target_logits_indices=target, bonus_logits_indices=bonus,
        logits_indices=torch.arange(n + len(draft_counts), dtype=torch.int32))


def _runner(sampling: SamplingMetadata):
    sampler = Sampler(logprobs_mode="raw_logits")
    return SimpleNamespace(
        input_batch=SimpleNamespace(sampling_metadata=sampling, update_async_output_token_ids=lambda: None),
        sampler=sampler, rejection_sampler=CountingRejection(sampler), use_async_scheduling=False,
        _draft_token_req_ids=None, _get_spec_decode_draft_probs=lambda metadata: None)


def _draw(subscribers, metadata, sampling, logits):
    sample = PatchSet(subscribers)._wrap_sample(GPUModelRunner._sample, None)
    CountingRejection.calls = 0
    torch.manual_seed(7)
    out = sample(_runner(sampling), logits.clone(), metadata)
    return out.sampled_token_ids, CountingRejection.calls


@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("B", [1, 4, 16])
def test_a_step_without_drafts_draws_the_rejection_samplers_tokens(B, temperature):
    logits = torch.randn(B, VOCAB, generator=torch.Generator().manual_seed(B)) * 3  # [B, V]
    metadata = _spec([0] * B)
    plain, plain_calls = _draw([Says(True)], metadata, _sampling(B, temperature, seeded=True), logits)
    vllm, vllm_calls = _draw([Says(False)], metadata, _sampling(B, temperature, seeded=True), logits)
    assert (plain_calls, vllm_calls) == (0, 1)
    assert plain.shape == vllm.shape == (B, 1) and plain.dtype == vllm.dtype == torch.int32
    assert torch.equal(plain, vllm)


def test_every_subscriber_must_agree_and_hears_the_engines_metadata():
    logits, metadata = torch.randn(4, VOCAB), _spec([0] * 4)
    yes, no = Says(True), Says(False)
    _, calls = _draw([yes, no], metadata, _sampling(4, 0.8, seeded=True), logits)
    assert calls == 1
    _, calls = _draw([yes], metadata, _sampling(4, 0.8, seeded=True), logits)
    assert calls == 0 and yes.heard[-1][0] is metadata  # after_verify still hears the step's metadata
    _, calls = _draw([], metadata, _sampling(4, 0.8, seeded=True), logits)
    assert calls == 1  # no subscriber: vLLM as it is


def test_a_step_with_drafts_takes_the_rejection_sampler():
    counts = [0, 2, 0, 1]
    logits = torch.randn(sum(counts) + len(counts), VOCAB)
    out, calls = _draw([Says(True)], _spec(counts), _sampling(4, 0.0, seeded=False), logits)
    assert calls == 1 and out.shape == (4, 3)


@pytest.mark.parametrize("over", [{"max_num_logprobs": 2}, {"no_penalties": False},
                                  {"bad_words_token_ids": {0: [[5]]}}, {"logprob_token_ids": {0: [3]}}])
def test_what_the_bonus_draw_treats_otherwise_keeps_the_rejection_sampler(over):
    sampling = _sampling(2, 0.8, seeded=True, **over)
    assert not plain_draw_serves(_spec([0, 0]), sampling)
    assert plain_draw_serves(_spec([0, 0]), _sampling(2, 0.8, seeded=True))


def test_a_check_that_fails_leaves_the_rejection_sampler():
    logits, metadata = torch.randn(2, VOCAB), _spec([0, 0])
    broken = SimpleNamespace(generators={})  # no field the check reads
    runner = _runner(_sampling(2, 0.0, seeded=False))
    runner.input_batch.sampling_metadata = broken
    sample = PatchSet([Says(True)])._wrap_sample(lambda r, lg, md: SimpleNamespace(sampled_token_ids=md), None)
    assert sample(runner, logits, metadata).sampled_token_ids is metadata


def test_serving_samples_plainly_unless_switched_off(monkeypatch):
    monkeypatch.delenv("CALIB_PLAIN_DRAW", raising=False)
    assert ServingSubscriber(SimpleNamespace()).samples_plainly()
    monkeypatch.setenv("CALIB_PLAIN_DRAW", "0")
    assert not ServingSubscriber(SimpleNamespace()).samples_plainly()
    assert not RunnerSubscriber().samples_plainly()  # capture's (the base's): the engine as vLLM runs it
