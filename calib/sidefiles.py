"""The one reader of calib's JSON side files (run_manifest.json, stats.json, tables.json, serve.json, ...).

Whatever is wrong with such a file, :func:`read_json` raises one :class:`SideFileError` that names the
file, what is wrong and what to do; a reader never meets a ``UnicodeDecodeError``,
``RecursionError`` or an ``AttributeError`` on a list where an object was expected. Callers that
know a field's type ask for it with :func:`field`, which names the file and the key.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

# A side file is metadata: a few KB. Anything far larger is not one (and is not read into memory).
MAX_BYTES = 64 << 20
# Deeper than any file calib writes (tables.json nests 5 levels): a bound far below Python's
# recursion limit, so a hostile file is refused by name instead of crashing the parser.
MAX_DEPTH = 64


class SideFileError(ValueError):
    """A JSON side file that cannot be used; the message names the file and what is wrong."""

    def __init__(self, path: str | os.PathLike, problem: str, hint: str | None = None):
        self.path, self.problem = str(path), problem
        super().__init__(f"{path}: {problem}" + (f"; {hint}" if hint else ""))


def _depth(obj, limit: int) -> int:
    """Nesting depth of ``obj`` (iteratively, so a deep file cannot exhaust the stack)."""
    deepest, stack = 0, [(obj, 1)]
    while stack:
        node, d = stack.pop()
        if isinstance(node, (dict, list)):
            deepest = max(deepest, d)
            if deepest > limit:
                return deepest
            stack.extend((v, d + 1) for v in (node.values() if isinstance(node, dict) else node))
    return deepest


def _reject_constant(name: str):
    raise ValueError(f"{name} is not JSON (write null for a missing number)")


def read_json(path: str | os.PathLike, expect: type = dict, *, hint: str | None = None,
              missing_ok: bool = False, allow_nan: bool = True):
    """Parse the JSON file ``path``, whose top level must be an ``expect`` (dict or list).

    Refused, each with a :class:`SideFileError` naming the file: a missing file (unless
    ``missing_ok``, which returns None), one that is a folder or unreadable, over :data:`MAX_BYTES`,
    not UTF-8 text, not JSON (with line and column), nested deeper than :data:`MAX_DEPTH`, holding
    ``NaN``/``Infinity`` where ``allow_nan`` is False (Python writes them for a NaN metric; strict JSON
    has none), or whose top level is not an ``expect``. ``hint`` says what to
    do (e.g. "recollect the bank") and is appended to every message.
    """
    path = Path(path)
    try:
        if path.is_dir():
            raise SideFileError(path, "is a folder, not a JSON file", hint)
        size = path.stat().st_size
    except FileNotFoundError:
        if missing_ok:
            return None
        raise SideFileError(path, "missing file", hint) from None
    except OSError as exc:
        raise SideFileError(path, f"cannot be read ({exc.strerror or exc})", hint) from exc
    if size > MAX_BYTES:
        raise SideFileError(path, f"is {size:,} bytes, far more than a JSON side file holds "
                                  f"(at most {MAX_BYTES:,})", hint)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise SideFileError(path, f"cannot be read ({exc.strerror or exc})", hint) from exc
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SideFileError(path, f"is not UTF-8 text (byte {exc.start}): a binary or corrupted file", hint) from exc
    try:
        obj = json.loads(text, **({} if allow_nan else {"parse_constant": _reject_constant}))
    except json.JSONDecodeError as exc:
        raise SideFileError(path, f"is not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})",
                            hint) from exc
    except ValueError as exc:  # NaN / Infinity
        raise SideFileError(path, f"is not valid JSON ({exc})", hint) from exc
    except RecursionError as exc:
        raise SideFileError(path, f"is nested deeper than {MAX_DEPTH} levels; not a calib side file", hint) from exc
    if _depth(obj, MAX_DEPTH) > MAX_DEPTH:
        raise SideFileError(path, f"is nested deeper than {MAX_DEPTH} levels; not a calib side file", hint)
    if not isinstance(obj, expect):
        want = {dict: "an object ({...})", list: "an array ([...])"}.get(expect, expect.__name__)
        raise SideFileError(path, f"top level is {type(obj).__name__}, expected {want}", hint)
    return obj


_KINDS = {int: "an integer", float: "a finite number", str: "a string", bool: "true or false",
          list: "an array", dict: "an object"}


def field(obj: dict, key: str, kind: type, path: str | os.PathLike, *, default=None, required: bool = False,
          hint: str | None = None):
    """``obj[key]`` checked to be a ``kind`` (``int`` excludes bools; ``float`` accepts ints, finite
    only); ``default`` when absent or null (a :class:`SideFileError` instead when ``required``)."""
    value = obj.get(key)
    if value is None:
        if required:
            raise SideFileError(path, f"key {key!r} is missing", hint)
        return default
    ok = isinstance(value, kind) and not (kind in (int, float) and isinstance(value, bool))
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        ok, value = True, float(value)
    if ok and kind is float and not math.isfinite(value):
        ok = False
    if not ok:
        raise SideFileError(path, f"key {key!r} is {value!r} ({type(value).__name__}), expected "
                                  f"{_KINDS.get(kind, kind.__name__)}", hint)
    return value
