"""Lightning wrapper for training an :class:`~calib.drafters.eagle.model.EagleHead`."""

from __future__ import annotations

import math

import lightning as L
import torch
from torch import nn

from calib.drafters.eagle.model import EagleHead, eagle_loss


class EagleTrainingModule(L.LightningModule):
    """Trains the head against the target's frozen embeddings and lm_head.

    Batches are dicts with ``input_ids`` [B, T] and ``hidden`` [B, T, H] (the target's post-norm
    states for those tokens, extracted beforehand). AdamW with linear warm-up then cosine decay over
    ``total_steps`` optimizer steps (0: constant learning rate).

    ``steps`` > 1 trains on the engine's multi-step drafting (training-time test, see
    :meth:`EagleHead.unrolled`); validation always unrolls ``val_steps`` (the K the engine drafts) so
    ``val_accept_per_round`` tracks accepted tokens per round whatever the training mode.
    """

    def __init__(self, head: EagleHead, embed: nn.Module, lm_head: nn.Module, lr: float = 1e-3,
                 token_weight: float = 0.1, weight_decay: float = 0.0, warmup_steps: int = 0,
                 total_steps: int = 0, hidden_noise: float = 0.0, steps: int = 1, step_decay: float = 1.0,
                 val_steps: int = 4, draft_lm_head: nn.Module | None = None,
                 draft_ids: torch.Tensor | None = None):
        super().__init__()
        self.head, self.embed, self.lm_head = head, embed, lm_head
        # a reduced-vocabulary head's own lm_head (trained with the head) and its rows' target ids [Vd]
        self.draft_lm_head, self.draft_ids = draft_lm_head, draft_ids
        for p in [*embed.parameters(), *lm_head.parameters()]:
            p.requires_grad_(False)
        self.lr, self.token_weight, self.weight_decay = lr, token_weight, weight_decay
        self.warmup_steps, self.total_steps, self.hidden_noise = warmup_steps, total_steps, hidden_noise
        self.steps, self.step_decay, self.val_steps = steps, step_decay, val_steps

    def _step(self, batch, stage: str):
        hidden = batch["hidden"]
        if stage == "train" and self.hidden_noise > 0:
            # EAGLE's robustness trick: at serve time deeper steps see the head's own (imperfect) states.
            hidden = hidden + (torch.rand_like(hidden) * 2 - 1) * self.hidden_noise
        steps = self.steps if stage == "train" else self.val_steps
        answer_from = int(batch["answer_from"][0]) if stage != "train" and "answer_from" in batch else None
        loss, parts = eagle_loss(self.head, self.embed, self.lm_head, batch["input_ids"], hidden,
                                 self.token_weight, target_hidden=batch["hidden"], steps=steps,
                                 step_decay=self.step_decay, answer_from=answer_from,
                                 draft_lm_head=self.draft_lm_head, draft_ids=self.draft_ids)
        n = batch["input_ids"].shape[0]
        self.log(f"{stage}_loss", loss, prog_bar=True, batch_size=n)
        for k, v in parts.items():
            self.log(f"{stage}_{k}", v, prog_bar=k in ("top1_step0", "accept_per_round"), batch_size=n)
        return loss

    def training_step(self, batch, _):
        return self._step(batch, "train")

    def validation_step(self, batch, _):
        self._step(batch, "val")

    def configure_optimizers(self):
        params = [*self.head.parameters(), *(self.draft_lm_head.parameters() if self.draft_lm_head is not None else [])]
        opt = torch.optim.AdamW(params, lr=self.lr, weight_decay=self.weight_decay)
        if self.total_steps <= 0:
            return opt

        def factor(step):
            if step < self.warmup_steps:
                return (step + 1) / max(1, self.warmup_steps)
            frac = (step - self.warmup_steps) / max(1, self.total_steps - self.warmup_steps)
            return 0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac)))

        sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
