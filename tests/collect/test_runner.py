"""The collector's run loop without an engine: config over environment, routing in the run's hash,
config checks, empty prompt sets refused before the model loads, Ctrl-C, per-prompt progress.

The engine is faked (``runner._engine``, ``calib.target.prepare_target``); only the progress test
imports vLLM (~10 s, no engine) to drive vLLM's own request loop with the collector's progress bar.
"""

import io
import json
import runpy
import shlex
import sys
import types
from pathlib import Path

import pytest
from omegaconf import OmegaConf
from tqdm.std import tqdm as plain_tqdm

from calib import envs
from calib.collect import runner
from calib.collect.runner import RunFolder, config_hash

ROOT = Path(__file__).resolve().parents[2]


class Stop(Exception):
    """Raised by the fake engine once it has seen what it was started with."""


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    """No calib/vLLM variable inherited from the shell, and none leaked by a test (restored after)."""
    for name in envs.REGISTRY:
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)


def compose(*overrides: str) -> dict:
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = hydra_compose("collect", overrides=[f"root={ROOT}", *overrides])
    return OmegaConf.to_container(cfg, resolve=True)


def fake_vllm(monkeypatch, llm_cls=None):
    mod = types.ModuleType("vllm")
    mod.SamplingParams = lambda **kw: kw
    mod.LLM = llm_cls
    mod.__version__ = "fake"
    monkeypatch.setitem(sys.modules, "vllm", mod)
    return mod


def snapshot_engine(monkeypatch):
    """A fake ``vllm.LLM`` that records the environment it was started in, then stops."""
    seen = {}

    class LLM:
        def __init__(self, **kwargs):
            seen.update({name: envs.os.environ.get(name) for name in envs.REGISTRY})
            raise Stop

    fake_vllm(monkeypatch, LLM)
    return seen


# -- config wins over inherited environment variables -------------------------------------------------

def test_collect_config_wins_over_inherited_env(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "7")
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    monkeypatch.setenv("CALIB_ROUTING", "1")  # what the docs used to tell users to set
    seen = snapshot_engine(monkeypatch)
    cfg = compose("engine.kv_cache_gb=3")
    with pytest.raises(Stop):
        runner._engine(cfg, tmp_path, None, tmp_path / "capture", (1, 4, 4))
    assert seen["VLLM_CPU_KVCACHE_SPACE"] == "3"
    assert seen["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"  # engine.in_process: true
    assert seen["CALIB_ROUTING"] == "0" and seen["CALIB_SHADOW_ROUTER"] is None
    assert seen["CALIB_COLLECT_DIR"] == str((tmp_path / "capture").resolve())
    assert seen["CALIB_NGRAM"] == "1,4,4" and seen["CALIB_CPU_SAMPLING_FIX"] == "1"
    warned = caplog.text
    assert "VLLM_CPU_KVCACHE_SPACE=7" in warned and "engine.kv_cache_gb" in warned
    assert "CALIB_ROUTING=1" in warned and "routing.capture" in warned


def test_routing_settings_reach_the_plugin_from_config(monkeypatch, tmp_path):
    router = tmp_path / "router"
    router.mkdir()
    (router / "router.safetensors").write_bytes(b"")
    (router / "router.json").write_text("{}")
    seen = snapshot_engine(monkeypatch)
    cfg = compose("routing.capture=true", f"routing.shadow_router={router}")
    runner.check_config(cfg)
    with pytest.raises(Stop):
        runner._engine(cfg, tmp_path, None, tmp_path / "capture", (1, 4, 4))
    assert seen["CALIB_ROUTING"] == "1" and seen["CALIB_SHADOW_ROUTER"] == str(router.resolve())

    # capture=false: no hooks at all, so no routing either
    seen.clear()
    with pytest.raises(Stop):
        runner._engine({**cfg, "capture": False}, tmp_path, None, tmp_path / "capture", (1, 4, 4))
    assert seen["CALIB_COLLECT_DIR"] is None and seen["CALIB_ROUTING"] == "0"


def test_plugin_passes_routing_to_the_hooks(monkeypatch):
    from calib.vllm import capture, patches, plugin

    got, installed = {}, []
    monkeypatch.setattr(capture, "start_capture", lambda out_dir, chain_settings, k, **kw: got.update(
        out_dir=out_dir, chain_settings=chain_settings, k=k, **kw) or "capture")
    monkeypatch.setattr(patches, "install", installed.append)
    envs.export({"CALIB_COLLECT_DIR": "/tmp/x", "CALIB_NGRAM": (2, 3, 5), "CALIB_ROUTING": True,
                 "CALIB_SHADOW_ROUTER": "/tmp/r"})
    plugin.register()
    assert got == {"out_dir": "/tmp/x", "chain_settings": {"ngram": (2, 3, 5)}, "k": 5, "routing": True, "shadow_router": "/tmp/r",
                   "serving": None}
    assert installed == [["capture"]]  # one patch set, capture its only subscriber


def test_distill_config_wins_over_inherited_env(monkeypatch, tmp_path):
    from calib.drafters.eagle.distill import generate_responses

    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "9")
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.setenv("CALIB_COLLECT_DIR", str(tmp_path))
    seen = snapshot_engine(monkeypatch)
    with pytest.raises(Stop):
        generate_responses([{"id": "a", "category": "chat", "messages": [{"role": "user", "content": "hi"}]}],
                           str(tmp_path), tmp_path / "responses.jsonl", max_tokens=8, kv_cache_gb=4)
    assert seen["VLLM_CPU_KVCACHE_SPACE"] == "4"
    assert seen["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1"  # the engine core in its own process
    assert seen["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0" and seen["CALIB_COLLECT_DIR"] is None


def test_export_refuses_unregistered_names():
    with pytest.raises(KeyError, match="calib/envs.py"):
        envs.export({"CALIB_NOT_A_VARIABLE": 1})


# -- routing is a setting, so it is part of the run's hash -------------------------------------------

def test_resume_with_another_routing_setting_is_refused(tmp_path):
    off = compose(f"out_dir={tmp_path}")
    on = compose(f"out_dir={tmp_path}", "routing.capture=true")
    assert off["routing"] == {"capture": False, "shadow_router": None}
    assert config_hash(off) != config_hash(on)
    RunFolder(tmp_path, off).open()
    with pytest.raises(RuntimeError, match="refusing to mix"):
        RunFolder(tmp_path, on).open()
    RunFolder(tmp_path, off).open()  # the same setting resumes


@pytest.mark.parametrize("overrides, message", [
    (["routing.capture=yes"], "routing.capture='yes': expected true or false"),
    (["routing.shadow_router=data/routing/smollm2-moefied/router"], "set routing.capture=true"),
    (["routing.capture=true", "routing.shadow_router=no/such/router"], "lacks router.safetensors"),
    (["+routing.capture_all=true"], "routing.capture_all is not a setting"),
    (["sampling.temperature=-1"], "sampling.temperature=-1"),
    (["sampling.top_p=0"], "sampling.top_p=0"),
    (["part_size=0"], "part_size=0"),
    (["capture=maybe"], "capture='maybe': expected true or false"),
])
def test_bad_settings_are_refused_with_the_values_they_take(overrides, message):
    with pytest.raises(ValueError) as err:
        runner.check_config(compose(*overrides))
    assert message in str(err.value)


# -- empty prompt sets fail before the model loads ----------------------------------------------------

def _no_model(monkeypatch):
    import calib.target

    def boom(*a, **k):
        raise AssertionError("the model was loaded before the prompts were checked")

    monkeypatch.setattr(calib.target, "prepare_target", boom)
    monkeypatch.setattr(runner, "_engine", boom)


@pytest.mark.parametrize("content", ["", "\n  \n"])
def test_empty_prompt_file_is_refused_before_the_model_loads(monkeypatch, tmp_path, content):
    _no_model(monkeypatch)
    empty = tmp_path / "empty.jsonl"
    empty.write_text(content)
    cfg = compose(f"out_dir={tmp_path / 'run'}", f"prompts.files=[{ROOT}/data/prompts/smoke.jsonl,{empty}]")
    with pytest.raises(ValueError, match=f"prompt file {empty} holds no prompts"):
        runner.run(cfg)
    assert not (tmp_path / "run").exists()  # no run folder is left behind either


def test_a_set_of_zero_prompts_is_refused_before_the_model_loads(monkeypatch, tmp_path):
    _no_model(monkeypatch)
    with pytest.raises(ValueError, match="would keep no prompts"):
        runner.run(compose(f"out_dir={tmp_path / 'run'}", "prompts.limit_per_file=0"))
    with pytest.raises(ValueError, match="no prompt files given"):
        runner.run(compose(f"out_dir={tmp_path / 'run'}", "prompts.files=[]"))


# -- a fake engine for whole runs -----------------------------------------------------------------------

class FakeTokenizer:
    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        return " ".join(m["content"] for m in messages)

    def __call__(self, text, add_special_tokens):
        return types.SimpleNamespace(input_ids=[len(w) for w in text.split()][:8] or [1])


def _output(i, prompt):
    return types.SimpleNamespace(
        request_id=str(i), prompt_token_ids=prompt["prompt_token_ids"], finished=True,
        outputs=[types.SimpleNamespace(token_ids=[5, 6, 7], text=f"answer {i}", spec_decode_metrics=None)])


def _fake_target(monkeypatch, tmp_path, llm):
    import calib.target

    monkeypatch.setattr(calib.target, "prepare_target", lambda *a, **k: tmp_path / "model")
    monkeypatch.setattr(runner, "_engine", lambda *a, **k: (llm, FakeTokenizer()))


# -- Ctrl-C ----------------------------------------------------------------------------------------------

def test_ctrl_c_prints_one_line_and_exits_130(monkeypatch, tmp_path, capsys):
    """Through collect.py's Hydra entry point: the engine is interrupted in the second of three parts."""
    class LLM:
        calls = 0

        def generate(self, prompts, params, use_tqdm):
            LLM.calls += 1
            if LLM.calls == 2:
                raise KeyboardInterrupt
            return [_output(i, p) for i, p in enumerate(prompts)]

    fake_vllm(monkeypatch)
    _fake_target(monkeypatch, tmp_path, LLM())
    out = tmp_path / "run"
    argv = ["collect.py", f"out_dir={out}", "part_size=1", "capture=false", "progress=false", f"root={ROOT}",
            "hydra/job_logging=none", "hydra/hydra_logging=none", "hydra.output_subdir=null",
            f"hydra.run.dir={tmp_path / 'hydra'}"]
    monkeypatch.setattr(sys, "argv", argv)
    try:
        with pytest.raises(SystemExit) as exit_:  # as `python collect.py` runs it (Hydra finds conf/ beside it)
            runpy.run_path(str(ROOT / "collect.py"), run_name="__main__")
    except KeyboardInterrupt:  # would otherwise end the whole pytest session
        pytest.fail("Ctrl-C escaped collect.py as a KeyboardInterrupt (a long traceback)")
    assert exit_.value.code == 130
    captured = capsys.readouterr()
    lines = [line for line in (captured.out + captured.err).splitlines() if line.strip()]
    # runpy puts collect.py's full path in argv[0]; `python collect.py` leaves it as typed
    command = runner.resume_command([str(ROOT / "collect.py"), *argv[1:]])
    assert lines == [f"interrupted: 1 of 3 parts kept in {out}; resume with: {command}"]
    assert command == shlex.join([runner.resume_command([]), str(ROOT / "collect.py"), *argv[1:]])
    assert [p.name for p in RunFolder(out, {}).finished_parts()] == ["part-00000"]


# -- progress per finished prompt -------------------------------------------------------------------------

def test_progress_moves_per_finished_prompt_through_vllms_request_loop(monkeypatch, tmp_path):
    """vLLM's own ``LLM._run_engine`` (no engine: its ``llm_engine`` finishes one request per step)
    drives the collector's bar: one tick per prompt, not one per part; parts and outputs unchanged."""
    pytest.importorskip("vllm")
    from vllm.entrypoints.llm import LLM as RealLLM
    from vllm.outputs import CompletionOutput, RequestOutput
    from vllm.utils.tqdm_utils import maybe_tqdm

    ticks = []

    class Bar(plain_tqdm):
        def __init__(self, *a, **k):
            super().__init__(*a, **{**k, "file": io.StringIO()})

        def update(self, n=1):
            out = super().update(n)
            ticks.append(self.n)
            return out

    class Engine:  # what LLM._run_engine asks of llm_engine
        def __init__(self, outs):
            self.queue = outs

        def get_num_unfinished_requests(self):
            return len(self.queue)

        def has_unfinished_requests(self):
            return bool(self.queue)

        def step(self):
            ticks.append(("step", len(self.queue)))
            return [self.queue.pop(0)]

    class LLM:
        def generate(self, prompts, params, use_tqdm):
            prompts = list(maybe_tqdm(prompts, use_tqdm=use_tqdm, desc="Rendering prompts"))
            self.llm_engine = Engine([
                RequestOutput(str(i), None, p["prompt_token_ids"], None,
                              [CompletionOutput(0, f"answer {i}", [5, 6, 7], None, None)], True)
                for i, p in enumerate(prompts)])
            return RealLLM._run_engine(self, RequestOutput, use_tqdm=use_tqdm)

    _fake_target(monkeypatch, tmp_path, LLM())
    monkeypatch.setattr(runner, "tqdm", Bar)
    out = tmp_path / "run"
    runner.run(compose(f"out_dir={out}", "part_size=2", "capture=false"))
    # 3 prompts in parts of 2: the bar moves after every request, before the next step starts.
    assert ticks == [("step", 2), 1, ("step", 1), 2, ("step", 1), 3]
    assert [p.name for p in RunFolder(out, {}).finished_parts()] == ["part-00000", "part-00001"]
    # request ids restart in every part (the fake's), so the third prompt's answer is "answer 0"
    assert json.loads((out / "outputs.json").read_text()) == {
        "chat-008": "answer 0", "chat-019": "answer 1", "code_edit-004": "answer 0"}
