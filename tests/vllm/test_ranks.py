"""Engines larger than one process (issue 29, Must 5), without an engine: calib.vllm.ranks.

The rank arithmetic (which rank records), the engine line for tensor- and pipeline-parallel engines, the
plugin standing capture down on every rank but the output rank, and the serving check run across two real
processes joined by a gloo group (as vLLM's tensor-parallel CPU group is): the real ``ServingSubscriber`` and
``Server.ranks_agree`` over a ``Server`` whose decision is scripted per rank (the same drafts; different drafts;
one rank raising; different draft passes). Every rank must return the same thing, and none may hang.
The engine itself runs tensor parallel in tests/collect/test_tensor_parallel_engine.py.
"""

from __future__ import annotations

import json
import logging
import multiprocessing as mp
from pathlib import Path
from types import SimpleNamespace as NS

import pytest

from calib.vllm.engine_line import PP_FIX, EngineFacts, decide
from calib.vllm.ranks import digest, output_rank, records_here


def test_the_output_rank_is_tp_rank_0_of_the_last_pipeline_stage():
    assert output_rank(NS(tensor_parallel_size=1, world_size=1)) == 0
    assert output_rank(NS(tensor_parallel_size=2, world_size=2)) == 0
    assert output_rank(NS(tensor_parallel_size=8, pipeline_parallel_size=4, world_size=32)) == 24  # vLLM's example
    assert output_rank(None) == 0  # a config without a parallel section: one process
    pc = NS(tensor_parallel_size=2, world_size=4)
    assert [records_here(pc, r) for r in range(4)] == [False, False, True, False]


def test_the_digest_is_the_same_in_every_process_and_tells_choices_apart():
    assert digest([[1, 2], [3]]) == 336251261  # crc32: not Python's salted hash
    assert len({digest([[1, 2], [3]]), digest([[1], [2, 3]]), digest([[1, 2, 3]]), digest(None), digest([])}) == 5


def _facts(**kw):
    return EngineFacts(**{"capture": False, "serve": False, "v2_runner": False, "async_scheduling": False,
                          "method": "ngram", "k": 4, **kw})


def test_the_engine_line_says_what_calib_does_across_ranks():
    _, line = decide(_facts(capture=True, tensor_parallel=2))
    assert line == ("calib capture: ON (V1 runner, sync scheduling, ngram K=4; 2 ranks, the output rank records "
                    "each round once)")
    _, line = decide(_facts(serve=True, tensor_parallel=2))
    assert line.endswith("tensor parallel 2, every rank decides from identical inputs, checked each step)")
    states, line = decide(_facts(serve=True, capture=True, tensor_parallel=2, pipeline_parallel=2))
    assert states["capture"].on and not states["serve"].on
    assert "serve OFF — pipeline parallelism (pipeline_parallel_size=2)" in line and PP_FIX in line
    _, line = decide(_facts(serve=True))
    assert "rank" not in line  # one process: nothing to say


@pytest.fixture
def plugin(monkeypatch):
    from calib.vllm import patches, plugin
    from calib.vllm.patches import PatchSet, RunnerSubscriber

    capture_sub = RunnerSubscriber()
    ps = PatchSet([capture_sub])  # not installed on vLLM's classes
    monkeypatch.setattr(patches, "_INSTALLED", ps)
    monkeypatch.setattr(plugin, "_MODES", {"capture": capture_sub})
    monkeypatch.delenv("CALIB_SERVE", raising=False)
    monkeypatch.setenv("CALIB_COLLECT_DIR", "/tmp/capture")
    return NS(mod=plugin, ps=ps, capture=capture_sub)


def _config(tp):
    return NS(use_v2_model_runner=False, scheduler_config=NS(async_scheduling=False, max_num_seqs=8),
              model_config=NS(model="/m", max_model_len=2048),
              parallel_config=NS(tensor_parallel_size=tp, pipeline_parallel_size=1, world_size=tp),
              speculative_config=NS(method="ngram", num_speculative_tokens=4, rejection_sample_method="standard"))


@pytest.mark.parametrize("rank,records", [(0, True), (1, False)])
def test_capture_records_on_the_output_rank_only(plugin, rank, records, caplog):
    with caplog.at_level(logging.INFO, logger="calib.vllm"):
        states = plugin.mod.engine_start(_config(2), rank=rank)
    assert states["capture"].on  # the engine records; this rank does or leaves it to the output rank
    assert (plugin.capture in plugin.ps.subscribers) is records


# -- the serving check across two real processes -----------------------------------------------------------

K = 4  # vLLM's K in the scripted steps


def _server_class():
    from calib.vllm.server import Server

    class ScriptedServer(Server):
        """Server.step's shape (pass-through once failed, the ranks' check before any side effect) with a
        decision scripted per rank and step: a list of drafts, "raise", or "pass" (vLLM's own)."""

        def __init__(self, knobs, script, passes):
            super().__init__(knobs)
            self.script, self.passes, self.planning = script, passes, True

        def step(self, runner, out):
            if self.failed:
                return out
            what = self.script[self.stats.steps]
            self.stats.steps += 1
            if what == "raise":
                raise RuntimeError("this rank's decision failed")
            if what == "pass":
                return out
            if not self.ranks_agree(digest(what), "drafts"):
                return out
            return NS(req_ids=out.req_ids, draft_token_ids=what)

        def plan_passes(self, runner, scheduler_output, sampled_token_ids):
            if not self.failed:
                scheduler_output.num_spec_tokens_to_schedule = self.passes

    return ScriptedServer


def _rank_main(rank: int, store: str, script: list, passes: int, out_file: str) -> None:
    import torch.distributed as dist

    from calib.serve.knobs import ServeKnobs
    from calib.vllm.ranks import RankCheck
    from calib.vllm.serving import ServingSubscriber

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    srv = _server_class()(ServeKnobs(tables="unused"), script, passes)
    srv.ranks = RankCheck(dist.group.WORLD)
    sub = ServingSubscriber(srv)
    vllm_drafts = [[7, 7], [8]]
    handed, planned = [], []
    for _ in script:
        sched = NS(num_spec_tokens_to_schedule=K)
        sub.before_propose(None, sched, None)
        planned.append(sched.num_spec_tokens_to_schedule)
        out = NS(req_ids=["a", "b"], draft_token_ids=vllm_drafts)
        handed.append(sub.take_drafts(None, out).draft_token_ids)
    Path(out_file).write_text(json.dumps({"handed": handed, "planned": planned, "failed": srv.failed,
                                          "checks": srv.ranks.checks, "reason": srv.stats.disabled_reason}))
    dist.destroy_process_group()


def _run_two_ranks(tmp_path, scripts, passes=(2, 2)) -> list[dict]:
    ctx = mp.get_context("spawn")
    files = [tmp_path / f"rank{r}.json" for r in range(2)]
    procs = [ctx.Process(target=_rank_main, args=(r, str(tmp_path / "store"), scripts[r], passes[r], str(files[r])))
             for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    alive = [p.is_alive() for p in procs]
    for p in procs:
        p.kill()
    assert not any(alive), "a rank hung in the serving check"
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    return [json.loads(f.read_text()) for f in files]


def test_ranks_that_agree_serve_and_ranks_that_do_not_stand_down_together(tmp_path):
    calib = [[1, 2, 3], [4]]
    other = [[1, 2], [4]]
    # step 0 agrees; step 1 differs; step 2 would agree again but calib is off by then, on both ranks
    a, b = _run_two_ranks(tmp_path, [[calib, calib, calib], [calib, other, calib]])
    assert a["handed"] == b["handed"] == [calib, [[7, 7], [8]], [[7, 7], [8]]]
    assert a["failed"] and b["failed"] and "tensor-parallel ranks chose different drafts at step 2" in a["reason"]
    assert a["planned"] == b["planned"] == [2, 2, K]  # once off, vLLM's own K
    assert a["checks"] == b["checks"] == 6  # one check per hook per step, on every rank


def test_a_rank_that_raises_is_a_disagreement_not_a_hang(tmp_path):
    calib = [[1, 2, 3], [4]]
    a, b = _run_two_ranks(tmp_path, [["raise", calib], [calib, calib]])
    assert a["handed"] == b["handed"] == [[[7, 7], [8]]] * 2 and a["failed"] and b["failed"]


def test_ranks_planning_different_draft_passes_keep_vllms(tmp_path):
    calib = [[1, 2, 3], [4]]
    a, b = _run_two_ranks(tmp_path, [[calib, calib], [calib, calib]], passes=(2, 3))
    assert a["planned"] == b["planned"] == [K, K]  # vLLM's own K on every rank: the draft passes stay paired
    assert a["handed"] == b["handed"] == [[[7, 7], [8]]] * 2 and a["failed"] and b["failed"]
    assert "draft passes" in a["reason"]


def test_ranks_that_both_pass_through_agree(tmp_path):
    a, b = _run_two_ranks(tmp_path, [["pass", "pass"], ["pass", "pass"]])
    assert a["handed"] == b["handed"] == [[[7, 7], [8]]] * 2 and not a["failed"] and not b["failed"]
