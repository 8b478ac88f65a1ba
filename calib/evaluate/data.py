"""Banks as dense per-round arrays for evaluation: accept masks, raw and calibrated probabilities of
each chain, split by prompt exactly as training splits them.

A bank has a *primary* chain (the one the engine verified: the model drafter's when the speculator
has confidences, else the n-gram chain) and, where ``ngram.parquet`` labels it, the n-gram chain
(for a model-drafter bank that is the counterfactual chain the context offered at the same round).

Which rounds count as test data depends on whether training saw the bank: a bank whose content
fingerprint (sha256 of acceptance.parquet) matches one of the tables' training banks is split by
prompt exactly as training split it (the tables' recorded fractions and seed) and only its held-out
prompts are scored; a bank training never saw is evaluated whole. Before anything is read, the
tables are cross-checked against the bank (:meth:`calib.tables.Tables.check_bank`: target model,
drafter, depth, n-gram features), and a mismatch is refused.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from calib.bank import Bank, load, schema
from calib.chains import chains, round_inputs, split_context
from calib.labels import prompt_split
from calib.tables.io import bank_fingerprint

SEEN = "held-out split of a training bank"
UNSEEN = "whole bank (not seen in training)"


@dataclass
class Chain:
    """One drafter's chain over the bank's rounds. ``acc`` is 1/0/NaN (NaN: not drafted or unlabelled)."""

    drafter: str  # a registered chain name (calib.chains): "model", "ngram", ...
    acc: np.ndarray  # [R, K] float
    p_cal: np.ndarray | None = None  # [R, K] calibrated P(accept | reached), NaN = no token
    p_raw: np.ndarray | None = None  # [R, K] raw confidence (model drafter only)
    # [R, K] the tables' forecast of P(accept | reached) per depth in the round's context cell, known
    # before the chain is drafted (calib.allocate.forecast.forecast_probs); None where the tables hold none
    p_forecast: np.ndarray | None = None
    # [R, A_ctx] each round's values of the table's context axes (the tables' order; None without tables):
    # the online correction's context cell (calib.tables.online.context_cells)
    context: np.ndarray | None = None

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
    seen: bool = True  # the prompt split applies (training saw this bank); False: every round is "test"
    scope: str = SEEN  # one line for the report: which part of the bank is evaluated, and why
    notes: list[str] = field(default_factory=list)  # cross-checks that could not be made
    round_temperature: np.ndarray | None = None  # [R] sampling temperature per round (NaN: not recorded)
    # [R] tokens in the request's context at each round (a chain file's ``context_len``; None where no chain
    # records it): what the step's attention reads, charged by a context-aware step cost (calib.cost.step)
    cached: np.ndarray | None = None

    def subset(self, mask: np.ndarray) -> EvalBank:
        chains = {k: Chain(c.drafter, c.acc[mask], None if c.p_cal is None else c.p_cal[mask],
                           None if c.p_raw is None else c.p_raw[mask],
                           None if c.p_forecast is None else c.p_forecast[mask],
                           None if c.context is None else c.context[mask]) for k, c in self.chains.items()}
        return EvalBank(self.name, self.path, self.category[mask], self.prompt_idx[mask], self.split[mask],
                        chains, self.primary, self.temperature, self.seen, self.scope, list(self.notes),
                        None if self.round_temperature is None else self.round_temperature[mask],
                        None if self.cached is None else self.cached[mask])


def eval_scope(path, tables, fractions=(0.7, 0.15, 0.15), seed: int = 0) -> tuple[bool, str, tuple, int, list]:
    """Whether the bank at ``path`` (a bank folder, or a list of them read as one) was a training bank
    of ``tables``, and the split to apply.

    Returns ``(seen, scope, fractions, seed, notes)``. A bank whose acceptance.parquet sha256 is
    among the tables' ``banks[].acceptance_sha256`` is *seen*: split by prompt with the split the
    tables record (the one training used; ``fractions``/``seed`` only where none is recorded, with a
    note where they differ). Any other bank is evaluated whole. Without tables, or with tables that
    record no fingerprints (hand-made stand-ins), nothing can be told, and the split is applied:
    never scoring training prompts as test is the safe side.
    """
    fractions, seed = tuple(fractions), int(seed)
    if tables is None:
        return True, f"{SEEN} (no tables given: split applied)", fractions, seed, []
    recorded = [b for b in tables.meta.get("banks", []) if isinstance(b, dict) and b.get("acceptance_sha256")]
    if not recorded:
        return (True, "held-out split (the tables record no training-bank fingerprints; assumed seen)",
                fractions, seed, [])
    paths = [path] if isinstance(path, (str, Path)) else list(path)
    by_fp = {b["acceptance_sha256"]: b for b in recorded}
    match = [by_fp.get(bank_fingerprint(p)) for p in paths]
    if not any(match):
        return False, UNSEEN, fractions, seed, []
    notes = []
    if not all(match):  # a union of seen and unseen folders: never score training prompts as test
        notes.append(f"{[str(p) for p, m in zip(paths, match) if m is None]} not seen in training, but read "
                     "together with training banks: the held-out split is applied to all of them")
    match = [m for m in match if m]
    sp = tables.meta.get("split") or {}
    if "fractions" in sp and "seed" in sp:
        rec = (tuple(float(f) for f in sp["fractions"]), int(sp["seed"]))
        if rec != (tuple(float(f) for f in fractions), seed):
            notes.append(f"{path}: split fractions {list(rec[0])} seed {rec[1]} recorded by the tables used (the "
                         f"split training held out), not the config's {list(fractions)} seed {seed}")
        fractions, seed = rec
    return True, f"{SEEN} ({match[0].get('path')})", fractions, seed, notes


def load_eval_bank(path, tables, fractions=(0.7, 0.15, 0.15), seed: int = 0, name: str | None = None) -> EvalBank:
    """Read one bank, split it (see :func:`eval_scope`), and attach calibrated probabilities from ``tables``.

    ``tables`` (a loaded :class:`calib.tables.Tables`, or None for raw arrays only) is first checked
    against the bank with ``tables.check_bank``, which raises :class:`calib.tables.TablesError` on a
    mismatch; what could not be checked is warned about and kept in ``EvalBank.notes``.
    """
    bank: Bank = load(path)  # validated first: a typo or a broken bank is named as such
    notes = []
    if tables is not None:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            tables.check_bank(bank)  # each folder of the bank
        for w in caught:  # re-emit (the caller's filters decide) and keep them for the report
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
            notes.append(str(w.message))
    seen, scope, fractions, seed, split_notes = eval_scope(bank.paths, tables, fractions, seed)
    notes += split_notes
    t = bank.rounds(chains=chains())  # every registered chain's own columns the bank records
    width = schema.width(t.column_names)
    cats = np.asarray(t.column("category").to_pylist(), dtype=object)
    pidx = t.column("prompt_idx").to_numpy()
    split = (prompt_split(cats, pidx, fractions=tuple(fractions), seed=seed) if seen
             else np.full(len(cats), "test", dtype=object))
    acc = schema.depth_matrix(t, schema.ACC, width)
    temp, temps = None, None
    if "temperature" in t.column_names:
        temps = np.asarray(t.column("temperature").to_numpy(zero_copy_only=False), dtype=np.float64)
        temp = float(np.nanmedian(temps)) if len(temps) else None
    found: dict[str, Chain] = {}
    for kind in chains():  # every registered chain kind the bank records, by registry id
        if kind.round_data is None:
            continue
        calibrated = tables is not None and tables.has_chain(kind.name)
        # the table's inputs as an engine passes them: the chain's own, then its context axes
        data = round_inputs(kind, t, tables.feature_names(kind.name) if calibrated else None)
        if data is None:
            continue
        p_cal = p_forecast = context = None
        if calibrated:
            p_cal = tables.accept_prob(kind.name, torch.from_numpy(data.inputs)).numpy().astype(np.float64)
            p_cal[np.isnan(data.acc)] = np.nan  # nothing to score or verify there
            p_forecast = _forecast(tables, kind.name, data.inputs)
            names = tables.feature_names(kind.name)
            _, ctx = split_context(names, kind.name)
            context = data.inputs[:, 0, [names.index(n) for n in ctx]].astype(np.float64)
        found[kind.name] = Chain(kind.name, data.acc, p_cal, data.raw, p_forecast, context)
    if not found:
        raise ValueError(f"{path}: no confidences and no ngram.parquet: nothing to calibrate")
    primary = _primary(bank, found)
    # The verified chain's labels are acceptance.parquet's; the other chains' (the counterfactual
    # n-gram chain of a model-drafter bank) exist only beside a chain with raw confidences.
    verified = found[primary]
    chain_set = {primary: Chain(primary, acc, verified.p_cal, verified.p_raw, verified.p_forecast, verified.context)}
    if verified.p_raw is not None:
        chain_set = {n: (chain_set[primary] if n == primary else c) for n, c in found.items()}
    if name is None:  # runs/banks/<name>/bank -> <name>
        name = Path(path).parent.name if Path(path).name == "bank" else Path(path).name
    return EvalBank(name, Path(path), cats, pidx, split, chain_set, primary, temp, seen, scope, notes, temps,
                    _context_len(t, notes))


def _context_len(t, notes: list) -> np.ndarray | None:
    """[R] tokens in each round's context: the first registered chain file's ``context_len`` in the joined,
    key-sorted rounds ``t`` (None where no chain records it). A chain file records it only where it looked a
    chain up; a round without it is placed by its request's own rounds: the tokens committed before it
    (``accept + 1`` per earlier round) plus the request's offset (its known rounds' median of context less
    those tokens; the bank's median offset for a request with none, said in ``notes``)."""
    import pandas as pd

    for kind in chains():
        col = f"{kind.column_prefix or ''}context_len"
        if not (kind.bank_file and col in t.column_names):
            continue
        ctx = np.asarray(t.column(col).to_numpy(zero_copy_only=False), dtype=np.float64)
        known = np.isfinite(ctx)
        if not known.any():
            return None
        if known.all():
            return ctx
        request = [k for k in schema.KEYS if k != "round_idx"]
        keys = t.select(request).to_pandas()
        group = keys.ne(keys.shift()).any(axis=1).cumsum().to_numpy()  # rows are sorted by the bank keys
        step = np.asarray(t.column("accept").to_numpy(zero_copy_only=False), dtype=np.float64) + 1
        before = pd.Series(step).groupby(group).cumsum().to_numpy() - step  # committed before each round
        # a copy: pandas may hand back a read-only view, and the lone requests' offsets are written below
        offset = pd.Series(np.where(known, ctx - before, np.nan)).groupby(group).transform("median").to_numpy(copy=True)
        lone = ~np.isfinite(offset)
        if lone.any():
            offset[lone] = np.nanmedian(ctx - before)
            notes.append(f"{int(lone.sum())} rounds of requests whose {kind.bank_file} records no context_len: "
                         "their context placed at the bank's median prompt")
        return np.where(known, ctx, before + offset)
    return None


def _forecast(tables, name: str, inputs: np.ndarray) -> np.ndarray | None:
    """The tables' forecast [R, K] of chain ``name`` for rounds whose table inputs are ``inputs`` [R, K, A]
    (the context axes are the inputs' columns of the forecast's axis names; equal over depths)."""
    from calib.allocate.forecast import forecast_probs

    meta = tables.forecast(name)
    if meta is None:
        return None
    names = tables.feature_names(name)
    cols = [names.index(a["name"]) for a in meta["axes"]]
    context = inputs[:, 0, cols].astype(np.float64) if cols else None
    out = forecast_probs(tables, name, context, depths=inputs.shape[1]).numpy().astype(np.float64)
    return out if context is not None else np.repeat(out, inputs.shape[0], axis=0)


def _primary(bank: Bank, found: dict[str, Chain]) -> str:
    """The chain the bank's engine verified: the model-free chain kind its manifest's speculator (or
    method) names, else the first chain with raw confidences (the model drafter), else the first found."""
    man = (bank.manifests() or [{}])[0]
    for name, c in found.items():
        if c.p_raw is None and name in (man.get("speculator"), man.get("method")):
            return name
    with_raw = [n for n, c in found.items() if c.p_raw is not None]
    return with_raw[0] if with_raw else next(iter(found))
