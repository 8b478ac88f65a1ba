"""Write an :class:`EagleHead` as the checkpoint vLLM 0.32 loads for ``method="eagle"``.

vLLM maps ``fc.weight`` and ``layers.0.*`` (HF names; q/k/v and gate/up are stacked on load) into
``EagleLlamaForCausalLM``; embeddings and lm_head are shared with the target when absent. The
config is the target's with ``num_hidden_layers = 1`` (vLLM's EAGLEConfig renames the architecture)
and the head's draft cost (:data:`calib.cost.draft.DRAFT_COST_KEY`, :func:`head_draft_cost`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file

from calib.atomic import atomic_dir
from calib.cost.draft import DRAFT_COST_KEY
from calib.drafters.eagle.model import head_cost_ratio


def head_draft_cost(target_config) -> float:
    """The draft cost an exported head records: its matmul FLOPs per token against the target's
    (:func:`head_cost_ratio`), to two places (an estimate, not a timing: 0.24 for SmolLM2-135M)."""
    return round(head_cost_ratio(target_config), 2)


def export_head(head, out_dir: str | os.PathLike, dtype: torch.dtype = torch.bfloat16, extra: dict | None = None,
                extra_tensors: dict | None = None) -> Path:
    """``extra`` updates the config; ``extra_tensors`` are stored as given (their own dtypes)."""
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tensors = {"fc.weight": head.fc.weight}
    for name, t in head.layer.state_dict().items():
        if name.startswith("input_layernorm"):
            continue
        tensors[f"layers.0.{name}"] = t
    tensors = {k: v.detach().to(dtype).contiguous().cpu() for k, v in tensors.items()}
    tensors.update({k: v.detach().contiguous().cpu() for k, v in (extra_tensors or {}).items()})
    config = head.config.to_dict()
    config.update(num_hidden_layers=1, architectures=["LlamaForCausalLM"], torch_dtype=str(dtype).split(".")[-1])
    config[DRAFT_COST_KEY] = head_draft_cost(head.config)  # head.config is the target's (all its layers)
    config.update(extra or {})
    config.pop("_attn_implementation", None)
    with atomic_dir(out) as stage:
        save_file(tensors, stage / "model.safetensors", metadata={"format": "pt"})
        (stage / "config.json").write_text(json.dumps(config, indent=2, default=str))
    return out


def load_exported(head, path: str | os.PathLike):
    """Load an :func:`export_head` checkpoint back into ``head`` (strict: every tensor must match)."""
    from safetensors.torch import load_file

    tensors = load_file(str(Path(path) / "model.safetensors"))
    head.fc.weight.data.copy_(tensors.pop("fc.weight").float())
    layer = {k.removeprefix("layers.0."): v.float() for k, v in tensors.items()}
    head.layer.load_state_dict({**layer, **{k: v for k, v in head.layer.state_dict().items()
                                            if k.startswith("input_layernorm")}}, strict=True)
    return head
