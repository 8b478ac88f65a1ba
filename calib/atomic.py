"""Writing artifacts so that nothing is half-written, silently replaced or left private.

Every file calib writes goes to a temp name beside its target and is renamed into place; a folder of
artifacts that belong together (tables + summary + pictures) is built in a temp folder beside its
target and swapped in as one unit (:func:`publish_dir`). Files get ``0644`` and folders ``0755``
(less what the process umask removes), not the ``0600``/``0700`` of :mod:`tempfile`.

A job's whole output folder (``train.py``, ``eval.py``) goes through :func:`staged_output`: the
folder is refused when it holds something else or an earlier run (unless ``overwrite``), built in a
staging folder with the run's log, and published on success only; a failed run leaves the previous
folder as it was and removes its staging folder.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

FILE_MODE, DIR_MODE = 0o644, 0o755


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def set_public_mode(path: str | os.PathLike) -> None:
    """chmod ``path`` to 0644 (file) or 0755 (folder), less the umask; folders recursively."""
    mask = _umask()
    path = Path(path)
    if path.is_symlink():  # chmod follows links: never touch what a link points at (W&B links into ~/.cache)
        return
    if path.is_dir():
        os.chmod(path, DIR_MODE & ~mask)
        for root, dirs, files in os.walk(path):
            for name in dirs + files:
                p = os.path.join(root, name)
                if not os.path.islink(p):
                    os.chmod(p, (DIR_MODE if name in dirs else FILE_MODE) & ~mask)
    else:
        os.chmod(path, FILE_MODE & ~mask)


@contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """A temp path beside ``path`` for writers that take a path (safetensors, ``savefig``, ``csv``):
    renamed onto ``path`` with public permissions when the block ends, removed if it raises. The temp
    name is hidden and ends in ``.tmp``, so a reader's ``*.json``-style glob never picks up a
    leftover (writers that infer a format from the suffix, like ``savefig``, must be told it)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        set_public_mode(tmp)
        os.replace(tmp, path)
    finally:
        Path(tmp).unlink(missing_ok=True)


@contextmanager
def atomic_dir(target: str | os.PathLike) -> Iterator[Path]:
    """A fresh staging folder beside ``target``, published at ``target`` as one unit when the block
    ends (:func:`publish_dir`: an existing ``target`` is replaced whole), removed if it raises."""
    stage = staging_dir(target)
    try:
        yield stage
        publish_dir(stage, target)
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def write_text_atomic(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` via a temp file in the same folder and one rename."""
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")
    return Path(path)


def write_json_atomic(path: str | os.PathLike, obj) -> Path:
    """:func:`write_text_atomic` of ``obj`` as indented, key-sorted JSON."""
    return write_text_atomic(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


def staging_dir(target: str | os.PathLike) -> Path:
    """A fresh temp folder beside ``target`` (same file system, so it can be renamed onto it)."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))


_RENAME_EXCHANGE = 2  # linux/fs.h


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one step with Linux's renameat2(RENAME_EXCHANGE); False where unsupported."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd = -100
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    rc = fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), _RENAME_EXCHANGE)
    return rc == 0


def publish_dir(staged: str | os.PathLike, target: str | os.PathLike) -> Path:
    """Put the folder ``staged`` at ``target`` as one unit; an existing ``target`` is replaced whole.

    A kill at any moment leaves either the old folder or the new one at ``target`` (on Linux the swap
    is one ``renameat2(RENAME_EXCHANGE)``; elsewhere the old folder is moved aside first and a kill
    between the two renames leaves it beside ``target`` as ``.NAME.old-*``).
    """
    staged, target = Path(staged), Path(target)
    set_public_mode(staged)
    if not target.exists():
        os.replace(staged, target)
        return target
    if _exchange(staged, target):
        shutil.rmtree(staged, ignore_errors=True)  # now holds the old folder
        return target
    old = target.with_name(f".{target.name}.old-{os.getpid()}")
    os.replace(target, old)
    os.replace(staged, target)
    shutil.rmtree(old, ignore_errors=True)
    return target


def check_out_dir(target: str | os.PathLike, overwrite: bool, markers: Sequence[str], job: str) -> None:
    """Refuse to replace ``target`` unless that is safe and was asked for.

    Publishing swaps the whole folder, so ``target`` must be absent, empty, or an earlier output of
    the same job (it holds one of ``markers``, e.g. ``tables.json``), and the last only with
    ``overwrite``. A folder holding anything else is never replaced, whatever ``overwrite`` says.

    Raises:
        FileExistsError: naming the folder, what it holds and what to do.
    """
    target = Path(target)
    if not target.exists():
        return
    if not target.is_dir():
        raise FileExistsError(f"out_dir {target} is a file, not a folder; choose another out_dir")
    entries = sorted(e.name for e in target.iterdir())
    if not entries:
        return
    found = [m for m in markers if (target / m).exists()]
    if not found:
        shown = ", ".join(entries[:5]) + (f" and {len(entries) - 5} more" if len(entries) > 5 else "")
        raise FileExistsError(
            f"out_dir {target} exists and holds files that are not {job} output ({shown}); {job} replaces "
            "its out_dir as a whole, so it will not write there: choose another out_dir (or empty this one)")
    if not overwrite:
        raise FileExistsError(
            f"out_dir {target} already holds {found[0]} from an earlier {job} run; pass overwrite=true to "
            "replace that folder as a whole, or choose another out_dir")


_LOG_FORMAT = "[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"  # Hydra's job-log format


@contextmanager
def staged_output(target: str | os.PathLike, *, overwrite: bool = False, markers: Sequence[str] = (),
                  job: str = "calib", log_file: str | None = None) -> Iterator[Path]:
    """Build a job's output folder in a staging folder; publish it at ``target`` as one unit on success.

    Yields the staging folder: write everything there (the tracker's files too, finished before the
    block ends). ``target`` is checked with :func:`check_out_dir` before the work and again before
    publishing (another run may have published meanwhile). With ``log_file``, the ``calib`` loggers
    (and everything else reaching the root logger) at INFO and above also go to that file in the
    staging folder, so the log travels with the outputs it describes. On any exception the staging
    folder is removed and ``target`` is left as it was.
    """
    check_out_dir(target, overwrite, markers, job)
    stage = staging_dir(target)
    handler, calib_logger, level = None, logging.getLogger("calib"), None
    try:
        if log_file:
            handler = logging.FileHandler(stage / log_file)
            handler.setFormatter(logging.Formatter(_LOG_FORMAT))
            handler.setLevel(logging.INFO)
            logging.getLogger().addHandler(handler)
            if calib_logger.getEffectiveLevel() > logging.INFO:  # e.g. no Hydra logging config (tests)
                level = calib_logger.level
                calib_logger.setLevel(logging.INFO)
        yield stage
        if handler is not None:
            logging.getLogger().removeHandler(handler)
            handler.close()
            handler = None
        check_out_dir(target, overwrite, markers, job)
        publish_dir(stage, target)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    finally:
        if handler is not None:
            logging.getLogger().removeHandler(handler)
            handler.close()
        if level is not None:
            calib_logger.setLevel(level)
