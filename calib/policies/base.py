"""The policy registry: one :class:`Policy` per name, what the replay computes and what serving runs.

A policy's entry holds its replay function (``compute``, on a :class:`calib.policies.setting.Setting`)
and, if it can be served, its :class:`Serving` spec (what ``serve.py policy=<name>`` runs; the Hydra
``policy`` group, the serve runner and bench/serve.py's arms are derived from it). Old serving names are
:attr:`Policy.aliases`. The two kinds and how the replay calls them: docs/policies.md.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple, TypedDict

import numpy as np

KINDS = ("step", "hindsight")
# Which side of the report's *Answer* a policy is on (:attr:`Policy.camp`): ``calib`` = calib's policies that
# serve (bench/serve.py's calib arms), ``peer`` = the arms a vLLM user could deploy instead (no speculation,
# vLLM's fixed K of every drafter the bank records, Dynamic SD, V2 adaptive verification), ``reference`` =
# bounds and building blocks (oracle, best_fixed in hindsight, replay-only allocators).
CAMPS = ("calib", "peer", "reference")
# The camp of a registered policy that does not set one (``camp=None``): a fallback for policies whose
# register_policy call predates the camp field; any other name is ``reference`` (left out of the Answer).
CAMP_DEFAULTS = {
    "no_spec": "peer", "fixed": "peer", "second_fixed": "peer", "vllm_dsd": "peer", "vllm_adaptive": "peer",
    "oracle": "reference", "best_fixed": "reference", "homogeneous": "reference", "gated_uniform": "reference",
    "ragged_raw": "reference", "ragged_calibrated": "calib", "two_drafter": "calib",
}
BASE_TOTALS = ("tokens", "cost", "positions", "steps", "rounds")  # every Totals has these; the rest are extras
log = logging.getLogger("calib.policies")


class PolicyResult(NamedTuple):
    """A step policy's decisions on one setting: tokens per round, cost and positions per step; ``extra`` holds
    scalars for the row (e.g. ``{"gamma": 3}``). A tuple, so ``tokens, cost, positions, extra = result`` works."""

    tokens: np.ndarray  # [S, B] committed tokens per round (accepted + 1; a step's: .sum(-1))
    cost: np.ndarray  # [S] verify + drafting cost per step (the curve's unit)
    positions: np.ndarray  # [S] draft positions verified per step
    extra: dict


class Totals(TypedDict, total=False):
    """A policy's sums over one slice's steps (what a ladder row is computed from), plus extras."""

    tokens: float
    cost: float
    positions: float
    steps: int
    rounds: int
    gamma: int


@dataclass(frozen=True)
class Arm:
    """One arm of bench/serve.py: its label and the ``speculative=`` config group it serves with
    (None: the config's default); ``default``: run unless ``--arms`` names the arms; ``replay``: the registered
    policy whose replay row predicts it (None: the arm's own policy)."""

    name: str
    speculative: str | None = None
    default: bool = True
    replay: str | None = None


@dataclass(frozen=True)
class Serving:
    """What ``serve.py policy=<name>`` runs in vLLM (the Hydra ``policy`` config node's fields).

    Attributes:
        speculate: vLLM speculates (``speculative=`` as configured); False: plain decoding.
        calib: calib decides each step inside the engine (calib/vllm/server.py) from the tables.
        chains: calib policies: the chains calib may verify (registered chain names).
        plan: calib policies with a model drafter: choose each step's number of draft passes.
        dynamic: vLLM Dynamic SD's schedule ``[[first B, last B, K], ...]`` (K capped at the configured K).
        oracle: the clock oracle (calib/serve/oracle.py): each step verifies exactly what a reference output of no
            speculation accepts (greedy only; needs ``serve.oracle``), the ceiling of verification allocation.
        arms: bench/serve.py's arms of this policy.
    """

    speculate: bool
    calib: bool = False
    chains: tuple[str, ...] | None = None
    plan: bool | None = None
    dynamic: tuple[tuple[int, int, int], ...] | None = None
    oracle: bool = False
    arms: tuple[Arm, ...] = ()

    def node(self, name: str, alias: str | None = None) -> dict:
        """The ``policy`` config node (conf/serve.yaml's ``policy:``) of policy ``name``; ``alias``: the old
        serving name it was asked for by (recorded in serve.json), else None."""
        return {"name": name, "alias": alias, "speculate": self.speculate, "calib": self.calib,
                "chains": None if self.chains is None else list(self.chains), "plan": self.plan,
                "dynamic": None if self.dynamic is None else [list(r) for r in self.dynamic], "oracle": self.oracle}


@dataclass(frozen=True)
class Policy:
    """One policy: how the replay scores it and, if servable, how serve.py runs it.

    Attributes:
        name: the name in ``replay.policies`` and in ladder rows (a family's rows: ``<name>_<x>``).
        order: position in the ladder plot and the report's tables (ascending; ties by name).
        colour: matplotlib colour of its ladder bars.
        explanation: one line, what it does (the report lists it under the ladder).
        compute: see the module docstring (signature depends on ``kind``).
        kind: ``"step"`` or ``"hindsight"``.
        below_no_spec: one line, why it can fall below ``no_spec`` (the report's *Checks*); "" if it cannot.
        needs: policies computed whenever this one is (e.g. ``best_fixed`` needs ``no_spec`` and ``fixed``);
            computed rows not asked for in ``replay.policies`` are not written.
        family: the policy is a family of rows ``<name>_<x>`` (``fixed`` -> ``fixed_1`` .. ``fixed_K``).
        plot: drawn in the ladder plot (a family's many rows are not).
        pooled_extra: extras of its rows carried into category ``all`` (a family's constant ``gamma``).
        camp: ``"calib"``, ``"peer"`` or ``"reference"`` (see :data:`CAMPS`): the report's *Answer* pits the
            best ``calib`` policy against the best ``peer``. None: :data:`CAMP_DEFAULTS` by name, else
            ``reference``; read it through :func:`camp_of`.
        serving: what ``serve.py policy=<name>`` runs (None: replay only).
        aliases: other names ``serve.py policy=`` accepts for it (old serving names); each says it is an alias.
        stateful: its replay carries what it learnt from one step to the next (an online estimator): replayed a
            step at a time (``replay.lanes``), it keeps that in ``Setting.lanes.memory`` between calls, and its
            steps are taken in order even where the requests are independent (B = 1).
    """

    name: str
    order: float
    colour: str | None
    explanation: str
    compute: Callable
    kind: str = "step"
    below_no_spec: str = ""
    needs: tuple[str, ...] = ()
    family: bool = False
    plot: bool = True
    pooled_extra: tuple[str, ...] = ()
    camp: str | None = None
    serving: Serving | None = None
    aliases: tuple[str, ...] = ()
    stateful: bool = False

    def __post_init__(self) -> None:
        if not self.name or not self.name.replace("_", "").isalnum():
            raise ValueError(f"Policy name {self.name!r} is invalid; use letters, digits and underscores")
        if self.kind not in KINDS:
            raise ValueError(f"Policy {self.name!r}: kind={self.kind!r} is invalid; it must be one of {list(KINDS)}")
        if not callable(self.compute):
            raise TypeError(f"Policy {self.name!r}: compute must be callable")
        if self.camp is not None and self.camp not in CAMPS:
            raise ValueError(f"Policy {self.name!r}: camp={self.camp!r} is invalid; it must be one of {list(CAMPS)}")
        if "\n" in self.explanation or "\n" in self.below_no_spec:
            raise ValueError(f"Policy {self.name!r}: explanation and below_no_spec are one line each")
        if self.aliases and self.serving is None:
            raise ValueError(f"Policy {self.name!r}: aliases are serving names; it has no serving spec")

    def owns(self, row: str) -> bool:
        """Whether a ladder row name belongs to this policy."""
        return row.startswith(self.name + "_") if self.family else row == self.name


_REGISTRY: dict[str, Policy] = {}
_ALIASES: dict[str, str] = {}  # alias -> canonical name


def register_policy(p: Policy, replace: bool = False) -> Policy:
    """Add ``p`` (after the ones registered before it: hindsight policies see every step policy's
    totals). A name or alias already taken is refused unless ``replace``; ``needs`` must name registered
    policies."""
    if p.name in _REGISTRY and not replace:
        raise ValueError(f"policy {p.name!r} is already registered")
    clash = [n for n in (p.name, *p.aliases)
             if _ALIASES.get(n, p.name) != p.name or (n != p.name and n in _REGISTRY)]
    if clash:
        raise ValueError(f"policy {p.name!r}: {clash} already name another registered policy or alias")
    missing = [n for n in p.needs if n not in _REGISTRY and n != p.name]
    if missing:
        raise ValueError(f"policy {p.name!r} needs {missing}, which are not registered; "
                         f"registered: {list(_REGISTRY)}")
    if p.name in _REGISTRY:
        _drop_aliases(p.name)
    _REGISTRY[p.name] = p
    _ALIASES.update({a: p.name for a in p.aliases})
    return p


def _drop_aliases(name: str) -> None:
    for alias in [a for a, n in _ALIASES.items() if n == name]:
        del _ALIASES[alias]


def unregister_policy(name: str) -> None:
    """Remove a registered policy and its aliases (tests and experiments)."""
    if name not in _REGISTRY:
        raise KeyError(f"no policy {name!r}; registered: {list(_REGISTRY)}")
    del _REGISTRY[name]
    _drop_aliases(name)


def policies() -> tuple[Policy, ...]:
    """Every registered policy, in registration (= computation) order."""
    return tuple(_REGISTRY.values())


def policy_names() -> tuple[str, ...]:
    return tuple(_REGISTRY)


def canonical(name: str) -> str:
    """The registered name ``name`` stands for: itself, or the policy it is an alias of (logged)."""
    if name in _ALIASES:
        log.info("policy %r is an alias of %r", name, _ALIASES[name])
        return _ALIASES[name]
    return name


def policy(name: str) -> Policy:
    """The registered policy ``name`` (or an alias of it); a ``KeyError`` naming the registered ones otherwise."""
    name = canonical(name)
    if name not in _REGISTRY:
        raise KeyError(f"unknown policy {name!r}; registered policies: {list(_REGISTRY)}")
    return _REGISTRY[name]


def aliases() -> dict[str, str]:
    """{alias: canonical name} of every registered policy."""
    return dict(_ALIASES)


def servable() -> tuple[Policy, ...]:
    """The registered policies serve.py can run (a :class:`Serving` spec), in registration order."""
    return tuple(p for p in _REGISTRY.values() if p.serving is not None)


def serving_nodes() -> dict[str, dict]:
    """{name: ``policy`` config node} of every servable policy and of every alias (its policy's node, with
    ``alias`` set to the name asked for)."""
    out = {}
    for p in servable():
        out[p.name] = p.serving.node(p.name)
        out.update({a: p.serving.node(p.name, alias=a) for a in p.aliases})
    return out


def policy_of_row(row: str) -> Policy | None:
    """The policy a ladder row name belongs to (``fixed_3`` -> ``fixed``); None if none does."""
    for p in policies():
        if p.owns(row):
            return p
    return None


def camp_of(p: Policy | str | None) -> str:
    """The camp of a policy (or of a registered policy's name): its own ``camp``, else
    :data:`CAMP_DEFAULTS`, else ``"reference"``; None (a row no policy owns) is ``"reference"``."""
    if isinstance(p, str):  # a registered name or alias, else a family's row (``fixed_3``)
        p = policy(p) if (canonical(p) in _REGISTRY or policy_of_row(p) is None) else policy_of_row(p)
    if p is None:
        return "reference"
    return p.camp if p.camp is not None else CAMP_DEFAULTS.get(p.name, "reference")


def display_order() -> tuple[Policy, ...]:
    """Registered policies in plot/report order."""
    return tuple(sorted(policies(), key=lambda p: (p.order, p.name)))


def row_order(rows) -> list[str]:
    """The policy row names present in ladder ``rows``, in display order (a family's rows sorted by name,
    where the family sits)."""
    present = {r["policy"] for r in rows}
    out: list[str] = []
    for p in display_order():
        out += sorted(n for n in present if p.owns(n)) if p.family else ([p.name] if p.name in present else [])
    return out


def closure(names) -> list[str]:
    """``names`` plus what they need, transitively, in registration order."""
    want = set(names)
    todo = list(want)
    while todo:
        for n in policy(todo.pop()).needs:
            if n not in want:
                want.add(n)
                todo.append(n)
    return [p.name for p in policies() if p.name in want]
