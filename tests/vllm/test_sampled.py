"""Sampled serving without an engine: the draft-probs rebuild and the causal cut (calib/vllm/server.py).

All tensors here are SYNTHETIC (a 3-token toy vocabulary, hand-written target and drafter
distributions, a stand-in decider); the real engine's T = 0.8 distribution test is
tests/vllm/test_sampled_engine.py. The Monte Carlo below verifies with a re-implementation of vLLM's
standard rejection sampler (accept ``x`` if ``p(x) / q(x) >= u``, else draw from ``(p - q)^+``), and
checks each wrong rule it is meant to catch is caught (cutting on the drawn token's q, a look-ahead
cut, substitutes verified against the drafter's q rows).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from calib.chains import NO_CHAIN, Offer, chains
from calib.serve import StepDecision, StepInputs
from calib.serve.knobs import ServeKnobs
from calib.vllm.sampled import verified_draft_probs
from calib.vllm.server import Server

scipy_stats = pytest.importorskip("scipy.stats")

MODEL = next(k for k in chains() if k.confidence is not None)  # the drafter's chain (registry)
LOOKUP = next(k for k in chains() if k.propose is not None)  # the recomputed chain


# -- the rebuild ------------------------------------------------------------------------------------
def _probs(R: int, W: int, V: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(R, W, V, generator=g), dim=-1)


def test_rebuild_keeps_model_prefixes_and_one_hots_substitutes_in_place():
    q = _probs(3, 4, 7)
    before = q.clone()
    drafts = [[5, 1], [2, 3, 4], []]  # truncated model prefix, substituted chain, emptied
    out, ids = verified_draft_probs(q, ["a", "b", "c"], ["a", "b", "c"], drafts, [True, False, False])
    assert out is q and ids == ["a", "b", "c"]  # fits: written in place
    assert torch.equal(out[0], before[0])  # the model prefix keeps its rows (vLLM reads [:2])
    assert torch.equal(out[2], before[2])  # emptied: vLLM reads no row of it
    for pos, tok in enumerate(drafts[1]):
        assert torch.equal(out[1, pos], torch.nn.functional.one_hot(torch.tensor(tok), 7).float())
    assert torch.equal(out[1, 3], before[1, 3])  # beyond the substitute: never read


def test_rebuild_widens_when_a_substitute_outruns_the_draft_passes():
    q = _probs(2, 1, 5)  # the plan ran one draft pass; the n-gram chain has 3 tokens
    out, ids = verified_draft_probs(q, ["b", "a"], ["a", "b"], [[4], [0, 1, 2]], [True, False])
    assert out.shape == (2, 3, 5) and ids == ["a", "b"]  # rows now by the batch's order
    assert torch.equal(out[0, 0], q[1, 0])  # request a's model row moved with it
    assert out[1].argmax(dim=-1).tolist() == [0, 1, 2] and torch.equal(out[1].sum(dim=-1), torch.ones(3))


def test_rebuild_writes_vllms_inference_mode_tensors_outside_inference_mode():
    with torch.inference_mode():  # vLLM drafts under inference mode; take_draft_token_ids runs outside it
        q = _probs(2, 2, 5)
    out, _ = verified_draft_probs(q, ["a", "b"], ["a", "b"], [[1], [2, 3]], [True, False])
    assert out[1].argmax(dim=-1).tolist() == [2, 3]
    wide, _ = verified_draft_probs(q, ["a", "b"], ["a", "b"], [[1], [2, 3, 4]], [True, False])
    assert wide.shape == (2, 3, 5) and wide.is_inference()


def test_rebuild_refuses_model_tokens_without_rows_and_foreign_ids():
    q = _probs(1, 2, 5)
    with pytest.raises(ValueError, match="no q rows"):
        verified_draft_probs(q, ["a"], ["a"], [[1, 2, 3]], [True])
    with pytest.raises(ValueError, match="vocabulary of 5"):
        verified_draft_probs(q, ["a"], ["a"], [[9]], [False])
    with pytest.raises(ValueError, match="want \\[R, W, V\\]"):
        verified_draft_probs(q[0], ["a"], ["a"], [[1]], [False])


# -- a stand-in decider: non-causal on purpose -------------------------------------------------------
class WholeOrNothing:
    """Takes a request's whole model chain iff the mean of its offered confidences is >= ``tau``,
    else the whole recomputed chain when offered, else nothing: a rule that looks at every depth."""

    engine_chain = MODEL.name

    def __init__(self, tau: float):
        self.tau = tau
        self.calls = 0

    def decide(self, inputs: StepInputs) -> StepDecision:
        self.calls += 1
        model, other = inputs.offers[MODEL.name], inputs.offers.get(LOOKUP.name)
        drafts, ids = [], []
        for b, toks in enumerate(model.tokens):
            c = model.signal[b, : len(toks)]
            if toks and float(c.mean()) >= self.tau:
                drafts.append(list(toks))
                ids.append(MODEL.id)
            elif other is not None and other.tokens[b]:
                drafts.append(list(other.tokens[b]))
                ids.append(LOOKUP.id)
            else:
                drafts.append([])
                ids.append(NO_CHAIN)
        B = len(drafts)
        return StepDecision(list(inputs.req_ids), drafts, torch.tensor(ids, dtype=torch.int8),
                            torch.tensor([len(x) for x in drafts], dtype=torch.int32), torch.zeros(B), 0.1)


def _server() -> Server:
    return Server(ServeKnobs("unused-tables"))


def test_cut_is_a_stopping_rule_deeper_confidences_change_nothing_shallower():
    """{model chain verified to depth >= j} must not move when confidences at depths > j do."""
    g = torch.Generator().manual_seed(1)
    B, K = 64, 4
    tokens = [[int(x) for x in torch.randint(0, 50, (K,), generator=g)] for _ in range(B)]
    conf = torch.rand(B, K, generator=g)
    srv, dec = _server(), WholeOrNothing(0.5)

    def depth_of(c):
        d = srv.decide_sampled(dec, StepInputs([str(b) for b in range(B)], [0.8] * B,
                                               {MODEL.name: Offer(tokens, c)}))
        return torch.where(d.chain == MODEL.id, d.depth, torch.zeros_like(d.depth))

    base = depth_of(conf)
    assert 0 < int((base > 0).sum()) < B and int((base < K).sum()) > 0  # cuts happen, not all-or-nothing
    for j in range(K):
        other = conf.clone()
        other[:, j:] = torch.rand(B, K - j, generator=g)  # redraw every depth > j (1-based)
        moved = depth_of(other)
        assert torch.equal(torch.minimum(moved, torch.tensor(j)), torch.minimum(base, torch.tensor(j))), j
    # the look-ahead rule it wraps is not a stopping rule: redrawing depth 2 moves depth-1 choices
    whole = dec.decide(StepInputs([str(b) for b in range(B)], [0.8] * B, {MODEL.name: Offer(tokens, conf)}))
    other = conf.clone()
    other[:, 1:] = torch.rand(B, K - 1, generator=g)
    moved = dec.decide(StepInputs([str(b) for b in range(B)], [0.8] * B, {MODEL.name: Offer(tokens, other)}))
    assert not torch.equal(whole.depth.clamp(max=1), moved.depth.clamp(max=1))


# -- Monte Carlo: the output distribution of the first two tokens ---------------------------------
P1 = np.array([0.5, 0.3, 0.2])  # target p(t1)
P2 = np.array([[0.2, 0.5, 0.3], [0.6, 0.2, 0.2], [0.1, 0.1, 0.8]])  # target p(t2 | t1)
Q1 = np.array([[0.6, 0.2, 0.2], [0.4, 0.3, 0.3]])  # drafter q(x1) in two contexts (even, odd requests)
# the drafter's q(x2 | x1): its max, the depth-2 confidence, depends on the draw x1
Q2 = np.array([[0.9, 0.05, 0.05], [0.34, 0.33, 0.33], [0.2, 0.4, 0.4]])
NGRAM = [1, 2]  # the recomputed chain (deterministic given the context)


def _verify(rng, drafts, rows):
    """vLLM's standard rejection sampler on one request, then plain decoding up to two tokens."""
    out = []
    for pos, x in enumerate(drafts):
        p = P1 if pos == 0 else P2[out[0]]
        q = rows[pos]
        if q[x] > 0 and p[x] / q[x] >= rng.random():
            out.append(x)
            continue
        resid = np.clip(p - q, 0, None)
        out.append(int(rng.choice(3, p=resid / resid.sum())))
        break
    while len(out) < 2:  # the bonus token, then the next step's
        out.append(int(rng.choice(3, p=P1 if not out else P2[out[0]])))
    return out[0] * 3 + out[1]


def _serve(rule: str, n: int = 10000, seed: int = 0) -> float:
    """p-value of the chi-square of (t1, t2) against the target under ``rule``."""
    rng = np.random.default_rng(seed)
    q1 = Q1[np.arange(n) % 2]  # [n, 3]
    x1 = np.array([rng.choice(3, p=row) for row in q1])
    x2 = np.array([rng.choice(3, p=Q2[a]) for a in x1])
    probs = torch.tensor(np.stack([q1, Q2[x1]], axis=1), dtype=torch.float32)  # [n, 2, 3]
    drawn = probs.gather(-1, torch.tensor(np.stack([x1, x2], 1))[..., None]).squeeze(-1)  # q of the draw
    conf = drawn if rule == "drawn_q" else probs.amax(dim=-1)  # [n, 2]
    req_ids = [str(i) for i in range(n)]
    tokens = [[int(a), int(b)] for a, b in zip(x1, x2)]
    offers = {MODEL.name: Offer(tokens, conf), LOOKUP.name: Offer([list(NGRAM)] * n)}
    dec, inputs = WholeOrNothing(0.55), StepInputs(req_ids, [0.8] * n, offers)
    d = dec.decide(inputs) if rule == "look_ahead" else _server().decide_sampled(dec, inputs)
    from_model = (d.chain == MODEL.id).tolist()
    if rule != "model_rows":  # else: substitutes verified against the drafter's rows (wrong)
        probs, _ = verified_draft_probs(probs, req_ids, req_ids, d.drafts, from_model)
    assert 0.05 < sum(from_model) / n < 0.95  # both the model chain and substitutes are verified
    counts = np.bincount([_verify(rng, d.drafts[i], probs[i].double().numpy()) for i in range(n)], minlength=9)
    return float(scipy_stats.chisquare(counts, n * (P1[:, None] * P2).reshape(-1)).pvalue)


def test_causal_cut_with_one_hot_substitutes_keeps_the_target_distribution():
    assert _serve("calib") > 1e-3


@pytest.mark.parametrize("rule", ["drawn_q", "look_ahead", "model_rows"])
def test_the_distribution_test_catches_each_wrong_rule(rule):
    assert _serve(rule, n=3000) < 1e-6


def test_cut_with_the_real_decider_is_a_stopping_rule_on_real_tokens(tmp_path):
    """SafeDecider on SYNTHETIC tables (tests/serve/decide_cases.py): prefixes of the offered chains with
    the drawn tokens (never the placeholders the cuts are decided on), and a stopping rule."""
    from dataclasses import replace

    from calib.tables.io import save
    from tests.serve.decide_cases import META, random_inputs, synthetic_decider, synthetic_tables

    dec = synthetic_decider(save(tmp_path / "tables", synthetic_tables(5), META))
    inputs = random_inputs(B=24, K=4, L=4, seed=3)
    model = inputs.offers[MODEL.name]
    d = _server().decide_sampled(dec, inputs)
    assert not d.passthrough and dec.failures == 0
    on_model = (d.chain == MODEL.id).tolist()
    assert any(on_model) and not all(on_model)
    for b, x in enumerate(d.drafts):
        offered = inputs.offers[MODEL.name if on_model[b] else LOOKUP.name].tokens[b]
        assert x == offered[: len(x)] and len(x) == int(d.depth[b])
    g = torch.Generator().manual_seed(4)
    base = torch.where(d.chain == MODEL.id, d.depth, 0)
    for j in range(4):
        conf = model.signal.clone()
        conf[:, j:] = torch.rand(24, 4 - j, generator=g)
        other = replace(inputs, offers={**inputs.offers, MODEL.name: Offer(model.tokens, conf)})
        e = _server().decide_sampled(dec, other)
        moved = torch.where(e.chain == MODEL.id, e.depth, 0)
        assert torch.equal(moved.clamp(max=j), base.clamp(max=j)), j


def test_a_sampled_step_priced_by_a_greedy_only_step_cost_is_said_once(tmp_path, caplog):
    """A step cost fitted on greedy steps prices T > 0 drafts without the rejection sampler's random path; the server
    says so at the first step where a request samples, once, and never on greedy steps."""
    import logging
    from types import SimpleNamespace

    from tests.serve.test_oracle import Drafts, _batch
    from tests.serve.test_oracle import _server as stand_in

    srv = stand_in(tmp_path, {}, LOOKUP.name)
    srv.unpriced_sampling = True  # what construction sets for such a cost (calib.cost.serving.prices_greedy_only)
    batch = _batch([([1, 2, 3], [4]), ([5, 6], [7])])
    runner = SimpleNamespace(input_batch=batch, requests={})
    said = lambda: sum("no `sampled` term" in r.getMessage() for r in caplog.records)
    with caplog.at_level(logging.INFO, logger="calib.serve"):
        srv.step(runner, Drafts(list(batch.req_ids), [[1], [2]]))
        assert said() == 0  # greedy
        batch.temperature_cpu[1] = 0.8
        srv.step(runner, Drafts(list(batch.req_ids), [[1], [2]]))
        srv.step(runner, Drafts(list(batch.req_ids), [[1], [2]]))
    assert said() == 1 and not srv.unpriced_sampling
