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


def encode_chat(tokenizer, messages) -> list[int]:
    """Token ids of ``messages`` with the chat template and the generation prompt, as calib sends them
    to vLLM (the template's own special tokens only: none added on top)."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False).input_ids


def load_prompts(files, limit_per_file: int | None = None, root: str | Path = ".") -> list[Prompt]:
    """The prompts of ``files`` in order (at most ``limit_per_file`` from each), relative to ``root``.

    A file without a single prompt, or a set without any, is an error naming the file: callers load
    prompts before a model, so a typo or an empty file fails at once, not after an engine started.
    """
    if limit_per_file is not None and int(limit_per_file) < 1:
        raise ValueError(f"limit_per_file={limit_per_file!r} would keep no prompts: use a number >= 1, "
                         "or null for every prompt")
    files = list(files)
    if not files:
        raise ValueError("no prompt files given: list at least one JSONL file (prompts.files)")
    out: list[Prompt] = []
    for f in files:
        path = Path(f) if Path(f).is_absolute() else Path(root) / f
        if not path.exists():
            raise FileNotFoundError(f"prompt file {path} not found")
        n = 0
        for line_no, line in enumerate(path.read_text().splitlines(), start=1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                msgs = rec["messages"]
                if not isinstance(msgs, list) or not msgs:
                    raise ValueError("'messages' must be a non-empty list")
                out.append(Prompt(len(out), str(rec["id"]), str(rec["category"]), msgs))
            except (json.JSONDecodeError, KeyError, ValueError) as exc:
                raise ValueError(f"{path}, line {line_no}: bad prompt record ({exc}); expected "
                                 '{"id": ..., "category": ..., "messages": [...]}') from exc
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
