"""Server offers every recomputed chain kind the tables calibrate (no chain named in Server): each recomputed from
the engine's token buffer once per step (calib/vllm/recomputed.py), and at most two chains handed to the allocator."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from calib.chains import Offer, chain
from calib.serve.knobs import ServeKnobs
from calib.vllm.recomputed import Recomputed, StepContexts
from calib.vllm.server import Server

pytest.importorskip("arctic_inference.suffix_decoding", reason="arctic-inference: make install-suffix")


def _batch(requests):
    """Stands for vLLM's InputBatch: (prompt, output) token lists per row."""
    width = max(len(p) + len(o) for p, o in requests) + 8
    buf = np.zeros((len(requests), width), dtype=np.int32)
    for i, (p, o) in enumerate(requests):
        buf[i, : len(p) + len(o)] = p + o
    return SimpleNamespace(req_ids=[f"r{i}" for i in range(len(requests))], token_ids_cpu=buf,
                           num_tokens_no_spec=np.array([len(p) + len(o) for p, o in requests]),
                           num_prompt_tokens=np.array([len(p) for p, _ in requests]),
                           temperature_cpu=np.zeros(len(requests)))


def _server():
    srv = Server(ServeKnobs("unused-tables"))
    srv.k, srv.max_model_len = 4, 2048
    dec = SimpleNamespace(chains=["model", "ngram", "suffix"], engine_chain="model", tables=None)
    # what recompute_chains builds from the tables: every recomputed kind they calibrate, in registry order
    srv.recomputed = {name: Recomputed(chain(name), None, 4, own, 2048)
                      for name, own in (("ngram", ["match_n"]), ("suffix", ["conf", "match_n"]))}
    return srv, dec


def test_the_suffix_chain_is_offered_as_its_recomputation_drafts_it():
    motif = [7, 8, 9, 10, 11, 12]
    reqs = [(motif + [1, 2] + motif[:3], [10]), ([3, 4, 5, 3, 4], [5]), ([1], [2])]
    srv, _ = _server()
    batch = _batch(reqs)
    contexts = StepContexts(batch, [0, 1, 2])
    tokens, sig = srv.recomputed["suffix"].chains(contexts)
    mine = chain("suffix").recompute(None, 4)
    for b, (p, o) in enumerate(reqs):
        want, _ = mine.propose(f"r{b}", np.array(p + o, dtype=np.int32), len(p), 2048)
        assert tokens[b] == want
    # [B, W, F]: conf (the tree's conditional estimate), match_n; NaN beyond the chain
    assert sig.shape[0] == 3 and sig.shape[2] == 2
    n0 = len(tokens[0])
    assert n0 > 0 and torch.isfinite(sig[0, :n0]).all() and (sig[0, :n0, 1] >= 1).all()
    assert torch.isnan(sig[0, n0:]).all()
    again = srv.recomputed["suffix"].chains(StepContexts(batch, [0, 1, 2]))  # the decision after the plan: shared
    assert again[0] is tokens and again[1] is sig
    srv.recomputed["suffix"].end_step()  # the decision read them: the next step recomputes every request
    assert not srv.recomputed["suffix"].matches and srv.recomputed["suffix"].last is None
    srv.finished(["r0"])
    assert "r0" not in srv.recomputed["suffix"].each.seen


def test_before_and_after_bookkeeping_a_step_is_recomputed_once():
    """The plan sees this step's tokens as ``extra`` (a padded EAGLE step: not yet in the buffer), the decision in
    the buffer: the same contexts, so the same chains, computed once (a stateful kind's tree extended once)."""
    srv, _ = _server()
    reqs = [([7, 8, 9, 10, 7, 8], [9]), ([3, 4, 5, 3, 4], [5])]
    before = _batch([(p, o[:-1]) for p, o in reqs])  # the buffer before bookkeeping
    plan = StepContexts(before, [0, 1], [[o[-1]] for _, o in reqs])
    after = _batch(reqs)
    decision = StepContexts(after, [0, 1])
    assert plan.keys == decision.keys
    for name, rec in srv.recomputed.items():
        first = rec.chains(plan)
        assert rec.chains(decision)[0] is first[0], name
        fresh = Recomputed(chain(name), None, 4, rec.own, 2048).chains(StepContexts(after, [0, 1]))
        assert fresh[0] == first[0] and np.array_equal(np.asarray(fresh[1]), np.asarray(first[1]), equal_nan=True)


def test_at_most_two_chains_reach_the_allocator():
    srv, dec = _server()
    B = 2
    model = Offer([[1, 2], [3, 4]], torch.full((B, 2), 0.5))
    weak = Offer([[5], [6]], None, probs=torch.tensor([[0.1], [0.2]]))
    strong = Offer([[7, 8], [9]], None, probs=torch.tensor([[0.9, 0.8], [0.7, float("nan")]]))
    got = srv.two_chains(dec, {"model": model, "ngram": weak, "suffix": strong}, ["a", "b"], [0.0, 0.0])
    assert list(got) == ["model", "suffix"] and srv.stats.chains_left_out == 1
    got = srv.two_chains(dec, {"model": model, "ngram": strong, "suffix": weak}, ["a", "b"], [0.0, 0.0])
    assert list(got) == ["model", "ngram"]
    two = {"ngram": weak, "suffix": strong}
    assert srv.two_chains(dec, two, ["a", "b"], [0.0, 0.0]) == two  # two offered: both stay


def test_between_cells_the_worker_forgets_the_suffix_responses_of_vllm_and_of_calib(monkeypatch):
    """calib.vllm.cell_stats.forget_served's worker side: vLLM's suffix drafter's cache and calib's recomputed
    suffix chain both emptied of the requests served so far (finished ones whose end was not told yet included)."""
    from arctic_inference.suffix_decoding import SuffixDecodingCache

    from calib.vllm import cell_stats, serving

    srv, _ = _server()
    srv.recomputed["suffix"].chains(StepContexts(_batch([([7, 8, 9, 7, 8], [9]), ([3, 4, 3], [4])]), [0, 1]))
    theirs = SuffixDecodingCache(max_tree_depth=24, max_cached_requests=100)
    theirs.start_request("a", np.array([1, 2, 3], dtype=np.int32))
    theirs.add_active_response("a", np.array([4], dtype=np.int32))
    monkeypatch.setattr(serving, "_SERVER", srv)
    worker = SimpleNamespace(model_runner=SimpleNamespace(drafter=SimpleNamespace(suffix_cache=theirs)))
    assert cell_stats._forget_in_worker(worker) == {"vllm": 1, "calib": 2}
    assert not theirs.active_requests and not theirs.cached_requests
    mine = srv.recomputed["suffix"].each
    assert not mine.cache.active_requests and not mine.cache.cached_requests and not mine.seen
