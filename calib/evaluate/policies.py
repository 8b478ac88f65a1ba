"""The replay's policy registry: a serving policy is one registered :class:`Policy`.

Everything that names policies iterates this registry: the replay (:mod:`calib.evaluate.replay`, which
computes what a config asks for), :class:`~calib.evaluate.replay.ReplayConfig`'s validation of
``replay.policies`` (so an unknown name in ``conf/eval.yaml`` or on the command line is refused with
the registered names), the ladder plot's bar order and colours (:mod:`calib.evaluate.plots`), the
report's ladder tables, its policy list and its "below ``no_spec``" explanations
(:mod:`calib.evaluate.report`, :mod:`calib.evaluate.run`), and the report's *Answer*, which pits the best
policy of camp ``calib`` against the best of camp ``peer`` (:attr:`Policy.camp`, :func:`camp_of`). Adding a policy is one
:func:`register_policy` call (plus its name in ``replay.policies`` to run it by default).

Two kinds of policy:

* ``kind="step"``: ``compute(setting) -> PolicyResult | None`` decides every step of one (bank,
  category, B, cost curve) setting; ``setting`` is a :class:`calib.evaluate.replay.Setting` (the
  gathered arrays, the curve, the config, the drafting prices and the shared helpers). ``None``: the
  policy does not apply to this bank (e.g. ``ragged_raw`` on a chain with no raw confidence). A family
  (``family=True``, e.g. ``fixed``) returns ``{row name: PolicyResult}``, rows named ``<name>_<x>``.
* ``kind="hindsight"``: ``compute(totals, pooled) -> Totals | None`` picks among the step policies'
  totals after every setting has been replayed: ``totals`` = this slice's ``{row name: Totals}``,
  ``pooled`` = the same over every category of the (bank, B, cost curve) (for the ``all`` slice
  ``totals is pooled``). ``best_fixed`` is one (the ladder's reference: every row's ``vs_best_fixed``);
  hindsight policies are not summed into ``all``, they are recomputed on it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple, TypedDict

import numpy as np

KINDS = ("step", "hindsight")
# Which side of the report's *Answer* a policy is on (:attr:`Policy.camp`): ``calib`` = calib's own policies
# (signal-driven allocators on the calibrated tables), ``peer`` = what a user could run instead (the
# engine's own policies), ``reference`` = bounds and building blocks (no_spec, the fixed family, oracle).
CAMPS = ("calib", "peer", "reference")
# The camp of a registered policy that does not set one (``camp=None``): a fallback for policies whose
# register_policy call predates the camp field; any other name is ``reference`` (left out of the Answer).
CAMP_DEFAULTS = {
    "no_spec": "reference", "fixed": "reference", "oracle": "reference",
    "best_fixed": "peer", "homogeneous": "peer", "vllm_dsd": "peer", "vllm_adaptive": "peer",
    "gated_uniform": "calib", "ragged_raw": "calib", "ragged_calibrated": "calib", "two_drafter": "calib",
}
BASE_TOTALS = ("tokens", "cost", "positions", "steps", "rounds")  # every Totals has these; the rest are extras


class PolicyResult(NamedTuple):
    """A step policy's decisions on one setting, per step [S]; ``extra`` holds scalars for the row
    (e.g. ``{"gamma": 3}``). A tuple, so ``tokens, cost, positions, extra = result`` works."""

    tokens: np.ndarray  # committed tokens per step
    cost: np.ndarray  # verify + drafting cost per step (the curve's unit)
    positions: np.ndarray  # draft positions verified per step
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
class Policy:
    """One serving policy.

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

    def owns(self, row: str) -> bool:
        """Whether a ladder row name belongs to this policy."""
        return row.startswith(self.name + "_") if self.family else row == self.name


_REGISTRY: dict[str, Policy] = {}


def register_policy(p: Policy, replace: bool = False) -> Policy:
    """Add ``p`` (after the ones registered before it: hindsight policies see every step policy's
    totals). A name already registered is refused unless ``replace``; ``needs`` must name registered
    policies."""
    if p.name in _REGISTRY and not replace:
        raise ValueError(f"policy {p.name!r} is already registered")
    missing = [n for n in p.needs if n not in _REGISTRY and n != p.name]
    if missing:
        raise ValueError(f"policy {p.name!r} needs {missing}, which are not registered; "
                         f"registered: {list(_REGISTRY)}")
    _REGISTRY[p.name] = p
    return p


def unregister_policy(name: str) -> None:
    """Remove a registered policy (tests and experiments)."""
    _builtins()
    if name not in _REGISTRY:
        raise KeyError(f"no policy {name!r}; registered: {list(_REGISTRY)}")
    del _REGISTRY[name]


def _builtins() -> None:
    """The built-in policies register when :mod:`calib.evaluate.replay` is imported (they use its helpers)."""
    import calib.evaluate.replay  # noqa: F401
    import calib.evaluate.peers  # noqa: F401


def policies() -> tuple[Policy, ...]:
    """Every registered policy, in registration (= computation) order."""
    _builtins()
    return tuple(_REGISTRY.values())


def policy_names() -> tuple[str, ...]:
    return tuple(p.name for p in policies())


def policy(name: str) -> Policy:
    """The registered policy ``name``; a ``KeyError`` naming the registered ones otherwise."""
    _builtins()
    if name not in _REGISTRY:
        raise KeyError(f"unknown policy {name!r}; registered policies: {list(_REGISTRY)}")
    return _REGISTRY[name]


def policy_of_row(row: str) -> Policy | None:
    """The policy a ladder row name belongs to (``fixed_3`` -> ``fixed``); None if none does."""
    for p in policies():
        if p.owns(row):
            return p
    return None


def camp_of(p: Policy | str | None) -> str:
    """The camp of a policy (or of a registered policy's name): its own ``camp``, else
    :data:`CAMP_DEFAULTS`, else ``"reference"``; None (a row no policy owns) is ``"reference"``."""
    if isinstance(p, str):
        p = policy(p)
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
