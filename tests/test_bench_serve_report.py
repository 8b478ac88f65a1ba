"""bench/serve.py's printed answer on SYNTHETIC records (no engine): each cell's median tok/s with the range over
its repetitions, the ratio to the best vLLM arm (no speculation included) and to no speculation, and the
answer line per calib arm (issue 30, Must 3)."""

from __future__ import annotations

from tests.bench_scripts import load_bench


def _bench():
    return load_bench("serve")


def _rec(arm, rep, tok_s, tpot):
    return {"arm": arm, "rep": rep, "cell": {"category": "code_edit", "sampling": "t0", "concurrency": 4},
            "tok_s": tok_s, "tpot_ms_median": tpot, "overhead_pct": 3.0 if arm.startswith("calib") else None}


def test_the_report_gives_medians_with_their_range_and_both_ratios(capsys):
    bench = _bench()
    records = [_rec("none", 0, 40.0, 25.0), _rec("none", 1, 44.0, 23.0),
               _rec("vllm_ngram", 0, 50.0, 20.0), _rec("vllm_ngram", 1, 54.0, 18.0),
               _rec("calib_ngram", 0, 60.0, 16.0), _rec("calib_ngram", 1, 66.0, 15.0)]
    arms = ["none", "vllm_ngram", "calib_ngram"]
    rows, text = bench.table(records, arms)
    (row,) = rows
    assert row["best_vllm"] == "vllm_ngram" and row["tok_s"]["calib_ngram"] == 63.0
    assert row["tok_s_spread"]["calib_ngram"] == [60.0, 66.0]
    assert "| 63.0 [60.0–66.0] (1.21×) |" in text and "| 42.0 [40.0–44.0] (0.81×) |" in text
    bench.report(records, arms, None, reps=2)
    out = capsys.readouterr().out
    assert out.startswith("calib_ngram: 1.21-1.21x the best vLLM arm (no speculation included), 1.21-1.21x the "
                          "best vLLM speculation arm, over 1 cells")
    assert "median of 2 [min–max]" in out
    assert "| 1.50× / 1.55× |" in out  # tok/s and decode speed (TPOT) over no speculation's
