"""eval's report sentence on calibration against the raw confidence, when a chain the banks record (e.g. a
recomputed suffix chain) has no table: named, not a crash. SYNTHETIC pooled rows."""

from calib.evaluate.run import _beats_raw_lines


def test_a_chain_without_a_table_is_named_and_the_others_judged():
    rows = [{"chain": "model", "temperature": 0.0, "ece_calibrated": 0.02, "ece_raw": 0.03, "nll_calibrated": 0.5,
             "nll_raw": 0.6, "ece_if_calibrated": 0.01},
            {"chain": "suffix", "temperature": 0.0, "ece_calibrated": float("nan"), "ece_raw": 0.08,
             "nll_calibrated": None, "nll_raw": 1.0, "ece_if_calibrated": float("nan")}]
    text = "\n".join(_beats_raw_lines(rows))
    assert "The suffix chain** is in the banks, not in these tables" in text
    assert "model drafter's raw confidence?** T = 0: **yes**" in text
