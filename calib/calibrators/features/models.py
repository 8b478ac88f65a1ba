"""Small models on named features (logistic, gradient boosting, MLP): P(accept at depth | reached).

Every model is a scikit-learn estimator of the calibrators' protocol (:mod:`calib.calibrators.base`):
``fit(X, y)`` / ``accept_proba(X)`` -> P(accept at depth | reached depth). ``X`` is a chain's feature
matrix with its ``depth`` column: a DataFrame, from which the model reads its ``features`` by name,
or an array holding exactly those columns in that order, then the depth. The features are the n-gram chain's match
features (:data:`calib.bank.schema.NGRAM_FEATURES`), the model chain's per-depth drafter outputs
(:data:`DRAFTER_FEATURES`, the confidence first) and the context axes (:data:`calib.chains.CONTEXT`).
Counts and distances enter the linear and MLP models as log1p (their effect is multiplicative), the
confidence as its logit (temperature scaling's input); gradient boosting takes them raw and is held
non-decreasing in the confidence (a calibration map should not fall as the drafter grows surer).
Large fits train on a random ``max_train_samples`` of the rows (a small model gains nothing from
millions of them).
"""

from __future__ import annotations

import logging
import numbers
import time
from contextlib import redirect_stdout
from typing import ClassVar

import numpy as np
import pandas as pd
import torch
from threadpoolctl import threadpool_limits

from calib.calibrators.base import Boolean, Calibrator, Interval, Subset
from calib.calibrators.lightning_fit import FIT_THREADS, torch_threads
from calib.chains import CONTEXT
from calib.chains.ngram import NGRAM_SAMPLE_FEATURES

log = logging.getLogger(__name__)

DRAFTER_FEATURES = ("conf", "entropy", "margin")  # the model chain's per-depth drafter outputs
FEATURE_NAMES = (*NGRAM_SAMPLE_FEATURES, *DRAFTER_FEATURES)  # every feature a bank records per round/depth
LOG_FEATURES = {"match_n", "occurrences", "distance", "distinct_next", "cont_len", "context_len", "position"}
LOGIT_FEATURES = {"conf"}
DEFAULT_FEATURES = ("match_n", "occurrences", "distance", "in_prompt", "distinct_next", "agreement",
                    "cont_len", "context_len", "depth_agreement")
# Context axes a model may also read as features: NaN (a request's first round, a bank without
# temperatures) becomes CONTEXT_MISSING, its own value as it is the table's bucket 0.
CONTEXT_FEATURES = tuple(CONTEXT)
CONTEXT_MISSING = -1.0
PREDICT_THREADS = 1  # threads of a feature model's prediction (OpenMP for gradient boosting, torch for the MLP)
PROGRESS_EVERY_S = 10.0  # the HGB fit logs one boosting-progress line per this many seconds at most


def _check_frame(X, depth, features, y=None):
    """(features [n, F] float64, depth [n] int64, y) from the protocol's inputs, checked."""
    if isinstance(X, pd.DataFrame):
        missing = [c for c in features if c not in X.columns]
        if missing:
            raise ValueError(f"n-gram samples lack columns {missing}; they come from calib.chains.ngram.ngram_samples")
        X = X[list(features)].to_numpy(dtype=np.float64, copy=True)
        ctx = [i for i, f in enumerate(features) if f in CONTEXT_FEATURES]
        if ctx:
            X[:, ctx] = np.nan_to_num(X[:, ctx], nan=CONTEXT_MISSING)
    else:
        X = np.asarray(X, dtype=np.float64)
        if X.ndim != 2 or X.shape[1] != len(features):
            raise ValueError(f"X must be [n, {len(features)}] holding {list(features)} in this order (or a "
                             f"DataFrame with those columns), got shape {X.shape}")
    depth = np.asarray(depth)
    if depth.shape != (X.shape[0],):
        raise ValueError(f"X has {X.shape[0]} rows but depth has shape {depth.shape}")
    bad = ~np.isfinite(X)
    if bad.any():
        r, c = np.argwhere(bad)[0]
        raise ValueError(f"n-gram feature {features[c]!r} is not finite at sample {r}")
    if y is not None:
        y = np.asarray(y)
        if not np.isin(y, (0, 1)).all():
            raise ValueError("labels must be 0 or 1")
        y = y.astype(np.float64)
    return X, depth.astype(np.int64), y


class FeatureModel(Calibrator):
    """A model on named ``features`` (see the module docstring)."""

    features: tuple
    max_train_samples: int
    seed: int
    _parameter_constraints: ClassVar[dict] = {
        "features": [Subset(FEATURE_NAMES + CONTEXT_FEATURES)],
        "seed": [Interval(numbers.Integral, 0, None)],
        "max_train_samples": [Interval(numbers.Integral, 4, None)],
    }

    @property
    def uses_context(self) -> bool:
        """Whether it reads more than its first feature: a table over that one (the model chain's
        confidence) must then average the others over the training rows (:mod:`calib.tables.export`)."""
        return len(self.features) > 1

    def _subsample(self, X, depth, y):
        if len(y) <= self.max_train_samples:
            return X, depth, y
        keep = np.sort(np.random.default_rng(self.seed).choice(len(y), self.max_train_samples, replace=False))
        return X[keep], depth[keep], y[keep]

    def _design(self, X: np.ndarray, depth: np.ndarray) -> np.ndarray:
        def column(i, f):
            if f in LOG_FEATURES:
                return np.log1p(X[:, i])
            if f in LOGIT_FEATURES:
                p = np.clip(X[:, i], 1e-4, 1 - 1e-4)
                return np.log(p) - np.log1p(-p)
            return X[:, i]

        cols = [column(i, f) for i, f in enumerate(self.features)]
        onehot = (np.minimum(depth, self.n_depths_ - 1)[:, None] == np.arange(self.n_depths_)[None, :])
        return np.column_stack(cols + [onehot.astype(np.float64)])



class LogisticAcceptance(FeatureModel):
    """Standardised logistic regression on (log) features + depth one-hot."""

    name = "logistic"
    _parameter_constraints: ClassVar[dict] = {
        "features": FeatureModel._parameter_constraints["features"],
        "C": [Interval(numbers.Real, 0, None, closed="neither")],
        "max_iter": [Interval(numbers.Integral, 1, None)],
        "max_train_samples": FeatureModel._parameter_constraints["max_train_samples"],
        "seed": FeatureModel._parameter_constraints["seed"],
    }

    def __init__(self, features=DEFAULT_FEATURES, C: float = 1.0, max_iter: int = 1000,
                 max_train_samples: int = 200_000, seed: int = 0):
        self.features = tuple(features)
        self.C = C
        self.max_iter = max_iter
        self.max_train_samples = max_train_samples
        self.seed = seed

    def _fit(self, X, depth, y, *, val=None, groups=None) -> None:
        from sklearn.linear_model import LogisticRegression
        from sklearn.pipeline import make_pipeline
        from sklearn.preprocessing import StandardScaler

        X, depth, y = _check_frame(X, depth, self.features, y)
        self.n_depths_ = int(depth.max()) + 1
        X, depth, y = self._subsample(X, depth, y)
        self.pipeline_ = make_pipeline(StandardScaler(), LogisticRegression(C=self.C, max_iter=self.max_iter))
        self.pipeline_.fit(self._design(X, depth), y)

    def _predict(self, X, depth) -> np.ndarray:
        X, depth, _ = _check_frame(X, depth, self.features)
        return self.pipeline_.predict_proba(self._design(X, depth))[:, 1]


class GradientBoostingAcceptance(FeatureModel):
    """scikit-learn HistGradientBoostingClassifier on raw features + depth (early stopping)."""

    name = "hgb"
    _parameter_constraints: ClassVar[dict] = {
        **FeatureModel._parameter_constraints,
        "max_iter": [Interval(numbers.Integral, 1, None)],
        "learning_rate": [Interval(numbers.Real, 0, None, closed="neither")],
        "max_leaf_nodes": [Interval(numbers.Integral, 2, None)],
    }

    def __init__(self, features=DEFAULT_FEATURES, max_iter: int = 300, learning_rate: float = 0.1,
                 max_leaf_nodes: int = 31, max_train_samples: int = 200_000, seed: int = 0):
        self.features = tuple(features)
        self.max_iter = max_iter
        self.learning_rate = learning_rate
        self.max_leaf_nodes = max_leaf_nodes
        self.max_train_samples = max_train_samples
        self.seed = seed

    def _fit(self, X, depth, y, *, val=None, groups=None) -> None:
        from sklearn.ensemble import HistGradientBoostingClassifier

        X, depth, y = _check_frame(X, depth, self.features, y)
        self.n_depths_ = int(depth.max()) + 1
        X, depth, y = self._subsample(X, depth, y)
        monotone = [1 if f in LOGIT_FEATURES else 0 for f in self.features] + [0]  # + depth
        self.model_ = HistGradientBoostingClassifier(
            max_iter=self.max_iter, learning_rate=self.learning_rate, max_leaf_nodes=self.max_leaf_nodes,
            early_stopping=True, validation_fraction=0.1, random_state=self.seed, verbose=2,
            monotonic_cst=monotone if any(monotone) else None)
        log.info("hgb: fitting up to %d boosting iterations on %d samples x %d features", self.max_iter,
                 len(y), X.shape[1] + 1)
        t0 = time.perf_counter()
        # sklearn reports its progress by print(); its OpenMP pool gets the fit loop's one thread (a small
        # model on a shared machine stalls on a busy core, and one thread sums in one order everywhere)
        with redirect_stdout(_ThrottledLog(log)), threadpool_limits(FIT_THREADS, user_api="openmp"):
            self.model_.fit(np.column_stack([X, depth]), y)
        log.info("hgb: %d boosting iterations (early stopping) in %.1f s", self.model_.n_iter_,
                 time.perf_counter() - t0)

    def _predict(self, X, depth) -> np.ndarray:
        X, depth, _ = _check_frame(X, depth, self.features)
        # Rows are independent, so the thread count cannot change a prediction; one thread, as the fit: sklearn
        # predicts tree by tree, an OpenMP region per tree, and where the other core is busy each region's
        # barrier waits on it (60k rows x 250 trees on the 2-core box, one core busy: 0.4-0.9 s on one thread,
        # 1.9-2.9 s on two).
        with threadpool_limits(PREDICT_THREADS, user_api="openmp"):
            return self.model_.predict_proba(np.column_stack([X, depth]))[:, 1]


class _ThrottledLog:
    """A text stream that turns sklearn's per-iteration ``print`` lines into INFO log records, at most
    one every :data:`PROGRESS_EVERY_S` seconds (the first iteration's line is always logged)."""

    def __init__(self, logger: logging.Logger, every_s: float = PROGRESS_EVERY_S):
        self.logger, self.every_s = logger, every_s
        self._buffer, self._last = "", None

    def write(self, text: str) -> int:
        self._buffer += text
        while "\n" in self._buffer:
            line, self._buffer = self._buffer.split("\n", 1)
            self._line(line.strip())
        return len(text)

    def flush(self) -> None:
        pass

    def _line(self, line: str) -> None:
        if line.startswith("Binning"):  # "Binning 0.1 GB of training data: 2.0 s"
            self.logger.info("hgb: %s", line)
            return
        if not line.startswith("["):  # header and timing summary: the caller logs its own summary
            return
        now = time.perf_counter()
        if self._last is None or now - self._last >= self.every_s:
            self._last = now
            self.logger.info("hgb %s", line)


class MLPAcceptance(FeatureModel):
    """A small MLP (Lightning, Adam, early stopping on validation NLL) on standardised features."""

    name = "mlp"
    _parameter_constraints: ClassVar[dict] = {
        **FeatureModel._parameter_constraints,
        "hidden": [Interval(numbers.Integral, 1, None)],
        "lr": [Interval(numbers.Real, 0, None, closed="neither")],
        "max_epochs": [Interval(numbers.Integral, 1, None)],
        "batch_size": [Interval(numbers.Integral, 1, None)],
        "patience": [Interval(numbers.Integral, 0, None)],
        "max_train_samples": [Interval(numbers.Integral, 4, None)],
        "progress": [Boolean()],
    }

    def __init__(self, features=DEFAULT_FEATURES, hidden: int = 32, lr: float = 3e-3, max_epochs: int = 20,
                 batch_size: int = 8192, patience: int = 3, max_train_samples: int = 200_000,
                 progress: bool = True, seed: int = 0):
        self.features = tuple(features)
        self.hidden = hidden
        self.lr = lr
        self.max_epochs = max_epochs
        self.batch_size = batch_size
        self.patience = patience
        self.max_train_samples = max_train_samples
        self.progress = progress
        self.seed = seed

    def _tensor(self, X, depth):
        Z = (self._design(X, depth) - self.mean_) / self.std_
        return torch.from_numpy(Z.astype(np.float32))

    def _fit(self, X, depth, y, *, val=None, groups=None) -> None:
        from torch.utils.data import TensorDataset

        from calib.calibrators.lightning_fit import fit_module

        X, depth, y = _check_frame(X, depth, self.features, y)
        self.n_depths_ = int(depth.max()) + 1
        D = self._design(X, depth)
        self.mean_, self.std_ = D.mean(0), D.std(0) + 1e-9
        X, depth, y, vX, vd, vy = self._train_and_early_stopping_rows(X, depth, y, val)
        Net = acceptance_net_class(D.shape[1], self.hidden, self.lr)
        torch.manual_seed(self.seed)  # weight init is part of the fit
        net = Net()
        train = TensorDataset(self._tensor(X, depth), torch.from_numpy(y.astype(np.float32)))
        valset = TensorDataset(self._tensor(vX, vd), torch.from_numpy(vy.astype(np.float32)))
        train_loader, val_loader = batch_loaders(train, valset, self.batch_size)
        self.epochs_ = fit_module(net, train_loader, val_loader, max_epochs=self.max_epochs,
                                  patience=self.patience, progress=self.progress, seed=self.seed)
        self.net_ = net.eval()

    def _train_and_early_stopping_rows(self, X, depth, y, val):
        """``(X, depth, y)`` to train on and ``(vX, vd, vy)`` to stop early on: ``val`` (at most a quarter
        of ``max_train_samples`` of it) or a random tenth held out of the rows; at most
        ``max_train_samples`` training rows (a small net gains nothing from millions)."""
        if val is not None:
            vX, vd, vy = _check_frame(val[0], val[1], self.features, val[2])
            if len(vy) > self.max_train_samples // 4:  # early stopping needs a sample, not all of it
                keep = np.random.default_rng(self.seed + 1).choice(len(vy), self.max_train_samples // 4, replace=False)
                vX, vd, vy = vX[keep], vd[keep], vy[keep]
        else:  # hold out a random tenth of the rows for early stopping
            rng = np.random.default_rng(self.seed)
            hold = rng.uniform(size=len(y)) < 0.1
            vX, vd, vy = X[hold], depth[hold], y[hold]
            X, depth, y = X[~hold], depth[~hold], y[~hold]
        if len(y) > self.max_train_samples:  # a small net gains nothing from millions of rows
            keep = np.random.default_rng(self.seed).choice(len(y), self.max_train_samples, replace=False)
            X, depth, y = X[keep], depth[keep], y[keep]
        return X, depth, y, vX, vd, vy

    def _predict(self, X, depth) -> np.ndarray:
        X, depth, _ = _check_frame(X, depth, self.features)
        with torch.no_grad(), torch_threads(PREDICT_THREADS):  # one thread, as gradient boosting's prediction
            return torch.sigmoid(self.net_(self._tensor(X, depth))).double().numpy()


class _IndexBatches:
    """Batches of row indices as tensors: each epoch (``shuffle``) a permutation drawn as torch's
    ``RandomSampler`` draws it (a seed from torch's global generator, then ``randperm`` on a generator of
    that seed), else the rows in order, cut into ``batch_size`` slices; the batches ``BatchSampler`` over
    ``RandomSampler`` / ``SequentialSampler`` would list, without a Python int per row and epoch."""

    def __init__(self, n: int, batch_size: int, shuffle: bool):
        self.n, self.batch_size, self.shuffle = n, batch_size, shuffle

    def __len__(self) -> int:
        return (self.n + self.batch_size - 1) // self.batch_size

    def __iter__(self):  # a generator, as RandomSampler's: the seed is drawn at the first batch, not before
        if not self.shuffle:
            yield from torch.arange(self.n).split(self.batch_size)
            return
        seed = int(torch.empty((), dtype=torch.int64).random_().item())
        g = torch.Generator()
        g.manual_seed(seed)
        yield from torch.randperm(self.n, generator=g).split(self.batch_size)


def batch_loaders(train, valset, batch_size: int, val_batch_size: int = 65536):
    """``(train, validation)`` DataLoaders handing whole batches, each gathered by one tensor index
    (per-sample indexing would dominate): the training rows shuffled per epoch, the validation rows in order."""
    from torch.utils.data import DataLoader

    return (DataLoader(train, sampler=_IndexBatches(len(train), batch_size, True), batch_size=None),
            DataLoader(valset, sampler=_IndexBatches(len(valset), val_batch_size, False), batch_size=None))


def acceptance_net_class(n_in: int, hidden: int, lr: float) -> type:
    """:class:`MLPAcceptance`'s network class: ``n_in`` standardised inputs -> two GELU layers of
    ``hidden`` -> one logit, a LightningModule trained on binary cross-entropy with Adam at ``lr``."""
    import lightning as L

    class Net(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(n_in, hidden), torch.nn.GELU(),
                                           torch.nn.Linear(hidden, hidden), torch.nn.GELU(),
                                           torch.nn.Linear(hidden, 1))

        def forward(self, x):
            return self.net(x).squeeze(-1)

        def training_step(self, batch, _):
            x, t = batch
            loss = torch.nn.functional.binary_cross_entropy_with_logits(self(x), t)
            self.log("train_nll", loss, prog_bar=True)
            return loss

        def validation_step(self, batch, _):
            x, t = batch
            self.log("val_nll", torch.nn.functional.binary_cross_entropy_with_logits(self(x), t), prog_bar=True)

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=lr)

    return Net
