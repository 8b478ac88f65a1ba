"""Multi-axis cells (issue 13 item 2): the model chain's interpolated confidence plus binned context axes
(temperature, previous accepted length), the n-gram chain's match features plus the same context.
The torch reference and the Triton kernel (interpreter, small cases) look the cells up identically:
bit-identical probabilities and decisions."""

from __future__ import annotations

import torch

from calib.allocate import allocate
from calib.chains import Axis
from calib.tables.layout import ChainTable, GridTables

NAN = float("nan")


def _tables(seed: int = 0) -> GridTables:
    g = torch.Generator().manual_seed(seed)
    G, D = 9, 3
    # model: conf (G points) x temperature (2 bins) x prev_accept (3 bins) -> 6 blocks of G columns
    m_axes = (Axis("conf", points=G), Axis("temperature", edges=(0.4,)), Axis("prev_accept", edges=(0.0, 2.0)))
    m_grid = torch.rand(D, 6 * G, generator=g).sort(dim=1).values  # any values; sorted keeps it tidy
    m_edges = torch.tensor([[0.4, float("inf")], [0.0, 2.0]])
    m_strides = torch.tensor([3 * G, G])
    # n-gram: match_n (3 bins) x temperature (2 bins)
    n_axes = (Axis("match_n", edges=(1.5, 2.5)), Axis("temperature", edges=(0.4,)))
    n_grid = torch.rand(D, 6, generator=g)
    n_edges = torch.tensor([[1.5, 2.5], [0.4, float("inf")]])
    n_strides = torch.tensor([1, 3])
    return GridTables({"model": ChainTable.build(m_axes, m_grid, m_edges, m_strides),
                       "ngram": ChainTable.build(n_axes, n_grid, n_edges, n_strides)})


def _signals(B: int, K: int, L: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    temp = torch.where(torch.rand(B, generator=g) < 0.5, 0.0, 0.8)  # per request [B]
    prev = torch.randint(-1, 5, (B,), generator=g).float()
    prev[prev < 0] = NAN  # a request's first round: own bucket 0
    conf = torch.rand(B, K, generator=g)
    conf[torch.rand(B, K, generator=g) < 0.15] = NAN
    # model x [B, K, 3]: conf per depth, then the request's context repeated over depths
    model = torch.stack([conf, temp[:, None].expand(B, K), prev[:, None].expand(B, K)], dim=2)
    match = torch.randint(1, 5, (B, 1), generator=g).float().expand(B, L).clone()
    match[torch.rand(B, generator=g) < 0.3] = NAN
    ngram = torch.stack([match, temp[:, None].expand(B, L)], dim=2)  # [B, L, 2]
    return {"model": model, "ngram": ngram}


def test_reference_reads_the_context_cell():
    t = _tables()
    x = torch.tensor([[[0.5, 0.8, 3.0]], [[0.5, 0.0, NAN]]])  # [B=2, K=1, A=3]
    p = t.accept_prob("model", x)
    G = 9
    grid = t.chains["model"].grid
    # T=0.8 -> bucket 1, prev 3 -> bucket 2: block 1*3 + 2; T=0 -> 0, NaN -> 0: block 0; conf 0.5 = point 4
    assert p[0, 0].item() == grid[0, 5 * G + 4].item()
    assert p[1, 0].item() == grid[0, 0 * G + 4].item()


def test_reference_and_kernel_agree_on_multi_axis_cells():
    t = _tables(1)
    for seed, (B, K, L, budget) in enumerate([(5, 3, 2, 4), (8, 2, 3, 7), (3, 3, 3, 20)]):
        s = _signals(B, K, L, seed)
        for sig in (s, {"model": s["model"]}):
            ref = allocate(t, sig, budget=budget, impl="reference")
            tri = allocate(t, sig, budget=budget, impl="triton")
            assert torch.equal(ref.drafter, tri.drafter) and torch.equal(ref.depth, tri.depth)
            assert torch.equal(ref.expected_accepted, tri.expected_accepted)
        cost = torch.linspace(1.0, 3.0, B + 2 * K * B + 1)
        ref = allocate(t, s, cost=cost, impl="reference")
        tri = allocate(t, s, cost=cost, impl="triton")
        assert torch.equal(ref.drafter, tri.drafter) and torch.equal(ref.depth, tri.depth)
        assert torch.equal(ref.expected_accepted, tri.expected_accepted)
