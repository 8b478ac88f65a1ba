"""Shape-aware price mode (calib/allocate/shape.py): exact against brute force, the Triton kernel takes the
reference's decisions, and a flat affine curve is its special case."""

from __future__ import annotations

import math

import pytest
import torch
from bruteforce import best_shape_goodput, options, shape_goodput
from strategies import assert_same, chains, pair

from calib.allocate import ShapePrice, allocate_probs

TOL = 1e-5  # gains on the 2**-24 grid, prices on base / 2**30, float32 products vs float64 brute force
NAN = float("nan")


def random_probs(gen: torch.Generator, b: int, k: int) -> torch.Tensor:
    p = torch.rand(b, k, generator=gen) ** 0.4
    dyadic = torch.tensor([0.0, 0.25, 0.5, 0.75, 1.0])[torch.randint(0, 5, (b, k), generator=gen)]
    p = torch.where(torch.rand(b, k, generator=gen) < 0.25, dyadic, p)  # ties and exact zeros
    ends = torch.randint(0, k + 2, (b, 1), generator=gen)  # chains of every length, some empty
    return torch.where(torch.arange(k)[None, :] >= ends, NAN, p)


def random_price(gen: torch.Generator, b: int, width: int, kind: str) -> ShapePrice:
    base = float(0.5 + torch.rand(1, generator=gen))
    u = torch.rand(b, width, generator=gen, dtype=torch.float64)
    if kind == "concave":  # MoE-like: each deeper position costs less than the one before
        steps = (0.05 + 0.4 * u).sort(dim=1, descending=True).values
    elif kind == "convex":
        steps = (0.05 + 0.4 * u).sort(dim=1).values
    elif kind == "shared":  # one row for every request
        steps = (0.05 + 0.4 * u[:1]).expand(b, -1)
    else:  # arbitrary non-negative steps, zeros included
        steps = torch.where(u < 0.2, 0.0, 0.6 * u)
    table = torch.cat([torch.zeros(b, 1, dtype=torch.float64), steps.cumsum(dim=1)], dim=1)
    if kind == "arbitrary" and width > 1 and bool(torch.rand(1, generator=gen) < 0.3):
        table[int(torch.randint(0, b, (1,), generator=gen)), width] = math.inf  # a depth not allowed
    return ShapePrice(base, table[0] if kind == "shared" else table)


def realised(out, model_p, ngram_p, price, b):
    choices = []
    for i in range(b):
        drafter, depth = int(out.drafter[i]), int(out.depth[i])
        g = dict(chains(model_p, ngram_p, i)).get(drafter, [])
        assert depth == 0 or 1 <= depth <= len(g), "allocated beyond the chain or a worthless token"
        choices.append((drafter, depth, sum(g[:depth])))
    rows = price.rows(b).tolist()
    return shape_goodput(choices, price.base, rows, b), rows


KINDS = ("concave", "convex", "shared", "arbitrary")


def random_instance(gen: torch.Generator, n: int, max_b: int = 4, max_k: int = 4):
    b, k = int(torch.randint(1, max_b + 1, (1,), generator=gen)), int(torch.randint(1, max_k + 1, (1,), generator=gen))
    model_p = random_probs(gen, b, k)
    ngram_p = random_probs(gen, b, int(torch.randint(1, max_k + 1, (1,), generator=gen))) if n % 2 else None
    width = max(k, 0 if ngram_p is None else ngram_p.shape[1])
    return b, model_p, ngram_p, random_price(gen, b, width, KINDS[n % 4])


def assert_optimal(out, b, model_p, ngram_p, price):
    got, rows = realised(out, model_p, ngram_p, price, b)
    opts = [options(chains(model_p, ngram_p, i)) for i in range(b)]
    assert got == pytest.approx(best_shape_goodput(opts, price.base, rows, b), rel=TOL), out


@pytest.mark.parametrize("seed", range(8))
def test_reference_is_optimal_against_brute_force(seed):
    """8 seeds x 60 instances = 480 random (B <= 4, K <= 4, one or two chains, four price kinds)."""
    gen = torch.Generator().manual_seed(1000 + seed)
    for n in range(60):
        b, model_p, ngram_p, price = random_instance(gen, n)
        assert_optimal(allocate_probs(pair(model_p, ngram_p), price=price), b, model_p, ngram_p, price)


@pytest.mark.parametrize("seed", range(8))
def test_triton_is_optimal_and_takes_the_reference_decisions(seed):
    """8 seeds x 25 instances through the interpreted kernel: bit-identical to the reference, optimal."""
    gen = torch.Generator().manual_seed(2000 + seed)
    for n in range(25):
        b, model_p, ngram_p, price = random_instance(gen, n)
        out = allocate_probs(pair(model_p, ngram_p), price=price, impl="triton")
        assert_same(allocate_probs(pair(model_p, ngram_p), price=price), out)
        assert_optimal(out, b, model_p, ngram_p, price)


def test_triton_on_a_padded_mid_size_batch():
    gen = torch.Generator().manual_seed(7)
    for n in range(4):
        _, model_p, ngram_p, price = random_instance(gen, n, max_b=37, max_k=8)
        assert_same(allocate_probs(pair(model_p, ngram_p), price=price),
                    allocate_probs(pair(model_p, ngram_p), price=price, impl="triton"))


@pytest.mark.parametrize("seed", range(3))
def test_an_affine_flat_curve_is_the_special_case(seed):
    """A dense target's flat curve C(T) = c_B + s (T - B) as a shape price: the same goodput as the flat rule."""
    gen = torch.Generator().manual_seed(seed)
    b, k = 6, 5
    model_p = random_probs(gen, b, k)
    ngram_p = random_probs(gen, b, k)
    c_b, slope = 1.0, 0.03 + 0.1 * seed
    curve = c_b + slope * (torch.arange(b * (k + 1) + 1, dtype=torch.float64) - b)
    flat = allocate_probs(pair(model_p, ngram_p), cost=curve.clamp(min=c_b))
    shaped = allocate_probs(pair(model_p, ngram_p), price=ShapePrice.affine(c_b, slope, k))
    def goodput(out):
        return (b + float(out.expected_accepted.sum())) / (c_b + slope * int(out.depth.sum()))

    assert goodput(shaped) >= goodput(flat) * (1 - TOL)  # the flat two-chain rule is a heuristic; shape mode exact
    one = allocate_probs(pair(model_p), cost=curve.clamp(min=c_b))
    one_shaped = allocate_probs(pair(model_p), price=ShapePrice.affine(c_b, slope, k))
    assert torch.equal(one.depth, one_shaped.depth)  # one chain: both exact, same tie rule (fewest tokens)


def test_refusals():
    p = torch.full((2, 3), 0.5)
    with pytest.raises(ValueError, match="column 0"):
        allocate_probs({"model": p}, price=ShapePrice(1.0, torch.tensor([0.1, 0.2])))
    with pytest.raises(ValueError, match="base"):
        allocate_probs({"model": p}, price=ShapePrice(0.0, torch.tensor([0.0, 0.2])))
    with pytest.raises(ValueError, match=r"table\[1\]"):
        allocate_probs({"model": p}, price=ShapePrice(1.0, torch.tensor([0.0, -0.2])))
    with pytest.raises(ValueError, match="rows"):
        allocate_probs({"model": p}, price=ShapePrice(1.0, torch.zeros(3, 2, dtype=torch.float64)))
    with pytest.raises(ValueError, match="exactly one"):
        allocate_probs({"model": p}, price=ShapePrice(1.0, torch.tensor([0.0, 0.2])), budget=2)


def test_allocate_from_raw_signals_takes_the_same_price():
    """``allocate(tables, signals, price=...)`` = the shape rule on the tables' calibrated probabilities, both impls."""
    from test_triton_matches_reference import random_tables

    from calib.allocate import allocate, calibrated_probs

    gen = torch.Generator().manual_seed(3)
    tables = random_tables(gen)
    b, k, l = 6, 5, 4
    conf = torch.rand(b, k, generator=gen)
    feats = torch.rand(b, l, 2, generator=gen) * torch.tensor([3.0, 2.0])
    price = random_price(gen, b, k, "concave")
    signals = pair(conf, feats)
    ref = allocate_probs(calibrated_probs(tables, signals), price=price)
    assert_same(ref, allocate(tables, signals, price=price))
    assert_same(ref, allocate(tables, signals, price=price, impl="triton"))
