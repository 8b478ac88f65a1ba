"""train.py through Hydra's compose API on a tiny SYNTHETIC bank (fast candidates only)."""

import re
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from calib.bank import write_bank
from calib.tables import load
from calib.training import run
from tests.synthetic import synthetic_tables

CONF = str(Path(__file__).resolve().parents[1] / "conf")


def test_train_entry_point(tmp_path):
    bank = write_bank(tmp_path / "bank", *synthetic_tables(n_prompts=40, rounds_per_prompt=30))
    with initialize_config_dir(CONF, version_base="1.3"):
        cfg = compose("train", overrides=[f"data.train=[{bank}]", f"out_dir={tmp_path / 'out'}", "logger=csv",
                                          "calibrator=isotonic", "ngram_model=logistic", "trainer.progress=false"])
    out = run(OmegaConf.to_container(cfg, resolve=True))
    tables = load(out)
    assert tables.has_chain("model") and tables.has_chain("ngram")
    model = tables.meta["chains"]["model"]
    # identity (the raw confidence) is always the baseline; the synthetic confidences carry no signal, so
    # isotonic pays by far more than one SE wherever a cell and depth hold enough prompts
    assert model["selection"]["baseline"] == "identity" and model["selection"]["groups"] == "prompt"
    assert "isotonic" in model["estimator"].split("|") and set(model["estimator"].split("|")) <= {"identity", "isotonic"}
    assert all(per_depth["0"] == "isotonic" for per_depth in model["choice"].values())  # depth 0: most rows
    assert model["cv_nll"]["isotonic"] < model["cv_nll"]["identity"] - 0.1
    assert set(model["params"]) == {"identity", "isotonic"} and "val_nll" not in model
    # the configured match features, then the context axes (conf/context/default.yaml: temperature always,
    # the optional ones where grouped CV kept them)
    n_feats = len(cfg.ngram_model.table.features)
    assert tables.feature_names("ngram")[:n_feats + 1] == [*cfg.ngram_model.table.features, "temperature"]
    optional = list(cfg.context.candidates)  # kept (in this order) where grouped-CV NLL drops by > one SE
    assert tables.feature_names("ngram")[n_feats + 1:] == [n for n in optional if n in tables.feature_names("ngram")]
    assert tables.feature_names("model")[:2] == ["conf", "temperature"]
    trials = model["context_trials"]  # each optional axis' grouped-CV NLLs, tried on isotonic
    assert set(trials) == set(optional) and {"cv_nll_without", "cv_nll_with", "se"} <= set(trials["mean_accept"])
    for name, t in trials.items():  # kept exactly where the gain exceeds one SE
        assert (name in tables.feature_names("model")) == (t["cv_nll_without"] - t["cv_nll_with"] > t["se"])
    assert (out / "reliability_test.png").exists() and (out / "csv" / "fit.csv").exists()
    fit_rows = (out / "csv" / "fit.csv").read_text().splitlines()
    assert fit_rows[0] == "drafter,candidate,cv_nll,chosen" and "model,isotonic," in (out / "csv" / "fit.csv").read_text()
    summary = (out / "summary.txt").read_text()
    assert "ECE raw" in summary and "5-fold CV grouped by prompt (one_se rule, baseline identity)" in summary


def test_train_config_groups_compose():
    with initialize_config_dir(CONF, version_base="1.3"):
        for group in ("auto", "temperature", "isotonic", "histogram", "identity"):
            cfg = compose("train", overrides=[f"calibrator={group}", "out_dir=x"])
            assert cfg.calibrator.candidates
        for group in ("auto", "logistic", "hgb", "mlp"):
            assert compose("train", overrides=[f"ngram_model={group}", "out_dir=x"]).ngram_model.table.features


def test_train_with_extra_inputs_exports_a_marginal_table(tmp_path):
    bank = write_bank(tmp_path / "bank", *synthetic_tables(n_prompts=40, rounds_per_prompt=30, extras=True))
    with initialize_config_dir(CONF, version_base="1.3"):
        cfg = compose("train", overrides=[f"data.train=[{bank}]", f"out_dir={tmp_path / 'out'}", "logger=none",
                                          "calibrator=temperature", "calibrator.extra=[entropy,margin]",
                                          "ngram_model=logistic", "trainer.progress=false", "trainer.max_epochs=5"])
    tables = load(run(OmegaConf.to_container(cfg, resolve=True)))
    table = tables.chains["model"]
    grid = table.grid.reshape(table.depths, -1, table.points)  # [D, context cells, G]
    assert not grid.isnan().any() and (grid.diff(dim=2) >= 0).all()  # monotone in confidence per cell


# --- a run owns its out_dir: refusal, staging, one-unit publishing (issue 12 item 4) ------------------

FAST = ["logger=none", "ngram_model=logistic", "trainer.progress=false"]


def _compose(bank, out, *overrides):
    with initialize_config_dir(CONF, version_base="1.3"):
        cfg = compose("train", overrides=[f"data.train=[{bank}]", f"out_dir={out}", *FAST, *overrides])
    return OmegaConf.to_container(cfg, resolve=True)


def _snapshot(folder: Path) -> dict:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def small_bank(tmp_path_factory):
    return write_bank(tmp_path_factory.mktemp("bank") / "bank", *synthetic_tables(n_prompts=30, rounds_per_prompt=20))


def test_existing_tables_are_replaced_only_with_overwrite(tmp_path, small_bank):
    out = tmp_path / "out"
    run(_compose(small_bank, out, "calibrator=isotonic"))
    before = _snapshot(out)
    with pytest.raises(FileExistsError, match=r"already holds an earlier train.py output; pass overwrite=true"):
        run(_compose(small_bank, out, "calibrator=histogram"))
    assert _snapshot(out) == before
    run(_compose(small_bank, out, "calibrator=histogram", "overwrite=true"))
    assert "histogram" in load(out).meta["chains"]["model"]["estimator"].split("|")
    assert "histogram" in (out / "config.yaml").read_text() and re.search(
        r"grouped CV \(5 folds, one_se\): chosen per depth .*'histogram'", (out / "train.log").read_text())
    # A folder that is not a train.py output is never replaced as a whole, overwrite or not.
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match=r"holds files calib did not write: notes.txt"):
        run(_compose(small_bank, foreign, "calibrator=isotonic", "overwrite=true"))
    assert (foreign / "notes.txt").read_text() == "keep me"
    # Nor is a train.py output that a user has since added to (the lost notes and bank).
    (out / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match=r"holds files calib did not write: notes.txt"):
        run(_compose(small_bank, out, "calibrator=isotonic", "overwrite=true"))
    assert (out / "notes.txt").read_text() == "mine"


def test_failed_run_leaves_previous_out_dir_untouched(tmp_path, small_bank, monkeypatch):
    out = tmp_path / "out"
    run(_compose(small_bank, out, "calibrator=isotonic"))
    before = _snapshot(out)

    def boom(*a, **k):
        raise RuntimeError("picture failed")

    import calib.presentation

    monkeypatch.setattr(calib.presentation, "reliability_figure", boom)  # after the tables are saved
    with pytest.raises(RuntimeError, match="picture failed"):
        run(_compose(small_bank, out, "calibrator=histogram", "overwrite=true"))
    assert _snapshot(out) == before  # was: new tables beside the old summary and picture
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no staging folder left behind


KILL = r'''
import json, os, sys
import calib.atomic, calib.tables.io
from calib.training import run

point, cfg = sys.argv[1], json.loads(sys.argv[2])
real_replace, real_exchange = os.replace, calib.atomic._exchange

def replace(src, dst):
    if point == "tables_json" and str(dst).endswith("tables.json"):
        os._exit(9)  # the tensor file is already in place, the JSON is not
    return real_replace(src, dst)

def exchange(a, b):
    if point == "before_swap":
        os._exit(9)
    ok = real_exchange(a, b)
    if point == "after_swap":
        os._exit(9)
    return ok

def figure(*a, **k):
    os._exit(9)

os.replace = replace
calib.atomic._exchange = exchange
if point == "picture":
    import calib.presentation
    calib.presentation.reliability_figure = figure
run(cfg)
'''


@pytest.mark.parametrize("point,expect", [("tables_json", "isotonic"), ("picture", "isotonic"),
                                          ("before_swap", "isotonic"), ("after_swap", "histogram")])
def test_kill_during_save_leaves_old_or_new_set(tmp_path, small_bank, point, expect):
    """A kill at any moment of the export leaves the old set (tables, summary, picture) or the new one."""
    import json
    import subprocess
    import sys

    out = tmp_path / "out"
    run(_compose(small_bank, out, "calibrator=isotonic"))
    cfg = _compose(small_bank, out, "calibrator=histogram", "overwrite=true")
    proc = subprocess.run([sys.executable, "-c", KILL, point, json.dumps(cfg)], cwd=str(Path(CONF).parent),
                          capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 9, proc.stderr[-2000:]
    tables = load(out)  # a consistent pair (was: new tensors beside the old JSON -> checksum error)
    other = {"isotonic": "histogram", "histogram": "isotonic"}[expect]
    chosen = tables.meta["chains"]["model"]["estimator"].split("|")  # beside the identity baseline
    assert expect in chosen and other not in chosen
    summary = (out / "summary.txt").read_text()
    assert f"d0 {expect}" in summary and other not in summary
    assert f"name: {expect}" in (out / "config.yaml").read_text()
    assert (out / "reliability_test.png").exists()
    assert not list(out.glob(".tables*"))


def test_train_py_writes_only_into_its_out_dir(tmp_path, small_bank):
    """train.py as a subprocess: config and log go into out_dir; Hydra writes no .hydra/ or log anywhere;
    a second run into the same out_dir is refused; artifacts are 0644 / 0755."""
    import subprocess
    import sys

    root = Path(CONF).parent
    out = tmp_path / "out"
    cmd = [sys.executable, str(root / "train.py"), f"data.train=[{small_bank}]", f"out_dir={out}",
           "calibrator=isotonic", *FAST]
    proc = subprocess.run(["bash", "-c", 'umask 022 && exec "$@"', "_", *cmd], cwd=tmp_path, capture_output=True,
                          text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert {"tables.json", "tables.safetensors", "summary.txt", "reliability_test.png", "config.yaml",
            "train.log"} <= {p.name for p in out.iterdir()}
    assert re.search(r"grouped CV \(5 folds, one_se\): chosen per depth .*'isotonic'", (out / "train.log").read_text())
    assert "calibrator" in (out / "config.yaml").read_text()
    assert not list(tmp_path.rglob(".hydra")) and not list(tmp_path.rglob("*.tmp-*"))
    assert not [p for p in tmp_path.rglob("train.log") if p.parent != out]  # was: runs/train/default/train.log
    for p in [out, *out.rglob("*")]:
        assert p.stat().st_mode & 0o777 == (0o755 if p.is_dir() else 0o644), p  # was 0600 / 0700
    again = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600, check=False)
    assert again.returncode != 0 and "pass overwrite=true" in again.stderr
    assert not list(tmp_path.rglob(".hydra"))
