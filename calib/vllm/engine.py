"""One engine builder: a composed config -> ``vllm.LLM(...)``, for collect, serve, distill and magpie.

The environment vLLM's processes read (``calib.envs``) is written from the config first: the config
wins over inherited values (:func:`calib.envs.export` returns those it replaced).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from calib import envs

log = logging.getLogger("calib.vllm")


def speculative_config(spec: dict, model_dir: Path, cache_dir: Path | None) -> tuple[dict | None, str]:
    """vLLM's speculative_config (None: plain decoding) and the bank's speculator id."""
    from calib.target import prepare_truncated_drafter

    method = spec["method"]
    if method == "none":  # plain decoding: the reference for output-identity checks
        return None, "none"
    out = {"method": method, "num_speculative_tokens": int(spec["num_speculative_tokens"])}
    if method == "ngram":
        out.update(prompt_lookup_min=int(spec["prompt_lookup_min"]),
                   prompt_lookup_max=int(spec["prompt_lookup_max"]))
        return out, "ngram"
    if method == "suffix":  # vLLM's suffix decoding (arctic-inference: make install-suffix)
        out.update({f"suffix_decoding_{k}": spec[k] for k in ("max_tree_depth", "max_spec_factor", "min_token_prob",
                                                              "max_cached_requests") if spec.get(k) is not None})
        return out, "suffix"
    if spec.get("draft_sample_method"):  # "probabilistic": drafts drawn from q, verified against q (T > 0)
        out["draft_sample_method"] = str(spec["draft_sample_method"])
    if method == "draft_model":
        if spec.get("drafter_layers"):
            drafter = prepare_truncated_drafter(model_dir, int(spec["drafter_layers"]), cache_dir)
            name = drafter.name
        else:
            drafter, name = drafter_folder(spec)
        out["model"] = str(drafter)
        return out, f"draft_model:{name}"
    if method in ("eagle", "eagle3"):
        drafter, name = drafter_folder(spec)
        out["model"] = str(drafter)
        if spec.get("draft_load_format"):  # "dummy": random head weights (plumbing checks only)
            out["draft_load_config"] = {"load_format": spec["draft_load_format"]}
        return out, f"{method}:{name}"
    raise ValueError(f"speculative.method={method!r} is not supported; use ngram, suffix, draft_model, "
                     "eagle or eagle3")


def drafter_folder(spec: Mapping) -> tuple[Path, str]:
    """(local folder, name) of the drafter ``speculative.model`` names: an HF folder (holding config.json),
    or a hub id resolved offline from the local HF cache, as ``model.path`` is (:func:`calib.target.resolve_target`);
    a clear error naming ``speculative.model`` and what to do where it is neither. The name (the folder's, or
    the hub id's last part) is what banks and tables call the drafter; identity is by fingerprint."""
    from calib.target import resolve_target, target_name

    method, model = spec.get("method"), spec.get("model")
    if not model:
        raise ValueError(f"speculative={method}: speculative.model is not set; give the drafter's folder or hub id "
                         f"(speculative.model=<folder or org/name>)")
    folder = resolve_target(model, key="speculative.model")
    return folder, target_name(model, folder, folder.name)


# CPU instruction sets with bf16 matrix arithmetic in hardware: there bf16 is the faster dtype, elsewhere float32
# (docs/profile.md: an AVX512-BF16 EPYC ran bf16 1.3-1.7x faster than float32, an EPYC without AVX-512 4x slower)
BF16_FLAGS = ("avx512_bf16", "amx_bf16")


AUTO_CHOICE = "engine.dtype auto"  # how cpu_dtype's reasons begin where calib, not the user, chose the dtype


def chosen_dtype(why: str) -> str | None:
    """:func:`cpu_dtype`'s reason where calib chose the dtype (``auto`` resolved), for the engine line
    (``CALIB_DTYPE_CHOICE``); None where the user set it."""
    return why if why.startswith(AUTO_CHOICE) else None


def cpu_dtype(requested: str, flags: Sequence[str] | None = None) -> tuple[str, str]:
    """``(dtype, why)`` for a CPU engine: ``requested`` as set unless it is ``auto``, which becomes ``bfloat16`` where
    the CPU has one of :data:`BF16_FLAGS` and ``float32`` where it has none (``flags``: /proc/cpuinfo's)."""
    if str(requested) != "auto":
        return str(requested), "as set (engine.dtype)"
    if flags is None:
        try:
            info = Path("/proc/cpuinfo").read_text()
        except OSError:
            return "auto", f"{AUTO_CHOICE}: the CPU's flags are unreadable, the model's own dtype"
        flags = next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), [])
    has = [f for f in BF16_FLAGS if f in flags]
    if has:
        return "bfloat16", f"{AUTO_CHOICE} -> bfloat16: this CPU computes bf16 in hardware ({' '.join(has)})"
    return "float32", f"{AUTO_CHOICE} -> float32: this CPU has no bf16 arithmetic (no avx512_bf16/amx_bf16)"


# calib's hooks act on vLLM's V1 model runner with synchronous scheduling (calib/vllm/engine_line.py); vLLM 0.32
# picks Model Runner V2 and async scheduling wherever Triton is present (every GPU build), so an engine that calib
# captures or serves through its V1 hooks asks for both explicitly, on every platform.
V1_RUNNER = {"VLLM_USE_V2_MODEL_RUNNER": False}  # environment, for vLLM's processes
SYNC_SCHEDULING = {"async_scheduling": False}  # vllm.LLM keyword arguments


def engine_kwargs(model_dir, engine: Mapping, *, max_num_seqs: int, seed: int, **extra) -> dict[str, Any]:
    """``vllm.LLM``'s keyword arguments from an ``engine`` config section (``enforce_eager``,
    ``max_model_len``, optional ``dtype`` and ``tensor_parallel_size``), the batch width and the seed; ``extra``
    passed as is (``speculative_config``, ``disable_log_stats``, ...)."""
    kwargs: dict[str, Any] = {"model": str(model_dir)}
    if "dtype" in engine:
        kwargs["dtype"] = str(engine["dtype"])  # float32 for output-identity checks
    if int(engine.get("tensor_parallel_size", 1) or 1) > 1:  # worker processes (calib.vllm.ranks)
        kwargs["tensor_parallel_size"] = int(engine["tensor_parallel_size"])
    kwargs.update(enforce_eager=bool(engine["enforce_eager"]), max_model_len=int(engine["max_model_len"]),
                  max_num_seqs=int(max_num_seqs), seed=int(seed), **extra)
    return kwargs


def build_engine(model_dir, engine: Mapping, *, env: Mapping[str, Any], max_num_seqs: int, seed: int,
                 config_of_env: Mapping[str, str] | None = None, **extra):
    """Write ``env`` for vLLM's processes (``calib.envs.export``), then start ``vllm.LLM`` with
    :func:`engine_kwargs`. An inherited variable the config overwrote is named in a warning when
    ``config_of_env`` maps it to the config key that sets it (the variable used to win silently)."""
    replaced = envs.export(env)
    for name, old in replaced.items():
        if config_of_env and name in config_of_env:
            log.warning("ignoring inherited %s=%s: the config's %s wins (set that instead)",
                        name, old, config_of_env[name])
    from vllm import LLM

    return LLM(**engine_kwargs(model_dir, engine, max_num_seqs=max_num_seqs, seed=seed, **extra))
