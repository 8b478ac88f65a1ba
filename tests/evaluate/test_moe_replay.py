"""The MoE replay's shape-aware rule (calib/evaluate/replay/moe.py): against the exact-model optimum on small
steps, and a small replay's rows."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest
import yaml

from calib.cost.moe import MoECost
from calib.evaluate.replay.moe import StepPricer

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def cost() -> MoECost:
    name = "moe_deepseek_v3"
    return MoECost(yaml.safe_load((ROOT / "conf" / "cost" / f"{name}.yaml").read_text())[name], ROOT)


def exhaustive(pricer: StepPricer, p: np.ndarray) -> float:
    """Best expected goodput over every depth vector under the model's actual shape cost (one chain)."""
    B, K = p.shape
    surv = np.cumprod(np.nan_to_num(p), axis=1)
    gains = np.concatenate([np.zeros((B, 1)), np.cumsum(surv, axis=1)], axis=1)
    best = 0.0
    for depth in itertools.product(range(K + 1), repeat=B):
        d = np.asarray(depth)
        if (surv[np.arange(B), np.maximum(d - 1, 0)][d > 0] < 2**-24).any():
            continue  # worthless tokens are never verified
        best = max(best, (B + gains[np.arange(B), d].sum()) / pricer.actual(d)[0])
    return best


def test_the_shape_rule_reaches_the_exact_model_optimum_on_small_steps(cost):
    """Majorise-minimise on the tangent price from the even allocation: measured against exhaustive search of
    the true (non-separable) expert-read cost on 120 random steps of B <= 3, K = 4."""
    rng = np.random.default_rng(0)
    hits, worst = 0, 1.0
    for n in range(120):
        B = 1 + n % 3
        p = rng.uniform(0.2, 1.0, (B, 4)) ** 0.5
        pricer = StepPricer(cost, B, 4, 0.0)
        start = pricer.even({"model": p})
        _, de, _, tokens = pricer.shaped({"model": p}, start, 3, "reference")
        got = tokens / pricer.actual(de)[0]
        best = exhaustive(pricer, p)
        assert got <= best * (1 + 1e-6)
        assert got >= (B + start[2].sum()) / pricer.actual(start[1])[0] * (1 - 1e-6)  # never below even
        hits += got >= best * (1 - 1e-6)
        worst = min(worst, got / best)
    assert hits >= 110 and worst > 0.995, (hits, worst)
