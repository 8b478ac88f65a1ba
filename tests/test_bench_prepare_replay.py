"""bench/prepare_replay.py (issue 41 Must 3) without an engine: its plan is the bench's own settings — one step
cost file that the replay charges and serving prices with, banks collected on the served prompts in the served
dtype and K (conf/speculative), a replay of exactly those banks — and finished steps are skipped (resume)."""

from __future__ import annotations

from tests.bench_scripts import load_bench


def _plan(tmp_path, *extra):
    bench = load_bench("prepare_replay")
    ns = type("A", (), {"out": str(tmp_path / "replay"), "tables": "runs/train/default", "prompts": "chat_code",
                        "max_tokens": 64, "min_prompts": 8, "concurrency": [1, 4], "set": list(extra)})()
    return bench, bench.commands(ns)


def test_the_plan_reads_one_step_cost_and_collects_in_the_served_dtype(tmp_path):
    _, steps = _plan(tmp_path, "engine.dtype=float32")
    names = [w for w, _, _ in steps]
    assert names[0] == "profile" and names[-1] == "replay" and len(names) == 6
    cost = str(tmp_path / "replay" / "step-cost.json")
    profile, *collects, replay = (cmd for _, cmd, _ in steps)
    assert profile[profile.index("--step-cost") + 1] == cost and "engine.dtype=float32" in profile
    assert all("engine.dtype=float32" in c and "prompts=chat_code" in c and "sampling.max_tokens=64" in c
               for c in collects)
    assert {next(a for a in c if a.startswith("speculative=")) for c in collects} == {"speculative=eagle",
                                                                                        "speculative=ngram"}
    assert f"cost.engine.path={cost}" in replay and "cost=engine" in replay
    assert "replay.cell_prompts=[8,2]" in replay  # each B replays the prompts the bench's cell serves
    banks = next(a for a in replay if a.startswith("data.test="))
    assert all(str(done) in banks for w, _, done in steps if w.startswith("collect") for done in [done.parent])


def test_without_a_dtype_collection_keeps_the_engine_default(tmp_path):
    _, steps = _plan(tmp_path)
    assert not any(a.startswith("engine.dtype=") for _, cmd, _ in steps for a in cmd)


def test_finished_steps_are_skipped(tmp_path, capsys, monkeypatch):
    bench, steps = _plan(tmp_path)
    for _, _, done in steps:
        done.parent.mkdir(parents=True, exist_ok=True)
        done.write_text("{}")
    ran = []
    monkeypatch.setattr(bench, "_run", lambda cmd, what: ran.append(what))
    tables = tmp_path / "tables"
    tables.mkdir()
    (tables / "tables.json").write_text("{}")
    bench.main(["--out", str(tmp_path / "replay"), "--tables", str(tables), "--concurrency", "1", "4"])
    assert ran == [] and capsys.readouterr().out.count("done already") == 6
