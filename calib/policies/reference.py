"""vLLM's own fixed arms: ``no_spec`` (verify nothing), the ``fixed`` family (γ of the bank's drafter for every
request) and the ``second_fixed`` family (γ of the other drafter the bank records, e.g. vLLM's n-gram arm on an
EAGLE bank, whose rounds carry the n-gram chain): what a vLLM user could deploy by hand instead of calib."""

from __future__ import annotations

import numpy as np

from calib.policies.base import Arm, Policy, PolicyResult, Serving, register_policy
from calib.policies.setting import Setting


def no_spec(s: Setting) -> PolicyResult:
    return PolicyResult(np.full(s.S, float(s.B)), np.full(s.S, s.plain.values[s.B]), np.zeros(s.S), {})


def fixed(s: Setting) -> dict:
    out = {}
    for g in range(1, s.K + 1):
        tok, cost, pos = s.uniform(np.full(s.S, g), s.draft(g))
        out[f"fixed_{g}"] = PolicyResult(tok, cost, pos, {"gamma": g})
    return out


def second_fixed(s: Setting) -> dict | None:
    """vLLM's fixed γ of the bank's second chain served alone (the engine that drafts only that chain: on an
    EAGLE bank, vLLM's n-gram arm; no model drafter loaded, so no idle drafter forward is charged); rows
    ``second_fixed_<γ>``. None on a bank without a second chain."""
    if not s.sb.second:
        return None
    out = {}
    for g in range(1, s.K + 1):
        tok, cost, pos = s.uniform_second(np.full(s.S, g))
        out[f"second_fixed_{g}"] = PolicyResult(tok, cost, pos, {"gamma": g})
    return out


# No speculation: plain decoding (the reference for greedy output identity); `speculative` is ignored.
NO_SPEC = register_policy(Policy(
    "no_spec", 10, "0.6", "verify nothing; one token per request per pass", no_spec, camp="peer",
    serving=Serving(speculate=False, arms=(Arm("none"),)), aliases=("none",)))
# Served: vLLM's own speculation with `speculative` as configured (K = speculative.num_speculative_tokens).
FIXED = register_policy(Policy(
    "fixed", 90, None, "every request verifies min(γ, drafted) tokens and pays γ draft passes (rows fixed_<γ>)",
    fixed, family=True, plot=False, pooled_extra=("gamma",), camp="peer",
    below_no_spec="verifies γ tokens for every request whatever its odds: where acceptance is low or the "
                  "per-position cost is high, the extra positions cost more than the tokens they bring "
                  "(`best_fixed` includes γ = 0, i.e. no_spec)",
    serving=Serving(speculate=True, arms=(Arm("vllm_eagle", "eagle"), Arm("vllm_ngram", "ngram"))),
    aliases=("vllm",)))
# Replayed only (the clock serves it as `vllm_ngram` from the n-gram engine): the bank's other drafter alone.
SECOND_FIXED = register_policy(Policy(
    "second_fixed", 91, None, "vLLM's fixed γ of the bank's other drafter served alone (rows second_fixed_<γ>; "
    "vLLM's n-gram arm on an EAGLE bank): no model drafter loaded", second_fixed, family=True, plot=False,
    pooled_extra=("gamma",), camp="peer",
    below_no_spec="verifies γ tokens of the other chain for every request whatever its odds"))
