"""The plan's own allocation as the step's decision (calib/vllm/server.py ``Server.planned_decision``).

SYNTHETIC inputs, no engine. That the plan's n-gram depths equal the allocator's decision on that chain
alone is tests/allocate/test_draft.py (``test_a_plan_that_stops_before_the_first_pass_...``); here: the
server hands them back only when the step is the one the plan saw, and decides as usual otherwise.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from calib.chains import NO_CHAIN, Offer, chains
from calib.serve import StepInputs
from calib.serve.knobs import ServeKnobs
from calib.vllm.server import Server

MODEL = next(k for k in chains() if k.confidence is not None)
LOOKUP = next(k for k in chains() if k.propose is not None)


def _server():
    srv = Server(ServeKnobs("unused-tables"))
    srv.lookup = LOOKUP.name
    srv.decider = SimpleNamespace(enabled=True)
    tokens = [[5, 6, 7], [8, 9], []]
    probs = [torch.tensor([0.9, 0.8, 0.2]), torch.tensor([0.5, 0.4]), torch.zeros(0)]
    depths = [2, 0, 0]
    keys = {r: (r, 10 + i, 3) for i, r in enumerate("abc")}
    srv.matches = {r: (keys[r], tokens[i], None) for i, r in enumerate("abc")}
    planned = {r: (keys[r], probs[i], depths[i]) for i, r in enumerate("abc")}
    inputs = StepInputs(list("abc"), [0.0] * 3, {LOOKUP.name: Offer(tokens, None)})
    return srv, planned, inputs


def test_a_step_the_plan_allocated_takes_its_depths():
    srv, planned, inputs = _server()
    d = srv.planned_decision(inputs, planned)
    assert d is not None and not d.passthrough
    assert d.drafts == [[5, 6], [], []]
    assert d.depth.tolist() == [2, 0, 0] and d.chain.tolist() == [LOOKUP.id, NO_CHAIN, NO_CHAIN]
    assert torch.allclose(d.expected_accepted, torch.tensor([0.9 + 0.9 * 0.8, 0.0, 0.0]))
    assert srv.stats.plan_decided == 1


def test_anything_the_plan_did_not_see_is_decided_as_usual():
    srv, planned, inputs = _server()
    moved = dict(planned, b=(("b", 99, 3), *planned["b"][1:]))  # another context than the decision's
    assert srv.planned_decision(inputs, moved) is None
    ran = dict(planned, a=(*planned["a"][:2], None))  # the plan ran a pass: its depths are not the step's
    assert srv.planned_decision(inputs, ran) is None
    assert srv.planned_decision(inputs, {k: v for k, v in planned.items() if k != "c"}) is None
    bigger = {**planned, "d": (("d", 7, 1), torch.tensor([0.9]), 1)}  # planned for a batch the step is not
    assert srv.planned_decision(inputs, bigger) is None
    both = StepInputs(inputs.req_ids, inputs.temperature,
                      {**inputs.offers, MODEL.name: Offer([[1], [], []], torch.full((3, 1), 0.5))})
    assert srv.planned_decision(both, planned) is None  # the model drafted: decide on both chains
    srv.decider.enabled = False
    assert srv.planned_decision(inputs, planned) is None
    assert srv.stats.plan_decided == 0
