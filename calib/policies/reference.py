"""vLLM's own fixed arms: ``no_spec`` (verify nothing), the ``fixed`` family (γ of the bank's drafter for every
request), the ``second_fixed`` family (γ of the other drafter the bank records, e.g. vLLM's n-gram arm on an
EAGLE bank, whose rounds carry the n-gram chain) and the ``vllm_suffix`` family (vLLM's suffix decoding at γ, on a
bank that records the suffix chain): what a vLLM user could deploy by hand instead of calib."""

from __future__ import annotations

import logging

import numpy as np

from calib.policies.base import Arm, Policy, PolicyResult, Serving, register_policy
from calib.policies.setting import Setting


def no_spec(s: Setting) -> PolicyResult:
    none = np.zeros((s.S, s.B), dtype=np.int64)
    return PolicyResult(np.ones((s.S, s.B)), s.plain.charge(none), np.zeros(s.S), {})


def fixed(s: Setting) -> dict:
    out = {}
    for g in range(1, s.K + 1):
        tok, cost, pos = s.uniform(np.full(s.S, g), s.draft(g))
        out[f"fixed_{g}"] = PolicyResult(tok, cost, pos, {"gamma": g})
    return out


SUFFIX = "suffix"  # the suffix chain's registered name (calib/chains/suffix.py)
log = logging.getLogger("calib.policies")


def vllm_suffix(s: Setting) -> dict | None:
    """vLLM's suffix decoding (``speculative=suffix``) served alone at a fixed γ, rows ``vllm_suffix_<γ>``: on a bank
    whose verified chain is the suffix chain (data/banks/suffix-*) that chain at γ (what ``fixed`` replays there),
    where it is the bank's second chain that chain alone as ``second_fixed`` prices it. A bank without the suffix
    chain cannot replay it: None, and one note on the bank (metrics.json's and the report's bank notes)."""
    if s.sb.names[0] == SUFFIX:
        return {f"vllm_suffix_{g}": PolicyResult(*s.uniform(np.full(s.S, g), s.draft(g)), {"gamma": g})
                for g in range(1, s.K + 1)}
    if s.sb.names[1] == SUFFIX:
        return {f"vllm_suffix_{g}": PolicyResult(*s.uniform_second(np.full(s.S, g)), {"gamma": g})
                for g in range(1, s.K + 1)}
    bank = s.sb.bank
    note = (f"vllm_suffix (vLLM's suffix decoding) not replayed: the bank records no suffix chain "
            f"(its chains: {', '.join(bank.chains)}; a suffix bank does: collect.py speculative=suffix, data/banks/suffix-*)")
    if note not in bank.notes:  # once per bank, whatever its settings and cost curves
        bank.notes.append(note)
        log.warning("bank %s: %s", bank.name, note)
    return None


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
    # vllm_suffix needs the suffix tree (make install-suffix): run when bench/serve.py --arms names it
    serving=Serving(speculate=True, arms=(Arm("vllm_eagle", "eagle"), Arm("vllm_ngram", "ngram"),
                                          Arm("vllm_suffix", "suffix", default=False))),
    aliases=("vllm",)))
# Replayed only (the clock serves it as `vllm_ngram` from the n-gram engine): the bank's other drafter alone.
SECOND_FIXED = register_policy(Policy(
    "second_fixed", 91, None, "vLLM's fixed γ of the bank's other drafter served alone (rows second_fixed_<γ>; "
    "vLLM's n-gram arm on an EAGLE bank): no model drafter loaded", second_fixed, family=True, plot=False,
    pooled_extra=("gamma",), camp="peer",
    below_no_spec="verifies γ tokens of the other chain for every request whatever its odds"))
# Replayed only (the clock serves it as fixed's `vllm_suffix` arm, speculative=suffix): vLLM's suffix decoding alone.
VLLM_SUFFIX = register_policy(Policy(
    "vllm_suffix", 92, None, "vLLM's suffix decoding at a fixed γ (rows vllm_suffix_<γ>; the suffix tree over the "
    "prompt and earlier outputs): replayed only on a bank that records the suffix chain, skipped with a note elsewhere",
    vllm_suffix, family=True, plot=False, pooled_extra=("gamma",), camp="peer",
    below_no_spec="verifies γ suffix-tree tokens for every request whatever its odds"))
