"""Figures that cannot drift (issue 41 Must 6): every marked block in README.md and docs/ that cites a bench JSON
(``<!-- clock:KIND JSON -->`` ... ``<!-- /clock -->``, calib.evaluate.clock) equals what that JSON renders, and its
links are relative. The stale-block check itself is tested on a SYNTHETIC bench JSON."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from calib.evaluate import clock, clock_blocks

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "calib").glob("*/README.md"))]


def test_every_marked_block_equals_its_json():
    found = [d for d in DOCS if clock_blocks.BLOCK.search(d.read_text())]
    assert found, "no marked block anywhere: the README's clock figures must be one"
    bad = [b for d in found for b in clock_blocks.stale_blocks(d, ROOT)]
    assert not bad, "\n".join(bad)


def test_the_readme_cites_its_clock_answer_through_a_block():
    text = (ROOT / "README.md").read_text()
    kinds = [m["kind"] for m in clock_blocks.BLOCK.finditer(text)]
    assert "answer" in kinds


def test_no_absolute_links_in_docs():
    bad = [f"{d.relative_to(ROOT)}: {m[0]}" for d in DOCS for m in re.finditer(r"\]\((/[^)]*)\)", d.read_text())]
    assert not bad, "\n".join(bad)


def _synthetic_bench(tmp_path: Path, calib_tok_s: float) -> str:
    row = {"category": "code_edit", "sampling": "greedy", "concurrency": 4}
    recs = [{"arm": a, "rep": r, "cell": row, "tok_s": t, "tpot_ms_median": 10.0}
            for r in (0, 1) for a, t in (("none", 40.0), ("vllm_ngram", 50.0), ("calib_ngram", calib_tok_s))]
    result = {"command": "python bench/serve.py --reps 2", "date": "2026-12-04", "cpu": "synthetic", "wall_s": 60,
              "cost_model": "engine", "arms": ["none", "vllm_ngram", "calib_ngram"], "table": clock.rows(recs),
              "runs": recs}
    (tmp_path / "bench").mkdir(exist_ok=True)
    (tmp_path / "bench" / "serve.json").write_text(json.dumps(result))
    return "bench/serve.json"


def test_a_block_whose_numbers_differ_from_its_json_is_stale(tmp_path):
    source = _synthetic_bench(tmp_path, 60.0)
    doc = tmp_path / "docs" / "page.md"
    doc.parent.mkdir()
    doc.write_text(f"intro\n<!-- clock:answer {source} -->\nold\n<!-- /clock -->\nafter\n")
    assert len(clock_blocks.stale_blocks(doc, tmp_path)) == 1
    assert clock_blocks.redraw(doc, tmp_path) == 1 and clock_blocks.stale_blocks(doc, tmp_path) == []
    text = doc.read_text()
    assert "1.20–1.20× the best vLLM arm" in text and "](../bench/serve.json)" in text  # relative to the doc
    assert text.startswith("intro\n") and text.endswith("after\n")
    _synthetic_bench(tmp_path, 45.0)  # the JSON changes: the block no longer matches
    (bad,) = clock_blocks.stale_blocks(doc, tmp_path)
    assert "page.md:2 clock:answer bench/serve.json" in bad and "--from-json" in bad


def test_a_block_citing_a_missing_json_or_kind_is_refused(tmp_path):
    doc = tmp_path / "page.md"
    doc.write_text("<!-- clock:answer nowhere.json -->\nx\n<!-- /clock -->\n")
    with pytest.raises(FileNotFoundError, match="nowhere.json"):
        clock_blocks.stale_blocks(doc, tmp_path)
    source = _synthetic_bench(tmp_path, 60.0)
    doc.write_text(f"<!-- clock:pie {source} -->\nx\n<!-- /clock -->\n")
    with pytest.raises(ValueError, match="kind 'pie'"):
        clock_blocks.stale_blocks(doc, tmp_path)
