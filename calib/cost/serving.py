"""The verify cost as serving is given it: one text, the ``cost`` knob (``conf/serve.yaml`` ``serve.cost``).

The parametric ``weight_read,per_position`` (conf/cost/parametric.yaml), a measured CSV
``PATH.csv[:column]`` (bench/verify_cost.py), or an engine's step-cost model ``PATH.json``
(:mod:`calib.cost.step`, the replay's cost kind ``engine``), turned into the allocator's price-mode curve.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
import torch

from calib.cost import make_curve


def parse_cost(text: str) -> tuple[float, float]:
    """``"weight_read,per_position"`` -> two positive floats (the parametric ``cost`` knob)."""
    try:
        w, p = (float(x) for x in str(text).split(","))
    except ValueError:
        raise ValueError(f"serve.cost={text!r}: expected 'weight_read,per_position' (e.g. '1.0,0.01') "
                         "or a measured curve 'PATH.csv[:column]'") from None
    if not (w > 0 and p >= 0 and math.isfinite(w) and math.isfinite(p)):
        raise ValueError(f"serve.cost={text!r}: weight_read must be > 0 and per_position >= 0")
    return w, p


def step_cost_path(text: str) -> str | None:
    """The path when the ``cost`` knob names an engine step-cost model (``PATH.json``), else None."""
    text = str(text)
    return text if text.endswith(".json") else None


@functools.lru_cache(maxsize=4)
def serving_step_cost(path: str):
    """The step-cost model a serving process prices with, read and checked once per process. A model fitted on
    other hardware is said once, in the engine line (calib.vllm.engine_line.cost_note), not here."""
    from calib.cost.step import load_step_cost

    return load_step_cost(path)


def step_pass_price(text: str, batch: int, passes: int) -> float | None:
    """An engine step-cost model's price of one model draft pass over ``batch`` rows (the mean over
    ``passes`` passes, as the replay's plan weighs it); None for the other ``cost`` knobs."""
    path = step_cost_path(text)
    if path is None:
        return None
    return float(serving_step_cost(path).draft(passes, batch)) / max(passes, 1)


def measured_cost(text: str) -> tuple[str, str] | None:
    """``(path, column)`` when the ``cost`` knob names a measured CSV (``PATH.csv[:column]``; column
    default ``seconds_min``), None for the parametric ``weight_read,per_position``."""
    text = str(text)
    if ".csv" not in text:
        return None
    path, _, column = text.partition(".csv")
    return path + ".csv", column.lstrip(":") or "seconds_min"


def cost_curve(text: str, t_max: int, drafter_loaded: bool = False) -> torch.Tensor:
    """The ``cost`` knob as the allocator's price-mode curve, float32 ``[t_max + 1]``: parametric
    ``weight_read,per_position``, a measured CSV ``PATH[:column]`` (``T, seconds[, seconds_min]``,
    bench/verify_cost.py; column default ``seconds_min``), read as conf/cost/measured.yaml reads it, or
    an engine step-cost model ``PATH.json``: a step's verify over ``T`` positions plus, with a model
    drafter loaded, its idle forward (its per-request term is left out: the same for every plan of a step)."""
    step = step_cost_path(text)
    if step is not None:
        from calib.cost.step import EngineStepCurve

        curve = EngineStepCurve("serve.cost", serving_step_cost(step), t_max, batch=0, drafter=drafter_loaded)
        return torch.from_numpy(np.ascontiguousarray(curve.values)).to(torch.float32)
    measured = measured_cost(text)
    if measured is not None:
        path, column = measured
        curve = make_curve("serve.cost", {"kind": "measured", "path": path, "column": column}, t_max)
        return torch.from_numpy(np.ascontiguousarray(curve.values)).to(torch.float32)
    w, p = parse_cost(text)
    return (w + p * torch.arange(t_max + 1, dtype=torch.float64)).to(torch.float32)


@dataclass(frozen=True)
class SampledPrice:
    """What a step under sampling adds to the price once it verifies draft tokens, in the cost knob's unit:
    ``per_drafting_request`` for each request with ``d >= 1`` draft tokens plus ``per_draft · d`` (an engine step
    cost's ``sampled`` term; its intercept, a once-per-step jump, is charged to each drafting request: an upper
    bound that keeps the price separable over requests)."""

    per_draft: float
    per_drafting_request: float

    def __post_init__(self):
        vals = (self.per_draft, self.per_drafting_request)
        if not all(isinstance(v, (int, float)) and math.isfinite(v) and v >= 0 for v in vals):
            raise ValueError(f"SampledPrice needs finite numbers >= 0, got {vals}")


def sampled_price(text: str) -> SampledPrice | None:
    """The ``cost`` knob's :class:`SampledPrice`: from an engine step-cost model's ``sampled`` term; None for
    the other knobs, or where that term is zero (a model fitted on greedy steps only)."""
    path = step_cost_path(text)
    if path is None:
        return None
    term = serving_step_cost(path).sampled
    price = SampledPrice(term.slopes.get("D", 0.0), term.intercept + term.slopes.get("R", 0.0))
    return price if any((price.per_draft, price.per_drafting_request)) else None


def prices_greedy_only(text: str) -> bool:
    """Whether the ``cost`` knob is an engine step cost fitted on greedy steps only (no ``sampled`` term): it prices a
    step under sampling as a greedy one (serving says so once, :meth:`calib.vllm.server.Server.note_unpriced_sampling`)."""
    return step_cost_path(text) is not None and sampled_price(text) is None


def sampled_shape_price(cost: torch.Tensor, price: SampledPrice, n_requests: int, width: int):
    """The price of a step of ``n_requests`` under sampling as a separable shape price ``(base, table [width + 1])``
    (:class:`calib.allocate.ShapePrice`'s arguments): ``cost`` [T_max + 1] is an engine step cost's curve, so each
    request's draft tokens add its slope per token (:func:`batch_slope`), plus ``price`` once it drafts (the sampler's
    random path runs only for requests with draft tokens where calib serves: docs/cost.md). :func:`sampled_price_table`'s
    price, as a tensor."""
    base, table = sampled_price_table(cost.cpu().numpy(), price, n_requests, width)
    return base, torch.from_numpy(table)


def batch_slope(cost: np.ndarray, n_requests: int, width: int) -> float:
    """A step's price per draft token over the positions a batch of ``n_requests`` can verify: the curve's mean slope
    from ``T = B`` to ``B + B * width`` (the first difference on a line, where a step cost is affine), and 0 where
    it falls. A step cost's measured steps at a few positions (:attr:`calib.cost.step.StepCost.t_residual`) can make a
    step with draft tokens cheaper than one without (one AMD EPYC at B = 1): a separable price cannot pay a request
    for drafting, so its drafts are free there."""
    span = min(n_requests * width, cost.shape[0] - 1 - n_requests)
    if span <= 0:
        return 0.0
    return max(0.0, float(cost[n_requests + span] - cost[n_requests]) / span)


def sampled_price_table(cost: np.ndarray, price: SampledPrice, n_requests: int, width: int) -> tuple[float, np.ndarray]:
    """:func:`sampled_shape_price` in numpy on the curve's float32 values ``cost [T_max + 1]``: ``(base, table float64
    [width + 1])``, what one request verifying ``d`` draft tokens adds (0 at ``d = 0``)."""
    base = float(cost[n_requests])
    d = np.arange(width + 1, dtype=np.float64)
    added = np.where(d > 0, price.per_drafting_request + price.per_draft * d, np.zeros_like(d))
    return base, batch_slope(cost, n_requests, width) * d + added


class ContextCurves:
    """Serving's price of a step at its own batch and context: an engine step cost fitted with the context its
    attention reads (step-cost version 3: ``C`` thousands of tokens cached, ``Q`` thousands of query-key pairs,
    docs/cost.md) read at the step's requests and their mean context, where :func:`cost_curve` reads it at the
    profile's mean context and no batch. On one EPYC core at c = 16 a code edit's step (~800 tokens cached per request)
    cost 30-45 ms more than a chat step's (~200), and each verified position more too; priced at the profile's mean,
    the step clock's base learned +18 and +31 ms on code edits and -9 to +2 on chat, and carried one category's correction
    into the other's steps (docs/serving.md, "December 7").

    :meth:`at` is the float32 tensor the allocator reads and its float64 numpy (the step clock's), built once per
    (batch, context bucket of :data:`CONTEXT_BUCKET` tokens) and kept while the batch and bucket last."""

    def __init__(self, cost, t_max: int, drafter_loaded: bool = False):
        self.cost, self.t_max, self.drafter = cost, int(t_max), bool(drafter_loaded)
        self.held: dict[tuple[int, int], tuple[torch.Tensor, np.ndarray]] = {}

    @classmethod
    def of(cls, text: str, t_max: int, drafter_loaded: bool = False) -> ContextCurves | None:
        """For the ``cost`` knob when it names a context-aware engine step cost; None otherwise (the knob's one curve)."""
        path = step_cost_path(text)
        if path is None or not serving_step_cost(path).context_aware:
            return None
        return cls(serving_step_cost(path), t_max, drafter_loaded)

    def at(self, batch: int, cached: int) -> tuple[torch.Tensor, np.ndarray]:
        """The price curve ``[t_max + 1]`` of a step of ``batch`` requests holding ``cached`` tokens in all."""
        per_request = (int(cached) // max(int(batch), 1)) // CONTEXT_BUCKET * CONTEXT_BUCKET + CONTEXT_BUCKET // 2
        key = (int(batch), per_request)
        held = self.held.get(key)
        if held is None:
            if len(self.held) > MAX_HELD_CURVES:  # a long run's batches and contexts: keep the newest
                self.held.clear()
            values = np.ascontiguousarray(self.cost.price_curve(self.t_max, batch, self.drafter, per_request))
            held = self.held[key] = (torch.from_numpy(values.astype(np.float32)), values)
        return held


# tokens per request one context bucket spans: the price moves by ~0.1 ms per position across one (EPYC, q ~ 2-3 ms
# per thousand query-key pairs), and a step's requests add a few tokens each
CONTEXT_BUCKET = 32
MAX_HELD_CURVES = 256
