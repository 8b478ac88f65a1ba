"""Self-generated requests for the EAGLE corpus (the Magpie method, Xu et al. 2024).

Templated prompts teach a head the templates: it replays well on held-out templated sequences and
poorly on requests people write. Magpie asks the target itself for requests instead: the engine is
given only its chat template's *user prefix* (``<|im_start|>user\\n`` after the default system turn)
and samples what comes next at T=1 until the turn ends. The result follows the target's own
distribution of requests, which is what a self-distilled head should be trained on.

Two kinds:

- ``magpie``: free requests, from the user prefix alone;
- ``magpie_code``: requests about real code. The user turn starts with one function taken verbatim
  from an installed package (``site-packages``; the standard library, which the sample code-edit
  prompts quote, is not used), in one of a few framings, and the target writes what it wants done.

Raw generations are kept in ``work_dir`` (resumable by chunk); :func:`select` then drops unfinished,
degenerate, duplicate and excluded ones deterministically, so changing a filter never regenerates.
"""

from __future__ import annotations

import ast
import json
import random
import re
import sysconfig
from pathlib import Path

from tqdm.auto import tqdm

from calib.drafters.eagle.corpus import build_code_edit
from calib.drafters.eagle.distill import plain_generation_env, read_chunked_jsonl
from calib.vllm.engine import build_engine

CODE_FRAMINGS = [
    "Here is the function `{name}` from `{file}`.\n\n```python\n{code}\n```\n\n",
    "```python\n{code}\n```\n\n",
    "I found this in the {package} package:\n\n```python\n{code}\n```\n\n",
    "{code}\n\n",
]
SKIP_PARTS = {"test", "tests", "testing", "_vendor", "vendor", "vendored", "examples", "benchmarks"}
MIN_LINES, MAX_LINES, MAX_CHARS = 6, 40, 1500
FILES_PER_PACKAGE = 24


def user_prefix(tokenizer) -> str:
    """The chat template's text up to where the first user message's content starts."""
    sentinel = "\x00CALIB_MAGPIE\x00"
    text = tokenizer.apply_chat_template([{"role": "user", "content": sentinel}], tokenize=False)
    return text[: text.index(sentinel)]


def code_snippets(site_packages: Path, seed: int = 0, skip_files: frozenset[str] = frozenset()) -> list[dict]:
    """Whole functions (``MIN_LINES``-``MAX_LINES`` lines, ASCII, at most ``MAX_CHARS``) from a seeded sample
    of each installed package's files; sorted walks, so the list depends only on what is installed."""
    extract = build_code_edit().extract
    rng = random.Random(f"magpie-code-{seed}")
    out = []
    for pkg in sorted(p for p in site_packages.iterdir() if p.is_dir() and p.name.isidentifier()
                      and not p.name.startswith("_") and (p / "__init__.py").exists()):
        files = sorted(f for f in pkg.rglob("*.py")
                       if not SKIP_PARTS & set(f.relative_to(site_packages).parts))
        rng.shuffle(files)
        for f in files[:FILES_PER_PACKAGE]:
            rel = f.relative_to(site_packages).as_posix()
            if rel in skip_files:
                continue
            try:
                src = f.read_text(encoding="utf-8")
                tree = ast.parse(src)
            except (SyntaxError, UnicodeDecodeError, ValueError):
                continue
            lines = src.splitlines()
            fns = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
            rng.shuffle(fns)
            for fn in fns:  # the first that fits; one per file: many packages, not many of one file
                got = extract(lines, fn, MIN_LINES, MAX_LINES, MAX_CHARS)  # the sample prompts' picker
                if got is not None:
                    out.append({"package": pkg.name, "file": rel, "name": fn.name, "start_line": got[0],
                                "code": got[2]})
                    break
    return out


def generate(raw_path: Path, model_dir: str, n_chat: int, n_code: int, seed: int = 0, temperature: float = 1.0,
             top_p: float = 1.0, max_tokens: int = 160, max_num_seqs: int = 128, kv_cache_gb: int = 4,
             skip_files: frozenset[str] = frozenset(), chunk: int = 512) -> Path:
    """Sample ``n_chat`` free and ``n_code`` code requests into ``raw_path`` (JSONL, appended by chunk;
    samples already there are kept)."""
    done = {r["id"] for r in read_chunked_jsonl(raw_path)}
    rng = random.Random(f"magpie-{seed}")
    site_packages = Path(sysconfig.get_paths()["purelib"])
    snippets = code_snippets(site_packages, seed, skip_files) if n_code else []
    if n_code and not snippets:
        raise ValueError(f"no function in {site_packages} fits a code request ({MIN_LINES}-{MAX_LINES} lines, "
                         f"ASCII, <= {MAX_CHARS} characters): set corpus.n_magpie_code=0")
    rng.shuffle(snippets)
    jobs = [{"id": f"magpie-{i:05d}", "kind": "magpie", "lead": ""} for i in range(n_chat)]
    for i in range(n_code):
        s = snippets[i % len(snippets)]
        lead = CODE_FRAMINGS[i % len(CODE_FRAMINGS)].format(**s)
        jobs.append({"id": f"magpie_code-{i:05d}", "kind": "magpie_code", "lead": lead,
                     "source": {k: s[k] for k in ("file", "name", "start_line")}})
    todo = [j for j in jobs if j["id"] not in done]
    if not todo:
        return raw_path
    llm = build_engine(model_dir, {"enforce_eager": True, "max_model_len": 2048}, max_num_seqs=max_num_seqs,
                       seed=seed, env=plain_generation_env(kv_cache_gb))
    from vllm import SamplingParams

    tok = llm.get_tokenizer()
    prefix = user_prefix(tok)
    params = SamplingParams(temperature=temperature, top_p=top_p, max_tokens=max_tokens)
    bar = tqdm(total=len(jobs), initial=len(jobs) - len(todo), desc="magpie requests (vLLM)", unit="request")
    with open(raw_path, "a", encoding="utf-8") as f:
        for a in range(0, len(todo), chunk):
            batch = todo[a:a + chunk]
            prompts = [{"prompt_token_ids": tok(prefix + j["lead"], add_special_tokens=False).input_ids}
                       for j in batch]
            outs = llm.generate(prompts, params, use_tqdm=False)
            f.write("".join(json.dumps({**j, "text": o.outputs[0].text,
                                        "finished": o.outputs[0].finish_reason == "stop"}) + "\n"
                            for j, o in zip(batch, outs)))
            f.flush()
            bar.update(len(batch))
    bar.close()
    del llm
    return raw_path


def _norm(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", " ", text.lower()).strip()


def _shingles(text: str, n: int = 8) -> set[str]:
    words = _norm(text).split()
    return {" ".join(words[i:i + n]) for i in range(len(words) - n + 1)}


def degenerate(text: str) -> str | None:
    """Why a generated request is unusable, or None."""
    words = text.split()
    if len(text) < 12 or len(words) < 3:
        return "too short"
    if len(text) > 1200:
        return "too long"
    if "<|im_" in text or "<|endoftext|>" in text:
        return "template tokens"
    if sum(c.isascii() for c in text) < 0.95 * len(text):
        return "not ASCII"
    if len(words) >= 20 and len(set(words)) < 0.35 * len(words):
        return "repetitive"
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if lines and max(lines.count(line) for line in lines) >= 3:
        return "repeated lines"
    return None


def select(raw_path: Path, excluded_texts: set[str], n_chat: int | None = None,
           n_code: int | None = None) -> tuple[list[dict], dict[str, int]]:
    """Corpus records from the raw samples, in sample order, and how many were dropped, by reason.

    Only the first ``n_chat`` free and ``n_code`` code samples are read (None: all), so lowering a
    count after sampling shrinks the corpus instead of keeping every sample.

    Dropped: unfinished (no end of turn within ``max_tokens``), :func:`degenerate`, a duplicate of an
    earlier request (same normalised first 80 characters) and anything sharing an 8-word run with an
    excluded (sample or test) prompt."""
    ex_shingles = set().union(*(_shingles(t) for t in excluded_texts)) if excluded_texts else set()
    ex_norm = {_norm(t) for t in excluded_texts}
    seen, out, dropped = set(), [], {}
    for r in read_chunked_jsonl(raw_path):
        limit = n_code if r["kind"] == "magpie_code" else n_chat
        if limit is not None and int(r["id"].rsplit("-", 1)[1]) >= limit:
            continue
        text = r["text"].strip()
        why = None if r["finished"] else "unfinished"
        why = why or degenerate(text)
        key = _norm(text)[:80]
        if why is None and key in seen:
            why = "duplicate"
        content = r["lead"] + text
        if why is None and (_norm(content) in ex_norm or _shingles(text) & ex_shingles):
            why = "excluded prompt"
        if why:
            dropped[why] = dropped.get(why, 0) + 1
            continue
        seen.add(key)
        rec = {"id": f"eagle-{r['id']}", "category": "code_edit" if r["kind"] == "magpie_code" else "chat",
               "messages": [{"role": "user", "content": content}]}
        if "source" in r:
            rec["source"] = r["source"]
        out.append(rec)
    return out, dropped
