"""Distinct-expert models on hand-computable cases (SYNTHETIC routing, not captured data), and IPF."""

import numpy as np
import pytest

from calib.cost.distinct import IndependentNonUniform, MaxEntPairwise, UniformCoupon, ipf_chain
from calib.cost.trajectories import Trajectories, one_hot


def _traj(seqs_ids, n_experts):
    """SYNTHETIC trajectories from expert ids [P, layers, k] per sequence."""
    seqs = [one_hot(np.asarray(s, dtype=np.uint8), n_experts) for s in seqs_ids]
    k = np.asarray(seqs_ids[0]).shape[2]
    return Trajectories(seqs, np.array(["synthetic"] * len(seqs), dtype=object), np.arange(len(seqs)), n_experts, k)


def _uniform_routing(n_seq, length, layers, n_experts, k, seed=0):
    rng = np.random.default_rng(seed)
    return [np.argsort(rng.random((length, layers, n_experts)), axis=2)[..., :k] for _ in range(n_seq)]


def coupon(E, k, n):
    return E * (1 - (1 - k / E) ** n)


def test_uniform_model_is_the_coupon_collector():
    m = UniformCoupon(n_experts=16, top_k=2, layers=3).fit()
    for shape in ([1], [4], [1, 1, 1], [2, 3, 5]):
        np.testing.assert_allclose(m.predict(shape), coupon(16, 2, sum(shape)), rtol=1e-12)


def test_independent_uniform_routing_recovers_the_coupon_curve():
    tr = _traj(_uniform_routing(40, 200, 2, 8, 2), 8)
    for model in (IndependentNonUniform().fit(tr), MaxEntPairwise(max_chain=6).fit(tr)):
        for n in (1, 2, 4, 6):
            np.testing.assert_allclose(model.predict([n]), coupon(8, 2, n), rtol=0.03)
            np.testing.assert_allclose(model.predict([1] * n), coupon(8, 2, n), rtol=0.03)


def test_repeated_routing_gives_k_distinct_experts_per_sequence():
    rng = np.random.default_rng(1)
    # Each sequence repeats one fixed set of k = 2 experts at every position (per layer).
    seqs = []
    for _ in range(30):
        fixed = np.argsort(rng.random((1, 2, 8)), axis=2)[..., :2]
        seqs.append(np.repeat(fixed, 50, axis=0))
    tr = _traj(seqs, 8)
    me = MaxEntPairwise(max_chain=6).fit(tr)
    for n in (1, 3, 6, 12):  # 12 > max_chain: the extrapolation keeps it at k
        np.testing.assert_allclose(me.predict([n]), 2.0, atol=1e-3)
    # Two sequences: independent draws of 2 sets each.
    pi = tr.marginals()
    np.testing.assert_allclose(me.predict([3, 3]), (1 - (1 - pi) ** 2).sum(-1), atol=1e-3)
    # The independence model misses the repetition: it predicts more than k.
    assert np.all(IndependentNonUniform().fit(tr).predict([4]) > 3.0)


def test_predict_counts_matches_predict():
    tr = _traj(_uniform_routing(10, 30, 2, 8, 2, seed=3), 8)
    for model in (UniformCoupon().fit(tr), IndependentNonUniform().fit(tr), MaxEntPairwise(max_chain=4).fit(tr)):
        shapes = [[1, 2], [3], [1, 1, 4], [5, 5]]
        counts = np.zeros((len(shapes), 6))
        for s, shape in enumerate(shapes):
            for d in shape:
                counts[s, d] += 1
        np.testing.assert_allclose(model.predict_counts(counts), np.stack([model.predict(s) for s in shapes]),
                                   rtol=1e-10)


def test_ipf_two_positions_is_the_2x2_table():
    table, _, err = ipf_chain(np.array([0.3]), np.array([[0.2]]), 2)
    # bit i = position i: state 0 = 00, 1 = x0 only, 2 = x1 only, 3 = both.
    np.testing.assert_allclose(table[0], [1 - 0.6 + 0.2, 0.1, 0.1, 0.2], atol=1e-8)
    assert err < 1e-8


@pytest.mark.parametrize("d", [3, 5])
def test_ipf_converges_to_the_constraints_of_a_markov_chain(d):
    # A stationary binary Markov chain: its marginals and pair rates by distance are feasible, and
    # with nearest-neighbour constraints alone the chain itself is the max-entropy answer.
    pi, stay1 = 0.25, 0.7  # P(1) and P(1 | 1)
    stay0 = 1 - pi * (1 - stay1) / (1 - pi)  # keeps pi stationary
    P = np.array([[stay0, 1 - stay0], [1 - stay1, stay1]])
    rates = [pi * np.linalg.matrix_power(P, delta)[1, 1] for delta in range(1, d)]
    table, sweeps, err = ipf_chain(np.array([pi]), np.array([rates]), d, max_iter=500, tol=1e-10)
    assert err < 1e-9 and sweeps < 500
    states = np.arange(1 << d)
    bits = (states[:, None] >> np.arange(d)) & 1
    for i in range(d):
        np.testing.assert_allclose(table[0] @ bits[:, i], pi, atol=1e-8)
        for j in range(i + 1, d):
            np.testing.assert_allclose(table[0] @ (bits[:, i] & bits[:, j]), rates[j - i - 1], atol=1e-8)
    # All-absent probability of the chain = (1 - pi) stay0^(d-1): the Markov chain satisfies every
    # constraint and IPF's answer must match it on them; for this family it is also the answer.
    np.testing.assert_allclose(table[0, 0], (1 - pi) * stay0 ** (d - 1), rtol=1e-3)
