"""bench/serve.py's printed answer on SYNTHETIC records (no engine): each cell's median tok/s with the range over
its repetitions, the ratio to the best vLLM arm (no speculation included) taken pair by pair, to no speculation,
the headroom captured of the clock oracle's, the replay's error, and the answer line per calib arm (issue 30
Must 3, issue 41 Musts 2 and 4)."""

from __future__ import annotations

import pytest

from calib.evaluate import clock
from tests.bench_scripts import load_bench


def _bench():
    return load_bench("serve")


def _rec(arm, rep, tok_s, tpot, sampling="greedy"):
    return {"arm": arm, "rep": rep, "cell": {"category": "code_edit", "sampling": sampling, "concurrency": 4},
            "tok_s": tok_s, "tpot_ms_median": tpot, "overhead_pct": 3.0 if arm.startswith("calib") else None}


RECORDS = [_rec("none", 0, 40.0, 25.0), _rec("none", 1, 44.0, 23.0),
           _rec("vllm_ngram", 0, 50.0, 20.0), _rec("vllm_ngram", 1, 54.0, 18.0),
           _rec("calib_ngram", 0, 60.0, 16.0), _rec("calib_ngram", 1, 66.0, 15.0)]
ARMS = ["none", "vllm_ngram", "calib_ngram"]


def test_the_report_gives_medians_with_their_range_and_both_ratios(capsys):
    bench = _bench()
    rows, text = bench.table(RECORDS, ARMS)
    (row,) = rows
    assert row["best_vllm"] == "vllm_ngram" and row["tok_s"]["calib_ngram"] == 63.0
    assert row["tok_s_spread"]["calib_ngram"] == [60.0, 66.0]
    # pair by pair: rep 0 60/50 = 1.2, rep 1 66/54 = 1.2222 -> median 1.2111
    assert row["ratio_to_best_vllm"]["calib_ngram"] == pytest.approx((1.2 + 66 / 54) / 2)
    assert row["ratio_spread"]["calib_ngram"] == pytest.approx([1.2, 66 / 54])
    assert "| 63.0 [60.0–66.0] (1.21×) |" in text and "| 42.0 [40.0–44.0] (0.81×) |" in text
    bench.report({"table": rows, "arms": ARMS, "cost_model": "engine"})
    out = capsys.readouterr().out
    assert out.startswith("calib_ngram: 1.21-1.21x the best vLLM arm (no speculation included), 1.21-1.21x the "
                          "best vLLM speculation arm, over 1 cells")
    assert "median [min–max]" in out
    assert "| 1.50× / 1.55× |" in out  # tok/s and decode speed (TPOT) over no speculation's


def test_headroom_and_prediction_error_per_cell():
    recs = RECORDS + [_rec("oracle_ngram", 0, 80.0, 12.0), _rec("oracle_ngram", 1, 81.0, 12.0)]
    (row,) = clock.rows(recs, {("code_edit", "greedy", 4, "calib_ngram"): 1.8})
    r, o = row["ratio_to_best_vllm"]["calib_ngram"], row["ratio_to_best_vllm"]["oracle_ngram"]
    assert row["oracle"] == {"calib_ngram": "oracle_ngram"}
    assert row["headroom_captured"]["calib_ngram"] == pytest.approx((r - 1) / (o - 1))
    assert 0 < row["headroom_captured"]["calib_ngram"] < 1
    assert row["ratio_to_none"]["calib_ngram"] == pytest.approx(1.5)  # tok/s pairwise: 60/40, 66/44
    decode = row["decode_ratio_to_none"]["calib_ngram"]  # median TPOT 24 / 15.5: the basis the replay predicts
    assert decode == pytest.approx(24 / 15.5) and row["prediction_basis"] == "decode (TPOT)"
    assert row["prediction_error"]["calib_ngram"] == pytest.approx(1.8 / decode - 1)
    assert "oracle_ngram" not in clock.calib_arms() and "oracle_ngram" in clock.oracle_arms()
    assert clock.headroom(1.1, 1.01) is None  # no ceiling above the clock's noise: no headroom figure


def test_the_replays_error_is_split_into_tokens_a_step_and_the_steps_price(capsys):
    """Predicted 1.8x as 2.7 tokens a step over no speculation's at 1.5x its step time; measured: 2.4 tokens a step (4
    requests: 9.6 over 4.0) at 1.6x (pair by pair, median): the tokens are over-predicted by 12.5 %, the step's
    price under-predicted by 6.25 % (printed +13 % / -6 %). No speculation itself is no factor; a bench without steady steps gets none."""
    from calib.evaluate.prediction import Predicted

    steady = {"none": [(4.0, 50.0), (4.0, 52.0)], "vllm_ngram": [(8.0, 75.0), (8.0, 78.0)],
              "calib_ngram": [(9.6, 80.0), (9.6, 83.2)]}  # (tokens a step, step ms) per repetition
    recs = [{**r, "steady_tokens_per_step": steady[r["arm"]][r["rep"]][0],
             "steady_step_ms": steady[r["arm"]][r["rep"]][1]} for r in RECORDS]
    cell = ("code_edit", "greedy", 4)
    (row,) = clock.rows(recs, {(*cell, "calib_ngram"): Predicted(1.8, 2.7, 1.5), (*cell, "vllm_ngram"): 1.4,
                               (*cell, "none"): Predicted(1.0, 1.0, 1.0)})
    assert row["steady_factors"]["calib_ngram"] == pytest.approx({"tokens": 2.4, "step": 1.6})
    assert row["predicted_vs_none"]["calib_ngram"] == 1.8 and row["predicted_vs_none"]["vllm_ngram"] == 1.4
    err = row["prediction_factor_error"]
    assert err["calib_ngram"] == pytest.approx({"tokens": 2.7 / 2.4 - 1, "step": 1.5 / 1.6 - 1})
    assert set(err) == {"calib_ngram"}  # a bare speed-up has no factors; no speculation is 1 against 1
    assert "| +13% / -6% |" in clock.factor_table([row], ARMS)
    _bench().report({"table": [row], "arms": ARMS, "cost_model": "engine"})
    assert "Where the replay's error comes from" in capsys.readouterr().out
    (old,) = clock.rows(RECORDS, {(*cell, "calib_ngram"): Predicted(1.8, 2.7, 1.5)})
    assert old["prediction_factor_error"] == {} and clock.factor_table([old], ARMS) is None


def test_the_replay_is_judged_against_the_decode_steps_where_they_were_recorded():
    """Steps with no request in prefill: the speed the replay prices; TPOT still holds the neighbours' prefill."""
    steps = {"none": (10.0, 11.0), "vllm_ngram": (14.0, 15.4), "calib_ngram": (16.0, 17.6)}
    recs = [{**r, "decode_step_tok_s": steps[r["arm"]][r["rep"]]} for r in RECORDS]
    (row,) = clock.rows(recs, {("code_edit", "greedy", 4, "calib_ngram"): 1.8})
    assert row["prediction_basis"] == "decode steps"
    assert row["decode_step_ratio_to_none"]["calib_ngram"] == pytest.approx(1.6)  # 16/10, 17.6/11 pair by pair
    assert row["prediction_error"]["calib_ngram"] == pytest.approx(1.8 / 1.6 - 1)
    assert "| 1.50× / 1.55× / 1.60× (1.80×, +12%) |" in clock.speedup_table([row], ARMS)
    # the steady state recorded too (every client's request in flight): it is the basis
    steady = {"none": (8.0, 8.0), "vllm_ngram": (12.0, 12.0), "calib_ngram": (14.0, 14.4)}
    (st,) = clock.rows([{**r, "steady_tok_s": steady[r["arm"]][r["rep"]]} for r in recs],
                       {("code_edit", "greedy", 4, "calib_ngram"): 1.8})
    assert st["prediction_basis"] == "steady decode" and st["steady_ratio_to_none"]["calib_ngram"] == pytest.approx(1.775)
    assert st["prediction_error"]["calib_ngram"] == pytest.approx(1.8 / 1.775 - 1)
    # one arm without the figure: the cell falls back to TPOT for every arm, never a mix of bases
    (mixed,) = clock.rows([r if r["arm"] != "none" else {**r, "decode_step_tok_s": None} for r in recs])
    assert mixed["prediction_basis"] == "decode (TPOT)" and mixed["decode_step_ratio_to_none"] == {}


def test_headroom_in_the_decode_state_is_taken_by_the_same_measure_on_every_side():
    """Prefill and a cell's draining tail weigh on every arm's tok/s alike and shrink the oracle's margin: the
    headroom is also stated over the steady decode speed-ups, with the best vLLM arm and the oracle taken there."""
    steady = {"none": (8.0, 8.0), "vllm_ngram": (12.0, 12.0), "calib_ngram": (15.0, 15.0), "oracle_ngram": (16.0, 16.0)}
    recs = RECORDS + [_rec("oracle_ngram", 0, 66.0, 12.0), _rec("oracle_ngram", 1, 70.0, 12.0)]
    (row,) = clock.rows([{**r, "steady_tok_s": steady[r["arm"]][r["rep"]]} for r in recs])
    assert row["prediction_basis"] == "steady decode"
    # steady: vLLM 1.5x none, calib 1.875x, oracle 2.0x -> (1.875/1.5 - 1) / (2.0/1.5 - 1) = 0.75
    assert row["headroom_captured_decode"]["calib_ngram"] == pytest.approx(0.75)
    tok = row["headroom_captured"]["calib_ngram"]
    assert tok == pytest.approx((row["ratio_to_best_vllm"]["calib_ngram"] - 1)
                                / (row["ratio_to_best_vllm"]["oracle_ngram"] - 1))
    assert tok != pytest.approx(0.75)  # two measures, both kept
    assert "(+75% in steady decode)" in clock.headroom_table([row])
    assert clock.answer_figures([row])["headroom_decode"] == [pytest.approx(0.75)]
    assert "(+75% to +75% in the decode state, over 1)" in clock.answer_lines([row])[0]
    from calib.evaluate import clock_blocks

    answer = clock_blocks.render_answer({"command": "python bench/serve.py", "table": [row], "runs": recs},
                                        "docs/bench/x.json")
    assert "in the decode state (prefill and a cell's draining tail left out) +75% to +75%" in answer
    # the best vLLM arm in the decode state may be another than by tok/s: no speculation here
    slow = {**steady, "vllm_ngram": (7.0, 7.0)}
    (row2,) = clock.rows([{**r, "steady_tok_s": slow[r["arm"]][r["rep"]]} for r in recs])
    assert row2["best_vllm"] == "vllm_ngram"  # by tok/s
    assert row2["headroom_captured_decode"]["calib_ngram"] == pytest.approx((15 / 8 - 1) / (16 / 8 - 1))
    # no decode figures (a bench before December 5 recorded only tok/s and TPOT): TPOT is the basis
    (old,) = clock.rows(recs)
    assert old["prediction_basis"] == "decode (TPOT)" and "calib_ngram" in old["headroom_captured_decode"]
    # tok/s only: no decode headroom
    assert clock.decode_headroom({**old, "prediction_basis": "output tok/s"}) == {}


def test_unstable_cells_are_named():
    recs = RECORDS + [_rec("calib_ngram", 2, 90.0, 15.0), _rec("vllm_ngram", 2, 50.0, 18.0)]
    rows = clock.rows(recs)
    assert clock.unstable(rows, 0.10) == ["code_edit/greedy/c4/calib_ngram"]
    assert clock.unstable(clock.rows(RECORDS), 0.10) == []


def test_a_run_interleaved_by_cells_says_so_and_counts_its_uneven_repetitions():
    """A cell served again (--max-reps) while its ratios spread wider than --tolerance: the header says how many
    repetitions each cell had and how the arms were alternated."""
    from calib.evaluate import clock_blocks

    other = [{**r, "cell": {**r["cell"], "concurrency": 16}} for r in RECORDS]
    recs = RECORDS + other + [_rec("none", 2, 42.0, 24.0), _rec("vllm_ngram", 2, 52.0, 19.0),
                              _rec("calib_ngram", 2, 61.0, 16.0)]
    result = {"command": "python bench/serve.py", "wall_s": 60.0, "table": clock.rows(recs), "arms": ARMS,
              "runs": recs, "tolerance": 0.05, "interleave": "cells", "cost_model": "engine"}
    assert clock.repetitions_text(result) == "2–3 repetitions (more where a ratio still spread wider than ±5% of its median)"
    tables = clock_blocks.render_tables(result, "docs/bench/x.json")
    assert "every arm's engine alive and each cell served by every arm in turn, 2–3 repetitions" in tables
    assert "each cell served by every arm in turn" in clock_blocks.render_answer(result, "docs/bench/x.json")
    arms_run = {**result, "interleave": "arms", "table": clock.rows(RECORDS), "runs": RECORDS}
    assert "arms alternated within each of 2 repetitions" in clock_blocks.render_tables(arms_run, "docs/bench/x.json")


def test_a_cell_whose_model_drafter_does_not_pay_names_the_engine_to_deploy_instead(capsys):
    """Issue 42 Must 4: where calib ran (almost) none of the EAGLE head's passes, the bench says to deploy the
    n-gram engine, with both arms' ratios; a cell where it drafted is not named."""
    def two(rep, tok_s, planned, engine):
        return {**_rec("calib_two_drafter", rep, tok_s, 16.0),
                "calib": {"passes_planned": planned, "passes_engine": engine}}

    idle = RECORDS + [two(0, 55.0, 1, 400), two(1, 57.0, 0, 400)]
    (row,) = clock.rows(idle)
    assert row["model_passes_share"] == {"calib_two_drafter": pytest.approx(1 / 800)}
    (line,) = clock.deploy_lines([row])
    assert line.startswith("code_edit/greedy/c4: calib_two_drafter ran 0% of the model drafter's passes")
    assert "deploy the n-gram engine (calib_ngram 1.21× vs calib_two_drafter" in line
    # measured faster on the EAGLE engine all the same: either engine, not the slower one
    (faster,) = clock.rows(RECORDS + [two(0, 80.0, 1, 400), two(1, 82.0, 0, 400)])
    (line,) = clock.deploy_lines([faster])
    assert "either engine (calib_ngram 1.21× vs calib_two_drafter" in line and "deploy the n-gram" not in line
    assert "faster than both" not in line  # both beat the best vLLM arm here
    slow = {**faster, "ratio_to_best_vllm": {**faster["ratio_to_best_vllm"], "calib_ngram": 0.9, "calib_two_drafter": 0.8}}
    (line,) = clock.deploy_lines([slow])
    assert "deploy the n-gram engine (calib_ngram 0.90× vs calib_two_drafter 0.80×" in line
    assert line.endswith(f"; {faster['best_vllm']} was faster than both here")
    drafting = RECORDS + [two(0, 55.0, 300, 400), two(1, 57.0, 280, 400)]
    assert clock.deploy_lines(clock.rows(drafting)) == []
    _bench().report({"table": [row], "arms": [*ARMS, "calib_two_drafter"], "cost_model": "engine"})
    assert "Where the model drafter does not pay:" in capsys.readouterr().out


def test_a_cell_larger_than_its_category_serves_the_category_again():
    """c = 64 asks 128 prompts of a 60-prompt category: each is served again from the top, so the batch fills."""
    serve = _bench()
    assert serve.cell_prompts(list("abc"), 2) == ["a", "b"]
    assert serve.cell_prompts(list("abc"), 7) == ["a", "b", "c", "a", "b", "c", "a"]
    with pytest.raises(ValueError, match="without prompts"):
        serve.cell_prompts([], 4)


def test_the_cost_file_says_whether_it_prices_sampled_steps(tmp_path, capsys):
    """A bench of T = 0.8 cells priced by a greedy-only step cost says so and records it."""
    import json
    from types import SimpleNamespace

    from calib.cost.serving import serving_step_cost
    from calib.cost.step import save_step_cost
    from tests.cost.test_step import TRUE
    from tests.cost.test_step_sampled import SAMPLED

    bench, path = load_bench("serve"), tmp_path / "step.json"
    for cost, sampling, warned in ((TRUE, ["greedy"], False), (TRUE, ["greedy", "sampled"], True),
                                   (SAMPLED, ["sampled"], False)):
        save_step_cost(cost, path)
        serving_step_cost.cache_clear()
        args = SimpleNamespace(set=[f"serve.cost={path}", "engine.dtype=float32"], sampling=sampling)
        out = bench._cost_file(args)
        json.dumps(out)  # written into the bench's JSON
        assert out["prices_sampling"] == (cost is SAMPLED)
        assert ("note_sampling" in out) == warned
        assert ("fitted on greedy steps only" in capsys.readouterr().out) == warned


def test_a_run_of_calib_arms_alone_reports_without_a_ratio(capsys):
    """``--arms calib_ngram`` alone (a quick look at what calib decided): no vLLM arm to judge it against, so no
    ratio, and the report still prints its tables."""
    mine = [r for r in RECORDS if r["arm"] == "calib_ngram"]
    (row,) = clock.rows(mine)
    assert row["best_vllm"] is None and row["ratio_to_best_vllm"] == {}
    assert clock.answer_lines([row]) == []
    _bench().report({"table": [row], "arms": ["calib_ngram"], "cost_model": "engine"})
    assert "| 63.0 [60.0–66.0] |" in capsys.readouterr().out


def test_the_report_says_why_a_tok_s_headroom_is_missing_where_the_decode_state_has_one():
    """An oracle that ran but stood within the clock's noise by tok/s: not "no oracle arm"."""
    from calib.evaluate.report import clock_lines

    spread = {"min": 0.6, "median": 0.6, "max": 0.6, "cells": 1}
    clock = {"bench": "docs/bench/x.json", "command": "python bench/serve.py", "tables": "these", "tables_sha256": None,
             "calib_best_vs_best_vllm": {"min": 1.0, "median": 1.0, "max": 1.0, "cells": 1},
             "headroom_captured": None, "headroom_captured_decode": spread, "prediction_abs_error": None,
             "per_arm": {}}
    text = "\n".join(clock_lines(clock))
    assert "no cell's oracle 2 % above the best vLLM arm" in text and "no oracle arm" not in text
    assert "(60%–60% in the decode state" in text
    assert "not measured (the bench ran no oracle arm)" in "\n".join(
        clock_lines({**clock, "headroom_captured_decode": None}))
