"""Bank IO: round trip, unions of different widths, pandas/datasets views, public-layout readers."""

import json

import pyarrow.parquet as pq
import pytest

from calib.bank import Bank, load, write_bank
from calib.bank.__main__ import main as cli
from calib.chains import chain
from tests.synthetic import synthetic_tables


def test_round_trip_and_public_reader(tmp_path):
    acc, spec, ng = synthetic_tables()
    bank = write_bank(tmp_path / "b", acc, spec, ng, manifest={"model": "synthetic-model"})
    # A reader that knows only the public layout: plain parquet + json, same keys and dtypes.
    a = pq.read_table(bank / "acceptance.parquet")
    assert a.schema.field("acc0").type == "int8" and a.schema.field("turn").type == "int16"
    assert a.num_rows == acc.num_rows
    stats = json.loads((bank / "stats.json").read_text())
    assert stats["n_rounds"] == acc.num_rows
    assert sum(stats["accept_hist"].values()) == acc.num_rows


def test_refuses_to_overwrite(tmp_path):
    tables = synthetic_tables()
    write_bank(tmp_path / "b", *tables)
    with pytest.raises(FileExistsError):
        write_bank(tmp_path / "b", *tables)


def test_union_of_widths_is_null_padded(tmp_path):
    b4 = write_bank(tmp_path / "w4", *synthetic_tables(width=4, speculator="a"))
    b8 = write_bank(tmp_path / "w8", *synthetic_tables(width=8, speculator="b", seed=1))
    bank = load([b4, b8])
    acc = bank.table("acceptance.parquet")
    assert "acc7" in acc.column_names
    n4 = pq.read_metadata(b4 / "acceptance.parquet").num_rows
    assert acc.column("acc7").slice(0, n4).null_count == n4
    # A folder holding bank folders works too.
    assert len(load(tmp_path).paths) == 2
    rounds = bank.rounds(chains=[chain("ngram")])
    assert rounds.num_rows == acc.num_rows and "ng_ngram_len" in rounds.column_names


def test_pandas_and_dataset_views(tmp_path):
    write_bank(tmp_path / "b", *synthetic_tables())
    bank = Bank(tmp_path / "b")
    df = bank.to_pandas(columns=["category", "accept", "acc0"])
    assert str(df["category"].dtype) == "category"
    ds = bank.to_dataset(columns=["accept", "conf0"])
    assert len(ds) == len(df) and "conf0" in ds.column_names


def test_manifest_and_stats_optional(tmp_path):
    b = write_bank(tmp_path / "b", *synthetic_tables())
    (b / "stats.json").unlink()
    assert cli(["validate", str(b)]) == 0


def test_not_a_bank(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a bank"):
        load(tmp_path)
    assert cli(["validate", str(tmp_path)]) == 1


def test_rounds_reuses_the_full_join_and_sees_rewritten_files(tmp_path):
    b4 = write_bank(tmp_path / "w4", *synthetic_tables(width=4, speculator="a"))
    b8 = write_bank(tmp_path / "w8", *synthetic_tables(width=8, speculator="b", seed=1))
    fresh = [load([b4, b8]).rounds(columns=c) for c in (["accept"], ["accept", "conf1", "acc0"], None)]
    bank = load([b4, b8])
    full = bank.rounds()
    assert full.equals(fresh[2])
    assert bank.rounds() is full  # kept
    for cols, ref in zip((["accept"], ["accept", "conf1", "acc0"]), fresh):
        got = bank.rounds(columns=cols)
        assert got.column_names == ref.column_names and got.equals(ref)
    with pytest.raises(KeyError):
        bank.rounds(columns=["no_such_column"])
    assert bank.rounds(chains=[chain("ngram")]).equals(load([b4, b8]).rounds(chains=[chain("ngram")]))
    write_bank(b4, *synthetic_tables(width=4, speculator="a", seed=5), overwrite=True)  # files change
    again = bank.rounds()
    assert again is not full and again.equals(load([b4, b8]).rounds())


def test_fingerprint_is_the_tables_identity(tmp_path):
    """calib.bank.io.fingerprint (deduplication) and tables.json's acceptance_sha256 are one digest."""
    from calib.bank.io import fingerprint
    from calib.tables.io import bank_fingerprint

    b = write_bank(tmp_path / "b", *synthetic_tables())
    other = write_bank(tmp_path / "o", *synthetic_tables(seed=3))
    assert fingerprint(b) == bank_fingerprint(b) != fingerprint(other)
