"""Draft chain kinds: their types and the one registry every layer reads (training, tables, allocate,
replay, serving). What a kind is and how a new one is added: docs/chains.md; the built-in kinds are
one file each (:mod:`calib.chains.model`, :mod:`calib.chains.ngram`), registered by :mod:`calib.chains`.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

NO_CHAIN = 0  # Allocation.drafter when a request verifies no draft token


@dataclass(frozen=True)
class Axis:
    """One axis of a chain's table, reading one column of ``X`` (axes are in ``X``'s column order).

    A *binned* axis has inner ``edges`` (bucket = number of edges <= x, so ``len(edges) + 1``
    buckets); an *interpolated* axis (``points > 0``, at most one, always axis 0: the raw
    confidence) is a uniform grid of ``points`` values over [0, 1] read by linear interpolation.
    """

    name: str
    edges: tuple[float, ...] = ()
    points: int = 0

    @property
    def interpolated(self) -> bool:
        return self.points > 0

    def to_json(self) -> dict:
        if self.interpolated:
            return {"name": self.name, "kind": "interpolate", "points": self.points}
        return {"name": self.name, "kind": "bins", "edges": [float(e) for e in self.edges]}

    @classmethod
    def from_json(cls, d: dict) -> Axis:
        if d["kind"] == "interpolate":
            return cls(d["name"], points=int(d["points"]))
        return cls(d["name"], edges=tuple(float(e) for e in d["edges"]))


@dataclass(frozen=True)
class ChainKind:
    """A registered chain kind; see the module docstring for each field."""

    id: int
    name: str
    samples: Callable  # (Bank) -> pd.DataFrame of censored per-depth samples
    feature_names: Callable[[dict], tuple[str, ...]]  # (chain config) -> columns of X, in order
    table_axes: Callable[[dict], tuple[Axis, ...]]  # (chain config) -> the exported table's axes
    drafted_depth: Callable[[Path], int]  # (bank folder) -> drafted K of this chain (0: none)
    config_key: str = ""  # train.yaml group holding ``candidates`` (+ table settings); default: name
    # (rounds table of Bank.rounds(chains=...), table axis names or None) -> RoundData | None
    round_data: Callable | None = None
    confidence: str | None = None  # X's column 0 when it is the drafter's raw confidence
    description: str = ""
    # The bank file holding this chain's own round columns besides acceptance ⋈ speculator (None: it
    # has none), joined by Bank.rounds(chains=...) with its columns renamed column_prefix + name.
    bank_file: str | None = None
    column_prefix: str = ""
    # The run_manifest.json object describing this chain (its "width" = the drafted depth), None: none.
    manifest_key: str | None = None
    engine_methods: tuple[str, ...] = ()  # the engine's (vLLM's) speculative methods that draft this chain
    # (Offer, own feature names, B, lengths, what) -> float64 [B, W, len(own)] (numpy): the table's own inputs
    # from what the chain offers at a serving step; None: offer_inputs (the offer's signal as given)
    step_inputs: Callable | None = None
    # (request's token ids, settings, prompt length, max_model_len) -> (tokens, features dict or None): the
    # chain recomputed from a request's tokens at a serving step (a model-free chain: prompt lookup)
    propose: Callable | None = None
    # (token buffer [R, N], rows [B], lengths [B], prompt lengths [B], settings, max_model_len, extra tokens [B, E],
    # their counts [B]) -> (tokens [B][<= k], features float64 [B, F (+ k per depth feature)]): ``propose`` for a
    # whole step at once
    # (serving's hot path); None: ``propose`` per request
    propose_batch: Callable | None = None
    # the layout of ``bank_file`` (calib.bank.schema.ChainFile): registered with the kind, so that the bank
    # writer and the validator know the file (None: the chain has no file of its own)
    bank: object = None
    # (settings, k) -> a stateful recomputation of the chain per request (capture and serving): ``.propose(req_id,
    # token ids, prompt length, max_model_len) -> (tokens, features dict or None)``, ``.finish(req_id)``;
    # its features are ``bank``'s round features and per-depth lists of its depth features (None: ``propose``)
    proposer: Callable | None = None
    # (given settings or None, k) -> the kind's settings, validated, defaults filled (what ``propose`` and
    # ``proposer`` take); None: the kind has none
    settings: Callable | None = None
    # (features dicts [B] (None: no chain), lengths [B], own feature names, width) -> float32 [B, width, F]: the
    # table's own inputs from what ``proposer``/``propose`` returned, as ``round_data`` lays a bank's rounds out
    step_features: Callable | None = None
    # (vLLM's speculative config) -> the kind's settings where vLLM drafts this chain itself (its method), so that
    # calib's recomputation is vLLM's draft; None: its defaults
    engine_settings: Callable | None = None
    # the serving knob (a field of calib.serve.knobs.ServeKnobs) holding the settings serving recomputes the chain
    # with where vLLM drafts another chain; "": none (the kind's defaults)
    serve_knob: str = ""
    # (per-request feature rows of ``propose_batch`` [B][F] (float64), lengths [B], own feature names, width) ->
    # float32 [B, width, F] (a numpy array or a tensor): ``step_features`` for what ``propose_batch`` returns; None:
    # the kind has no batch path
    batch_features: Callable | None = None
    # per-depth features of ``bank`` a table may read although a bank predates them: the kind fills them in
    # (documented where it does) and check_bank notes such a bank instead of refusing it
    filled_features: tuple[str, ...] = ()

    def recompute(self, settings, k: int):
        """The kind's per-request recomputation (:attr:`proposer`, else a stateless wrapper of :attr:`propose`)
        with its settings resolved (:attr:`settings`); None for a chain that is not recomputed."""
        resolved = self.settings(settings, k) if self.settings is not None else settings
        if self.proposer is not None:
            return self.proposer(resolved, k)
        if self.propose is not None:
            return _Stateless(self.propose, resolved)
        return None

    @property
    def config(self) -> str:
        return self.config_key or self.name

    def X(self, samples, chain_cfg: dict, context: bool = True, reads=()):
        """The feature matrix ``X [n, F]`` (a DataFrame) of ``samples``: columns :attr:`feature_names`,
        then (``context``) the selected context axes of ``chain_cfg`` (:func:`context_axes`), then any
        other sample column in ``reads`` (the named features of an estimator that reads more, such as
        the model chain's entropy and margin: :mod:`calib.calibrators.features`)."""
        names = list(self.feature_names(chain_cfg))
        if context:
            names += [a.name for a in context_axes(chain_cfg)]
        names += [n for n in reads if n not in names]
        missing = [n for n in names if n not in samples.columns]
        if missing:
            raise ValueError(f"chain {self.name!r}: the samples lack feature columns {missing} "
                             f"(they have {sorted(map(str, samples.columns))})")
        return samples[names]


class _Stateless:
    """A ``propose`` function as a per-request recomputation (:meth:`ChainKind.recompute`): stateless, so
    recomputed whenever asked."""

    stateful = False

    def __init__(self, propose: Callable, settings):
        self.fn, self.settings = propose, settings

    def propose(self, req_id: str, context, prompt_len: int, max_model_len: int | None):
        return self.fn(context, self.settings, prompt_len, max_model_len)

    def finish(self, req_id: str) -> None:
        pass


@dataclass(frozen=True)
class RoundData:
    """One chain over a bank's rounds (``R`` rounds, ``K`` depths)."""

    acc: object  # float [R, K]: 1/0, NaN where not drafted or unlabelled
    inputs: object = None  # float32 [R, K, A]: the table's inputs (None when no axes were asked for)
    raw: object = None  # float [R, K]: the drafter's raw confidence (chains with one)


# Context axes every chain may be cut by: name -> what the engine passes (per request, repeated over
# depths). Their values per round come from calib.labels.round_context (one definition for samples,
# eval and replay); NaN (not recorded / a request's first round) falls in bucket 0 of any edges.
CONTEXT = {
    "temperature": "the request's sampling temperature (0 = greedy)",
    "prev_accept": "the request's accepted length in its previous round (same prompt and turn; NaN in its first)",
    "mean_accept": "the request's mean accepted length over its earlier rounds (NaN in its first)",
    "position": "the tokens the request has generated in this turn before this round (0 in its first)",
}


def context_spec(chain_cfg: dict) -> tuple[list[str], list[str], dict]:
    """``(axes, candidates, edges)`` of a chain config's ``context`` block: context axes always in the
    table, optional ones (kept where validation NLL improves), and each name's edges (list or "auto")."""
    ctx = (chain_cfg or {}).get("context") or {}
    axes, cands = list((ctx.get("axes") or {}).keys()), list((ctx.get("candidates") or {}).keys())
    edges = {n: (spec or {}).get("edges", "auto")
             for block in ("axes", "candidates") for n, spec in (ctx.get(block) or {}).items()}
    unknown = [n for n in axes + cands if n not in CONTEXT]
    if unknown:
        raise ValueError(f"context axes {unknown} are not registered context axes; known: {sorted(CONTEXT)}")
    return axes, cands, edges


def context_axes(chain_cfg: dict) -> tuple[Axis, ...]:
    """The context axes a resolved chain config selected (``context.selected``; default: its ``axes``)
    with resolved edges (:func:`resolve_edges`), in table order (after the chain's own axes)."""
    ctx = (chain_cfg or {}).get("context") or {}
    axes, _, edges = context_spec(chain_cfg)
    names = list(ctx.get("selected", axes))
    for n in names:
        if isinstance(edges.get(n), str):
            raise ValueError(f"context axis {n!r}: edges {edges[n]!r} are not resolved (calib.chains.resolve_edges)")  # noqa: TRY004 -- a config value, not a type error
    return tuple(Axis(n, edges=tuple(float(e) for e in edges[n])) for n in names)


def binned_table_axes(chain_cfg: dict) -> tuple[Axis, ...]:
    """A model-free chain's table axes: its ``table.features`` binned at ``table.edges``, then its context axes
    (:func:`context_axes`); the ``table_axes`` of a chain kind without a raw confidence."""
    table = chain_cfg["table"]
    return (*(Axis(f, edges=tuple(float(x) for x in e)) for f, e in zip(table["features"], table["edges"])),
            *context_axes(chain_cfg))


def split_context(names, chain_name: str) -> tuple[list[str], list[str]]:
    """``(own, context)`` of a chain table's axis names: the chain's own axes, then the :data:`CONTEXT`
    axes, which must come last (a ``ValueError`` naming the chain otherwise)."""
    names = list(names)
    ctx = [n for n in names if n in CONTEXT]
    own = names[: len(names) - len(ctx)]
    if names[len(own):] != ctx:
        raise ValueError(f"chain {chain_name!r}: context axes {ctx} must come after the chain's own axes, got {names}")
    return own, ctx


def resolve_edges(values, spec, max_bins: int = 8, decimals: int = 4) -> list[float]:
    """Inner bin edges of a context axis: ``spec`` as given when it is a list; ``"auto"``: midpoints
    between the distinct (rounded) finite training ``values`` (none for a single value: a one-bin
    axis), thinned to at most ``max_bins`` bins by quantiles of those distinct values."""
    if not isinstance(spec, str):
        return [float(e) for e in spec]
    if spec != "auto":
        raise ValueError(f"context edges must be a list of numbers or 'auto', got {spec!r}")
    import numpy as np

    v = np.asarray(values, dtype=np.float64)
    u = np.unique(np.round(v[np.isfinite(v)], decimals))
    if len(u) > max_bins:  # keep bins that split the values into groups of similar count
        u = np.unique(np.quantile(u, np.linspace(0, 1, max_bins)))
    return [float(round((a + b) / 2, decimals + 1)) for a, b in itertools.pairwise(u)]


_REGISTRY: dict[str, ChainKind] = {}
_BY_ID: list = [None]  # the registry sorted by id, kept until it changes (serving reads it many times a step)


def register_chain(kind: ChainKind, *, replace: bool = False) -> ChainKind:
    """Add ``kind`` to the registry; its ``id`` (>= 1) and ``name`` must be new unless ``replace``."""
    if kind.id <= NO_CHAIN or kind.id > 127:
        raise ValueError(f"chain {kind.name!r}: id {kind.id} must be in 1..127 (0 = no chain, int8 outputs)")
    for other in _REGISTRY.values():
        if other.name != kind.name and other.id == kind.id:
            raise ValueError(f"chain id {kind.id} is taken by {other.name!r}")
    if kind.name in _REGISTRY and not replace:
        raise ValueError(f"chain {kind.name!r} is already registered")
    if kind.bank is not None:  # the bank writer and validator learn its file
        from calib.bank.schema import register_chain_file

        if kind.bank.file != kind.bank_file:
            raise ValueError(f"chain {kind.name!r}: bank layout {kind.bank.file!r} is not its bank_file {kind.bank_file!r}")
        register_chain_file(kind.bank)
    _REGISTRY[kind.name] = kind
    _BY_ID[0] = None
    return kind


def unregister_chain(name: str) -> None:
    """Remove a chain kind (tests register temporary ones), and its bank file's layout."""
    kind = _REGISTRY.pop(name, None)
    _BY_ID[0] = None
    if kind is not None and kind.bank is not None:
        from calib.bank.schema import unregister_chain_file

        unregister_chain_file(kind.bank.file)


def recomputed_chains() -> tuple[ChainKind, ...]:
    """The registered kinds calib recomputes from a request's tokens (capture records them beside every round;
    serving offers them): those with a ``proposer`` or a ``propose`` and a bank layout."""
    return tuple(k for k in chains() if (k.proposer is not None or k.propose is not None) and k.bank is not None)


def chains() -> tuple[ChainKind, ...]:
    """Every registered chain kind, by id (the allocator's tie order: lower id first)."""
    if _BY_ID[0] is None:
        _BY_ID[0] = tuple(sorted(_REGISTRY.values(), key=lambda c: c.id))
    return _BY_ID[0]


def chain(key: str | int) -> ChainKind:
    """The chain kind of a name or id; a ``KeyError`` lists the registered ones."""
    if isinstance(key, str) and key in _REGISTRY:
        return _REGISTRY[key]
    for c in chains():
        if key in (c.name, c.id):
            return c
    raise KeyError(f"no chain kind {key!r}; registered: {[(c.id, c.name) for c in chains()]}")


def chain_names() -> tuple[str, ...]:
    return tuple(c.name for c in chains())


def confidence_chain() -> str:
    """The (first registered) chain kind with a raw confidence: the model drafter's chain."""
    return next(k.name for k in chains() if k.confidence is not None)


def verified_chain(speculator: str, method: str | None) -> str:
    """The chain an engine (or a bank's engine) verified: a model-free chain kind named by the speculator
    (or vLLM's method), else the model drafter's (:func:`confidence_chain`)."""
    for kind in chains():
        if kind.confidence is None and kind.name in (speculator, method):
            return kind.name
    return confidence_chain()


def chain_of_method(method: str) -> ChainKind:
    """The chain kind an engine's speculative ``method`` drafts (:attr:`ChainKind.engine_methods`); a
    ``KeyError`` lists the methods the registered kinds support."""
    for kind in chains():
        if method in kind.engine_methods:
            return kind
    known = [m for k in chains() for m in k.engine_methods]
    raise KeyError(f"speculative method {method!r} is not supported ({', '.join(known)})")


@dataclass(frozen=True)
class Offer:
    """What one chain offers for the engine's ``B`` running requests at a serving step."""

    tokens: list[list[int]]  # [B][<= L]: the chain per request ([] = none)
    # the chain's signal: float [B, K] raw confidence (the model chain; entries beyond a request's tokens
    # ignored), or float [B, L, F] the table's own (non-context) features in its axis order
    signal: object = None
    # float [B, >= L]: the chain's calibrated P(accept | reached) when the engine already looked it up
    # this step (calib.allocate.calibrated_probs on the same inputs); replaces the signal's lookup
    probs: object = None


def offer_inputs(x, B: int, lengths: list[int], n_own: int, what: str) -> np.ndarray:
    """An offer's signal ``x`` (a tensor, an array or nested lists) as a numpy float64 ``[B, W, n_own]`` (W = the
    longest chain), NaN beyond each request's chain (``[B, L]`` is read as one feature). numpy: a serving step
    builds it for a few requests, where a torch call's fixed cost would be most of the time."""
    width = max(lengths, default=0)
    if width == 0:
        return np.full((B, 1, n_own), np.nan)
    if x is None:
        raise ValueError(f"{what} is None but the chain has tokens")
    if not isinstance(x, np.ndarray):
        import torch

        if not (isinstance(x, torch.Tensor) and x.dtype in (torch.float32, torch.float64) and x.device.type == "cpu"):
            x = torch.as_tensor(x)  # nested lists read as torch reads them (floats as float32)
            x = x if x.dtype in (torch.float32, torch.float64) else x.to(torch.float64)
        x = x.detach().cpu().numpy()
    if x.ndim == 2:
        x = x[..., None]
    if x.ndim != 3 or x.shape[0] != B or x.shape[2] != n_own:
        raise ValueError(f"{what} must be [B={B}, L, F={n_own}], got {tuple(x.shape)}")
    if x.shape[1] < width:
        raise ValueError(f"{what} has {x.shape[1]} depths, a chain has {width} tokens")
    out = x[:, :width].astype(np.float64)  # a copy: the offer is left as given
    out[np.arange(width)[None, :] >= np.asarray(lengths)[:, None]] = np.nan
    return out
