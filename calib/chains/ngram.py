"""The n-gram chain (prompt lookup, vLLM's ``ngram``): the chain the request's context offers, with its
match features.

Its columns are the bank's ngram.parquet (joined as ``ng_*`` by ``Bank.rounds(chains=...)``); its table
reads match features (:data:`calib.bank.schema.NGRAM_FEATURES`) as ``[R, L, F]`` float32, the chain's
values repeated over its depths, NaN beyond it (feature 0 NaN = no token), then the context axes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from calib.bank import schema
from calib.chains.base import ChainKind, RoundData, binned_table_axes
from calib.ngram import DEPTH_FEATURE as DEPTH_AGREEMENT  # ngram.parquet's depth_agreement{j} columns

assert DEPTH_AGREEMENT in schema.NGRAM_DEPTH_FEATURES  # the bank layout's family and the matcher's name are one
# every feature an n-gram table or model may read: the round's match features, then the per-depth ones
NGRAM_SAMPLE_FEATURES = (*schema.NGRAM_FEATURES, *schema.NGRAM_DEPTH_FEATURES)
PREFIX = "ng_"  # of ngram.parquet's columns in Bank.rounds(chains=...)
# depth_agreement where a bank collected before calib recorded it has none: depth 0 is the round's agreement (the
# same number by definition), deeper depths this value, a bucket of their own in a table (edges from -0.5)
NOT_RECORDED = -1.0


def depth_agreement_matrix(table, width: int, length: np.ndarray, prefix: str = "") -> np.ndarray:
    """float64 ``[R, width]``: ``depth_agreement`` of each round's chain (the bank's ``depth_agreement{j}``), NaN
    beyond it; where a bank did not record it, the round's ``agreement`` at depth 0 and :data:`NOT_RECORDED` deeper."""
    out = schema.depth_matrix(table, f"{prefix}{DEPTH_AGREEMENT}", width)
    on = np.arange(width)[None, :] < np.asarray(length)[:, None]
    missing = on & np.isnan(out)
    if missing.any():
        agreement = table.column(f"{prefix}agreement").to_numpy(zero_copy_only=False).astype(np.float64)
        out[:, :1] = np.where(missing[:, :1], agreement[:, None], out[:, :1])
        out[:, 1:][missing[:, 1:]] = NOT_RECORDED
    out[~on] = np.nan
    return out


def ngram_samples(bank):
    """One row per (labelled n-gram chain, depth reached): keys, depth, match features, the context
    columns (:func:`calib.labels.round_context` of the verified rounds), label.
    A bank without ngram.parquet yields nothing."""
    import pandas as pd
    import pyarrow as pa

    from calib.labels import CONTEXT_COLUMNS, per_depth_samples, with_round_context

    if not bank.has(schema.NGRAM):
        return pd.DataFrame()
    t = with_round_context(bank.table(schema.NGRAM), bank)
    src = np.asarray(t.column("label_source").to_pylist(), dtype=object)
    t = t.filter(pa.array(src != "none"))
    width = schema.width(t.column_names, schema.NGRAM_TOK)
    acc = schema.depth_matrix(t, schema.ACC, width)
    rounds = {f: t.column(f).to_numpy(zero_copy_only=False).astype(np.float64) for f in schema.NGRAM_FEATURES}
    length = np.nan_to_num(t.column("ngram_len").to_numpy(zero_copy_only=False).astype(np.float64))
    per_depth = {DEPTH_AGREEMENT: depth_agreement_matrix(t, width, length)}
    rounds["counterfactual"] = np.asarray(t.column("label_source").to_pylist(), dtype=object) == "counterfactual"
    rounds.update({n: t.column(f"ctx_{n}").to_numpy(zero_copy_only=False).astype(np.float64) for n in CONTEXT_COLUMNS})
    return per_depth_samples(t, acc, per_depth, rounds)


def ngram_drafted_depth(bank_dir) -> int:
    """Drafted depth K of the n-gram chain in one bank folder: the widest chain (ngram_tok columns)."""
    import pyarrow.parquet as pq

    ng = Path(bank_dir) / schema.NGRAM
    return schema.width(pq.read_schema(ng).names, schema.NGRAM_TOK) if ng.exists() else 0


def round_feature_tensor(table, names, width: int, prefix: str = ""):
    """n-gram features ``[R, L, F]`` (float32 torch) in the order ``names`` from ngram.parquet round columns.

    The round features are repeated across depths ``j < ngram_len``, ``depth_agreement`` is read per depth
    (:func:`depth_agreement_matrix`); every feature is NaN at depths beyond the chain (feature 0 NaN = "no token", as the tables read
    it). ``in_prompt`` becomes 0/1. ``prefix`` is :data:`PREFIX` for ``Bank.rounds(chains=...)``.
    """
    import pyarrow as pa
    import torch

    n = table.num_rows
    length = np.nan_to_num(table.column(f"{prefix}ngram_len").to_numpy(zero_copy_only=False).astype(np.float64))
    feats = np.empty((n, len(names)), dtype=np.float64)
    for f, name in enumerate(names):
        if name not in NGRAM_SAMPLE_FEATURES:
            raise KeyError(f"unknown n-gram feature {name!r}; known: {NGRAM_SAMPLE_FEATURES}")
        if name == DEPTH_AGREEMENT:
            continue
        col = table.column(f"{prefix}{name}")
        if pa.types.is_boolean(col.type):
            col = col.cast(pa.int8())
        feats[:, f] = col.to_numpy(zero_copy_only=False).astype(np.float64)
    out = np.repeat(feats[:, None, :], width, axis=1)
    if DEPTH_AGREEMENT in names:
        out[:, :, list(names).index(DEPTH_AGREEMENT)] = depth_agreement_matrix(table, width, length, prefix)
    beyond = np.arange(width)[None, :] >= length[:, None]
    out[beyond] = np.nan
    return torch.from_numpy(out.astype(np.float32))


def ngram_round_data(rounds, axis_names=None):
    """The n-gram chain over a bank's rounds joined with ngram.parquet (``Bank.rounds(chains=...)``,
    columns ``ng_*``); None without it. Unlabelled chains (label_source none) are NaN in the mask."""
    if f"{PREFIX}ngram_len" not in rounds.column_names:
        return None
    n = len(PREFIX)
    width = schema.width([c[n:] for c in rounds.column_names if c.startswith(PREFIX)], schema.NGRAM_TOK)
    acc = schema.depth_matrix(rounds, f"{PREFIX}acc", width)
    src = np.asarray(rounds.column(f"{PREFIX}label_source").to_pylist(), dtype=object)
    acc[src == "none"] = np.nan  # an unlabelled chain cannot be scored or verified in replay
    inputs = None if axis_names is None else round_feature_tensor(rounds, axis_names, width, prefix=PREFIX).numpy()
    return RoundData(acc, inputs)


def step_feature_tensor(features: Sequence[Mapping | None], lengths: Sequence[int], names: Sequence[str],
                        width: int):
    """float32 ``[B, width, F]`` n-gram features (``names`` order, e.g. the own features of the n-gram
    table) from per-request feature dicts (``calib.ngram.NgramMatch.features()``; None = no match): the
    chain's values repeated over depths ``< lengths[i]``, NaN beyond, booleans 0/1, as
    :func:`round_feature_tensor` lays a bank's rounds out. An engine's :class:`calib.chains.Offer` signal."""
    import torch

    out = np.full((len(features), width, len(names)), np.nan, dtype=np.float64)
    for i, (f, n) in enumerate(zip(features, lengths)):
        n = min(int(n), width)
        if f is None or n <= 0:
            continue
        for c, name in enumerate(names):
            out[i, :n, c] = np.asarray(f[name], dtype=np.float64)[:n] if name == DEPTH_AGREEMENT else float(f[name])
    return torch.from_numpy(out.astype(np.float32))


def propose(context, settings: tuple[int, int, int], prompt_len: int = 0, max_model_len: int | None = None):
    """``(tokens, features)``: the chain vLLM's n-gram proposer drafts from a request's token ids
    ``context`` with ``settings`` = (prompt_lookup_min, prompt_lookup_max, k) (:func:`calib.ngram.find_match`),
    and its match features (None without a match)."""
    from calib.ngram import find_match

    lo, hi, k = settings
    m = find_match(context, lo, hi, k, prompt_len, max_model_len)
    tokens = [int(t) for t in m.tokens]
    return tokens, (m.features() if tokens else None)


def propose_batch(token_ids, rows, num_tokens, prompt_lens, settings: tuple[int, int, int],
                  max_model_len: int | None = None, extra=None, extra_len=None):
    """:func:`propose` for a step's requests at once, on the engine's token buffer (:func:`calib.ngram.find_matches`):
    ``(tokens [B][<= k], features float64 [B, F])``, the columns :data:`calib.ngram.MATCH_FEATURES`."""
    from calib.ngram import find_matches

    lo, hi, k = settings
    return find_matches(token_ids, rows, num_tokens, prompt_lens, lo, hi, k, max_model_len, extra, extra_len)


def batch_feature_array(features, lengths: Sequence[int], names: Sequence[str], width: int) -> np.ndarray:
    """numpy float32 ``[B, width, F]`` of :func:`propose_batch`'s features (``[B, F + k]``, or its rows; columns
    ``names``), as :func:`step_feature_tensor` lays them out: round features repeated over depths ``< lengths[b]``,
    ``depth_agreement`` read per depth, NaN beyond.
    numpy, not a tensor: serving reads it in numpy (calib.chains.base.offer_inputs), where a torch call each way
    would start cold inside the engine."""
    from calib.ngram import MATCH_FEATURES

    n_round = len(MATCH_FEATURES)
    cols = [MATCH_FEATURES.index(n) if n != DEPTH_AGREEMENT else 0 for n in names]
    if not isinstance(features, np.ndarray):  # rows: np.array, not np.stack (a few times faster on a step's rows)
        features = np.array(features, dtype=np.float64) if len(features) else np.zeros((0, n_round + width))
    reached = np.arange(width)[None, :] < np.asarray(lengths, dtype=np.int64)[:, None]  # [B, width]
    # rounded to float32 before the broadcast (the same values as after it: one rounding either way)
    out = np.where(reached[:, :, None], features[:, cols].astype(np.float32)[:, None, :], np.float32(np.nan))
    if DEPTH_AGREEMENT in names:
        depth = features[:, n_round: n_round + width].astype(np.float32)  # [B, <= width]
        out[:, : depth.shape[1], list(names).index(DEPTH_AGREEMENT)] = np.where(
            reached[:, : depth.shape[1]], depth, np.float32(np.nan))
    return out


def ngram_settings(given, k: int) -> tuple[int, int, int]:
    """``(prompt_lookup_min, prompt_lookup_max, k)``: a 3-sequence as given, a mapping ``{min_n, max_n, k}``,
    or None (1, 4, ``k``); a 3-sequence's k at most ``k`` (the most draft tokens a step verifies)."""
    if given is None:
        return (1, 4, int(k))
    if isinstance(given, Mapping):
        return (int(given.get("min_n", 1)), int(given.get("max_n", 4)), int(given.get("k", k)))
    lo, hi, kk = (int(x) for x in given)
    if not 1 <= lo <= hi or kk < 1:
        raise ValueError(f"n-gram settings {given!r}: expected 1 <= min_n <= max_n and k >= 1")
    return (lo, hi, min(kk, int(k)))


def ngram_engine_settings(sc) -> tuple[int, int, int]:
    """The settings of vLLM's n-gram proposer in its speculative config (``prompt_lookup_min``/``_max``, K)."""
    return (int(sc.prompt_lookup_min), int(sc.prompt_lookup_max), int(sc.num_speculative_tokens))


NGRAM = ChainKind(
    id=2, name="ngram", samples=ngram_samples, config_key="ngram_model",
    feature_names=lambda cfg: NGRAM_SAMPLE_FEATURES,
    table_axes=binned_table_axes,
    drafted_depth=ngram_drafted_depth, round_data=ngram_round_data,
    bank_file=schema.NGRAM, column_prefix=PREFIX, manifest_key="ngram_chain", engine_methods=("ngram",),
    propose=propose, propose_batch=propose_batch, bank=schema.NGRAM_FILE, settings=ngram_settings,
    step_features=step_feature_tensor, batch_features=batch_feature_array, engine_settings=ngram_engine_settings,
    serve_knob="ngram", filled_features=(DEPTH_AGREEMENT,),
    description="prompt lookup (vLLM ngram): match features of the chain the context offered")
