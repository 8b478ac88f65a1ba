"""The real suffix chain (calib/chains/suffix.py): arctic-inference's suffix tree as vLLM's proposer runs it, its bank
file through the generic writer and validator, and its table inputs."""

from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq
import pytest

from calib.bank import validate, write_bank
from calib.chains import chain, recomputed_chains
from calib.chains.suffix import SUFFIX, SUFFIX_FILE, conditional, suffix_round_data
from calib.collect.assemble import RunKeys, build_tables

arctic = pytest.importorskip("arctic_inference.suffix_decoding", reason="arctic-inference: make install-suffix")


def _requests(seed=0, n=6, length=80, vocab=12):
    rng = np.random.default_rng(seed)
    motif = rng.integers(0, vocab, 10)
    return [np.concatenate([motif, rng.integers(0, vocab, 6), motif[: 4 + i], rng.integers(0, vocab, length)])
            .astype(np.int32) for i in range(n)]


def test_the_proposer_drafts_what_vllms_suffix_proposer_drafts():
    """Request after request, token after token, as vllm/v1/spec_decode/suffix_decoding.py calls the cache."""
    settings = SUFFIX.settings(None, 4)
    mine = SUFFIX.recompute(None, 4)
    theirs = arctic.SuffixDecodingCache(max_tree_depth=settings["max_tree_depth"],
                                        max_cached_requests=settings["max_cached_requests"])
    drafted = 0
    for r, toks in enumerate(_requests()):
        req, prompt = f"r{r}", 20
        theirs.start_request(req, toks[:prompt])
        for n in range(prompt + 1, len(toks)):
            theirs.add_active_response(req, toks[n - 1: n])
            want = theirs.speculate(req, toks[max(0, n - settings["max_tree_depth"]): n], max_spec_tokens=4,
                                    max_spec_factor=settings["max_spec_factor"], min_token_prob=settings["min_token_prob"])
            tokens, feats = mine.propose(req, toks[:n], prompt, 2048)
            assert tokens == list(want.token_ids), (r, n)
            if tokens:
                drafted += 1
                assert feats["match_n"] == want.match_len and feats["score"] == pytest.approx(want.score)
                assert feats["suffix_prob"] == pytest.approx(list(want.probs))
        theirs.stop_request(req)
        mine.finish(req)
    assert drafted > 50  # the motifs repeat: the tree drafts often, from earlier responses too


def test_conditional_estimate():
    got = conditional(np.array([[0.8, 0.4, 0.4, np.nan], [0.0, 0.0, np.nan, np.nan]]))
    assert np.allclose(got[0, :3], [0.8, 0.5, 1.0]) and np.isnan(got[0, 3])
    assert got[1, :2].tolist() == [0.0, 0.0] and np.isnan(got[1, 2:]).all()


def _records(toks, prompt=20, engine_draft=None):
    """Capture records of one request (engine drafts 'engine_draft' or the suffix chain itself)."""
    rc = chain("suffix").recompute(None, 3)
    ng = chain("ngram").recompute(None, 3)
    recs = []
    for step, n in enumerate(range(prompt + 1, len(toks) - 3)):
        tokens, feats = rc.propose("q-aaaaaaaa", toks[:n], prompt, 2048)
        ngt, ngf = ng.propose("q-aaaaaaaa", toks[:n], prompt, 2048)
        drafted = tokens if engine_draft is None else engine_draft
        if not drafted:
            continue
        accepted = next((j for j, t in enumerate(drafted) if t != toks[n + j]), len(drafted))
        recs.append({"req": "q-aaaaaaaa", "step": step, "batch_size": 1, "drafted": list(drafted),
                     "accepted": accepted, "context_len": n, "prompt_len": prompt,
                     "suffix_tokens": tokens, "suffix": feats, "ngram_tokens": ngt, "ngram": ngf})
    return recs


def test_its_bank_file_through_the_generic_writer_and_validator(tmp_path):
    assert SUFFIX in recomputed_chains()
    toks = _requests(seed=3, n=1)[0]
    keys = RunKeys("m", "suffix", "suffix-k3-t0", 3, 3, chain_verified=True, temperature=0.0)
    acc, spec, *chains = build_tables({0: _records(toks)}, {0: "code_edit"}, {0: list(toks)}, keys)
    assert [SUFFIX_FILE.length in c.column_names for c in chains] == [False, True]  # registry order: ngram, suffix
    bank = write_bank(tmp_path / "b", acc, spec, *chains)
    assert validate(str(bank)) == []
    t = pq.read_table(bank / SUFFIX_FILE.file)
    assert set(t.column("label_source").to_pylist()) == {"verified"}
    assert t.column("accept").to_pylist() == acc.column("accept").to_pylist()
    # a path estimate above 1 is named by file, column and row
    import pyarrow as pa

    bad = t.set_column(t.column_names.index("suffix_prob0"), "suffix_prob0",
                       pa.array(t.column("suffix_prob0").to_numpy(zero_copy_only=False) * 0 + 1.5))
    pq.write_table(bad, bank / SUFFIX_FILE.file)
    problems = validate(str(bank))
    assert problems and problems[0].column == "suffix_prob0" and "outside [0.0, 1.0]" in problems[0].message
    assert problems[0].file.endswith(SUFFIX_FILE.file) and problems[0].row == 0


def test_round_data_reads_its_features(tmp_path):
    from calib.bank import load

    toks = _requests(seed=4, n=1)[0]
    keys = RunKeys("m", "eagle:x", "eagle-k3-t0", 3, 3, chain_verified=False, temperature=0.0)
    recs = _records(toks, engine_draft=[1, 2, 3])  # another drafter's rounds: the suffix chain is counterfactual
    bank = write_bank(tmp_path / "b", *build_tables({0: recs}, {0: "chat"}, {0: list(toks)}, keys))
    rounds = load(bank).rounds(chains=[SUFFIX])
    data = suffix_round_data(rounds, ["conf", "match_n"])
    length = rounds.column("sx_suffix_len").to_numpy()
    assert data.inputs.shape == (rounds.num_rows, 3, 2)
    has = length > 0
    assert np.isfinite(data.raw[has, 0]).all() and np.isnan(data.raw[~has]).all()
    assert (data.inputs[has, 0, 1] == rounds.column("sx_match_n").to_numpy()[has]).all()
    src = set(rounds.column("sx_label_source").to_pylist())
    assert src <= {"counterfactual", "none"} and "counterfactual" in src


def test_forgetting_the_responses_drafts_a_served_prompt_again_as_the_first_time():
    """Between benchmark cells (calib.vllm.cell_stats.forget_served): a re-served greedy prompt must not be drafted
    from its own earlier output; the requests still held as active (finished, not yet told) are stopped first."""
    toks = _requests(n=1)[0]
    prompt = 20

    def drafts(proposer, req):
        return [proposer.propose(req, toks[:n], prompt, 2048)[0] for n in range(prompt + 1, len(toks))]

    fresh = SUFFIX.recompute(None, 4)
    first = drafts(fresh, "a")  # "a" stays active: its end not told, as after a cell's last step
    again = drafts(fresh, "b")
    assert again != first  # the global tree holds "a"'s output: the re-served prompt drafts further
    served = SUFFIX.recompute(None, 4)
    drafts(served, "a")
    assert served.forget_responses() == 1
    assert not served.cache.active_requests and not served.cache.cached_requests
    assert drafts(served, "b") == first
