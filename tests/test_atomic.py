"""calib.atomic: a file or folder is either the old one or the complete new one, never half-written."""

from __future__ import annotations

import os
import stat

import pytest

from calib.atomic import OWNED, atomic_dir, atomic_path, write_text_atomic


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_atomic_path_renames_on_success_with_public_mode(tmp_path):
    target = tmp_path / "sub" / "table.json"
    with atomic_path(target) as tmp:
        assert tmp.parent == target.parent and tmp.name.startswith(".table.json.") and tmp.suffix == ".tmp"
        tmp.write_text("new")
        assert not target.exists()
    assert target.read_text() == "new"
    assert _mode(target) == 0o644 & ~_umask()
    assert sorted(p.name for p in target.parent.iterdir()) == ["table.json"]


def test_atomic_path_keeps_the_old_file_when_the_writer_fails(tmp_path):
    target = tmp_path / "table.json"
    target.write_text("old")
    with pytest.raises(RuntimeError), atomic_path(target) as tmp:
        tmp.write_text("half")
        raise RuntimeError("writer died")
    assert target.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["table.json"]


def test_write_text_atomic_is_utf8(tmp_path):
    path = write_text_atomic(tmp_path / "note.md", "accept α ≥ 0.5\n")
    assert path.read_bytes() == "accept α ≥ 0.5\n".encode()


def test_atomic_dir_replaces_a_folder_it_wrote_whole(tmp_path):
    target = tmp_path / "head"
    with atomic_dir(target) as stage:
        (stage / "stale.bin").write_text("old")
    with atomic_dir(target) as stage:
        (stage / "model.safetensors").write_text("new")
        assert (target / "stale.bin").exists()  # nothing visible until the block ends
    assert sorted(p.name for p in target.iterdir()) == [OWNED, "model.safetensors"]
    assert _mode(target) == 0o755 & ~_umask()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["head"]


def test_atomic_dir_refuses_a_folder_holding_what_it_did_not_write(tmp_path):
    target = tmp_path / "head"
    target.mkdir()
    (target / "README.md").write_text("mine")
    with pytest.raises(FileExistsError, match=r"holds files calib did not write: README.md"), atomic_dir(target):
        raise AssertionError("the block must not run")
    assert sorted(p.name for p in target.iterdir()) == ["README.md"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["head"]


def test_atomic_dir_leaves_the_old_folder_when_the_writer_fails(tmp_path):
    target = tmp_path / "head"
    with atomic_dir(target) as stage:
        (stage / "model.safetensors").write_text("old")
    with pytest.raises(RuntimeError), atomic_dir(target) as stage:
        (stage / "model.safetensors").write_text("half")
        raise RuntimeError("writer died")
    assert (target / "model.safetensors").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["head"]


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
