"""A step padded to the cheapest that commits the same tokens: where a step's price falls with more positions (a CPU
whose matrix products run a few rows faster than one: an AMD EPYC stepped T = 5 positions 15 % faster than T = 1,
docs/cost.md), verifying draft tokens that are sure to be rejected costs less than not verifying them. The clock
oracle pads its steps so (calib/serve/oracle.py), and the replay's oracle prices them so (calib/policies/oracle.py).
"""

from __future__ import annotations

import numpy as np


def cheapest_padding(spare, base: int, price) -> np.ndarray:
    """Positions to add per row, int64 ``[B]``: ``spare`` [B] draft tokens each row may add, ``base`` the step's
    positions without them (``B + Σ depth``), ``price`` ``[T_max + 1]`` the step's price by positions. The step goes
    to the ``T`` of the lowest price the spare tokens reach (ties to the fewest positions), one token per row in
    turn (row order); a price that never falls past ``base`` adds none."""
    spare = np.maximum(np.asarray(spare, dtype=np.int64), 0)
    price = np.asarray(price, dtype=np.float64)
    top = min(int(base + spare.sum()), len(price) - 1)
    out = np.zeros_like(spare)
    if top <= base:
        return out
    extra = int(np.argmin(price[base: top + 1]))  # the first minimum: the fewest positions
    if extra == 0:
        return out
    # one token per row in turn: every row gets min(spare, level - 1), then the first rows still with spare one more
    level = 1
    while int(np.minimum(spare, level).sum()) < extra:
        level += 1
    out = np.minimum(spare, level - 1)
    left = extra - int(out.sum())
    more = np.flatnonzero(spare >= level)[:left]
    out[more] += 1
    return out
