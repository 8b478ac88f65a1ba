"""The clock oracle (calib/serve/oracle.py) and its wiring: the reference file, the per-row choice, the serving
step it drives (calib/vllm/server.py ``Server.step`` / ``plan_passes``), the knob and serve.py's checks.

Every token list here is SYNTHETIC (small made-up ids, a fake vLLM input batch of numpy arrays); no engine.
The real engine's run is tests/vllm/test_oracle_engine.py.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from calib.chains import Offer, chains
from calib.serve import RequestHistory, StepInputs
from calib.serve.knobs import ServeKnobs
from calib.serve.oracle import (
    FORMAT,
    Oracle,
    Reference,
    accepted_prefix,
    all_committed,
    oracle_choice,
    pad_to_cheapest,
    prompt_key,
    write_reference,
)

ROOT = Path(__file__).resolve().parents[2]
MODEL = next(k for k in chains() if k.confidence is not None)
LOOKUP = next(k for k in chains() if k.propose is not None)


def test_prompt_key_is_sha256_of_little_endian_int64():
    ids = [1, 2, 70000]
    assert prompt_key(ids) == hashlib.sha256(np.array(ids, dtype="<i8").tobytes()).hexdigest()
    assert prompt_key(np.array(ids, dtype=np.int32)) == prompt_key(ids) == prompt_key(tuple(ids))
    assert prompt_key([1, 2]) != prompt_key([2, 1]) and len(prompt_key([])) == 64
    with pytest.raises(ValueError, match="flat sequence of ints"):
        prompt_key([[1, 2]])


def test_reference_round_trip_and_continuation(tmp_path):
    a, b = prompt_key([1, 2, 3]), prompt_key([4, 5])
    path = write_reference(tmp_path / "ref.json", {a: [10, 11, 12, 13], b: np.array([7, 8])}, 4, "float32")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ref.json"]  # no temp file left behind
    obj = json.loads(path.read_text())
    assert obj == {"format": FORMAT, "max_tokens": 4, "dtype": "float32", "outputs": {a: [10, 11, 12, 13], b: [7, 8]}}
    ref = Reference.load(path)
    assert len(ref) == 2 and a in ref and ref.max_tokens == 4 and ref.dtype == "float32"
    assert ref.continuation(a, []) == [10, 11, 12, 13]
    assert ref.continuation(a, np.array([10, 11], dtype=np.int32)) == [12, 13]
    assert ref.continuation(a, [10], limit=2) == [11, 12]
    assert ref.continuation(a, [10, 11, 12, 13]) == []  # the whole reference: nothing left to verify
    assert ref.continuation(a, [10, 99]) is None  # parted from the reference
    assert ref.continuation(a, [10, 11, 12, 13, 14]) == []  # a verify step ran past its end: finished
    assert ref.continuation(a, [10, 11, 12, 14, 14]) is None
    assert ref.continuation(prompt_key([9]), []) is None  # unknown prompt


@pytest.mark.parametrize("edit, where", [
    (lambda o: o.update(format="calib-oracle-reference/0"), "'format'"),
    (lambda o: o.update(max_tokens=0), "'max_tokens'"),
    (lambda o: o.update(dtype=3), "'dtype'"),
    (lambda o: o.update(outputs=[1, 2]), "'outputs'"),
    (lambda o: o["outputs"].update({"nothex": [1]}), "'nothex'"),
    (lambda o: o["outputs"].update({"0" * 64: [1, -2]}), "0" * 64),
    (lambda o: o["outputs"].update({"0" * 64: [1, 2, 3, 4, 5]}), "more than max_tokens=4"),
    (lambda o: o.update(extra=1), "unknown key"),
])
def test_bad_reference_files_are_refused_naming_file_and_key(tmp_path, edit, where):
    obj = {"format": FORMAT, "max_tokens": 4, "dtype": "auto", "outputs": {prompt_key([1]): [3, 4]}}
    edit(obj)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(obj))
    with pytest.raises(ValueError) as err:
        Reference.load(path)
    assert str(path) in str(err.value) and where in str(err.value)


def test_missing_or_non_json_reference(tmp_path):
    with pytest.raises(FileNotFoundError, match="reference_out="):
        Reference.load(tmp_path / "none.json")
    (tmp_path / "x.json").write_text("{not json")
    with pytest.raises(ValueError, match="x.json: not JSON"):
        Reference.load(tmp_path / "x.json")


def test_write_reference_refuses_before_writing(tmp_path):
    with pytest.raises(ValueError, match="not a list of token ids"):
        write_reference(tmp_path / "r.json", {prompt_key([1]): [1, -1]}, 8, "auto")
    with pytest.raises(ValueError, match="not a prompt key"):
        write_reference(tmp_path / "r.json", {"p1": [1]}, 8, "auto")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("what", ["a prompt file", "a list", "a folder"])
def test_write_reference_never_replaces_what_is_not_a_reference(tmp_path, what):
    """The guard is in write_reference itself, not only in serve.py's config check: a caller that skips the check
    still cannot replace a user's file (or write into a folder); an earlier reference is replaced."""
    path = tmp_path / "out.json"
    if what == "a folder":
        path.mkdir()
    else:
        path.write_text('{"messages": []}\n' if what == "a prompt file" else "[1, 2]")
    before = None if what == "a folder" else path.read_bytes()
    with pytest.raises(FileExistsError, match="not written: .*(folder|not a clock-oracle reference)"):
        write_reference(path, {prompt_key([1]): [1]}, 8, "auto")
    assert path.is_dir() if what == "a folder" else path.read_bytes() == before
    ref = write_reference(tmp_path / "ref.json", {prompt_key([1]): [1]}, 8, "auto")
    write_reference(ref, {prompt_key([1]): [1, 2]}, 8, "auto")  # a reference replaced by the next one
    assert json.loads(ref.read_text())["outputs"][prompt_key([1])] == [1, 2]


def test_oracle_choice_commits_most_ties_to_the_cheaper_chain():
    offers = {"model": [[1, 2, 3], [1, 2], [5], [1, 9], [4]],
              "ngram": [[1, 2], [1, 2, 3], [6], [1, 8], []]}
    conts = [[1, 2, 3, 4], [1, 2, 3], [7, 7], [1, 7], None]
    drafts, chosen, known = oracle_choice(offers, conts, ("ngram", "model"), "model", [[4], [4], [4], [4], [4, 4]])
    assert drafts == [[1, 2, 3], [1, 2, 3], [], [1], [4, 4]]
    assert chosen == ["model", "ngram", None, "ngram", "model"]  # row 3: a tie (1 each) goes to the n-gram chain
    assert known == [True, True, True, True, False]  # the unknown row keeps the engine's own draft
    # a draft longer than the continuation's end commits no more than what is left
    assert oracle_choice({"ngram": [[1, 2, 3]]}, [[1, 2]])[0] == [[1, 2]]
    assert oracle_choice({"ngram": [[3]]}, [None])[:2] == ([[]], [None])  # no engine drafts given
    with pytest.raises(ValueError, match="offers 1 drafts for 2"):
        oracle_choice({"ngram": [[1]]}, [[1], [1]])
    assert accepted_prefix([], [1]) == 0 and accepted_prefix([1, 2], [1, 2, 3]) == 2


def _committed(draft, cont) -> list[int]:
    """What greedy verification of ``draft`` commits against the reference ``cont``: the accepted prefix, then the
    target's own next token (the corrected or bonus token) where the reference goes on."""
    n = accepted_prefix(draft, cont)
    return list(cont[: n + 1])


def test_padding_reaches_the_cheapest_step_and_commits_the_same_tokens():
    offers = {"ngram": [[1, 2, 9, 9], [5, 5], [], [3, 3, 3]], "model": [[1, 8], [6, 6, 6], [4], [3, 3, 3]]}
    conts = [[1, 2, 3, 4], [7, 7, 7], [1, 2], None]
    drafts, chosen, known = oracle_choice(offers, conts, ("ngram", "model"), "model", [[], [], [], [3, 3]])
    assert drafts == [[1, 2], [], [], [3, 3]]  # B = 4, T = 8
    falling = np.array([0, 60, 58, 56, 54, 52, 50, 48, 47, 46, 45, 44, 46, 48, 50], dtype=np.float64)
    padded, names = pad_to_cheapest(drafts, chosen, known, offers, conts, falling, ("ngram", "model"))
    # spare: row 0 [9, 9] (ngram's tokens past its prefix), row 1 ngram's [5, 5], row 2 model's [4]: T 8 -> 11 (44)
    assert padded == [[1, 2, 9], [5], [4], [3, 3]] and names == ["ngram", "ngram", "model", "model"]
    assert sum(map(len, padded)) + 4 == 11
    for d, p, c in zip(drafts, padded, conts):
        if c is not None:
            assert _committed(p, c) == _committed(d, c)  # the same tokens, token for token
    rising = np.arange(20, dtype=np.float64)
    assert pad_to_cheapest(drafts, chosen, known, offers, conts, rising) == (drafts, chosen)  # every shipped cost
    # a reference that ends at the prefix (the request finishes) and an unknown row get nothing
    assert pad_to_cheapest([[1, 2]], ["ngram"], [True], {"ngram": [[1, 2, 5]]}, [[1, 2]], falling)[0] == [[1, 2]]
    assert pad_to_cheapest([[]], [None], [False], {"ngram": [[4]]}, [None], falling) == ([[]], [None])


def test_padding_never_changes_what_is_committed_and_never_costs_more():
    """Random SYNTHETIC instances: the padded step commits what the unpadded one does and is priced no higher."""
    rng = np.random.default_rng(0)
    for _ in range(300):
        B, K = int(rng.integers(1, 6)), int(rng.integers(1, 5))
        conts = [None if rng.random() < 0.15 else rng.integers(0, 3, size=int(rng.integers(0, 6))).tolist()
                 for _ in range(B)]
        offers = {c: [rng.integers(0, 3, size=int(rng.integers(0, K + 1))).tolist() for _ in range(B)]
                  for c in ("ngram", "model")}
        price = rng.uniform(1, 2, size=B * (K + 1) + 1)
        drafts, chosen, known = oracle_choice(offers, conts, ("ngram",), "model", offers["model"])
        padded, names = pad_to_cheapest(drafts, chosen, known, offers, conts, price, ("ngram",))
        assert all(len(p) <= K and p[: len(d)] == list(d) for p, d in zip(padded, drafts))
        assert price[B + sum(map(len, padded))] <= price[B + sum(map(len, drafts))]
        for d, p, c, name, b in zip(drafts, padded, conts, names, range(B)):
            if c is not None:
                assert _committed(p, c) == _committed(d, c)
            if len(p) > len(d):
                assert name is not None and p == offers[name][b][: len(p)]  # one chain's draft, as offered


def test_all_committed_is_what_no_model_draft_could_beat():
    assert all_committed([[1, 2], [5]], [[1, 2, 3], [5]], 2)  # min(K, left) each
    assert not all_committed([[1], [5]], [[1, 2, 3], [5]], 2)
    assert not all_committed([[1, 2]], [None], 2) and not all_committed(None, [[1]], 2)
    assert all_committed([[]], [[]], 4)  # the reference has ended: nothing to commit
    assert Oracle(None).passes([[1, 2]], [[1, 2]], 4) == 0 and Oracle(None).passes([[1]], [[1, 2]], 4) == 4


def _batch(rows: list[tuple[list[int], list[int]]], width: int = 32):
    """A fake vLLM input batch: per row (prompt ids, output ids so far)."""
    B = len(rows)
    tok = np.zeros((B, width), dtype=np.int32)
    for i, (p, o) in enumerate(rows):
        tok[i, : len(p) + len(o)] = p + o
    req_ids = [f"r{i}" for i in range(B)]
    return SimpleNamespace(token_ids_cpu=tok, num_prompt_tokens=np.array([len(p) for p, _ in rows]),
                           num_tokens_no_spec=np.array([len(p) + len(o) for p, o in rows]),
                           req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                           temperature_cpu=np.zeros(B, dtype=np.float32))


def test_oracle_reads_the_batch_and_caches_prompt_keys():
    p0, p1 = [1, 2, 3, 1, 2], [9, 9]
    ref = Reference({prompt_key(p0): [3, 1, 2, 3, 4], prompt_key(p1): [5, 6]}, 8, "auto")
    orc = Oracle(ref)
    batch = _batch([(p0, [3]), (p1, [7]), ([4], [])])
    conts = orc.continuations(batch, [0, 1, 2], batch.req_ids, [0.0, 0.0, 0.0], limit=3)
    assert conts == [[1, 2, 3], None, None]  # row 1 parted (7 != 5), row 2 unknown prompt
    assert set(orc.keys) == {"r0", "r1", "r2"}
    assert orc.continuations(batch, [0], ["r0"], [0.0], 4, extra=[[1, 2]]) == [[3, 4]]  # bookkeeping pending
    assert orc.continuations(batch, [0], ["r0"], [0.7], 4) == [None]  # greedy only
    orc.finish("r0")
    assert "r0" not in orc.keys


def test_oracle_decision_is_a_step_decision():
    orc = Oracle(Reference({}, 4, "auto"))
    inputs = StepInputs(["a", "b", "c"], [0.0] * 3, {MODEL.name: Offer([[1, 2], [3], [8]], None),
                                                      LOOKUP.name: Offer([[1], [3], [9]], None)})
    d, known = orc.decide(inputs, [[1, 2, 5], [3, 4], None], MODEL.name, [[1, 2], [3], [8, 8]])
    assert d.drafts == [[1, 2], [3], [8, 8]] and known == [True, True, False]
    assert d.chain.dtype == torch.int8 and d.chain.tolist() == [MODEL.id, LOOKUP.id, MODEL.id]
    assert d.depth.dtype == torch.int32 and d.depth.tolist() == [2, 1, 2]
    assert d.expected_accepted.dtype == torch.float32 and d.expected_accepted[:2].tolist() == [2.0, 1.0]
    assert torch.isnan(d.expected_accepted[2]) and d.probs is None and not d.passthrough
    # priced where more positions cost less: each row verifies its chosen chain's next token past the prefix
    # (row 0 the model's 6, row 1 the n-gram's 3), T 5 -> 7, the cheapest the offers reach
    cheap = Oracle(Reference({}, 4, "auto"), price=np.array([0, 9, 8, 7, 6, 5, 4, 3, 2.0]))
    inputs = StepInputs(["a", "b"], [0.0] * 2, {MODEL.name: Offer([[1, 2, 6], [5, 5]], None),
                                                 LOOKUP.name: Offer([[1], [3, 3]], None)})
    d, known = cheap.decide(inputs, [[1, 2, 5], [3, 4]], MODEL.name, [[1, 2, 6], [5, 5]])
    assert d.drafts == [[1, 2, 6], [3, 3]] and cheap.padded == 2 and known == [True, True]
    assert d.depth.tolist() == [3, 2] and d.expected_accepted.tolist() == [2.0, 1.0]  # the prefix, not the depth


def _server(tmp_path, ref: dict, engine_chain: str):
    """A Server past construction, with the oracle on and a stand-in decider (no tables, no engine)."""
    from calib.vllm.recomputed import Recomputed
    from calib.vllm.server import Server

    path = write_reference(tmp_path / "ref.json", ref, 16, "float32")
    srv = Server(ServeKnobs("unused-tables", oracle=str(path)))
    srv.k, srv.max_model_len = 4, 2048
    srv.recomputed = {LOOKUP.name: Recomputed(LOOKUP, (1, 4, 4), 4, [], 2048)}  # what construction builds
    srv.oracle = Oracle(Reference.load(path))
    srv.decider = SimpleNamespace(enabled=True, engine_chain=engine_chain, chains=[engine_chain, LOOKUP.name], tables=None,
                                  remember=lambda *a, **k: pytest.fail("the oracle must not feed online learning"),
                                  finish=lambda r: None, history=RequestHistory(from_text=True))
    return srv


def test_server_step_verifies_what_the_reference_accepts_on_the_ngram_engine(tmp_path):
    prompt, out = [1, 2, 3, 4, 1, 2], [3]
    context = np.array(prompt + out)
    ngram = LOOKUP.propose(context, (1, 4, 4), len(prompt), 2048)[0]  # vLLM's n-gram draft of this context
    assert ngram[:2] == [4, 1]
    srv = _server(tmp_path, {prompt_key(prompt): out + [4, 1, 77, 5]}, LOOKUP.name)
    batch = _batch([(prompt, out), ([8, 8], [1])])  # row 1: a prompt the reference does not hold
    runner = SimpleNamespace(input_batch=batch, requests={})
    decided = srv.step(runner, Drafts(list(batch.req_ids), [ngram, [6, 6]]))
    assert decided.req_ids == ["r0", "r1"]
    assert decided.draft_token_ids == [[4, 1], [6, 6]]  # the accepted prefix; vLLM's own draft where unknown
    st = srv.stats
    assert (st.oracle_known, st.oracle_unknown, st.decided, st.truncated) == (1, 1, 1, 1)
    assert srv.chosen == {"r0": LOOKUP.name, "r1": LOOKUP.name}
    srv.finished(["r0"])
    assert "r0" not in srv.oracle.keys


class Drafts:
    """Stands for vLLM's ``DraftTokenIds`` (what ``take_draft_token_ids`` returns)."""

    def __init__(self, req_ids, draft_token_ids):
        self.req_ids, self.draft_token_ids = req_ids, draft_token_ids


def test_plan_runs_no_model_pass_only_where_the_ngram_chain_commits_all_it_can(tmp_path):
    prompt = [1, 2, 3, 4, 1, 2]
    sched = SimpleNamespace(num_spec_tokens_to_schedule=4)
    for after, passes in (([3, 4, 1, 2, 3], 0), ([3, 4, 9], 4)):  # the n-gram chain [4, 1, 2, 3] all / 1 of 2
        srv = _server(tmp_path, {prompt_key(prompt): after}, MODEL.name)
        srv.planning = True
        batch = _batch([(prompt, [])])
        sched.num_spec_tokens_to_schedule = 4
        # a padded EAGLE step: this step's token (3) is not yet in token_ids_cpu
        srv.plan_passes(SimpleNamespace(input_batch=batch, requests={}), sched, torch.tensor([[3, -1]]))
        assert sched.num_spec_tokens_to_schedule == passes
        assert (srv.stats.planned, srv.stats.passes_engine, srv.stats.passes_planned) == (1, 4, passes)


def test_knob_and_policy(tmp_path):
    import calib.policies
    from calib.evaluate import clock

    ref = write_reference(tmp_path / "ref.json", {}, 8, "auto")
    assert ServeKnobs("t", oracle=str(ref)).oracle == str(ref) and ServeKnobs("t").oracle is None
    assert ServeKnobs.from_json(ServeKnobs("t", oracle=str(ref)).to_json()).oracle == str(ref)
    with pytest.raises(ValueError, match="parameter oracle="):
        ServeKnobs("t", oracle=str(tmp_path / "missing.json"))
    node = calib.policies.serving_nodes()["oracle"]
    assert node["oracle"] is True and node["calib"] and node["chains"] == ["model", "ngram"] and node["plan"] is False
    assert calib.policies.serving_nodes()["two_drafter"]["oracle"] is False
    assert {a: (i.policy, i.method) for a, i in clock.arms().items() if i.oracle} == {
        "oracle_ngram": ("oracle", "ngram"), "oracle_two_drafter": ("oracle", "eagle")}


def test_serve_config_checks_and_knobs(tmp_path):
    from calib.vllm.serve_runner import check_oracle, serve_knobs
    from tests.vllm.test_engine import compose

    ref = write_reference(tmp_path / "ref.json", {}, 8, "float32")
    cfg = compose("serve", "policy=oracle", "speculative=ngram", "sampling.max_tokens=8", "engine.dtype=float32")
    with pytest.raises(ValueError, match=r"needs serve.oracle=PATH.*reference_out=PATH"):
        check_oracle(cfg)
    cfg["serve"]["oracle"] = str(ref)
    check_oracle(cfg)
    knobs = serve_knobs(cfg, ROOT)
    assert knobs.oracle == str(ref) and knobs.chains == ("model", "ngram") and knobs.plan is False
    rel = compose("serve", "policy=oracle", "serve.oracle=ref.json", "serve.cost=[1.0,0.05]")
    assert serve_knobs(rel, tmp_path).oracle == str(ref)  # project-relative: absolute for the engine
    with pytest.raises(ValueError, match="sampling.temperature=0.8"):
        check_oracle({**cfg, "sampling": {**cfg["sampling"], "temperature": 0.8}})
    two = compose("serve", "policy=two_drafter", f"serve.oracle={ref}")
    with pytest.raises(ValueError, match="serve.oracle=.*only policy=oracle"):
        check_oracle(two)
    with pytest.raises(ValueError, match="only"):
        serve_knobs(two, ROOT)
    with pytest.raises(ValueError, match="reference_out=.*policy=no_spec"):
        check_oracle(compose("serve", "policy=fixed", "reference_out=x.json"))
    check_oracle(compose("serve", "policy=no_spec", "reference_out=x.json"))
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"format": FORMAT, "max_tokens": 8, "dtype": "auto", "outputs": {"k": [1]}}))
    with pytest.raises(ValueError, match="bad.json: outputs key 'k'"):
        check_oracle({**cfg, "serve": {**cfg["serve"], "oracle": str(bad)}})
