"""The replay's settings: :class:`ReplayConfig`, whose defaults are ``conf/eval.yaml``'s ``replay:`` and
``draft_cost:`` blocks (the one place they are written)."""

from __future__ import annotations

import functools
import numbers
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import ClassVar

from calib.allocate.api import IMPLEMENTATIONS
from calib.calibrators.base import Interval, Options, validate_params
from calib.chains import chain_names
from calib.params import Boolean
from calib.policies import canonical, policy_names

MODES = ("price", "budget")  # price: goodput rule on the cost curve; budget: tokens per request
# When the draft-aware policies plan their model draft passes: once per step, before drafting (the loop
# calib serves: calib/vllm/server.py sets the step's passes), or again before every pass.
PLANS = ("step", "pass")
# How a recorded round counts: once per policy step, or for the stretch of text it covered (summarise).
WEIGHTINGS = ("positions", "throughput", "rounds")
DRAFTERS = chain_names()  # the chains a draft cost can be given for (calib.chains, at import)
EVAL_YAML = Path(__file__).resolve().parents[3] / "conf" / "eval.yaml"


@functools.cache
def yaml_defaults() -> dict:
    """ReplayConfig's defaults: ``conf/eval.yaml``'s ``replay:`` block and its ``draft_cost:`` (the one
    place they are written; ``eval.py`` passes the composed values, overrides included)."""
    from omegaconf import OmegaConf

    if not EVAL_YAML.exists():
        raise FileNotFoundError(f"{EVAL_YAML} not found: ReplayConfig takes its defaults from it; pass "
                                "every field explicitly when calib runs outside its repository")
    cfg = OmegaConf.load(EVAL_YAML)
    replay = OmegaConf.to_container(cfg.replay, resolve=True)
    return {**{f.name: replay[f.name] for f in fields(ReplayConfig) if f.name in replay},
            "draft_cost": OmegaConf.to_container(cfg.draft_cost, resolve=True)}


def _from_yaml(name: str):
    """A ``default_factory`` reading field ``name`` from :func:`yaml_defaults` at construction."""
    return lambda: yaml_defaults()[name]


@dataclass
class ReplayConfig:
    """How the replay runs; fields not given take their value from ``conf/eval.yaml`` (``replay:``
    and ``draft_cost:``), so the YAML is the one source of every default. Checked on construction:
    an unknown policy, mode or implementation is a ``ValueError`` listing the valid ones.

    Attributes:
        batch_sizes: the B of each replayed setting.
        policies: registered policy names (:func:`calib.policies.policy_names`; ``fixed`` =
            every ``fixed_<γ>``); checked against the registry when the config is built.
        mode: from :data:`MODES`; ``price``: the allocator's goodput rule on the cost curve,
            ``budget``: a batch budget of ``round(budget_per_request * B)`` draft tokens.
        min_steps, max_steps, passes: steps per setting ≈ ``passes · rounds / B``, clipped.
        seed: of the step draws.
        draft_cost: ``{drafter: cost of one draft pass as a fraction of the target's pass over B}``,
            drafters from :data:`DRAFTERS`.
        impl: the allocator implementation (``calib.allocate``'s ``IMPLEMENTATIONS``).
        plan: from :data:`PLANS`; when the draft-aware policies (``ragged_calibrated``, ``two_drafter``)
            choose their draft passes: ``step`` once before drafting, as served; ``pass`` before each.
        cell_prompts: ``(min, per_request)``: a setting at ``B`` replays only the first ``max(min,
            per_request · B)`` prompts of its category, in the order they were collected, which is what
            ``bench/serve.py``'s cell at concurrency ``B`` serves (the top of the category's file); None: every
            prompt. A prediction of a served cell is then of the prompts it served.
        undrafted_steps: replay a model-free drafter's steps without a draft too (the gaps between a request's
            rounds: :mod:`calib.evaluate.replay.undrafted`); off: the recorded rounds only, every step drafted.
        weighting: from :data:`WEIGHTINGS`; ``positions``: a recorded round counts for the text it covered, so
            a policy committing more than the collecting engine crosses it in fewer steps
            (:func:`calib.evaluate.replay.summarise`), each request crossing its own stretch; ``throughput``: the
            same text, the batch writing it at its total rate (:func:`calib.policies.setting.step_weights`);
            ``rounds``: every recorded round is one step of every policy.
        online: the policies read each round's calibrated probabilities as the online correction leaves them
            (eval's ``online:``, the correction serving applies by default; each bank's rounds in collection
            order, learning from every verified depth, :func:`calib.evaluate.online.with_online`); off: the
            tables alone.
        redecide: a policy that commits less than a recorded round's stretch decides again on the rest of it,
            each chain's accept mask and probabilities shifted by what it committed
            (:mod:`calib.evaluate.replay.redecide`); off: it crosses the rest at the same rate. Under weighting
            ``rounds`` a round has no stretch, and this does nothing.
        lanes: replay each setting as the bench serves it, B lanes each following its request through the text
            (:mod:`calib.evaluate.replay.lanes`), instead of dealing recorded rounds to steps; the weighting,
            ``redecide`` and ``undrafted_steps`` (a lane serves the steps between rounds always) then play no part.
    """

    batch_sizes: tuple[int, ...] = field(default_factory=_from_yaml("batch_sizes"))
    policies: tuple[str, ...] = field(default_factory=_from_yaml("policies"))
    mode: str = field(default_factory=_from_yaml("mode"))
    budget_per_request: float = field(default_factory=_from_yaml("budget_per_request"))
    min_steps: int = field(default_factory=_from_yaml("min_steps"))
    max_steps: int = field(default_factory=_from_yaml("max_steps"))
    passes: float = field(default_factory=_from_yaml("passes"))
    seed: int = field(default_factory=_from_yaml("seed"))
    draft_cost: dict = field(default_factory=_from_yaml("draft_cost"))
    impl: str = field(default_factory=_from_yaml("impl"))
    plan: str = field(default_factory=_from_yaml("plan"))
    cell_prompts: tuple[int, int] | None = field(default_factory=_from_yaml("cell_prompts"))
    undrafted_steps: bool = field(default_factory=_from_yaml("undrafted_steps"))
    weighting: str = field(default_factory=_from_yaml("weighting"))
    online: bool = field(default_factory=_from_yaml("online"))
    redecide: bool = field(default_factory=_from_yaml("redecide"))
    lanes: bool = field(default_factory=_from_yaml("lanes"))

    _constraints: ClassVar[dict] = {  # declarative checks (calib.calibrators.base), batch_sizes below
        "mode": [Options(MODES)],
        "budget_per_request": [Interval(numbers.Real, 0, None)],
        "min_steps": [Interval(numbers.Integral, 1, None)],
        "max_steps": [Interval(numbers.Integral, 1, None)],
        "passes": [Interval(numbers.Real, 0, None, closed="neither")],
        "seed": [Interval(numbers.Integral, 0, None)],
        "impl": [Options(IMPLEMENTATIONS)],
        "plan": [Options(PLANS)],
        "undrafted_steps": [Boolean()],
        "weighting": [Options(WEIGHTINGS)],
        "online": [Boolean()],
        "redecide": [Boolean()],
        "lanes": [Boolean()],
    }

    def accounting(self) -> str:
        """One sentence for the report: how the replay turns recorded rounds into steps."""
        if self.lanes:
            return ("B lanes serve a category's test prompts in order, each following its request through the text "
                    "(replay.lanes: a lane at position x serves the recorded round that holds x, read from x on) and "
                    "taking the next prompt when done; the totals are the steady steps, every lane busy.")
        out = (f"Each step deals B recorded rounds of one category from the test split, each counted for the text its "
               f"collecting engine crossed (weighting `{self.weighting}`)")
        return out + ("; a policy committing less decides again on the rest (replay.redecide)."
                      if self.redecide and self.weighting != "rounds" else ".")

    def __post_init__(self) -> None:
        self.batch_sizes = tuple(self.batch_sizes)
        self.policies = tuple(canonical(p) if isinstance(p, str) else p for p in self.policies)  # aliases: their policy
        self.draft_cost = dict(self.draft_cost)
        params = {f.name: getattr(self, f.name) for f in fields(self)}
        validate_params("ReplayConfig", {k: params[k] for k in self._constraints}, self._constraints)
        known = policy_names()
        pols = list(self.policies)
        if not pols or len(set(pols)) != len(pols) or not all(isinstance(p, str) for p in pols):
            raise ValueError(f"ReplayConfig: policies={pols} is invalid; it must be a non-empty list of distinct "
                             f"policy names; the registered policies are {list(known)}")
        unknown = [p for p in pols if p not in known]
        if unknown:
            raise ValueError(f"ReplayConfig: unknown policies {unknown}; the registered policies are "
                             f"{list(known)} (calib.policies)")
        positive = Interval(numbers.Integral, 1, None)
        if not self.batch_sizes or not all(positive.accepts(b) for b in self.batch_sizes):
            raise ValueError(f"ReplayConfig: batch_sizes={list(self.batch_sizes)} is invalid; it must be a "
                             "non-empty list of integers >= 1")
        if self.cell_prompts is not None:
            pair = tuple(self.cell_prompts) if isinstance(self.cell_prompts, (list, tuple)) else ()
            if len(pair) != 2 or not all(positive.accepts(v) for v in pair):
                raise ValueError(f"ReplayConfig: cell_prompts={self.cell_prompts!r} is invalid; it must be null or "
                                 "[min, per_request], two integers >= 1 (bench/serve.py's cell: [8, 2])")
            self.cell_prompts = (int(pair[0]), int(pair[1]))
        if self.min_steps > self.max_steps:
            raise ValueError(f"ReplayConfig: min_steps={self.min_steps} > max_steps={self.max_steps}")
        unknown = sorted(set(self.draft_cost) - set(chain_names()))
        if unknown:
            raise ValueError(f"ReplayConfig: draft_cost names {unknown}; the drafters are {list(chain_names())}")
        for name, cost in self.draft_cost.items():
            if not Interval(numbers.Real, 0, None).accepts(cost):
                raise ValueError(f"ReplayConfig: draft_cost[{name!r}]={cost!r} is invalid; it must be a "
                                 "finite number >= 0 (a fraction of the target's verify pass over the batch)")
