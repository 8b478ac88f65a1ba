"""serve.py's TTFT / TPOT (calib.vllm.serve_runner.latency_figures) on SYNTHETIC clocks: vLLM's bench serve
definitions, prefill out of TPOT, one-token and unfinished requests left out where they have no value."""

import math
from types import SimpleNamespace

import pytest

from calib.vllm.serve_runner import latency_figures


def _out(n_tokens):
    return SimpleNamespace(outputs=[SimpleNamespace(token_ids=list(range(n_tokens)))])


def test_ttft_and_tpot_follow_vllms_definitions():
    times = [(0.0, 0.5, 1.5), (0.0, 1.0, 1.4), (0.2, 0.3, 0.3), (0.0, math.nan, math.nan)]
    outputs = [_out(11), _out(5), _out(1), None]
    f = latency_figures(times, outputs)
    # TTFT: sent -> first token, every request with a first token
    assert f["ttft_ms_median"] == pytest.approx(500.0) and f["ttft_ms_mean"] == pytest.approx((500 + 1000 + 100) / 3)
    # TPOT: (finished - first token) / (tokens - 1); the one-token request has none
    assert f["tpot_ms_mean"] == pytest.approx((100.0 + 100.0) / 2) and f["tpot_ms_median"] == pytest.approx(100.0)
    assert f["decode_tok_s_per_request"] == pytest.approx(10.0)


def test_no_request_gives_no_figure_rather_than_a_wrong_one():
    f = latency_figures([], [])
    assert all(math.isnan(v) for v in f.values())
