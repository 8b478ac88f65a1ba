"""Serving's knobs as one validated value, carried to vLLM's workers as JSON in ``CALIB_SERVE``.

serve.py builds it from its config (:func:`calib.vllm.serve_runner.build_engine`); under ``vllm serve`` a
user sets ``CALIB_SERVE='{"tables": "runs/train/default"}'``. A new knob is one field here and its use.
"""

from __future__ import annotations

import json
import numbers
import warnings
from collections.abc import Mapping
from dataclasses import InitVar, asdict, dataclass, field, fields
from pathlib import Path
from typing import ClassVar

from calib.cost.draft import DEFAULT_DRAFT_COST, PROJECT_ROOT
from calib.params import TEXT, Boolean, Each, Interval, NoneValue, Satisfies, validate_params
from calib.tables.online import OnlineSettings

# The cost serve.py prices with by default (conf/serve.yaml serve.cost), for `vllm serve` too: the engine's
# step cost measured by bench/profile_step.py (calib/cost/step.py), what the replay's cost kind `engine` reads.
DEFAULT_COST_FILE = "data/cost/smollm2-135m-cpu-step.json"
DEFAULT_COST = str(PROJECT_ROOT / DEFAULT_COST_FILE)


def _cost_text(text) -> bool:
    from calib.cost.serving import measured_cost, parse_cost, step_cost_path

    return isinstance(text, str) and (measured_cost(text) is not None or step_cost_path(text) is not None
                                      or bool(parse_cost(text)))


# The flat spellings of the online correction's settings before they were one nested value (conf/online/), kept
# for one release as aliases with a warning: {old knob: its key in ``online``}. ``online=false`` (a bool) likewise.
DEPRECATED_ONLINE = {"online_decay": "decay", "online_prior": "prior", "online_pooled": "pooled",
                     "online_slope": "slope"}


def _online(node, flat: dict) -> OnlineSettings:
    """The online correction's settings from the ``online`` knob and the deprecated flat knobs set (``flat``),
    each warned about with the key to write instead; a flat knob and a nested key set to two values is refused."""
    if isinstance(node, bool):
        text = json.dumps(node)
        warnings.warn(f"serve.online={text} is deprecated: write serve.online.enabled={text} (CALIB_SERVE: "
                      f"{{\"online\": {{\"enabled\": {text}}}}}); the flat spelling goes in the next release",
                      FutureWarning, stacklevel=4)
        node = {"enabled": node}
    settings = OnlineSettings.from_config(node, key="online", owner="ServeKnobs")
    if not flat:
        return settings
    default, values = OnlineSettings(), settings.to_config()
    for old, value in flat.items():
        new = DEPRECATED_ONLINE[old]
        if values[new] not in (getattr(default, new), value):
            raise ValueError(f"ServeKnobs: {old}={value!r} and online.{new}={values[new]!r} set one setting twice; "
                             f"drop {old} (deprecated) and keep online.{new}")
        text = json.dumps(value)  # as a config or CALIB_SERVE spells it (false, not False)
        warnings.warn(f"serve.{old}={text} is deprecated: write serve.online.{new}={text} (CALIB_SERVE: "
                      f"{{\"online\": {{\"{new}\": {text}}}}}); the flat spelling goes in the next release",
                      FutureWarning, stacklevel=4)
        values[new] = value
    return OnlineSettings.from_config(values, key="online", owner="ServeKnobs")


@dataclass(frozen=True)
class ServeKnobs:
    """What serving needs beyond the engine's own config; validated at construction."""

    tables: str  # the tables folder (python train.py out_dir=...)
    cost: str = DEFAULT_COST  # verify cost C(T): a measured 'PATH.csv[:column]' or 'weight_read,per_position'
    model_id: str | None = None  # the target's id in the tables (None: the engine's model folder name)
    ngram: tuple[int, int, int] = (1, 4, 4)  # min_n, max_n, k of the n-gram chain beside a model drafter
    chains: tuple[str, ...] | None = None  # the chains calib may verify (None: every registered chain)
    plan: bool = True  # with a model drafter: choose each step's number of draft passes (plan_draft)
    draft_cost: float = DEFAULT_DRAFT_COST  # one model-drafter pass / the verify pass C(B) (the drafter's export)
    # the online correction of the tables by verified outcomes (calib/tables/online.py): one nested value, the
    # schema eval's replay reads too (conf/online/default.yaml); a mapping (JSON, config) is read into it
    online: OnlineSettings = field(default_factory=OnlineSettings)
    # deprecated flat spellings (one release; a warning names the nested key): online_decay=X is online.decay=X
    online_decay: InitVar[float | None] = None
    online_prior: InitVar[float | None] = None
    online_pooled: InitVar[bool | None] = None
    online_slope: InitVar[bool | None] = None
    # the clock oracle (greedy only, calib/serve/oracle.py): the path of a reference file of no speculation's
    # outputs; each step verifies exactly what the reference accepts instead of deciding from the tables
    oracle: str | None = None
    # standing aside (calib/serve/aside.py): after this many consecutive decisions of one batch that were vLLM's
    # own drafts, or no drafts, take that without deciding (0: always decide), deciding again every aside_every steps
    aside_after: int = 4
    aside_every: int = 16
    # ... and a stretch of vLLM's own drafts only where their whole proposal adds at most this share to a step's price
    aside_engine_price: float = 0.3
    # with a model drafter: retire a request from the model chain after this many consecutive steps its batch ran no
    # draft pass; a step of retired requests only that runs none skips the head's idle pass (calib/vllm/retire.py;
    # 0: never, the head runs every step as in vLLM)
    retire_drafter_after: int = 4
    # retire a newcomer before its first step where the last plan would run no pass for one more request either:
    # its prefill skips the head's pass and its prefix-cache hit keeps the block vLLM drops for the head
    retire_at_admission: bool = True
    # the step clock (calib/serve/step_clock.py): the cost curve corrected by this engine's own steps, per batch
    # size, each step's weight decaying by clock_decay per later step, the curve a prior of clock_prior steps
    clock: bool = True
    clock_decay: float = 0.95
    clock_prior: float = 8.0
    # where a batch has verified draft tokens clock_probe steps in a row and its last decision expected less than
    # clock_probe_gain (a share of the step's goodput) from them, one step without draft tokens: the clock then tells
    # what a step pays once for any draft token from its base (0: never)
    clock_probe: int = 16
    clock_probe_gain: float = 0.25
    # an engine step cost fitted with context (docs/cost.md): price each step at its own batch and its requests' mean
    # context (calib.cost.serving.ContextCurves), not at the profile's mean context
    context_price: bool = True

    _parameter_constraints: ClassVar[dict] = {
        "tables": [TEXT],
        "cost": [Satisfies("a measured 'PATH.csv[:column]', an engine step-cost model 'PATH.json' or "
                           "'weight_read,per_position' (e.g. '1.0,0.01')",
                           _cost_text)],
        "model_id": [TEXT, NoneValue()],
        "ngram": [Satisfies("three integers min_n <= max_n, k >= 1", lambda v: len(v) == 3 and all(
            isinstance(x, numbers.Integral) and not isinstance(x, bool) and x >= 1 for x in v) and v[0] <= v[1])],
        "chains": [Each(TEXT), NoneValue()],
        "plan": [Boolean()],
        "draft_cost": [Interval(numbers.Real, 0, None)],
        # a mapping of OnlineSettings' keys (the deprecated bool: online.enabled), each checked by its own
        # declaration; the check of serve.py's config reuses these entries (calib.config_checks.check_serve)
        "online": [Satisfies("a mapping of the online correction's settings (conf/online/default.yaml)",
                             lambda v: isinstance(v, (Mapping, OnlineSettings))), Boolean()],
        **{f"online.{k}": v for k, v in OnlineSettings._parameter_constraints.items()},
        **{old: [NoneValue(), *OnlineSettings._parameter_constraints[new]] for old, new in DEPRECATED_ONLINE.items()},
        "aside_after": [Interval(numbers.Integral, 0, None)],
        "aside_every": [Interval(numbers.Integral, 1, None)],
        "aside_engine_price": [Interval(numbers.Real, 0, None)],
        "retire_drafter_after": [Interval(numbers.Integral, 0, None)],
        "retire_at_admission": [Boolean()],
        "clock": [Boolean()],
        "clock_decay": [Interval(numbers.Real, 0, 1, closed="right")],
        "clock_prior": [Interval(numbers.Real, 0, None, closed="neither")],
        "clock_probe": [Interval(numbers.Integral, 0, None)],
        "clock_probe_gain": [Interval(numbers.Real, 0, None)],
        "context_price": [Boolean()],
        "oracle": [NoneValue(), Satisfies("None or the path of an existing oracle reference file "
                                          "(calib/serve/oracle.py)", lambda v: isinstance(v, str) and Path(v).is_file())],
    }

    def online_settings(self) -> OnlineSettings | None:
        """The online correction's settings, or None when switched off (what the decider takes)."""
        return self.online if self.online.enabled else None

    def __post_init__(self, online_decay, online_prior, online_pooled, online_slope):
        object.__setattr__(self, "ngram", tuple(self.ngram) if isinstance(self.ngram, (list, tuple)) else self.ngram)
        if isinstance(self.chains, list):
            object.__setattr__(self, "chains", tuple(self.chains))
        flat = {"online_decay": online_decay, "online_prior": online_prior, "online_pooled": online_pooled,
                "online_slope": online_slope}
        validate_params("ServeKnobs", {f.name: getattr(self, f.name) for f in fields(self)} | flat,
                        {k: v for k, v in self._parameter_constraints.items() if "." not in k})
        object.__setattr__(self, "online", _online(self.online, {k: v for k, v in flat.items() if v is not None}))

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> ServeKnobs:
        """The knobs ``CALIB_SERVE`` holds; an unknown key or a bad value is refused by name."""
        try:
            values = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"CALIB_SERVE={text!r}: not JSON ({exc}); expected e.g. "
                             '\'{"tables": "runs/train/default"}\'') from None
        names = [f.name for f in fields(cls)] + list(DEPRECATED_ONLINE)
        if not isinstance(values, dict) or set(values) - set(names):
            raise ValueError(f"CALIB_SERVE={text!r}: expected a JSON object with keys from {', '.join(names)}")
        return cls(**values)
