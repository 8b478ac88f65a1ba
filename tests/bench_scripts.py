"""bench/ scripts are scripts, not a package: tests load one by path."""

import importlib.util
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"


def load_bench(name: str, module_name: str | None = None):
    """The module of ``bench/<name>.py`` (under ``module_name``, default ``bench_<name>``)."""
    spec = importlib.util.spec_from_file_location(module_name or f"bench_{name}", BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
