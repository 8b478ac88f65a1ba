#!/usr/bin/env python3
"""Build ``data/prompts/code_edit.jsonl`` from the CPython standard library.

Each prompt asks the model to apply one small, mechanical edit (rename a
variable or parameter, add a docstring, add type hints, convert a loop to a
comprehension, add input validation, switch to f-strings, add logging calls,
remove comments) to one real function or method taken verbatim from the
standard library of the interpreter running this script, and to return the
complete edited code.  The answers therefore copy most of the input, which is
what calib's speculative-decoding sample banks want.

Selection is deterministic: candidate files are walked in sorted order, whole
top-level functions and methods of top-level classes are picked with ``ast`` by
line range (15-60 lines, at most 1,800 characters once dedented), candidates
are shuffled with a fixed seed, and edit kinds are assigned round-robin.  At
most one snippet is taken per file and at most two per top-level stdlib
module or package.  Files under test/ or tests/, idlelib/, lib2to3/,
site-packages/ and a few non-library folders are skipped.

The published file was produced with CPython 3.11.7.  Running

    python data/prompts/build_code_edit.py

on 3.11.7 rewrites it byte-for-byte; other Python versions ship other standard
library sources and therefore give other snippets (and a different
``python_version`` field).  The source code is (c) the Python Software
Foundation, used under the PSF License Agreement.

Only the standard library is used.
"""

from __future__ import annotations

import argparse
import ast
import builtins
import io
import json
import keyword
import os
import platform
import random
import re
import sysconfig
import tokenize
from pathlib import Path

SEED = 20240611
N_PROMPTS = 60
MIN_LINES = 15
MAX_LINES = 60
MAX_CHARS = 1800
PER_FILE = 1
PER_MODULE = 2

OUT_PATH = Path(__file__).resolve().parent / "code_edit.jsonl"

# Directory names skipped anywhere in the path.
SKIP_DIRS = {
    "test", "tests", "idlelib", "lib2to3", "site-packages", "dist-packages",
    "turtledemo", "__phello__", "__pycache__", "lib-dynload", "pydoc_data",
    "ensurepip", "encodings",
}
# Top-level files that are generated, joke modules or otherwise unsuitable.
SKIP_FILES = {"this.py", "antigravity.py", "__hello__.py"}

EDIT_KINDS = [
    "rename_variable",
    "add_docstring",
    "add_type_hints",
    "loop_to_comprehension",
    "rename_parameter",
    "add_input_validation",
    "use_fstrings",
    "add_logging",
    "remove_comments",
]

RENAMES = {
    "s": "text", "n": "count", "i": "idx", "j": "jdx", "k": "key",
    "v": "val", "x": "item", "c": "ch", "f": "fobj", "p": "part",
    "d": "mapping", "l": "items", "m": "match", "t": "tup", "e": "exc",
    "fp": "file_obj", "buf": "buffer", "res": "result", "result": "res",
    "line": "row", "lines": "rows", "name": "item_name", "names": "name_list",
    "value": "val", "values": "vals", "data": "payload", "path": "file_path",
    "key": "k", "args": "arguments", "parts": "pieces", "msg": "message",
    "pos": "position", "start": "begin", "end": "stop", "size": "length",
    "obj": "target", "items": "entries", "text": "content", "host": "hostname",
    "chunks": "pieces", "prefix": "head", "filename": "fname", "module": "mod",
    "index": "pos", "count": "total", "attr": "attribute", "rv": "retval",
    "ret": "retval", "tmp": "temp", "out": "output", "node": "elem",
    "ch": "char", "fullname": "full_name", "fn": "func", "cb": "callback",
    "ws": "whitespace", "sep": "separator", "cmd": "command", "req": "request",
    "resp": "response", "exc": "error", "err": "error", "num": "number",
    "idx": "index", "val": "value", "elem": "element", "src": "source",
    "fd": "file_desc", "dst": "dest", "dirname": "dir_name",
}

INTROS = {
    "function": "the function `{name}` from Python's standard library (`{file}`)",
    "method": "the method `{name}` of class `{cls}` from Python's standard library (`{file}`)",
}

RETURN_LINES = [
    "Return the complete edited code in a single Python code block.",
    "Return the complete edited code, not just the changed lines.",
    "Reply with the full edited code in one fenced code block.",
]


def iter_source_files(stdlib: Path):
    for root, dirs, files in os.walk(stdlib):
        rel_root = Path(root).relative_to(stdlib)
        dirs[:] = sorted(
            d for d in dirs
            if d not in SKIP_DIRS and not d.startswith("config-")
        )
        for fn in sorted(files):
            if not fn.endswith(".py"):
                continue
            rel = rel_root / fn
            if rel_root == Path(".") and (
                fn in SKIP_FILES or fn.startswith("_sysconfigdata")
            ):
                continue
            yield rel


def top_module(rel: Path) -> str:
    first = rel.parts[0]
    return first.removesuffix(".py")


def comment_lines(code: str) -> int:
    n = 0
    try:
        for tok in tokenize.generate_tokens(io.StringIO(code).readline):
            if tok.type == tokenize.COMMENT:
                n += 1
    except (tokenize.TokenError, IndentationError, SyntaxError):
        return 0
    return n


def has_docstring(fn: ast.AST) -> bool:
    return ast.get_docstring(fn, clean=False) is not None


def has_annotations(fn: ast.FunctionDef) -> bool:
    a = fn.args
    all_args = a.posonlyargs + a.args + a.kwonlyargs
    if a.vararg:
        all_args.append(a.vararg)
    if a.kwarg:
        all_args.append(a.kwarg)
    return fn.returns is not None or any(x.annotation is not None for x in all_args)


def plain_params(fn: ast.FunctionDef, is_method: bool) -> list[str]:
    params = [x.arg for x in fn.args.posonlyargs + fn.args.args + fn.args.kwonlyargs]
    if is_method and params and params[0] in ("self", "cls"):
        params = params[1:]
    return [p for p in params if not p.startswith("_")]


def name_usage(fn: ast.FunctionDef):
    """Return (stored local names, all Name ids, attribute/keyword names)."""
    stored, loaded, shadow = [], set(), set()
    for node in ast.walk(fn):
        if isinstance(node, ast.Name):
            loaded.add(node.id)
            if isinstance(node.ctx, ast.Store) and node.id not in stored:
                stored.append(node.id)
        elif isinstance(node, ast.Attribute):
            shadow.add(node.attr)
        elif isinstance(node, ast.keyword) and node.arg:
            shadow.add(node.arg)
        elif isinstance(node, (ast.Global, ast.Nonlocal)):
            shadow.update(node.names)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node is not fn:
            shadow.add(node.name)
        elif isinstance(node, ast.arg):
            loaded.add(node.arg)
    return stored, loaded, shadow


def new_name(old: str, taken: set[str], suffix: str) -> str | None:
    if old in RENAMES:
        cand = RENAMES[old]
    elif old != old.lower():  # camelCase -> snake_case
        cand = re.sub(r"(?<=[a-z0-9])([A-Z])", r"_\1", old).lower()
    else:
        cand = f"{old}_{suffix}"
    if cand in taken or keyword.iskeyword(cand) or cand == old:
        cand = f"{old}_{suffix}"
    if cand in taken:
        return None
    return cand


def comprehension_target(fn: ast.FunctionDef) -> str | None:
    """Find ``x = []`` immediately followed by a for loop that only appends to x."""
    for node in ast.walk(fn):
        for field in ("body", "orelse", "finalbody"):
            block = getattr(node, field, None)
            if not isinstance(block, list):
                continue
            for prev, stmt in zip(block, block[1:]):
                if not (isinstance(prev, ast.Assign) and len(prev.targets) == 1
                        and isinstance(prev.targets[0], ast.Name)
                        and isinstance(prev.value, ast.List) and not prev.value.elts):
                    continue
                if not isinstance(stmt, ast.For) or stmt.orelse or len(stmt.body) != 1:
                    continue
                var = prev.targets[0].id
                inner = stmt.body[0]
                if isinstance(inner, ast.If) and not inner.orelse and len(inner.body) == 1:
                    inner = inner.body[0]
                if (isinstance(inner, ast.Expr) and isinstance(inner.value, ast.Call)
                        and isinstance(inner.value.func, ast.Attribute)
                        and inner.value.func.attr == "append"
                        and isinstance(inner.value.func.value, ast.Name)
                        and inner.value.func.value.id == var
                        and len(inner.value.args) == 1):
                    return var
    return None


def uses_old_formatting(fn: ast.FunctionDef) -> bool:
    for node in ast.walk(fn):
        if (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mod)
                and isinstance(node.left, ast.Constant) and isinstance(node.left.value, str)):
            return True
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr == "format" and isinstance(node.func.value, ast.Constant)
                and isinstance(node.func.value.value, str)):
            return True
    return False


def extract(lines: list[str], fn: ast.FunctionDef, min_lines: int = MIN_LINES, max_lines: int = MAX_LINES,
            max_chars: int = MAX_CHARS) -> tuple[int, int, str] | None:
    start = min([fn.lineno] + [d.lineno for d in fn.decorator_list])
    end = fn.end_lineno
    n = end - start + 1
    if not (min_lines <= n <= max_lines):
        return None
    indent = " " * fn.col_offset
    out = []
    for raw in lines[start - 1:end]:
        line = raw.rstrip("\n").rstrip("\r")
        if "\t" in line or "```" in line:
            return None
        if line.strip() == "":
            out.append("")
        elif line.startswith(indent):
            out.append(line[len(indent):].rstrip())
        else:
            return None  # e.g. a multi-line string dedented past the def
    code = "\n".join(out)
    if len(code) > max_chars or not code.isascii():
        return None
    return start, end, code


def candidates(stdlib: Path):
    for rel in iter_source_files(stdlib):
        try:
            src = (stdlib / rel).read_text(encoding="utf-8")
            tree = ast.parse(src)
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        lines = src.splitlines(keepends=True)
        found = []
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                found.append((node, None))
            elif isinstance(node, ast.ClassDef):
                for sub in node.body:
                    if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        found.append((sub, node.name))
        for fn, cls in found:
            got = extract(lines, fn)
            if got is None:
                continue
            start, end, code = got
            yield analyse(rel, fn, cls, start, end, code)


def analyse(rel: Path, fn, cls, start: int, end: int, code: str) -> dict:
    is_method = cls is not None
    stored, loaded, shadow = name_usage(fn)
    params = plain_params(fn, is_method)
    taken = loaded | shadow | set(dir(builtins))
    kinds: dict[str, dict] = {}

    locals_ = [v for v in stored if v not in params and not v.startswith("_")
               and v not in shadow and v != "self"]
    for v in locals_:
        nn = new_name(v, taken, "var")
        if nn:
            kinds["rename_variable"] = {"old": v, "new": nn}
            break
    for p in params:
        if p in shadow:
            continue
        nn = new_name(p, taken, "arg")
        if nn:
            kinds["rename_parameter"] = {"old": p, "new": nn}
            break
    if not has_docstring(fn):
        kinds["add_docstring"] = {}
    if not has_annotations(fn) and (params or fn.returns is None):
        kinds["add_type_hints"] = {}
    target = comprehension_target(fn)
    if target:
        kinds["loop_to_comprehension"] = {"var": target}
    if params:
        kinds["add_input_validation"] = {"param": params[0]}
    if uses_old_formatting(fn):
        kinds["use_fstrings"] = {}
    kinds["add_logging"] = {}
    if comment_lines(code) >= 2:
        kinds["remove_comments"] = {}
    return {
        "file": rel.as_posix(), "module": top_module(rel), "name": fn.name,
        "cls": cls, "start": start, "end": end, "code": code, "kinds": kinds,
        "is_async": isinstance(fn, ast.AsyncFunctionDef),
    }


def instruction(kind: str, info: dict, cand: dict, rng: random.Random) -> str:
    what = "method" if cand["cls"] else "function"
    intro = INTROS[what].format(name=cand["name"], cls=cand["cls"], file=cand["file"])
    if kind == "rename_variable":
        body = (f"Rename the local variable `{info['old']}` to `{info['new']}` everywhere "
                f"it is used in this {what}. Do not change anything else.")
    elif kind == "rename_parameter":
        body = (f"Rename the parameter `{info['old']}` to `{info['new']}` in the signature "
                f"and everywhere it is used inside this {what}. Do not change anything else.")
    elif kind == "add_docstring":
        body = (f"Add a concise docstring to this {what}: a one-line summary, then a short "
                "description of the parameters and the return value. Leave the code itself unchanged.")
    elif kind == "add_type_hints":
        body = (f"Add type hints to every parameter and to the return value of this {what}, "
                "using built-in generics (e.g. `list[str]`) and `X | None` where appropriate. "
                "Do not change the logic.")
    elif kind == "loop_to_comprehension":
        body = (f"Convert the `for` loop that builds the list `{info['var']}` into an "
                "equivalent list comprehension. Keep everything else exactly as it is.")
    elif kind == "add_input_validation":
        body = (f"Add input validation at the top of this {what}: check the argument "
                f"`{info['param']}` and raise a `TypeError` or `ValueError` with a clear message "
                "when it is invalid. Keep the rest of the code unchanged.")
    elif kind == "use_fstrings":
        body = ("Replace every `%`-style string formatting and `str.format()` call in this "
                f"{what} with an equivalent f-string. Do not change anything else.")
    elif kind == "add_logging":
        body = (f"Add logging to this {what}: assume a module-level "
                "`logger = logging.getLogger(__name__)` already exists, add a `logger.debug(...)` "
                "call at the start that shows the arguments, and a `logger.debug(...)` call before "
                "each `return`. Keep the existing code unchanged.")
    elif kind == "remove_comments":
        body = (f"Remove all `#` comments from this {what}. Keep docstrings and all code "
                "exactly as they are.")
    else:  # pragma: no cover
        raise ValueError(kind)
    ret = rng.choice(RETURN_LINES)
    return (f"Here is {intro}.\n\n```python\n{cand['code']}\n```\n\n{body} {ret}")


def build(stdlib: Path) -> list[dict]:
    cands = list(candidates(stdlib))
    cands.sort(key=lambda c: (c["file"], c["start"]))
    rng = random.Random(SEED)
    rng.shuffle(cands)
    return pick(cands, rng, N_PROMPTS)


def pick(cands: list[dict], rng: random.Random, n: int, per_module: int = PER_MODULE, id_prefix: str = "code_edit",
         skip_exhausted: bool = False) -> list[dict]:
    """Up to ``n`` prompts from shuffled ``cands``: edit kinds round-robin, each given to the first candidate
    it applies to within the per-file and per-module limits. A kind with no candidate left stops the run
    (``skip_exhausted``: is skipped from then on, until every kind is)."""
    used_files: dict[str, int] = {}
    used_mods: dict[str, int] = {}
    used_idx: set[int] = set()
    dead: set[str] = set()
    version = platform.python_version()
    records = []
    i = 0
    while len(records) < n and len(dead) < len(EDIT_KINDS):
        kind = EDIT_KINDS[i % len(EDIT_KINDS)]
        i += 1
        if kind in dead:
            continue
        for j, cand in enumerate(cands):
            if j in used_idx or kind not in cand["kinds"]:
                continue
            if used_files.get(cand["file"], 0) >= PER_FILE:
                continue
            if used_mods.get(cand["module"], 0) >= per_module:
                continue
            break
        else:
            if not skip_exhausted:
                raise SystemExit(f"no candidate left for edit kind {kind!r}")
            dead.add(kind)
            continue
        used_idx.add(j)
        used_files[cand["file"]] = used_files.get(cand["file"], 0) + 1
        used_mods[cand["module"]] = used_mods.get(cand["module"], 0) + 1
        content = instruction(kind, cand["kinds"][kind], cand, rng)
        records.append({
            "id": f"{id_prefix}-{len(records):03d}",
            "category": "code_edit",
            "messages": [{"role": "user", "content": content}],
            "source": {
                "file": cand["file"],
                "start_line": cand["start"],
                "end_line": cand["end"],
                "python_version": version,
            },
            "edit": kind,
        })
    return records


def main(build=build, out_path: Path = OUT_PATH, doc: str = __doc__) -> None:
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--out", type=Path, default=out_path, help="output JSONL path")
    ap.add_argument("--stdlib", type=Path, default=Path(sysconfig.get_paths()["stdlib"]),
                    help="standard library directory to read")
    args = ap.parse_args()
    records = build(args.stdlib)
    with open(args.out, "w", encoding="utf-8", newline="\n") as f:
        f.writelines(json.dumps(rec, ensure_ascii=False) + "\n" for rec in records)
    print(f"wrote {len(records)} prompts to {args.out}")


if __name__ == "__main__":
    main()
