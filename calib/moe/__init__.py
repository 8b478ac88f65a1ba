"""MoE verification cost: routing captures, distinct-expert models, MoE verify-cost curves.

Light on import (numpy only, loaded on first use): the testbed recipe (:mod:`calib.moe.moefy`,
:mod:`calib.moe.capture`) loads torch and transformers itself. See calib/moe/README.md.
"""

_LAZY = {"UniformCoupon": "models", "IndependentNonUniform": "models", "MaxEntPairwise": "models",
         "Trajectories": "trajectories", "MoECost": "cost"}

__all__ = ["IndependentNonUniform", "MaxEntPairwise", "MoECost", "Trajectories", "UniformCoupon"]


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"calib.moe.{_LAZY[name]}"), name)
    raise AttributeError(name)
