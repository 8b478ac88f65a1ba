"""Banks from a fleet (calib/bank/fleet.py): replicas listed together and validated as one.
The banks here are SYNTHETIC (tests/synthetic.py), shaped to each case."""

from __future__ import annotations

import shutil

import pyarrow as pa
import pyarrow.compute as pc
import pytest

from calib.bank import write_bank
from calib.bank.fleet import FleetError, bank_parts, check_disjoint_parts, fleets
from calib.bank.io import DuplicateBankWarning, OverlappingBanksError
from tests.synthetic import synthetic_tables

MANIFEST = {"model": "synthetic-model", "speculator": "synthetic", "config": "synthetic-k4", "method": "eagle",
            "num_speculative_tokens": 4}


def _shift(table, column, by):
    if table is None:
        return None
    i = table.column_names.index(column)
    return table.set_column(i, column, pc.add(table.column(column), pa.scalar(by, table.schema.field(column).type)))


def _replica(path, prompt_offset=0, round_offset=0, width=4, manifest=None, seed=0):
    acc, spec, ng = synthetic_tables(n_prompts=6, rounds_per_prompt=5, width=width, seed=seed)
    tables = [_shift(_shift(t, "prompt_idx", prompt_offset), "round_idx", round_offset) for t in (acc, spec, ng)]
    if manifest is False:  # no run_manifest.json at all
        return write_bank(path, *tables)
    return write_bank(path, *tables, manifest={**MANIFEST, **(manifest or {})})


def test_a_fleet_of_disjoint_replicas_is_listed_part_by_part(tmp_path):
    a = _replica(tmp_path / "fleet" / "replica-0")
    b = _replica(tmp_path / "fleet" / "replica-1", prompt_offset=100)
    single = _replica(tmp_path / "other", prompt_offset=200, manifest={"method": "eagle3"})
    assert fleets([tmp_path / "fleet", single]) == [[a, b], [single]]
    assert bank_parts([tmp_path / "fleet", single]) == [a, b, single]  # a lone bank is not held to the fleet's


def test_a_request_split_between_replicas_at_different_rounds_is_no_overlap(tmp_path):
    a = _replica(tmp_path / "fleet" / "r0")
    b = _replica(tmp_path / "fleet" / "r1", round_offset=5)  # the same requests' later rounds
    assert bank_parts([tmp_path / "fleet"]) == [a, b]


def test_shared_round_keys_are_refused_naming_both_parts_and_the_key(tmp_path):
    a = _replica(tmp_path / "fleet" / "r0")
    b = _replica(tmp_path / "fleet" / "r1", round_offset=3, seed=1)  # rounds 3 and 4 of every request twice
    with pytest.raises(OverlappingBanksError) as exc:
        bank_parts([tmp_path / "fleet"])
    msg = str(exc.value)
    assert str(a) in msg and str(b) in msg and "round_idx=3" in msg and "prompt_idx=0" in msg
    with pytest.raises(OverlappingBanksError):
        check_disjoint_parts([b, a])


@pytest.mark.parametrize(("change", "field"), [
    ({"width": 3, "manifest": False}, "drafted width K (acc columns): 4 vs 3"),
    ({"manifest": {"identity": {"target": {"architecture": "LlamaForCausalLM", "config_sha256": "a" * 64,
                                           "weights_sha256": "b" * 64}, "drafter": None}}}, "'identity'"),
    ({"manifest": {"method": "eagle3"}}, "'method'"),
])
def test_replicas_that_measured_something_else_are_refused_by_name(tmp_path, change, field):
    a = _replica(tmp_path / "fleet" / "r0", manifest=change.get("manifest") if change.get("manifest") is False else None)
    b = _replica(tmp_path / "fleet" / "r1", prompt_offset=100, **change)
    with pytest.raises(FleetError) as exc:
        bank_parts([tmp_path / "fleet"])
    msg = str(exc.value)
    assert str(a) in msg and str(b) in msg and field in msg


def test_a_replica_listed_twice_or_copied_is_counted_once(tmp_path):
    a = _replica(tmp_path / "fleet" / "r0")
    b = _replica(tmp_path / "fleet" / "r1", prompt_offset=100)
    copy = tmp_path / "copy-of-r1"
    shutil.copytree(b, copy)
    with pytest.warns(DuplicateBankWarning, match="is a copy"):
        parts = bank_parts([tmp_path / "fleet", a, copy])
    assert parts == [a, b]
