"""The online correction (calib/tables/online.py). Synthetic data, unit tests: labels drawn from known
probabilities so that the right answer is known."""

import numpy as np
import pytest

from calib.metrics import expected_accepted_length
from calib.tables.online import OnlineCorrection, OnlineSettings, replay_online, verified_mask


def _rounds(rng, n, k, p_true):
    """Rounds of ``k`` depths whose depth-d acceptance is Bernoulli(p_true[r, d]); NaN after the first
    rejection's depth + 1 (a chain is drafted whole, but only its verified prefix is labelled here)."""
    acc = (rng.uniform(size=(n, k)) < p_true).astype(np.float64)
    return acc


def test_cold_start_is_the_tables_alone():
    p = np.array([[0.2, 0.5, np.nan], [0.9, 0.7, 0.1]])
    corr = OnlineCorrection(3)
    assert np.array_equal(corr.apply(p, [0, 1]), p, equal_nan=True)
    assert np.array_equal(replay_online(p, np.ones_like(p), [0, 0])[0], p[0], equal_nan=True)


def test_only_verified_positions_count():
    acc = np.array([[1.0, 0.0, 0.0, np.nan], [0.0, 0.0, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0]])
    assert verified_mask(acc).tolist() == [[True, True, False, False], [True, False, False, False],
                                           [True, True, True, True]]
    corr = OnlineCorrection(4, OnlineSettings(decay=1.0))
    added = corr.update(np.full((3, 4), 0.5), acc, [0, 0, 0])
    st = corr.state()[0]
    assert added == 7
    assert st["n"] == [3.0, 2.0, 1.0, 1.0]  # the rejections after a first one are not counted
    # depth 1 saw one accept and one reject at p = 0.5: no evidence either way; depth 2 one accept
    assert st["offset"][1] == 0.0 and st["offset"][2] > 0.0


def test_a_calibrated_stream_leaves_the_tables_alone():
    rng = np.random.default_rng(0)
    p = rng.uniform(0.1, 0.9, size=(5000, 4))
    acc = _rounds(rng, 5000, 4, p)
    out = replay_online(p, acc, np.zeros(5000), OnlineSettings(decay=0.999, prior=50))
    assert np.abs(out[2000:] - p[2000:]).mean() < 0.03


def test_a_shifted_stream_is_followed():
    rng = np.random.default_rng(1)
    p = rng.uniform(0.3, 0.9, size=(4000, 4))
    shifted = 1 / (1 + np.exp(-(np.log(p / (1 - p)) - 1.2)))  # the workload accepts less than the tables say
    acc = _rounds(rng, 4000, 4, shifted)
    out = replay_online(p, acc, np.zeros(4000), OnlineSettings(decay=0.999, prior=50))
    actual = np.cumprod(acc == 1, axis=1).sum(axis=1)[1000:].mean()
    alone = expected_accepted_length(p[1000:]).mean()
    online = expected_accepted_length(out[1000:]).mean()
    assert abs(alone - actual) / actual > 0.5  # the tables alone are far off
    # the deeper depths see few positions (a round reaches them only after accepts), so they learn slowly
    assert abs(online - actual) / actual < 0.1
    assert abs(online - actual) < abs(alone - actual) / 5


def test_cells_are_kept_apart_and_it_can_be_switched_off():
    corr = OnlineCorrection(1, OnlineSettings(decay=1.0, prior=1.0, pooled=False))
    for _ in range(10):  # ten engine steps of ten rounds, every one rejected
        corr.update(np.full((10, 1), 0.5), np.zeros((10, 1)), np.zeros(10))
    assert corr.apply(np.array([[0.5]]), [0])[0, 0] < 0.05
    assert corr.apply(np.array([[0.5]]), [80])[0, 0] == 0.5  # another temperature: untouched
    assert "pooled" not in corr.state()


def _stream(rng, n, cells, shift_of_cell):
    """``n`` one-depth rounds in random ``cells``; the tables say 0.6 everywhere, the workload accepts at
    σ(logit 0.6 + shift of the round's cell)."""
    cell = rng.choice(cells, size=n)
    z = np.log(0.6 / 0.4) + np.array([shift_of_cell[c] for c in cell])
    acc = (rng.uniform(size=(n, 1)) < 1 / (1 + np.exp(-z[:, None]))).astype(np.float64)
    return np.full((n, 1), 0.6), acc, cell


def test_a_shift_every_cell_shares_reaches_a_thin_cell_through_the_pooled_level():
    rng = np.random.default_rng(2)
    shift = {c: -1.0 for c in range(8)}  # every cell accepts less than the tables say (σ(logit 0.6 − 1) = 0.36)
    p, acc, cell = _stream(rng, 3000, np.arange(7), shift)  # cell 7 is never seen
    for pooled in (True, False):
        out = replay_online(p, acc, cell, OnlineSettings(prior=50, pooled=pooled))
        assert abs(out[-500:, 0].mean() - 0.36) < 0.05  # the cells the stream visits follow it either way
        corr = OnlineCorrection(1, OnlineSettings(prior=50, pooled=pooled))
        for i in range(len(p)):
            corr.update(p[i:i + 1], acc[i:i + 1], cell[i:i + 1])
        thin = corr.apply(np.array([[0.6]]), [7])[0, 0]
        if pooled:
            assert abs(thin - 0.36) < 0.05  # the shared shift, learnt from every position
        else:
            assert thin == 0.6  # kept apart: a cell that saw nothing is the table
    assert set(corr.state()) == set(range(7))


def test_a_cell_that_differs_learns_its_own_residual_under_the_pooled_level():
    rng = np.random.default_rng(3)
    p, acc, cell = _stream(rng, 6000, np.arange(2), {0: -1.0, 1: 1.0})  # opposite shifts: pooled ≈ 0
    # a memory (1 / (1 − λ) = 1,000 positions) long against the prior: the residual is learnt whole (with
    # the default 100 the prior's 50 pseudo-positions keep a third of it at the pooled level)
    corr = OnlineCorrection(1, OnlineSettings(decay=0.999, prior=50))
    for i in range(len(p)):
        corr.update(p[i:i + 1], acc[i:i + 1], cell[i:i + 1])
    truth = {0: 1 / (1 + np.exp(-(np.log(1.5) - 1))), 1: 1 / (1 + np.exp(-(np.log(1.5) + 1)))}
    for c, t in truth.items():
        assert abs(corr.apply(np.array([[0.6]]), [c])[0, 0] - t) < 0.05
    st = corr.state()
    assert abs(st["pooled"]["offset"][0]) < 0.5 and st["pooled"]["n"][0] == 6000
    off = OnlineCorrection(1, OnlineSettings(enabled=False))
    assert off.update(np.full((5, 1), 0.5), np.zeros((5, 1)), np.zeros(5)) == 0
    assert off.apply(np.array([[0.5]]), [0])[0, 0] == 0.5


@pytest.mark.parametrize("kw", [{"decay": 0.0}, {"decay": 1.5}, {"prior": 0.0}, {"prior": float("inf")}])
def test_bad_settings_are_refused(kw):
    with pytest.raises(ValueError, match="online"):
        OnlineSettings(**kw)


def _overconfident(rng, n, k=3, slope=0.4, shift=-0.3):
    """SYNTHETIC rounds of ``k`` depths whose tables are too sure of themselves: each depth accepts at
    σ(slope·logit p + shift) of the table's ``p``, and a round's depths go together (one logit per round,
    as a long n-gram match makes every depth likely). Every depth's mean can be matched by an offset; the
    spread only by a slope, and with depths that go together the expected length needs the spread."""
    z = rng.uniform(-3, 3, size=(n, 1)) + rng.normal(0, 0.3, size=(n, k))
    p = 1 / (1 + np.exp(-z))
    acc = (rng.uniform(size=(n, k)) < 1 / (1 + np.exp(-(slope * z + shift)))).astype(np.float64)
    return p, acc


def test_a_table_too_sure_of_itself_is_flattened_by_the_slope():
    rng = np.random.default_rng(4)
    p, acc = _overconfident(rng, 6000)
    actual = np.cumprod(acc == 1, axis=1).sum(axis=1)[2000:].mean()
    errors = {}
    for slope in (True, False):
        settings = OnlineSettings(decay=0.999, prior=50, slope=slope)
        out = replay_online(p, acc, np.zeros(len(p)), settings)
        errors[slope] = abs(expected_accepted_length(out[2000:]).mean() - actual) / actual
        corr = OnlineCorrection(3, settings)
        for s in range(0, len(p), 10):  # the same stream, ten rounds an update
            corr.update(p[s:s + 10], acc[s:s + 10], np.zeros(10))
        st = corr.state()["pooled"]
        if slope:
            assert abs(st["slope"][0] - (0.4 - 1)) < 0.15  # β learns the table's spread: 1 + β ≈ 0.4
        else:
            assert "slope" not in st
    assert errors[True] < 0.03 and errors[False] > 0.1  # an offset alone matches the means, not the length


def test_table_of_reads_back_the_table_behind_what_was_served():
    rng = np.random.default_rng(5)
    p, acc = _overconfident(rng, 500)
    cells = rng.integers(0, 3, size=len(p))
    corr = OnlineCorrection(3, OnlineSettings())
    corr.update(p, acc, cells)
    assert corr.state()["pooled"]["slope"][0] != 0.0
    q = np.where(rng.uniform(size=p.shape) < 0.1, np.nan, p)  # no token there: NaN stays NaN
    served = corr.apply(q, cells)
    assert not np.allclose(served, q, equal_nan=True)
    np.testing.assert_allclose(corr.table_of(served, cells), q, rtol=1e-9, atol=1e-12)


def test_the_slope_flattens_the_table_but_never_reverses_its_order():
    from calib.tables.online import MIN_SCALE

    rng = np.random.default_rng(6)
    p = rng.uniform(0.05, 0.95, size=(4000, 1))
    acc = (rng.uniform(size=p.shape) < 1 - p).astype(np.float64)  # SYNTHETIC: the workload accepts the opposite
    corr = OnlineCorrection(1, OnlineSettings(prior=4))
    for s in range(0, len(p), 20):
        corr.update(p[s:s + 20], acc[s:s + 20], np.zeros(20))
    assert corr.state()["pooled"]["slope"][0] == pytest.approx(MIN_SCALE - 1)  # the floor, not below it
    grid = np.linspace(0.05, 0.95, 19)[:, None]
    assert (np.diff(corr.apply(grid, np.zeros(19))[:, 0]) > 0).all()
