"""calib/serve/allocation.py: the serving decider's numpy path (impl="host") decides as the torch reference does,
on SYNTHETIC tables (tests/serve/decide_cases.py's): the same drafts, chains and depths bit for bit, the chosen
chain's probabilities per verified token, expected accepted lengths to float32 rounding; under a flat curve and a
sampled step's shape price; a curve too short for the batch is refused as the torch path refuses it."""

from __future__ import annotations

import pytest
import torch

from calib.cost.serving import SampledPrice
from calib.serve import decide_step
from tests.serve.decide_cases import cheap_curve, random_inputs, synthetic_history, synthetic_tables


def _same(ref, out):
    assert out.drafts == ref.drafts
    assert torch.equal(out.chain, ref.chain) and torch.equal(out.depth, ref.depth)
    torch.testing.assert_close(out.expected_accepted, ref.expected_accepted, rtol=1e-6, atol=1e-6)
    assert ref.probs is not None and out.probs is not None
    assert torch.equal(out.probs.isnan(), ref.probs.isnan())
    assert torch.equal(out.probs.nan_to_num(), ref.probs.nan_to_num())


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("offered", [("model", "ngram"), ("model",), ("ngram",)])
def test_host_decides_as_the_reference(seed, offered):
    t = synthetic_tables(seed + 40)
    B = 6
    inputs = random_inputs(B=B, seed=seed, model="model" in offered, ngram="ngram" in offered)
    h = synthetic_history(inputs.req_ids, seed)
    sampled = SampledPrice(per_draft=0.004 * (seed + 1), per_drafting_request=0.01 * seed)
    for cost in (cheap_curve(B), torch.linspace(1.0, 4.0, 60), 1.0 + 0.01 * torch.arange(60, dtype=torch.float32)):
        for price in (None, sampled):
            ref = decide_step(t, inputs, h, k_max=4, cost=cost, sampled_price=price)
            _same(ref, decide_step(t, inputs, h, k_max=4, cost=cost, sampled_price=price, impl="host"))


def test_a_curve_too_short_for_the_batch_is_refused_alike():
    t = synthetic_tables(3)
    inputs = random_inputs(B=6, seed=1)
    h = synthetic_history(inputs.req_ids, 1)
    for impl in ("reference", "host"):
        with pytest.raises(ValueError, match=r"needs at least B \+ 1 = 7"):
            decide_step(t, inputs, h, k_max=4, cost=torch.linspace(1.0, 2.0, 5), impl=impl)
