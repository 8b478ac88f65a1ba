"""Hypothesis strategies shared by the allocator tests."""

from __future__ import annotations

import math

import torch
from hypothesis import strategies as st

from tests.synthetic import two_chain_tables  # noqa: F401 -- shared by the allocator tests

NAN = float("nan")
# Exact dyadic values make ties likely; NaN ends a chain; free floats cover the rest.
probability = st.one_of(
    st.sampled_from([0.0, 0.25, 0.5, 0.75, 1.0, NAN]),
    st.floats(0.0, 1.0, width=32),
)


@st.composite
def prob_matrix(draw, rows: int, max_cols: int, min_cols: int = 1) -> torch.Tensor:
    cols = draw(st.integers(min_cols, max_cols))
    values = draw(st.lists(probability, min_size=rows * cols, max_size=rows * cols))
    return torch.tensor(values, dtype=torch.float32).reshape(rows, cols)


@st.composite
def instance(draw, max_b: int = 4, max_k: int = 3, two: bool = False):
    b = draw(st.integers(1, max_b))
    model_p = draw(prob_matrix(b, max_k))
    ngram_p = draw(prob_matrix(b, max_k)) if two else None
    return model_p, ngram_p


@st.composite
def cost_curve(draw, max_len: int, min_len: int = 1) -> torch.Tensor:
    """Verify-cost curves: increasing, flat-then-steep, or arbitrary (non-convex) positive values;
    sometimes too short for most allocations, sometimes with an infeasible (+inf) total. Pass
    ``min_len = B + 1``: shorter curves, and 0 / NaN entries, are refused (test_boundary.py)."""
    n = draw(st.integers(min_len, max(max_len, min_len)))
    kind = draw(st.sampled_from(["increasing", "arbitrary", "step"]))
    if kind == "increasing":
        steps = draw(st.lists(st.floats(0.0, 1.0), min_size=n, max_size=n))
        values = [1.0 + s for s in itertools_accumulate(steps)]
    elif kind == "step":
        width = draw(st.integers(1, 4))
        values = [1.0 + 0.5 * (t // width) for t in range(n)]
    else:
        values = draw(st.lists(st.floats(0.5, 3.0), min_size=n, max_size=n))
    if n > min_len + 1 and draw(st.booleans()):
        values[draw(st.integers(min_len, n - 1))] = math.inf
    return torch.tensor(values, dtype=torch.float32)


def itertools_accumulate(xs):
    total, out = 0.0, []
    for x in xs:
        total += x
        out.append(total)
    return out


def chains(model_p: torch.Tensor, ngram_p: torch.Tensor | None, row: int):
    """(drafter id, gains) pairs of one request, as plain Python lists."""
    from bruteforce import gains

    out = [(1, gains(model_p[row].tolist()))]
    if ngram_p is not None:
        out.append((2, gains(ngram_p[row].tolist())))
    return out


def chain_length(p: torch.Tensor, row: int) -> int:
    n = 0
    for x in p[row].tolist():
        if math.isnan(x):
            break
        n += 1
    return n


def pair(model_p, ngram_p=None) -> dict:
    """The allocator's chain mapping for the model chain and, if given, the n-gram chain."""
    return {"model": model_p} | ({} if ngram_p is None else {"ngram": ngram_p})


def assert_same(ref, other):
    """Two allocations take the same decisions bit for bit; their expected lengths agree to float32 rounding."""
    assert torch.equal(ref.drafter, other.drafter), (ref.drafter, other.drafter)
    assert torch.equal(ref.depth, other.depth), (ref.depth, other.depth)
    torch.testing.assert_close(ref.expected_accepted, other.expected_accepted, rtol=1e-6, atol=1e-6)
