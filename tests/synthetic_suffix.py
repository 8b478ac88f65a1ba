"""A SYNTHETIC chain kind, ``synthetic_suffix``, as one file: everything calib needs to know about it.

Modelled on suffix decoding (the real kind is calib/chains/suffix.py), but SYNTHETIC: its bank file
``synthetic_suffix.parquet`` holds, per round,
``suffix_len`` (the chain's length) and ``suffix_score`` (a score written by :func:`add_to_bank` from the
round's accepted length plus noise, not by any engine); its labels are the verified chain's accept mask.
Registering :data:`SUFFIX` (``calib.chains.register_chain``) takes it through the bank, training, export,
replay and the serving decision (``tests/test_chains.py``); no other file names it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from calib.bank import schema
from calib.chains import Axis, ChainKind, RoundData, offer_inputs

BANK_FILE = "synthetic_suffix.parquet"  # SYNTHETIC: keys, suffix_len, suffix_score per round
PREFIX = "syn_"  # its columns in Bank.rounds(chains=...)
SCORE = "suffix_score"
EDGES = (0.25, 0.5, 0.75)


def suffix_samples(bank):
    """Censored per-depth samples: one row per (round, depth reached) with the round's score."""
    from calib.labels import per_depth_samples

    t = bank.rounds(chains=[SUFFIX])
    if f"{PREFIX}{SCORE}" not in t.column_names:
        import pandas as pd

        return pd.DataFrame()
    data = suffix_round_data(t, None)
    score = t.column(f"{PREFIX}{SCORE}").to_numpy(zero_copy_only=False).astype(np.float64)
    return per_depth_samples(t, data.acc, {}, {SCORE: score})


def suffix_depth(bank_dir) -> int:
    """The drafted depth: the widest chain its bank file records (0: none)."""
    import pyarrow.parquet as pq

    path = Path(bank_dir) / BANK_FILE
    return int(pq.read_table(path, columns=["suffix_len"]).column(0).to_numpy().max()) if path.exists() else 0


def suffix_round_data(rounds, axis_names):
    """The chain over a bank's rounds: the verified accept mask within the chain's length, and as table
    input the round's score repeated over the chain's depths (NaN beyond)."""
    if f"{PREFIX}{SCORE}" not in rounds.column_names:
        return None
    width = schema.width(rounds.column_names)
    length = np.nan_to_num(rounds.column(f"{PREFIX}suffix_len").to_numpy(zero_copy_only=False).astype(np.float64))
    beyond = np.arange(width)[None, :] >= length[:, None]
    acc = schema.depth_matrix(rounds, schema.ACC, width)
    acc[beyond] = np.nan
    if axis_names is None:
        return RoundData(acc)
    score = rounds.column(f"{PREFIX}{SCORE}").to_numpy(zero_copy_only=False).astype(np.float32)
    inputs = np.repeat(score[:, None, None], width, axis=1)
    inputs[beyond] = np.nan
    return RoundData(acc, inputs)


def suffix_step_inputs(offer, own, B, lengths, what):
    """At a serving step the engine offers the chain's tokens and its score per request ([B] or [B, L])."""
    import torch

    score = torch.as_tensor(offer.signal, dtype=torch.float64)
    if score.ndim == 1:
        score = score[:, None].expand(B, max(lengths, default=1))
    return offer_inputs(score, B, lengths, len(own), what)


SUFFIX = ChainKind(
    id=9, name="synthetic_suffix", samples=suffix_samples, feature_names=lambda cfg: (SCORE,),
    table_axes=lambda cfg: (Axis(SCORE, edges=EDGES),), drafted_depth=suffix_depth, round_data=suffix_round_data,
    bank_file=BANK_FILE, column_prefix=PREFIX, step_inputs=suffix_step_inputs,
    description="SYNTHETIC test chain: suffix decoding's per-round score")


def add_to_bank(bank_dir, seed: int = 3) -> Path:
    """Write a SYNTHETIC suffix.parquet into a bank folder: every round offers a chain as deep as the
    bank's drafts, scored by its accepted length plus uniform noise (acceptance rises with the score)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    acc = pq.read_table(Path(bank_dir) / schema.ACCEPTANCE)
    width = schema.width(acc.column_names)
    accept = acc.column("accept").to_numpy(zero_copy_only=False).astype(np.float64)
    rng = np.random.default_rng(seed)
    score = np.clip(0.6 * accept / max(width, 1) + 0.4 * rng.uniform(size=acc.num_rows), 0, 1)
    table = pa.table({**{k: acc.column(k) for k in schema.KEYS},
                      "suffix_len": pa.array(np.full(acc.num_rows, width, dtype=np.int64)),
                      SCORE: pa.array(score)})
    pq.write_table(table, Path(bank_dir) / BANK_FILE)
    return Path(bank_dir)
