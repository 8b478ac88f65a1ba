"""An idle drafter stays right: after steps with 0 draft passes (what calib plans when no pass pays), the
EAGLE head drafts exactly what it drafts without the idle stretch, so acceptance is unchanged.

At 0 passes vLLM 0.32's EAGLE proposer still runs the head's first forward over the step's verified
tokens (its KV cache) and skips the LM head and sampling (``llm_base_proposer.py``: "No draft tokens
requested"); calib sets those 0 passes through ``num_spec_tokens_to_schedule`` (calib/vllm/server.py
``plan_passes``), as this test's wrapper does for a fixed stretch. Real engine, float32 (greedy
identity is exact there), one process running the generations. A third generation skips the stretch's passes
through calib's patch set (what serving does once its requests are retired, calib/vllm/retire.py): the output is
the same and the head runs that many forwards fewer.
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
from vllm.v1.worker.gpu_model_runner import GPUModelRunner

from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer
from calib.vllm.patches import PatchSet, RunnerSubscriber

model_dir, head, prompt, idle_steps = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
state = {"idle": 0, "drafts": [], "skip": False, "forwards": 0, "skipped": 0}
propose, take = GPUModelRunner.propose_draft_token_ids, GPUModelRunner.take_draft_token_ids
head_propose = SpecDecodeBaseProposer.propose

def counted_propose(self, *args, **kwargs):  # the head's own propose: its forward runs
    state["forwards"] += 1
    return head_propose(self, *args, **kwargs)

class SkipIdle(RunnerSubscriber):  # what calib's serving says on a step of retired requests (calib/vllm/retire.py)
    def skips_idle_pass(self):
        if state["skip"] and state["idle_now"]:
            state["skipped"] += 1
            return True
        return False

def propose_idle_first(self, scheduler_output, *args, **kwargs):
    state["idle_now"] = state["idle"] > 0
    if state["idle"] > 0:  # what calib's plan does when no pass pays
        state["idle"] -= 1
        scheduler_output.num_spec_tokens_to_schedule = 0
    return propose(self, scheduler_output, *args, **kwargs)

def take_recorded(self):
    out = take(self)
    if out is not None:
        for r, toks in zip(out.req_ids, out.draft_token_ids):
            i = self.input_batch.req_id_to_index[r]
            state["drafts"].append((int(self.input_batch.num_tokens_no_spec[i]), list(map(int, toks))))
    return out

GPUModelRunner.propose_draft_token_ids = propose_idle_first
GPUModelRunner.take_draft_token_ids = take_recorded
SpecDecodeBaseProposer.propose = counted_propose
PatchSet([SkipIdle()]).install(GPUModelRunner, SpecDecodeBaseProposer)  # wraps counted_propose
llm = LLM(model=model_dir, dtype="float32", enforce_eager=True, max_model_len=1024, max_num_seqs=1, seed=0,
          enable_prefix_caching=False, speculative_config={"method": "eagle", "model": head, "num_speculative_tokens": 4})
params = SamplingParams(temperature=0.0, max_tokens=48)
runs = []
for idle, skip in ((0, False), (idle_steps, False), (idle_steps, True)):
    state.update(idle=idle, drafts=[], skip=skip, forwards=0, skipped=0)
    out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    runs.append({"tokens": list(out.token_ids), "drafts": state["drafts"], "forwards": state["forwards"],
                 "skipped": state["skipped"]})
print("RESULT " + json.dumps(runs))
"""

PROMPT = ("Rename the variable `total` to `acc` everywhere in this function and return the whole function:\n\n"
          "def summed(xs):\n    total = 0\n    for x in xs:\n        total = total + x\n    return total\n")


@pytest.mark.engine
def test_drafts_after_an_idle_stretch_equal_drafts_without_one():
    from calib.target import prepare_target

    model_dir = prepare_target()
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
           "HF_HUB_OFFLINE": "1", "VLLM_PLUGINS": ""}  # vLLM alone: the wrapper stands in for calib's plan
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(model_dir), str(ROOT / "data/drafters/eagle-smollm2-135m"),
                           PROMPT, "6"], capture_output=True, text=True, env=env, cwd=ROOT, timeout=600,
                          check=False)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert line is not None, proc.stdout[-2000:] + proc.stderr[-4000:]
    busy, idle, skipped = json.loads(line[len("RESULT "):])
    assert busy["tokens"] == idle["tokens"] == skipped["tokens"]  # lossless every way (float32 greedy)
    # the idle stretch's passes skipped (calib.vllm.patches' propose hook): the head ran that many forwards fewer,
    # and the engine went on drafting after it, from a head whose cache misses those steps
    assert skipped["skipped"] == 6 and idle["skipped"] == 0
    assert skipped["forwards"] == idle["forwards"] - 6 + (len(skipped["drafts"]) - len(idle["drafts"]))
    assert any(d for _, d in skipped["drafts"][-5:])
    idle_steps = [d for d in idle["drafts"] if not d[1]]
    assert len(idle_steps) >= 6  # the stretch happened: steps that drafted nothing
    after = {n: d for n, d in idle["drafts"] if d}
    before = {n: d for n, d in busy["drafts"] if d}
    shared = sorted(n for n in after if n in before)  # contexts both runs drafted at, after the stretch
    assert len(shared) >= 3
    # the same context gives the same draft: the head's KV cache was kept right while it was idle
    assert [after[n] for n in shared] == [before[n] for n in shared]
