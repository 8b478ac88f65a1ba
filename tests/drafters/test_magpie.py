"""Self-generated (Magpie) requests for the EAGLE corpus: prefix, code snippets and the filter.

The generation itself is vLLM sampling (run by the recipe); the raw samples here are SYNTHETIC."""

from __future__ import annotations

import json
from pathlib import Path

from calib.drafters.eagle import magpie
from calib.drafters.eagle.corpus import excluded_prompts

ROOT = Path(__file__).resolve().parents[2]


class TemplateTokenizer:
    """A tokenizer stand-in with SmolLM2's chat template (default system turn first)."""

    def apply_chat_template(self, messages, tokenize=False):
        sys = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM<|im_end|>\n"
        return sys + "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)


def test_user_prefix_ends_where_the_user_writes():
    prefix = magpie.user_prefix(TemplateTokenizer())
    assert prefix.endswith("<|im_start|>user\n") and prefix.startswith("<|im_start|>system")


def test_code_snippets_take_whole_functions_of_installed_packages(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "tests").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    body = "".join(f"        x{i} = {i}\n" for i in range(8))
    (pkg / "mod.py").write_text(f"import os\n\nclass A:\n    def method(self):\n{body}        return x0\n\n"
                                "def short():\n    return 1\n")
    (pkg / "tests" / "test_mod.py").write_text(f"def test_it():\n{body}    return 0\n")
    (tmp_path / "notapackage").mkdir()
    got = magpie.code_snippets(tmp_path)
    assert [(s["file"], s["name"]) for s in got] == [("pkg/mod.py", "method")]  # tests/ and short() skipped
    assert got[0]["code"].startswith("def method(self):\n    x0 = 0") and got[0]["start_line"] == 4
    assert magpie.code_snippets(tmp_path, skip_files=frozenset({"pkg/mod.py"})) == []


def test_degenerate_requests_are_named():
    assert magpie.degenerate("Explain how tides work and why there are two a day.") is None
    assert magpie.degenerate("Hi") == "too short"
    assert magpie.degenerate("word " * 300) == "too long"
    assert magpie.degenerate("the same " * 20 + "end") == "repetitive"
    assert magpie.degenerate("Write this.\n" * 3 + "Please help") == "repeated lines"
    assert magpie.degenerate("Translate this: " + "日本語のテキスト" * 3) == "not ASCII"
    assert magpie.degenerate("Tell me a joke<|im_end|> please now") == "template tokens"


def test_select_drops_unfinished_duplicate_and_excluded_requests(tmp_path):
    _, ex_texts, _ = excluded_prompts([ROOT / "data" / "prompts"])
    sample = "Explain photosynthesis to a ten-year-old."  # a sample prompt the model happened to write again
    assert sample in ex_texts
    raw = [
        {"id": "magpie-00000", "kind": "magpie", "lead": "", "text": " How do I keep basil alive indoors?", "finished": True},
        {"id": "magpie-00001", "kind": "magpie", "lead": "", "text": "How do I keep BASIL alive indoors??", "finished": True},
        {"id": "magpie-00002", "kind": "magpie", "lead": "", "text": "Write a long story about", "finished": False},
        {"id": "magpie-00003", "kind": "magpie", "lead": "", "text": sample, "finished": True},
        {"id": "magpie_code-00000", "kind": "magpie_code", "lead": "```python\ndef f():\n    pass\n```\n\n",
         "text": "Add a docstring to this function.", "finished": True,
         "source": {"file": "pkg/mod.py", "name": "f", "start_line": 1}},
    ]
    path = tmp_path / "magpie_raw.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in raw))
    records, dropped = magpie.select(path, ex_texts)
    assert [r["id"] for r in records] == ["eagle-magpie-00000", "eagle-magpie_code-00000"]
    assert dropped == {"duplicate": 1, "unfinished": 1, "excluded prompt": 1}
    assert records[0] == {"id": "eagle-magpie-00000", "category": "chat",
                          "messages": [{"role": "user", "content": "How do I keep basil alive indoors?"}]}
    code = records[1]
    assert code["category"] == "code_edit" and code["source"]["file"] == "pkg/mod.py"
    assert code["messages"][0]["content"] == raw[4]["lead"] + "Add a docstring to this function."
    fewer, _ = magpie.select(path, ex_texts, n_chat=1, n_code=0)  # counts lowered after sampling
    assert [r["id"] for r in fewer] == ["eagle-magpie-00000"]


def test_recipe_adds_kept_requests_to_the_corpus_and_samples_once(tmp_path, monkeypatch):
    """The recipe's magpie stage with a SYNTHETIC sampler standing in for vLLM."""
    import pytest

    from calib.drafters.eagle import recipe

    class Stop(Exception):
        pass

    calls = []

    def fake_generate(raw, model_dir, n_chat, n_code, *args):
        calls.append((n_chat, n_code))
        raw.write_text("".join(json.dumps({"id": f"magpie-{i:05d}", "kind": "magpie", "lead": "",
                                           "text": f"Request number {i} about gardening?", "finished": i != 1}) + "\n"
                               for i in range(n_chat)))

    def stop(*args, **kwargs):
        raise Stop

    monkeypatch.setattr(recipe, "target_dir", lambda *a, **k: ("target", "m"))
    monkeypatch.setattr(recipe.magpie, "generate", fake_generate)
    monkeypatch.setattr(recipe, "generate_responses", stop)
    cfg = {"root": str(ROOT), "work_dir": str(tmp_path / "work"), "seed": 0, "model": {"name": "m"},
           "corpus": {"n_chat": 3, "n_rewrite": 0, "n_code_edit": 0, "n_howto": 0, "n_magpie": 4, "n_magpie_code": 0,
                      "exclude_dirs": ["data/prompts"]},
           "distill": {"max_tokens": 8, "temperature": 0.0, "max_num_seqs": 1, "max_model_len": 64, "kv_cache_gb": 1}}
    for _ in range(2):  # the second run finds the samples and does not sample again
        with pytest.raises(Stop):
            recipe.run(cfg)
    assert calls == [(4, 0)]
    ids = [json.loads(line)["id"] for line in (tmp_path / "work" / "corpus.jsonl").read_text().splitlines()]
    assert ids == ["eagle-chat-00000", "eagle-chat-00001", "eagle-chat-00002",
                   "eagle-magpie-00000", "eagle-magpie-00002", "eagle-magpie-00003"]  # 00001 never finished
