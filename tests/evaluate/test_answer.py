"""The report's *Answer* (issue 14 item 5, issue 41 Must 1): per (bank, cost curve) and per cell, calib's best
served policy against the best arm a vLLM user could deploy, camps read from the policy registry. On the hand-made replay bank (SYNTHETIC: four rounds written by hand in
tests/evaluate/test_replay.py, not engine data). Expected values are recomputed from the same ladder rows, so no
assertion depends on how a different CPU rounds; orderings hold by construction."""

import math

import pytest

from calib.cost import make_curve
from calib.evaluate import plots, report
from calib.evaluate.data import load_eval_bank
from calib.evaluate.replay import ReplayConfig, replay
from calib.policies import CAMPS, Policy, camp_of, policy_of_row, register_policy, unregister_policy
from tests.evaluate.test_replay import curve, identity_tables, tiny_bank

STEEP = make_curve("parametric", {"kind": "parametric", "weight_read": 1.0, "per_position": 0.3}, 64)
SUPER = "synthetic_super"  # SYNTHETIC throwaway calib policy: the oracle's steps with 100x the tokens


def _super(totals, pooled):
    o = totals["oracle"]
    return {**o, "tokens": 100.0 * o["tokens"]}


@pytest.fixture
def bank2(tmp_path):
    return load_eval_bank(tiny_bank(tmp_path, categories=("chat", "chat", "code", "code")),
                          identity_tables(tmp_path), fractions=(0, 0, 1))


def _ladder(bank, extra=()):
    cfg = ReplayConfig(batch_sizes=(1, 2), policies=[*ReplayConfig().policies, *extra], min_steps=4, max_steps=4)
    return replay([bank], {"parametric": curve(), "steep": STEEP}, cfg, progress=False)


def _expected(ladder, bank, cm):
    """The answer row recomputed by hand from the ladder rows."""
    rows = [r for r in ladder if r["bank"] == bank and r["cost_model"] == cm]
    at = {(r["category"], r["batch_size"], r["policy"]): r for r in rows}
    bs = sorted({r["batch_size"] for r in rows})

    def mean_all(n):
        return sum(at[("all", b, n)]["vs_best_fixed"] for b in bs) / len(bs)

    def best(camp):
        names = [n for n in report.ladder_policy_rows(rows) if camp_of(policy_of_row(n)) == camp]
        return max(names, key=mean_all)

    def cell_best(camp, c, b):  # per cell: the best of the camp there
        return max(at[k]["goodput"] for k in at if k[:2] == (c, b) and camp_of(policy_of_row(k[2])) == camp)

    cal, peer = best("calib"), best("peer")
    cells = {(c, b) for (c, b, _) in at}
    ratios = {(c, b): cell_best("calib", c, b) / cell_best("peer", c, b) for (c, b) in cells}
    return {"calib_policy": cal, "peer_policy": peer,
            "ratio_mean": sum(ratios[("all", b)] for b in bs) / len(bs), "ratio_min": min(ratios.values()),
            "oracle_vs_peer_mean": sum(at[("all", b, "oracle")]["goodput"] / cell_best("peer", "all", b)
                                       for b in bs) / len(bs)}


def test_builtin_camps_come_from_the_registry():
    # calib: what calib serves; peers: the arms a vLLM user could deploy (every drafter the bank records)
    assert {camp_of(n) for n in ("ragged_calibrated", "two_drafter")} == {"calib"}
    assert {camp_of(n) for n in ("no_spec", "fixed", "second_fixed", "vllm_dsd")} == {"peer"}
    assert {camp_of(n) for n in ("oracle", "best_fixed", "homogeneous", "gated_uniform", "ragged_raw")} == {"reference"}
    assert camp_of(None) == "reference"
    with pytest.raises(ValueError, match="camp='rival' is invalid"):
        Policy("x", 1, None, "x", _super, camp="rival")
    # a policy that sets no camp: the default mapping by name, else reference
    assert camp_of(Policy("vllm_adaptive", 1, None, "x", _super)) == "peer"
    assert camp_of(Policy("something_new", 1, None, "x", _super)) == "reference"
    assert set(CAMPS) == {"calib", "peer", "reference"}


def test_answer_rows_match_the_ladder(bank2):
    ladder = _ladder(bank2)
    answer = report.answer_rows(ladder)
    assert [(a["bank"], a["cost_model"]) for a in answer] == [(bank2.name, "parametric"), (bank2.name, "steep")]
    for a in answer:
        e = _expected(ladder, a["bank"], a["cost_model"])
        assert a["calib_policy"] == e["calib_policy"] and a["peer_policy"] == e["peer_policy"]
        for k in ("ratio_mean", "ratio_min", "oracle_vs_peer_mean"):
            assert a[k] == pytest.approx(e[k], rel=1e-12)
        assert a["ratio_min"] <= a["ratio_mean"] + 1e-12
        assert a["calib_beats_peer"] == (a["ratio_mean"] > 1)
        assert a["calib_vs_best_fixed_min"] <= a["calib_vs_best_fixed_mean"] + 1e-12
        assert set(a["calib_camp"]) <= {"ragged_calibrated", "two_drafter"}
        for c in a["cells"]:  # headroom captured = (calib - peer) / (oracle - peer), from the same cell
            if c["headroom_captured"] is not None:
                assert c["headroom_captured"] == pytest.approx((c["ratio"] - 1) / (c["oracle_vs_peer"] - 1), rel=1e-9)
    lines = report.answer_lines(answer, "answer.png", clock=report.clock_lines(None))
    assert lines[0] == "## Answer" and lines[2].startswith("**On a clock — the answer")  # the clock first
    assert "(bank, cost) pairs" in lines[4] and "![answer](answer.png)" in lines


def test_a_synthetic_calib_policy_with_higher_goodput_becomes_the_answer(bank2, tmp_path):
    p = register_policy(Policy(SUPER, 65, "tab:pink", "SYNTHETIC throwaway calib policy: the oracle with 100x tokens",
                               _super, kind="hindsight", needs=("oracle",), camp="calib"))
    try:
        ladder = _ladder(bank2, extra=(SUPER,))
        answer = report.answer_rows(ladder)
        assert {a["calib_policy"] for a in answer} == {SUPER}
        assert all(a["calib_beats_peer"] and a["ratio_min"] > 1 for a in answer)
        assert all(SUPER in a["calib_camp"] and SUPER not in a["peer_camp"] for a in answer)
        verdict = report.answer_verdict(answer)
        assert verdict.startswith(f"**Replayed (a prediction from the banks, not a clock): calib beats the best peer "
                                  f"in {len(answer)} of {len(answer)} (bank, cost) pairs")
        assert plots.answer(answer, tmp_path / "answer.png").exists()
        # the same policy registered as a peer is the best peer instead, and calib loses every pair
        unregister_policy(SUPER)
        register_policy(Policy(SUPER, 65, "tab:pink", "SYNTHETIC", _super, kind="hindsight", needs=("oracle",),
                               camp="peer"))
        answer = report.answer_rows(_ladder(bank2, extra=(SUPER,)))
        assert {a["peer_policy"] for a in answer} == {SUPER}
        assert not any(a["calib_beats_peer"] for a in answer)
    finally:
        unregister_policy(p.name)


def test_answer_without_a_camp_says_so():
    meta = {"bank": "b", "cost_model": "m", "unit": "u", "batch_size": 1}
    rows = [{**meta, "category": "all", "policy": n, "goodput": 1.0, "vs_best_fixed": 1.0}
            for n in ("no_spec", "best_fixed", "oracle")]
    (a,) = report.answer_rows(rows)
    assert a["peer_policy"] == "no_spec" and a["calib_policy"] is None and a["ratio_mean"] is None
    assert a["oracle_vs_peer_mean"] == 1.0 and not math.isnan(a["peer_vs_best_fixed_mean"])
    assert "No (bank, cost) pair" in report.answer_verdict([a])
    assert plots.answer([a], "unused.png") is None


def test_clock_lines_say_whose_tables_the_serving_bench_measured(tmp_path):
    """The report's measured answer beside the replayed one (synthetic bench JSON, unit test)."""
    import json

    from calib.evaluate.report import clock_lines, clock_summary, newest_serving_bench

    row = {"ratio_to_best_vllm": {"calib_ngram": 0.9, "vllm_ngram": 1.0}, "headroom_captured": {"calib_ngram": -0.5},
           "prediction_error": {"calib_ngram": 0.2, "vllm_ngram": -0.05}}
    bench = {"command": "python bench/serve.py --reps 2", "date": "2026-12-01", "cpu": "x", "arms": ["vllm_ngram", "calib_ngram"],
             "table": [row, {"ratio_to_best_vllm": {"calib_ngram": 1.1, "vllm_ngram": 1.0}}], "tables_sha256": "a" * 64,
             "identity_float32_greedy": {"calib_ngram": {"identical": 16, "prompts": 16}}}
    (tmp_path / "serve-old.json").write_text(json.dumps({**bench, "date": "2026-11-01"}))
    (tmp_path / "serve-new.json").write_text(json.dumps(bench))
    found = newest_serving_bench(tmp_path)
    assert found.name == "serve-new.json"
    mine = " ".join(clock_lines(clock_summary(found, "a" * 64), tmp_path / "report"))
    assert "it served these tables" in mine and "`calib_ngram` 0.90–1.10×" in mine and "identical" in mine
    assert "0.90–1.10× the best vLLM arm" in mine and "headroom captured" in mine and "-50%" in mine
    assert "missed the clock's decode speed-up by 12% (median) to 20% (worst)" in mine
    assert "](../serve-new.json)" in mine  # relative to the report's folder: the report can move with its bench
    assert "**other tables**" in " ".join(clock_lines(clock_summary(found, "b" * 64)))
    assert "no serving bench found" in " ".join(clock_lines(clock_summary(newest_serving_bench(tmp_path / "none"),
                                                                          "a" * 64)))


def test_the_report_reads_the_grid_each_cell_from_its_latest_run(tmp_path):
    """A folder with a grid manifest (docs/bench/grid-*.json) cites it: each cell from the last run listing it
    (synthetic bench JSON, unit test)."""
    import json

    from calib.evaluate.report import clock_lines, clock_summary, newest_serving_bench

    def row(cat, calib):
        return {"category": cat, "sampling": "greedy", "concurrency": 4,
                "ratio_to_best_vllm": {"calib_ngram": calib, "vllm_ngram": 1.0}}

    folder = tmp_path / "docs" / "bench"
    folder.mkdir(parents=True)
    common = {"command": "python bench/serve.py", "cpu": "x", "arms": ["vllm_ngram", "calib_ngram"],
              "tables_sha256": "a" * 64}
    (folder / "serve-a.json").write_text(json.dumps({**common, "date": "2026-12-01",
                                                     "table": [row("chat", 0.8), row("code_edit", 0.9)]}))
    (folder / "serve-b.json").write_text(json.dumps({**common, "date": "2026-12-02", "table": [row("chat", 1.2)]}))
    (folder / "grid-2026-12-02.json").write_text(json.dumps(
        {"sources": ["docs/bench/serve-a.json", "docs/bench/serve-b.json"]}))
    found = newest_serving_bench(folder)
    assert found.name == "grid-2026-12-02.json"
    summary = clock_summary(found, "a" * 64)
    assert summary["cells"] == 2 and summary["date"] == "2026-12-02" and summary["tables"] == "these"
    assert "0.90–1.20× the best vLLM arm" in " ".join(clock_lines(summary))
    (folder / "serve-b.json").write_text(json.dumps({**common, "tables_sha256": "b" * 64, "date": "2026-12-02",
                                                     "table": [row("chat", 1.2)]}))
    mixed = clock_summary(found, "a" * 64)  # runs that served different tables: not these, and said so
    assert mixed["tables"] == "other" and "sha256 2 digests, not these" in " ".join(clock_lines(mixed))
