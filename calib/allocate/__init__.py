"""Serve-time allocation of the batch's verification budget across draft chains.

>>> from calib.allocate import allocate_probs
>>> out = allocate_probs(model_p, ngram_p, budget=64)        # or cost=verify_cost_curve
>>> out.drafter, out.depth, out.expected_accepted            # int8 [B], int32 [B], float32 [B]

The Triton kernel lives in :mod:`calib.allocate.triton_kernels` and is imported only when
``impl="triton"`` is asked for; on CPU tensors it runs under Triton's interpreter, which the caller
switches on with ``TRITON_INTERPRET=1`` before triton is first imported (nothing here sets it).
"""

from calib.allocate.api import Allocation, allocate, allocate_probs, check_cost
from calib.allocate.reference import MODEL, NGRAM, NO_DRAFTER, SCALE
from calib.allocate.tables import AcceptanceTables, GridTables

__all__ = [
    "MODEL",
    "NGRAM",
    "NO_DRAFTER",
    "SCALE",
    "AcceptanceTables",
    "Allocation",
    "GridTables",
    "allocate",
    "allocate_probs",
    "check_cost",
]
