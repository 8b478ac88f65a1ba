"""Writing artifacts so that nothing is half-written, silently replaced or left private.

Every file calib writes goes to a temp name beside its target and is renamed into place; a folder of
artifacts that belong together (tables + summary + pictures) is built in a temp folder beside its
target and swapped in as one unit (:func:`publish_dir`). Files get ``0644`` and folders ``0755``
(less what the process umask removes), not the ``0600``/``0700`` of :mod:`tempfile`.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import os
import shutil
import tempfile
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
    if path.is_dir():
        os.chmod(path, DIR_MODE & ~mask)
        for root, dirs, files in os.walk(path):
            for d in dirs:
                os.chmod(os.path.join(root, d), DIR_MODE & ~mask)
            for f in files:
                os.chmod(os.path.join(root, f), FILE_MODE & ~mask)
    else:
        os.chmod(path, FILE_MODE & ~mask)


def write_text_atomic(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` to ``path`` via a temp file in the same folder and one rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
        set_public_mode(tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


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
