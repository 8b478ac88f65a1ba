"""A chain kind's round data with the table's context axes appended (what eval and replay read)."""

from __future__ import annotations

import numpy as np

from calib.chains.base import ChainKind, RoundData, split_context


def round_inputs(kind: ChainKind, rounds, axis_names):
    """:attr:`ChainKind.round_data` with the table's context axes appended: the chain's own inputs for
    the names that are not :data:`CONTEXT` axes, then each context axis' per-round value
    (:func:`calib.labels.round_context` of ``rounds``, a bank's rounds sorted by its keys) repeated over
    depths. ``axis_names`` None: no inputs."""
    if kind.round_data is None:
        return None
    if axis_names is None:
        return kind.round_data(rounds, None)
    own, ctx = split_context(axis_names, kind.name)
    data = kind.round_data(rounds, own)
    if data is None or not ctx:
        return data
    from calib.labels import round_context

    values = round_context(rounds, ctx)
    extra = np.stack([values[n] for n in ctx], axis=1).astype(np.float32)  # [R, A_ctx]
    width = data.inputs.shape[1]
    inputs = np.concatenate([data.inputs, np.repeat(extra[:, None, :], width, axis=1)], axis=2)  # [R, K, A]
    return RoundData(data.acc, inputs, data.raw)
