"""Requests calib must not judge (issue 29, Must 6), without an engine: the classification of vLLM's
SamplingParams, the bank column capture writes (optional, old banks load), training leaving those rounds
out by default, and serving putting vLLM's own drafts back for them."""

from types import SimpleNamespace as NS

import numpy as np
import pyarrow as pa
import pytest
import torch

from calib.bank import load, validate, write_bank
from calib.collect.assemble import build_tables
from calib.transforms import decode, encode, target_only_transforms
from tests.collect.test_assemble import KEYS, _rec
from tests.synthetic import synthetic_tables


def test_plain_and_neutral_requests_are_judged():
    from vllm import SamplingParams

    assert target_only_transforms(None) == ()
    assert target_only_transforms(SamplingParams(temperature=0.8, top_p=0.9, max_tokens=8)) == ()
    neutral = SamplingParams(presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0, logit_bias={},
                             allowed_token_ids=None, bad_words=[])
    assert target_only_transforms(neutral) == ()


@pytest.mark.parametrize("kw, name", [
    ({"allowed_token_ids": [1, 2]}, "allowed_token_ids"),
    ({"logit_bias": {5: -100.0}}, "logit_bias"),
    ({"bad_words": ["foo"]}, "bad_words"),
    ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"frequency_penalty": -0.2}, "frequency_penalty"),
    ({"repetition_penalty": 1.1}, "repetition_penalty"),
])
def test_each_target_only_transform_is_named(kw, name):
    from vllm import SamplingParams

    assert target_only_transforms(SamplingParams(**kw)) == (name,)


def test_structured_output_and_several_at_once():
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    p = SamplingParams(structured_outputs=StructuredOutputsParams(choice=["yes", "no"]), logit_bias={1: 2.0},
                       repetition_penalty=1.2)
    found = target_only_transforms(p)
    assert found == ("logit_bias", "repetition_penalty", "structured_output")
    assert decode(encode(found)) == found and decode("") == () and decode(None) is None
    # vLLM may keep only the token ids of bad words
    assert target_only_transforms(NS(bad_words=None, _bad_words_token_ids=[[3, 4]])) == ("bad_words",)


# --- the bank --------------------------------------------------------------------------------------------

def test_capture_records_become_an_optional_column(tmp_path):
    final = [10, 11, 12, 13, 20, 21, 22, 23]
    plain = {0: [_rec(1, [20, 99, 98], 1, ngram_tokens=[20, 21, 5])]}
    _, spec, _ = build_tables(plain, {0: "chat"}, {0: final}, KEYS)
    assert "logit_transforms" not in spec.column_names  # a capture that does not record it adds nothing
    recs = [_rec(1, [20, 99, 98], 1, ngram_tokens=[20, 21, 5]), _rec(2, [22, 23], 2)]
    recs[0]["logit_transforms"], recs[1]["logit_transforms"] = ["logit_bias"], []
    acc, spec, ng = build_tables({0: recs}, {0: "chat"}, {0: final}, KEYS)
    assert spec.column("logit_transforms").to_pylist() == ["logit_bias", ""]
    assert write_bank(tmp_path / "b", acc, spec, ng) and validate(str(tmp_path / "b")) == []


def _marked_bank(tmp_path, name, marks):
    acc, spec, ng = synthetic_tables()
    col = [marks[i % len(marks)] for i in range(spec.num_rows)]
    spec = spec.append_column(pa.field("logit_transforms", pa.string()), pa.array(col, pa.string()))
    return write_bank(tmp_path / name, acc, spec, ng, manifest={"model": "synthetic-model"})


def test_validate_names_unknown_transforms(tmp_path):
    from calib.bank import BankError

    assert validate(str(_marked_bank(tmp_path, "ok", ["", None, "logit_bias,bad_words"]))) == []
    with pytest.raises(BankError, match=r"logit_transforms, row 1: names other than allowed_token_ids"):
        _marked_bank(tmp_path, "bad", ["", "magic"])


def test_training_leaves_transformed_rounds_out_by_default(tmp_path):
    bank_dir = _marked_bank(tmp_path, "b", ["", "presence_penalty", None])
    all_rounds = load(bank_dir).rounds()
    judged = load(bank_dir, judged_only=True)
    marks = np.array(all_rounds.column("logit_transforms").to_pylist(), dtype=object)
    keep = ~(marks == "presence_penalty")
    assert judged.rounds().num_rows == int(keep.sum()) < all_rounds.num_rows
    assert judged.transformed_keys().num_rows == int((~keep).sum())
    # every file is cut the same way (rows in their order), with or without a column subset
    for file in ("acceptance.parquet", "speculator.parquet", "ngram.parquet"):
        assert judged.table(file).num_rows == int(keep.sum())
    assert judged.rounds(["accept", "conf0"]).num_rows == int(keep.sum())
    assert judged.rounds().column("accept").to_pylist() == all_rounds.filter(pa.array(keep)).column("accept").to_pylist()
    # banks made before the column (the shipped ones) lose nothing
    old = write_bank(tmp_path / "old", *synthetic_tables(), manifest={"model": "synthetic-model"})
    assert load(old, judged_only=True).rounds().num_rows == load(old).rounds().num_rows


def test_train_config_key():
    from calib.config_checks import _train_constraints

    (rule,) = _train_constraints()["data.keep_logit_transforms"]
    assert rule.accepts(False) and rule.accepts(True) and not rule.accepts("yes")


# --- serving ---------------------------------------------------------------------------------------------

def test_serving_puts_vllms_drafts_back_for_requests_it_must_not_judge():
    from vllm import SamplingParams

    from calib.chains import NO_CHAIN, chain
    from calib.serve.knobs import ServeKnobs
    from calib.vllm.server import Server, keep_engine_rows

    engine = [[1, 2, 3], [4, 5], []]
    drafts, ids = [[1], [9, 9], []], torch.tensor([1, 2, NO_CHAIN], dtype=torch.int8)
    out, out_ids = keep_engine_rows(drafts, ids, engine, [False, True, True], "model")
    assert out == [[1], [4, 5], []] and out_ids.tolist() == [1, chain("model").id, NO_CHAIN]
    assert ids.tolist() == [1, 2, NO_CHAIN]  # the decision itself is not changed in place

    srv = Server(ServeKnobs(tables="unused"))
    runner = NS(requests={"a": NS(sampling_params=SamplingParams()),
                          "b": NS(sampling_params=SamplingParams(logit_bias={1: 1.0})),
                          "c": NS(sampling_params=SamplingParams(repetition_penalty=1.3))})
    assert srv.left_to_vllm(runner, ["a", "b", "c", "gone"]) == [False, True, True, False]
    srv.finished(["b"])
    assert "b" not in srv.transformed
