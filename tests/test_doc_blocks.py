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
    assert kinds[0] == "grid"  # the README leads with the whole grid's answer, cell by cell


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


def test_the_grid_takes_each_cell_from_its_latest_run(tmp_path):
    """A grid manifest lists runs oldest first: a cell a later run served again is read from it, the others stay."""
    def bench(name, cells):
        recs = [{"arm": a, "rep": r, "cell": {"category": cat, "sampling": "greedy", "concurrency": c},
                 "tok_s": t, "tpot_ms_median": 10.0}
                for r in (0, 1) for (cat, c, calib) in cells
                for a, t in (("none", 40.0), ("vllm_ngram", 50.0), ("calib_ngram", calib))]
        (tmp_path / "bench").mkdir(exist_ok=True)
        (tmp_path / "bench" / name).write_text(json.dumps({"arms": ["none", "vllm_ngram", "calib_ngram"],
                                                           "table": clock.rows(recs), "runs": recs}))
        return f"bench/{name}"

    old = bench("old.json", [("chat", 4, 45.0), ("code_edit", 4, 45.0)])
    new = bench("new.json", [("code_edit", 4, 60.0)])
    (tmp_path / "bench" / "grid.json").write_text(json.dumps({"sources": [old, new]}))
    cells = clock_blocks.latest_cells({"sources": [old, new]}, tmp_path)
    assert [(r["category"], src) for r, src, _ in cells] == [("chat", old), ("code_edit", new)]
    text = clock_blocks.render("grid", "bench/grid.json", tmp_path)
    assert "**0.90–1.20× the best vLLM arm** of each cell, ≥ 0.98× in 1 of 2 cells" in text
    assert "| code_edit | greedy | 4 | vllm_ngram | calib_ngram 1.20× [1.20–1.20] |" in text
    assert text.count("no replay predicted these runs.") == 1 and "pairs within" not in text  # runs without a replay
    with pytest.raises(FileNotFoundError, match="missing.json"):
        clock_blocks.latest_cells({"sources": [old, "bench/missing.json"]}, tmp_path)
    with pytest.raises(ValueError, match="non-empty list"):
        clock_blocks.latest_cells({"sources": old}, tmp_path)
    (tmp_path / "bench" / "notes.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="notes.json, which is not a bench/serve.py result"):
        clock_blocks.latest_cells({"sources": ["bench/notes.json"]}, tmp_path)


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
