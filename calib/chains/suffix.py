"""The suffix chain (SuffixDecoding, arXiv 2411.04975; vLLM's ``suffix`` method): the continuation a suffix tree
over the request's prompt and every earlier response proposes, with the tree's own estimates.

Drafted by the real implementation, the ``arctic-inference`` package vLLM's ``suffix`` proposer imports (an
optional install step: ``make install-suffix``): one :class:`SuffixProposer` per process mirrors vLLM's proposer
(``vllm/v1/spec_decode/suffix_decoding.py``: the request's prompt tree, a global tree of responses, the draft of
whichever scores higher), so capture reproduces vLLM's draft when vLLM verifies it and recomputes it beside
every other drafter's round. Its bank file ``suffix.parquet`` (:data:`SUFFIX_FILE`) holds per round the chain,
``match_n`` (context tokens the tree matched), ``agreement`` (its estimate of the first token), ``score`` (the tree's expected accepted length: the sum of
its path probabilities), ``from_global`` (drafted from earlier responses, not the request's own tokens),
``tree_seqs`` (sequences in the tree drafted from: its support) and per depth ``suffix_prob{j}``: the tree's
estimate that the path up to token j is right (a product of count ratios). Its table reads ``conf``, the
tree's conditional estimate at depth j (``suffix_prob{j} / suffix_prob{j-1}``: what the table calibrates, and
the raw probability eval compares it with), and round features (:data:`FEATURES`), then the context axes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa

from calib.bank import schema
from calib.chains.base import ChainKind, RoundData, binned_table_axes

SUFFIX_FILE = schema.ChainFile(
    "suffix.parquet", "suffix_len", "suffix_tok",
    {"match_n": (pa.int64(), 0.0, math.inf), "agreement": (pa.float64(), 0.0, 1.0), "score": (pa.float64(), 0.0, math.inf),
     "from_global": (pa.bool_(), 0.0, 1.0), "tree_seqs": (pa.int64(), 0.0, math.inf),
     "context_len": (pa.int64(), 0.0, math.inf)},
    {"suffix_prob": (0.0, 1.0)})
PREFIX = "sx_"  # of suffix.parquet's columns in Bank.rounds(chains=...)
# What a table or an estimator may read, per depth, by the names calib's feature estimators know where they mean
# the same (calib/calibrators/features): ``conf`` the tree's conditional estimate of the token at that depth (its
# raw probability; derived from suffix_prob, so an estimator's input, not a table axis: check_bank looks a table's
# axes up among the file's columns), ``match_n`` the context tokens it matched, ``agreement`` the share of the
# matched context's continuations that go on with the chain's first token (the tree's estimate at depth 0),
# ``context_len``; then round features no estimator reads yet (not in ...features.models.FEATURE_NAMES).
ROUND_COLUMNS = ("match_n", "agreement", "context_len", "score", "from_global", "tree_seqs")  # suffix.parquet's
FEATURES = ("conf", *ROUND_COLUMNS)
# vLLM 0.32's SpeculativeConfig defaults (suffix_decoding_*), the settings capture and serving recompute with
DEFAULTS = {"max_tree_depth": 24, "max_cached_requests": 10000, "max_spec_factor": 1.0, "min_token_prob": 0.1}


def suffix_settings(given, k: int) -> dict:
    """The recomputation's settings: :data:`DEFAULTS` overridden by ``given`` (a mapping), and ``k``."""
    given = dict(given or {})
    unknown = sorted(set(given) - set(DEFAULTS) - {"k"})
    if unknown:
        raise ValueError(f"suffix chain settings: unknown {unknown}; known: {sorted(DEFAULTS)} and k")
    out = {**DEFAULTS, **given, "k": int(given.get("k", k))}
    if out["k"] < 1 or out["max_tree_depth"] < 1 or not 0 <= out["min_token_prob"] <= 1:
        raise ValueError(f"suffix chain settings {out}: need k >= 1, max_tree_depth >= 1, 0 <= min_token_prob <= 1")
    return out


def suffix_engine_settings(sc) -> dict:
    """The settings of vLLM's suffix proposer in its speculative config (``suffix_decoding_*``)."""
    return {name: getattr(sc, f"suffix_decoding_{name}") for name in DEFAULTS}


class SuffixProposer:
    """vLLM's suffix proposer over one ``arctic_inference`` cache, per request: the prompt starts the request's
    tree, later tokens extend it (and the global tree of responses), and the draft is whichever tree's scores
    higher, as ``SuffixDecodingCache.speculate`` chooses, keeping which one it was."""

    def __init__(self, settings: dict, k: int):
        from arctic_inference.suffix_decoding import SuffixDecodingCache

        self.s = settings
        self.cache = SuffixDecodingCache(max_tree_depth=int(settings["max_tree_depth"]),
                                         max_cached_requests=int(settings["max_cached_requests"]))
        self.seen: dict[str, int] = {}  # req_id -> tokens of its context the trees hold

    def _extend(self, req_id: str, context: np.ndarray, prompt_len: int) -> None:
        cache = self.cache
        if req_id not in cache.active_requests:
            if req_id in cache.cached_requests:
                cache.evict_cached_response(req_id)
            cache.start_request(req_id, np.ascontiguousarray(context[:prompt_len], dtype=np.int32))
            self.seen[req_id] = prompt_len
        new = context[self.seen[req_id]:]
        if len(new):
            cache.add_active_response(req_id, np.ascontiguousarray(new, dtype=np.int32))
            self.seen[req_id] = len(context)

    def propose(self, req_id: str, context, prompt_len: int, max_model_len: int | None):
        """``(tokens, features)`` for the request whose token ids are ``context`` (prompt, then its output so far):
        its chain and the features :data:`SUFFIX_FILE` records (None: no chain)."""
        from arctic_inference.suffix_decoding._C import SuffixTree

        context = np.asarray(context)
        n = len(context)
        self._extend(req_id, context, int(prompt_len))
        room = self.s["k"] if max_model_len is None else min(self.s["k"], int(max_model_len) - n - 1)
        if room <= 0:
            return [], None
        pattern = np.ascontiguousarray(context[max(0, n - int(self.s["max_tree_depth"])):], dtype=np.int32)
        trees = (self.cache._local_trees[req_id], self.cache._global_tree)  # the pair SuffixDecodingCache.speculate reads
        drafts = [SuffixTree.speculate_ndarray(t, pattern, int(room), float(self.s["max_spec_factor"]), 0.0,
                                               float(self.s["min_token_prob"]), False) for t in trees]
        glob = drafts[1].score > drafts[0].score  # speculate keeps the local draft on a tie
        d = drafts[int(glob)]
        tokens = [int(t) for t in d.token_ids]
        if not tokens:
            return [], None
        probs = [min(1.0, max(0.0, float(p))) for p in d.probs]
        return tokens, {"match_n": int(d.match_len), "agreement": probs[0], "score": float(d.score), "from_global": bool(glob),
                        "tree_seqs": int(trees[int(glob)].num_seqs()), "context_len": n,
                        "suffix_prob": probs}

    def finish(self, req_id: str) -> None:
        if req_id in self.cache.active_requests:
            self.cache.stop_request(req_id)
        self.seen.pop(req_id, None)

    def forget_responses(self) -> int:
        """:func:`forget_responses` of this proposer's cache (no request in flight)."""
        self.seen.clear()
        return forget_responses(self.cache)


def forget_responses(cache) -> int:
    """Empty an ``arctic_inference`` ``SuffixDecodingCache`` of every request, for a moment when none is in flight:
    the requests it still holds as active are finished ones whose end it has not been told yet (vLLM and calib
    stop a request at the next step), so each is stopped, then every response is evicted from the global tree;
    how many. A benchmark does this between cells that serve the same prompts, or the suffix trees would draft a
    re-served prompt from its own earlier output."""
    for req_id in list(cache.active_requests):
        cache.stop_request(req_id)
    done = list(cache.cached_requests)
    for req_id in done:
        cache.evict_cached_response(req_id)
    return len(done)


def conditional(prob: np.ndarray) -> np.ndarray:
    """float64 ``[..., L]``: the tree's estimate at depth j given depth j-1 was right, from its path estimates
    ``prob`` (``prob[j] / prob[j-1]``, ``prob[0]`` at depth 0); NaN where ``prob`` is."""
    prob = np.asarray(prob, dtype=np.float64)
    prev = np.concatenate([np.ones_like(prob[..., :1]), prob[..., :-1]], axis=-1)
    with np.errstate(invalid="ignore", divide="ignore"):
        cond = np.clip(np.where(prev > 0, prob / prev, 0.0), 0.0, 1.0)
    return np.where(np.isnan(prob), np.nan, cond)


def _features(table: pa.Table, width: int, prefix: str = "") -> dict[str, np.ndarray]:
    """Every table feature float64 ``[R, width]`` from suffix.parquet's round columns (``prefix`` + name): the
    conditional estimate per depth, round features repeated over the chain's depths, NaN beyond it."""
    length = np.nan_to_num(table.column(f"{prefix}{SUFFIX_FILE.length}").to_numpy(zero_copy_only=False)
                           .astype(np.float64))
    beyond = np.arange(width)[None, :] >= length[:, None]
    prob = schema.depth_matrix(table, f"{prefix}suffix_prob", width)
    out = {"conf": conditional(prob)}
    for name in ROUND_COLUMNS:
        col = table.column(f"{prefix}{name}")
        if pa.types.is_boolean(col.type):
            col = col.cast(pa.int8())
        out[name] = np.repeat(col.to_numpy(zero_copy_only=False).astype(np.float64)[:, None], width, axis=1)
    for v in out.values():
        v[beyond] = np.nan
    return out


def suffix_samples(bank):
    """One row per (labelled suffix chain, depth reached): keys, depth, the table features, the context columns
    (:func:`calib.labels.round_context` of the verified rounds), label; from the folders of ``bank`` that hold
    suffix.parquet (none: nothing)."""
    import pandas as pd

    from calib.labels import CONTEXT_COLUMNS, per_depth_samples, with_round_context

    paths = [p for p in bank.paths if (Path(p) / SUFFIX_FILE.file).exists()]
    if not paths:
        return pd.DataFrame()
    if len(paths) < len(bank.paths):  # trained beside banks of other drafters: the banks that record the chain
        bank = type(bank)(paths, validate_on_open=False, judged_only=bank.judged_only)
    t = with_round_context(bank.table(SUFFIX_FILE.file), bank)
    src = np.asarray(t.column("label_source").to_pylist(), dtype=object)
    t = t.filter(pa.array(src != "none"))
    width = schema.width(t.column_names, SUFFIX_FILE.token)
    acc = schema.depth_matrix(t, schema.ACC, width)
    rounds = {n: t.column(f"ctx_{n}").to_numpy(zero_copy_only=False).astype(np.float64) for n in CONTEXT_COLUMNS}
    return per_depth_samples(t, acc, _features(t, width), rounds)


def suffix_drafted_depth(bank_dir) -> int:
    """Drafted depth K of the suffix chain in one bank folder: the widest chain (suffix_tok columns)."""
    import pyarrow.parquet as pq

    path = Path(bank_dir) / SUFFIX_FILE.file
    return schema.width(pq.read_schema(path).names, SUFFIX_FILE.token) if path.exists() else 0


def suffix_round_data(rounds, axis_names=None):
    """The suffix chain over a bank's rounds joined with suffix.parquet (columns ``sx_*``); None without it.
    Unlabelled chains are NaN in the mask; ``raw`` is the tree's conditional estimate per depth."""
    if f"{PREFIX}{SUFFIX_FILE.length}" not in rounds.column_names:
        return None
    n = len(PREFIX)
    width = schema.width([c[n:] for c in rounds.column_names if c.startswith(PREFIX)], SUFFIX_FILE.token)
    acc = schema.depth_matrix(rounds, f"{PREFIX}acc", width)
    src = np.asarray(rounds.column(f"{PREFIX}label_source").to_pylist(), dtype=object)
    acc[src == "none"] = np.nan  # an unlabelled chain cannot be scored or verified in replay
    feats = _features(rounds, width, PREFIX)
    inputs = None
    if axis_names is not None:
        unknown = [a for a in axis_names if a not in feats]
        if unknown:
            raise KeyError(f"unknown suffix feature(s) {unknown}; known: {FEATURES}")
        inputs = np.stack([feats[a] for a in axis_names], axis=2).astype(np.float32)  # [R, K, A]
    return RoundData(acc, inputs, feats["conf"])


def suffix_step_features(features: Sequence[Mapping | None], lengths: Sequence[int], names: Sequence[str],
                         width: int):
    """float32 ``[B, width, F]`` of the recomputed chains' features (``names`` order) at a serving step, laid out
    as :func:`suffix_round_data` lays a bank's rounds out."""
    import torch

    out = np.full((len(features), width, len(names)), np.nan, dtype=np.float64)
    for i, (f, n) in enumerate(zip(features, lengths)):
        n = min(int(n), width)
        if f is None or n <= 0:
            continue
        cond = conditional(np.asarray(f["suffix_prob"][:n], dtype=np.float64))
        for c, name in enumerate(names):
            out[i, :n, c] = cond if name == "conf" else float(f[name])
    return torch.from_numpy(out.astype(np.float32))


SUFFIX = ChainKind(
    id=3, name="suffix", samples=suffix_samples, config_key="suffix_model",
    feature_names=lambda cfg: FEATURES,
    table_axes=binned_table_axes,
    drafted_depth=suffix_drafted_depth, round_data=suffix_round_data,
    bank_file=SUFFIX_FILE.file, column_prefix=PREFIX, manifest_key="suffix_chain", engine_methods=("suffix",),
    bank=SUFFIX_FILE, proposer=SuffixProposer, settings=suffix_settings, step_features=suffix_step_features,
    engine_settings=suffix_engine_settings,
    description="suffix decoding (vLLM suffix, arctic-inference): the suffix tree's estimates of its chain")


def available() -> bool:
    """Whether the real implementation (``arctic_inference``'s native suffix tree) is installed."""
    try:
        from arctic_inference.suffix_decoding._C import SuffixTree  # noqa: F401
    except ImportError:
        return False
    return True
