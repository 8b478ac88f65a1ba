# Typed stub for calib/envs.py: the type each variable reads as (a type checker sees these; the module
# resolves them through __getattr__). tests/vllm/test_knobs.py keeps this list equal to envs.REGISTRY.
from collections.abc import Callable, Mapping
from typing import Any

class EnvVar:
    name: str
    type: str
    default: Any
    doc: str
    read: Callable[[], Any]
    def __init__(self, name: str, type: str, default: Any, doc: str, read: Callable[[], Any]) -> None: ...

REGISTRY: dict[str, EnvVar]

CALIB_CACHE_DIR: str
CALIB_COLLECT_DIR: str | None
CALIB_NGRAM: tuple[int, ...]
CALIB_ROUTING: bool
CALIB_SHADOW_ROUTER: str | None
CALIB_SERVE: str | None  # JSON of calib.serve.knobs.ServeKnobs
CALIB_DTYPE_CHOICE: str | None  # why engine.dtype auto became this dtype (calib.vllm.engine.cpu_dtype)
CALIB_CPU_SAMPLING_FIX: bool
CALIB_LEAN_RECOVERED_DRAW: bool
CALIB_PLAIN_DRAW: bool
TRITON_INTERPRET: bool
WANDB_MODE: str
VLLM_ENABLE_V1_MULTIPROCESSING: bool
VLLM_CPU_KVCACHE_SPACE: str | None
VLLM_USE_V2_MODEL_RUNNER: bool | None
VLLM_CPU_NUM_OF_RESERVED_CPU: str | None

def export(values: Mapping[str, Any]) -> dict[str, str]: ...
