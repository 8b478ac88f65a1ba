"""Policies: one registry entry per policy, run by the replay (calib.evaluate.replay) and by serve.py.

:mod:`calib.policies.base` is the registry; the built-ins register in the modules below. See docs/policies.md.
"""

from calib.policies.base import (
    BASE_TOTALS,
    CAMP_DEFAULTS,
    CAMPS,
    KINDS,
    Arm,
    Policy,
    PolicyResult,
    Serving,
    Totals,
    aliases,
    camp_of,
    canonical,
    closure,
    display_order,
    policies,
    policy,
    policy_names,
    policy_of_row,
    register_policy,
    row_order,
    servable,
    serving_nodes,
    unregister_policy,
)

# Import order = registration order = computation order = the row order within a ladder setting.
# isort: off
from calib.policies import reference  # noqa: F401  (no_spec, fixed)
from calib.policies import uniform  # noqa: F401  (homogeneous, gated_uniform)
from calib.policies import ragged  # noqa: F401  (ragged_raw, ragged_calibrated, two_drafter)
from calib.policies import oracle  # noqa: F401
from calib.policies import hindsight  # (best_fixed, vllm_dsd)
from calib.policies import vllm_adaptive  # noqa: F401
# isort: on

REFERENCE = hindsight.REFERENCE  # every ladder row's reference (vs_best_fixed)

__all__ = [
    "BASE_TOTALS", "CAMPS", "CAMP_DEFAULTS", "KINDS", "REFERENCE", "Arm", "Policy", "PolicyResult", "Serving", "Totals",
    "aliases", "camp_of", "canonical", "closure", "display_order", "policies", "policy", "policy_names",
    "policy_of_row", "register_policy", "row_order", "servable", "serving_nodes", "unregister_policy",
]
