"""Width against depth under a token budget (calib/evaluate/replay/width_depth.py): the founding toy from the
shipped routing capture, and the policy against width-first and depth-first in replay."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest
import yaml

from calib.cost.moe import MoECost
from calib.cost.trajectories import Trajectories
from calib.evaluate.replay.width_depth import break_even, decide, replay_budget, shape_experts

ROOT = Path(__file__).resolve().parents[2]
CAPTURE = ROOT / "data" / "routing" / "smollm2-moefied-ngram-k4"


def moe_cost(name: str) -> MoECost:
    return MoECost(yaml.safe_load((ROOT / "conf" / "cost" / f"{name}.yaml").read_text())[name], ROOT)


@pytest.fixture(scope="module")
def costs() -> dict[str, MoECost]:
    return {n: moe_cost(n) for n in ("moe", "moe_qwen3_30b_a3b", "moe_deepseek_v3")}


def capture_experts(seed: int = 0, n: int = 2000) -> tuple[float, float]:
    """Distinct experts (summed over layers) the capture's ACTUAL routing reads for [2] (two consecutive committed
    positions of one request) and [1, 1] (one position of each of two requests), averaged over random draws."""
    tr = Trajectories.from_bank(CAPTURE)
    rng = np.random.default_rng(seed)
    long = [s for s in tr.seqs if s.shape[0] >= 2]
    depth, width = [], []
    for _ in range(n):
        s = long[rng.integers(len(long))]
        i = rng.integers(s.shape[0] - 1)
        depth.append((s[i] | s[i + 1]).sum())
        a, b = rng.choice(len(tr.seqs), size=2, replace=False)
        width.append((tr.seqs[a][rng.integers(tr.seqs[a].shape[0])] | tr.seqs[b][rng.integers(tr.seqs[b].shape[0])]).sum())
    return float(np.mean(depth)), float(np.mean(width))


def test_founding_toy_from_the_shipped_capture(costs, capsys):
    """Batch 1, two positions: speculating one token ([2]) beats batching a second sequence ([1, 1]) exactly
    where the draft's acceptance is above the break-even the target's routing gives; printed per target."""
    depth2, width2 = capture_experts()
    model2, model11 = shape_experts(costs["moe"], [[2], [1, 1]])
    assert depth2 < width2  # consecutive tokens co-activate experts in the capture itself
    assert model2 == pytest.approx(depth2, rel=0.03) and model11 == pytest.approx(width2, rel=0.03)
    with capsys.disabled():
        print(f"\ncapture {CAPTURE.name}: experts read, [2] {depth2:.1f} (model {model2:.1f}), "
              f"[1, 1] {width2:.1f} (model {model11:.1f})")
    for name, cost in costs.items():
        alpha = break_even(cost)
        assert 0 < alpha < 1
        with capsys.disabled():
            print(f"{name}: break-even alpha = {alpha:.3f} (depth beats width above it)")
        for p, deepen in ((alpha - 0.01, False), (alpha + 0.01, True)):
            depth, admitted = decide(cost, np.array([[p, 0.9, np.nan, np.nan]]), n_waiting=3, budget=2)
            assert (int(depth[0]), admitted) == ((1, 0) if deepen else (0, 1)), (name, p)


@pytest.fixture(scope="module")
def ngram_rounds(tmp_path_factory):
    """The shipped n-gram bank's test rounds, calibrated by stand-in tables fitted on its train split (a clean
    checkout has no ``runs/``: train.py's tables are not shipped)."""
    import calib.tables
    from calib.evaluate.data import load_eval_bank
    from tests.evaluate.fit_tables import fit_tables

    path = ROOT / "data" / "banks" / "ngram-chat_code-t0"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tables = calib.tables.load(fit_tables([path], tmp_path_factory.mktemp("tables"), split="train"))
        bank = load_eval_bank(path, tables)
    c = bank.chains[bank.primary]
    test = bank.split == "test"
    return c.p_cal[test], c.accept[test]


def test_the_toy_in_replay_speculates_where_it_pays(costs, ngram_rounds, capsys):
    """Batch 1, budget 2, on a real bank's calibrated rounds: where the policy speculates, the first draft is
    accepted more often than the break-even; where it batches, less often."""
    p, accepted = ngram_rounds
    cost = costs["moe_qwen3_30b_a3b"]
    alpha = break_even(cost)
    rows = np.random.default_rng(0).choice(p.shape[0], size=400, replace=False)
    deepen = np.array([int(decide(cost, p[[r]], n_waiting=1, budget=2)[0][0]) == 1 for r in rows])
    hit = accepted[rows] >= 1
    with capsys.disabled():
        print(f"\nngram-chat_code-t0 under moe_qwen3_30b_a3b (alpha* {alpha:.3f}): speculates in {deepen.mean():.0%} "
              f"of 400 steps; first draft accepted {hit[deepen].mean():.3f} there, {hit[~deepen].mean():.3f} elsewhere")
    assert 0.05 < deepen.mean() < 0.95
    assert hit[deepen].mean() > alpha > hit[~deepen].mean()


@pytest.mark.parametrize(("running", "budget"), [(1, 2), (2, 4), (4, 8)])
def test_the_policy_beats_width_first_and_depth_first(costs, ngram_rounds, running, budget):
    p, accepted = ngram_rounds
    res = replay_budget(costs["moe_deepseek_v3"], p, accepted, running, budget, steps=120)
    assert res["policy"]["goodput"] > res["width_first"]["goodput"]
    assert res["policy"]["goodput"] > res["depth_first"]["goodput"]
