"""Loops numba compiles, once per process: the one mechanism behind each module of compiled kernels
(:mod:`calib.allocate.compiled`, :mod:`calib.tables.online_compiled`, :mod:`calib.tables.lookup_compiled`).

A module names its entries and the helpers they call; at the first :meth:`Kernels.get` the helpers are compiled
into the module's namespace (so the entries call the compiled ones), the entries are compiled and run once on tiny
inputs (seconds the first time on a machine, then numba's disk cache). Where numba is not installed, or cannot
compile them (said once in a log line), ``get`` returns None and the module's numpy versions run.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence


class Kernels:
    """The compiled ``entries`` (names in ``namespace``, a module's ``globals()``) with their ``helpers``;
    ``warm_up(compiled)`` runs each once; ``what`` and ``instead`` name them and their fallback in the log line
    (``calib: numba could not compile {what} (...); {instead} instead``); ``options``: numba's ``njit`` options
    beside ``cache`` and ``nogil``."""

    def __init__(self, namespace: dict, entries: Sequence[str], helpers: Sequence[Callable],
                 warm_up: Callable[[dict], None], what: str, instead: str, **options) -> None:
        self.namespace, self.entries, self.helpers = namespace, tuple(entries), tuple(helpers)
        self.warm_up, self.what, self.instead, self.options = warm_up, what, instead, options
        self._held: list = []  # [{name: compiled function} or None], filled at the first get()

    def get(self) -> dict | None:
        """``{name: compiled function}`` of the entries, or None (numba missing or failing: the numpy versions)."""
        if not self._held:
            try:
                from numba import njit
            except ImportError:
                self._held.append(None)
                return None
            jit = njit(cache=True, nogil=True, **self.options)
            for f in self.helpers:
                self.namespace[f.__name__] = jit(f)  # the entries call the compiled helpers
            compiled = {name: jit(self.namespace[name]) for name in self.entries}
            try:
                self.warm_up(compiled)
            except Exception as exc:  # noqa: BLE001 - a compiler that fails here: the numpy versions, said once
                logging.getLogger("calib").warning("calib: numba could not compile %s (%s); %s instead", self.what,
                                                   exc, self.instead)
                compiled = None
            self._held.append(compiled)
        return self._held[0]
