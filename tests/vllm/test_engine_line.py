"""One engine line, never silently off (issue 29, Must 4), without an engine.

The decision (:func:`calib.vllm.engine_line.decide`) over V1/V2 x sync/async x capture/serve, the facts read
from vLLM 0.32's config classes (their attribute names checked against the installed vLLM), the plugin's
worker hook (one line on rank 0, modes that cannot act stood down) and the V2 wiring (calib's tables put in
as the speculator's acceptance estimator when V2's runner has built its KV cache).
"""

from __future__ import annotations

import json
import logging
import os
from types import SimpleNamespace as NS

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton (as test_v2_estimator)

import pytest

from calib.vllm.engine_line import ADAPTIVE_FIX, SYNC_FIX, V1_FIX, EngineFacts, decide, facts_from_config


def _facts(capture=False, serve=False, v2=False, async_=False, method="eagle", k=4, adaptive=False):
    return EngineFacts(capture=capture, serve=serve, v2_runner=v2, async_scheduling=async_, method=method,
                       k=k if method else None, adaptive_verification=adaptive)


@pytest.mark.parametrize("method", ["eagle", "ngram"])
def test_v1_sync_acts(method):
    states, line = decide(_facts(capture=True, v2=False, method=method))
    assert states["capture"].on and line == f"calib capture: ON (V1 runner, sync scheduling, {method} K=4)"
    states, line = decide(_facts(serve=True, method=method))
    assert states["serve"].on and line == f"calib serve: ON (V1 runner, sync scheduling, {method} K=4)"


@pytest.mark.parametrize("mode", ["capture", "serve"])
def test_v1_async_is_off_naming_what_to_set(mode):
    states, line = decide(_facts(**{mode: True}, async_=True))
    assert not states[mode].on
    assert line.startswith(f"calib {mode}: OFF — async scheduling on the V1 runner") and line.endswith(f"set {SYNC_FIX}")


@pytest.mark.parametrize("async_", [False, True])
def test_v2(async_):
    # capture hooks V1 only
    states, line = decide(_facts(capture=True, v2=True, async_=async_))
    assert not states["capture"].on and "Model Runner V2" in line and V1_FIX in line
    # serving: through V2's adaptive verification when it is on (a model drafter), else off with what to set
    states, line = decide(_facts(serve=True, v2=True, async_=async_, adaptive=True))
    assert states["serve"].on and line.startswith("calib serve: ON via V2 adaptive verification")
    assert f"async scheduling {'on' if async_ else 'off'}" in line
    states, line = decide(_facts(serve=True, v2=True, async_=async_))
    assert not states["serve"].on and line.endswith(f"set {ADAPTIVE_FIX}")
    states, line = decide(_facts(serve=True, v2=True, async_=async_, method="ngram", adaptive=True))
    assert not states["serve"].on and "ngram" in line and V1_FIX in line


def test_both_modes_one_line_and_none_asked_no_line():
    states, line = decide(_facts(capture=True, serve=True, v2=True, adaptive=True))
    assert line.count("\n") == 0 and line.startswith("calib: capture OFF") and "| serve ON via V2" in line
    assert decide(_facts()) == ({}, None)  # calib not switched on: silent
    states, line = decide(_facts(serve=True, method=None))
    assert line.startswith("calib serve: OFF — the engine runs no speculative decoding; set --speculative-config")
    states, line = decide(EngineFacts(serve=True, v2_runner=False, async_scheduling=False, capture=False,
                                      method="eagle", k=4, rejection_sample_method="strict"))
    assert not states["serve"].on and "rejection_sample_method" in line


def test_facts_read_vllms_config_attributes():
    """The attributes facts_from_config reads exist on vLLM 0.32's config classes."""
    from vllm.config import SchedulerConfig, SpeculativeConfig, VllmConfig

    assert isinstance(VllmConfig.use_v2_model_runner, property)
    fields = {**SchedulerConfig.__dataclass_fields__}
    assert "async_scheduling" in fields
    spec_fields = SpeculativeConfig.__dataclass_fields__
    for name in ("method", "num_speculative_tokens", "enable_adaptive_verification", "rejection_sample_method"):
        assert name in spec_fields, name
    cfg = NS(use_v2_model_runner=True, scheduler_config=NS(async_scheduling=True),
             speculative_config=NS(method="eagle3", num_speculative_tokens=3, enable_adaptive_verification=True,
                                   rejection_sample_method="standard"))
    f = facts_from_config(cfg, capture=False, serve=True)
    assert (f.v2_runner, f.async_scheduling, f.method, f.k, f.adaptive_verification) == (True, True, "eagle3", 3, True)
    f = facts_from_config(NS(use_v2_model_runner=False, scheduler_config=NS(async_scheduling=None),
                             speculative_config=None), capture=True, serve=False)
    assert f.method is None and not f.async_scheduling and not f.v2_runner


# --- the plugin: worker hook, stand-down, V2 wiring ----------------------------------------------------

@pytest.fixture
def plugin(monkeypatch):
    from calib.vllm import patches, plugin
    from calib.vllm.patches import PatchSet, RunnerSubscriber

    serve_sub = RunnerSubscriber()

    def ensure(runner, log_failure=True):  # Server.ensure: the tables checked against the engine's config
        srv = serve_sub.server
        srv.seen.append(runner)
        if srv.refuse:
            srv.failed, srv.stats.disabled_reason = True, "TablesError: target model: tables t were fitted for ..."

    serve_sub.server = NS(failed=False, stats=NS(disabled_reason=None), tables_dir="somewhere", seen=[],
                          refuse=False, ensure=ensure)
    capture_sub = RunnerSubscriber()
    ps = PatchSet([serve_sub, capture_sub])  # not installed on vLLM's classes
    monkeypatch.setattr(patches, "_INSTALLED", ps)
    monkeypatch.setattr(plugin, "_MODES", {"serve": serve_sub, "capture": capture_sub})
    monkeypatch.setenv("CALIB_SERVE", '{"tables": "somewhere"}')
    monkeypatch.setenv("CALIB_COLLECT_DIR", "/tmp/capture")
    wired = []
    monkeypatch.setattr(plugin, "wire_v2_estimator", lambda knobs: wired.append(knobs.tables))
    return NS(mod=plugin, ps=ps, serve=serve_sub, capture=capture_sub, wired=wired)


def _config(v2, async_, adaptive=False, method="eagle"):
    return NS(use_v2_model_runner=v2, scheduler_config=NS(async_scheduling=async_, max_num_seqs=8),
              model_config=NS(model="/m", max_model_len=2048),
              speculative_config=NS(method=method, num_speculative_tokens=4, enable_adaptive_verification=adaptive,
                                    rejection_sample_method="standard"))


def _calib_lines(caplog):
    return [r.getMessage() for r in caplog.records if r.name == "calib.vllm"]


def test_v1_sync_engine_keeps_both_modes_and_logs_one_line(plugin, caplog):
    with caplog.at_level(logging.INFO, logger="calib.vllm"):
        plugin.mod.engine_start(_config(False, False))
    want = ("calib: capture ON (V1 runner, sync scheduling, eagle K=4) | serve ON (V1 runner, sync scheduling, "
            "eagle K=4, tables somewhere)")
    (line,) = _calib_lines(caplog)
    # the default step cost was fitted on one machine: elsewhere the line carries the note, at WARNING
    assert line == want or (line.startswith(want + " — step cost ") and "re-run bench/profile_step.py" in line), line
    assert caplog.records[-1].levelno == (logging.INFO if line == want else logging.WARNING)
    assert plugin.ps.subscribers == (plugin.serve, plugin.capture) and not plugin.serve.server.failed
    (view,) = plugin.serve.server.seen  # the tables were checked at engine start, on the engine's config
    assert (view.max_num_reqs, view.max_model_len, view.model_config.model) == (8, 2048, "/m")


def test_tables_refused_at_engine_start_are_in_the_line(plugin, caplog):
    plugin.serve.server.refuse = True
    with caplog.at_level(logging.INFO, logger="calib.vllm"):
        plugin.mod.engine_start(_config(False, False))
    (line,) = _calib_lines(caplog)
    assert line.startswith("calib: capture ON (V1 runner, sync scheduling, eagle K=4) | serve OFF — tables refused: "
                           "TablesError: target model") and "python train.py" in line
    assert plugin.ps.subscribers == (plugin.capture,) and caplog.records[-1].levelno == logging.WARNING


def test_v2_engine_stands_the_v1_modes_down_and_says_why(plugin, caplog):
    with caplog.at_level(logging.INFO, logger="calib.vllm"):
        plugin.mod.engine_start(_config(True, True))
    (line,) = _calib_lines(caplog)
    assert "capture OFF" in line and "serve OFF" in line and caplog.records[-1].levelno == logging.WARNING
    assert plugin.ps.subscribers == () and plugin.serve.server.failed
    assert "Model Runner V2" in plugin.serve.server.stats.disabled_reason and plugin.wired == []


def test_v2_adaptive_engine_wires_the_estimator(plugin, caplog):
    with caplog.at_level(logging.INFO, logger="calib.vllm"):
        plugin.mod.engine_start(_config(True, True, adaptive=True))
    assert plugin.wired == ["somewhere"] and plugin.serve not in plugin.ps.subscribers


def test_only_rank_0_logs(plugin, caplog):
    with caplog.at_level(logging.INFO, logger="calib.vllm"):
        plugin.mod.engine_start(_config(False, False), rank=1)
    assert _calib_lines(caplog) == []


def test_the_worker_hook_runs_engine_start_after_init(plugin, monkeypatch, caplog):
    import vllm.v1.worker.worker_base as wb

    class Worker:
        def __init__(self, vllm_config, local_rank, rank, distributed_init_method, is_driver_worker=False):
            self.vllm_config, self.rank = vllm_config, rank

    monkeypatch.setattr(wb, "WorkerBase", Worker)
    monkeypatch.setattr(plugin.mod, "_WORKER_HOOKED", False)
    plugin.mod.hook_engine_start()
    with caplog.at_level(logging.INFO, logger="calib.vllm"):
        Worker(_config(False, True), 0, 0, "tcp://x")
        Worker(vllm_config=None, local_rank=0, rank=0, distributed_init_method="x")  # a broken config: logged
    lines = _calib_lines(caplog)
    assert len(lines) == 2 and "async scheduling" in lines[0] and lines[1].startswith("calib: OFF — could not decide")


def test_v2_wiring_puts_the_tables_in_as_the_acceptance_estimator(tmp_path, monkeypatch, caplog):
    """wire_v2_estimator wraps V2's GPUModelRunner.initialize_kv_cache; v2_serve checks the tables against the
    engine (by content) and installs them on the speculator (the attributes V2's DraftModelSpeculator has)."""
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner as V2Runner

    from calib.serve.knobs import ServeKnobs
    from calib.serve.v2_estimator import CalibAcceptanceEstimator
    from calib.tables import save
    from calib.vllm import plugin
    from tests.serve.decide_cases import synthetic_tables
    from tests.serve.test_v2_estimator import MODEL_META, D

    tables = save(tmp_path / "t", synthetic_tables(1, chains=("model",)), MODEL_META)
    calls = []
    monkeypatch.setattr(V2Runner, "initialize_kv_cache", lambda self, *a, **k: calls.append("vllm"))
    monkeypatch.setattr(plugin, "_V2_WIRED", False)
    plugin.wire_v2_estimator(ServeKnobs(tables=str(tables), model_id="synthetic-model"))

    class Speculator:
        max_num_reqs, num_speculative_steps, device = 5, D, torch.device("cpu")
        acceptance_estimator = object()

    head = tmp_path / "head"  # not a model folder: no fingerprint, the names are compared
    runner = NS(speculator=Speculator(), adaptive_verification=None, model_config=NS(model=str(tmp_path / "m")),
                speculative_config=NS(method="eagle", num_speculative_tokens=D, model=str(head),
                                      draft_model_config=NS(model=str(head))))
    with caplog.at_level(logging.INFO, logger="calib.vllm"):
        V2Runner.initialize_kv_cache(runner, None)
    assert calls == ["vllm"] and isinstance(runner.speculator.acceptance_estimator, CalibAcceptanceEstimator)
    assert any("V2's acceptance estimator" in m for m in _calib_lines(caplog))
    # tables for another drafter: refused at engine start, vLLM's estimator kept, one error line
    runner.speculative_config.model = str(tmp_path / "other")
    runner.speculative_config.draft_model_config = NS(model=str(tmp_path / "other"))
    runner.speculator.acceptance_estimator = kept = object()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="calib.vllm"):
        V2Runner.initialize_kv_cache(runner, None)
    assert runner.speculator.acceptance_estimator is kept
    (line,) = _calib_lines(caplog)
    assert line.startswith("calib serve: OFF — cannot be V2's acceptance estimator") and "eagle:other" in line


def test_collect_runs_the_v1_runner_with_sync_scheduling_and_says_so(monkeypatch, tmp_path, caplog):
    from calib import envs
    from calib.collect import runner
    from tests.collect.test_runner import Stop, compose, fake_vllm

    for name in envs.REGISTRY:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")  # inherited: the config wins
    seen = {}

    class LLM:
        def __init__(self, **kwargs):
            seen.update(kwargs, env=os.environ.get("VLLM_USE_V2_MODEL_RUNNER"))
            raise Stop

    fake_vllm(monkeypatch, LLM)
    with caplog.at_level(logging.INFO, logger="calib.collect"), pytest.raises(Stop):
        runner._engine(compose(), tmp_path, None, tmp_path / "capture", (1, 4, 4))
    assert seen["env"] == "0" and seen["async_scheduling"] is False
    assert "collect: vLLM's V1 model runner with sync scheduling" in caplog.text


# --- serving's step cost fitted on other hardware: said in the line (issue 43, Must 2) -------------------------

NOTE = "step cost c.json: the step cost was fitted on cpu (AMD EPYC), this engine steps on cuda: ..."


@pytest.mark.parametrize("v2", [False, True])
def test_a_cost_fitted_elsewhere_is_in_the_serve_line(v2):
    f = EngineFacts(capture=True, serve=True, v2_runner=v2, async_scheduling=v2, method="eagle", k=4,
                    adaptive_verification=v2, cost_note=NOTE)
    states, line = decide(f)
    assert states["serve"].on and states["serve"].text().endswith(f" — {NOTE}")
    assert NOTE not in states["capture"].text() and line.count(NOTE) == 1


def _cost_file(tmp_path, source: dict):
    from dataclasses import replace

    from calib.cost.step import load_step_cost, save_step_cost
    from calib.serve.knobs import DEFAULT_COST

    path = tmp_path / "cost.json"
    save_step_cost(replace(load_step_cost(DEFAULT_COST), source=source), path)
    return json.dumps({"tables": "t", "cost": str(path)})


def test_cost_note_compares_the_device_and_the_cpu(tmp_path):
    from calib.cost.step import this_machine
    from calib.vllm.engine_line import cost_note

    shipped = cost_note("cuda", '{"tables": "t"}')  # the default: the 2-core CPU's step cost
    assert "data/cost/smollm2-135m-cpu-step.json: the step cost was fitted on cpu (AMD EPYC" in shipped
    assert "this engine steps on cuda" in shipped and "bench/profile_step.py --step-cost PATH" in shipped
    assert cost_note("cpu", _cost_file(tmp_path, {"cpu": this_machine()})) == ""
    assert cost_note("cuda", _cost_file(tmp_path, {"cpu": "Host CPU", "device": "cuda"})) == ""
    other = cost_note("cpu", _cost_file(tmp_path, {"cpu": "Some CPU, 64 cores, no AVX-512"}))
    assert "fitted on 'Some CPU, 64 cores, no AVX-512', this machine is" in other
    assert cost_note("cuda", '{"tables": "t", "cost": "1.0,0.01"}') == ""  # a verify-only curve records no machine
    assert cost_note("cuda", "not json") == ""  # the server refuses bad knobs itself, by name


def test_cost_note_compares_the_gpu_model_where_both_know_it(tmp_path, monkeypatch):
    """Issue 43: an A100's step cost on an H100 is said (one device kind, another model); the same model, or a fit
    that recorded no model, says nothing beyond the kind."""
    from calib.cost import step
    from calib.vllm.engine_line import cost_note

    monkeypatch.setattr(step, "accelerator_name", lambda device: "NVIDIA H100 80GB HBM3")
    other = cost_note("cuda", _cost_file(tmp_path, {"cpu": "Host", "device": "cuda", "accelerator": "NVIDIA A100-SXM4-40GB"}))
    assert "fitted on cuda 'NVIDIA A100-SXM4-40GB', this engine steps on cuda 'NVIDIA H100 80GB HBM3'" in other
    assert "bench/profile_step.py --step-cost PATH" in other
    assert cost_note("cuda", _cost_file(tmp_path, {"device": "cuda", "accelerator": "NVIDIA H100 80GB HBM3"})) == ""
    assert cost_note("cuda", _cost_file(tmp_path, {"device": "cuda"})) == ""  # an older fit: the kind alone


def test_facts_carry_the_cost_note_of_the_engines_device(monkeypatch):
    monkeypatch.setenv("CALIB_SERVE", '{"tables": "t"}')
    cfg = NS(use_v2_model_runner=True, scheduler_config=NS(async_scheduling=True), device_config=NS(device_type="cuda"),
             speculative_config=NS(method="eagle", num_speculative_tokens=4, enable_adaptive_verification=True,
                                   rejection_sample_method="standard"))
    assert "this engine steps on cuda" in facts_from_config(cfg, capture=False, serve=True).cost_note
    assert facts_from_config(cfg, capture=True, serve=False).cost_note == ""


def test_the_dtype_calib_chose_is_stated_in_the_engine_line(monkeypatch):
    """Issue 43, Must 4: where serve.py or collect.py resolved engine.dtype auto for the CPU (CALIB_DTYPE_CHOICE,
    written for the engine), the engine line says which dtype and why, serving and capture alike; unset, nothing."""
    from calib.vllm.engine import cpu_dtype
    from calib.vllm.engine_line import decide

    _, why = cpu_dtype("auto", flags=["avx2"])
    cfg = NS(use_v2_model_runner=False, scheduler_config=NS(async_scheduling=False), device_config=NS(device_type="cpu"),
             model_config=NS(dtype="torch.float32"),
             speculative_config=NS(method="ngram", num_speculative_tokens=4, rejection_sample_method="standard"))
    monkeypatch.setenv("CALIB_SERVE", '{"tables": "t", "cost": "1.0,0.01"}')
    monkeypatch.setenv("CALIB_DTYPE_CHOICE", why)
    for capture, serve in ((False, True), (True, False)):
        _, text = decide(facts_from_config(cfg, capture=capture, serve=serve))
        assert "engine.dtype auto -> float32: this CPU has no bf16 arithmetic" in text, text
    monkeypatch.delenv("CALIB_DTYPE_CHOICE")
    _, text = decide(facts_from_config(cfg, capture=True, serve=False))
    assert "engine.dtype" not in text


def test_dtype_note_names_the_banks_dtype_and_the_served_one(tmp_path, monkeypatch):
    """Issue 43: tables from banks collected in bf16, served in float32 (or the other way), are said in the line."""
    from calib.vllm.engine_line import decide, dtype_note

    def tables(*dtypes):
        d = tmp_path / "-".join(map(str, dtypes))
        d.mkdir()
        (d / "tables.json").write_text(json.dumps({"banks": [{"path": "b", "dtype": t} for t in dtypes]}))
        return json.dumps({"tables": str(d)})

    note = dtype_note("torch.float32", tables("bfloat16", "float32"))
    assert "collected in bfloat16, this engine serves in float32" in note and "engine.dtype=float32" in note
    assert dtype_note("torch.bfloat16", tables("bfloat16")) == ""
    assert dtype_note("torch.float32", tables(None)) == ""  # banks before the manifest recorded a dtype
    assert dtype_note("torch.float32", json.dumps({"tables": str(tmp_path / "missing")})) == ""
    facts = EngineFacts(capture=False, serve=True, v2_runner=False, async_scheduling=False, method="ngram", k=4,
                        dtype_note=note)
    assert note in decide(facts)[1]
