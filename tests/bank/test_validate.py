"""Validator: a valid synthetic bank passes; each kind of damage is caught and located."""

import json

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from calib.bank import BankError, validate, write_bank
from calib.bank.__main__ import main as cli
from tests.synthetic import synthetic_tables


@pytest.fixture
def bank(tmp_path):
    return write_bank(tmp_path / "bank", *synthetic_tables(), manifest={"model": "synthetic-model"})


def _set(table: pa.Table, column: str, row: int, value, typ=None) -> pa.Table:
    vals = table.column(column).to_pylist()
    vals[row] = value
    i = table.column_names.index(column)
    return table.set_column(i, table.schema.field(column).with_type(typ or table.schema.field(column).type),
                            pa.array(vals, type=typ or table.schema.field(column).type))


def _rewrite(bank, file, table):
    pq.write_table(table, bank / file)
    (bank / "stats.json").unlink(missing_ok=True)  # stats are checked separately


def _problems(bank):
    return [str(p) for p in validate(str(bank))]


def test_valid_bank_passes(bank):
    assert validate(str(bank)) == []
    assert cli(["validate", str(bank)]) == 0


def test_empty_bank_rejected(tmp_path):
    acc, spec, _ = synthetic_tables(n_prompts=1, rounds_per_prompt=1)
    d = tmp_path / "b"
    d.mkdir()
    pq.write_table(acc.slice(0, 0), d / "acceptance.parquet")
    pq.write_table(spec.slice(0, 0), d / "speculator.parquet")
    assert any("empty bank" in p for p in _problems(d))
    assert cli(["validate", str(d)]) == 1


def test_missing_file(bank):
    (bank / "speculator.parquet").unlink()
    assert any("speculator.parquet" in p and "missing file" in p for p in _problems(bank))


def test_missing_column(bank):
    t = pq.read_table(bank / "acceptance.parquet").drop_columns(["accept"])
    _rewrite(bank, "acceptance.parquet", t)
    assert any("column accept" in p and "missing column" in p for p in _problems(bank))


def test_wrong_dtype(bank):
    t = pq.read_table(bank / "acceptance.parquet")
    t = t.set_column(t.column_names.index("prompt_idx"), "prompt_idx", pc.cast(t.column("prompt_idx"), pa.int32()))
    _rewrite(bank, "acceptance.parquet", t)
    assert any("column prompt_idx" in p and "dtype is int32" in p for p in _problems(bank))


def test_duplicate_keys(bank):
    t = pq.read_table(bank / "acceptance.parquet")
    _rewrite(bank, "acceptance.parquet", pa.concat_tables([t, t.slice(3, 1)]))
    probs = _problems(bank)
    assert any("duplicate key" in p and f"row {t.num_rows}" in p for p in probs), probs


def test_row_without_partner(bank):
    t = pq.read_table(bank / "speculator.parquet")
    _rewrite(bank, "speculator.parquet", t.slice(1))
    probs = _problems(bank)
    assert any("acceptance.parquet" in p and "row 0" in p and "no partner" in p for p in probs), probs


def test_manifest_mismatch(bank):
    m = json.loads((bank / "run_manifest.json").read_text())
    m["n_rounds"] += 1
    (bank / "run_manifest.json").write_text(json.dumps(m))
    assert any("run_manifest.json" in p and "n_rounds" in p for p in _problems(bank))


def test_stats_mismatch(bank):
    s = json.loads((bank / "stats.json").read_text())
    s["mean_accept"] += 0.5
    (bank / "stats.json").write_text(json.dumps(s))
    assert any("stats.json" in p and "mean_accept" in p for p in _problems(bank))


# -- content damage, generated: each must be reported at the damaged row and column ---------------
DAMAGE = st.sampled_from(["conf_nan", "conf_inf", "conf_range", "accept_neg", "accept_wide",
                          "acc_gap", "acc_disagree", "acc_value", "conf_undrafted"])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(kind=DAMAGE, row_seed=st.integers(0, 10_000), seed=st.integers(0, 50))
def test_generated_damage_is_located(tmp_path_factory, kind, row_seed, seed):
    acc, spec, _ = synthetic_tables(seed=seed)
    n, width = acc.num_rows, 4
    row = row_seed % n
    accept = acc.column("accept")[row].as_py()
    drafted = sum(acc.column(f"acc{k}")[row].as_py() is not None for k in range(width))
    if kind == "conf_nan":
        spec, col = _set(spec, "conf0", row, float("nan")), "conf0"
    elif kind == "conf_inf":
        spec, col = _set(spec, "conf0", row, float("inf")), "conf0"
    elif kind == "conf_range":
        spec, col = _set(spec, "conf0", row, 1.5), "conf0"
    elif kind == "accept_neg":
        acc, col = _set(acc, "accept", row, -1), "accept"
    elif kind == "accept_wide":
        acc, col = _set(acc, "accept", row, drafted + 1), "accept"
    elif kind == "acc_gap":
        acc = _set(acc, "acc0", row, None)  # a hole at depth 0 ...
        if drafted == 1:
            acc = _set(acc, "acc1", row, 0)  # ... followed by a drafted depth
        col = "acc1"
    elif kind == "acc_disagree":
        k = 0
        acc, col = _set(acc, f"acc{k}", row, 0 if accept > 0 else 1), f"acc{k}"
    elif kind == "acc_value":
        acc, col = _set(acc, "acc0", row, 7), "acc0"
    else:  # conf_undrafted
        if drafted == width:
            acc = _set(acc, "acc3", row, None)
            acc = _set(acc, "accept", row, min(accept, 3))
            for k in range(3):
                acc = _set(acc, f"acc{k}", row, 1 if k < min(accept, 3) else 0)
        spec, col = _set(spec, "conf3", row, 0.5), "conf3"
    d = tmp_path_factory.mktemp("bank")
    pq.write_table(acc, d / "acceptance.parquet")
    pq.write_table(spec, d / "speculator.parquet")
    probs = validate(str(d))
    assert probs, f"{kind} at row {row} not detected"
    assert any(p.row == row and (col is None or p.column == col) for p in probs), (kind, row, [str(p) for p in probs])


def test_ngram_damage(bank):
    t = pq.read_table(bank / "ngram.parquet")
    labelled = [i for i, s in enumerate(t.column("label_source").to_pylist()) if s == "counterfactual"]
    i = labelled[0]
    n = t.column("ngram_len")[i].as_py()
    _rewrite(bank, "ngram.parquet", _set(t, "accept", i, n + 1))
    probs = _problems(bank)
    assert any("ngram.parquet" in p and f"row {i}" in p for p in probs), probs


def test_routing_files_checked(bank):
    acc = pq.read_table(bank / "acceptance.parquet")
    np.save(bank / "routing.npy", np.zeros((3, 2, 2), dtype=np.uint8))
    meta = acc.slice(0, 3).select(["model", "speculator", "config", "category", "prompt_idx", "turn", "round_idx"])
    for name, vals, typ in [("routing_idx", [0, 1, 5], pa.int64()), ("routing_block_idx", [0, 0, 0], pa.int64()),
                            ("request_idx", [0, 0, 0], pa.int64()), ("position", [1, 2, 3], pa.int64()),
                            ("accepted", [True, True, False], pa.bool_())]:
        meta = meta.append_column(pa.field(name, typ), pa.array(vals, type=typ))
    pq.write_table(meta, bank / "routing_meta.parquet")
    probs = _problems(bank)
    assert any("routing_meta.parquet" in p and "routing_idx" in p and "row 2" in p for p in probs), probs


def test_bank_error_names_file_column_row(tmp_path):
    acc, spec, ng = synthetic_tables()
    acc = _set(acc, "accept", 2, -3)
    with pytest.raises(BankError, match=r"acceptance.parquet, column accept, row 2"):
        write_bank(tmp_path / "bad", acc, spec, ng)
    assert not (tmp_path / "bad").exists()  # nothing half-written
    assert not list(tmp_path.iterdir())
