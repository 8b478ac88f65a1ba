"""The bank schema: the one place that knows the specdec-calibration run layout.

A *bank* is a run directory in the public specdec-calibration layout::

    acceptance.parquet   keys + accept (int64) + acc0..acc{D-1} (int8, 1/0/null)
    speculator.parquet   keys + conf0..conf{D-1} (float64, null where nothing was proposed)
    run_manifest.json    optional: how the run was made
    stats.json           optional: accept histogram, mean commits, accept_by_position, by category
    routing.npy          optional: uint8 [N, layers, top_k] expert ids
    routing_meta.parquet optional: keys + routing_idx, routing_block_idx, request_idx, position, accepted

Both parquet files have one row per draft round, keyed by :data:`KEYS`. calib extends the layout
additively (a reader that knows only the public layout sees nothing new):

* speculator.parquet may carry ``tok{k}`` (int64 drafted token id), ``entropy{k}`` (float64, nats,
  of the drafter's distribution at depth k), ``margin{k}`` (float64, top-1 minus top-2 probability),
  ``batch_size`` (int64, requests in the verify step), ``temperature`` (float64) and ``logit_transforms``
  (string: the request's target-only logit transforms, calib/transforms.py).
* ngram.parquet (same keys) holds the n-gram (prompt-lookup) chain that the context offered at that
  round, its match features and, when known, its accept mask — see :data:`NGRAM_FEATURES` — and, in banks
  collected since calib recorded it, ``depth_agreement{j}`` per depth (:data:`NGRAM_DEPTH_FEATURES`).

Routing captures (MoE targets; see :data:`ROUTING_META_COLUMNS`): ``routing.npy`` row ``i`` holds,
for one position the target verified, the ``top_k`` expert ids chosen in each MoE layer.
``routing_meta.parquet`` has one row per routing row: the round's keys, ``routing_idx`` (the row of
routing.npy), ``routing_block_idx`` (index of the position inside that round's verify block:
0 = the position after the last committed token, j = draft token j), ``request_idx``, ``position``
(absolute token position in the request) and ``accepted`` (the token at that position was
committed). calib's rules: a round's block indices are distinct and do not exceed its drafted width,
positions are ``block start + routing_block_idx``, and ``accepted`` is a prefix in block order that
holds ``accept`` or ``accept + 1`` rows. ``run_manifest.json`` may describe the capture under
``"routing"`` (:data:`ROUTING_INFO`); ``n_experts`` there bounds the expert ids.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

KEYS: tuple[str, ...] = ("model", "speculator", "config", "category", "prompt_idx", "turn", "round_idx")
KEY_TYPES: dict[str, pa.DataType] = {
    "model": pa.string(),
    "speculator": pa.string(),
    "config": pa.string(),
    "category": pa.string(),
    "prompt_idx": pa.int64(),
    "turn": pa.int16(),
    "round_idx": pa.int64(),
}

ACCEPTANCE = "acceptance.parquet"
SPECULATOR = "speculator.parquet"
NGRAM = "ngram.parquet"
MANIFEST = "run_manifest.json"
STATS = "stats.json"
ROUTING = "routing.npy"
ROUTING_META = "routing_meta.parquet"

# Per-depth column families: prefix -> (arrow type, file).
ACC = "acc"
CONF = "conf"
PER_DEPTH: dict[str, tuple[pa.DataType, str]] = {
    ACC: (pa.int8(), ACCEPTANCE),
    CONF: (pa.float64(), SPECULATOR),
    "tok": (pa.int64(), SPECULATOR),
    "entropy": (pa.float64(), SPECULATOR),
    "margin": (pa.float64(), SPECULATOR),
}
# Round-level columns beyond the keys: name -> (arrow type, file, required).
ROUND_COLUMNS: dict[str, tuple[pa.DataType, str, bool]] = {
    "accept": (pa.int64(), ACCEPTANCE, True),
    "batch_size": (pa.int64(), SPECULATOR, False),
    "temperature": (pa.float64(), SPECULATOR, False),
    # Collected with calib serving on (calib/vllm/server.py): the chain the engine verified this round,
    # "model" (a prefix of the speculator's draft) or "ngram" (the n-gram chain calib substituted; the
    # round's acc/conf/tok columns are then empty, since the speculator's draft was not verified, and
    # ngram.parquet labels the chain as verified). Absent when serving was off.
    "verified_chain": (pa.string(), SPECULATOR, False),
    # The round's request carried target-only logit transforms (calib/transforms.py): their names
    # comma-joined ("allowed_token_ids", "logit_bias", "bad_words", "presence_penalty", "frequency_penalty",
    # "repetition_penalty", "structured_output"); "" none. Such rounds accept differently from what the
    # tables describe: train.py leaves them out by default. Absent (or null) in banks made before it.
    "logit_transforms": (pa.string(), SPECULATOR, False),
}

# ngram.parquet: the prompt-lookup chain of each round.
#   ngram_len      tokens in the chain (0: the context offered no match)
#   ngram_tok{j}   proposed token ids; acc{j} its accept mask (same rules as acceptance.parquet)
#   accept         accepted prefix length (null when unlabelled)
#   verified       True when this chain is the one the engine verified
#   label_source   "verified" | "counterfactual" (labelled from the final greedy output) | "none"
NGRAM_FEATURES: dict[str, pa.DataType] = {
    "match_n": pa.int64(),  # length of the matched context suffix
    "occurrences": pa.int64(),  # earlier occurrences of that suffix in the context
    "distance": pa.int64(),  # tokens back from the context end to the start of the match used
    "in_prompt": pa.bool_(),  # the match used lies in the prompt (vs. generated text)
    "distinct_next": pa.int64(),  # distinct next tokens proposed by the occurrences
    "agreement": pa.float64(),  # share of occurrences proposing the chain's first token
    "cont_len": pa.int64(),  # tokens available after the match (before the context end)
    "context_len": pa.int64(),  # tokens in the context when the chain was looked up
}
NGRAM_ROUND: dict[str, pa.DataType] = {
    "ngram_len": pa.int64(),
    **NGRAM_FEATURES,
    "accept": pa.int64(),
    "verified": pa.bool_(),
    "label_source": pa.string(),
}
LABEL_SOURCES = ("verified", "counterfactual", "none")
NGRAM_TOK = "ngram_tok"


@dataclass(frozen=True)
class ChainFile:
    """The layout of a chain kind's own bank file (one row per round, keyed by :data:`KEYS`): the chain the
    context offered at that round, its features and, when known, its accept mask. The bank writer and the
    validator read every registered layout the same way (:func:`register_chain_file`); a chain kind declares
    its own (:attr:`calib.chains.ChainKind.bank`).

    Columns: ``{length}`` (int64 tokens in the chain, 0: none), ``{token}{j}`` (int64 token ids, set exactly
    on the first ``length`` depths), ``acc{j}`` (int8 accept mask, the acceptance.parquet rules), ``accept``
    (int64, null when unlabelled), ``verified`` (bool: the engine verified this chain), ``label_source``
    (:data:`LABEL_SOURCES`), each round feature of ``features`` (null only on an empty chain) and each
    per-depth feature family ``{name}{j}`` of ``depth_features`` (float64, set exactly where a token is)."""

    file: str
    length: str
    token: str
    features: dict  # name -> (arrow type, low, high): a round feature and its range
    depth_features: dict = field(default_factory=dict)  # prefix -> (low, high): float64 per depth

    def round_columns(self) -> dict[str, pa.DataType]:
        return {self.length: pa.int64(), **{n: t for n, (t, _, _) in self.features.items()},
                "accept": pa.int64(), "verified": pa.bool_(), "label_source": pa.string()}

    def column_type(self, name: str) -> pa.DataType | None:
        cols = self.round_columns()
        if name in cols:
            return cols[name]
        if depth_columns([name], self.token):
            return pa.int64()
        if depth_columns([name], ACC):
            return pa.int8()
        if any(depth_columns([name], p) for p in self.depth_features):
            return pa.float64()
        return None

    def to_json(self) -> dict:
        """The layout as run_manifest.json's ``chain_files`` holds it (so that a bank names its own layouts)."""
        def bound(x):
            return None if math.isinf(x) else float(x)

        return {"length": self.length, "token": self.token,
                "features": {n: [str(t), bound(lo), bound(hi)] for n, (t, lo, hi) in self.features.items()},
                "depth_features": {p: [bound(lo), bound(hi)] for p, (lo, hi) in self.depth_features.items()}}

    @classmethod
    def from_json(cls, file: str, d: dict) -> ChainFile:
        def bound(x, inf):
            return inf if x is None else float(x)

        return cls(file, str(d["length"]), str(d["token"]),
                   {n: (pa.type_for_alias(t), bound(lo, -math.inf), bound(hi, math.inf))
                    for n, (t, lo, hi) in d["features"].items()},
                   {p: (bound(lo, -math.inf), bound(hi, math.inf)) for p, (lo, hi) in d.get("depth_features", {}).items()})

    def column_names(self, width: int) -> list[str]:
        """Every column of the file for a chain ``width`` tokens wide, in the order the writer lays out."""
        return (list(KEYS) + list(self.round_columns()) + [f"{self.token}{j}" for j in range(width)]
                + [f"{p}{j}" for p in self.depth_features for j in range(width)] + [f"{ACC}{j}" for j in range(width)])


# per depth: of the earlier occurrences still agreeing with the chain, the share going on with its token there
# (calib.ngram.depth_agreement); banks collected before it lack the columns, and stay valid
NGRAM_DEPTH_FEATURES = {"depth_agreement": (0.0, 1.0)}
NGRAM_FILE = ChainFile(NGRAM, "ngram_len", NGRAM_TOK,
                       {n: (t, 0.0, 1.0 if n == "agreement" else math.inf) for n, t in NGRAM_FEATURES.items()},
                       NGRAM_DEPTH_FEATURES)
_CHAIN_FILES: dict[str, ChainFile] = {NGRAM: NGRAM_FILE}  # the public layout's own extension, always known


def register_chain_file(spec: ChainFile) -> ChainFile:
    """Make the writer and the validator know a chain kind's bank file (:func:`calib.chains.register_chain`
    calls it); the same layout again is a no-op, another layout under a known file name a ``ValueError``."""
    known = _CHAIN_FILES.get(spec.file)
    if known is not None and known != spec:
        raise ValueError(f"bank file {spec.file!r} is already registered with another layout")
    twin = next((s.file for s in _CHAIN_FILES.values() if s.file != spec.file and s.length == spec.length), None)
    if twin is not None:  # the writer tells a chain table's file by its length column
        raise ValueError(f"bank file {spec.file!r}: its length column {spec.length!r} is {twin}'s already")
    _CHAIN_FILES[spec.file] = spec
    return spec


def unregister_chain_file(file: str) -> None:
    if file != NGRAM:
        _CHAIN_FILES.pop(file, None)


def chain_files() -> tuple[ChainFile, ...]:
    """Every registered chain file layout, by file name."""
    return tuple(_CHAIN_FILES[f] for f in sorted(_CHAIN_FILES))


def chain_file_of(table: pa.Table) -> ChainFile:
    """The registered layout a chain table follows (the one whose length column it holds); a ``ValueError``
    names the columns and the known layouts otherwise."""
    found = [s for s in chain_files() if s.length in table.column_names]
    if len(found) != 1:
        raise ValueError(f"a chain table with columns {table.column_names[:12]} matches {len(found)} registered "
                         f"chain files (by length column: {[(s.file, s.length) for s in chain_files()]})")
    return found[0]

ROUTING_META_COLUMNS: dict[str, pa.DataType] = {
    "routing_idx": pa.int64(),
    "routing_block_idx": pa.int64(),
    "request_idx": pa.int64(),
    "position": pa.int64(),
    "accepted": pa.bool_(),
}

# run_manifest.json "routing" object: how a routing capture was made.
ROUTING_INFO: dict[str, type] = {
    "n_experts": int,  # experts per MoE layer (ids are < n_experts)
    "top_k": int,  # experts chosen per position and layer (= routing.npy's last axis)
    "layers": int,  # MoE layers captured (= routing.npy's middle axis)
    "source": str,  # what produced it, e.g. "shadow-router proxy on SmolLM2-135M (dense model ran)"
    "proxy": bool,  # True when the routing is not that of a real MoE model
}

_DEPTH_COL = re.compile(r"^([a-z_]+?)(\d+)$")


def depth_columns(names, prefix: str) -> list[str]:
    """The ``{prefix}{k}`` columns among ``names``, ordered by depth k."""
    found = []
    for name in names:
        m = _DEPTH_COL.match(name)
        if m and m.group(1) == prefix:
            found.append((int(m.group(2)), name))
    return [name for _, name in sorted(found)]


def width(names, prefix: str = ACC) -> int:
    """Number of depths D, i.e. 1 + the largest k among ``{prefix}{k}`` columns (0 if none)."""
    cols = depth_columns(names, prefix)
    return 0 if not cols else int(_DEPTH_COL.match(cols[-1]).group(2)) + 1


def col(prefix: str, k: int) -> str:
    return f"{prefix}{k}"


def column_type(name: str, file: str) -> pa.DataType | None:
    """The schema type of column ``name`` in ``file`` (None for a column calib does not define)."""
    if name in KEY_TYPES:
        return KEY_TYPES[name]
    if file == ROUTING_META:
        return ROUTING_META_COLUMNS.get(name)
    if file in _CHAIN_FILES:
        return _CHAIN_FILES[file].column_type(name)
    for cname, (typ, home, _) in ROUND_COLUMNS.items():
        if cname == name and home == file:
            return typ
    for prefix, (typ, home) in PER_DEPTH.items():
        if home == file and depth_columns([name], prefix):
            return typ
    return None


def depth_matrix(table: pa.Table, prefix: str, n_depths: int | None = None) -> np.ndarray:
    """The ``{prefix}{k}`` columns as float64 [rows, n_depths], null -> NaN; absent columns are NaN
    (a bank narrower than ``n_depths``), so banks of any width line up."""
    if n_depths is None:
        n_depths = width(table.column_names, prefix)
    n = table.num_rows
    out = np.empty((n, n_depths))
    cols = [table.column(f"{prefix}{k}").to_numpy(zero_copy_only=False).astype(np.float64, copy=False)
            if f"{prefix}{k}" in table.column_names else None for k in range(n_depths)]
    # filled a block of rows at a time: a column written down a whole [rows, depths] matrix at once strides
    # through all of it once per depth (1M rounds x 16 depths: ~4x slower than blocks that stay in cache)
    for start in range(0, n, DEPTH_MATRIX_BLOCK):
        stop = min(start + DEPTH_MATRIX_BLOCK, n)
        for k, c in enumerate(cols):
            out[start:stop, k] = np.nan if c is None else c[start:stop]
    return out


DEPTH_MATRIX_BLOCK = 1 << 15  # rows per block of depth_matrix's copy
