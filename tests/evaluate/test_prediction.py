"""The replay's prediction of a served arm (calib.evaluate.prediction) on a SYNTHETIC ladder: a hand-made
metrics.json and two hand-made bank manifests."""

import json

import pytest

from calib.evaluate.prediction import NOT_SPECULATING, Predicted, predicted, replay_row


def _metrics(tmp_path):
    banks = []
    for name, method, temp in (("eagle-x-t0", "eagle", 0.0), ("ngram-x-t0.8", "ngram", 0.8)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "run_manifest.json").write_text(json.dumps(
            {"method": method, "speculator": method, "sampling": {"temperature": temp}}))
        banks.append({"name": name, "path": str(tmp_path / name)})
    ladder = [{"bank": b, "batch_size": 4, "category": "chat", "cost_model": "engine", "policy": p, "goodput": g}
              for b, rows in (("eagle-x-t0", {"no_spec": 2.0, "fixed_4": 1.5, "two_drafter": 3.0}),
                              ("ngram-x-t0.8", {"no_spec": 2.0, "fixed_4": 2.5}))
              for p, g in rows.items()]
    return {"banks": banks, "ladder": ladder}


def test_an_arm_is_predicted_from_its_banks_row(tmp_path):
    m = _metrics(tmp_path)
    cell = {"category": "chat", "batch": 4, "cost_model": "engine"}
    assert predicted(m, row="two_drafter", method="eagle", temperature=0.0, **cell) == Predicted(1.5)
    assert predicted(m, row=replay_row("fixed", True, 4), method="eagle", temperature=0.0,
                     **cell).speedup == pytest.approx(0.75)
    assert predicted(m, row="fixed_4", method="ngram", temperature=0.8, **cell).speedup == pytest.approx(1.25)
    assert predicted(m, row="no_spec", method=None, temperature=0.8, **cell) == NOT_SPECULATING
    # nothing replayed for that cell: no prediction rather than a wrong one
    assert predicted(m, row="fixed_4", method="ngram", temperature=0.0, **cell) is None
    assert predicted(m, row="two_drafter", method="eagle", temperature=0.0, category="chat", batch=16,
                     cost_model="engine") is None


def test_a_prediction_holds_its_two_factors_where_the_ladder_records_tokens(tmp_path):
    """speed-up = tokens a step / a step's time, both over no speculation's: 3.0 tokens a round against 0.9 (a
    batch whose lanes are not all full: the same share for both), goodput 1.5x, so the step costs 2x none's."""
    m = _metrics(tmp_path)
    for r in m["ladder"]:
        if r["bank"] == "eagle-x-t0":
            r["tokens_per_round"] = {"no_spec": 0.9, "fixed_4": 2.0, "two_drafter": 2.7}[r["policy"]]
    p = predicted(m, row="two_drafter", method="eagle", temperature=0.0, category="chat", batch=4,
                  cost_model="engine")
    assert p.speedup == pytest.approx(1.5) and p.tokens == pytest.approx(3.0) and p.step == pytest.approx(2.0)


def test_a_dynamic_sd_arm_is_predicted_as_the_schedule_it_is_served():
    """vLLM's Dynamic SD arm runs the schedule the engine is given, not the best table in hindsight."""
    from calib.policies import policy

    schedule = policy("vllm_dsd").serving.dynamic
    assert replay_row("vllm_dsd", False, 4, schedule, 1) == "fixed_4"
    assert replay_row("vllm_dsd", False, 4, ((1, 4, 4), (5, 16, 2), (17, 1024, 0)), 16) == "fixed_2"
    assert replay_row("vllm_dsd", False, 4, ((1, 4, 4), (5, 16, 2), (17, 1024, 0)), 64) == "no_spec"
    assert replay_row("vllm_dsd", False, 2, ((1, 4, 4),), 4) == "fixed_2"  # capped at the engine's K
    assert replay_row("vllm_dsd", False, 4) == "vllm_dsd"  # no schedule: the policy's own row


def test_a_cell_is_replayed_on_the_prompts_it_serves():
    """replay.cell_prompts: at B the replay keeps the first max(min, 2·B) prompts of the category in collection order,
    as bench/serve.py's cell at concurrency B serves them (SYNTHETIC rows: 20 prompts, 3 rounds each)."""
    from types import SimpleNamespace

    import numpy as np

    from calib.evaluate.clock import cell_prompt_count
    from calib.evaluate.replay.config import ReplayConfig
    from calib.evaluate.replay.driver import cell_rows

    prompt_idx = np.repeat(np.arange(100, 120)[::-1], 3)  # collected in another order than stored
    bank = SimpleNamespace(prompt_idx=prompt_idx)
    rows = np.arange(prompt_idx.size)
    for batch in (1, 4, 16):
        kept = cell_rows(bank, rows, batch, (8, 2))
        n = cell_prompt_count(batch)
        assert sorted(set(prompt_idx[kept])) == list(range(100, 100 + min(n, 20))) and kept.size == 3 * min(n, 20)
    assert cell_rows(bank, rows, 4, None) is rows
    assert ReplayConfig(cell_prompts=[8, 2]).cell_prompts == (8, 2) and ReplayConfig().cell_prompts is None
    for bad in ([8], [0, 2], "8,2", [8, 2.5]):
        with pytest.raises(ValueError, match="cell_prompts"):
            ReplayConfig(cell_prompts=bad)
