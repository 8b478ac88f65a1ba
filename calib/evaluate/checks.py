"""``eval.py``'s config check: the composed config's keys against their constraints (:mod:`calib.config_checks`'
machinery), reusing the replay's own declaration (``ReplayConfig._constraints``), before any bank loads."""

from __future__ import annotations

import numbers
from collections.abc import Mapping

from calib.config_checks import (
    ABSENT,
    INT_0,
    INT_1,
    LOGGERS,
    PATHS,
    REAL_0,
    config_path,
    get,
    refuse,
    validate_config,
)
from calib.evaluate.replay import ReplayConfig
from calib.params import TEXT, Boolean, Each, Fractions, Interval, NoneValue, Options
from calib.tables.online import OnlineSettings

SPLITS = ("train", "val", "test")
COST_KINDS = ("parametric", "measured", "engine", "moe")


def _eval_constraints() -> dict:
    return {
        "data.test": [TEXT, PATHS],
        "tables": [TEXT],
        "serving_bench": [NoneValue(), TEXT],
        "split.fractions": [Fractions(3)],
        "split.seed": [INT_0],
        "split.name": [Options(SPLITS)],
        "metrics.n_bins": [INT_1],
        "metrics.n_boot": [INT_1],
        "metrics.length_n_boot": [INT_1],
        "metrics.seed": [INT_0],
        "plots.reliability_bins": [INT_1],
        # the online correction's one schema, which serve.py's serve.online is checked by too
        **{f"online.{k}": v for k, v in OnlineSettings._parameter_constraints.items()},
        "metrics.online_warmup_rounds": [INT_0],
        "metrics.depth_min_labels": [INT_1],
        **{f"replay.{k}": v for k, v in ReplayConfig._constraints.items()},  # the replay's own declaration
        "replay.batch_sizes": [Each(INT_1)],
        "replay.progress": [Boolean()],
        "logger.kind": [Options(LOGGERS)],
        "overwrite": [Boolean()],
    }


def _check_costs(job: str, cfg) -> None:
    """eval.yaml's ``cost`` curves: a known kind; a parametric curve's weight_read > 0 and per_position >= 0."""
    costs = get(cfg, "cost")
    if costs is ABSENT or costs is None:
        return
    if not isinstance(costs, Mapping) or not costs:
        refuse(job, "cost", costs, "it must name at least one cost curve (cost=parametric|measured|...)")
    for name, c in costs.items():
        if not isinstance(c, Mapping):
            refuse(job, f"cost.{name}", c, "it must be a cost curve's settings (conf/cost/)")
        sub = {"cost": {name: c}}
        validate_config(job, {"cost": {name: {"kind": c.get("kind", name)}}}, {f"cost.{name}.kind": [Options(COST_KINDS)]})
        if c.get("kind", name) == "parametric":
            validate_config(job, sub, {f"cost.{name}.weight_read": [Interval(numbers.Real, 0, None, closed="neither")],
                                       f"cost.{name}.per_position": [REAL_0]})
        elif c.get("kind", name) == "engine":
            validate_config(job, sub, {f"cost.{name}.path": [TEXT], f"cost.{name}.charge": [NoneValue(), TEXT]})
            _check_cost_file(job, cfg, f"cost.{name}.path", c["path"], "engine")
            if c.get("charge"):
                _check_cost_file(job, cfg, f"cost.{name}.charge", c["charge"], "engine")
        elif c.get("kind", name) == "measured":
            validate_config(job, sub, {f"cost.{name}.path": [TEXT], f"cost.{name}.column": [NoneValue(), TEXT],
                                       f"cost.{name}.pad_to_cheaper": [Boolean()]})
            _check_cost_file(job, cfg, f"cost.{name}.path", c["path"], "measured", c.get("column") or "seconds")


def _check_cost_file(job: str, cfg, key: str, value: str, kind: str, column: str = "seconds") -> None:
    """The file a cost curve reads, read now (a few hundred bytes), so that a folder, a profile instead of a fit or a
    mistyped term is said before any bank loads, naming the key; skipped where ``root`` cannot be resolved yet."""
    from calib.cost import read_curve_csv
    from calib.cost.step import load_step_cost

    path = config_path(cfg, value)
    if path is None:
        return
    try:
        if kind == "engine":
            load_step_cost(path)
        else:
            read_curve_csv(path, column)
    except ValueError as exc:
        want = "an engine step-cost JSON (bench/profile_step.py --step-cost)" if kind == "engine" else \
            "a measured verify-cost CSV (bench/verify_cost.py)"
        refuse(job, key, value, f"it must name {want}: {exc}")


def check_eval(cfg) -> None:
    """Refuse an ``eval.py`` config (resolved, a plain dict or an OmegaConf config) whose settings make a
    metric meaningless or the replay impossible: split fractions/seed/name, metric bins and bootstrap
    replicates < 1, reliability bins < 1, the replay's settings (batch sizes ints >= 1, budget_per_request
    >= 0, 1 <= min_steps <= max_steps, passes > 0, mode, impl, policies, draft costs finite >= 0 per
    registered chain) and the cost curves'. Raises ``ValueError`` naming the key."""
    job = "eval.py"
    validate_config(job, cfg, _eval_constraints())
    lo, hi = get(cfg, "replay.min_steps"), get(cfg, "replay.max_steps")
    if lo is not ABSENT and hi is not ABSENT and lo > hi:
        refuse(job, "replay.min_steps", lo, f"it must be at most replay.max_steps={hi!r}")
    draft = get(cfg, "draft_cost")
    if draft is not ABSENT:
        from calib.chains import chain_names

        if not isinstance(draft, Mapping):
            refuse(job, "draft_cost", draft, "it must map drafters to the cost of one draft pass")
        for name, value in draft.items():
            if name not in chain_names():
                refuse(job, f"draft_cost.{name}", value, f"draft costs are given for the chains {list(chain_names())}")
            validate_config(job, {"draft_cost": {name: value}}, {f"draft_cost.{name}": [REAL_0]})
    replay = get(cfg, "replay")
    if isinstance(replay, Mapping):  # what is left of ReplayConfig's checks (its policies), before any bank loads
        fields = {k: v for k, v in replay.items() if k != "progress"}
        try:
            ReplayConfig(**fields, **({"draft_cost": draft} if isinstance(draft, Mapping) else {}))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{job} config: replay: {exc} (set it with `python {job} replay.KEY=...`)") from None
    _check_costs(job, cfg)
