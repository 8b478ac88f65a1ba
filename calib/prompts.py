"""Prompt sets: JSONL files of ``{"id", "category", "messages": [...]}`` (see data/prompts/README.md)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Prompt:
    idx: int  # position in the concatenated set: the bank's prompt_idx
    id: str
    category: str
    messages: list


# What to give a target without a chat template (a base model): the template calib ships for that.
PLAIN_TEMPLATE_HINT = "conf/model/plain_prompt.jinja sends the messages as plain text"


def encode_chat(tokenizer, messages) -> list[int]:
    """Token ids of ``messages`` with the chat template and the generation prompt, as calib sends them
    to vLLM (the template's own special tokens only: none added on top)."""
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    except ValueError as exc:
        if "chat_template is not set" not in str(exc):
            raise
        raise ValueError(
            f"the target's tokenizer ({getattr(tokenizer, 'name_or_path', '?')}) has no chat template (a base model?), "
            f"and calib sends every prompt through one: for a GGUF target give model.chat_template=<file.jinja> "
            f"({PLAIN_TEMPLATE_HINT}); for a model folder, set its "
            "tokenizer's chat_template and save_pretrained it") from None
    return tokenizer(text, add_special_tokens=False).input_ids


ROLES = ("system", "user", "assistant", "tool")
RECORD = '{"id": ..., "category": ..., "messages": [{"role": "user", "content": "..."}]}'


def _record(rec) -> tuple[str, str, list]:
    """(id, category, messages) of one parsed JSONL record; a ValueError/TypeError saying what is wrong."""
    if not isinstance(rec, dict):
        raise TypeError(f"the line is a JSON {type(rec).__name__}, not an object")
    for key in ("id", "category", "messages"):
        if key not in rec:
            raise ValueError(f"field {key!r} is missing")
    pid, cat, msgs = rec["id"], rec["category"], rec["messages"]
    if isinstance(pid, bool) or not isinstance(pid, (str, int)) or not str(pid).strip():
        raise ValueError(f"'id' is {pid!r}; expected a non-empty string (or an integer)")
    if not isinstance(cat, str) or not cat.strip():
        raise ValueError(f"'category' is {cat!r}; expected a non-empty string")
    if cat != cat.strip() or not cat.isprintable():  # a bank key and a report label: "chat\n" is not "chat"
        raise ValueError(f"'category' is {cat!r}; expected a name without surrounding spaces or control characters")
    if not isinstance(msgs, list) or not msgs:
        raise ValueError("'messages' must be a non-empty list")
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise TypeError(f"messages[{i}] is a {type(m).__name__}, not an object with 'role' and 'content'")
        if m.get("role") not in ROLES:
            raise ValueError(f"messages[{i}].role is {m.get('role')!r}; expected one of {', '.join(ROLES)}")
        if not isinstance(m.get("content"), str):
            raise TypeError(f"messages[{i}].content is {m.get('content')!r}; expected a string")
        if m["role"] == "user" and not m["content"].strip():
            raise ValueError(f"messages[{i}].content is {m['content']!r}: an empty user message (the model would "
                             "answer nothing in particular); write the prompt or drop the record")
    if not any(m["role"] == "user" for m in msgs):
        raise ValueError(f"messages hold no user message (roles {[m['role'] for m in msgs]}): there is nothing for "
                         "the model to answer; add the user's turn")
    if msgs[-1]["role"] == "assistant":
        raise ValueError(f"messages[{len(msgs) - 1}] is the assistant's turn: calib sends the messages with a "
                         "generation prompt, so the model would answer after its own answer (and a drafter could copy "
                         "it); drop the last message, or end the record with the user's turn")
    return str(pid), cat, msgs


def _lines(path: Path) -> list[str]:
    """The lines of the UTF-8 text file ``path``; ValueError naming the file (and line) otherwise."""
    if path.is_dir():
        raise ValueError(f"prompt file {path} is a folder, not a JSONL file: name the .jsonl file itself")
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise ValueError(f"prompt file {path} cannot be read ({exc.strerror or exc})") from exc
    try:
        text = raw.decode("utf-8-sig")  # an editor's byte-order mark is not part of the first record
    except UnicodeDecodeError as exc:
        line_no = raw.count(b"\n", 0, exc.start) + 1
        raise ValueError(f"{path}, line {line_no}: not UTF-8 text (byte {exc.start}); prompt files are "
                         "UTF-8 JSONL: re-save it as UTF-8") from exc
    # Lines end at "\n" only: a JSON string may hold U+2028 and friends, which str.splitlines splits at.
    return [line.removesuffix("\r") for line in text.split("\n")]


def load_prompts(files, limit_per_file: int | None = None, root: str | Path = ".") -> list[Prompt]:
    """The prompts of ``files`` in order (at most ``limit_per_file`` from each), relative to ``root``.

    A file without a single prompt, or a set without any, is an error naming the file: callers load
    prompts before a model, so a typo or an empty file fails at once, not after an engine started.
    So is a malformed record (not JSON, not an object, a missing or mistyped field, empty messages, a
    message whose role is not one of :data:`ROLES` or whose content is not a string, an empty user message, no
    user message, a last message that is the assistant's, a category with surrounding spaces or control
    characters), naming the
    file and the line, and a file that is not UTF-8 text or is a folder.
    """
    if limit_per_file is not None and (isinstance(limit_per_file, bool) or int(limit_per_file) < 1):
        raise ValueError(f"limit_per_file={limit_per_file!r} would keep no prompts: use a number >= 1, "
                         "or null for every prompt")
    files = [files] if isinstance(files, (str, Path)) else list(files)  # one file, not its characters
    if not files:
        raise ValueError("no prompt files given: list at least one JSONL file (prompts.files)")
    out: list[Prompt] = []
    for f in files:
        path = Path(f) if Path(f).is_absolute() else Path(root) / f
        if not path.exists():
            raise FileNotFoundError(f"prompt file {path} not found")
        n = 0
        for line_no, line in enumerate(_lines(path), start=1):
            if not line.strip():
                continue
            try:
                pid, cat, msgs = _record(json.loads(line))
            except (RecursionError, TypeError, ValueError) as exc:  # JSONDecodeError is a ValueError
                why = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)
                if isinstance(exc, json.JSONDecodeError):
                    why = f"not JSON: {exc.msg} at column {exc.colno}"
                raise ValueError(f"{path}, line {line_no}: bad prompt record ({why}); expected one JSON "
                                 f"object per line, {RECORD}") from None
            out.append(Prompt(len(out), pid, cat, msgs))
            n += 1
            if limit_per_file is not None and n >= limit_per_file:
                break
        if n == 0:
            raise ValueError(f"prompt file {path} holds no prompts: add JSONL records "
                             '{"id": ..., "category": ..., "messages": [...]} or drop it from the list')
    ids = [p.id for p in out]
    if len(set(ids)) != len(ids):
        dup = sorted({i for i in ids if ids.count(i) > 1})
        raise ValueError(f"duplicate prompt ids across {list(files)}: {dup[:5]}")
    return out
