"""Serving mode, engine-independent core: per-request history context and the per-step decision.

>>> from calib.chains import Offer
>>> from calib.serve import RequestHistory, SafeDecider, StepInputs
>>> decider = SafeDecider("runs/train/default", model_id=..., speculator="eagle:head", k_max=4, cost=curve)
>>> offers = {"model": Offer(model_tokens, model_conf), "ngram": Offer(ngram_tokens, ngram_x)}
>>> out = decider.decide(StepInputs(req_ids, temperature, offers))
>>> out.drafts     # the new draft list per request, each <= k_max tokens
>>> decider.observe(req_id, accepted, drafted)   # after each verify step; decider.finish(req_id) at the end

The vLLM wing's serving subscriber (:mod:`calib.vllm.serving`, installed by the plugin when ``CALIB_SERVE``
holds the knobs, :class:`calib.serve.knobs.ServeKnobs`; docs/serving_hooks.md) calls these; see docs/serving.md.
"""

from calib.serve.decide import (
    SafeDecider,
    StepDecision,
    StepInputs,
    chain_inputs,
    decide_step,
)
from calib.serve.history import RequestHistory

__all__ = [
    "RequestHistory",
    "SafeDecider",
    "StepDecision",
    "StepInputs",
    "chain_inputs",
    "decide_step",
]
