"""The draft cost of a drafter: one draft pass (a token for every request) as a fraction of the target's verify pass.

A drafter records it where it is described, its export's ``config.json`` (key :data:`DRAFT_COST_KEY`,
written by calib/drafters/eagle/export.py); :func:`draft_cost` reads it, and a drafter that records
none (an n-gram chain, a draft model calib did not export) is priced at :data:`DEFAULT_DRAFT_COST`.
conf/eval.yaml and conf/serve.yaml read it with the ``${calib.draft_cost:DRAFTER}`` resolver.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

from calib.sidefiles import read_json

DRAFT_COST_KEY = "calib_draft_cost"  # in a drafter's config.json
# What the shipped EAGLE head (data/drafters/eagle-smollm2-135m) records: its matmul FLOPs per token
# against the target's (calib.drafters.eagle.model.head_cost_ratio: 0.242) to two places.
DEFAULT_DRAFT_COST = 0.24
PROJECT_ROOT = Path(__file__).resolve().parents[2]  # conf/ and data/: what a relative drafter path is under
RESOLVER = "calib.draft_cost"


def check_draft_cost(value, where: str) -> float:
    """``value`` as a float, or a ``ValueError`` naming ``where``: a draft cost is finite and >= 0."""
    try:
        cost = float(value)
    except (TypeError, ValueError):
        cost = math.nan
    if isinstance(value, bool) or not (math.isfinite(cost) and cost >= 0):
        raise ValueError(f"{where}: draft cost {value!r}; it must be a finite number >= 0 (one draft pass "
                         "as a fraction of the target's verify pass)")
    return cost


def draft_cost(drafter_dir: str | os.PathLike | None) -> float:
    """The draft cost recorded in ``drafter_dir``'s ``config.json`` (relative: under the project);
    :data:`DEFAULT_DRAFT_COST` where there is no such folder (None: no drafter folder) or it records none."""
    if drafter_dir is None:
        return DEFAULT_DRAFT_COST
    path = Path(drafter_dir)
    config = (path if path.is_absolute() else PROJECT_ROOT / path) / "config.json"
    if not config.is_file():
        return DEFAULT_DRAFT_COST
    recorded = read_json(config, hint="the drafter's draft cost is read from it")
    if DRAFT_COST_KEY not in recorded:
        return DEFAULT_DRAFT_COST
    return check_draft_cost(recorded[DRAFT_COST_KEY], f"{config} {DRAFT_COST_KEY}")
