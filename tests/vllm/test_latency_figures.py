"""serve.py's TTFT / TPOT (calib.vllm.clients.latency_figures) on SYNTHETIC clocks: vLLM's bench serve
definitions, prefill out of TPOT, one-token and unfinished requests left out where they have no value."""

import math
from types import SimpleNamespace

import pytest

from calib.vllm.clients import latency_figures


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


class _FakeEngine:
    """SYNTHETIC engine: a request prefills for ``prefill_steps`` steps, then makes ``per_step`` tokens a step
    until ``max_tokens``; every step returns the cumulative outputs of the requests that produced a token."""

    def __init__(self, prefill_steps=2, per_step=2, max_tokens=6):
        self.reqs, self.prefill, self.per_step, self.max = {}, prefill_steps, per_step, max_tokens

    def add_request(self, rid, prompt, params):
        self.reqs[rid] = {"left": self.prefill, "n": 0}

    def step(self):
        out = []
        for rid, r in list(self.reqs.items()):
            if r["left"]:
                r["left"] -= 1
                if r["left"]:
                    continue
                r["n"] = 1  # the prefill's last chunk samples the first token
            else:
                r["n"] = min(self.max, r["n"] + self.per_step)
            done = r["n"] >= self.max
            out.append(SimpleNamespace(request_id=rid, finished=done,
                                       outputs=[SimpleNamespace(token_ids=list(range(r["n"])))]))
            if done:
                del self.reqs[rid]
        return out


def test_generate_records_every_step_and_which_were_pure_decode():
    from calib.vllm.clients import decode_step_figures, generate

    llm = SimpleNamespace(llm_engine=_FakeEngine())
    times, steps = [], []
    outs = generate(llm, [0, 1, 2], [None] * 3, concurrency=2, times=times, steps=steps)
    assert [len(o.outputs[0].token_ids) for o in outs] == [6, 6, 6]
    assert sum(n for _, n, _, _ in steps) == 18  # every output token counted once
    # two requests prefill (2 steps: the 2nd yields their first tokens), decode 1 -> 3 -> 5 -> 6; then the third
    # prefills alone: steps with a request in prefill are never pure
    assert [p for _, _, p, _ in steps] == [False, False, True, True, True, False, False, True, True, True]
    assert [n for _, n, _, _ in steps] == [0, 2, 4, 4, 2, 0, 1, 2, 2, 1]
    assert [b for _, _, _, b in steps] == [2, 2, 2, 2, 2, 1, 1, 1, 1, 1]
    f = decode_step_figures([(0.5, 0, False, 2), (0.1, 4, True, 2), (0.3, 2, True, 1)], concurrency=2)
    assert f["steady_steps"] == 1 and f["steady_tok_s"] == pytest.approx(40.0) and f["steady_step_ms"] == pytest.approx(100)
    assert f["decode_steps"] == 2 and f["decode_step_tok_s"] == pytest.approx(6 / 0.4)
    assert f["decode_step_share"] == pytest.approx(0.4 / 0.9)
    assert f["decode_batch_mean"] == pytest.approx((0.1 * 2 + 0.3 * 1) / 0.4)
    assert f["decode_step_ms"] == pytest.approx(200.0) and f["decode_tokens_per_step"] == pytest.approx(3.0)
    none = decode_step_figures([(0.5, 0, False, 2)], concurrency=2)
    assert none["steady_steps"] == 0 and math.isnan(none["steady_tok_s"])
    assert none["decode_steps"] == 0 and math.isnan(none["decode_step_tok_s"]) and math.isnan(none["decode_step_ms"])
