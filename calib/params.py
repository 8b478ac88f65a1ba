"""Declarative parameter constraints, checked at every boundary (scikit-learn's ``_parameter_constraints``).

A class (or a config section) lists, per parameter, the constraints it may satisfy::

    _parameter_constraints = {"n_bins": [Interval(numbers.Integral, 1, None)],
                              "temperature": [Interval(numbers.Real, 0, None)]}

and :func:`validate_params` raises one ``ValueError`` naming the owner, the parameter, its value and
what it may be. Used by the calibrators, the allocator's and the decider's constructors, the tables
loader, the bank validator and the entry points' config checks. A leaf: imports numpy only.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import numpy as np


def finite_number(value) -> bool:
    """A real number (not a bool) that is finite."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def _items(value) -> list | None:
    """``value`` as a list if it is a sequence other than a string, else None."""
    if isinstance(value, (str, bytes)):
        return None
    try:
        return list(value)
    except TypeError:
        return None


class Satisfies:
    """A constraint given by a ``test`` (a predicate; raising TypeError/ValueError counts as False) and
    the ``label`` that describes it in messages: for what the declarative types do not cover (a tensor's
    dtype and rank, a registered name, a pair of numbers)."""

    def __init__(self, label: str, test):
        self.label, self.test = label, test

    def accepts(self, value) -> bool:
        try:
            return bool(self.test(value))
        except (TypeError, ValueError):
            return False

    def __str__(self) -> str:
        return self.label


TEXT = Satisfies("a non-empty string", lambda v: isinstance(v, str) and bool(v))


@dataclass(frozen=True)
class Options:
    """A parameter that must be one of ``values`` (an enum-like option)."""

    values: tuple

    def accepts(self, value) -> bool:
        return isinstance(value, str) == isinstance(self.values[0], str) and value in self.values

    def __str__(self) -> str:
        return "one of " + ", ".join(repr(v) for v in self.values)


@dataclass(frozen=True)
class Interval:
    """A number of ``kind`` (``numbers.Integral`` or ``numbers.Real``; never a bool) in the interval
    from ``low`` to ``high`` (None = unbounded); ``closed`` says which ends belong to it."""

    kind: type
    low: float | None = None
    high: float | None = None
    closed: str = "both"  # both | left | right | neither

    def accepts(self, value) -> bool:
        if isinstance(value, bool) or not isinstance(value, self.kind):
            return False
        if self.kind is numbers.Real and not np.isfinite(value):
            return False
        left_in, right_in = self.closed in ("both", "left"), self.closed in ("both", "right")
        if self.low is not None and (value < self.low or (value == self.low and not left_in)):
            return False
        return not (self.high is not None and (value > self.high or (value == self.high and not right_in)))

    def __str__(self) -> str:
        kind = "an integer" if self.kind is numbers.Integral else "a finite number"
        lo = "-inf" if self.low is None else self.low
        hi = "inf" if self.high is None else self.high
        left = "[" if self.closed in ("both", "left") and self.low is not None else "("
        right = "]" if self.closed in ("both", "right") and self.high is not None else ")"
        return f"{kind} in {left}{lo}, {hi}{right}"


@dataclass(frozen=True)
class Subset:
    """A non-empty sequence of distinct names, each one of ``values`` (e.g. feature names)."""

    values: tuple

    def accepts(self, value) -> bool:
        items = _items(value)
        return bool(items) and len(set(items)) == len(items) and all(v in self.values for v in items)

    def __str__(self) -> str:
        return "a non-empty list of distinct names from " + ", ".join(repr(v) for v in self.values)


@dataclass(frozen=True)
class Boolean:
    """``True`` or ``False`` (a numpy bool too; not 0/1 nor the string "false")."""

    def accepts(self, value) -> bool:
        return isinstance(value, (bool, np.bool_))

    def __str__(self) -> str:
        return "a bool"


@dataclass(frozen=True)
class Fractions:
    """A non-empty sequence of ``n`` (any length if None) finite numbers in [0, 1] summing to 1."""

    n: int | None = None
    tol: float = 1e-6

    def accepts(self, value) -> bool:
        items = _items(value)
        if not items or (self.n is not None and len(items) != self.n):
            return False
        if not all(finite_number(v) and 0 <= v <= 1 for v in items):
            return False
        return abs(sum(items) - 1.0) <= self.tol

    def __str__(self) -> str:
        n = f"{self.n} " if self.n is not None else ""
        return f"a list of {n}fractions in [0, 1] summing to 1"


@dataclass(frozen=True)
class Each:
    """A non-empty sequence (not a string) whose every item satisfies ``item`` (e.g. batch sizes >= 1)."""

    item: object

    def accepts(self, value) -> bool:
        items = _items(value)
        return bool(items) and all(self.item.accepts(v) for v in items)

    def __str__(self) -> str:
        return f"a non-empty list, each {self.item}"


@dataclass(frozen=True)
class NoneValue:
    """``None`` (an optional parameter left unset)."""

    def accepts(self, value) -> bool:
        return value is None

    def __str__(self) -> str:
        return "None"


def validate_params(owner: str, params: dict, constraints: dict, *, missing_ok: bool = False) -> None:
    """Raise ``ValueError`` naming the parameter, its value and what it may be, for the first
    parameter of ``params`` that none of its ``constraints[name]`` accepts (sklearn's convention).
    With ``missing_ok`` a parameter absent from ``params`` is skipped (an optional config key)."""
    for name, allowed in constraints.items():
        if name not in params:
            if missing_ok:
                continue
            raise KeyError(f"{owner}._parameter_constraints names {name!r}, which is not a parameter")
        value = params[name]
        if not any(c.accepts(value) for c in allowed):
            want = " or ".join(str(c) for c in allowed)
            raise ValueError(f"{owner}: parameter {name}={value!r} is invalid; it must be {want}")
