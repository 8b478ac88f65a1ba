"""The one Lightning fit loop the gradient-trained calibrators share (CPU, early stopping on val NLL)."""

from __future__ import annotations

import warnings


def fit_module(module, train_loader, val_loader, *, max_epochs: int, patience: int, progress: bool,
               seed: int, min_delta: float = 0.0) -> int:
    """Train ``module`` (logging ``val_nll``) with early stopping; return the epochs run."""
    import lightning as L
    from lightning.pytorch.callbacks import EarlyStopping

    L.seed_everything(seed, verbose=False)
    trainer = L.Trainer(max_epochs=max_epochs, accelerator="cpu", devices=1, logger=False,
                        enable_checkpointing=False, enable_model_summary=False, enable_progress_bar=progress,
                        num_sanity_val_steps=0,
                        callbacks=[EarlyStopping("val_nll", patience=patience, min_delta=min_delta)])
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*does not have many workers.*")
        warnings.filterwarnings("ignore", message=".*smaller than the logging interval.*")
        trainer.fit(module, train_loader, val_loader)
    return trainer.current_epoch
