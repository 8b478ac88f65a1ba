"""Banks as dense per-round arrays for evaluation: accept masks, raw and calibrated probabilities of
each chain, split by prompt exactly as training splits them.

A bank has a *primary* chain (the one the engine verified: the model drafter's when the speculator
has confidences, else the n-gram chain) and, where ``ngram.parquet`` labels it, the n-gram chain
(for a model-drafter bank that is the counterfactual chain the context offered at the same round).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from calib.bank import Bank, load, schema
from calib.labels import prompt_split
from calib.tables.features import ngram_feature_tensor


@dataclass
class Chain:
    """One drafter's chain over the bank's rounds. ``acc`` is 1/0/NaN (NaN: not drafted or unlabelled)."""

    drafter: str  # "model" | "ngram"
    acc: np.ndarray  # [R, K] float
    p_cal: np.ndarray | None = None  # [R, K] calibrated P(accept | reached), NaN = no token
    p_raw: np.ndarray | None = None  # [R, K] raw confidence (model drafter only)

    @property
    def labelled(self) -> np.ndarray:
        return ~np.isnan(self.acc).all(axis=1)

    @property
    def accept(self) -> np.ndarray:
        """Accepted prefix length per round (0 where unlabelled)."""
        ok = np.nan_to_num(self.acc) == 1
        return np.cumprod(ok, axis=1).sum(axis=1)

    @property
    def length(self) -> np.ndarray:
        """Drafted tokens per round (a chain is a prefix: count of labelled depths)."""
        return (~np.isnan(self.acc)).sum(axis=1)

    def oracle_p(self) -> np.ndarray:
        """The accept mask as probabilities: 1 before the first rejection, 0 from it, NaN beyond
        the drafted chain — survival is then exactly 1 up to the accepted length and 0 after."""
        return self.acc.copy()


@dataclass
class EvalBank:
    name: str
    path: Path
    category: np.ndarray  # [R] str
    prompt_idx: np.ndarray  # [R]
    split: np.ndarray  # [R] 'train' | 'val' | 'test'
    chains: dict[str, Chain] = field(default_factory=dict)
    primary: str = "model"
    temperature: float | None = None

    def subset(self, mask: np.ndarray) -> EvalBank:
        chains = {k: Chain(c.drafter, c.acc[mask], None if c.p_cal is None else c.p_cal[mask],
                           None if c.p_raw is None else c.p_raw[mask]) for k, c in self.chains.items()}
        return EvalBank(self.name, self.path, self.category[mask], self.prompt_idx[mask], self.split[mask],
                        chains, self.primary, self.temperature)


def load_eval_bank(path, tables, fractions=(0.7, 0.15, 0.15), seed: int = 0, name: str | None = None) -> EvalBank:
    """Read one bank, split by prompt, and attach calibrated probabilities from ``tables``."""
    bank: Bank = load(path)
    with_ng = bank.has(schema.NGRAM)
    t = bank.rounds(with_ngram=with_ng)
    width = schema.width(t.column_names)
    cats = np.asarray(t.column("category").to_pylist(), dtype=object)
    pidx = t.column("prompt_idx").to_numpy()
    split = prompt_split(cats, pidx, fractions=tuple(fractions), seed=seed)
    acc = schema.depth_matrix(t, schema.ACC, width)
    conf = schema.depth_matrix(t, schema.CONF, width)
    has_conf = bool((~np.isnan(conf)).any())
    temp = None
    if "temperature" in t.column_names:
        temps = t.column("temperature").to_numpy(zero_copy_only=False)
        temp = float(np.nanmedian(temps)) if len(temps) else None
    chains: dict[str, Chain] = {}
    ng_chain = None
    if with_ng:
        ng_width = schema.width([c[3:] for c in t.column_names if c.startswith("ng_")], schema.NGRAM_TOK)
        ng_acc = schema.depth_matrix(t, "ng_acc", ng_width)
        src = np.asarray(t.column("ng_label_source").to_pylist(), dtype=object)
        ng_acc[src == "none"] = np.nan  # an unlabelled chain cannot be scored or verified in replay
        ng_p = None
        if tables is not None and tables.has_ngram:
            feats = ngram_feature_tensor(t, tables.ngram_feature_names, ng_width, prefix="ng_")
            ng_p = tables.ngram_accept_prob(feats).numpy().astype(np.float64)
            ng_p[np.isnan(ng_acc)] = np.nan
        ng_chain = Chain("ngram", ng_acc, ng_p)
    if has_conf:
        p_cal = None
        if tables is not None and tables.has_model:
            p_cal = tables.model_accept_prob(torch.from_numpy(conf.astype(np.float32))).numpy().astype(np.float64)
        chains["model"] = Chain("model", acc, p_cal, conf)
        if ng_chain is not None:
            chains["ngram"] = ng_chain
        primary = "model"
    else:
        # n-gram bank: the verified chain is the n-gram chain (acceptance == ngram.parquet labels)
        if ng_chain is None:
            raise ValueError(f"{path}: no confidences and no ngram.parquet: nothing to calibrate")
        chains["ngram"] = Chain("ngram", acc, ng_chain.p_cal)
        primary = "ngram"
    if name is None:  # runs/banks/<name>/bank -> <name>
        name = Path(path).parent.name if Path(path).name == "bank" else Path(path).name
    return EvalBank(name, Path(path), cats, pidx, split, chains, primary, temp)
