"""A serving step's inputs as the tables read them: the requests' temperatures (checked once per step), the
history context columns, and each offered chain's ``[B, L, A]`` table inputs and token lists, built in numpy
(:func:`chain_inputs_host`; :func:`chain_inputs` as tensors). Split from :mod:`calib.serve.decide`, which
re-exports these names."""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from calib.chains import Offer, chains, offer_inputs, split_context
from calib.serve.history import RequestHistory

logger = logging.getLogger("calib.serve")


@dataclass
class StepInputs:
    """What the engine holds for its ``B`` running requests (batch order) when it decides: what each
    chain it runs offers (:class:`calib.chains.Offer`; a chain it does not run is absent, e.g. an
    EAGLE-only engine without the n-gram recompute offers the model chain only)."""

    req_ids: list[str]  # [B]: engine request ids, batch order
    temperature: torch.Tensor | Sequence[float]  # float [B]: each request's sampling temperature (0 = greedy)
    # chain name -> its offer: tokens [B][<= L], and its signal (model chain: raw confidence [B, K]; n-gram
    # chain: features [B, L, F] in its table's own-axis order, or already looked-up probs [B, >= L])
    offers: Mapping[str, Offer] = field(default_factory=dict)

    def engine_drafts(self, chain_name: str) -> list[list[int]]:
        """The lists the engine would verify on its own (its drafter's chain), [] per request if absent."""
        offer = self.offers.get(chain_name)
        return [list(t) for t in offer.tokens] if offer is not None else [[] for _ in self.req_ids]


def request_temperatures(inputs: StepInputs) -> np.ndarray:
    """float64 ``[B]``: each request's sampling temperature, refused unless every one is a finite number
    ``>= 0`` (a ``ValueError`` naming the first bad request's index, id and value). One vector check."""
    B = len(inputs.req_ids)
    t = inputs.temperature
    if isinstance(t, list) and len(t) == B:  # serving's list of floats: checked in Python, one numpy call
        try:
            if all(0 <= x < math.inf for x in t):  # NaN fails
                return np.array(t, dtype=np.float64)
        except TypeError:
            pass  # not numbers: the error below names them
    try:
        t = t.detach().cpu().numpy() if isinstance(t, torch.Tensor) else np.asarray(t, dtype=np.float64)
        t = t.astype(np.float64).reshape(-1)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"temperature must be B={B} numbers (one per request), got {inputs.temperature!r:.80} "
                         f"({exc})") from None
    if t.shape != (B,):
        raise ValueError(f"temperature has {t.shape[0]} entries for B={B} requests")
    if not B or (np.minimum.reduce(t) >= 0 and np.maximum.reduce(t) < np.inf):  # NaN fails both: checked below
        return t
    bad = ~(np.isfinite(t) & (t >= 0))
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise ValueError(f"temperature[{i}] = {float(t[i]):g} (request {inputs.req_ids[i]!r}): a sampling temperature "
                         "must be a finite number >= 0 (0 = greedy); a NaN or negative one would silently be "
                         f"read from an end bin of the tables' temperature axis ({int(bad.sum())} of {B} requests)")
    return t


def _note_unfitted(tables, temps: np.ndarray, chains: Sequence[str], cache: dict | None = None) -> None:
    """Log (once per temperature and loaded tables) request temperatures outside the tables' fitted range.
    ``cache``: the decider's, where the sets of temperatures already checked against these tables are kept (a
    set checked once has nothing new to log)."""
    unfitted = getattr(tables, "unfitted_temperatures", None)
    if unfitted is None:  # in-memory tables record no temperatures
        return
    if cache is not None:
        seen = cache.setdefault("temperatures_checked", {})
        key = (id(tables), tuple(chains), frozenset(temps.tolist()))
        if seen.get(key) is tables:
            return
        if len(seen) > 256:  # batches of ever new temperatures: keep the newest
            seen.clear()
        seen[key] = tables
    new = unfitted(temps, chains)
    if new:
        where = getattr(tables, "path", None) or "(in memory)"
        logger.warning("calib serve: request temperature %s outside the temperatures the tables %s were fitted at "
                       "(%s); deciding with the tables' nearest temperature bin anyway (train tables on banks at "
                       "this temperature to calibrate it; logged once per temperature)",
                       ", ".join(f"{t:g}" for t in new), where, tables.temperature_range_text(chains))


def feature_names(tables, chain_name: str) -> list[str]:
    """The input features of ``chain_name``'s table in the order an engine passes them ([] if absent)."""
    if hasattr(tables, "feature_names"):
        return list(tables.feature_names(chain_name))
    t = tables.chains.get(chain_name)
    return [a.name for a in t.axes] if t is not None else []


def context_columns(ctx: Sequence[str], inputs: StepInputs, history: RequestHistory,
                     temperatures: np.ndarray | None = None) -> np.ndarray:
    """float64 ``[B, len(ctx)]``: each context axis' value per request (``temperatures``: the checked
    :func:`request_temperatures`, computed here when not given)."""
    B = len(inputs.req_ids)
    hist = history.values(inputs.req_ids, [n for n in ctx if n != "temperature"])
    cols = []
    for n in ctx:
        if n == "temperature":
            cols.append(request_temperatures(inputs) if temperatures is None else temperatures)
        else:
            cols.append(hist[n])
    return np.stack(cols, axis=1) if cols else np.zeros((B, 0))


def _tokens(tokens, B: int, k_max: int, what: str) -> list[list[int]]:
    if len(tokens) != B:
        raise ValueError(f"{what} has {len(tokens)} lists for B={B} requests")
    out = [list(map(int, t[:k_max])) for t in tokens]
    for i, t in enumerate(out):
        if t and min(t) < 0:
            raise ValueError(f"{what}[{i}] holds a negative token id: {t}")
    return out


def chain_inputs(tables, inputs: StepInputs, history: RequestHistory, *, k_max: int,
                 skip: Sequence[str] = (), temperatures: np.ndarray | None = None):
    """``({chain name: float32 [B, L, A]}, {chain name: token lists [B][<= k_max]})`` for the chains
    both the engine (``inputs.offers``) and the tables have, in registry order: the chain's own inputs
    (:attr:`calib.chains.ChainKind.step_inputs` of its offer), then the context axes the tables hold
    (``tables.feature_names(chain)`` order), NaN where a request has no token. Temperatures are checked
    (:func:`request_temperatures`) unless given already checked. Tensors; :func:`chain_inputs_host` in numpy."""
    signals, tokens = chain_inputs_host(tables, inputs, history, k_max=k_max, skip=skip, temperatures=temperatures)
    return {n: torch.from_numpy(x) for n, x in signals.items()}, tokens


def chain_inputs_host(tables, inputs: StepInputs, history: RequestHistory, *, k_max: int,
                      skip: Sequence[str] = (), temperatures: np.ndarray | None = None,
                      columns: dict | None = None, lists: bool = True):
    """:func:`chain_inputs` with numpy float32 ``[B, L, A]`` signals (the serving decider's host path).
    ``columns``: a dict filled with the context columns read (context axes -> float64 ``[B, A_ctx]``);
    ``lists=False``: the caller looks the chains up only (the serving plan), so their token lists are not
    copied and checked (returned ``{}``), only their lengths read."""
    B = len(inputs.req_ids)
    if temperatures is None:
        temperatures = request_temperatures(inputs)
    signals, tokens = {}, {}
    columns = {} if columns is None else columns  # context axes -> their columns: read once per step
    for kind in chains():
        name, offer = kind.name, inputs.offers.get(kind.name)
        if offer is None or name not in tables.chains:
            continue
        if lists:
            toks = tokens[name] = _tokens(offer.tokens, B, k_max, f"{name}_tokens")
            lengths = [len(t) for t in toks]
        elif len(offer.tokens) != B:
            raise ValueError(f"{name}_tokens has {len(offer.tokens)} lists for B={B} requests")
        else:
            lengths = [min(len(t), k_max) for t in offer.tokens]
        if name in skip:  # the caller has this chain's probabilities already
            continue
        own, ctx = split_context(feature_names(tables, name), name)
        what = f"the {name} chain's signal"
        x = np.asarray((kind.step_inputs or _offered)(offer, own, B, lengths, what), dtype=np.float64)
        n_own = x.shape[2]
        out = np.empty((B, x.shape[1], n_own + len(ctx)), dtype=np.float32)  # [B, L, A]
        out[..., :n_own] = x  # float64 -> float32, rounded as torch's .to(float32)
        if ctx:
            key = tuple(ctx)
            if key not in columns:
                columns[key] = context_columns(ctx, inputs, history, temperatures)  # [B, A_ctx]
            out[..., n_own:] = columns[key][:, None, :]
        signals[name] = out
    if not signals and not tokens:
        raise ValueError(f"no chain to decide on: the engine offers {list(inputs.offers)}, the tables calibrate "
                         f"{sorted(tables.chains)}")
    return signals, tokens


def _offered(offer: Offer, own: list[str], B: int, lengths: list[int], what: str) -> np.ndarray:
    """A chain's own table inputs as offered (its signal holds them in the table's axis order)."""
    return offer_inputs(offer.signal, B, lengths, len(own), what)


def _given_probs(offers: Mapping[str, Offer], tokens: dict, B: int) -> dict[str, np.ndarray]:
    """float32 ``[B, W]`` per chain whose offer holds already looked-up probabilities, NaN beyond its tokens."""
    out = {}
    for name, toks in tokens.items():
        given = offers[name].probs
        if given is None:
            continue
        given = given.detach().cpu().numpy() if isinstance(given, torch.Tensor) else np.asarray(given)
        lengths = np.array([len(t) for t in toks])
        width = max(1, int(lengths.max()))
        p = np.full((B, width), np.nan, dtype=np.float32)
        p[:, : min(width, given.shape[1])] = given[:, :width]
        p[np.arange(width)[None, :] >= lengths[:, None]] = np.nan  # a chain ends with its tokens
        out[name] = p
    return out
