"""Writing artifacts so that nothing is half-written, silently replaced or left private.

Every file calib writes goes to a temp name beside its target and is renamed into place; a folder of
artifacts that belong together (tables + summary + pictures) is built in a temp folder beside its
target and swapped in as one unit (:func:`publish_dir`). Files get ``0644`` and folders ``0755``
(less what the process umask removes), not the ``0600``/``0700`` of :mod:`tempfile`.

Every published folder carries an ownership record (:data:`OWNED`: each file's size and sha256, each
link, each subfolder, and the job that wrote them). A folder is replaced only while it holds exactly
what its record lists: a user's notes beside old tables, a project folder with a stray ``train.log``,
a file edited since, or a folder from before records existed are never replaced, whatever
``overwrite`` says; the refusal lists what else is there. A symlinked target is followed (the folder it
points at is replaced, the link kept).

A job's whole output folder (``train.py``, ``eval.py``, ``serve.py``) goes through
:func:`staged_output`: the folder is refused when it holds something else, another job's output or
(without ``overwrite``) an earlier run, built in a staging folder with the run's log, and published on
success only; a failed run, Ctrl-C, SIGTERM or SIGHUP leaves the previous folder as it was and removes
its staging folder, and the staging folder of a run killed outright (SIGKILL) is removed by the next run at
the same place (:mod:`calib.debris`). An out_dir inside a bank or a tables folder is refused; a write error
that names no file (EFBIG, ENOSPC) is re-raised naming it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import fcntl
import hashlib
import json
import logging
import os
import shutil
import signal
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from calib.debris import _host, _stage_prefix, clean_stale_staging

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
    except OSError as exc:
        named = named_os_error(exc, path)
        if named is exc:
            raise
        raise named from exc
    finally:
        Path(tmp).unlink(missing_ok=True)


def named_os_error(exc: OSError, path: str | os.PathLike) -> OSError:
    """``exc`` naming ``path`` where it names no file: a write's "File too large" (a file size limit, EFBIG)
    or "No space left on device" carry no file name, and a user cannot tell which output hit it. Errors
    that name a file, or carry no errno (calib's own refusals), are returned as they are."""
    if exc.filename is not None or not exc.errno:
        return exc
    try:
        return type(exc)(exc.errno, exc.strerror or str(exc), str(path))
    except TypeError:  # an OSError subclass with another signature
        return exc


@contextmanager
def atomic_dir(target: str | os.PathLike, *, job: str = "calib", carry_foreign: bool = False) -> Iterator[Path]:
    """A fresh staging folder beside ``target``, published at ``target`` as one unit when the block
    ends (:func:`publish_dir`: an existing ``target`` is replaced whole, and only if it holds just
    what calib wrote there), removed if it raises. ``target`` is checked before the block runs too,
    so a refused folder costs no work.

    With ``carry_foreign``, whatever ``target`` holds that calib did not write (a README beside an
    exported checkpoint) is copied into the staging folder first and published with the new files;
    the block must leave those copies as they are (overwriting one is refused at publish: it would
    be lost)."""
    target = resolve_target(target)
    if not carry_foreign:
        check_replaceable(target, job=job, what="folder")
    stage = staging_dir(target)
    try:
        if carry_foreign and target.is_dir():
            for rel in foreign_entries(target):
                src, dst = target / rel, stage / rel
                dst.parent.mkdir(parents=True, exist_ok=True)
                if src.is_symlink():
                    os.symlink(os.readlink(src), dst)
                elif src.is_dir():
                    shutil.copytree(src, dst, symlinks=True)
                else:
                    shutil.copy2(src, dst)
        yield stage
        publish_dir(stage, target, job=job, what="folder", carry_foreign=carry_foreign)
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
    """A fresh temp folder beside ``target`` (same file system, so it can be renamed onto it), named
    ``.NAME.tmp-PID@HOST-*`` after the process that owns it; staging folders that killed runs left beside
    ``target`` are cleaned first (:func:`clean_stale_staging`)."""
    target = Path(target)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        clean_stale_staging(target)
        return Path(tempfile.mkdtemp(prefix=f"{_stage_prefix(target)}{os.getpid()}@{_host()}-", dir=target.parent))
    except OSError as exc:
        raise OSError(exc.errno, f"cannot create a staging folder beside {target} ({exc.strerror or exc}); "
                                 f"choose an out_dir in a writable folder with free space") from exc


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


# -- ownership: calib replaces a folder only if it holds exactly what calib recorded writing there ------
OWNED = ".calib-owned.json"  # written into every folder calib publishes: {job, files: {path: entry}}
OWNED_VERSION = 1


def _entries(folder: Path) -> dict[str, dict]:
    """Every file, link and folder under ``folder`` (relative POSIX paths, the ownership record
    excluded): a file as {size, sha256}, a link as {link: where it points}, a folder as {dir: true}.
    Links are recorded, never followed."""
    out: dict[str, dict] = {}
    for root, dirs, files in os.walk(folder, followlinks=False):
        for name in dirs + files:
            p = Path(root) / name
            rel = p.relative_to(folder).as_posix()
            if rel == OWNED:
                continue
            if p.is_symlink():
                out[rel] = {"link": os.readlink(p)}
            elif p.is_dir():
                out[rel] = {"dir": True}
            else:
                out[rel] = {"size": p.stat().st_size, "sha256": sha256_file(p)}
    return out


def sha256_file(path: str | os.PathLike) -> str:
    """The hex sha256 of the file at ``path`` (read in 1 MiB blocks)."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _record(folder: Path) -> dict | None:
    """The ownership record of ``folder`` (None: none, or one that cannot be trusted)."""
    from calib.sidefiles import SideFileError, read_json

    try:
        rec = read_json(folder / OWNED, missing_ok=True)
    except SideFileError:
        return None
    if rec is None or not isinstance(rec.get("files"), dict) or rec.get("version") != OWNED_VERSION:
        return None
    return rec


def foreign_entries(folder: str | os.PathLike, carried: str | os.PathLike | None = None) -> list[str]:
    """What ``folder`` holds that calib did not record writing there: entries missing from its
    ownership record, or changed since (another size or content, a file where a link was). Empty for
    a folder that is exactly what calib published; every entry for a folder with no record. A foreign
    folder is named once, not file by file. With ``carried`` (a staging folder), a foreign entry that
    stands there unchanged is not counted: it is carried into the new folder, so nothing is lost."""
    folder = Path(folder)
    rec = _record(folder)
    recorded = rec["files"] if rec is not None else {}
    entries = _entries(folder)
    foreign = {rel for rel, entry in entries.items() if not _same(recorded.get(rel), entry)}
    if carried is not None and foreign:
        staged = _entries(Path(carried))
        foreign = {rel for rel in foreign if not _same(staged.get(rel), entries[rel])}
    return sorted(f for f in foreign if not any(f.startswith(d + "/") for d in foreign if d != f))


def _same(mine: dict | None, entry: dict) -> bool:
    if mine is None:
        return False
    if "sha256" in entry:
        return mine.get("size") == entry["size"] and mine.get("sha256") == entry["sha256"]
    return mine == entry


def _write_record(folder: Path, job: str, exclude: set[str] = frozenset()) -> None:
    """Record what ``folder`` holds as calib's, less ``exclude`` (carried foreign entries stay foreign)."""
    files = {rel: e for rel, e in _entries(folder).items()
             if rel not in exclude and not any(rel.startswith(x + "/") for x in exclude)}
    write_json_atomic(folder / OWNED, {"version": OWNED_VERSION, "job": job, "files": files,
                                       "note": "what calib wrote here; calib replaces this folder only while "
                                               "it holds exactly these files (delete this file to keep calib "
                                               "from ever replacing the folder)"})


def owner(folder: str | os.PathLike) -> str | None:
    """The job that published ``folder`` (its ownership record's ``job``), None without a record."""
    rec = _record(Path(folder))
    return None if rec is None else str(rec.get("job"))


def resolve_target(target: str | os.PathLike) -> Path:
    """``target`` with a symlink followed (calib writes into the folder a link points at and leaves the
    link as it is); a dangling link is refused, naming it and where it points."""
    target = Path(target)
    if target.is_symlink():
        real = Path(os.path.realpath(target))
        if not real.exists():
            raise FileNotFoundError(f"out_dir {target} is a symlink to {os.readlink(target)}, which does not exist; "
                                    "create that folder or point out_dir elsewhere")
        return real
    return target


def check_replaceable(target: str | os.PathLike, *, job: str = "calib", overwrite: bool = True,
                      what: str = "out_dir", carried: str | os.PathLike | None = None) -> None:
    """Refuse to replace ``target`` unless everything in it is what calib wrote there.

    ``target`` may be absent or empty. A folder with content is replaced only if its ownership
    record (:data:`OWNED`, written by :func:`publish_dir`) lists exactly what it holds, the record
    names the same ``job``, and ``overwrite`` is set. Anything else — a user's notes beside old
    tables, a project folder, a file edited since — is never replaced, whatever ``overwrite`` says,
    unless it stands unchanged in ``carried`` (the staging folder of an :func:`atomic_dir` with
    ``carry_foreign``), which then publishes it with the new files.

    Raises:
        FileExistsError: naming the folder, what else it holds and what to do.
    """
    target = resolve_target(target)
    if not target.exists():
        return
    if not target.is_dir():
        raise FileExistsError(f"{what} {target} is a file, not a folder; choose another {what}")
    if not any(target.iterdir()):
        return
    foreign = foreign_entries(target, carried)
    if foreign:
        shown = ", ".join(foreign[:8]) + (f" and {len(foreign) - 8} more" if len(foreign) > 8 else "")
        why = ("it has no calib ownership record (" + OWNED + ")" if _record(target) is None else
               "these are not what calib recorded writing there (added, or changed since)")
        raise FileExistsError(
            f"{what} {target} holds files calib did not write: {shown} ({why}). {job} replaces its {what} as a "
            f"whole and never deletes what it did not write: choose another {what}, or move those files out")
    prior = owner(target)
    if prior is None and carried is not None:  # no record, but every entry is carried: nothing is lost
        return
    if prior != job:
        raise FileExistsError(f"{what} {target} holds the output of {prior}, not of {job}; choose another {what}")
    if not overwrite:
        raise FileExistsError(f"{what} {target} already holds an earlier {job} output; pass overwrite=true to "
                              f"replace that folder as a whole, or choose another {what}")


@contextmanager
def _parent_lock(target: Path) -> Iterator[None]:
    """An exclusive flock on ``target``'s parent folder: the last check and the swap of two runs
    publishing at the same place do not interleave."""
    fd = os.open(target.parent, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def publish_dir(staged: str | os.PathLike, target: str | os.PathLike, *, job: str = "calib",
                overwrite: bool = True, what: str = "out_dir", carry_foreign: bool = False) -> Path:
    """Put the folder ``staged`` at ``target`` as one unit, with an ownership record of what it holds.

    An existing ``target`` is replaced whole, and only if :func:`check_replaceable` allows it (checked
    here under a lock, right before the swap); a symlinked ``target`` is followed, the link kept. A
    kill at any moment leaves either the old folder or the new one at ``target`` (on Linux the swap
    is one ``renameat2(RENAME_EXCHANGE)``; elsewhere the old folder is moved aside first and a kill
    between the two renames leaves it beside ``target`` as ``.NAME.old-*``). With ``carry_foreign``,
    what ``target`` holds that calib did not write may stay if ``staged`` holds it unchanged.
    """
    staged, target = Path(staged), resolve_target(target)
    carried = set(foreign_entries(target)) if carry_foreign and target.is_dir() else set()
    _write_record(staged, job, exclude=carried)
    set_public_mode(staged)
    with _parent_lock(target):
        check_replaceable(target, job=job, overwrite=overwrite, what=what,
                          carried=staged if carry_foreign else None)
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


_LOG_FORMAT = "[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"  # Hydra's job-log format


@contextmanager
def staged_output(target: str | os.PathLike, *, overwrite: bool = False, job: str = "calib",
                  log_file: str | None = None) -> Iterator[Path]:
    """Build a job's output folder in a staging folder; publish it at ``target`` as one unit on success.

    Yields the staging folder: write everything there (the tracker's files too, finished before the
    block ends). ``target`` is checked with :func:`check_replaceable` before the work and again, under
    a lock, right before publishing (another run may have published meanwhile). With ``log_file``, the
    ``calib`` loggers (and everything else reaching the root logger) at INFO and above also go to that
    file in the staging folder, so the log travels with the outputs it describes. On any exception,
    Ctrl-C, SIGTERM or SIGHUP the staging folder is removed and ``target`` is left as it was.
    """
    target = resolve_target(target)
    check_not_inside_an_input(target, job=job)
    check_replaceable(target, job=job, overwrite=overwrite)
    stage = staging_dir(target)
    handler, calib_logger, level = None, logging.getLogger("calib"), None
    try:
        with _signals_raise():
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
            publish_dir(stage, target, job=job, overwrite=overwrite)
    except OSError as exc:
        shutil.rmtree(stage, ignore_errors=True)
        named = named_os_error(exc, f"{target} (staged in {stage.name})")
        if named is exc:
            raise
        raise named from exc
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    finally:
        if handler is not None:
            logging.getLogger().removeHandler(handler)
            handler.close()
        if level is not None:
            calib_logger.setLevel(level)


# A folder calib reads: a bank (calib.bank.schema.ACCEPTANCE) or tables (calib.tables.io.META; no import: no torch)
INPUT_MARKERS = {"acceptance.parquet": "bank", "tables.json": "tables folder"}


def check_not_inside_an_input(target: str | os.PathLike, *, job: str = "calib", what: str = "out_dir") -> None:
    """Refuse an output folder inside a bank or a tables folder (``train.py out_dir=<a bank>/sub`` wrote tables
    into the bank it read, and the bank validator could not tell). The folder itself may be an earlier output
    (tables replaced with ``overwrite``): only the folders above it are checked.

    Raises:
        FileExistsError: naming the output folder, the input above it and what marks it as one.
    """
    target = Path(os.path.abspath(resolve_target(target)))
    for parent in target.parents:
        for marker, kind in INPUT_MARKERS.items():
            if (parent / marker).is_file():
                raise FileExistsError(f"{what} {target} lies inside the {kind} {parent} (it holds {marker}): {job} "
                                      f"never writes into an input; choose an {what} outside {parent}")


class Terminated(SystemExit):
    """Raised in the main thread on SIGTERM / SIGHUP inside :func:`staged_output`, so the staging folder
    is cleaned up as on Ctrl-C; exits with 128 + the signal number, as the default handler would."""


@contextmanager
def _signals_raise() -> Iterator[None]:
    """Within the block, SIGTERM and SIGHUP raise :class:`Terminated` (main thread only; elsewhere, or
    where a handler other than the default is installed, signals are left as they are)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def _raise(signum, _frame):
        raise Terminated(128 + signum)

    previous = {}
    for sig in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(sig) is signal.SIG_DFL:
            previous[sig] = signal.signal(sig, _raise)
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
