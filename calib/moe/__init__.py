"""MoE verification cost: routing captures, distinct-expert models, MoE verify-cost curves.

Light on import (numpy only, loaded on first use): the testbed recipe (:mod:`calib.moe.moefy`,
:mod:`calib.moe.capture`) loads torch and transformers itself. The cost models themselves live in
:mod:`calib.cost` (``distinct``, ``moe``); see calib/moe/README.md.
"""

_LAZY = {"UniformCoupon": "calib.cost.distinct", "IndependentNonUniform": "calib.cost.distinct",
         "MaxEntPairwise": "calib.cost.distinct", "Trajectories": "calib.cost.trajectories",
         "MoECost": "calib.cost.moe"}

__all__ = ["IndependentNonUniform", "MaxEntPairwise", "MoECost", "Trajectories", "UniformCoupon"]


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(name)
