"""The compiled table lookup (calib/tables/lookup_compiled.py) against the numpy lookup it stands in for
(calib.tables.layout.chain_lookup_host with the kernel off). SYNTHETIC tables and inputs (seeded): an interpolated
confidence axis with binned context axes, a binned-only chain, NaN confidences and contexts, values on the edges, ±inf.
The table's own values bit for bit; values read through a learnt online correction to one float32 ulp (numba's scalar
``exp`` and numpy's vector loop can round a float64 apart)."""

from __future__ import annotations

from importlib.util import find_spec

import numpy as np
import pytest

from calib.tables import layout
from calib.tables.lookup_compiled import lookup_kernel
from calib.tables.online import OnlineSettings
from calib.tables.online_tables import OnlineTables
from tests.allocate.test_context_axes import _signals, _tables

# numba is imported by the tests, never at collection (its modules in sys.modules upset vLLM's kernel rebinding)
pytestmark = pytest.mark.skipif(find_spec("numba") is None, reason="numba is not installed: the numpy lookup runs")


def _numpy_lookup(monkeypatch, table, x, name):
    with monkeypatch.context() as m:
        m.setattr(layout, "lookup_kernel", lambda: None)
        return layout.chain_lookup_host(table, x, name)


def _inputs(seed: int, B: int = 24) -> dict:
    """SYNTHETIC signals of tests/allocate/test_context_axes.py, with edge values and ±inf mixed in."""
    x = {n: v.numpy().astype(np.float32) for n, v in _signals(B, 5, 4, seed).items()}
    rng = np.random.default_rng(seed)
    model, ngram = x["model"], x["ngram"]
    model[rng.uniform(size=model.shape[:2]) < 0.1, 0] = rng.choice([0.0, 1.0])  # the confidence axis' ends
    model[rng.uniform(size=model.shape[:2]) < 0.1, 1] = 0.4  # a value on an edge
    model[rng.uniform(size=model.shape[:2]) < 0.05, 2] = np.inf
    ngram[rng.uniform(size=ngram.shape[:2]) < 0.1, 0] = 2.5
    ngram[rng.uniform(size=ngram.shape[:2]) < 0.05, 1] = -np.inf
    return x


def _same(a, b) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


@pytest.mark.parametrize("seed", range(6))
def test_the_compiled_lookup_reads_the_grid_bit_for_bit(monkeypatch, seed):
    assert lookup_kernel() is not None  # numba is installed: a kernel that stops compiling fails here, not silently
    tables = _tables(seed)
    for name, x in _inputs(seed).items():
        t = tables.chains[name]
        assert _same(layout.chain_lookup_host(t, x, name), _numpy_lookup(monkeypatch, t, x, name))


def test_the_compiled_lookup_reads_a_learnt_correction(monkeypatch):
    tables = _tables(3)
    online = OnlineTables(tables, OnlineSettings())
    rng = np.random.default_rng(0)
    for step in range(40):
        x = _inputs(100 + step)
        for name in ("model", "ngram"):
            t = tables.chains[name]
            fast, plain = layout.chain_lookup_host(t, x[name], name), _numpy_lookup(monkeypatch, t, x[name], name)
            np.testing.assert_array_max_ulp(np.nan_to_num(fast, nan=-1.0), np.nan_to_num(plain, nan=-1.0), maxulp=1)
            assert (np.isnan(fast) == np.isnan(plain)).all()
            # learn: the rounds' outcomes, every round in some context cell
            p = np.where(np.isnan(plain), np.nan, np.clip(plain, 0.01, 0.99)).astype(np.float64)
            acc = np.where(np.isnan(p), np.nan, (rng.uniform(size=p.shape) < 0.3).astype(np.float64))
            online.observe(name, p, acc, rng.integers(0, online.chains[name]["n_cells"], len(p)))
        online.refresh()
    assert all(c["correction"]._learnt for c in online.chains.values())


def test_a_confidence_outside_0_1_is_still_refused_by_name():
    tables = _tables(0)
    x = _inputs(0)["model"]
    x[2, 1, 0] = 1.5
    with pytest.raises(ValueError, match="model"):
        layout.chain_lookup_host(tables.chains["model"], x, "model")


def test_what_serving_remembers_of_a_step_is_its_cells_and_table_of(monkeypatch):
    """OnlineTables.remembered (one compiled call) gives the context cells and table_of of the rows served, NaN from
    each row's depth on, as the numpy path (cells, then table_of) does: before the correction learns and after."""
    tables = _tables(5)
    fast, plain = OnlineTables(tables, OnlineSettings()), OnlineTables(_tables(5), OnlineSettings())
    for c in plain.chains.values():
        c["correction"]._kernels = None
    rng = np.random.default_rng(3)
    for step in range(30):
        for name in ("model", "ngram"):
            B, W, A = 12, 5, len(fast.chains[name]["edges"])
            values = rng.normal(2.0, 3.0, (B, A))
            values[rng.uniform(size=values.shape) < 0.1] = np.nan
            values[rng.uniform(size=values.shape) < 0.05] = np.inf
            probs = rng.uniform(size=(B, W)).astype(np.float32)
            probs[rng.uniform(size=probs.shape) < 0.1] = rng.choice([0.0, 1.0, np.nan])
            depth = rng.integers(0, W + 1, B)
            rows = np.flatnonzero(rng.uniform(size=B) < 0.7)
            (cells, table), (want_cells, want) = (o.remembered(name, values, rows, probs, depth) for o in (fast, plain))
            np.testing.assert_array_equal(cells, want_cells)
            np.testing.assert_allclose(table, want, rtol=1e-12, atol=1e-15)  # NaN where NaN
            assert np.isnan(table[np.arange(W)[None, :] >= depth[rows][:, None]]).all()
            p = np.where(np.isnan(want), np.nan, np.clip(want, 0.01, 0.99))
            acc = np.where(np.isnan(p), np.nan, (rng.uniform(size=p.shape) < 0.4).astype(np.float64))
            for o in (fast, plain):
                o.observe(name, p, acc, want_cells)
                o.refresh()
    assert all(c["correction"]._learnt for c in fast.chains.values())
