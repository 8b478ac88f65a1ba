"""Declarative checks of the entry points' composed Hydra configs: ``train.py`` and ``serve.py`` here,
``eval.py``'s beside the evaluation (:mod:`calib.evaluate.checks`, it reuses the replay's declarations).

Each job has a table of dotted config keys and the constraints (:mod:`calib.params`) their values may
satisfy, plus the few rules tying two keys together; a refusal is one ``ValueError`` naming the job, the
key, its value, what it may be and how to set it. A key absent from the config is not checked.
"""

from __future__ import annotations

import itertools
import numbers
from collections.abc import Mapping

from calib.params import (
    TEXT,
    Boolean,
    Each,
    Fractions,
    Interval,
    NoneValue,
    Options,
    Satisfies,
    Subset,
    finite_number,
    validate_params,
)

ABSENT = object()


def _list(v) -> bool:
    return isinstance(v, (list, tuple))


INT_0 = Interval(numbers.Integral, 0, None)
INT_1 = Interval(numbers.Integral, 1, None)
REAL_0 = Interval(numbers.Real, 0, None)
PATHS = Satisfies("a non-empty list of paths", lambda v: _list(v) and bool(v) and all(isinstance(p, str) and p for p in v))
EDGES = Satisfies("a list of finite numbers in ascending order",
                  lambda v: _list(v) and all(finite_number(x) for x in v) and all(a <= b for a, b in itertools.pairwise(v)))
AUTO_OR_EDGES = [Options(("auto",)), EDGES]
LOGGERS = ("wandb", "csv", "none")
CALIBRATOR_EXTRA = ("entropy", "margin", "temperature")  # conf/calibrator/_common.yaml: extra


def _names(values) -> Satisfies:
    return Satisfies("a list of distinct names from " + ", ".join(repr(v) for v in values),
                     lambda v: _list(v) and len(set(v)) == len(v) and all(x in values for x in v))


def _lightning(prefix: str) -> dict:
    """The Lightning-trained estimators' own constraints of their shared settings (conf/trainer)."""
    from calib.calibrators.scaling.temperature import TemperatureScaling

    own = TemperatureScaling._parameter_constraints
    return {f"{prefix}.{k}": own[k] for k in ("max_epochs", "patience", "progress")}


def _train_constraints() -> dict:
    from calib.chains.ngram import NGRAM_SAMPLE_FEATURES

    return {
        "data.train": [TEXT, PATHS],
        "data.keep_logit_transforms": [Boolean()],
        "split.fractions": [Fractions(3)],
        "split.seed": [INT_0],
        **_lightning("trainer"),
        "calibrator.grid_points": [Interval(numbers.Integral, 2, None)],
        "calibrator.extra": [NoneValue(), _names(CALIBRATOR_EXTRA)],
        "ngram_model.table.features": [Subset(NGRAM_SAMPLE_FEATURES)],
        "ngram_model.table.edges": [Each(EDGES)],
        "context.max_bins": [INT_1],
        "context.min_cell_samples": [INT_1],
        "context.trial_samples": [INT_1],
        **{f"{group}.selection.{k}": v for group in ("calibrator", "ngram_model") for k, v in _selection().items()},
        "ngram_model.transfer.max_samples": [INT_1],
        "ngram_model.per_cell": [Boolean()],
        "logger.kind": [Options(LOGGERS)],
        "overwrite": [Boolean()],
    }


def _selection() -> dict:
    """The grouped cross-validation's settings (calib.calibrators.selection.GroupedCVSelection's declaration)."""
    from calib.calibrators.selection import GroupedCVSelection

    c = GroupedCVSelection._parameter_constraints
    return {k: c[k] for k in ("n_splits", "rule", "max_cv_samples", "ece_guard", "n_jobs", "seed")}


def _serve_constraints() -> dict:
    return {
        "tables": [TEXT],
        "concurrency": [INT_1],
        "limit": [NoneValue(), INT_1],
        "seed": [INT_0],
        "sampling.temperature": [REAL_0],
        "sampling.top_p": [Interval(numbers.Real, 0, 1, closed="right")],
        "sampling.max_tokens": [INT_1],
        "policy.speculate": [Boolean()],
        "policy.calib": [Boolean()],
        "serve.draft_cost": [REAL_0],
        "serve.cost": [TEXT, Satisfies("a list [weight_read, per_position] of two finite numbers >= 0",
                                       lambda v: _list(v) and len(v) == 2 and all(finite_number(x) and x >= 0 for x in v))],
        "serve.model_id": [NoneValue(), TEXT],
        "model.path": [NoneValue(), TEXT],   # an HF folder or a cached hub id (calib.target.resolve_target)
        "engine.max_model_len": [INT_1],
        "engine.kv_cache_gb": [Interval(numbers.Real, 0, None, closed="neither")],
        "engine.enforce_eager": [Boolean()],
        "engine.in_process": [Boolean()],
        "overwrite": [Boolean()],
        "progress": [Boolean()],
    }


def get(cfg, key: str, default=ABSENT):
    """``cfg``'s value at the dotted ``key`` (a plain dict, or an OmegaConf config: only that value is
    resolved); ``default`` where a part is missing."""
    try:
        from omegaconf import DictConfig, OmegaConf

        if isinstance(cfg, DictConfig):
            value = OmegaConf.select(cfg, key, default=default)
            return OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value
    except ImportError:  # pragma: no cover - omegaconf comes with hydra
        pass
    node = cfg
    for part in key.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return default
        node = node[part]
    return node


def config_path(cfg, value: str):
    """``value`` (a path a config names) as a ``Path`` under the config's ``root`` where relative; None where
    ``root`` cannot be resolved yet (an OmegaConf config composed outside Hydra: ``${hydra:runtime.cwd}``), so a
    check that reads the file is skipped there."""
    from pathlib import Path

    try:
        root = get(cfg, "root", ".")
    except Exception:  # noqa: BLE001 - the interpolation needs Hydra's runtime
        return None
    return Path(value) if Path(value).is_absolute() else Path(str(root)) / value


def refuse(job: str, key: str, value, want: str) -> None:
    raise ValueError(f"{job} config: parameter {key}={value!r} is invalid; {want} (set it with "
                     f"`python {job} {key}=...`)")


def validate_config(job: str, cfg, constraints: dict) -> None:
    """Check every dotted key of ``constraints`` present in ``cfg``; the first value none of its
    constraints accepts is a ``ValueError`` naming ``job`` (e.g. ``"eval.py"``), the key, the value,
    what it may be and the override that sets it."""
    for key, allowed in constraints.items():
        value = get(cfg, key)
        if value is ABSENT:
            continue
        try:
            validate_params(f"{job} config", {key: value}, {key: allowed})
        except ValueError as exc:
            raise ValueError(f"{exc} (set it with `python {job} {key}=...`)") from None


def _check_context(job: str, cfg) -> None:
    """``context.axes`` / ``context.candidates``: registered context names, each with ``edges`` "auto"
    or ascending finite numbers."""
    from calib.chains import CONTEXT

    for block in ("axes", "candidates"):
        spec = get(cfg, f"context.{block}")
        if spec is ABSENT or spec is None:
            continue
        if not isinstance(spec, Mapping):
            refuse(job, f"context.{block}", spec, "it must be a mapping {context axis: {edges: ...}}")
        for name, axis in spec.items():
            if name not in CONTEXT:
                refuse(job, f"context.{block}.{name}", axis, f"context axes are {sorted(CONTEXT)} (calib.chains.CONTEXT)")
            validate_config(job, {"context": {block: {name: axis or {}}}},
                            {f"context.{block}.{name}.edges": AUTO_OR_EDGES})


def check_train(cfg) -> None:
    """Refuse a ``train.py`` config (resolved, as a plain dict or an OmegaConf config) that cannot give
    meaningful tables: split fractions not 3 numbers in [0, 1] summing to 1, a negative split seed,
    trainer settings the estimators refuse, a grid of fewer than 2 points, unknown extra inputs, n-gram
    table features unknown or edges unsorted (or not one list per feature), context axes unknown or with
    unsorted edges, context counts < 1, an unknown logger kind. Raises ``ValueError`` naming the key."""
    job = "train.py"
    validate_config(job, cfg, _train_constraints())
    feats, edges = get(cfg, "ngram_model.table.features"), get(cfg, "ngram_model.table.edges")
    if feats is not ABSENT and edges is not ABSENT and len(feats) != len(edges):
        refuse(job, "ngram_model.table.edges", edges, f"it must hold one list of edges per feature of "
                                                       f"ngram_model.table.features={feats!r} ({len(feats)})")
    _check_context(job, cfg)


def check_serve(cfg) -> None:
    """Refuse a ``serve.py`` config (resolved, a plain dict or an OmegaConf config) the run cannot honour:
    concurrency, limit, seed; the sampling temperature (finite >= 0), top_p in (0, 1], max_tokens >= 1;
    where the policy speculates, ``speculative.num_speculative_tokens >= 1`` and the n-gram settings
    (>= 1, min <= max); for the calib policies their chains (registered names) and ``serve.draft_cost``
    finite >= 0, ``serve.cost`` a CSV path or [weight_read, per_position]; the engine's sizes. Raises
    ``ValueError`` naming the key."""
    job = "serve.py"
    validate_config(job, cfg, _serve_constraints())
    from calib.serve.knobs import ServeKnobs

    # the serving knobs' own declaration, checked before the engine starts
    validate_config(job, cfg, {f"serve.{k}": v for k, v in ServeKnobs._parameter_constraints.items()
                               if k.startswith(("online", "aside_", "retire_"))})
    method = get(cfg, "speculative.method")
    if get(cfg, "policy.speculate") is True and method not in (ABSENT, None, "none"):
        validate_config(job, cfg, {"speculative.num_speculative_tokens": [INT_1]})
        pairs = (("speculative.prompt_lookup_min", "speculative.prompt_lookup_max"),
                 ("speculative.ngram.min_n", "speculative.ngram.max_n"))
        validate_config(job, cfg, {k: [INT_1] for pair in pairs for k in pair} | {"speculative.ngram.k": [INT_1]})
        for lo_key, hi_key in pairs:
            lo, hi = get(cfg, lo_key), get(cfg, hi_key)
            if lo is not ABSENT and hi is not ABSENT and lo > hi:
                refuse(job, lo_key, lo, f"it must be at most {hi_key}={hi!r}")
    _check_reference_out(job, cfg)
    if get(cfg, "policy.calib") is True:
        from calib.chains import chain_names

        validate_config(job, cfg, {"policy.chains": [Subset(chain_names())], "policy.plan": [Boolean()]})


def _check_reference_out(job: str, cfg) -> None:
    """``reference_out``: the file a no-speculation run writes the clock oracle's reference to, at its end. A folder
    there, or a file that is not such a reference (a prompt file, a bench result), is refused now: the run would
    replace the user's file with its outputs."""
    out = get(cfg, "reference_out", None)
    path = config_path(cfg, out) if isinstance(out, str) and out else None
    if path is None:
        return
    from calib.serve.oracle import unreplaceable

    why = unreplaceable(path)
    if why is not None:
        refuse(job, "reference_out", out, why)

