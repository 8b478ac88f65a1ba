"""What train.py hands the tracker (issue 43 Must 6): its banks declared as input, both chains' headline metrics,
each table once. SYNTHETIC metadata, a recording tracker."""

from __future__ import annotations

from calib.training_report import _log, wandb_note


class Recorder:
    def __init__(self):
        self.scalars, self.tables, self.inputs, self.outputs = {}, [], [], []

    def log(self, values):
        self.scalars.update(values)

    def log_table(self, key, rows):
        self.tables.append(key)

    def log_image(self, key, path):
        pass

    def use_artifact(self, name, kind, paths, metadata=None):
        self.inputs.append((name, kind, [str(p) for p in paths]))

    def log_artifact(self, name, kind, paths, metadata=None):
        self.outputs.append((name, kind))


def test_train_declares_its_banks_and_logs_both_chains_headlines_once(tmp_path):
    bank = tmp_path / "bank"
    bank.mkdir()
    rows = [{"depth": 0, "n": 10, "cal_ece": 0.03}, {"depth": "all", "n": 12, "cal_ece": 0.02, "raw_ece": 0.04}]
    meta = {"banks": [{"path": str(bank)}, {"path": str(tmp_path / "gone")}],
            "chains": {"model": {"val": rows, "test": rows},
                       "ngram": {"test": {"model": {"ece": 0.030, "brier": 0.12}, "table": {"ece": 0.028}}}}}
    rec = Recorder()
    _log(rec, tmp_path, meta, per_depth=[{"depth": 0}], fit_rows=[], reports={})
    assert rec.inputs == [("calib-banks", "bank", [str(bank)])]  # a bank path that no longer exists is not declared
    assert rec.scalars["model/test/cal_ece"] == 0.02 and rec.scalars["model/val/raw_ece"] == 0.04
    assert rec.scalars["ngram/test/model/ece"] == 0.030 and rec.scalars["ngram/test/table/ece"] == 0.028
    assert sorted(rec.tables) == ["fit", "model_test_per_depth", "model_val_per_depth"]  # each once
    assert rec.outputs == [("calib-tables", "tables")]


def test_wandb_note_names_the_sync_and_then_declare_inputs(tmp_path):
    """After an offline run, train says how to sync it and then declare its banks (as eval does its tables)."""
    assert wandb_note(tmp_path) == ""  # no offline run (logger=csv, or online): nothing to sync or declare
    run = tmp_path / "wandb" / "offline-run-20261205_000000-abc"
    run.mkdir(parents=True)
    note = wandb_note(tmp_path).splitlines()
    assert note[1:] == [f"W&B offline run published with the outputs: wandb sync {run}",
                        f"then: python -m calib.tracking declare-inputs {tmp_path} (the input banks' lineage edge)"]
