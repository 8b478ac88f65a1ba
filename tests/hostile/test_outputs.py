"""Hostile cases for calib's output folders: calib replaces only what it wrote, and a fault, a signal or
a second run never loses anything.

Each case builds a folder, tries to publish over it, and asserts the refusal names the folder and what
else it holds, and that nothing outside calib's own staging changed (a snapshot of the whole tmp
tree, contents included, before and after).
"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from calib.atomic import OWNED, atomic_dir, check_replaceable, foreign_entries, staged_output
from calib.vllm.serve_runner import calib_off

ROOT = Path(__file__).resolve().parents[2]


def snapshot(root: Path) -> dict:
    """Every path under ``root`` with what it is: file bytes, link target, or a folder."""
    out = {}
    for p in sorted(root.rglob("*")):
        rel = str(p.relative_to(root))
        if p.is_symlink():
            out[rel] = ("link", os.readlink(p))
        elif p.is_dir():
            out[rel] = ("dir",)
        else:
            out[rel] = ("file", p.read_bytes())
    return out


def publish(target: Path, job: str = "train.py", overwrite: bool = True, files=None) -> None:
    with staged_output(target, overwrite=overwrite, job=job) as stage:
        for name, text in (files or {"tables.json": "{}", "summary.txt": "new"}).items():
            (stage / name).parent.mkdir(parents=True, exist_ok=True)
            (stage / name).write_text(text)


# -- folders calib must never replace ---------------------------------------------------------------


def _old_tables_plus_notes_and_bank(d: Path):
    publish(d, files={"tables.json": "{}", "train.log": "old"})
    (d / "notes.md").write_text("my notes")
    (d / "bank").mkdir()
    (d / "bank" / "acceptance.parquet").write_bytes(b"PAR1")


def _project_with_stray_train_log(d: Path):
    (d / ".git").mkdir(parents=True)
    (d / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (d / "src").mkdir()
    (d / "src" / "main.py").write_text("print('hi')\n")
    (d / "train.log").write_text("a log")


def _legacy_output_without_record(d: Path):
    d.mkdir()
    for name in ("tables.json", "tables.safetensors", "summary.txt", "train.log"):
        (d / name).write_text("from an older calib")


def _owned_file_edited_since(d: Path):
    publish(d)
    (d / "summary.txt").write_text("edited by hand")


def _owned_file_replaced_by_link(d: Path):
    publish(d)
    (d / "summary.txt").unlink()
    (d / "summary.txt").symlink_to("/etc/hostname")


def _record_forged_as_a_list(d: Path):
    publish(d)
    (d / OWNED).write_text("[]")


def _record_binary(d: Path):
    publish(d)
    (d / OWNED).write_bytes(b"\x89PNG\r\n\x1a\n\x00\xff")


def _user_subfolder_in_owned_output(d: Path):
    publish(d)
    (d / "mine").mkdir()
    (d / "mine" / "a.txt").write_text("a")
    (d / "mine" / "b.txt").write_text("b")


FOREIGN = [
    # (case, build, what the message must name)
    ("old tables + a user's notes and bank", _old_tables_plus_notes_and_bank, ["bank", "notes.md"]),
    ("a project folder with a stray train.log", _project_with_stray_train_log, [".git", "src", "train.log"]),
    ("an older calib's output (no record)", _legacy_output_without_record, ["tables.json", OWNED]),
    ("an owned file edited since", _owned_file_edited_since, ["summary.txt", "changed since"]),
    ("an owned file replaced by a link", _owned_file_replaced_by_link, ["summary.txt"]),
    ("an ownership record that is a list", _record_forged_as_a_list, ["tables.json", OWNED]),
    ("a binary ownership record", _record_binary, ["tables.json", OWNED]),
    ("a user's subfolder in an owned output", _user_subfolder_in_owned_output, ["mine"]),
]


@pytest.mark.parametrize("case,build,named", FOREIGN, ids=[c[0] for c in FOREIGN])
def test_a_folder_holding_what_calib_did_not_write_is_never_replaced(tmp_path, case, build, named):
    target = tmp_path / "out"
    build(target)
    before = snapshot(tmp_path)
    with pytest.raises(FileExistsError) as err:
        publish(target, overwrite=True)
    msg = str(err.value)
    assert str(target) in msg and "calib did not write" in msg, msg
    for name in named:
        assert name in msg, (name, msg)
    assert "choose another out_dir, or move those files out" in msg
    assert snapshot(tmp_path) == before  # nothing changed, no staging folder left


def test_the_foreign_subfolder_is_named_once_not_file_by_file(tmp_path):
    target = tmp_path / "out"
    _user_subfolder_in_owned_output(target)
    assert foreign_entries(target) == ["mine"]


def test_an_owned_output_is_replaced_only_with_overwrite_and_only_by_its_own_job(tmp_path):
    target = tmp_path / "out"
    publish(target, files={"tables.json": "{}", "old.png": "old"})
    before = snapshot(tmp_path)
    with pytest.raises(FileExistsError, match=r"already holds an earlier train.py output; pass overwrite=true"):
        publish(target, overwrite=False)
    with pytest.raises(FileExistsError, match=r"holds the output of train.py, not of eval.py"):
        publish(target, job="eval.py", overwrite=True)
    assert snapshot(tmp_path) == before
    publish(target, overwrite=True, files={"tables.json": '{"new": 1}'})
    assert sorted(p.name for p in target.iterdir()) == [OWNED, "tables.json"]  # old.png went with its run
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_a_file_or_a_dangling_link_as_out_dir_is_refused(tmp_path):
    (tmp_path / "out").write_text("a file")
    with pytest.raises(FileExistsError, match=r"out_dir .*out is a file, not a folder"):
        publish(tmp_path / "out")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match=r"dangling is a symlink to .*nowhere, which does not exist"):
        publish(tmp_path / "dangling")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dangling", "out"]


def test_a_symlinked_out_dir_is_followed_and_the_link_kept(tmp_path):
    real = tmp_path / "disk" / "tables"
    publish(real, files={"tables.json": "old"})
    link = tmp_path / "out"
    link.symlink_to(real)
    publish(link, overwrite=True, files={"tables.json": "new"})
    assert link.is_symlink() and os.readlink(link) == str(real)  # was: replaced by a real folder
    assert (real / "tables.json").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["disk", "out"]  # no old link left under a temp name
    assert sorted(p.name for p in real.parent.iterdir()) == ["tables"]


def test_a_link_inside_an_owned_output_is_recorded_not_followed(tmp_path):
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "big.bin").write_text("not calib's")
    target = tmp_path / "out"
    with staged_output(target, job="eval.py") as stage:
        (stage / "latest-run").symlink_to(outside)
    assert foreign_entries(target) == []
    publish(target, job="eval.py", overwrite=True)
    assert (outside / "big.bin").read_text() == "not calib's"  # replacing the folder never follows the link


def test_carry_foreign_publishes_what_calib_did_not_write_with_the_new_files(tmp_path):
    head = tmp_path / "head"
    head.mkdir()
    (head / "README.md").write_text("the maintainers' notes")
    (head / "runs").mkdir()
    (head / "runs" / "log.txt").write_text("run 1")
    with atomic_dir(head, carry_foreign=True) as stage:
        (stage / "model.safetensors").write_text("weights 1")
    assert (head / "README.md").read_text() == "the maintainers' notes" and (head / "runs" / "log.txt").exists()
    assert foreign_entries(head) == ["README.md", "runs"]  # still not calib's: carried, not claimed
    with atomic_dir(head, carry_foreign=True) as stage:  # the next export replaces calib's own file
        (stage / "model.safetensors").write_text("weights 2")
    assert (head / "model.safetensors").read_text() == "weights 2"
    assert (head / "README.md").read_text() == "the maintainers' notes"


def test_carry_foreign_refuses_a_block_that_overwrites_a_carried_file(tmp_path):
    head = tmp_path / "head"
    head.mkdir()
    (head / "config.json").write_text('{"mine": true}')
    before = snapshot(tmp_path)
    with pytest.raises(FileExistsError, match=r"holds files calib did not write: config.json"), \
            atomic_dir(head, carry_foreign=True) as stage:
        (stage / "config.json").write_text('{"exported": true}')
    assert snapshot(tmp_path) == before


def test_write_bank_replaces_only_a_bank_it_wrote(tmp_path):
    from calib.bank import write_bank
    from tests.synthetic import synthetic_tables  # SYNTHETIC rounds: a unit test of the folder rules only

    tables = synthetic_tables(n_prompts=2, rounds_per_prompt=3)
    bank = write_bank(tmp_path / "bank", *tables)
    with pytest.raises(FileExistsError, match=r"bank folder .*bank already holds an earlier"):
        write_bank(bank, *tables)
    write_bank(bank, *tables, overwrite=True)  # its own bank: replaced
    (bank / "notes.md").write_text("mine")
    before = snapshot(tmp_path)
    with pytest.raises(FileExistsError, match=r"bank folder .*bank holds files calib did not write: notes.md"):
        write_bank(bank, *tables, overwrite=True)
    assert snapshot(tmp_path) == before


def test_collect_refuses_a_non_empty_folder_that_is_not_a_collect_run(tmp_path):
    from calib.collect.runner import RunFolder

    (tmp_path / "capture").mkdir()  # a user's folder of that name: collect empties its own capture/
    (tmp_path / "capture" / "keep.txt").write_text("mine")
    before = snapshot(tmp_path)
    with pytest.raises(FileExistsError, match=r"out_dir .* is not empty \(capture\) and holds no collect_config.json"):
        RunFolder(tmp_path, {"seed": 0}).open()
    assert snapshot(tmp_path) == before
    RunFolder(tmp_path / "new", {"seed": 0}).open()  # a new folder, then its own run resumes
    RunFolder(tmp_path / "new", {"seed": 0}).open()


# -- faults, signals, concurrent runs -----------------------------------------------------------------


def test_disk_full_mid_run_leaves_the_previous_output_and_no_staging(tmp_path):
    target = tmp_path / "out"
    publish(target, files={"tables.json": "old"})
    before = snapshot(tmp_path)
    with pytest.raises(OSError, match="No space left"), staged_output(target, overwrite=True, job="train.py") as stage:
        (stage / "tables.json").write_text("half")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    assert snapshot(tmp_path) == before


def test_an_unwritable_parent_is_named_with_what_to_do(tmp_path, monkeypatch):
    import tempfile

    def read_only(*a, **k):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))

    monkeypatch.setattr(tempfile, "mkdtemp", read_only)  # root ignores chmod, so the refusal is simulated
    with pytest.raises(OSError, match=r"cannot create a staging folder beside .*out \(Permission denied\); "
                                      r"choose an out_dir in a writable folder"):
        publish(tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


def test_a_second_run_that_published_meanwhile_is_not_overwritten_without_overwrite(tmp_path):
    target = tmp_path / "out"
    with pytest.raises(FileExistsError, match="already holds an earlier train.py output"), \
            staged_output(target, job="train.py") as first:  # started while out_dir was empty
        (first / "tables.json").write_text("first")
        publish(target, overwrite=False, files={"tables.json": "second"})  # finished first
    assert (target / "tables.json").read_text() == "second"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


SLOW_JOB = r"""
import signal, sys, time
from pathlib import Path
from calib.atomic import staged_output
# A shell starts background jobs with SIGINT ignored (CI, make &), and nohup ignores SIGHUP (calib then keeps it
# ignored, as a nohup'd job should): restore both as a terminal has them.
signal.signal(signal.SIGINT, signal.default_int_handler)
signal.signal(signal.SIGHUP, signal.SIG_DFL)
with staged_output(Path(sys.argv[1]), overwrite=True, job="train.py") as stage:
    (stage / "tables.json").write_text("half")
    print("staged", flush=True)
    time.sleep(60)
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT], ids=["SIGTERM", "SIGHUP", "SIGINT"])
def test_a_signal_mid_run_cleans_up_like_ctrl_c(tmp_path, sig):
    target = tmp_path / "out"
    publish(target, files={"tables.json": "old"})
    before = snapshot(tmp_path)
    proc = subprocess.Popen([sys.executable, "-c", SLOW_JOB, str(target)], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "staged"
    assert len(list(tmp_path.iterdir())) == 2  # out and the run's staging folder
    proc.send_signal(sig)
    proc.wait(timeout=30)
    assert proc.returncode != 0
    if sig != signal.SIGINT:
        assert proc.returncode == 128 + sig
    deadline = time.time() + 5
    while snapshot(tmp_path) != before and time.time() < deadline:
        time.sleep(0.1)
    assert snapshot(tmp_path) == before  # was: a staging folder left behind on SIGTERM


def test_check_replaceable_is_silent_for_absent_and_empty_folders(tmp_path):
    check_replaceable(tmp_path / "absent", job="train.py", overwrite=False)
    (tmp_path / "empty").mkdir()
    check_replaceable(tmp_path / "empty", job="train.py", overwrite=False)


def test_atomic_dir_refuses_before_the_work_runs(tmp_path):
    (tmp_path / "head").mkdir()
    (tmp_path / "head" / "README.md").write_text("mine")
    ran = []
    with pytest.raises(FileExistsError, match="README.md"), atomic_dir(tmp_path / "head"):
        ran.append(1)
    assert ran == []


# -- serve.py: a calib run with calib off is not a calib figure ---------------------------------------

CALIB = {"name": "calib_two_drafter", "calib": True}
OFF_CASES = [
    ("hooks never installed", {"calib": None}, "never installed"),
    ("tables refused at engine start", {"calib": {"steps": 9, "decided": 0, "disabled_reason": "TablesError: x"}},
     "TablesError: x"),
    ("no step decided", {"calib": {"steps": 9, "decided": 0, "errors": 3, "disabled_reason": None}},
     "none of 9 engine steps was decided (3 hook errors)"),
]


@pytest.mark.parametrize("case,record,why", OFF_CASES, ids=[c[0] for c in OFF_CASES])
def test_calib_off_is_detected(case, record, why):
    assert why in calib_off(CALIB, record)


def test_calib_on_and_vllm_policies_are_not_off():
    assert calib_off(CALIB, {"calib": {"steps": 9, "decided": 4, "disabled_reason": None}}) is None
    assert calib_off({"name": "vllm"}, {"calib": None}) is None
    # a cell served inside a stand-aside stretch (calib/serve/aside.py) decided nothing on purpose: calib was on
    aside = {"steps": 9, "decided": 0, "aside_engine": 9, "aside_none": 0, "disabled_reason": None}
    assert calib_off(CALIB, {"calib": aside}) is None


# -- issue 43: debris of killed runs, outputs inside inputs, errors that name no file ------------------------


def test_a_killed_runs_staging_folder_is_removed_by_the_next_run(tmp_path, caplog):
    target = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-c", SLOW_JOB, str(target)], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "staged"
    proc.kill()  # SIGKILL: no handler runs, the staging folder stays (was: forever)
    proc.wait(timeout=30)
    (stale,) = [p for p in tmp_path.iterdir() if p.name.startswith(".out.tmp-")]
    assert stale.name.startswith(f".out.tmp-{proc.pid}@")
    with caplog.at_level("WARNING", logger="calib.atomic"):
        publish(target)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert f"removed {stale}: the staging folder of run {proc.pid} on this host, which no longer runs" in caplog.text


def test_staging_folders_calib_cannot_vouch_for_are_named_and_kept(tmp_path, caplog):
    """A live run's staging folder is left silently; one without an owner (an older calib, another host) and a
    previous output moved aside (``.old-``) are kept and named."""
    from calib.debris import _host

    target = tmp_path / "out"
    live = tmp_path / f".out.tmp-{os.getpid()}@{_host()}-abc"
    unowned, moved = tmp_path / ".out.tmp-k3j4h5", tmp_path / ".out.old-999999"
    for d in (live, unowned, moved):
        d.mkdir()
        (d / "tables.json").write_text("{}")
    with caplog.at_level("WARNING", logger="calib.atomic"):
        publish(target)
    assert all(d.is_dir() for d in (live, unowned, moved))
    assert f"{unowned} beside {target}: a staging folder of a run that did not finish" in caplog.text
    assert f"{moved} beside {target}: the previous output moved aside" in caplog.text
    assert str(live) not in caplog.text


@pytest.mark.parametrize("marker, kind", [("acceptance.parquet", "bank"), ("tables.json", "tables folder")])
def test_an_out_dir_inside_an_input_is_refused(tmp_path, marker, kind):
    """``train.py out_dir=<a bank>/sub`` wrote tables into the bank it read (issue 43)."""
    inp = tmp_path / "in"
    inp.mkdir()
    (inp / marker).write_bytes(b"PAR1")
    before = snapshot(tmp_path)
    with pytest.raises(FileExistsError) as err:
        publish(inp / "sub" / "deeper")
    assert str(err.value) == (f"out_dir {inp / 'sub' / 'deeper'} lies inside the {kind} {inp} (it holds {marker}): "
                              f"train.py never writes into an input; choose an out_dir outside {inp}")
    assert snapshot(tmp_path) == before


FULL_DISK_JOB = r"""
import resource, signal, sys
from pathlib import Path
from calib.atomic import staged_output, write_text_atomic
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # past the limit a write fails with EFBIG instead of a signal
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
out = Path(sys.argv[1])


def staged():
    with staged_output(out / "run", job="train.py") as stage:
        (stage / "t").write_text("x" * 10_000)


for call in (lambda: write_text_atomic(out / "big.json", "x" * 10_000), staged):
    try:
        call()
    except OSError as exc:
        print(exc)
"""


def test_file_too_large_names_the_file(tmp_path):
    """A file size limit (ulimit -f) fails a write with "File too large" and no file name (issue 43)."""
    p = subprocess.run([sys.executable, "-c", FULL_DISK_JOB, str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                       timeout=60, check=True)
    first, second = p.stdout.splitlines()
    assert first == f"[Errno 27] File too large: '{tmp_path / 'big.json'}'"
    assert second.startswith(f"[Errno 27] File too large: '{tmp_path / 'run'} (staged in .run.tmp-")
    assert sorted(x.name for x in tmp_path.iterdir()) == []  # nothing half-written left
