"""A third chain kind needs one registration and nothing else (issue 13 item 1).

A SYNTHETIC ``suffix`` chain (vLLM 0.32 ships suffix decoding; here its per-depth score is a random
column of a synthetic bank, with the verified chain's accept mask as its labels) is registered in this
file only, then trained by train.py's job, exported, loaded, looked up, allocated (reference and Triton
kernel, bit-identical) and replayed. The collector hook that would write its column is what a real
chain adds besides; a test chain does not need one.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from calib.bank import schema, write_bank
from calib.chains import (
    Axis,
    ChainKind,
    RoundData,
    chain,
    chain_names,
    chains,
    register_chain,
    unregister_chain,
)
from calib.labels import per_depth_samples
from tests.synthetic import synthetic_tables

CONF = str(Path(__file__).resolve().parents[1] / "conf")
SCORE = "suffix_score"  # per-depth column {SCORE}{k} of speculator.parquet (SYNTHETIC)
EDGES = (0.25, 0.5, 0.75)


def suffix_samples(bank):
    t = bank.rounds()
    if f"{SCORE}0" not in t.column_names:
        import pandas as pd

        return pd.DataFrame()
    width = schema.width(t.column_names)
    return per_depth_samples(t, schema.depth_matrix(t, schema.ACC, width),
                             {SCORE: schema.depth_matrix(t, SCORE, width)}, {})


def suffix_depth(bank_dir) -> int:
    import pyarrow.parquet as pq

    return schema.width(pq.read_schema(Path(bank_dir) / schema.SPECULATOR).names, SCORE)


def suffix_round_data(rounds, axis_names):
    if f"{SCORE}0" not in rounds.column_names:
        return None
    width = schema.width(rounds.column_names)
    score = schema.depth_matrix(rounds, SCORE, width)
    inputs = None if axis_names is None else score.astype(np.float32)[..., None]
    return RoundData(schema.depth_matrix(rounds, schema.ACC, width), inputs)


SUFFIX = ChainKind(id=3, name="suffix", samples=suffix_samples, feature_names=lambda cfg: (SCORE,),
                   table_axes=lambda cfg: (Axis(SCORE, edges=EDGES),), drafted_depth=suffix_depth,
                   round_data=suffix_round_data, description="SYNTHETIC test chain: suffix decoding's per-depth score")


@pytest.fixture
def suffix_chain():
    register_chain(SUFFIX)
    try:
        yield SUFFIX
    finally:
        unregister_chain(SUFFIX.name)


def _bank(tmp_path):
    """A synthetic bank whose speculator.parquet also carries the suffix chain's score; acceptance
    rises with it, so a calibrated table is increasing in the score."""
    acceptance, speculator, ngram = synthetic_tables(n_prompts=40, rounds_per_prompt=30)
    rng = np.random.default_rng(3)
    width = schema.width(acceptance.column_names)
    for k in range(width):
        acc = np.array(acceptance.column(f"acc{k}").to_pylist(), dtype=object)
        score = [None if a is None else float(np.clip(0.6 * a + 0.4 * rng.uniform(), 0, 1)) for a in acc]
        speculator = speculator.append_column(pa.field(f"{SCORE}{k}", pa.float64()), pa.array(score, pa.float64()))
    return write_bank(tmp_path / "bank", acceptance, speculator, ngram)


def test_registry_ids_and_names():
    assert [(c.id, c.name) for c in chains()][:2] == [(1, "model"), (2, "ngram")]
    assert chain(1) is chain("model") and chain("ngram").config == "ngram_model"
    with pytest.raises(ValueError, match="already registered"):
        register_chain(chain("model"))
    with pytest.raises(ValueError, match="id 1 is taken by 'model'"):
        register_chain(ChainKind(id=1, name="other", samples=None, feature_names=None, table_axes=None,
                                 drafted_depth=None))
    with pytest.raises(KeyError, match="no chain kind 'suffix'"):
        chain("suffix")


def test_a_third_chain_is_one_registration(tmp_path, suffix_chain):
    from calib.allocate import allocate, allocate_probs
    from calib.cost import make_curve
    from calib.evaluate.data import load_eval_bank
    from calib.evaluate.replay import ReplayConfig, replay
    from calib.tables import load
    from calib.training import run

    assert chain_names() == ("model", "ngram", "suffix")
    bank = _bank(tmp_path)
    with initialize_config_dir(CONF, version_base="1.3"):
        cfg = compose("train", overrides=[f"data.train=[{bank}]", f"out_dir={tmp_path / 'out'}", "logger=none",
                                          "calibrator=isotonic", "ngram_model=logistic", "trainer.progress=false"])
    cfg = OmegaConf.to_container(cfg, resolve=True)
    # The chain's config group: its candidate estimators (any estimator of the one protocol).
    cfg["suffix"] = {"candidates": {"histogram": {"_target_": "calib.calibrators.binning.HistogramBinning",
                                                  "min_samples": 20}}}

    # train -> export -> load
    tables = load(run(cfg))
    entry = tables.meta["chains"]["suffix"]
    assert entry["id"] == 3 and entry["estimator"] == "histogram" and entry["k"] == 4
    assert entry["axes"] == [{"name": SCORE, "kind": "bins", "edges": list(EDGES)}]
    assert tables.feature_names("suffix") == [SCORE]
    assert "suffix drafter: selected histogram" in (tmp_path / "out" / "summary.txt").read_text()
    grid = tables.chains["suffix"].grid
    assert grid.shape == (4, len(EDGES) + 1) and (grid[0].diff() > 0).all()  # acceptance rises with the score

    # look up: a score in bucket b at depth d reads grid[d, b]; NaN = no token
    x = torch.tensor([[[0.1], [0.6], [float("nan")]], [[0.9], [0.3], [0.8]]])
    p = tables.accept_prob("suffix", x)
    assert p[0, 0] == grid[0, 0] and p[0, 1] == grid[1, 2] and torch.isnan(p[0, 2]) and p[1, 2] == grid[2, 3]
    assert tables.accept_prob("suffix", torch.tensor([[0.6]]), depth=1)[0] == grid[1, 2]

    # allocate: the suffix chain against the model chain, ids from the registry, kernel == reference
    torch.manual_seed(0)
    # the model chain's table: confidence, then its context axes (conf/context: the request's temperature,
    # and the optional ones validation NLL kept)
    names = tables.feature_names("model")
    assert names[:2] == ["conf", "temperature"]
    conf = torch.stack([torch.rand(6, 4), *(torch.zeros(6, 4) for _ in names[1:])], dim=2)  # [B, K, A]
    score = torch.rand(6, 4, 1)
    score[:2, 2:] = float("nan")
    if os.environ.get("TRITON_INTERPRET") == "1" or torch.cuda.is_available():
        impls = ("reference", "triton")
    else:
        impls = ("reference",)  # the kernel on CPU needs the interpreter set before triton is imported
    for mode in ({"budget": 9}, {"cost": 1.0 + 0.05 * torch.arange(40.0)}):
        outs = [allocate(tables, {"suffix": score, "model": conf}, impl=impl, **mode) for impl in impls]
        assert set(outs[0].drafter.tolist()) <= {0, 1, 3} and 3 in outs[0].drafter.tolist()
        for other in outs[1:]:
            assert torch.equal(outs[0].drafter, other.drafter) and torch.equal(outs[0].depth, other.depth)
            assert torch.equal(outs[0].expected_accepted, other.expected_accepted)
        probs = allocate_probs({"model": tables.accept_prob("model", conf),
                                "suffix": tables.accept_prob("suffix", score)}, **mode)
        assert torch.equal(probs.drafter, outs[0].drafter) and torch.equal(probs.depth, outs[0].depth)

    # evaluate + replay: the bank read as eval.py reads it has the suffix chain, calibrated by its table;
    # replayed as the second chain beside the model chain
    with pytest.warns(UserWarning):  # the synthetic bank's manifest records no model/speculator
        eb = load_eval_bank(bank, tables)
    assert list(eb.chains) == ["model", "ngram", "suffix"] and eb.primary == "model"
    suffix = eb.chains.pop("suffix")
    drafted = ~np.isnan(suffix.acc)
    assert np.isfinite(suffix.p_cal[drafted]).all() and np.isnan(suffix.p_cal[~drafted]).all()
    eb.chains = {"model": eb.chains["model"], "suffix": suffix}
    eb.split[:] = "test"
    rcfg = ReplayConfig(batch_sizes=[4], policies=["no_spec", "two_drafter", "oracle"], min_steps=4, max_steps=4,
                        draft_cost={"model": 0.1, "suffix": 0.0})
    curve = make_curve("parametric", {"kind": "parametric", "weight_read": 1.0, "per_position": 0.01}, 64)
    rows = replay([eb], {"parametric": curve}, rcfg, progress=False)
    shares = [r["ngram_share"] for r in rows if r["policy"] == "two_drafter" and r["category"] != "all"]
    assert shares and max(shares) > 0  # requests verifying the second chain, here the suffix chain
