"""bench/priced_counts.py on SYNTHETIC records (no engine): each arm's verified and accepted draft tokens a step,
priced by a step cost as (B + accepted) / price[B + verified], over the best vLLM arm of the cell; arms that load a
model drafter and sampled cells are left out (their price is not in the counts)."""

from __future__ import annotations

import numpy as np
import pytest

from tests.bench_scripts import load_bench


def _rec(arm, rep, verified, accepted, concurrency=4, sampling="greedy"):
    return {"arm": arm, "rep": rep, "cell": {"category": "code_edit", "sampling": sampling,
                                             "concurrency": concurrency},
            "mean_verified_per_step": verified, "mean_accepted_per_step": accepted}


def test_counts_are_priced_by_the_step_cost_over_the_best_vllm_arm():
    bench = load_bench("priced_counts")
    price = lambda B: 0.05 + 0.005 * np.arange(8 * B)  # a step of T positions costs 0.05 + 0.005 T seconds
    recs = [_rec("none", r, 0.0, 0.0) for r in (0, 1)] + \
           [_rec("vllm_ngram", 0, 12.0, 8.0), _rec("vllm_ngram", 1, 12.0, 8.0),
            _rec("calib_ngram", 0, 8.0, 7.0), _rec("calib_ngram", 1, 9.0, 7.5), _rec("calib_ngram", 2, 8.5, 7.2),
            _rec("calib_two_drafter", 0, 8.0, 7.0),  # an EAGLE engine: its draft passes are not in the counts
            _rec("vllm_ngram", 0, 12.0, 8.0, sampling="sampled")]
    rows = {r["arm"]: r for r in bench.priced(recs, price)}
    assert set(rows) == {"none", "vllm_ngram", "calib_ngram"}
    vllm = (4 + 8.0) / (0.05 + 0.005 * 16)
    calib = (4 + 7.2) / (0.05 + 0.005 * 12.5)  # medians over repetitions: 8.5 verified, 7.2 accepted; T interpolated
    assert rows["vllm_ngram"]["priced_tok_s"] == pytest.approx(vllm)
    assert rows["calib_ngram"]["priced_tok_s"] == pytest.approx(calib)
    assert rows["calib_ngram"]["vs_best_vllm"] == pytest.approx(calib / vllm)  # vLLM's n-gram arm beats none here
    assert rows["none"]["vs_best_vllm"] == pytest.approx((4 / 0.07) / vllm)


def test_the_command_names_a_bench_without_records(tmp_path):
    bench = load_bench("priced_counts")
    (tmp_path / "grid.json").write_text('{"sources": []}')
    with pytest.raises(SystemExit, match="no `runs`"):
        bench.main([str(tmp_path / "grid.json"), "--cost", "1.0,0.1"])
    (tmp_path / "run.json").write_text('{"runs": []}')
    with pytest.raises(SystemExit, match="not an engine step cost file"):
        bench.main([str(tmp_path / "run.json"), "--cost", "1.0,0.1"])
