"""The online correction's compiled update (calib/tables/online_compiled.py) against its numpy update. SYNTHETIC
data: the seeded stream of tests/tables/test_online_kernels.py (NaN, 0, 1, ±inf mixed in). Not bit for bit: numba's
scalar ``exp``/``log`` round differently from numpy's vector loops on some CPUs, in the last bit of a few percent of
values (measured here: 4.6 % of a million ``exp``), so the states agree to float64 rounding, and the positions
each update counts exactly."""

from importlib.util import find_spec

import numpy as np
import pytest

from calib.tables.online import OnlineCorrection, OnlineSettings
from calib.tables.online_compiled import kernels
from calib.tables.online_kernels import cut, edge_grid
from tests.tables.test_online_kernels import _outcomes, _probs

# numba is imported by the tests, never at collection (its modules in sys.modules upset vLLM's kernel rebinding)
pytestmark = pytest.mark.skipif(find_spec("numba") is None, reason="numba is not installed: the numpy versions run")

SETTINGS = [OnlineSettings(), OnlineSettings(decay=0.9, prior=4.0), OnlineSettings(slope=False),
            OnlineSettings(pooled=False), OnlineSettings(decay=1.0, prior=1.0)]


def _levels(state: dict) -> np.ndarray:
    """Every number of a :meth:`OnlineCorrection.state`, in key order."""
    return np.array([v for key in sorted(state, key=str) for name in sorted(state[key])
                     for v in np.atleast_1d(state[key][name])], dtype=np.float64)


@pytest.mark.parametrize("settings", SETTINGS)
def test_the_compiled_update_learns_what_the_numpy_update_learns(settings):
    rng = np.random.default_rng(11)
    D = 4
    fast, plain = OnlineCorrection(D, settings, compiled=True), OnlineCorrection(D, settings, compiled=False)
    for step in range(300):
        B = int(rng.integers(1, 40))
        K = int(rng.integers(1, 7))  # past the tracked depths too
        cells = (np.full(B, rng.integers(0, 5)) if step % 3 == 0 else rng.integers(0, 12 if step % 3 == 1 else 200, B))
        p, acc = _probs(rng, (B, K)), _outcomes(rng, (B, K))
        assert fast.update(p, acc, cells) == plain.update(p, acc, cells)
        served = rng.integers(-2, 250, B)  # a negative id reads the pooled level, as numpy's unsigned view does
        np.testing.assert_allclose(fast.apply(p, served), plain.apply(p, served), rtol=1e-9, atol=1e-12)
        back = fast.table_of(p, served)  # compiled once something is learnt
        np.testing.assert_allclose(back, plain.table_of(p, served), rtol=1e-9, atol=1e-12)
        assert (np.isnan(back) == np.isnan(p)).all()
    assert fast.state().keys() == plain.state().keys()
    np.testing.assert_allclose(_levels(fast.state()), _levels(plain.state()), rtol=1e-9, atol=1e-12)
    assert plain.state()  # the stream taught something


@pytest.mark.parametrize("settings", SETTINGS[:4])
def test_a_steps_remembered_rounds_teach_what_their_outcome_rows_teach(settings):
    """update_rounds (serving's refresh: the outcomes built in the compiled loops, or by outcome_rows without numba)
    learns what update learns from the same rounds' table rows, outcome rows and cells."""
    from calib.tables.online import outcome_rows

    rng = np.random.default_rng(5)
    D = 3
    fused = OnlineCorrection(D, settings, compiled=True)
    plain = OnlineCorrection(D, settings, compiled=False)
    rows_of = OnlineCorrection(D, settings, compiled=False)  # update_rounds' numpy path
    for step in range(200):
        N, W = int(rng.integers(1, 20)), int(rng.integers(1, 6))  # past the tracked depths too
        depth = rng.integers(1, W + 1, N)
        table = _probs(rng, (N, W))
        table[np.arange(W)[None, :] >= depth[:, None]] = np.nan  # a round ends at its depth
        cells = rng.integers(0, 3 if step % 2 else 60, N)  # grown past the cells held, now and then
        rows = np.sort(rng.choice(N, int(rng.integers(1, N + 1)), replace=False))
        accepted = rng.integers(0, depth[rows] + 1)
        width = int(depth[rows].max())
        want = plain.update(table[rows, :width], outcome_rows(accepted, depth[rows], width), cells[rows])
        assert fused.update_rounds(table, rows, accepted, depth, cells) == want
        assert rows_of.update_rounds(table, rows, accepted, depth, cells) == want
    for got in (fused, rows_of):
        assert got.state().keys() == plain.state().keys()
        np.testing.assert_allclose(_levels(got.state()), _levels(plain.state()), rtol=1e-9, atol=1e-12)
    assert plain.state()["pooled" if settings.pooled else 0]  # the stream taught something


def test_an_update_that_sees_nothing_leaves_the_tables_alone():
    corr = OnlineCorrection(3, compiled=True)
    p = np.full((2, 3), 0.5)
    assert corr.update(p, np.full((2, 3), np.nan), [0, 1]) == 0  # nothing drafted
    assert corr.update(np.array([[0.0, 1.0, np.nan]] * 2), np.ones((2, 3)), [0, 1]) == 0  # certainties only
    assert corr.apply(p, [0, 1]) is not None and (corr.apply(p, [0, 1]) == p).all() and not corr.state()["pooled"]["n"][0]


def test_a_negative_cell_is_refused_before_anything_is_learnt():
    corr = OnlineCorrection(2, compiled=True)
    with pytest.raises(ValueError, match="negative"):
        corr.update(np.full((2, 2), 0.5), np.ones((2, 2)), [0, -1])
    assert not any(corr.state()["pooled"]["n"])


@pytest.mark.parametrize("edges", [[[0.5]], [[0.0, 2.0], [0.4]], [[-1.0, 0.0, 1.0, 3.0], [0.4], [2.0, 8.0]]])
def test_the_compiled_cut_gives_numpys_cells(edges):
    rng = np.random.default_rng(len(edges))
    values = rng.normal(0, 3, size=(500, len(edges)))
    values[rng.uniform(size=values.shape) < 0.05] = np.nan
    values[rng.uniform(size=values.shape) < 0.03] = np.inf
    values[rng.uniform(size=values.shape) < 0.03] = -np.inf
    flat = np.array([e for axis in edges for e in axis])
    values[rng.uniform(size=values.shape) < 0.1] = rng.choice(flat)  # on an edge
    grid, strides = edge_grid(edges)
    assert np.array_equal(kernels()["cut_loops"](values, grid, strides), cut(values, grid, strides))
