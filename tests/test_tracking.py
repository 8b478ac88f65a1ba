"""Lineage a team can follow (issue 43, Must 6): an input folder (a bank) is declared by reference, an offline
run records every input with its digest, and ``python -m calib.tracking declare-inputs`` declares them on the
synced run, refusing inputs that changed since. No W&B server is reachable here: the offline runs are real, the
online side is a recording stand-in for the ``wandb`` module around W&B's own Artifact."""

from __future__ import annotations

from pathlib import Path

import pytest

from calib import tracking


@pytest.fixture
def inputs(tmp_path):
    bank = tmp_path / "bank"
    bank.mkdir()
    (bank / "acceptance.parquet").write_bytes(b"PAR1 rounds")
    (bank / "run_manifest.json").write_text("{}")
    tables = tmp_path / "tables.json"
    tables.write_text('{"version": 1}')
    return bank, tables


def _offline_run(tmp_path, monkeypatch, inputs) -> Path:
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    bank, tables = inputs
    out = tmp_path / "out"
    out.mkdir()
    t = tracking.WandbTracker("team-x", out, {}, "train", mode="offline")
    try:
        t.use_artifact("calib-banks", "bank", [bank])
        t.use_artifact("calib-tables", "tables", [tables])
    finally:
        t.finish()
    return out


class FakeWandb:
    """The ``wandb`` module as declare_inputs uses it: init (resuming a run) and the real Artifact."""

    def __init__(self):
        import wandb

        self.Artifact, self.inits, self.used, self.finished = wandb.Artifact, [], [], 0

    def init(self, **kw):
        self.inits.append(kw)
        return self

    def use_artifact(self, art):
        self.used.append(art)

    def finish(self):
        self.finished += 1


def test_an_offline_run_records_each_input_and_declare_inputs_declares_them(tmp_path, monkeypatch, inputs):
    out = _offline_run(tmp_path, monkeypatch, inputs)
    (run_dir,) = tracking.offline_runs(out)
    record = tracking.recorded_inputs(run_dir)
    recorded = record["inputs"]
    assert set(recorded) == {"calib-banks", "calib-tables"} and record["project"] == "team-x"
    assert recorded["calib-banks"]["sha256"] == tracking.content_digest([inputs[0]])
    fake = FakeWandb()
    assert tracking.declare_inputs(out, wandb=fake) == {str(run_dir): ["calib-banks", "calib-tables"]}
    (init,) = fake.inits
    assert init["id"] == run_dir.name.rsplit("-", 1)[1] and init["resume"] == "must" and init["project"] == "team-x"
    arts = {a.name: a for a in fake.used}
    assert arts["calib-banks"].type == "bank" and arts["calib-tables"].type == "tables"
    bank = arts["calib-banks"].manifest.entries  # the bank by reference, checksummed where it lies, not uploaded
    assert sorted(bank) == ["bank/acceptance.parquet", "bank/run_manifest.json"]
    assert all(e.ref and e.ref.startswith("file://") for e in bank.values())
    assert set(arts["calib-tables"].manifest.entries) == {"tables.json"} and fake.finished == 1


def test_an_input_changed_since_the_run_is_not_declared(tmp_path, monkeypatch, inputs):
    out = _offline_run(tmp_path, monkeypatch, inputs)
    (inputs[0] / "acceptance.parquet").write_bytes(b"PAR1 other rounds")
    fake = FakeWandb()
    with pytest.raises(ValueError, match=r"input 'calib-banks' \(bank\) recorded sha256 [0-9a-f]{12}\.\.\., its files "
                                         r".* now hold [0-9a-f]{12}\.\.\.: they changed since the run"):
        tracking.declare_inputs(out, wandb=fake)
    assert fake.inits == []


def test_the_command_names_a_folder_without_runs(tmp_path, capsys):
    assert tracking.main(["declare-inputs", str(tmp_path)]) == 1
    assert f"{tmp_path}: no W&B offline run here" in capsys.readouterr().err
