"""calib.allocate.padding: a step padded to its cheapest reachable size. Every price and spare count here is
SYNTHETIC (small made-up numbers)."""

from __future__ import annotations

import numpy as np

from calib.allocate.padding import cheapest_padding


def test_pads_to_the_cheapest_step_one_token_per_row_in_turn():
    falling = np.array([0, 60, 58, 56, 54, 52, 50, 48, 47, 46, 45, 44, 46, 48, 50], dtype=np.float64)
    assert cheapest_padding([2, 2, 1, 0], 8, falling).tolist() == [1, 1, 1, 0]  # T 8 -> 11, the minimum
    assert cheapest_padding([3, 0, 3], 4, falling).tolist() == [3, 0, 3]  # all it can reach (T = 10, 45)
    assert cheapest_padding([5, 5], 10, falling).tolist() == [1, 0]  # past T = 11 the price rises again
    assert cheapest_padding([5, 5], 6, falling[:10]).tolist() == [2, 1]  # no step past the curve's end (T = 9)
    assert cheapest_padding([2, 2], 8, np.arange(20.0)).tolist() == [0, 0]  # a price that never falls
    assert cheapest_padding([2, 2], 8, np.full(20, 3.0)).tolist() == [0, 0]  # ties: the fewest positions
    assert cheapest_padding([], 0, falling).tolist() == []


def test_padding_is_the_argmin_over_reachable_steps():
    rng = np.random.default_rng(0)
    for _ in range(500):
        B = int(rng.integers(1, 8))
        spare = rng.integers(0, 5, size=B)
        base = int(B + rng.integers(0, 3 * B + 1))
        price = rng.uniform(1, 2, size=base + 1 + int(rng.integers(0, 40)))
        out = cheapest_padding(spare, base, price)
        assert ((0 <= out) & (out <= spare)).all()
        reach = price[base: min(base + int(spare.sum()), len(price) - 1) + 1]
        assert price[base + int(out.sum())] == reach.min() and int(out.sum()) == int(np.argmin(reach))
        short = out < spare  # rows left with spare tokens were given no fewer than any other row, less one
        assert not short.any() or out.max() <= out[short].min() + 1
