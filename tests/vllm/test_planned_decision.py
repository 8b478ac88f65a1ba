"""The plan's own allocation as the step's decision (calib/vllm/server.py ``Server.planned_decision``).

SYNTHETIC inputs, no engine. That the plan's n-gram depths equal the allocator's decision on that chain
alone is tests/allocate/test_draft.py (``test_a_plan_that_stops_before_the_first_pass_...``); here: the
server hands them back only when the step is the one the plan saw (the same contexts, in any order), with the
context columns the plan read, and decides as usual otherwise.
"""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import torch

from calib.chains import NO_CHAIN, Offer, chains
from calib.serve import StepInputs
from calib.serve.knobs import ServeKnobs
from calib.vllm.planning import PlannedStep
from calib.vllm.server import Server

MODEL = next(k for k in chains() if k.confidence is not None)
LOOKUP = next(k for k in chains() if k.propose is not None)


def _server():
    srv = Server(ServeKnobs("unused-tables"))
    srv.decider = SimpleNamespace(enabled=True)
    tokens = [[5, 6, 7], [8, 9], []]
    probs = np.array([[0.9, 0.8, 0.2], [0.5, 0.4, np.nan], [np.nan] * 3], dtype=np.float32)
    keys = tuple((r, 10 + i, 3) for i, r in enumerate("abc"))  # each request's context (StepContexts.keys)
    srv.step_keys = keys  # what the decision's offers saw
    planned = PlannedStep(LOOKUP.name, keys, probs, np.array([2, 0, 0]), {("temperature",): np.zeros((3, 1))})
    inputs = StepInputs(list("abc"), [0.0] * 3, {LOOKUP.name: Offer(tokens, None)})
    return srv, planned, inputs


def test_a_step_the_plan_allocated_takes_its_depths():
    srv, planned, inputs = _server()
    d = srv.planned_decision(inputs, planned)
    assert d is not None and not d.passthrough
    assert d.drafts == [[5, 6], [], []]
    assert d.depth.tolist() == [2, 0, 0] and d.chain.tolist() == [LOOKUP.id, NO_CHAIN, NO_CHAIN]
    assert d.depth.dtype == torch.int32 and d.chain.dtype == torch.int8
    assert torch.allclose(d.expected_accepted, torch.tensor([0.9 + 0.9 * 0.8, 0.0, 0.0]))
    assert d.probs.dtype == torch.float32 and d.probs.shape == (3, 2)
    assert d.probs[0].tolist() == [np.float32(0.9), np.float32(0.8)] and torch.isnan(d.probs[1:]).all()
    assert d.context is planned.columns  # the context columns the plan read: remember reads them again
    assert srv.stats.plan_decided == 1


def test_the_plans_rows_follow_the_decisions_order():
    srv, planned, inputs = _server()
    order = [2, 0, 1]
    srv.step_keys = tuple(planned.keys[i] for i in order)
    moved = StepInputs([inputs.req_ids[i] for i in order], [0.0] * 3,
                       {LOOKUP.name: Offer([inputs.offers[LOOKUP.name].tokens[i] for i in order], None)})
    d = srv.planned_decision(moved, planned)
    assert d.drafts == [[], [5, 6], []] and d.depth.tolist() == [0, 2, 0]
    assert d.context[("temperature",)].shape == (3, 1)
    assert srv.planned_probs(srv.step_keys) is None  # none planned now (offers hands self.planned over)
    srv.planned = planned
    assert srv.planned_probs(srv.step_keys)[1, :2].tolist() == [np.float32(0.9), np.float32(0.8)]


def test_anything_the_plan_did_not_see_is_decided_as_usual():
    srv, planned, inputs = _server()
    srv.step_keys = (planned.keys[0], ("b", 99, 3), planned.keys[2])  # another context than the plan's
    assert srv.planned_decision(inputs, planned) is None
    srv.step_keys = planned.keys
    ran = replace(planned, depth=None)  # the plan ran a pass: its depths are not the step's
    assert srv.planned_decision(inputs, ran) is None
    assert srv.planned_decision(inputs, None) is None
    bigger = replace(planned, keys=(*planned.keys, ("d", 7, 1)), probs=np.zeros((4, 3), dtype=np.float32),
                     depth=np.array([2, 0, 0, 1]))  # planned for a batch the step is not
    assert srv.planned_decision(inputs, bigger) is None
    both = StepInputs(inputs.req_ids, inputs.temperature,
                      {**inputs.offers, MODEL.name: Offer([[1], [], []], torch.full((3, 1), 0.5))})
    assert srv.planned_decision(both, planned) is None  # the model drafted: decide on both chains
    srv.decider.enabled = False
    assert srv.planned_decision(inputs, planned) is None
    assert srv.stats.plan_decided == 0


def test_its_expected_accepted_length_is_the_metrics_one():
    """The planned decision's expected accepted length in float32 equals calib.metrics' on its verified prefixes
    (NaN inside a prefix ends the chain there), on SYNTHETIC probabilities."""
    from calib.metrics import expected_accepted_length

    rng = np.random.default_rng(0)
    B, W = 32, 5
    probs = rng.uniform(0.0, 1.0, size=(B, W)).astype(np.float32)
    probs[rng.random((B, W)) < 0.1] = np.nan
    depth = rng.integers(0, W + 1, size=B)
    keys = tuple((f"r{b}", 10, 1) for b in range(B))
    srv = Server(ServeKnobs("unused-tables"))
    srv.decider, srv.step_keys = SimpleNamespace(enabled=True), keys
    tokens = [list(range(W))] * B
    d = srv.planned_decision(StepInputs([k[0] for k in keys], [0.0] * B, {LOOKUP.name: Offer(tokens, None)}),
                             PlannedStep(LOOKUP.name, keys, probs, depth, {}))
    taken = np.full((B, max(1, int(depth.max()))), np.nan)
    for b in range(B):
        taken[b, : depth[b]] = probs[b, : depth[b]]
    want = torch.from_numpy(expected_accepted_length(taken)).to(torch.float32)
    assert torch.equal(d.expected_accepted, want)
    assert torch.equal(torch.nan_to_num(d.probs, -1.0), torch.nan_to_num(torch.from_numpy(taken).float(), -1.0))
