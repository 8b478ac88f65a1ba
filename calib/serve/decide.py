"""One serving step's decision: which chain each running request verifies, and how deep.

:func:`decide_step` turns what the engine holds after drafting (:class:`StepInputs`) and what it knows
of each request (:class:`calib.serve.history.RequestHistory`, the sampling temperature) into the
per-chain ``[B, L, A]`` inputs the tables expect, calls :func:`calib.allocate.allocate`, and returns
the new draft list per request (:class:`StepDecision`). :class:`SafeDecider` wraps it for an engine:
tables loaded and checked once at construction, and never an exception into the engine afterwards.

The draft lists handed back hold, per request, a prefix of one offered chain (the model draft, the
n-gram chain, ...), or ``[]``; never more than ``k_max`` tokens (vLLM's ``num_speculative_tokens``: a longer list
crashes its spec-decode metrics, docs/serving_design.md claim 3), and ints ``>= 0`` only.

Temperatures. Every request's sampling temperature must be a finite number ``>= 0``: a NaN, infinite
or negative one is a ``ValueError`` naming the request (index, id) and the value (inside
:class:`SafeDecider`: that step passes through, counted as a failure), never silently binned into an
end bin of the tables' temperature axis. A request temperature outside the range the tables were
fitted at (tables.json ``chains.<name>.temperatures``, :meth:`calib.tables.Tables.unfitted_temperatures`)
is *decided anyway*, on the tables' nearest (end) temperature bin, and logged once per distinct
temperature per loaded tables (a warning on the ``calib.serve`` logger naming the tables' range): the
output is the target's either way (verification is lossless), only the choice of drafts may be worse,
and serve.py refuses an engine temperature outside the range before it starts
(:meth:`calib.tables.Tables.check_temperature`).
"""

from __future__ import annotations

import logging
import math
import numbers
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from calib.allocate import ShapePrice, check_cost
from calib.allocate.api import IMPLEMENTATIONS
from calib.chains import (
    NO_CHAIN,
    chain,
    chain_names,
    chains,
    verified_chain,
)
from calib.cost.serving import SampledPrice, sampled_shape_price
from calib.params import TEXT, Interval, NoneValue, Options, Satisfies, validate_params
from calib.serve.allocation import HOST_LOOKUPS, host_decision, torch_decision
from calib.serve.history import RequestHistory
from calib.serve.inputs import (  # noqa: F401 - the step's inputs (calib/serve/inputs.py), re-exported here
    StepInputs,
    _given_probs,
    _note_unfitted,
    chain_inputs,
    chain_inputs_host,
    context_columns,
    feature_names,
    request_temperatures,
)

logger = logging.getLogger("calib.serve")

CHAIN_NAMES = Satisfies("a list of registered chain names (calib.chains)",
                        lambda v: not isinstance(v, (str, bytes)) and all(isinstance(c, str) and c in chain_names()
                                                                           for c in v))
K_MAX = Interval(numbers.Integral, 1, None)  # vLLM's num_speculative_tokens
# decide_step's per-call arguments (and SafeDecider's, below).
SAMPLED_PRICE = [NoneValue(), Satisfies("a calib.cost.serving.SampledPrice", lambda v: isinstance(v, SampledPrice))]
DECIDE_CONSTRAINTS = {"k_max": [K_MAX], "budget": [NoneValue(), Interval(numbers.Integral, 0, None)],
                      "impl": [Options(IMPLEMENTATIONS)], "sampled_price": SAMPLED_PRICE}


def check_price_mode(cost, sampled_price) -> None:
    """A sampled step's price is added to a cost curve: ``sampled_price`` needs ``cost`` (price mode)."""
    if sampled_price is not None and cost is None:
        raise ValueError("sampled_price prices a sampled step's drafts: it needs `cost` (price mode), not a budget")


class StepDecision:
    """The step's decision per request (batch order, as in the :class:`StepInputs`).

    ``chain``, ``depth``, ``expected_accepted`` and ``probs`` read as tensors; a decision made in numpy (the serving
    decider's host path) keeps its arrays and makes each tensor at its first read (a view, no copy), and
    :meth:`host` hands out the numpy arrays without a torch call: inside an engine each torch call starts cold
    (docs/profile.md), and serving reads the decision in numpy."""

    __slots__ = ("_held", "allocator_ms", "context", "drafts", "passthrough", "req_ids")

    def __init__(self, req_ids: list[str], drafts: list[list[int]], chain, depth, expected_accepted,
                 allocator_ms: float, passthrough: bool = False, probs=None, context: dict | None = None) -> None:
        self.req_ids = req_ids  # [B]
        self.drafts = drafts  # [B][<= k_max]: the new draft list per request (a prefix of the chosen chain, or [])
        self.allocator_ms = allocator_ms  # wall time of the decision (inputs built + allocate), milliseconds
        self.passthrough = passthrough  # True: the engine's own drafts, unchanged (SafeDecider after an error)
        # context axes (names, in table order) -> float64 [B, A_ctx]: the history and temperature columns the
        # decision read (the online correction keys its cells on the same); None where the path did not keep them
        self.context = context
        # tensors or numpy arrays, as the path made them: chain int8 [B] (registry id of the chosen chain,
        # calib.chains; 0 = none), depth int32 [B] (len(drafts[i])), expected_accepted float32 [B] (calibrated
        # expected accepted tokens; NaN: pass-through), probs float32 [B, W] (the chosen chain's P(accept | reached)
        # per drafted token as decided, NaN beyond a request's draft; None where the path did not expose them: the
        # Triton kernel looks them up itself)
        self._held = {"chain": chain, "depth": depth, "expected_accepted": expected_accepted, "probs": probs}

    def _tensor(self, name: str) -> torch.Tensor | None:
        x = self._held[name]
        if x is not None and not isinstance(x, torch.Tensor):
            x = self._held[name] = torch.from_numpy(np.asarray(x))  # made once, at the first read
        return x

    chain = property(lambda self: self._tensor("chain"), doc="int8 [B]: registry id of the chosen chain (0 = none)")
    depth = property(lambda self: self._tensor("depth"), doc="int32 [B]: len(drafts[i])")
    expected_accepted = property(lambda self: self._tensor("expected_accepted"),
                                 doc="float32 [B]: calibrated expected accepted tokens (NaN: pass-through)")
    probs = property(lambda self: self._tensor("probs"),
                     doc="float32 [B, W]: the chosen chain's P(accept | reached) per drafted token, or None")

    def host(self, name: str) -> np.ndarray | None:
        """Field ``name`` (``"chain"``, ``"depth"``, ``"expected_accepted"``, ``"probs"``) as a numpy array (a view
        of a CPU tensor where the path made one), or None."""
        x = self._held[name]
        return x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else x

    def __repr__(self) -> str:
        return (f"StepDecision(req_ids={self.req_ids!r}, drafts={self.drafts!r}, chain={self.host('chain')!r}, "
                f"passthrough={self.passthrough})")


def decide_step(tables, inputs: StepInputs, history: RequestHistory, *, k_max: int,
                cost: torch.Tensor | None = None, budget: int | None = None,
                impl: str = "reference", sampled_price: SampledPrice | None = None) -> StepDecision:
    """Allocate this step's verification and return the new draft lists (see the module docstring).

    Uses every chain the engine offers (``inputs.offers``) that the tables calibrate, one or two. ``cost`` (price mode) or ``budget`` (an int ``>= 0``) as in :func:`calib.allocate.allocate`;
    ``k_max`` an int ``>= 1`` (:data:`DECIDE_CONSTRAINTS`). Raises on anything off, a NaN, infinite or
    negative request temperature included (wrap it in :class:`SafeDecider` inside an engine); a
    temperature outside the tables' fitted range is decided and logged once (see the module docstring).
    ``sampled_price`` (price mode; :class:`calib.cost.serving.SampledPrice`) is added to ``cost`` on a step
    where any request samples."""
    validate_params("decide_step", {"k_max": k_max, "budget": budget, "impl": impl, "sampled_price": sampled_price},
                    DECIDE_CONSTRAINTS)
    check_price_mode(cost, sampled_price)
    if cost is not None and inputs.req_ids:  # SafeDecider checks its curve once, at construction
        check_cost(cost, 1)
    return _decide_step(tables, inputs, history, k_max=k_max, cost=cost, budget=budget, impl=impl,
                        sampled_price=sampled_price)


def _decide_step(tables, inputs: StepInputs, history: RequestHistory, *, k_max: int, cost, budget, impl: str,
                 sampled_price: SampledPrice | None = None, cache: dict | None = None):
    """:func:`decide_step` on arguments already checked (:class:`SafeDecider` checks them once, at construction;
    ``cache``: its store of what depends only on them and the batch size, :func:`calib.serve.allocation.host_decision`)."""
    start = time.perf_counter()
    B = len(inputs.req_ids)
    if B == 0:
        return StepDecision([], [], torch.zeros(0, dtype=torch.int8), torch.zeros(0, dtype=torch.int32),
                            torch.zeros(0), (time.perf_counter() - start) * 1e3)
    if len(set(inputs.req_ids)) != B:  # one list per request id: a duplicate would be decided twice
        seen: set = set()
        dup = next(r for r in inputs.req_ids if r in seen or seen.add(r))
        raise ValueError(f"request id {dup!r} appears {list(inputs.req_ids).count(dup)} times in one step "
                         f"(positions {[i for i, r in enumerate(inputs.req_ids) if r == dup]}): each request is "
                         "decided once per step")
    temps = request_temperatures(inputs)
    offered = [k.name for k in chains() if k.name in inputs.offers and k.name in tables.chains]
    _note_unfitted(tables, temps, offered, cache)
    if nothing_offered(inputs, offered):  # no token to verify: the allocator's answer is known (no lookup made)
        return StepDecision(list(inputs.req_ids), [[] for _ in range(B)], np.full(B, NO_CHAIN, dtype=np.int8),
                            np.zeros(B, dtype=np.int32), np.zeros(B, dtype=np.float32),
                            (time.perf_counter() - start) * 1e3, probs=np.full((B, 1), np.nan, dtype=np.float32),
                            context={})
    # offers whose probabilities the engine already looked up (the serving plan): the reference path uses them
    skip = [n for n in offered if inputs.offers[n].probs is not None] if impl in HOST_LOOKUPS else []
    columns: dict[tuple, np.ndarray] = {}
    signals, tokens = chain_inputs_host(tables, inputs, history, k_max=k_max, skip=skip, temperatures=temps,
                                        columns=columns)
    given = _given_probs(inputs.offers, {n: tokens[n] for n in skip}, B)
    if impl == "host" and budget is None:  # serving: numpy, one lookup per chain (calib/serve/allocation.py)
        drafter, depth, expected, chosen = host_decision(tables, signals, given, cost, sampled_price, temps, k_max,
                                                         cache)
        # kept in numpy: StepDecision makes a tensor only where one is read (serving reads none)
    else:
        signals = {n: torch.from_numpy(x) for n, x in signals.items()}
        given = {n: torch.from_numpy(p) for n, p in given.items()}
        shape = None  # a step under sampling: the sampler's random path, priced per drafting request
        if sampled_price is not None and (temps > 0).any():
            shape, cost = ShapePrice(*sampled_shape_price(cost, sampled_price, B, k_max)), None
        drafter, depth, expected, chosen = torch_decision(tables, signals, given, cost, budget, impl, shape)
    ids, depths = drafter.tolist(), depth.tolist()
    by_id = {chain(n).id: t for n, t in tokens.items()}
    drafts = []
    for i in range(B):
        if ids[i] == NO_CHAIN:
            drafts.append([])
            continue
        d = by_id[ids[i]][i][: min(depths[i], k_max)]
        if len(d) != depths[i]:  # the allocator verifies only tokens it was given: a bug if not
            raise RuntimeError(f"request {inputs.req_ids[i]}: depth {depths[i]} but the chain has {len(d)} tokens")
        drafts.append(d)
    return StepDecision(list(inputs.req_ids), drafts, drafter, depth, expected, (time.perf_counter() - start) * 1e3,
                        probs=chosen, context=columns)


def nothing_offered(inputs: StepInputs, offered: Sequence[str]) -> bool:
    """Whether no request has a token on any ``offered`` chain: the step verifies nothing whatever the tables say (a
    step with no n-gram match anywhere, common at low concurrency), so :func:`_decide_step` makes no lookup. False
    where nothing is ``offered`` (the lookup says which chains are missing)."""
    return bool(offered) and not any(len(t) for n in offered for t in inputs.offers[n].tokens)


@dataclass(frozen=True)
class _Remembered:
    """One chain's drafted rounds of one decided step, as :meth:`SafeDecider.remember` keeps them for the online
    correction (each request points at its row)."""

    name: str  # the chain
    cells: np.ndarray  # int64 [R]: each round's context cell
    table: np.ndarray  # float64 [R, W]: the table's probabilities behind those served, NaN past each round's depth
    depth: np.ndarray  # int64 [R]: the depth each round verifies


class SafeDecider:
    """:func:`decide_step` for an engine: refuses wrong tables at construction, never raises after.

    Construction (engine start; refusing is right there): checks its arguments declaratively
    (:attr:`_parameter_constraints`: ids non-empty strings, ``k_max`` and ``max_failures`` ints >= 1,
    ``budget`` None or an int >= 0, ``impl`` one of the allocator's, ``chains`` registered names), loads the tables (a folder, through
    :func:`calib.tables.load`, or a loaded :class:`calib.tables.io.Tables`) and checks them against what
    the engine reports with :meth:`Tables.check_bank` on an engine manifest (target ``model_id``,
    ``speculator`` e.g. ``"eagle:<head dir name>"`` or ``"ngram"``, ``k_max`` = num_speculative_tokens,
    and the depth of every other chain it offers that a manifest records, e.g. the n-gram chain's; with
    ``identity`` (:func:`calib.fingerprint.identity` of the engine's target and drafter folders) target and
    drafter are compared by content, the ids serving only in messages): a mismatch is a
    :class:`calib.tables.io.TablesError` naming both sides. Also checks ``k_max`` and the cost curve (for one request).

    :meth:`decide` never raises: on an exception it logs one warning (with the exception) the first
    time, counts it, and returns the engine's own drafts unchanged for that step; after
    ``max_failures`` consecutive failures it disables itself for the rest of the run (logged once) and
    passes every later step through. :meth:`observe` / :meth:`finish` feed the history, same rule.
    """

    _parameter_constraints: ClassVar[dict] = {
        "model_id": [TEXT], "speculator": [TEXT], "method": [NoneValue(), TEXT], "chains": [CHAIN_NAMES],
        "max_failures": [Interval(numbers.Integral, 1, None)],
        "history": [NoneValue(), Satisfies("a RequestHistory", lambda v: isinstance(v, RequestHistory))],
        "online": [NoneValue(), Satisfies("calib.tables.online.OnlineSettings",
                                          lambda v: type(v).__name__ == "OnlineSettings")],
        "identity": [NoneValue(), Satisfies("an identity dict (calib.fingerprint.identity)",
                                            lambda v: isinstance(v, dict))],
        **DECIDE_CONSTRAINTS,
    }

    def __init__(self, tables, *, model_id: str, speculator: str, k_max: int, method: str | None = None,
                 chains: Sequence[str] | None = None, cost: torch.Tensor | None = None,
                 budget: int | None = None, impl: str = "reference", max_failures: int = 3,
                 history: RequestHistory | None = None, identity: dict | None = None, online=None,
                 sampled_price: SampledPrice | None = None) -> None:
        from calib.tables import load
        from calib.tables.online_tables import OnlineTables

        chains = chain_names() if chains is None else chains  # default: every registered chain kind
        validate_params("SafeDecider", {"model_id": model_id, "speculator": speculator, "method": method,
                                        "chains": chains, "max_failures": max_failures, "history": history,
                                        "k_max": k_max, "budget": budget, "impl": impl, "identity": identity,
                                        "online": online, "sampled_price": sampled_price},
                        self._parameter_constraints)
        if (cost is None) == (budget is None):
            raise ValueError("give exactly one of `cost` (verify-cost curve) and `budget`")
        if cost is not None:
            check_cost(cost, 1)
        check_price_mode(cost, sampled_price)
        self.sampled_price = sampled_price  # what a step under sampling adds once it verifies a draft token
        self.tables = tables if hasattr(tables, "check_bank") else load(tables)
        self.engine_chain = verified_chain(speculator, method)
        offered = [c for c in dict.fromkeys([self.engine_chain, *chains])]
        for c in offered:
            chain(c)  # a KeyError lists the registered chains
        self.chains = [c for c in offered if c in self.tables.chains]
        manifest = {"model": model_id, "speculator": speculator, "method": method,
                    "num_speculative_tokens": k_max, **({"identity": identity} if identity else {})}
        for c in self.chains:  # the other chains are cut to k_max too
            if c != self.engine_chain and chain(c).manifest_key is not None:
                manifest[chain(c).manifest_key] = {"width": k_max}
        where = f"engine (model {model_id!r}, speculator {speculator!r}, num_speculative_tokens={k_max})"
        self.tables.check_bank(manifest, path=where)  # TablesError naming both sides
        self.k_max, self.cost, self.budget, self.impl = k_max, cost, budget, impl
        self.max_failures = max_failures
        self.history = history if history is not None else RequestHistory()
        self.failures = 0  # every failed step or history update this run
        self.consecutive_failures = 0
        self.disabled = False
        self._warned = False
        # the online correction (calib/tables/online.py): the tables as a prior, corrected in place by the
        # verified outcomes of what this decider chose; None: the tables alone
        self.online = OnlineTables(self.tables, online) if online is not None and online.enabled else None
        self._host_cache: dict = {}  # what the host allocation derives from the cost curve and price (allocation.py)
        self._pending: dict[str, tuple[_Remembered, int]] = {}  # req id -> (its step's rounds, its row there)
        self._outcomes: list[tuple[_Remembered, int, int]] = []  # this step's (rounds, row, accepted), as observed

    @property
    def enabled(self) -> bool:
        return not self.disabled

    def decide(self, inputs: StepInputs) -> StepDecision:
        """This step's drafts; the engine's own (``passthrough=True``) after an error or once disabled."""
        start = time.perf_counter()
        if not self.disabled:
            try:
                picked = StepInputs(inputs.req_ids, inputs.temperature,
                                    {n: o for n, o in inputs.offers.items() if n in self.chains})
                out = _decide_step(self.tables, picked, self.history, k_max=self.k_max, cost=self.cost,
                                   budget=self.budget, impl=self.impl, sampled_price=self.sampled_price,
                                   cache=self._host_cache)
                self.consecutive_failures = 0
                return out
            except Exception as exc:  # noqa: BLE001 - the serving rule: never raise into the engine
                self._fail(exc, "decide")
        return self._passthrough(inputs, start)

    def remember(self, inputs: StepInputs, decision: StepDecision, skip: Sequence[bool] = ()) -> None:
        """Keep what this step decided with (per drafted request: its chain, context cell and probabilities)
        for the online correction to learn from when :meth:`observe` reports the outcome; rows where
        ``skip`` is true (requests left to the engine) are not kept. Once per chain over the batch (a
        :class:`_Remembered` of its rows; each request points at its row). Never raising."""
        if self.online is None or decision.passthrough or decision.host("probs") is None:
            return
        try:
            B = len(inputs.req_ids)
            depth = decision.host("depth").astype(np.int64)  # [B]
            skipped = list(skip[:B]) + [False] * (B - len(skip[:B]))
            # per request, the chain its kept round verifies (NO_CHAIN: none); Python lists over a step's few rows,
            # where each numpy call would start cold
            ids = [c if d > 0 and not s else NO_CHAIN
                   for c, d, s in zip(decision.host("chain").tolist(), depth.tolist(), skipped)]
            probs = decision.host("probs")  # float32 [B, W], NaN past each row's depth
            known = decision.context or {}
            for name, c in self.online.chains.items():
                cid = chain(name).id
                at = [b for b, x in enumerate(ids) if x == cid]
                if not at:
                    continue
                rows = np.array(at, dtype=np.int64)  # [R]
                ctx = c["context"]
                values = known.get(tuple(ctx))
                if values is None:
                    values = context_columns(ctx, inputs, self.history, request_temperatures(inputs) if ctx else None)
                # the rows' cells [R] and the table's probabilities behind the ones served [R, W] (the correction
                # moves before the outcome), NaN from each round's depth on
                cells, table = self.online.remembered(name, values, rows, probs, depth)
                kept = _Remembered(name, cells, table, depth[rows])
                self._pending.update(zip([inputs.req_ids[b] for b in at], [(kept, i) for i in range(len(at))]))
        except Exception as exc:  # noqa: BLE001
            self._fail(exc, "remember")

    def observe(self, req_id: str, accepted: int, drafted: int | None = None) -> None:
        """:meth:`RequestHistory.observe`, and the round's outcome kept for the online correction when this
        decider chose the round for ``req_id`` (when it knows it and ``drafted`` matches it); the correction
        learns from a step's outcomes together at :meth:`refresh`, as eval's replay does (one engine step, one
        Newton step per level). Never raising."""
        try:
            self.history.observe(req_id, accepted, drafted)
            pending = self._pending.pop(req_id, None) if self.online is not None else None
            if pending is not None:
                kept, row = pending
                depth = int(kept.depth[row])
                if drafted is None or drafted == depth:
                    self._outcomes.append((kept, row, min(int(accepted), depth)))
        except Exception as exc:  # noqa: BLE001
            self._fail(exc, "observe")

    def observe_step(self, req_ids: Sequence[str], accepted: Sequence[int], drafted: Sequence[int]) -> None:
        """:meth:`observe` of a step's verified requests at once (``drafted[i] >= 1`` draft tokens each, ``accepted[i]``
        of them accepted), without a call per request; a value :meth:`observe` would refuse takes it one by one
        (each refused request counted as its failure). Never raising."""
        try:
            accepted, drafted = [int(a) for a in accepted], [int(d) for d in drafted]
            if len(accepted) != len(req_ids) or len(drafted) != len(req_ids) or not all(
                    0 <= a <= d and d >= 1 for a, d in zip(accepted, drafted)):
                for r, a, d in zip(req_ids, accepted, drafted):
                    self.observe(r, a, d)
                return
            self.history.observe_rounds(req_ids, accepted)
            if self.online is None:
                return
            pop, outcomes = self._pending.pop, self._outcomes
            for r, a, d in zip(req_ids, accepted, drafted):
                pending = pop(r, None)
                if pending is not None:
                    kept, row = pending
                    if d == kept.depth[row]:
                        outcomes.append((kept, row, a))  # a <= d: min(a, depth) is a
        except Exception as exc:  # noqa: BLE001
            self._fail(exc, "observe")

    def refresh(self) -> None:
        """Learn from the step's outcomes (one update per chain over all its rounds, in the order they were
        observed) and rewrite the tables' cells the online correction moved (once per step, before deciding)."""
        if self.online is None:
            return
        try:
            from calib.tables.online import outcome_rows

            outcomes, self._outcomes = self._outcomes, []
            by_chain: dict[str, list[tuple]] = {}
            for o in outcomes:
                by_chain.setdefault(o[0].name, []).append(o)
            for name, rounds in by_chain.items():
                first = rounds[0][0]
                if all(k is first for k, _, _ in rounds):  # the usual step: every round decided at the last step
                    rows = np.array([r for _, r, _ in rounds], dtype=np.int64)  # [R]
                    accepted = np.array([a for _, _, a in rounds], dtype=np.int64)  # [R]
                    self.online.observe_rounds(name, first.table, rows, accepted, first.depth, first.cells)
                else:  # a round remembered at an earlier step (not observed then): row by row
                    accepted = np.array([a for _, _, a in rounds])  # [R]
                    drafted = np.array([k.depth[r] for k, r, _ in rounds])
                    cells = np.array([k.cells[r] for k, r, _ in rounds], dtype=np.int64)
                    width = int(drafted.max())
                    p = np.full((len(rounds), width), np.nan)
                    for i, (k, r, _) in enumerate(rounds):
                        p[i, : drafted[i]] = k.table[r, : drafted[i]]
                    self.online.observe(name, p, outcome_rows(accepted, drafted, width), cells)
            self.online.refresh(lazy=self.impl in HOST_LOOKUPS)  # the kernel reads the grid without a lookup
        except Exception as exc:  # noqa: BLE001
            self._fail(exc, "refresh")

    def finish(self, req_id: str) -> None:
        try:
            self._pending.pop(req_id, None)
            self.history.finish(req_id)
        except Exception as exc:  # noqa: BLE001
            self._fail(exc, "finish")

    def forget_learned(self) -> None:
        """The online correction back to the tables alone (:meth:`calib.tables.online_tables.OnlineTables.reset`)
        and no round left pending: a bench's cells each start from the same state (call it with no request in
        flight)."""
        self._pending.clear()
        self._outcomes.clear()
        if self.online is not None:
            self.online.reset()

    def _fail(self, exc: BaseException, where: str) -> None:
        self.failures += 1
        self.consecutive_failures += 1
        if not self._warned:
            self._warned = True
            logger.warning("calib serve: %s failed (%s: %s); passing the engine's own drafts through for this "
                           "step (further failures are counted, not logged; disabled after %d in a row)",
                           where, type(exc).__name__, exc, self.max_failures, exc_info=exc)
        if not self.disabled and self.consecutive_failures >= self.max_failures:
            self.disabled = True
            logger.warning("calib serve: %d consecutive failures (%d in all); calib is disabled for the rest "
                           "of this run, the engine drafts on its own", self.consecutive_failures, self.failures)

    def _passthrough(self, inputs: StepInputs, start: float) -> StepDecision:
        try:
            drafts = inputs.engine_drafts(self.engine_chain)
        except Exception:  # noqa: BLE001 - malformed inputs: hand back nothing rather than raise
            drafts = [[] for _ in getattr(inputs, "req_ids", [])]
        B = len(drafts)
        ids = [chain(self.engine_chain).id if d else NO_CHAIN for d in drafts]
        return StepDecision(list(getattr(inputs, "req_ids", [])), drafts, torch.tensor(ids, dtype=torch.int8),
                            torch.tensor([len(d) for d in drafts], dtype=torch.int32),
                            torch.full((B,), math.nan), (time.perf_counter() - start) * 1e3, passthrough=True)
