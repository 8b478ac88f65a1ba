"""The one engine builder (calib.vllm.engine): each caller's ``vllm.LLM`` kwargs are what they were before
the builder existed, and serve.py hands the workers its knobs in CALIB_SERVE. vLLM is faked."""

import sys
import types
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from calib import envs
from calib.serve.knobs import ServeKnobs

ROOT = Path(__file__).resolve().parents[2]


class Stop(Exception):
    pass


@pytest.fixture
def started(monkeypatch):
    """A fake ``vllm.LLM`` recording its kwargs and the calib variables it was started with."""
    for name in envs.REGISTRY:
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    seen = {}

    class LLM:
        def __init__(self, **kwargs):
            seen.update(kwargs=kwargs, env={n: envs.os.environ.get(n) for n in envs.REGISTRY})
            raise Stop

    mod = types.ModuleType("vllm")
    mod.LLM, mod.SamplingParams = LLM, lambda **kw: kw
    monkeypatch.setitem(sys.modules, "vllm", mod)
    return seen


def compose(name: str, *overrides: str) -> dict:
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from calib.policies.config_store import store_policy_configs

    store_policy_configs()  # conf/serve.yaml's policy group comes from the policy registry
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = hydra_compose(name, overrides=[f"root={ROOT}", *overrides])
    return OmegaConf.to_container(cfg, resolve=True)


def test_serve_engine_kwargs_and_knobs(started, monkeypatch, tmp_path):
    import calib.target
    from calib.vllm import serve_runner as runner
    from calib.vllm.engine import cpu_dtype

    monkeypatch.setattr(calib.target, "prepare_target", lambda *a, **k: tmp_path)
    cfg = compose("serve", "policy=calib_two_drafter", "speculative=ngram")
    with pytest.raises(Stop):
        runner.build_engine(cfg, ROOT, max_num_seqs=4)
    e = cfg["engine"]
    spec = cfg["speculative"]
    assert started["kwargs"] == {
        "model": str(tmp_path), "dtype": cpu_dtype(str(e["dtype"]))[0], "enforce_eager": bool(e["enforce_eager"]),
        "max_model_len": int(e["max_model_len"]), "max_num_seqs": 4, "seed": int(cfg["seed"]),
        "disable_log_stats": False,
        "speculative_config": {"method": "ngram", "num_speculative_tokens": int(spec["num_speculative_tokens"]),
                               "prompt_lookup_min": int(spec["prompt_lookup_min"]),
                               "prompt_lookup_max": int(spec["prompt_lookup_max"])},
        "async_scheduling": False}  # a calib arm serves through the V1 hooks: sync scheduling and the V1 runner
    assert started["env"]["VLLM_USE_V2_MODEL_RUNNER"] == "0"
    knobs = ServeKnobs.from_json(started["env"]["CALIB_SERVE"])
    assert knobs.tables == str(ROOT / cfg["tables"]) and knobs.cost == str(ROOT / cfg["serve"]["cost"])
    assert knobs.chains == tuple(cfg["policy"]["chains"]) and knobs.draft_cost == float(cfg["serve"]["draft_cost"])
    assert started["env"]["CALIB_COLLECT_DIR"] is None and started["env"]["CALIB_CPU_SAMPLING_FIX"] == "1"

    with pytest.raises(Stop):
        runner.build_engine(compose("serve", "policy=none"), ROOT, max_num_seqs=2)
    assert started["env"]["CALIB_SERVE"] is None and started["kwargs"]["speculative_config"] is None
    # vLLM's own arms keep vLLM's defaults (what a user deploys): no scheduling or runner asked for
    assert "async_scheduling" not in started["kwargs"] and started["env"]["VLLM_USE_V2_MODEL_RUNNER"] is None
    # bench/profile_step.py: every arm on calib's engine, whose V1 runner its timers wrap
    with pytest.raises(Stop):
        runner.build_engine(compose("serve", "policy=none"), ROOT, max_num_seqs=2, v1_sync=True)
    assert started["kwargs"]["async_scheduling"] is False and started["env"]["VLLM_USE_V2_MODEL_RUNNER"] == "0"


def test_recipe_engines_kwargs(started, tmp_path):
    from calib.drafters.eagle import magpie

    with pytest.raises(Stop):
        magpie.generate(tmp_path / "raw.jsonl", str(tmp_path), n_chat=1, n_code=0, seed=3, max_num_seqs=7,
                        kv_cache_gb=5)
    assert started["kwargs"] == {"model": str(tmp_path), "enforce_eager": True, "max_model_len": 2048,
                                 "max_num_seqs": 7, "seed": 3}
    assert started["env"]["VLLM_CPU_KVCACHE_SPACE"] == "5" and started["env"]["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1"
    assert started["env"]["CALIB_COLLECT_DIR"] is None


def test_collect_engine_kwargs(started, tmp_path):
    """collect resolves engine.dtype=auto on a CPU as serve.py does (issue 43: they used to differ on CPUs
    without bf16 arithmetic, so a bank's acceptance was not the served engine's)."""
    from calib.collect import runner
    from calib.vllm.engine import cpu_dtype

    cfg = compose("collect")
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 4}
    with pytest.raises(Stop):
        runner._engine(cfg, tmp_path, spec, tmp_path / "capture", (1, 4, 4))
    e = cfg["engine"]
    assert started["kwargs"] == {
        "model": str(tmp_path), "speculative_config": spec, "dtype": cpu_dtype(str(e.get("dtype", "auto")))[0],
        "enforce_eager": bool(e["enforce_eager"]), "max_model_len": int(e["max_model_len"]),
        "max_num_seqs": int(cfg["concurrency"]), "seed": int(cfg["seed"]),
        "per_request_spec_decode_metrics": "detailed",
        "async_scheduling": False}  # capture hooks V1 with sync scheduling (issue 29; VLLM_USE_V2_MODEL_RUNNER=0 too)


def test_a_bank_records_the_dtype_it_was_collected_in(tmp_path):
    from calib.collect.runner import recorded_dtype

    assert recorded_dtype("float32", tmp_path) == "float32"
    assert recorded_dtype("auto", tmp_path) == "auto"  # no config.json: unknown, said as such
    (tmp_path / "config.json").write_text('{"torch_dtype": "bfloat16"}')
    assert recorded_dtype("auto", tmp_path) == "bfloat16"


def test_auto_dtype_on_a_cpu_follows_its_bf16_arithmetic():
    """Issue 43 Must 4: engine.dtype=auto on a CPU is bf16 where it computes bf16 in hardware, else float32; a set
    dtype is kept; the reason names the flags."""
    from calib.vllm.engine import cpu_dtype

    assert cpu_dtype("auto", ["avx2", "avx512f", "avx512_bf16"]) == (
        "bfloat16", "engine.dtype auto -> bfloat16: this CPU computes bf16 in hardware (avx512_bf16)")
    assert cpu_dtype("auto", ["avx2", "amx_bf16", "avx512_bf16"])[0] == "bfloat16"
    dtype, why = cpu_dtype("auto", ["avx2", "fma"])  # a 2-core EPYC without AVX-512: float32 4x faster there
    assert dtype == "float32" and "no bf16 arithmetic" in why
    assert cpu_dtype("float32", ["amx_bf16"]) == ("float32", "as set (engine.dtype)")
    assert cpu_dtype("auto")[0] in ("bfloat16", "float32", "auto")  # this machine's own flags
