"""The model chain (a draft model, EAGLE): the drafter's own draft with its raw confidence per depth.

Its columns are the bank's acceptance.parquet (accept mask) and speculator.parquet (``conf{k}``, and
``entropy{k}``/``margin{k}`` where recorded); its table reads the confidence, then the context axes.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from calib.chains.base import Axis, ChainKind, RoundData, context_axes, offer_inputs


def model_samples(bank):
    """One row per (round, depth reached): keys, depth, conf (+ entropy/margin if present), the context
    columns (:func:`calib.labels.round_context`), label. Rounds without confidences (an n-gram drafter)
    yield nothing."""
    import pyarrow as pa

    from calib.bank import schema
    from calib.labels import per_depth_samples, round_context

    t = bank.rounds()
    width = schema.width(t.column_names)
    conf = schema.depth_matrix(t, schema.CONF, width)
    has_conf = ~np.isnan(conf).all(axis=1)
    context = {n: v[has_conf] for n, v in round_context(t).items()}  # before the filter: every round counts
    t = t.filter(pa.array(has_conf))
    acc = schema.depth_matrix(t, schema.ACC, width)
    per_depth = {"conf": conf[has_conf]}
    for extra in ("entropy", "margin"):
        if f"{extra}0" in t.column_names:
            per_depth[extra] = schema.depth_matrix(t, extra, width)
    return per_depth_samples(t, acc, per_depth, context)


def model_drafted_depth(bank_dir) -> int:
    """Drafted depth K of the model chain in one bank folder: the widest conf columns holding data."""
    import pyarrow.parquet as pq

    from calib.bank import schema

    spec = Path(bank_dir) / schema.SPECULATOR
    w = schema.width(pq.read_schema(spec).names, schema.CONF)
    if not w:
        return 0
    conf0 = pq.read_table(spec, columns=[schema.col(schema.CONF, 0)]).column(0)
    return w if conf0.null_count < len(conf0) else 0


def model_round_data(rounds, axis_names=None):
    """The model chain over a bank's rounds (:class:`calib.chains.RoundData`; None for a bank without
    confidences): the verified accept mask, raw confidences, and as table input the confidence."""
    from calib.bank import schema

    width = schema.width(rounds.column_names)
    conf = schema.depth_matrix(rounds, schema.CONF, width)
    if not (~np.isnan(conf)).any():
        return None
    inputs = None if axis_names is None else conf.astype(np.float32)[..., None]
    return RoundData(schema.depth_matrix(rounds, schema.ACC, width), inputs, conf)


def model_step_inputs(offer, own, B: int, lengths: list[int], what: str):
    """float64 ``[B, W, 1]`` (numpy): the drafter's raw confidence per depth, the only own input an engine offers."""
    if own != ["conf"]:
        raise ValueError(f"the model chain's table reads {own} before its context axes; decide_step "
                         "passes the raw confidence only (['conf'])")
    return offer_inputs(offer.signal, B, lengths, len(own), what)


MODEL = ChainKind(
    id=1, name="model", samples=model_samples, confidence="conf", config_key="calibrator",
    feature_names=lambda cfg: ("conf", *tuple(cfg.get("extra") or ())),
    table_axes=lambda cfg: (Axis("conf", points=int(cfg.get("grid_points", 1025))), *context_axes(cfg)),
    drafted_depth=model_drafted_depth, round_data=model_round_data,
    engine_methods=("eagle", "eagle3", "draft_model"), step_inputs=model_step_inputs,
    description="the model-based drafter (draft model, EAGLE): raw confidence per depth")
