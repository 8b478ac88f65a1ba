"""The one Lightning fit loop the gradient-trained calibrators share (CPU, early stopping on val NLL)."""

from __future__ import annotations

import logging
import warnings

LIGHTNING_LOGGERS = ("lightning", "lightning.pytorch", "lightning.fabric")


def single_lightning_log() -> None:
    """Make Lightning's info lines ("GPU available: ...") appear once.

    Importing ``lightning`` gives its loggers a console handler of their own, while they still
    propagate to the root logger; once the application has configured the root logger (Hydra does,
    before ``train.py``'s job imports Lightning) every line is printed twice. When the root logger
    has handlers, Lightning's own console handlers are removed and its records propagate to the
    root handlers (and so into Hydra's job log); otherwise Lightning keeps its console handler.
    """
    if not logging.getLogger().handlers:
        return
    for name in LIGHTNING_LOGGERS:
        logger = logging.getLogger(name)
        for handler in list(logger.handlers):
            if type(handler) is logging.StreamHandler:  # Lightning's console, not a file handler
                logger.removeHandler(handler)
        logger.propagate = True


def fit_module(module, train_loader, val_loader, *, max_epochs: int, patience: int, progress: bool,
               seed: int, min_delta: float = 0.0) -> int:
    """Train ``module`` (logging ``val_nll``) with early stopping; return the epochs run."""
    import lightning as L
    from lightning.pytorch.callbacks import EarlyStopping

    single_lightning_log()
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
