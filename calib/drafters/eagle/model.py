"""The EAGLE head and its training objective.

Mirrors vLLM 0.32's ``EagleLlamaForCausalLM`` (``vllm/model_executor/models/llama_eagle.py``):

    x = fc(concat(embed(token_{t+1}), h_t))          # h_t: the target's final (post-norm) hidden state
    x = decoder_layer(x)                              # one Llama layer without its input layernorm
    logits = target.lm_head(x)                        # no extra norm; embeddings and lm_head shared

so the head predicts ``h_{t+1}`` from the token the target emitted at t+1 and the target's state at
t. Training (EAGLE): smooth-L1 regression of ``h_{t+1}`` plus cross-entropy of the head's
next-token distribution against the target's (soft labels from the target's logits).
"""

from __future__ import annotations

import copy

import torch
from torch import nn


class EagleHead(nn.Module):
    """fc + one Llama decoder layer; embeddings and lm_head are the target's (frozen, not owned)."""

    def __init__(self, config):
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

        config = copy.deepcopy(config)
        config._attn_implementation = "sdpa"  # causal without an explicit mask (sequences are unpadded)
        self.config = config
        self.fc = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=False)
        self.layer = LlamaDecoderLayer(config, layer_idx=0)
        self.layer.input_layernorm = nn.Identity()  # as in vLLM (and EAGLE): the first layer has none
        self.rotary = LlamaRotaryEmbedding(config)

    def forward(self, token_embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """``token_embeds`` [B, T, H] of tokens t+1, ``hidden`` [B, T, H] target states at t → [B, T, H]."""
        x = self.fc(torch.cat([token_embeds, hidden], dim=-1))
        positions = torch.arange(x.shape[1], device=x.device)[None].expand(x.shape[0], -1)
        return self.layer(x, position_ids=positions, position_embeddings=self.rotary(x, positions))


def eagle_loss(head: EagleHead, embed: nn.Module, lm_head: nn.Module, input_ids: torch.Tensor,
               hidden: torch.Tensor, token_weight: float = 0.1,
               target_hidden: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
    """EAGLE's objective on one batch of target outputs.

    ``input_ids`` [B, T] and ``hidden`` [B, T, H] (the target's post-norm states for those tokens).
    Position t of the head sees token t+1 and state t and is scored against state t+1 and the
    target's next-token distribution there.
    """
    pred = head(embed(input_ids[:, 1:]), hidden[:, :-1])
    target = (hidden if target_hidden is None else target_hidden)[:, 1:]
    feature = nn.functional.smooth_l1_loss(pred, target)
    with torch.no_grad():
        p_target = torch.softmax(lm_head(target).float(), dim=-1)
    log_q = torch.log_softmax(lm_head(pred).float(), dim=-1)
    token = -(p_target * log_q).sum(-1).mean()
    with torch.no_grad():
        top1 = (log_q.argmax(-1) == p_target.argmax(-1)).float().mean()
    return feature + token_weight * token, {"feature": feature.detach(), "token": token.detach(),
                                            "top1_agreement": top1}
