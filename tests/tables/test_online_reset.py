"""OnlineTables.reset: the tables alone again (a bench's cells each start from the same state). SYNTHETIC tables and
outcomes (tests/allocate/test_context_axes.py's)."""

from __future__ import annotations

import numpy as np
import torch

from calib.tables.online import OnlineSettings
from calib.tables.online_tables import OnlineTables
from tests.allocate.test_context_axes import _tables


def test_reset_restores_every_grid_and_unlearns_the_correction():
    tables = _tables(3)
    before = {name: t.grid.clone() for name, t in tables.chains.items()}
    online = OnlineTables(tables, OnlineSettings())
    rng = np.random.default_rng(0)
    for _ in range(20):  # outcomes far below what the tables say: the correction moves every grid
        for name, c in online.chains.items():
            p = np.full((8, 3), 0.9)
            online.observe(name, p, np.zeros_like(p), rng.integers(0, c["n_cells"], 8))
        online.refresh(lazy=False)
    assert any(not torch.equal(t.grid, before[n]) for n, t in tables.chains.items())
    online.reset()
    for name, t in tables.chains.items():
        assert torch.equal(t.grid, before[name])
        c = online.chains[name]
        assert not c["correction"]._learnt and not c["stale"].any()
        rows, cols = np.zeros((1, 2), dtype=np.int64), np.array([[0, 1]], dtype=np.int64)
        assert np.array_equal(online.read_host(name, rows, cols), c["host_prior"][rows, cols])
    p = np.full((4, 3), 0.9)
    name = next(iter(online.chains))
    assert online.observe(name, p, np.zeros_like(p), np.zeros(4, dtype=np.int64)) > 0  # it learns again
