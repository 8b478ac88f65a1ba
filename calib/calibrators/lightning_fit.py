"""The one Lightning fit loop the gradient-trained calibrators share (CPU, early stopping on val NLL).

A fit runs on **one** torch intra-op thread (:data:`FIT_THREADS`): the calibrators' modules are tiny
(a 32-wide MLP on 8192-row batches, a Platt layer on one full batch), so torch's thread pool costs
more in synchronisation than it gains, and where the cores are busy with other work its threads'
barriers stall for milliseconds per op. Measured on the 2-core dev box (another job running), the
default MLP on 200k rows for 10 epochs: 38.9 s on torch's 2 threads, 10.0 s on one; the fitted
weights are bit-identical (the ops' reductions do not depend on the thread count at these sizes).
"""

from __future__ import annotations

import logging
import warnings
from contextlib import contextmanager

import torch

LIGHTNING_LOGGERS = ("lightning", "lightning.pytorch", "lightning.fabric")
LIGHTNING_BANNER = "lightning.pytorch.utilities.rank_zero"  # where Lightning logs its start-up lines
_FITS_RUN = 0  # fits in this process (the start-up lines are shown at the first only)
FIT_THREADS: int | None = 1  # torch intra-op threads while a calibrator trains (None: torch's own count)


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


@contextmanager
def torch_threads(n: int | None):
    """torch's intra-op thread count set to ``n`` (None: left as it is) inside the block."""
    before = torch.get_num_threads()
    if n is not None and n != before:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)


def fit_module(module, train_loader, val_loader, *, max_epochs: int, patience: int, progress: bool,
               seed: int, min_delta: float = 0.0, threads: int | None = None) -> int:
    """Train ``module`` (logging ``val_nll``) with early stopping; return the epochs run.
    ``threads``: torch intra-op threads during the fit (None: :data:`FIT_THREADS`)."""
    import lightning as L
    from lightning.pytorch.callbacks import EarlyStopping

    global _FITS_RUN
    single_lightning_log()
    L.seed_everything(seed, verbose=False)
    # Lightning's start-up lines ("GPU available: False", "TPU available", a Tip) say the same thing at
    # every fit of a run that fits a dozen small models: shown at the first fit only.
    banner = logging.getLogger(LIGHTNING_BANNER)
    level = banner.level
    if _FITS_RUN:
        banner.setLevel(logging.WARNING)
    try:
        trainer = L.Trainer(max_epochs=max_epochs, accelerator="cpu", devices=1, logger=False,
                            enable_checkpointing=False, enable_model_summary=False, enable_progress_bar=progress,
                            num_sanity_val_steps=0,
                            callbacks=[EarlyStopping("val_nll", patience=patience, min_delta=min_delta)])
        with warnings.catch_warnings(), torch_threads(FIT_THREADS if threads is None else threads):
            warnings.filterwarnings("ignore", message=".*does not have many workers.*")
            warnings.filterwarnings("ignore", message=".*smaller than the logging interval.*")
            warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\).*")  # Lightning's own
            trainer.fit(module, train_loader, val_loader)
    finally:
        banner.setLevel(level)
        _FITS_RUN += 1
    return trainer.current_epoch
