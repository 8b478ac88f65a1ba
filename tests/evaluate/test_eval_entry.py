"""eval.py through Hydra's compose API on a tiny SYNTHETIC bank and stand-in tables."""

import json
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from calib.bank import write_bank
from calib.evaluate.run import run
from tests.evaluate.fit_tables import fit_tables
from tests.synthetic import synthetic_tables

ROOT = Path(__file__).resolve().parents[2]


def test_eval_compose_run(tmp_path):
    bank = write_bank(tmp_path / "bank", *synthetic_tables(n_prompts=24, rounds_per_prompt=12, width=4, seed=3),
                      manifest={"model": "synthetic-model", "speculator": "synthetic"})
    fit_tables([bank], tmp_path / "tables", split="train")
    out = tmp_path / "out"
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("eval", overrides=[f"root={ROOT}", f"data.test=[{bank}]", f"tables={tmp_path / 'tables'}",
                                         "metrics.online_warmup_rounds=0", f"out_dir={out}", "logger=csv", "metrics.n_boot=20",
                                         "replay.batch_sizes=[1,4]", "replay.max_steps=8", "replay.min_steps=4",
                                         "replay.progress=false",
                                         # a bench that records no tables digest, whatever docs/bench's newest is
                                         "serving_bench=docs/bench/serve-c4-2026-12-02.json"])
    assert set(cfg.cost) == {"engine", "parametric"}  # both curves by default
    run(cfg)
    m = json.loads((out / "metrics.json").read_text())
    cal = m["calibration"][0]
    assert {"drafter", "variant", "category", "depth", "n", "ece", "ece_ci", "ece_equal_mass", "ece_debiased",
            "mce", "brier", "nll", "auroc"} <= set(cal)
    assert {r["variant"] for r in m["calibration"] if r["drafter"] == "model"} == {"raw", "calibrated"}
    assert {r["variant"] for r in m["calibration"] if r["drafter"] == "ngram"} == {"calibrated"}
    assert {"drafter", "variant", "category", "predicted_mean", "actual_mean", "mae", "pearson"} <= set(
        m["accept_length"][0])
    lad = m["ladder"]
    assert {"policy", "batch_size", "category", "cost_model", "goodput", "vs_best_fixed",
            "headroom_captured"} <= set(lad[0])
    assert {r["cost_model"] for r in lad} == {"engine", "parametric"}
    assert {r["policy"] for r in lad} >= {"no_spec", "fixed_1", "best_fixed", "homogeneous", "gated_uniform",
                                          "ragged_raw", "ragged_calibrated", "two_drafter", "oracle"}
    report = (out / "report.md").read_text()
    assert "Policy ladder" in report and "reliability_" in report
    # the online correction, replayed: tables alone vs corrected per slice, same keys as served
    on = m["online"]
    assert on["settings"]["enabled"] and on["slices"]
    assert {"predicted_tables", "predicted_online", "error_tables", "error_online", "ece_tables",
            "ece_online", "rounds", "actual_mean"} <= set(on["slices"][0])
    assert "## Online correction" in report
    # per depth against raw, with and without the correction (issue 42 Must 3): every model depth, one verdict
    assert {r["depth"] for r in on["depths"]} == {r["depth"] for r in m["calibration"]
                                                   if r["drafter"] == "model" and r["depth"] != "all"}
    assert {r["chain"] for r in on["depths"]} == {"model"} and set(on["depth_verdict"]) >= {"tables", "online"}
    assert "**Does any depth with ≥ 500 labels end worse than raw?**" in report
    assert "Does calibration beat the model drafter's raw confidence?" in report  # said plainly, per chain
    # beside the replay, the clock: the serving bench named, said not to be for these tables (it records none)
    answer = report[: report.index("## ", len("# Evaluation report\n\n## Answer"))]
    assert answer.split("\n")[4].startswith("**On a clock — the answer**")  # the clock first (issue 41 Must 5)
    assert "not necessarily these tables" in answer and "](/" not in report  # links relative: the report can move
    assert m["clock"]["bench"].endswith(".json") and m["clock"]["calib_best_vs_best_vllm"]["cells"] > 0
    # the report leads with its answer: right after the title, before the headline and every other table
    assert report.splitlines()[:3] == ["# Evaluation report", "", "## Answer"]
    sections = [ln for ln in report.splitlines() if ln.startswith("## ")]
    assert sections[0] == "## Answer" and report.index("## Answer") < report.index("Accepted length")
    assert "![answer](answer.png)" in report and (out / "answer.png").exists()
    # metrics.json's answer: one row per (bank, cost curve), its ratios recomputed from the ladder rows
    from calib.policies import camp_of, policy_of_row

    assert [(a["bank"], a["cost_model"]) for a in m["answer"]] == [(lad[0]["bank"], c)
                                                                  for c in ("engine", "parametric")]
    for a in m["answer"]:
        rows = [r for r in lad if r["bank"] == a["bank"] and r["cost_model"] == a["cost_model"]]
        at = {(r["category"], r["batch_size"], r["policy"]): r for r in rows}
        mean_all = {n: sum(at[("all", b, n)]["vs_best_fixed"] for b in (1, 4)) / 2
                    for n in {r["policy"] for r in rows}}
        for camp in ("calib", "peer"):
            best = max(v for n, v in mean_all.items() if camp_of(policy_of_row(n)) == camp)
            assert mean_all[a[f"{camp}_policy"]] == best and camp_of(a[f"{camp}_policy"]) == camp
        cal = a["calib_policy"]

        def cell_best(at, c, b, camp):  # issue 41 Must 1: per cell, the best of each camp there
            return max(r["goodput"] for (c2, b2, n), r in at.items()
                       if (c2, b2) == (c, b) and camp_of(policy_of_row(n)) == camp)
        ratios = {(c, b): cell_best(at, c, b, "calib") / cell_best(at, c, b, "peer") for (c, b, n) in at if n == cal}
        assert abs(a["ratio_mean"] - (ratios[("all", 1)] + ratios[("all", 4)]) / 2) <= 1e-12 * a["ratio_mean"]
        assert a["ratio_min"] == min(ratios.values())
        assert (a["ratio_min_category"], a["ratio_min_batch_size"]) in ratios
        assert f"`{cal}`" in report.split("## Answer")[1].split("\n## ")[0]
    assert len(list(out.glob("*.png"))) >= 5
    assert (out / "csv" / "ladder.csv").exists()


# --- tables x bank checks, the split of unseen banks, out_dir as one unit (issue 12 items 2-4) -------

import os

import pyarrow.parquet as pq

import calib.tables
from calib.tables import TablesError
from calib.tables.io import bank_fingerprint

FAST = ["logger=csv", "metrics.n_boot=5", "replay.batch_sizes=[1,4]", "replay.max_steps=4", "replay.min_steps=2",
        "replay.progress=false", "cost=parametric"]


def _cfg(banks, tables, out, *overrides):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose("eval", overrides=[f"root={ROOT}", f"data.test=[{','.join(map(str, banks))}]",
                                          f"tables={tables}", f"out_dir={out}", *FAST, *overrides])


def _bank(path, width=4, seed=3, speculator="synthetic"):
    man = {"model": "synthetic-model", "speculator": speculator, "num_speculative_tokens": width}
    return write_bank(path, *synthetic_tables(n_prompts=24, rounds_per_prompt=12, width=width, seed=seed,
                                              speculator=speculator), manifest=man)


def _retag(src, dst, **meta):
    """The stand-in tables of ``src`` re-exported with ``meta`` merged into tables.json."""
    t = calib.tables.load(src)
    return calib.tables.save(dst, t, {**{k: v for k, v in t.meta.items() if k not in ("json_sha256",)}, **meta})


def test_eval_refuses_tables_of_another_depth_or_drafter(tmp_path):
    shallow = _bank(tmp_path / "k2", width=2)
    fit_tables([shallow], tmp_path / "t2")  # K=2 tables (2 grid rows)
    deep = _bank(tmp_path / "k4")
    with pytest.raises(TablesError, match=rf"tables {tmp_path / 't2'} cover model-drafter depths 0..1 \(K=2\), "
                                          rf"bank {deep} drafts K=4"):
        run(_cfg([deep], tmp_path / "t2", tmp_path / "out"))  # was: depths 2-3 silently read row 1
    assert not (tmp_path / "out").exists()
    fit_tables([deep], tmp_path / "t4")
    _retag(tmp_path / "t4", tmp_path / "eagle", target_models=["synthetic-model"],
           chains={"model": {"ids": ["eagle:head"], "k": 4}, "ngram": {"ids": ["ngram"], "k": 4}})
    dm = _bank(tmp_path / "dm", speculator="draft_model:first24")
    with pytest.raises(TablesError, match=r"\['eagle:head'\], bank .*dm was drafted by 'draft_model:first24'"):
        run(_cfg([dm], tmp_path / "eagle", tmp_path / "out"))


def test_unseen_bank_is_evaluated_whole(tmp_path):
    seen, unseen = _bank(tmp_path / "seen"), _bank(tmp_path / "unseen", seed=4)
    fit_tables([seen], tmp_path / "stand-in")
    _retag(tmp_path / "stand-in", tmp_path / "tables", target_models=["synthetic-model"],
           split={"fractions": [0.7, 0.15, 0.15], "seed": 0},
           banks=[{"path": "elsewhere/seen", "acceptance_sha256": bank_fingerprint(seen)}])
    m = run(_cfg([seen, unseen], tmp_path / "tables", tmp_path / "out"))
    scope = {b["name"]: b for b in m["banks"]}
    assert scope["seen"]["evaluated"].startswith("held-out split of a training bank (elsewhere/seen)")
    assert scope["unseen"]["evaluated"] == "whole bank (not seen in training)"
    n = {r["bank"]: r["n"] for r in m["accept_length"]
         if r["drafter"] == "model" and r["variant"] == "raw" and r["category"] == "all"}
    assert n["unseen"] == pq.read_metadata(unseen / "acceptance.parquet").num_rows  # was: ~15% of it
    assert n["seen"] < 0.4 * pq.read_metadata(seen / "acceptance.parquet").num_rows
    report = (tmp_path / "out" / "report.md").read_text()
    assert "- `unseen` (" in report and "whole bank (not seen in training)" in report
    assert "held-out split of a training bank" in report


def test_eval_out_dir_is_one_unit(tmp_path):
    bank = _bank(tmp_path / "bank")
    fit_tables([bank], tmp_path / "tables")
    out = tmp_path / "out"
    old_umask = os.umask(0o022)
    try:
        run(_cfg([bank], tmp_path / "tables", out, "logger=wandb"))
        first = {p.name for p in out.iterdir()}
        with pytest.raises(FileExistsError, match=r"already holds an earlier eval.py output; pass overwrite=true"):
            run(_cfg([bank], tmp_path / "tables", out))
        run(_cfg([bank], tmp_path / "tables", out, "overwrite=true"))
    finally:
        os.umask(old_umask)
    assert not (out / "wandb").exists()  # the earlier run's files went with it: one unit, never a mix
    assert {"metrics.json", "report.md", "config.yaml", "eval.log", "wandb"} <= first
    assert {"metrics.json", "report.md", "config.yaml", "eval.log", "csv"} <= {p.name for p in out.iterdir()}
    assert f"({bank}): held-out split" in (out / "eval.log").read_text()
    assert "overwrite: true" in (out / "config.yaml").read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bank", "out", "tables"]  # no staging folder
    for p in [out, *out.rglob("*")]:
        if not p.is_symlink():
            assert p.stat().st_mode & 0o777 == (0o755 if p.is_dir() else 0o644), p
    foreign = tmp_path / "tables"  # tables written outside a train.py run (no ownership record): never replaced
    with pytest.raises(FileExistsError, match="holds files calib did not write: tables.json, tables.safetensors"):
        run(_cfg([bank], tmp_path / "tables", foreign, "overwrite=true"))
    assert calib.tables.load(foreign)


def test_a_bank_with_no_prompts_to_score_is_refused_by_name(tmp_path):
    # 2 prompts, both in the training part of the split the tables record: nothing held out to score
    bank = write_bank(tmp_path / "bank", *synthetic_tables(n_prompts=2, rounds_per_prompt=12, width=4, seed=3),
                      manifest={"model": "synthetic-model", "speculator": "synthetic"})
    fit_tables([bank], tmp_path / "tables", split="train")
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("eval", overrides=[f"root={ROOT}", f"data.test=[{bank}]", f"tables={tmp_path / 'tables'}",
                                         f"out_dir={tmp_path / 'out'}", "logger=none", "split.name=val",
                                         "split.fractions=[1.0,0.0,0.0]"])
    with pytest.raises(ValueError, match=r"bank .*bank holds no 'val' prompts to score"):
        run(cfg)
    assert not (tmp_path / "out").exists()  # nothing published


def test_eval_tracks_its_tables_as_input_and_few_headline_scalars(tmp_path, monkeypatch):
    """W&B a team can use: eval declares the tables it evaluates as its input artifact (the lineage bank ->
    tables -> eval), logs at most 50 headline scalars (the rows go in tables), and names its run."""
    from calib import tracking
    from calib.evaluate.run import MAX_SUMMARY_KEYS

    calls = {"scalars": {}, "used": [], "tables": []}

    class Recording(tracking.Tracker):
        def log(self, scalars, step=None):
            calls["scalars"].update(scalars)

        def log_table(self, key, rows):
            calls["tables"].append(key)

        def use_artifact(self, name, kind, paths, metadata=None):
            calls["used"].append((name, kind, [Path(p) for p in paths]))

    monkeypatch.setattr(tracking, "make_tracker", lambda *a, **k: Recording())
    bank = write_bank(tmp_path / "bank", *synthetic_tables(n_prompts=24, rounds_per_prompt=12, width=4, seed=3),
                      manifest={"model": "synthetic-model", "speculator": "synthetic"})
    fit_tables([bank], tmp_path / "tables", split="train")
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("eval", overrides=[f"root={ROOT}", f"data.test=[{bank}]", f"tables={tmp_path / 'tables'}",
                                         f"out_dir={tmp_path / 'out'}", "metrics.n_boot=20", "replay.batch_sizes=[1]",
                                         "replay.max_steps=4", "replay.min_steps=2", "replay.progress=false"])
    run(cfg)
    (name, kind, paths), = calls["used"]
    assert (name, kind) == ("calib-tables", "tables") and all(p.is_file() for p in paths)
    assert {p.name for p in paths} == {"tables.safetensors", "tables.json"}
    assert 0 < len(calls["scalars"]) <= MAX_SUMMARY_KEYS, sorted(calls["scalars"])
    # the clock leads the summary (issue 41 Must 5): the bench's answer first, the replay's after it, named so
    keys = list(calls["scalars"])
    assert keys[0].startswith("clock/calib_vs_best_vllm") and "replay_answer/calib_vs_peer_mean" in keys
    assert keys.index("clock/calib_vs_best_vllm_min") < keys.index("replay_answer/calib_vs_peer_mean")
    assert {"ladder", "calibration", "online"} <= set(calls["tables"])
    assert tracking.run_name("eval", tmp_path / ".out.tmp-abc123") == "eval:out"


def test_an_offline_wandb_run_records_its_input_tables_by_digest(tmp_path, monkeypatch):
    """W&B refuses use_artifact offline; calib's tracker then records the input's name, type and digest in
    the run's config, and names the run <job>:<output folder>."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    from calib.tracking import WandbTracker

    (tmp_path / "tables.json").write_text("{}")
    (tmp_path / "tables.safetensors").write_bytes(b"x")
    t = WandbTracker("calib", tmp_path, {}, "eval", mode="offline", group="exp-1")
    try:
        t.use_artifact("calib-tables", "tables", [tmp_path / "tables.json", tmp_path / "tables.safetensors"])
        used = dict(t.run.config)["input_artifacts"]["calib-tables"]
        assert used["type"] == "tables" and len(used["sha256"]) == 64
        assert t.run.name == f"eval:{tmp_path.name}" and t.run.group == "exp-1"
    finally:
        t.finish()


def test_an_online_wandb_run_uses_the_artifact_train_logged(tmp_path, monkeypatch):
    """Online, eval's use_artifact hands W&B an artifact of the same name, type and content digest as the one
    train.py's log_artifact built from the same files: W&B links the two by that digest, so the run graph
    shows bank -> tables -> eval. (No W&B server is reachable here: the run object is a recording stand-in.)"""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    from calib.tracking import WandbTracker

    (tmp_path / "tables.json").write_text('{"version": 1}')
    (tmp_path / "tables.safetensors").write_bytes(b"table bytes")
    files = [tmp_path / "tables.json", tmp_path / "tables.safetensors"]
    t = WandbTracker("calib", tmp_path, {}, "eval", mode="offline")
    offline_run = t.run
    seen = {}

    class OnlineRun:
        offline = False

        def log_artifact(self, art):
            seen["logged"] = art

        def use_artifact(self, art):
            seen["used"] = art

    try:
        t.run = OnlineRun()
        t.log_artifact("calib-tables", "tables", files)
        t.use_artifact("calib-tables", "tables", list(reversed(files)))
        logged, used = seen["logged"], seen["used"]
        assert (used.name, used.type) == ("calib-tables", "tables")
        assert used.manifest.digest() == logged.manifest.digest()
        assert set(used.manifest.entries) == {"tables.json", "tables.safetensors"}
    finally:
        t.run = offline_run
        t.finish()


def test_replay_online_decides_by_the_corrected_probabilities(tmp_path):
    """replay.online=true: the replay's policies read each replayed round's probabilities as the online correction
    leaves them (what serving decides by); the banks given are not changed, and rounds not replayed keep the
    tables' own. Synthetic banks (a unit test of the plumbing, not a figure)."""
    import numpy as np

    from calib.evaluate.online import replays, with_online
    from calib.tables.online import OnlineSettings

    bank = _bank(tmp_path / "bank")
    fit_tables([bank], tmp_path / "tables")
    cfg = _cfg([bank], tmp_path / "tables", tmp_path / "out", "replay.online=true")
    from calib.evaluate.run import _load_banks

    tables = calib.tables.load(tmp_path / "tables")
    banks = _load_banks(cfg, tables, ROOT)
    replayed = replays(banks, tables, OnlineSettings.from_config(cfg.online, key="online", owner="test"))
    assert replayed
    corrected = with_online(banks, replayed)
    for rec in replayed:
        before = rec["bank"].chains[rec["chain"]].p_cal
        after = next(b for b in corrected if b.name == rec["bank"].name).chains[rec["chain"]].p_cal
        assert after is not before and np.array_equal(after[rec["keep"]], rec["online"], equal_nan=True)
        others = np.setdiff1d(np.arange(len(before)), rec["keep"])
        assert np.array_equal(after[others], before[others], equal_nan=True)
        assert not np.array_equal(after[rec["keep"]], before[rec["keep"]], equal_nan=True)  # the correction moved it
    m = run(cfg)
    assert m["config"]["replay"]["online"] is True and m["ladder"]
