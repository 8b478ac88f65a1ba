"""Lightning wrapper for training an :class:`~calib.drafters.eagle.model.EagleHead`."""

from __future__ import annotations

import lightning as L
import torch
from torch import nn

from calib.drafters.eagle.model import EagleHead, eagle_loss


class EagleTrainingModule(L.LightningModule):
    """Trains the head against the target's frozen embeddings and lm_head.

    Batches are dicts with ``input_ids`` [B, T] and ``hidden`` [B, T, H] (the target's post-norm
    states for those tokens, extracted beforehand).
    """

    def __init__(self, head: EagleHead, embed: nn.Module, lm_head: nn.Module, lr: float = 1e-3,
                 token_weight: float = 0.1):
        super().__init__()
        self.head, self.embed, self.lm_head = head, embed, lm_head
        for p in [*embed.parameters(), *lm_head.parameters()]:
            p.requires_grad_(False)
        self.lr, self.token_weight = lr, token_weight

    def _step(self, batch, stage: str):
        loss, parts = eagle_loss(self.head, self.embed, self.lm_head, batch["input_ids"], batch["hidden"],
                                 self.token_weight)
        self.log(f"{stage}_loss", loss, prog_bar=True)
        for k, v in parts.items():
            self.log(f"{stage}_{k}", v)
        return loss

    def training_step(self, batch, _):
        return self._step(batch, "train")

    def validation_step(self, batch, _):
        self._step(batch, "val")

    def configure_optimizers(self):
        return torch.optim.AdamW(self.head.parameters(), lr=self.lr)
