"""Draft chain kinds: the one registry every layer reads (labels, training, tables, allocate, replay).

A *chain* is what one drafter proposes for a request at one round: tokens at depths 0..K-1, each
accepted only if every shallower one was. calib calibrates every chain kind the same way; what
differs between kinds is registered here, once, as a :class:`ChainKind`:

* ``id``: the value :class:`calib.allocate.Allocation` ``.drafter`` takes for this chain (0 is
  :data:`NO_CHAIN`, "verify nothing"); the Triton kernel receives it as a constexpr;
* ``name``: its key in config (``train.yaml``'s ``config_key`` group), ``tables.json`` and reports;
* ``samples(bank)``: censored per-depth samples (one row per round and depth reached: bank keys,
  ``depth``, ``label`` and the feature columns);
* ``feature_names(chain_cfg)``: the columns of the feature matrix ``X [n, F]`` every estimator of this
  chain takes (netcal's convention: the drafter's raw confidence in column 0 for a chain that has one,
  then context features);
* ``table_axes(chain_cfg)``: how its exported table is cut (:class:`Axis`; the layout is in
  :mod:`calib.tables.layout`);
* ``drafted_depth(bank_dir)``: the drafted depth K a bank folder records for this chain (0: none);
* ``round_data(rounds, axis_names)``: the chain per round of a bank, for evaluation and replay
  (:class:`RoundData`: accept mask, table inputs in ``axis_names`` order, raw confidence), None where
  the bank does not record it;
* ``config_key``: the ``train.yaml`` group holding its ``candidates`` (estimators of the one protocol,
  :mod:`calib.calibrators.base`) and table settings (``calibrator`` for the model chain,
  ``ngram_model`` for the n-gram chain: the README's overrides keep working);
* ``confidence``: the name of X's column 0 when it is the drafter's raw confidence (the model chain):
  training then reports raw vs calibrated per depth and the accepted length per round.

Context axes. Besides its own axes, every chain's table may be cut by what the engine knows about the
request at that round (:data:`CONTEXT`: the sampling temperature, the previous round's accepted
length). They are binned axes after the chain's own ones, one per name of the chain config's
``context`` block (``conf/context/``: ``axes`` always cut the table, ``candidates`` only where
validation NLL says they pay; edges listed, or ``auto`` = midpoints between the distinct training
values). Samples and a bank's rounds carry them as round columns of the same name
(:func:`calib.labels.round_context`), so training, eval and replay read what an engine would pass.

The allocator chooses between at most two chains per request (:mod:`calib.allocate.reference`); any
two registered kinds may be those two.

A new chain kind (vLLM's ``suffix`` decoding, say) is one :func:`register_chain` call plus the
collector hook that writes its columns into the bank; nothing else names chains
(``tests/test_chains.py`` registers a SYNTHETIC one and takes it through training, export, load,
lookup and allocation).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

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
    # (rounds table of Bank.rounds(with_ngram=...), table axis names or None) -> RoundData | None
    round_data: Callable | None = None
    confidence: str | None = None  # X's column 0 when it is the drafter's raw confidence
    description: str = ""

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


def register_chain(kind: ChainKind, *, replace: bool = False) -> ChainKind:
    """Add ``kind`` to the registry; its ``id`` (>= 1) and ``name`` must be new unless ``replace``."""
    if kind.id <= NO_CHAIN or kind.id > 127:
        raise ValueError(f"chain {kind.name!r}: id {kind.id} must be in 1..127 (0 = no chain, int8 outputs)")
    for other in _REGISTRY.values():
        if other.name != kind.name and other.id == kind.id:
            raise ValueError(f"chain id {kind.id} is taken by {other.name!r}")
    if kind.name in _REGISTRY and not replace:
        raise ValueError(f"chain {kind.name!r} is already registered")
    _REGISTRY[kind.name] = kind
    return kind


def unregister_chain(name: str) -> None:
    """Remove a chain kind (tests register temporary ones)."""
    _REGISTRY.pop(name, None)


def chains() -> tuple[ChainKind, ...]:
    """Every registered chain kind, by id (the allocator's tie order: lower id first)."""
    _builtin()
    return tuple(sorted(_REGISTRY.values(), key=lambda c: c.id))


def chain(key: str | int) -> ChainKind:
    """The chain kind of a name or id; a ``KeyError`` lists the registered ones."""
    for c in chains():
        if key in (c.name, c.id):
            return c
    raise KeyError(f"no chain kind {key!r}; registered: {[(c.id, c.name) for c in chains()]}")


def chain_names() -> tuple[str, ...]:
    return tuple(c.name for c in chains())


_BUILTIN_DONE = False


def _builtin() -> None:
    """Register the built-in kinds on first use (their hooks import pandas/pyarrow lazily)."""
    global _BUILTIN_DONE
    if _BUILTIN_DONE:
        return
    _BUILTIN_DONE = True
    from calib import labels

    register_chain(ChainKind(
        id=1, name="model", samples=labels.model_samples, confidence="conf", config_key="calibrator",
        feature_names=lambda cfg: ("conf", *tuple(cfg.get("extra") or ())),
        table_axes=lambda cfg: (Axis("conf", points=int(cfg.get("grid_points", 1025))), *context_axes(cfg)),
        drafted_depth=labels.model_drafted_depth, round_data=labels.model_round_data,
        description="the model-based drafter (draft model, EAGLE): raw confidence per depth"))
    register_chain(ChainKind(
        id=2, name="ngram", samples=labels.ngram_samples, config_key="ngram_model",
        feature_names=lambda cfg: labels.NGRAM_SAMPLE_FEATURES,
        table_axes=lambda cfg: (*(Axis(f, edges=tuple(float(x) for x in e))
                                  for f, e in zip(cfg["table"]["features"], cfg["table"]["edges"])),
                                *context_axes(cfg)),
        drafted_depth=labels.ngram_drafted_depth, round_data=_ngram_round_data,
        description="prompt lookup (vLLM ngram): match features of the chain the context offered"))


def round_inputs(kind: ChainKind, rounds, axis_names):
    """:attr:`ChainKind.round_data` with the table's context axes appended: the chain's own inputs for
    the names that are not :data:`CONTEXT` axes, then each context axis' per-round value
    (:func:`calib.labels.round_context` of ``rounds``, a bank's rounds sorted by its keys) repeated over
    depths. ``axis_names`` None: no inputs."""
    if kind.round_data is None:
        return None
    if axis_names is None:
        return kind.round_data(rounds, None)
    names = list(axis_names)
    ctx = [n for n in names if n in CONTEXT]
    own = names[: len(names) - len(ctx)]
    if names[len(own):] != ctx:
        raise ValueError(f"chain {kind.name!r}: context axes {ctx} must come after the chain's own axes, got {names}")
    data = kind.round_data(rounds, own)
    if data is None or not ctx:
        return data
    import numpy as np

    from calib.labels import round_context

    values = round_context(rounds, ctx)
    extra = np.stack([values[n] for n in ctx], axis=1).astype(np.float32)  # [R, A_ctx]
    width = data.inputs.shape[1]
    inputs = np.concatenate([data.inputs, np.repeat(extra[:, None, :], width, axis=1)], axis=2)  # [R, K, A]
    return RoundData(data.acc, inputs, data.raw)


def _ngram_round_data(rounds, axis_names):
    from calib.tables.features import ngram_round_data

    return ngram_round_data(rounds, axis_names)
