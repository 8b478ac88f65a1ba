"""Replay banks as a stream of decode steps and score the registered policies (:mod:`calib.policies`) by goodput.

``config`` (:class:`ReplayConfig`), ``driver`` (:func:`replay`, the ladder rows); accounting: docs/policies.md.
"""

from calib.evaluate.replay.config import DRAFTERS, EVAL_YAML, MODES, ReplayConfig, yaml_defaults
from calib.evaluate.replay.driver import (
    add_hindsight,
    draw_steps,
    ladder_rows,
    replay,
    replay_setting,
    summarise,
    train_mean_curve,
)

__all__ = ["DRAFTERS", "EVAL_YAML", "MODES", "ReplayConfig", "add_hindsight", "draw_steps", "ladder_rows", "replay",
           "replay_setting", "summarise", "train_mean_curve", "yaml_defaults"]
