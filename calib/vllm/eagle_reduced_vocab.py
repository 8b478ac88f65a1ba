"""vLLM 0.32's EAGLE-1 Llama head drafting over a reduced vocabulary (architecture :data:`ARCHITECTURE`).

``EagleLlamaForCausalLM`` (fc + one decoder layer) scores the target's whole vocabulary with the
target's shared lm_head. This subclass owns an lm_head of ``draft_vocab_size`` rows and a
draft-to-target map ``d2t`` (EAGLE-3's convention: target id = draft id + d2t[draft id]);
``compute_logits`` returns target-vocabulary logits, -inf outside the draft vocabulary, so vLLM's
argmax, its probabilistic drafting and calib's patch set all see target ids. calib's plugin registers
it (calib/vllm/plugin.py); calib/drafters/eagle/reduced_vocab.py writes such a head.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from vllm.config import VllmConfig
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
from vllm.model_executor.models.llama_eagle import EagleLlamaForCausalLM
from vllm.model_executor.models.utils import maybe_prefix

from calib.vllm.plugin import D2T_KEY, REDUCED_VOCAB_EAGLE

ARCHITECTURE = REDUCED_VOCAB_EAGLE  # config.json "architectures"; kept as is by vLLM's EAGLEConfig (it starts with "Eagle")


def target_ids_from_d2t(d2t: torch.Tensor, vocab_size: int, where: str) -> torch.Tensor:
    """The target id of every draft id (``arange + d2t``) [draft_vocab_size], or a ``ValueError``
    naming ``where`` if one falls outside the target vocabulary or two draft ids share a target id."""
    target_ids = torch.arange(d2t.numel(), device=d2t.device) + d2t.long().view(-1)
    if target_ids.numel() and (int(target_ids.min()) < 0 or int(target_ids.max()) >= vocab_size):
        raise ValueError(f"{where}: {D2T_KEY} maps a draft id outside the target vocabulary [0, {vocab_size})")
    if torch.unique(target_ids).numel() != target_ids.numel():
        raise ValueError(f"{where}: {D2T_KEY} maps two draft ids to one target id")
    return target_ids


class EagleLlamaReducedVocabForCausalLM(EagleLlamaForCausalLM):
    """EAGLE-1 Llama head with its own ``draft_vocab_size``-row lm_head and a ``d2t`` map."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        config = self.config
        self.draft_vocab_size = int(config.draft_vocab_size)
        if not 0 < self.draft_vocab_size <= config.vocab_size:
            raise ValueError(f"{ARCHITECTURE}: draft_vocab_size {self.draft_vocab_size} must be in "
                             f"(0, vocab_size {config.vocab_size}] (the drafter's config.json)")
        self.lm_head = ParallelLMHead(self.draft_vocab_size, config.hidden_size,
                                      prefix=maybe_prefix(prefix, "lm_head"))
        self.logits_processor = LogitsProcessor(self.draft_vocab_size, scale=getattr(config, "logit_scale", 1.0))
        # why a buffer, not a parameter: the loader must not treat the map as a weight to shard or cast
        self.register_buffer("draft_to_target", torch.arange(self.draft_vocab_size), persistent=False)  # [Vd]

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        draft_logits = self.logits_processor(self.lm_head, hidden_states)  # [N, Vd]
        if draft_logits is None:
            return None
        logits = draft_logits.new_full((draft_logits.shape[0], self.config.vocab_size), float("-inf"))  # [N, V]
        logits[:, self.draft_to_target] = draft_logits
        return logits

    def get_top_tokens(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Greedy target ids [N] without the full-vocabulary tensor (vLLM's local-argmax path)."""
        draft_logits = self.logits_processor(self.lm_head, hidden_states)  # [N, Vd]
        return self.draft_to_target[draft_logits.argmax(dim=-1)]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]):
        seen = {"d2t": False, "lm_head": False}

        def rest():
            for name, tensor in weights:
                if name.endswith(D2T_KEY):
                    self._set_d2t(tensor)
                    seen["d2t"] = True
                    continue
                seen["lm_head"] |= "lm_head" in name
                yield name, tensor

        super().load_weights(rest())
        missing = [k for k, found in seen.items() if not found]
        if missing:
            raise ValueError(f"{ARCHITECTURE}: the checkpoint has no {' and no '.join(missing)} tensor; a "
                             "reduced-vocabulary head stores its own lm_head.weight and d2t")

    def _set_d2t(self, d2t: torch.Tensor) -> None:
        if d2t.numel() != self.draft_vocab_size:
            raise ValueError(f"{ARCHITECTURE}: {D2T_KEY} has {d2t.numel()} entries, config draft_vocab_size "
                             f"is {self.draft_vocab_size}")
        target_ids = target_ids_from_d2t(d2t, self.config.vocab_size, f"{ARCHITECTURE} checkpoint")
        self.draft_to_target.copy_(target_ids.to(self.draft_to_target.device))
