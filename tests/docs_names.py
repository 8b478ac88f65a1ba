"""What the docs name, extracted for tests/test_docs_drift.py: environment variables, config keys written as
Hydra overrides, and ``--flags`` of calib's command lines, each with the page and line that names it.

    python tests/docs_names.py        # print every name found and every one the code does not define

Pages: README.md, docs/*.md, calib/*/README.md. Commands are read from fenced code blocks (a line ending in
``\\`` continues) and from inline code; an environment assignment before a command (``A=1 python ...``) is a
variable the docs name.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "calib").glob("*/README.md")])

HYDRA_ENTRIES = ("train.py", "eval.py", "collect.py", "serve.py")
HYDRA_MODULES = {"calib.moe": "moe", "calib.drafters.eagle": "eagle",
                 "calib.drafters.eagle.reduced_vocab": "eagle_reduced"}
# Hydra's own command-line flags (hydra/_internal/utils.py get_args_parser)
HYDRA_FLAGS = {"--help", "-h", "--hydra-help", "--version", "--cfg", "-c", "--resolve", "--package", "-p",
               "--run", "-r", "--multirun", "-m", "--shell-completion", "-sc", "--config-path", "-cp",
               "--config-name", "-cn", "--config-dir", "-cd", "--experimental-rerun", "--info", "-i"}

# A variable named with one of these prefixes is an environment variable wherever the docs write it.
ENV_PREFIXES = ("CALIB_", "VLLM_", "HF_", "WANDB_", "TRITON_", "HUGGINGFACE_", "TRANSFORMERS_", "TORCH_",
                "PYTORCH_", "OMP_", "CUDA_", "TOKENIZERS_")
_ENV_NAMED = re.compile(r"\b((?:{})[A-Z0-9_]+)\b".format("|".join(ENV_PREFIXES)))
_ENV_ASSIGN = re.compile(r"(?:^|\s)([A-Z][A-Z0-9]*_[A-Z0-9_]+)=")
_FENCE = re.compile(r"^\s*```")
_INLINE = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")
_PY = r"(?:\S*/)?python3?"


@dataclass(frozen=True)
class Name:
    kind: str  # "env", "key", "flag"
    name: str  # the variable, the override key (with its value), or the flag
    where: str  # page:line
    entry: str | None = None  # the command it belongs to (train.py, bench/serve.py, -m calib.bank), None: prose
    value: str | None = None


def code_lines(text: str):
    """(line number, code text, in a fence) for each fenced line (continuations joined) and inline span."""
    fenced, joined, start = False, "", 0
    for i, line in enumerate(text.splitlines(), 1):
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if fenced:
            if not joined:
                start = i
            if line.rstrip().endswith("\\"):
                joined += line.rstrip()[:-1] + " "
                continue
            yield start, joined + line, True
            joined = ""
        else:
            for m in _INLINE.finditer(line):
                yield i, m.group(1), False


def commands(code: str):
    """(entry, args) of each calib command in a line of code: ``python train.py a=b``, ``python -m calib.bank
    validate X``, ``python bench/serve.py --tables T``; a comment, pipe, ``&&`` or ``;`` ends a command."""
    code = code.split(" #", 1)[0]
    for part in re.split(r"&&|\|\||;|\|", code):
        m = re.search(rf"{_PY}\s+(-m\s+[\w.]+|[\w./-]+\.py)\b(.*)", part) or \
            re.search(r"(?:^|\s)(vllm\s+(?:bench\s+)?serve)\b(.*)", part)
        if not m:
            continue
        entry = m.group(1).replace("-m ", "-m ").strip()
        entry = re.sub(r"^-m\s+", "-m ", entry)
        entry = entry.removeprefix("./")
        try:
            args = shlex.split(m.group(2))
        except ValueError:
            args = m.group(2).split()
        yield entry, [a for a in args if not a.startswith(">")]


def extract(pages=PAGES) -> list[Name]:
    names: list[Name] = []
    for page in pages:
        rel = str(page.relative_to(ROOT)) if page.is_relative_to(ROOT) else page.name
        text = page.read_text()
        for i, line in enumerate(text.splitlines(), 1):
            for m in _ENV_NAMED.finditer(line):
                names.append(Name("env", m.group(1), f"{rel}:{i}"))
        for i, code, _fenced in code_lines(text):
            where = f"{rel}:{i}"
            for m in _ENV_ASSIGN.finditer(code.split(" #", 1)[0]):
                if not _ENV_NAMED.fullmatch(m.group(1)):
                    names.append(Name("env", m.group(1), where))
            found = False
            for entry, args in commands(code):
                found = True
                for a in args:
                    if a.startswith("-"):
                        names.append(Name("flag", a.split("=", 1)[0], where, entry))
                    elif is_hydra(entry) and re.match(r"^~?[\w./@-]+=", a):
                        key, value = a.split("=", 1)
                        names.append(Name("key", key.lstrip("~"), where, entry, value))
            if not found and not _fenced and re.fullmatch(r"[a-z_]+(?:\.[\w-]+)+=\S*", code.strip()):
                key, value = code.strip().split("=", 1)  # `serve.online=false` in prose: some entry's key
                names.append(Name("key", key, where, None, value))
    return names


def is_hydra(entry: str | None) -> bool:
    return entry in HYDRA_ENTRIES or (entry or "").removeprefix("-m ") in HYDRA_MODULES


def config_name(entry: str) -> str:
    return entry.removesuffix(".py") if entry in HYDRA_ENTRIES else HYDRA_MODULES[entry.removeprefix("-m ")]


if __name__ == "__main__":
    for n in extract():
        print(n)
