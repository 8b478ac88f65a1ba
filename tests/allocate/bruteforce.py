"""Independent brute-force optima for tiny instances (plain Python floats, no calib code).

A request's options are every (chain, depth) it could verify, with value = sum of the chain's
survival products up to that depth; depth 0 (verify nothing) is always an option. Following the
allocator's contract, a token whose survival is below one fixed-point unit (2**-24) is worth nothing
and is not an option (with a non-monotone cost curve, padding with worthless tokens could otherwise
"pay" by landing on a cheaper total).
"""

from __future__ import annotations

import itertools
import math

MIN_GAIN = 2.0**-24


def gains(p_row) -> list[float]:
    """Survival products of one chain, stopping at its first missing (NaN) or worthless token."""
    out, running = [], 1.0
    for p in p_row:
        if math.isnan(p):
            break
        running *= min(max(p, 0.0), 1.0)
        if running < MIN_GAIN:
            break
        out.append(running)
    return out


def options(chains_of_request) -> list[tuple[int, int, float]]:
    """[(drafter, depth, value)] for one request; drafter 1 = model, 2 = n-gram."""
    opts = [(0, 0, 0.0)]
    for drafter, g in chains_of_request:
        for depth in range(1, len(g) + 1):
            opts.append((drafter, depth, sum(g[:depth])))
    return opts


def best_value_within_budget(all_options, budget: int) -> float:
    """Knapsack DP over requests: best total value using at most ``budget`` tokens."""
    best = [0.0] * (budget + 1)  # best[b] = best value with at most b tokens so far
    for opts in all_options:
        new = [-math.inf] * (budget + 1)
        for b in range(budget + 1):
            for _, depth, value in opts:
                if depth <= b:
                    new[b] = max(new[b], best[b - depth] + value)
        best = new
    return best[budget]


def goodput(depths_values, cost, n_requests: int) -> float:
    total = n_requests + sum(d for d, _ in depths_values)
    if total >= len(cost) or not cost[total] > 0 or math.isinf(cost[total]):
        return -math.inf
    return (n_requests + sum(v for _, v in depths_values)) / cost[total]


def best_goodput(all_options, cost, n_requests: int) -> float:
    """Enumerate every combination of options (tiny instances only)."""
    best = -math.inf
    for combo in itertools.product(*all_options):
        best = max(best, goodput([(d, v) for _, d, v in combo], cost, n_requests))
    return best


def shape_goodput(choices, base: float, table, n_requests: int) -> float:
    """Goodput of one option per request ``choices`` [(drafter, depth, value)] under the shape price
    ``base + sum_i table[i][depth_i]`` (``table`` rows as lists; +inf = not allowed)."""
    cost = base + sum(table[i][d] for i, (_, d, _) in enumerate(choices))
    if math.isinf(cost):
        return -math.inf
    return (n_requests + sum(v for _, _, v in choices)) / cost


def best_shape_goodput(all_options, base: float, table, n_requests: int) -> float:
    """Enumerate every combination of options under the shape price (tiny instances only)."""
    best = -math.inf
    for combo in itertools.product(*all_options):
        if any(d >= len(table[i]) for i, (_, d, _) in enumerate(combo)):
            continue
        best = max(best, shape_goodput(combo, base, table, n_requests))
    return best
