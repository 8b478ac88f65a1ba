"""bench/prepare_replay.py (issue 41 Must 3) without an engine: its plan is the bench's own settings — one step
cost file that the replay charges and serving prices with, banks collected on the served prompts in the served
dtype and K (conf/speculative), a replay of exactly those banks — and finished steps are skipped (resume)."""

from __future__ import annotations

from pathlib import Path

from tests.bench_scripts import load_bench


def _plan(tmp_path, *extra):
    bench = load_bench("prepare_replay")
    ns = type("A", (), {"out": str(tmp_path / "replay"), "tables": "runs/train/default", "prompts": "chat_code",
                        "max_tokens": 64, "min_prompts": 8, "concurrency": [1, 4], "set": list(extra),
                        "categories": ["chat", "code_edit"]})()
    return bench, bench.commands(ns)


def test_the_plan_reads_one_step_cost_and_collects_in_the_served_dtype(tmp_path):
    _, steps = _plan(tmp_path, "engine.dtype=float32")
    names = [w for w, _, _ in steps]
    assert names[:5] == ["profile greedy chat", "profile greedy code_edit", "profile sampled chat",
                         "profile sampled code_edit", "step cost"] and names[-1] == "replay" and len(names) == 10
    cost = str(tmp_path / "replay" / "step-cost.json")
    *profiles, fit = (cmd for _, cmd, _ in steps[:5])
    collects, replay = [cmd for _, cmd, _ in steps[5:-1]], steps[-1][1]
    assert all("engine.dtype=float32" in p and p[p.index("--prompts") + 1] in ("chat", "code_edit") for p in profiles)
    assert [p[p.index("--sampling") + 1] for p in profiles] == ["greedy", "greedy", "sampled", "sampled"]
    # one fit over all four profiles, greedy and sampled: the sampled jump is in the cost serving prices with
    fitted = [fit[fit.index("--from-json") + 1], *fit[fit.index("--with-json") + 1: fit.index("--step-cost")]]
    assert sorted(fitted) == sorted(str(done) for _, _, done in steps[:4])
    assert fit[fit.index("--step-cost") + 1] == cost
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
    assert ran == [] and capsys.readouterr().out.count("done already") == 10


def test_a_profile_is_finished_only_once_its_command_ends_well(tmp_path, monkeypatch):
    """A profile is rewritten after each arm: a killed one must run again, so it writes to a staged name that is
    renamed once the command succeeds (and a failed step exits before any rename)."""
    bench, steps = _plan(tmp_path)
    _, cmd, done = steps[0]
    written = cmd[cmd.index("--out") + 1]
    assert written == str(bench.staged(done)) and written != str(done)
    ran = []

    def fake_run(cmd, what):
        ran.append(what)
        if "--out" in cmd:  # a profile: writes its staged file, as profile_step does after each arm
            out = cmd[cmd.index("--out") + 1]
            Path(out).parent.mkdir(parents=True, exist_ok=True)
            Path(out).write_text("{}")
        else:
            for _, c, d in steps:
                if c is cmd:
                    d.parent.mkdir(parents=True, exist_ok=True)
                    d.write_text("{}")

    monkeypatch.setattr(bench, "_run", fake_run)
    monkeypatch.setattr(bench, "commands", lambda args: steps)
    tables = tmp_path / "tables"
    tables.mkdir()
    (tables / "tables.json").write_text("{}")
    bench.main(["--out", str(tmp_path / "replay"), "--tables", str(tables)])
    assert done.exists() and not bench.staged(done).exists() and len(ran) == len(steps)
