"""n-gram recomputation matches vLLM's proposer; features and counterfactual labels by hand."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from calib.ngram import find_match, label_chain


@settings(max_examples=400, deadline=None)
@given(ctx=st.lists(st.integers(0, 4), min_size=1, max_size=60), min_n=st.integers(1, 3),
       extra=st.integers(0, 3), k=st.integers(1, 6))
def test_chain_matches_vllm(ctx, min_n, extra, k):
    vllm_ngram = pytest.importorskip("vllm.v1.spec_decode.ngram_proposer")
    max_n = min_n + extra
    want = vllm_ngram._find_longest_matched_ngram_and_propose_tokens(
        np.array(ctx, dtype=np.int32), min_n, max_n, 10_000, k).tolist()
    assert find_match(ctx, min_n, max_n, k).tokens == want


def test_features_by_hand():
    #        0  1  2  3  4  5  6  7  8  9
    ctx = [7, 1, 2, 3, 9, 1, 2, 4, 1, 2]  # suffix [1, 2] occurs at 1 and 5 (not at 8: itself)
    m = find_match(ctx, 1, 3, k=3, prompt_len=4)
    assert m.match_n == 2 and m.occurrences == 2
    assert m.tokens == [3, 9, 1]  # earliest occurrence (start 1), continuation from index 3
    assert m.distance == 10 - 1 and m.cont_len == 10 - 3
    assert m.in_prompt  # the match [1, 2] at 1..2 lies inside the 4-token prompt
    assert m.distinct_next == 2 and m.agreement == 0.5  # next tokens 3 and 4


def test_no_match():
    m = find_match([1, 2, 3, 4], 1, 3, k=4)
    assert m.tokens == [] and m.match_n == 0 and m.occurrences == 0


def test_max_model_len_caps_chain():
    assert find_match([5, 6, 5, 6, 5], 1, 2, k=4, max_model_len=7).tokens == [6, 5]


def test_label_chain():
    final = [0, 1, 2, 3, 4, 5]
    assert label_chain([3, 4, 9], 3, final) == (2, [1, 1, 0])
    assert label_chain([9, 4], 3, final) == (0, [0, 0])
    # Beyond the end of the realised sequence the token would not be committed.
    assert label_chain([5, 6], 5, final) == (1, [1, 0])


def _find_match_windows(context, min_n, max_n, k, prompt_len=0, max_model_len=None):
    """The sliding-window matcher find_match replaced (kept to test that the faster one is the same)."""
    from numpy.lib.stride_tricks import sliding_window_view

    from calib.ngram import NgramMatch

    ctx = np.asarray(context, dtype=np.int64)
    total = ctx.shape[0]
    out = NgramMatch(context_len=int(total))
    if max_model_len is not None:
        k = min(k, max_model_len - total)
    if total < min_n or k <= 0:
        return out
    for n in range(min(max_n, total - 1), min_n - 1, -1):
        windows = sliding_window_view(ctx[: total - 1], n)
        starts = np.flatnonzero((windows == ctx[total - n:]).all(axis=1))
        if starts.size == 0:
            continue
        ends = starts + n
        start = int(starts[0])
        end = start + n
        chain = ctx[end: end + min(k, total - end)]
        nxt = ctx[ends]
        out.tokens, out.match_n, out.occurrences = chain.tolist(), n, int(starts.size)
        out.distance, out.in_prompt = int(total - start), bool(end <= prompt_len)
        out.distinct_next, out.agreement = int(np.unique(nxt).size), float(np.mean(nxt == chain[0]))
        out.cont_len = int(total - end)
        out.depth_agreement = _depth_agreement_naive(ctx.tolist(), ends.tolist(), chain.tolist())
        return out
    return out


def _depth_agreement_naive(ctx, ends, chain):
    """Per depth: of the occurrences whose continuation equals chain[:j] and reaches depth j, the share with chain[j]."""
    out = []
    for j in range(len(chain)):
        known = [e for e in ends if e + j < len(ctx) and ctx[e: e + j] == chain[:j]]
        out.append(sum(ctx[e + j] == chain[j] for e in known) / len(known))
    return out


def test_depth_agreement_by_hand():
    """Three earlier occurrences of (1, 2): their next tokens are 3, 4, 3; of the two with 3, one goes on with 9."""
    m = find_match([5, 1, 2, 3, 9, 1, 2, 4, 7, 1, 2, 3, 8, 1, 2], 1, 4, 4)
    assert m.tokens == [3, 9, 1, 2]
    assert m.depth_agreement == pytest.approx([2 / 3, 1 / 2, 1.0, 1.0])
    assert m.depth_agreement[0] == m.agreement
    assert find_match([1, 2, 3], 1, 4, 4).depth_agreement == []  # no match


def test_find_match_equals_the_sliding_window_matcher():
    """SYNTHETIC contexts (small vocabularies: many and overlapping matches, and none)."""
    rng = np.random.default_rng(0)
    for _ in range(3000):
        total = int(rng.integers(0, 60))
        ctx = rng.integers(0, int(rng.integers(1, 8)), total)
        min_n = int(rng.integers(1, 4))
        max_n = int(rng.integers(min_n, 6))
        k = int(rng.integers(1, 6))
        prompt_len = int(rng.integers(0, total + 1))
        mml = None if rng.random() < 0.5 else int(total + rng.integers(0, 4))
        assert find_match(ctx, min_n, max_n, k, prompt_len, mml) == _find_match_windows(
            ctx, min_n, max_n, k, prompt_len, mml), (ctx.tolist(), min_n, max_n, k, prompt_len, mml)


@settings(max_examples=300, deadline=None)
@given(data=st.data(), batch=st.integers(1, 4), min_n=st.integers(1, 3), extra=st.integers(0, 3),
       k=st.integers(1, 6), capped=st.booleans())
def test_batch_matches_equal_one_at_a_time(data, batch, min_n, extra, k, capped):
    """The step-wide matcher (compiled where numba is installed) finds what find_match finds, request by request,
    on an engine's token buffer with tokens not yet written behind it."""
    from calib.ngram import MATCH_FEATURES, find_matches

    width = 40
    buf = np.array(data.draw(st.lists(st.lists(st.integers(0, 4), min_size=width, max_size=width),
                                      min_size=batch + 1, max_size=batch + 1)), dtype=np.int32)
    rows = data.draw(st.permutations(range(batch + 1)))[:batch]
    lengths = [data.draw(st.integers(0, width)) for _ in range(batch)]
    late = [data.draw(st.lists(st.integers(0, 4), max_size=3)) for _ in range(batch)]
    prompt = [data.draw(st.integers(0, width)) for _ in range(batch)]
    pad = np.zeros((batch, 3), dtype=np.int64)
    for b, x in enumerate(late):
        pad[b, : len(x)] = x
    limit = data.draw(st.integers(1, width + 5)) if capped else None
    tokens, feats = find_matches(buf, rows, lengths, prompt, min_n, min_n + extra, k, limit, pad, [len(x) for x in late])
    for b in range(batch):
        ctx = list(buf[rows[b], : lengths[b]]) + late[b]
        m = find_match(ctx, min_n, min_n + extra, k, prompt[b], limit)
        assert tokens[b] == m.tokens
        assert feats[b, : len(MATCH_FEATURES)].tolist() == [float(m.features()[f]) for f in MATCH_FEATURES]
        depth = feats[b, len(MATCH_FEATURES):]
        assert depth[: len(m.tokens)].tolist() == m.depth_agreement
        assert np.isnan(depth[len(m.tokens):]).all()
