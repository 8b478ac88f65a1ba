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
    # per depth j of the chain: of the occurrences whose continuation agrees with the chain's first j tokens (and
    # reaches depth j inside the context), the share that goes on with its token j; depth 0 is ``agreement``
    depth_agreement: list[float] = field(default_factory=list)

    def features(self) -> dict:
        """The round's match features (:data:`MATCH_FEATURES`), then the per-depth ``depth_agreement`` list."""
        return {
            "match_n": self.match_n, "occurrences": self.occurrences, "distance": self.distance,
            "in_prompt": self.in_prompt, "distinct_next": self.distinct_next,
            "agreement": self.agreement, "cont_len": self.cont_len, "context_len": self.context_len,
            DEPTH_FEATURE: list(self.depth_agreement),
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
        out.depth_agreement = depth_agreement(ctx, ends, chain)
        return out
    return out


def depth_agreement(ctx: np.ndarray, ends: np.ndarray, chain: np.ndarray) -> list[float]:
    """Per depth j of ``chain``: among the occurrences (ending at ``ends``, exclusive) whose continuation in ``ctx``
    agrees with ``chain[:j]`` and reaches depth j, the share whose token j is ``chain[j]``. The chain is one
    occurrence's continuation, so every share is above 0; depth 0 is the round's ``agreement``. Where every earlier
    occurrence still agrees at a deep depth, the chain is likelier right there than its match alone says."""
    alive, out = np.asarray(ends, dtype=np.int64), []
    for j, tok in enumerate(np.asarray(chain).tolist()):
        alive = alive[alive + j < ctx.shape[0]]
        same = alive[ctx[alive + j] == tok]
        out.append(float(same.size / alive.size))
        alive = same
    return out


# The round columns of :func:`find_matches`' feature array, in NgramMatch.features() order; the array then holds
# ``k`` columns of ``depth_agreement`` (NaN beyond the chain).
MATCH_FEATURES = ("match_n", "occurrences", "distance", "in_prompt", "distinct_next", "agreement", "cont_len",
                  "context_len")
DEPTH_FEATURE = "depth_agreement"  # the per-depth feature (a list in NgramMatch.features())
_N_ROUND = len(MATCH_FEATURES)  # where the kernel writes depth_agreement (a constant numba compiles in)


def find_matches(token_ids, rows, num_tokens, prompt_lens, min_n: int, max_n: int, k: int,
                 max_model_len: int | None = None, extra=None, extra_len=None):
    """:func:`find_match` for a batch at once, on an engine's token buffer: request ``b``'s context is
    ``token_ids[rows[b], :num_tokens[b]]`` followed by ``extra[b, :extra_len[b]]`` (tokens not yet written).
    Returns ``(tokens [B][<= k], features float64 [B, len(MATCH_FEATURES) + k])``: the round columns, a row of zeros
    but ``context_len`` where there is no match (as :class:`NgramMatch` holds then), then ``depth_agreement`` per
    depth, NaN beyond the chain. One compiled call per
    step where numba is installed (vLLM's own n-gram proposer uses it; calib's serving path then costs
    microseconds per request), else :func:`find_match` per request; both give the same (tested)."""
    B = len(rows)
    rows = np.asarray(rows, dtype=np.int64)
    num_tokens = np.asarray(num_tokens, dtype=np.int64)
    prompt_lens = np.asarray(prompt_lens, dtype=np.int64)
    if extra is None:
        extra, extra_len = np.zeros((B, 1), dtype=np.int64), np.zeros(B, dtype=np.int64)
    extra, extra_len = np.asarray(extra, dtype=np.int64).reshape(B, -1), np.asarray(extra_len, dtype=np.int64)
    limit = -1 if max_model_len is None else int(max_model_len)
    kernel = _batch_kernel()
    if kernel is None:
        return _find_matches_numpy(token_ids, rows, num_tokens, prompt_lens, min_n, max_n, k, limit, extra,
                                   extra_len)
    chains = np.zeros((B, max(int(k), 1)), dtype=np.int64)
    lengths = np.zeros(B, dtype=np.int64)
    feats = np.zeros((B, len(MATCH_FEATURES) + max(int(k), 1)), dtype=np.float64)
    feats[:, len(MATCH_FEATURES):] = np.nan
    kernel(np.asarray(token_ids), rows, num_tokens, prompt_lens, int(min_n), int(max_n), int(k), limit, extra,
           extra_len, chains, lengths, feats)
    return [c[:n] for c, n in zip(chains.tolist(), lengths.tolist())], feats  # two tolist calls, not one per row


def _find_matches_numpy(token_ids, rows, num_tokens, prompt_lens, min_n, max_n, k, limit, extra, extra_len):
    n_round = len(MATCH_FEATURES)
    tokens, feats = [], np.full((len(rows), n_round + max(int(k), 1)), np.nan)
    for b, r in enumerate(rows.tolist()):
        ctx = np.concatenate([np.asarray(token_ids[r, : num_tokens[b]], dtype=np.int64), extra[b, : extra_len[b]]])
        m = find_match(ctx, min_n, max_n, k, int(prompt_lens[b]), None if limit < 0 else limit)
        tokens.append(m.tokens)
        f = m.features()
        feats[b, :n_round] = [float(f[name]) for name in MATCH_FEATURES]
        feats[b, n_round: n_round + len(m.depth_agreement)] = m.depth_agreement
    return tokens, feats


_KERNEL: list = []  # [compiled kernel or None], filled at first use


def _batch_kernel():
    """The numba-compiled batch matcher, or None where numba is not installed (compiled once per process,
    cached on disk by numba)."""
    if not _KERNEL:
        try:
            from numba import njit
        except ImportError:
            _KERNEL.append(None)
        else:
            _KERNEL.append(njit(cache=True, nogil=True)(_match_batch))
    return _KERNEL[0]


def _match_batch(token_ids, rows, num_tokens, prompt_lens, min_n, max_n, k, limit, extra, extra_len,
                 chains, lengths, feats):  # pragma: no cover - run compiled (numba); _find_matches_numpy is its twin
    """find_match's rule, per request, in loops numba compiles (see :func:`find_matches`)."""
    for b in range(rows.shape[0]):
        n_buf, n_extra, row = num_tokens[b], extra_len[b], rows[b]
        total = n_buf + n_extra
        feats[b, 7] = total
        kk = k if limit < 0 else min(k, limit - total)
        if total < min_n or kk <= 0:
            continue
        top = min(max_n, total - 1)
        if top < min_n:
            continue
        ctx = np.empty(total, dtype=np.int64)
        for i in range(n_buf):
            ctx[i] = token_ids[row, i]
        for i in range(n_extra):
            ctx[n_buf + i] = extra[b, i]
        # one pass: how many of the context's last tokens (up to top) end at each earlier index i
        best, ends = 0, np.zeros(total, dtype=np.int64)
        for i in range(total - 1):
            m = 0
            while m < top and m <= i and ctx[i - m] == ctx[total - 1 - m]:
                m += 1
            ends[i] = m
            best = max(best, m)
        if best < min_n:
            continue
        n, count, first = best, 0, -1  # the longest n-gram; its earliest occurrence; their next tokens
        nxt = np.empty(total, dtype=np.int64)
        alive = np.empty(total, dtype=np.int64)  # where each occurrence's continuation starts
        for i in range(total - 1):
            if ends[i] >= n:
                if first < 0:
                    first = i
                nxt[count] = ctx[i + 1]
                alive[count] = i + 1
                count += 1
        end = first + 1
        m = min(kk, total - end)
        for j in range(m):
            chains[b, j] = ctx[end + j]
        lengths[b] = m
        seen = np.sort(nxt[:count])
        distinct, agree = 1, 0
        for j in range(count):
            if j and seen[j] != seen[j - 1]:
                distinct += 1
            if nxt[j] == ctx[end]:
                agree += 1
        feats[b, 0] = n
        feats[b, 1] = count
        feats[b, 2] = total - (end - n)
        feats[b, 3] = 1.0 if end <= prompt_lens[b] else 0.0
        feats[b, 4] = distinct
        feats[b, 5] = agree / count
        feats[b, 6] = total - end
        # depth_agreement: the occurrences still agreeing with the chain, narrowed depth by depth
        n_alive = count
        for j in range(m):
            known, same = 0, 0
            for a in range(n_alive):
                at = alive[a] + j
                if at < total:
                    known += 1
                    if ctx[at] == ctx[end + j]:
                        alive[same] = alive[a]
                        same += 1
            feats[b, _N_ROUND + j] = same / known
            n_alive = same


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
