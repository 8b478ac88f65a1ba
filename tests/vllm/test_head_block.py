"""A request retired at admission costs what it costs on an engine without a model drafter: its prefix-cache hit
keeps the block vLLM drops for the EAGLE head, and its prefill and steps skip the head's pass (calib/vllm/retire.py,
the patch set's cache-lookup and propose hooks, calib/vllm/patches.py).

Real engine, float32 (greedy identity is exact there), prefix caching on, one process running the scheduler and
the runner; a stand-in subscriber says what calib's serving says of a retired request, and the plan's "no pass" is
forced as in tests/vllm/test_idle_drafter.py. A prompt served twice: the second time it is found in the cache.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import json, sys
from vllm import LLM, SamplingParams
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer
from vllm.v1.worker.gpu_model_runner import GPUModelRunner

from calib.vllm.patches import PatchSet, RunnerSubscriber

model_dir, head, prompt = sys.argv[1], sys.argv[2], sys.argv[3]
state = {"retired": False, "forwards": 0, "kept": 0}
propose, head_propose = GPUModelRunner.propose_draft_token_ids, SpecDecodeBaseProposer.propose

def counted_propose(self, *args, **kwargs):  # the head's own propose: its forward runs
    state["forwards"] += 1
    return head_propose(self, *args, **kwargs)

def no_pass(self, scheduler_output, *args, **kwargs):  # what calib's plan does where no pass pays
    if state["retired"]:
        scheduler_output.num_spec_tokens_to_schedule = 0
    return propose(self, scheduler_output, *args, **kwargs)

class Retired(RunnerSubscriber):  # what calib's serving says of requests retired at admission
    def skips_idle_pass(self):
        return state["retired"]

    def keeps_head_block(self, request_id):
        state["kept"] += state["retired"]
        return state["retired"]

GPUModelRunner.propose_draft_token_ids = no_pass
SpecDecodeBaseProposer.propose = counted_propose
PatchSet([Retired()]).install(GPUModelRunner, SpecDecodeBaseProposer, KVCacheManager)
llm = LLM(model=model_dir, dtype="float32", enforce_eager=True, max_model_len=1024, max_num_seqs=1, seed=0,
          enable_prefix_caching=True, speculative_config={"method": "eagle", "model": head, "num_speculative_tokens": 4})
params = SamplingParams(temperature=0.0, max_tokens=24)
runs = []
for retired in (False, True):
    llm.reset_prefix_cache()
    state.update(retired=retired, forwards=0, kept=0)
    outs = [llm.generate([prompt], params, use_tqdm=False)[0] for _ in range(2)]
    runs.append({"tokens": [list(o.outputs[0].token_ids) for o in outs], "cached": [o.num_cached_tokens for o in outs],
                 "prompt": len(outs[0].prompt_token_ids), "forwards": state["forwards"], "kept": state["kept"]})
print("RESULT " + json.dumps(runs))
"""

PROMPT = "Summarise the following notes in two sentences.\n\n" + "\n".join(
    f"- Note {i}: the shipment of part {i * 7 % 31} arrived on day {i % 9 + 1} and was checked by team {i % 4}."
    for i in range(24))


@pytest.mark.engine
def test_a_request_retired_at_admission_keeps_the_heads_block_and_skips_the_head():
    from calib.target import prepare_target

    model_dir = prepare_target()
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
           "HF_HUB_OFFLINE": "1", "VLLM_PLUGINS": ""}  # vLLM alone: the stand-in speaks for calib's serving
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(model_dir), str(ROOT / "data/drafters/eagle-smollm2-135m"),
                           PROMPT], capture_output=True, text=True, env=env, cwd=ROOT, timeout=600, check=False)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert line is not None, proc.stdout[-2000:] + proc.stderr[-4000:]
    vllm_runs, retired = json.loads(line[len("RESULT "):])
    n = vllm_runs["prompt"]
    assert n > 300  # more than two of the CPU backend's 128-token blocks
    assert vllm_runs["tokens"][0] == vllm_runs["tokens"][1] == retired["tokens"][0] == retired["tokens"][1]
    assert vllm_runs["cached"][0] in (0, None) and retired["cached"][0] in (0, None)  # the cache was emptied
    block = retired["cached"][1] - vllm_runs["cached"][1]
    assert block > 0 and retired["cached"][1] == (n - 1) // block * block  # the whole-block hit, one block more
    assert retired["kept"] >= 2 and vllm_runs["kept"] == 0
    assert retired["forwards"] == 0 and vllm_runs["forwards"] > 0  # the head never ran for the retired requests
