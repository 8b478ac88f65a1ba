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

The allocator chooses between at most two chains per request (:mod:`calib.allocate.reference`); any
two registered kinds may be those two.

A new chain kind (vLLM's ``suffix`` decoding, say) is one :func:`register_chain` call plus the
collector hook that writes its columns into the bank; nothing else names chains
(``tests/test_chains.py`` registers a SYNTHETIC one and takes it through training, export, load,
lookup and allocation).
"""

from __future__ import annotations

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

    def X(self, samples, chain_cfg: dict):
        """The feature matrix ``X [n, F]`` (a DataFrame, columns :attr:`feature_names`) of ``samples``."""
        names = list(self.feature_names(chain_cfg))
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
        table_axes=lambda cfg: (Axis("conf", points=int(cfg.get("grid_points", 1025))),),
        drafted_depth=labels.model_drafted_depth, round_data=labels.model_round_data,
        description="the model-based drafter (draft model, EAGLE): raw confidence per depth"))
    register_chain(ChainKind(
        id=2, name="ngram", samples=labels.ngram_samples, config_key="ngram_model",
        feature_names=lambda cfg: labels.NGRAM_SAMPLE_FEATURES,
        table_axes=lambda cfg: tuple(Axis(f, edges=tuple(float(x) for x in e))
                                     for f, e in zip(cfg["table"]["features"], cfg["table"]["edges"])),
        drafted_depth=labels.ngram_drafted_depth, round_data=_ngram_round_data,
        description="prompt lookup (vLLM ngram): match features of the chain the context offered"))


def _ngram_round_data(rounds, axis_names):
    from calib.tables.features import ngram_round_data

    return ngram_round_data(rounds, axis_names)
