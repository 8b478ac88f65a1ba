"""Routing captures in the public layout: writer, reader, validation findings (SYNTHETIC banks)."""

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from calib.bank import BankError, read_routing, validate, write_bank
from calib.bank.__main__ import main as cli
from calib.cost.trajectories import Trajectories
from tests.synthetic import synthetic_tables

E, K, LAYERS = 8, 2, 3


def _routing_for(acc: pa.Table, seed=0):
    """SYNTHETIC routing for every verified position of every round: block = 1 + drafted positions."""
    rng = np.random.default_rng(seed)
    keys = ["model", "speculator", "config", "category", "prompt_idx", "turn", "round_idx"]
    accept = acc.column("accept").to_pylist()
    drafted = [sum(acc.column(f"acc{k}")[i].as_py() is not None for k in range(4)) for i in range(acc.num_rows)]
    rows, next_pos = [], {}
    order = sorted(range(acc.num_rows), key=lambda i: (acc.column("prompt_idx")[i].as_py(),
                                                        acc.column("round_idx")[i].as_py()))
    for i in order:
        p = acc.column("prompt_idx")[i].as_py()
        start = next_pos.get(p, 10)
        for j in range(drafted[i] + 1):
            rows.append({**{k: acc.column(k)[i].as_py() for k in keys}, "routing_idx": len(rows),
                         "routing_block_idx": j, "request_idx": p, "position": start + j,
                         "accepted": j <= accept[i]})
        next_pos[p] = start + accept[i] + 1
    experts = np.argsort(rng.random((len(rows), LAYERS, E)), axis=2)[..., :K].astype(np.uint8)
    types = {**{k: acc.schema.field(k).type for k in keys}, "routing_idx": pa.int64(),
             "routing_block_idx": pa.int64(), "request_idx": pa.int64(), "position": pa.int64(),
             "accepted": pa.bool_()}
    meta = pa.table({c: [r[c] for r in rows] for c in types}, schema=pa.schema(list(types.items())))
    return experts, meta


@pytest.fixture
def rbank(tmp_path):
    acc, spec, _ = synthetic_tables(with_ngram=False)
    experts, meta = _routing_for(acc)
    info = {"n_experts": E, "top_k": K, "layers": LAYERS, "proxy": True, "source": "synthetic"}
    return write_bank(tmp_path / "bank", acc, spec, manifest={"routing": info}, routing=(experts, meta))


def _problems(bank):
    return [str(p) for p in validate(str(bank))]


def _edit_meta(bank, column, row, value):
    t = pq.read_table(bank / "routing_meta.parquet")
    vals = t.column(column).to_pylist()
    vals[row] = value
    t = t.set_column(t.column_names.index(column), t.schema.field(column), pa.array(vals, t.schema.field(column).type))
    pq.write_table(t, bank / "routing_meta.parquet")


def test_valid_routing_bank_passes_and_reads(rbank):
    assert validate(str(rbank)) == []
    assert cli(["validate", str(rbank)]) == 0
    rt = read_routing(rbank)
    assert rt.experts.shape[1:] == (LAYERS, K) and rt.n_experts == E and rt.info["proxy"] is True
    tr = Trajectories.from_bank(rbank)
    assert len(tr) == 4 and tr.seqs[0].shape[1:] == (LAYERS, E)
    assert all(s.sum(axis=2).min() == K for s in tr.seqs)  # k experts per position and layer
    np.testing.assert_allclose(tr.marginals().sum(axis=1), K)


def test_repeated_expert_in_topk(rbank):
    arr = np.load(rbank / "routing.npy")
    arr[5, 1] = [3, 3]
    np.save(rbank / "routing.npy", arr)
    probs = _problems(rbank)
    assert any("routing.npy" in p and "layer 1" in p and "row 5" in p for p in probs), probs


def test_expert_id_beyond_manifest(rbank):
    arr = np.load(rbank / "routing.npy")
    arr[2, 0] = [E, 0]
    np.save(rbank / "routing.npy", arr)
    probs = _problems(rbank)
    assert any("routing.npy" in p and "row 2" in p and "n_experts" in p for p in probs), probs


def test_shape_disagrees_with_manifest(rbank):
    m = json.loads((rbank / "run_manifest.json").read_text())
    m["routing"]["top_k"] = 4
    (rbank / "run_manifest.json").write_text(json.dumps(m))
    assert any("routing.top_k" in p for p in _problems(rbank))


def test_wrong_dtype_of_routing_array(rbank):
    np.save(rbank / "routing.npy", np.load(rbank / "routing.npy").astype(np.int64))
    assert any("expected uint8" in p for p in _problems(rbank))


def test_accepted_must_be_a_prefix_matching_accept(rbank):
    meta = pq.read_table(rbank / "routing_meta.parquet")
    blocks = meta.column("routing_block_idx").to_pylist()
    acc = meta.column("accepted").to_pylist()
    row = next(i for i in range(len(blocks)) if blocks[i] > 0 and not acc[i])  # a rejected draft position
    _edit_meta(rbank, "accepted", row, True)
    probs = _problems(rbank)
    assert any("routing_meta.parquet" in p and "accepted" in p for p in probs), probs


def test_positions_must_follow_block_index(rbank):
    _edit_meta(rbank, "position", 1, 999)
    probs = _problems(rbank)
    assert any("column position" in p and "block start" in p for p in probs), probs


def test_block_index_beyond_drafted_width(rbank):
    _edit_meta(rbank, "routing_block_idx", 0, 9)
    probs = _problems(rbank)
    assert any("routing_block_idx" in p and "row 0" in p for p in probs), probs


def test_meta_rows_must_cover_the_array(rbank):
    arr = np.load(rbank / "routing.npy")
    np.save(rbank / "routing.npy", np.concatenate([arr, arr[:1]]))
    assert any("every routing row needs exactly one meta row" in p for p in _problems(rbank))


def test_null_and_orphan_meta_rows(rbank):
    _edit_meta(rbank, "request_idx", 3, None)
    assert any("column request_idx, row 3" in p and "null" in p for p in _problems(rbank))


def test_reader_refuses_invalid_capture(rbank):
    _edit_meta(rbank, "routing_idx", 0, 10_000)
    with pytest.raises(BankError, match="routing_idx"):
        read_routing(rbank)
