"""Serve-time allocation of the batch's verification budget across draft chains.

>>> from calib.allocate import allocate_probs
>>> out = allocate_probs({"model": model_p, "ngram": ngram_p}, budget=64)   # or cost=verify_cost_curve
>>> out.drafter, out.depth, out.expected_accepted    # int8 [B] (chain ids, calib.chains), int32 [B], float32 [B]

The Triton kernel lives in :mod:`calib.allocate.triton_kernels` and is imported only when
``impl="triton"`` is asked for; on CPU tensors it runs under Triton's interpreter, which the caller
switches on with ``TRITON_INTERPRET=1`` before triton is first imported (nothing here sets it).
"""

from calib.allocate.api import MAX_CHAINS, Allocation, allocate, allocate_probs, calibrated_probs, check_cost
from calib.allocate.draft import DraftPlan, plan_draft
from calib.allocate.forecast import forecast_probs
from calib.allocate.reference import SCALE
from calib.allocate.shape import ShapePrice
from calib.chains import NO_CHAIN
from calib.tables.layout import AcceptanceTables, ChainTable, GridTables

__all__ = [
    "MAX_CHAINS",
    "NO_CHAIN",
    "SCALE",
    "AcceptanceTables",
    "Allocation",
    "ChainTable",
    "DraftPlan",
    "GridTables",
    "ShapePrice",
    "allocate",
    "allocate_probs",
    "calibrated_probs",
    "check_cost",
    "forecast_probs",
    "plan_draft",
]
