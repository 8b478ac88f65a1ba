"""calib's lean draw of the rejection sampler's recovered tokens (calib.vllm.sampled.sample_recovered_tokens): the
same tokens as vLLM's for seeded requests, the same distribution for the others, nothing drawn on a step without
draft tokens. vLLM's own CPU kernel decides in both (no engine; SYNTHETIC probabilities)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

pytest.importorskip("vllm")

from vllm.platforms.cpu import CpuPlatform

CpuPlatform.register_triton_kernel_overrides()  # the C++ kernels a CPU engine registers at start

from vllm.v1.sample import rejection_sampler as rs

from calib.vllm.sampled import apply_lean_recovered_draw, sample_recovered_tokens

VLLM_DRAW = rs.sample_recovered_tokens


def _step(rng, draft_counts, vocab):
    counts = list(draft_counts)
    n = sum(counts)
    cu = torch.tensor(np.cumsum(counts), dtype=torch.int32)  # [B]
    drafts = torch.tensor(rng.integers(0, vocab, n), dtype=torch.int32)  # [num_tokens]
    probs = torch.softmax(torch.tensor(rng.normal(size=(n, vocab)), dtype=torch.float32), -1)  # [num_tokens, V]
    return counts, cu, drafts, probs


def _seeded(B):
    return SimpleNamespace(generators={i: torch.Generator().manual_seed(1000 + i) for i in range(B)})


@pytest.mark.parametrize("seed", range(6))
def test_seeded_requests_recover_the_same_tokens_as_vllm(seed):
    rng = np.random.default_rng(seed)
    counts, cu, drafts, probs = _step(rng, rng.integers(0, 5, size=int(rng.integers(1, 7))), 97)
    if not drafts.numel():
        counts[0] += 1
        counts, cu, drafts, probs = _step(rng, counts, 97)
    ours = sample_recovered_tokens(4, counts, cu, drafts, None, probs, _seeded(len(counts)), "cpu")
    theirs = VLLM_DRAW(4, counts, cu, drafts, None, probs, _seeded(len(counts)), "cpu")
    assert torch.equal(ours, theirs)


def test_a_step_without_draft_tokens_draws_nothing():
    torch.manual_seed(0)
    before = torch.get_rng_state()
    out = sample_recovered_tokens(4, [0] * 16, torch.zeros(16, dtype=torch.int32), torch.zeros(0, dtype=torch.int32),
                                  None, torch.zeros(0, 49152), SimpleNamespace(generators={}), "cpu")
    assert out.numel() == 0 and torch.equal(torch.get_rng_state(), before)


def test_unseeded_requests_keep_the_distribution():
    """One draft position whose draft token is 0: the recovered token follows p over the other tokens."""
    p = torch.tensor([[0.4, 0.1, 0.2, 0.3]])  # token 0 is the draft: recovered ~ (0.1, 0.2, 0.3) / 0.6
    counts, cu, drafts = [0, 1], torch.tensor([0, 1], dtype=torch.int32), torch.tensor([0], dtype=torch.int32)
    torch.manual_seed(1)
    n = 3000
    seen = np.bincount([int(sample_recovered_tokens(4, counts, cu, drafts, None, p, SimpleNamespace(generators={}),
                                                    "cpu")[0]) for _ in range(n)], minlength=4)
    expected = np.array([0.0, 0.1, 0.2, 0.3]) / 0.6 * n
    assert seen[0] == 0
    chi2 = float((((seen - expected) ** 2)[1:] / expected[1:]).sum())
    assert chi2 < 13.8, (seen, expected)  # chi-square, 2 degrees of freedom, p = 0.001


def test_applied_unless_switched_off(monkeypatch):
    monkeypatch.setattr(rs, "sample_recovered_tokens", VLLM_DRAW)  # restored afterwards
    monkeypatch.setenv("CALIB_LEAN_RECOVERED_DRAW", "0")
    assert not apply_lean_recovered_draw() and rs.sample_recovered_tokens is VLLM_DRAW
    monkeypatch.delenv("CALIB_LEAN_RECOVERED_DRAW")
    assert apply_lean_recovered_draw() and rs.sample_recovered_tokens is sample_recovered_tokens
