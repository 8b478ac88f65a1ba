"""Temperature / Platt scaling on the logit of the confidence, trained with Lightning.

    logit P(accept | reached k) = a_k · logit(conf) + b_k (+ w · context)

``X`` is ``[n, 1 + F]``: the confidence in column 0, then (optionally) context features such as
entropy and margin, standardised on the training rows.

``per_depth=True`` fits a slope and intercept per depth (Platt per depth); ``per_depth=False``
shares one slope (a temperature 1/a) with a per-depth intercept. Full-batch L-BFGS (or Adam) on
the NLL, early stopping on validation NLL. Depths deeper than any seen use the deepest terms.
"""

from __future__ import annotations

import logging
import numbers
from typing import ClassVar

import numpy as np
import torch

from calib.calibrators.base import Boolean, Calibrator, Interval, Options, check_inputs, logit

log = logging.getLogger(__name__)

OPTIMIZERS = ("lbfgs", "adam")  # full-batch L-BFGS (strong Wolfe line search) or Adam


def _module(n_depths, n_extra, per_depth, optimizer, lr):
    import lightning as L

    class PlattModule(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Parameter(torch.ones(n_depths if per_depth else 1, dtype=torch.float64))
            self.b = torch.nn.Parameter(torch.zeros(n_depths, dtype=torch.float64))
            self.w = torch.nn.Parameter(torch.zeros(n_extra, dtype=torch.float64))

        def forward(self, z, depth, extra):
            a = self.a[depth] if per_depth else self.a[0]
            out = a * z + self.b[depth]
            if n_extra:
                out = out + extra @ self.w
            return out

        def _nll(self, batch):
            z, depth, extra, y, *w = batch  # w: samples per row when the rows are bins (fit_counts)
            if w:  # the rows' NLL: soft targets k/n weighted by n, over the samples
                return torch.nn.functional.binary_cross_entropy_with_logits(
                    self(z, depth, extra), y, weight=w[0], reduction="sum") / w[0].sum()
            return torch.nn.functional.binary_cross_entropy_with_logits(self(z, depth, extra), y)

        def training_step(self, batch, _):
            loss = self._nll(batch)
            self.log("train_nll", loss, prog_bar=True)
            return loss

        def validation_step(self, batch, _):
            self.log("val_nll", self._nll(batch), prog_bar=True)

        def configure_optimizers(self):
            if optimizer == "lbfgs":
                return torch.optim.LBFGS(self.parameters(), lr=lr, max_iter=20, line_search_fn="strong_wolfe")
            if optimizer == "adam":
                return torch.optim.Adam(self.parameters(), lr=lr)
            raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {optimizer!r}")

    return PlattModule()


class TemperatureScaling(Calibrator):
    name = "temperature"
    uses_context = True
    _parameter_constraints: ClassVar[dict] = {
        "per_depth": [Boolean()],
        "optimizer": [Options(OPTIMIZERS)],
        "lr": [Interval(numbers.Real, 0, None, closed="neither")],
        "max_epochs": [Interval(numbers.Integral, 1, None)],
        "patience": [Interval(numbers.Integral, 0, None)],
        "progress": [Boolean()],
        "seed": [Interval(numbers.Integral, 0, None)],
    }

    def __init__(self, per_depth: bool = True, optimizer: str = "lbfgs", lr: float = 1.0,
                 max_epochs: int = 50, patience: int = 3, progress: bool = True, seed: int = 0):
        self.per_depth = per_depth
        self.optimizer = optimizer
        self.lr = lr
        self.max_epochs = max_epochs
        self.patience = patience
        self.progress = progress
        self.seed = seed

    @staticmethod
    def _tensors(conf, depth, extra, y, n_depths):
        z = torch.from_numpy(logit(conf))
        d = torch.from_numpy(np.minimum(depth, n_depths - 1))
        e = torch.from_numpy(extra) if extra is not None else torch.zeros((conf.size, 0), dtype=torch.float64)
        out = [z, d, e]
        if y is not None:
            out.append(torch.from_numpy(y))
        return out

    def _fit(self, X, depth, y, *, val=None, groups=None) -> None:
        from torch.utils.data import DataLoader

        from calib.calibrators.lightning_fit import fit_module

        conf, depth, y, extra = check_inputs(X, depth, y)
        if conf.size == 0:
            raise ValueError("no samples to fit")
        self.n_depths_ = int(depth.max()) + 1
        n_extra = 0 if extra is None else extra.shape[1]
        if extra is not None:  # standardise so one learning rate suits every input
            self.extra_mean_, self.extra_std_ = extra.mean(0), extra.std(0) + 1e-9
            extra = (extra - self.extra_mean_) / self.extra_std_
        # Full batch: one "sample" holding every tensor (per-sample indexing would dominate).
        train = [tuple(self._tensors(conf, depth, extra, y, self.n_depths_))]
        if val is not None:
            vc, vd, vy, ve = check_inputs(*val)
            if ve is not None:
                ve = (ve - self.extra_mean_) / self.extra_std_
            valset = [tuple(self._tensors(vc, vd, ve, vy, self.n_depths_))]
        else:
            valset = train
        module = _module(self.n_depths_, n_extra, self.per_depth, self.optimizer, self.lr)
        self.epochs_ = fit_module(module, DataLoader(train, batch_size=None), DataLoader(valset, batch_size=None),
                                  max_epochs=self.max_epochs, patience=self.patience, progress=self.progress,
                                  seed=self.seed, min_delta=1e-7)
        self.a_ = module.a.detach().numpy().copy()
        self.b_ = module.b.detach().numpy().copy()
        self.w_ = module.w.detach().numpy().copy()

    def fit_counts(self, depth, x, z, k, n) -> TemperatureScaling:
        """Fit from binned counts (:mod:`calib.training_stats`): per bin, its ``depth``, mean logit ``z``,
        accepts ``k`` and samples ``n``. The same Lightning fit as :meth:`fit` (L-BFGS, early stopping on
        the training NLL) on the bins, each bin's NLL its ``n`` samples' at the bin's mean logit, so both
        follow the same path; they differ by the spread of the logits inside a bin. Not with context inputs
        (``extra``): those are not binned."""
        from torch.utils.data import DataLoader

        from calib.calibrators.lightning_fit import fit_module

        self._validate_params()
        depth, z, k, n = (np.asarray(a) for a in (depth, z, k, n))
        if n.sum() == 0:
            raise ValueError("no samples to fit")
        self.n_depths_ = int(depth.max()) + 1
        batch = (torch.from_numpy(np.asarray(z, np.float64)), torch.from_numpy(depth.astype(np.int64)),
                 torch.zeros((z.size, 0), dtype=torch.float64), torch.from_numpy(k / n), torch.from_numpy(n * 1.0))
        module = _module(self.n_depths_, 0, self.per_depth, self.optimizer, self.lr)
        loader = DataLoader([batch], batch_size=None)
        self.epochs_ = fit_module(module, loader, loader, max_epochs=self.max_epochs, patience=self.patience,
                                  progress=self.progress, seed=self.seed, min_delta=1e-7)
        self.a_ = module.a.detach().numpy().copy()
        self.b_ = module.b.detach().numpy().copy()
        self.w_ = np.zeros(0)
        self.classes_ = np.array([0, 1])
        return self

    def _predict(self, X, depth) -> np.ndarray:
        conf, depth, _, extra = check_inputs(X, depth)
        d = np.minimum(depth, self.n_depths_ - 1)
        a = self.a_[d] if self.per_depth else self.a_[0]
        z = a * logit(conf) + self.b_[d]
        if self.w_.size:
            if extra is None:
                raise ValueError("this calibrator was fitted with context features: pass X [n, 1 + F] "
                                 f"with its {self.w_.size} context columns after the confidence")
            z = z + ((extra - self.extra_mean_) / self.extra_std_) @ self.w_
        return 1.0 / (1.0 + np.exp(-z))
