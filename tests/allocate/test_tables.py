"""GridTables lookups: interpolation, bucketing, depth clamping, NaN = no token."""

from __future__ import annotations

import math

import pytest
import torch
from strategies import pair, two_chain_tables

from calib.allocate import AcceptanceTables, ChainTable, GridTables, allocate, allocate_probs

INF, NAN = float("inf"), float("nan")


def make_tables(reuse_last_row: bool = False) -> GridTables:
    model_grid = torch.tensor([[0.0, 0.5, 1.0], [0.2, 0.4, 0.6]])  # D = 2, G = 3
    edges = torch.tensor([[1.0, 3.0], [0.5, INF]])  # feature 0: 3 buckets, feature 1: 2 buckets
    strides = torch.tensor([1, 3])
    ngram_grid = torch.arange(12, dtype=torch.float32).reshape(2, 6) / 20  # D_ng = 2, 6 cells
    return two_chain_tables(model_grid, edges, strides, ngram_grid, reuse_last_row=reuse_last_row)


def test_protocol():
    assert isinstance(make_tables(), AcceptanceTables)


def test_model_lookup_interpolates():
    t = make_tables()
    conf = torch.tensor([[0.0, 0.5, 1.0], [0.25, 0.75, 1.0], [0.0, NAN, 0.75]])
    p = t.accept_prob("model", conf)
    # depth 0 uses row 0, depths 1 and 2 use row 1 (the last: the offline lookup reuses it).
    assert p[0].tolist() == pytest.approx([0.0, 0.4, 0.6])
    assert p[1].tolist() == pytest.approx([0.25, 0.5, 0.6])
    assert p[2, 0].item() == 0.0 and math.isnan(p[2, 1].item()) and p[2, 2].item() == pytest.approx(0.5)


def test_model_lookup_refuses_confidences_outside_0_1():
    # Before: clamped, so logits passed by mistake gave nonsense probabilities silently.
    t = make_tables()
    for bad in (2.0, -1.0, INF):
        with pytest.raises(ValueError, match=r"model\[1, 0\] = .*in \[0, 1\].*logits"):
            t.accept_prob("model", torch.tensor([[0.5, 0.5], [bad, NAN]]))


def test_ngram_lookup_buckets_cells_and_depths():
    t = make_tables()
    # (x0, x1) -> bucket0 = #{1, 3 <= x0}, bucket1 = #{0.5 <= x1}; cell = b0 + 3 * b1.
    feats = torch.tensor([[[0.0, 0.0], [1.0, 0.5], [5.0, 9.0]], [[NAN, 1.0], [2.0, NAN], [3.0, 0.4]]])
    p = t.accept_prob("ngram", feats)
    row0, row1 = t.chains["ngram"].grid[0], t.chains["ngram"].grid[1]
    assert p[0, 0].item() == row0[0].item()
    assert p[0, 1].item() == row1[1 + 3].item()
    assert p[0, 2].item() == row1[2 + 3].item()  # depth 2 >= D_ng reuses the last row
    assert math.isnan(p[1, 0].item())
    assert p[1, 1].item() == row1[1].item()  # NaN in a later feature falls in its bucket 0
    assert p[1, 2].item() == row1[2].item()


def test_bad_tables_are_rejected():
    t = make_tables()
    ng = t.chains["ngram"]
    with pytest.raises(ValueError, match="grid has 4 cells, the axes reach 5"):
        ChainTable(ng.axes, ng.grid[:, :4], ng.edges, ng.strides)
    with pytest.raises(ValueError, match="only axis 0"):
        ChainTable(ng.axes[:1] + t.chains["model"].axes, ng.grid, ng.edges, ng.strides)


def test_allocate_goes_through_the_tables():
    t = make_tables(reuse_last_row=True)  # K = 3 > D = 2: the tables say row 1 stands for depth 2
    conf = torch.tensor([[0.9, 0.8, NAN], [0.3, 0.95, 0.7]])
    feats = torch.tensor([[[4.0, 1.0], [4.0, 1.0]], [[0.0, 0.0], [NAN, 0.0]]])
    for mode in ({"budget": 3}, {"cost": 1 + 0.2 * torch.arange(12.0)}):
        direct = allocate(t, pair(conf, feats), **mode)
        via_probs = allocate_probs(pair(t.accept_prob("model", conf), t.accept_prob("ngram", feats)), **mode)
        assert torch.equal(direct.depth, via_probs.depth) and torch.equal(direct.drafter, via_probs.drafter)
