"""Retiring the model drafter (calib/vllm/retire.py): the streaks that retire a request, the step that skips the
head's idle pass, the patch set's propose hook that skips it (stand-in proposer, no vLLM), and the server that
offers a retired request's model draft no more (stand-in decider and runner)."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from calib.chains import chains
from calib.serve.history import RequestHistory
from calib.serve.knobs import ServeKnobs
from calib.vllm.patches import PatchSet, RunnerSubscriber
from calib.vllm.retire import DrafterRetirement
from tests.vllm.test_patches import Runner  # the runner's hooked methods, standing in

MODEL = next(k for k in chains() if k.confidence is not None)  # the model drafter's chain
LOOKUP = next(k for k in chains() if k.propose is not None)  # a chain calib recomputes (n-gram)


def test_a_step_skips_only_when_every_request_went_long_enough_without_a_pass():
    r = DrafterRetirement(after=2)
    assert not r.note_step(["a", "b"], 0)  # one step without a pass each: not yet
    assert r.note_step(["a", "b"], 0) and r.take_skip() and not r.take_skip()  # read once per step
    assert r.retired == {"a", "b"}
    assert not r.note_step(["a", "b", "c"], 0)  # a newcomer keeps the head running for the batch...
    assert not r.note_step(["a", "b", "c"], 3)  # ... a pass for it does not bring the others back ...
    assert r.retired == {"a", "b"} and r.streak["c"] == 0
    assert not r.note_step(["a", "b", "c"], 0)
    assert r.note_step(["a", "b", "c"], 0) and r.retired == {"a", "b", "c"}  # ... until it went 2 steps without one
    r.finish("a")
    assert not r.is_retired("a") and "a" not in r.streak
    assert not r.note_step([], 0)


def test_retiring_off_never_skips():
    r = DrafterRetirement(after=0)
    for _ in range(10):
        assert not r.note_step(["a"], 0)
    assert not r.retired and not r.take_skip()


class Proposer:
    """Stand-in for SpecDecodeBaseProposer.propose: records its calls (its forward)."""

    def __init__(self):
        self.calls = 0
        self.num_speculative_tokens = 4
        self._last_draft_probs = "stale"

    def propose(self, num_speculative_tokens, **kwargs):
        self.calls += 1
        return torch.zeros(kwargs["common_attn_metadata"].batch_size(), num_speculative_tokens, dtype=torch.int64)

    def _sample_draft_tokens(self, hidden_states, sampling_metadata):
        raise AssertionError("not reached")


class Says(RunnerSubscriber):
    def __init__(self, skip):
        self.skip, self.asked = skip, 0

    def skips_idle_pass(self):
        self.asked += 1
        return self.skip


@pytest.mark.parametrize("votes, k, skipped", [((True,), 0, True), ((True, True), 0, True), ((True, False), 0, False),
                                               ((False,), 0, False), ((True,), 2, False)])
def test_the_propose_hook_skips_the_idle_pass_only_when_every_subscriber_says_so(votes, k, skipped):
    runner_cls, proposer_cls = type("R", (Runner,), {}), type("P", (Proposer,), {})
    subs = [Says(v) for v in votes]
    PatchSet(subs).install(runner_cls, proposer_cls)
    proposer = proposer_cls()
    kwargs = {"common_attn_metadata": SimpleNamespace(batch_size=lambda: 3), "next_token_ids": torch.zeros(3)}
    out = proposer.propose(num_speculative_tokens=k, **kwargs) if k == 2 else proposer.propose(k, **kwargs)
    assert out.shape == (3, k) and out.dtype == torch.int64
    assert proposer.calls == (0 if skipped else 1)
    if skipped:  # the state vLLM's own propose leaves when it drafts nothing
        assert proposer.num_speculative_tokens == 0 and proposer._last_draft_probs is None
    assert all(s.asked == (1 if k == 0 else 0) for s in subs)  # each asked once: each clears its own flag


def test_knob_is_validated():
    assert ServeKnobs("t").retire_drafter_after == 4
    assert ServeKnobs.from_json('{"tables": "t", "retire_drafter_after": 0}').retire_drafter_after == 0
    for bad in (-1, 1.5, True, "2"):
        with pytest.raises((TypeError, ValueError), match="retire_drafter_after"):
            ServeKnobs("t", retire_drafter_after=bad)


def _server(after: int):
    from calib.vllm.recomputed import Recomputed
    from calib.vllm.server import Server

    srv = Server(ServeKnobs("unused-tables", retire_drafter_after=after))
    srv.k, srv.max_model_len, srv.planning = 4, 2048, True
    srv.recomputed = {LOOKUP.name: Recomputed(LOOKUP, (1, 4, 4), 4, [], 2048)}
    srv.decider = SimpleNamespace(enabled=True, engine_chain=MODEL.name, chains=[MODEL.name, LOOKUP.name],
                                  finish=lambda r: None, history=RequestHistory(from_text=True))
    return srv


def _runner(req_ids):
    B = len(req_ids)
    tokens = np.zeros((B, 64), dtype=np.int32)
    tokens[:, :6] = [1, 2, 3, 4, 1, 2]
    n = np.full(B, 6, dtype=np.int32)
    batch = SimpleNamespace(req_ids=list(req_ids), req_id_to_index={r: b for b, r in enumerate(req_ids)},
                            token_ids_cpu=tokens, num_tokens_no_spec=n, num_prompt_tokens=n.copy(),
                            temperature_cpu=np.zeros(B, dtype=np.float32))
    return SimpleNamespace(input_batch=batch, requests={})


def test_the_server_retires_requests_and_offers_their_model_draft_no_more():
    srv = _server(after=2)
    runner = _runner(["a", "b"])
    sched = SimpleNamespace(num_spec_tokens_to_schedule=0)
    srv.note_passes(runner, sched)
    assert not srv.retirement.skip_now and srv.stats.head_skipped == 0
    srv.note_passes(runner, sched)
    assert srv.retirement.skip_now and (srv.stats.head_skipped, srv.stats.retired) == (1, 2)
    srv.retirement.retired.discard("b")  # as if "b" had not retired: its draft is still offered
    srv.conf = {"a": [0.9, 0.8], "b": [0.7, 0.6]}
    offers = srv.offers(srv.decider, ["a", "b"], [[5, 6], [5, 6]], runner.input_batch, [0, 1])
    model = offers[MODEL.name]
    assert model.tokens == [[], [5, 6]]  # the retired request's draft left out
    assert np.isnan(model.signal[0]).all() and model.signal[1, :2].tolist() == pytest.approx([0.7, 0.6])
    srv.finished(["a"])
    assert not srv.retirement.is_retired("a")


def test_newcomers_are_retired_at_admission_only_while_the_plan_says_so():
    r = DrafterRetirement(after=4)
    assert r.admit(["a"]) == 0 and not r.preadmit("b")  # the plan has not said so
    r.note_step(["a"], 2)  # "a" seen, drafted for
    r.admitting = True
    assert r.preadmit("b") and r.admitted == {"b"}  # the scheduler's lookup: "b" keeps the head's block...
    r.admitting = False
    assert r.admit(["a", "b", "c"]) == 1  # ... and is retired at its first step whatever the plan says by then
    assert r.retired == {"b"} and "c" not in r.retired and not r.admitted
    r.note_step(["a", "b", "c"], 0)
    r.admitting = True
    assert r.admit(["a", "b", "c", "d"]) == 1 and r.retired == {"b", "d"}  # seen requests retire by their streaks
    assert not r.preadmit("a") and r.preadmit("b")  # a preempted request's second lookup: as it stands
    r.finish("d")
    assert not r.is_retired("d")
    asked = []
    r.admitting = lambda: asked.append(1) or True  # the plan's question: asked once, on the first newcomer
    assert not asked and r.admit(["a", "b", "c"]) == 0 and not asked  # no newcomer: not asked
    assert r.admit(["e", "f"]) == 2 and r.preadmit("g") and asked == [1]
    r.admitting = lambda: 1 / 0  # an answer that raises is no
    assert r.admit(["h"]) == 0 and r.admitting is False
    off = DrafterRetirement(after=0)
    off.admitting = True
    assert off.admit(["x"]) == 0 and not off.preadmit("x")


def test_a_newcomer_drafts_where_a_pass_pays_for_it_and_not_in_a_crowd():
    from calib.vllm.planning import newcomer_drafts

    cost = torch.linspace(1.0, 3.0, 600)  # a verify cost rising with the positions verified (SYNTHETIC)
    fresh = torch.tensor([0.9, 0.85, 0.8, 0.75])
    alone = {MODEL.name: torch.zeros(1, 0), LOOKUP.name: torch.full((1, 3), float("nan"))}
    gone = torch.zeros(1, 4)  # the batch's one request retired
    assert newcomer_drafts(alone, gone, fresh, cost=cost, pass_cost=0.01, chain=MODEL.name)
    assert not newcomer_drafts(alone, gone, fresh, cost=cost, pass_cost=5.0, chain=MODEL.name)  # a pass too dear
    assert not newcomer_drafts(alone, gone, torch.full((4,), 0.01), cost=cost, pass_cost=0.01, chain=MODEL.name)


def test_a_newcomer_is_retired_at_admission_only_where_no_pass_pays_even_in_the_best_case():
    """The question a plan leaves for newcomers prices one in the batch's best case for a pass: nobody offering an
    n-gram draft, none retired. At batch 1 (a request joins as the last one finishes, often with a long n-gram match
    and retired) a pass pays and the newcomer is not retired; in a batch of 64 it does not. SYNTHETIC."""
    from calib.vllm.planning import best_case, newcomer_drafts

    cost = 0.075 + 0.0035 * torch.arange(600, dtype=torch.float64)  # a CPU-like curve: a verified position is cheap
    fresh = torch.tensor([0.41, 0.39, 0.48, 0.52])
    long_match = {MODEL.name: torch.zeros(1, 0), LOOKUP.name: torch.tensor([[0.9, 0.8, 0.7, 0.6]])}
    retired = torch.zeros(1, 4)
    kw = {"cost": cost, "pass_cost": 0.0115, "chain": MODEL.name}
    assert not newcomer_drafts(long_match, retired, fresh, **kw)  # beside this step's batch no pass pays ...
    best = best_case(long_match, MODEL.name)
    assert best[MODEL.name] is long_match[MODEL.name] and torch.isnan(best[LOOKUP.name]).all()
    assert newcomer_drafts(best, fresh[None], fresh, **kw)  # ... in its best case one does: not retired
    crowd = best_case({MODEL.name: torch.zeros(64, 0), LOOKUP.name: torch.rand(64, 4)}, MODEL.name)
    assert not newcomer_drafts(crowd, fresh.repeat(64, 1), fresh, **{**kw, "pass_cost": 0.05})  # retired


def test_the_server_counts_the_requests_retired_at_admission():
    srv = _server(after=2)
    srv.retirement.admitting = True
    srv.note_passes(_runner(["a", "b"]), SimpleNamespace(num_spec_tokens_to_schedule=0))
    assert not srv.retirement.skip_now and srv.stats.retired == 0  # a step that was not planned admits no one...
    srv.retirement.streak.clear()
    srv.plan_passes(_runner(["a", "b"]), SimpleNamespace(num_spec_tokens_to_schedule=0), None)  # ... the plan's
    srv.admit_newcomers(["a", "b"])  # first act does, before anything else (vLLM's K = 0 here), counted once
    srv.note_passes(_runner(["a", "b"]), SimpleNamespace(num_spec_tokens_to_schedule=0))
    assert srv.retirement.skip_now  # newcomers retired at admission: their first step skips the head's pass
    assert (srv.stats.retired, srv.stats.retired_at_admission, srv.stats.head_skipped) == (2, 2, 1)
    assert ServeKnobs("t").retire_at_admission is True
    with pytest.raises((TypeError, ValueError), match="retire_at_admission"):
        ServeKnobs("t", retire_at_admission="yes")


def test_a_step_of_retired_requests_decides_without_the_plan_what_the_plan_would(tmp_path, monkeypatch):
    """The real serving state through bench/hot_path.py's stand-in runner (real code-edit prompts; SYNTHETIC tables
    and drafter confidences): once every request is retired, the plan of draft passes is not made, and the draft
    lists handed back and the passes run are those of a server that makes it on every step."""
    from calib.vllm import planning
    from calib.vllm.server import Server
    from tests.bench_scripts import load_bench
    from tests.serve.test_serve_entry import _synthetic_eagle_tables

    hot = load_bench("hot_path")
    tables = str(_synthetic_eagle_tables(tmp_path / "tables"))
    plans, plan = [], planning.plan_first_pass_host  # the plan's allocation (plan_draft where it answers None)
    monkeypatch.setattr(planning, "plan_first_pass_host", lambda *a, **k: plans.append(1) or plan(*a, **k))
    lean = hot.run("eagle", 8, 30, 0.0, tables, "1.0,0.001", seed=0, aside_after=0)  # a pass too dear: all retire
    made = len(plans)
    monkeypatch.setattr(Server, "plans_for", lambda self, gone: True)
    full = hot.run("eagle", 8, 30, 0.0, tables, "1.0,0.001", seed=0, aside_after=0)
    assert lean["decided"] == full["decided"] == 30 and lean["errors"] == full["errors"] == 0
    assert (lean["drafts_crc32"], lean["passes_planned"]) == (full["drafts_crc32"], full["passes_planned"])
    assert made < 10 and len(plans) - made == 30  # planned until the batch retired (after 4 steps), then not


def test_the_admission_question_of_a_retired_batch_is_the_plans(tmp_path):
    """A batch whose requests are all retired makes no plan, so its newcomers' question is asked without the plan's
    n-gram probabilities: the batch's best case offers nothing on that chain, so the answer is the one the plan's own
    chains give, at every batch size and pass price (pass where a pass is cheap, retire where it is dear), with the
    forecast's columns read when asked or given. SYNTHETIC tables and cost."""
    from calib.serve import StepInputs
    from calib.tables import load
    from calib.vllm.planning import best_case, newcomer_drafts
    from tests.serve.test_serve_entry import _synthetic_eagle_tables

    tables = load(_synthetic_eagle_tables(tmp_path / "tables"))
    srv = _server(after=2)
    srv.decider = SimpleNamespace(tables=tables, engine_chain=MODEL.name, history=RequestHistory(),
                                  cost=0.075 + 0.0035 * torch.arange(600, dtype=torch.float32))
    answers = set()
    for B in (1, 4, 16):
        ids, temps = [f"r{b}" for b in range(B)], [0.0] * (B - 1) + [0.8]
        columns = np.array([[t] for t in temps])  # the forecast's one axis, as the plan reads it
        planned = {MODEL.name: torch.zeros(B, 0), LOOKUP.name: torch.rand(B, 4, generator=torch.Generator().manual_seed(B))}
        fresh = srv.forecast(tables, MODEL.name, tables.forecast(MODEL.name), columns, 4)
        for price in (1e-4, 0.02, 5.0):
            srv.pass_prices[B + 1] = price
            plans = not newcomer_drafts(best_case(planned, MODEL.name), fresh, fresh.amax(dim=0),
                                        cost=srv.decider.cost, pass_cost=price, chain=MODEL.name)
            lean = srv.admission_question(srv.decider, StepInputs(ids, temps), None, B, 4)
            given = srv.admission_question(srv.decider, StepInputs(ids, temps), columns, B, 4)
            assert lean() == given() == plans
            answers.add(lean())
    assert answers == {True, False}


def test_the_server_observes_each_verified_round_from_vllms_sampled_ids():
    """vLLM's sampled ids per request: the accepted draft tokens, the bonus (or the correction), then -1; a request
    with no draft verified no round. What `observe` hands the decider, in Python lists (stand-in decider)."""
    srv = _server(after=2)
    seen, refreshed = [], []
    srv.decider = SimpleNamespace(observe_step=lambda *a: seen.append(a), refresh=lambda: refreshed.append(1))
    runner = _runner(["a", "b", "c", "d"])
    sampled = torch.tensor([[5, 6, 7, -1, -1], [9, -1, -1, -1, -1], [4, -1, -1, -1, -1], [1, 2, 3, 4, 8]],
                           dtype=torch.int32)
    srv.observe(runner, SimpleNamespace(num_draft_tokens=[4, 2, 0, 4]), sampled)
    assert seen == [(("a", "b", "d"), (2, 0, 4), (4, 2, 4))] and refreshed == [1]
    srv.observe(runner, SimpleNamespace(num_draft_tokens=[0, 0, 0, 0]), sampled)  # nothing verified: no round
    assert len(seen) == 1 and refreshed == [1, 1]
