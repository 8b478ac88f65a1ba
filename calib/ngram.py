"""Prompt-lookup (n-gram) chains and their match features, recomputed from a context.

vLLM's ``NgramProposer`` computes the match inside numba and exposes only the drafted tokens, so
calib recomputes the same match here (tests check it against vLLM's own function) and adds the
features an acceptance model needs. Pure numpy: no engine import.

vLLM's rule: the longest n in [min_n, max_n] such that the context's last n tokens occur earlier
(the occurrence ending before the last token); among those occurrences, the earliest; the chain is
up to k tokens that follow it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class NgramMatch:
    tokens: list[int] = field(default_factory=list)  # the proposed chain (empty: no match)
    match_n: int = 0
    occurrences: int = 0
    distance: int = 0  # context_len - start of the match used
    in_prompt: bool = False  # the matched n-gram lies wholly inside the prompt
    distinct_next: int = 0
    agreement: float = 0.0  # share of occurrences whose next token is the chain's first token
    cont_len: int = 0  # tokens after the match used, up to the context end
    context_len: int = 0

    def features(self) -> dict:
        return {
            "match_n": self.match_n, "occurrences": self.occurrences, "distance": self.distance,
            "in_prompt": self.in_prompt, "distinct_next": self.distinct_next,
            "agreement": self.agreement, "cont_len": self.cont_len, "context_len": self.context_len,
        }


def find_match(context, min_n: int, max_n: int, k: int, prompt_len: int = 0,
               max_model_len: int | None = None) -> NgramMatch:
    """The chain vLLM's n-gram proposer would draft from ``context``, with its match features."""
    ctx = np.asarray(context, dtype=np.int64)
    total = ctx.shape[0]
    out = NgramMatch(context_len=int(total))
    if max_model_len is not None:
        k = min(k, max_model_len - total)
    if total < min_n or k <= 0:
        return out
    top = min(max_n, total - 1)
    if top < min_n:
        return out
    # An occurrence of the last n tokens is a window ctx[s:s+n] ending before the last token (it may
    # overlap the suffix). Its last element sits at i = s+n-1 <= total-2 with ctx[i] == ctx[-1]: find
    # those once, then keep the candidates that also match 2, 3, ... tokens back (one pass per depth
    # over the few candidates, not over the whole context).
    ends_at = np.flatnonzero(ctx[: total - 1] == ctx[total - 1])
    alive = [ends_at]
    for j in range(1, top):
        prev = alive[-1]
        prev = prev[prev >= j]
        alive.append(prev[ctx[prev - j] == ctx[total - 1 - j]])
    for n in range(top, min_n - 1, -1):
        last = alive[n - 1]
        if last.size == 0:
            continue
        starts = last - (n - 1)
        ends = starts + n
        start = int(starts[0])
        end = start + n
        chain = ctx[end: end + min(k, total - end)]
        nxt = ctx[ends]  # every occurrence ends before the last token, so a next token exists
        out.tokens = chain.tolist()
        out.match_n = n
        out.occurrences = int(starts.size)
        out.distance = int(total - start)
        out.in_prompt = bool(end <= prompt_len)
        out.distinct_next = int(np.unique(nxt).size)
        out.agreement = float(np.mean(nxt == chain[0]))
        out.cont_len = int(total - end)
        return out
    return out


def label_chain(chain, context_len: int, final_tokens) -> tuple[int, list[int]]:
    """Accepted prefix length and accept mask of ``chain`` against the realised sequence.

    ``final_tokens`` is the whole sequence (prompt + output) after the request finished. A chain
    token at a position the request never reached (it stopped first) counts as not accepted,
    since it would not have been committed.
    """
    final = np.asarray(final_tokens, dtype=np.int64)
    truth = final[context_len: context_len + len(chain)]
    match = np.zeros(len(chain), dtype=bool)
    match[: truth.size] = truth == np.asarray(chain[: truth.size], dtype=np.int64)
    accept = int(np.argmin(match)) if not match.all() else len(chain)
    return accept, [1 if j < accept else 0 for j in range(len(chain))]
