"""Capture records → bank tables; the reconciliation gate; durable parts and config refusal."""

import json

import pytest

from calib.bank import validate, write_bank
from calib.collect.assemble import (
    ReconciliationError,
    RunKeys,
    build_tables,
    engine_request_prefix,
    read_capture,
    reconcile,
)
from calib.collect.runner import SUCCESS, RunFolder

KEYS = RunKeys(model="m", speculator="draft_model:x", config="c", width=3, chain_width=3,
               chain_verified=False, temperature=0.0)


def _rec(step, drafted, accepted, ngram_tokens=(), context_len=4, conf=True):
    rec = {"req": "0-abcdefgh", "step": step, "batch_size": 2, "drafted": list(drafted),
           "accepted": accepted, "context_len": context_len, "prompt_len": 3,
           "ngram_tokens": list(ngram_tokens),
           "ngram": {"match_n": 1, "occurrences": 1, "distance": 3, "in_prompt": True,
                     "distinct_next": 1, "agreement": 1.0, "cont_len": 2, "context_len": context_len}}
    if conf:
        rec.update(conf=[0.9, 0.5, 0.2][: len(drafted)], entropy=[0.1] * len(drafted), margin=[0.5] * len(drafted))
    return rec


def test_build_tables_counterfactual(tmp_path):
    final = [10, 11, 12, 13, 20, 21, 22, 23]
    rounds = {0: [_rec(1, [20, 99, 98], 1, ngram_tokens=[20, 21, 5], context_len=4),
                  _rec(2, [22, 23], 2, ngram_tokens=[], context_len=6)]}
    acc, spec, ng = build_tables(rounds, {0: "chat"}, {0: final}, KEYS)
    assert acc.column("accept").to_pylist() == [1, 2]
    assert acc.column("acc2").to_pylist() == [0, None]
    assert spec.column("conf0").to_pylist() == [0.9, 0.9]
    assert ng.column("label_source").to_pylist() == ["counterfactual", "none"]
    assert ng.column("accept").to_pylist() == [2, None]  # [20, 21] match the realised output, 5 does not
    assert write_bank(tmp_path / "b", acc, spec, ng) and validate(str(tmp_path / "b")) == []


def test_verified_ngram_must_reproduce_draft():
    keys = RunKeys("m", "ngram", "c", 3, 3, chain_verified=True, temperature=0.0)
    good = {0: [_rec(1, [5, 6], 1, ngram_tokens=[5, 6, 7], conf=False)]}
    _, _, ng = build_tables(good, {0: "chat"}, {0: [1, 2, 3, 4, 5, 9]}, keys)
    assert ng.column("label_source").to_pylist() == ["verified"]
    assert ng.column("ngram_len").to_pylist() == [2]
    bad = {0: [_rec(1, [5, 6], 1, ngram_tokens=[5, 8], conf=False)]}
    with pytest.raises(ReconciliationError, match="does not reproduce"):
        build_tables(bad, {0: "chat"}, {0: [1, 2, 3, 4]}, keys)


def test_serving_while_collecting_labels_each_chain_by_what_was_verified(tmp_path):
    """calib served while collecting (SYNTHETIC records): a round where it verified the n-gram chain
    instead of the drafter's keeps no drafter labels, and its n-gram row is the verified one."""
    final = [10, 11, 12, 13, 20, 21, 22, 23]
    own = _rec(1, [20, 99], 1, ngram_tokens=[20, 21, 5], context_len=4)
    own["verified_chain"] = "model"
    sub = _rec(2, [22, 23], 2, ngram_tokens=[22, 23, 7], context_len=6)
    sub["verified_chain"] = "ngram"
    acc, spec, ng = build_tables({0: [own, sub]}, {0: "chat"}, {0: final}, KEYS)
    assert acc.column("accept").to_pylist() == [1, 0]
    assert acc.column("acc0").to_pylist() == [1, None]  # the drafter's draft was not verified in round 2
    assert spec.column("conf0").to_pylist() == [0.9, None] and spec.column("tok0").to_pylist() == [20, None]
    assert spec.column("verified_chain").to_pylist() == ["model", "ngram"]
    assert ng.column("label_source").to_pylist() == ["counterfactual", "verified"]
    assert ng.column("verified").to_pylist() == [False, True]
    assert ng.column("accept").to_pylist() == [2, 2] and ng.column("ngram_len").to_pylist() == [3, 2]
    assert write_bank(tmp_path / "b", acc, spec, ng) and validate(str(tmp_path / "b")) == []
    # no serving: no verified_chain column, the bank layout is unchanged
    _, spec0, _ = build_tables({0: [_rec(1, [20, 99], 1)]}, {0: "chat"}, {0: final}, KEYS)
    assert "verified_chain" not in spec0.column_names


def test_reconcile_gate():
    rounds = {0: [_rec(1, [1, 2, 3], 1), _rec(2, [1, 2, 3], 0)]}
    reconcile(rounds, {0: ([1, 0], [3, 3])}, {0: "p0"})
    with pytest.raises(ReconciliationError, match="prompt 0"):
        reconcile(rounds, {0: ([1, 1], [3, 3])}, {0: "p0"})
    with pytest.raises(ReconciliationError, match="captured 2 rounds, vLLM reports 3"):
        reconcile(rounds, {0: ([1, 0, 0], [3, 3, 3])}, {0: "p0"})


def test_read_capture_orders_and_surfaces_errors(tmp_path):
    (tmp_path / "capture-1.jsonl").write_text(json.dumps(_rec(2, [1], 0)) + "\n" + json.dumps(_rec(1, [1], 1)) + "\n")
    recs = read_capture(tmp_path)
    assert [r["step"] for r in recs["0-abcdefgh"]] == [1, 2]
    assert engine_request_prefix("12-abcdefgh") == "12"
    (tmp_path / "capture-2.jsonl").write_text(json.dumps({"capture_error": "verify: boom"}) + "\n")
    with pytest.raises(RuntimeError, match="boom"):
        read_capture(tmp_path)


def test_run_folder_parts_and_refusal(tmp_path):
    cfg = {"a": 1, "out_dir": str(tmp_path)}
    folder = RunFolder(tmp_path, cfg)
    folder.open()
    (folder.parts / ".part-00001.xyz").mkdir()  # a part being written when the run was killed
    rounds = {0: [_rec(1, [20, 99, 98], 1, ngram_tokens=[20], context_len=4)]}
    folder.write_part(0, build_tables(rounds, {0: "chat"}, {0: [1, 2, 3, 4, 20]}, KEYS), {"n_rounds": 1})
    assert folder.done(0) and not folder.done(1)
    assert (folder.part_dir(0) / SUCCESS).exists()
    RunFolder(tmp_path, {**cfg, "out_dir": "elsewhere"}).open()  # out_dir is not part of the hash
    assert not list(folder.parts.glob(".part-*"))  # stale temp part removed on reopen
    with pytest.raises(RuntimeError, match="another config"):
        RunFolder(tmp_path, {**cfg, "a": 2}).open()
