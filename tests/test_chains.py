"""A third chain kind needs one registration and one file (issue 13 item 1, issue 26 Must 2).

The SYNTHETIC ``suffix`` chain of ``tests/synthetic_suffix.py`` (vLLM ships suffix decoding; here its
score is written beside a synthetic bank, with the verified chain's accept mask as its labels) is
registered here only, then read from the bank (its own bank file, joined by ``Bank.rounds``), checked
against tables (``check_bank``), trained by train.py's job, exported, loaded, looked up, allocated
(reference and Triton kernel, bit-identical), replayed and decided on at a serving step
(``decide_step`` and ``SafeDecider`` with an offers mapping). The collector hook that would write its
file is what a real chain adds besides; a test chain does not need one.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from calib.bank import load as load_bank
from calib.bank import write_bank
from calib.chains import ChainKind, Offer, chain, chain_names, chains, register_chain, unregister_chain
from tests.synthetic import synthetic_tables
from tests.synthetic_suffix import BANK_FILE, EDGES, PREFIX, SCORE, SUFFIX, add_to_bank

CONF = str(Path(__file__).resolve().parents[1] / "conf")


@pytest.fixture
def suffix_chain():
    register_chain(SUFFIX)  # the one registration
    try:
        yield SUFFIX
    finally:
        unregister_chain(SUFFIX.name)


def _bank(tmp_path):
    """A SYNTHETIC bank with the suffix chain's file beside it; acceptance rises with its score."""
    acceptance, speculator, ngram = synthetic_tables(n_prompts=40, rounds_per_prompt=30)
    return add_to_bank(write_bank(tmp_path / "bank", acceptance, speculator, ngram))


def test_registry_ids_and_names():
    assert [(c.id, c.name) for c in chains()][:3] == [(1, "model"), (2, "ngram"), (3, "suffix")]
    assert chain(1) is chain("model") and chain("ngram").config == "ngram_model"
    with pytest.raises(ValueError, match="already registered"):
        register_chain(chain("model"))
    with pytest.raises(ValueError, match="id 1 is taken by 'model'"):
        register_chain(ChainKind(id=1, name="other", samples=None, feature_names=None, table_axes=None,
                                 drafted_depth=None))
    with pytest.raises(KeyError, match="no chain kind 'synthetic_suffix'"):
        chain("synthetic_suffix")


def test_a_third_chain_is_one_registration(tmp_path, suffix_chain):
    from calib.allocate import allocate, allocate_probs
    from calib.cost import make_curve
    from calib.evaluate.data import load_eval_bank
    from calib.evaluate.replay import ReplayConfig, replay
    from calib.tables import load
    from calib.training import run

    assert chain_names() == ("model", "ngram", "suffix", "synthetic_suffix")
    bank = _bank(tmp_path)
    # bank: the chain's own file is joined (prefixed) when the chain is asked for, and only then
    assert f"{PREFIX}{SCORE}" in load_bank(bank).rounds(chains=[SUFFIX]).column_names
    assert f"{PREFIX}{SCORE}" in load_bank(bank).rounds(chains=chains()).column_names
    assert f"{PREFIX}{SCORE}" not in load_bank(bank).rounds().column_names
    with initialize_config_dir(CONF, version_base="1.3"):
        cfg = compose("train", overrides=[f"data.train=[{bank}]", f"out_dir={tmp_path / 'out'}", "logger=none",
                                          "calibrator=isotonic", "ngram_model=logistic", "trainer.progress=false"])
    cfg = OmegaConf.to_container(cfg, resolve=True)
    # The chain's config group: its candidate estimators (any estimator of the one protocol).
    cfg["synthetic_suffix"] = {"candidates": {"histogram": {"_target_": "calib.calibrators.binning.HistogramBinning",
                                                  "min_samples": 20}}}

    # train -> export -> load
    tables = load(run(cfg))
    entry = tables.meta["chains"]["synthetic_suffix"]
    assert entry["id"] == 9 and entry["estimator"] == "histogram" and entry["k"] == 4
    assert entry["axes"] == [{"name": SCORE, "kind": "bins", "edges": list(EDGES)}]
    assert tables.feature_names("synthetic_suffix") == [SCORE]
    # one candidate and no baseline: it is the baseline, chosen at every depth
    assert entry["choice"] == {str(d): "histogram" for d in range(entry["depths"])}
    assert ("synthetic_suffix drafter: chosen per depth by 5-fold CV grouped by prompt (one_se rule, baseline histogram): "
            "d0 histogram") in (tmp_path / "out" / "summary.txt").read_text()
    # check_bank reads the chain's own bank file: a bank whose suffix.parquet lacks the score is refused
    import shutil

    import pyarrow.parquet as pq

    from calib.tables import TablesError

    with pytest.warns(UserWarning):  # the synthetic bank's manifest records no model/speculator
        tables.check_bank(bank)
    broken = Path(shutil.copytree(bank, tmp_path / "broken"))
    pq.write_table(pq.read_table(broken / BANK_FILE).drop([SCORE]), broken / BANK_FILE)
    with pytest.raises(TablesError, match=rf"synthetic_suffix features: .* read \['{SCORE}'\], bank .*{BANK_FILE} lacks"):
        tables.check_bank(broken)
    grid = tables.chains["synthetic_suffix"].grid
    assert grid.shape == (4, len(EDGES) + 1) and (grid[0].diff() >= 0).all() and grid[0, -1] > grid[0, 0]  # rises

    # look up: a score in bucket b at depth d reads grid[d, b]; NaN = no token
    x = torch.tensor([[[0.1], [0.6], [float("nan")]], [[0.9], [0.3], [0.8]]])
    p = tables.accept_prob("synthetic_suffix", x)
    assert p[0, 0] == grid[0, 0] and p[0, 1] == grid[1, 2] and torch.isnan(p[0, 2]) and p[1, 2] == grid[2, 3]
    assert tables.accept_prob("synthetic_suffix", torch.tensor([[0.6]]), depth=1)[0] == grid[1, 2]

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
        outs = [allocate(tables, {"synthetic_suffix": score, "model": conf}, impl=impl, **mode) for impl in impls]
        assert set(outs[0].drafter.tolist()) <= {0, 1, 9} and 9 in outs[0].drafter.tolist()
        for other in outs[1:]:
            assert torch.equal(outs[0].drafter, other.drafter) and torch.equal(outs[0].depth, other.depth)
            assert torch.equal(outs[0].expected_accepted, other.expected_accepted)
        probs = allocate_probs({"model": tables.accept_prob("model", conf),
                                "synthetic_suffix": tables.accept_prob("synthetic_suffix", score)}, **mode)
        assert torch.equal(probs.drafter, outs[0].drafter) and torch.equal(probs.depth, outs[0].depth)

    # evaluate + replay: the bank read as eval.py reads it has the suffix chain, calibrated by its table;
    # replayed as the second chain beside the model chain
    with pytest.warns(UserWarning):  # the synthetic bank's manifest records no model/speculator
        eb = load_eval_bank(bank, tables)
    assert list(eb.chains) == ["model", "ngram", "synthetic_suffix"] and eb.primary == "model"
    suffix = eb.chains.pop("synthetic_suffix")
    drafted = ~np.isnan(suffix.acc)
    assert np.isfinite(suffix.p_cal[drafted]).all() and np.isnan(suffix.p_cal[~drafted]).all()
    eb.chains = {"model": eb.chains["model"], "synthetic_suffix": suffix}
    eb.split[:] = "test"
    rcfg = ReplayConfig(batch_sizes=[4], policies=["no_spec", "two_drafter", "oracle"], min_steps=4, max_steps=4,
                        draft_cost={"model": 0.1, "synthetic_suffix": 0.0})
    curve = make_curve("parametric", {"kind": "parametric", "weight_read": 1.0, "per_position": 0.01}, 64)
    rows = replay([eb], {"parametric": curve}, rcfg, progress=False)
    shares = [r["ngram_share"] for r in rows if r["policy"] == "two_drafter" and r["category"] != "all"]
    assert shares and max(shares) > 0  # requests verifying the second chain, here the suffix chain

    # the serving decision: the engine offers the model draft and the suffix chain, one mapping
    _serving_decision(tables)


def _serving_decision(tables):
    from calib.allocate import allocate
    from calib.serve import RequestHistory, SafeDecider, StepInputs, chain_inputs, decide_step

    B, cost = 6, 1.0 + 0.01 * torch.arange(64.0)
    model = Offer([[1, 2, 3, 4]] * B, torch.full((B, 4), 0.02))  # a weak model draft
    suffix = Offer([[10 + i, 11, 12, 13] if i % 3 else [] for i in range(B)], torch.full((B,), 0.95))
    step = StepInputs([f"req-{i}" for i in range(B)], torch.zeros(B), {"model": model, "synthetic_suffix": suffix})
    history = RequestHistory()
    out = decide_step(tables, step, history, k_max=4, cost=cost)
    assert chain("synthetic_suffix").id in out.chain.tolist()
    for i, (cid, d) in enumerate(zip(out.chain.tolist(), out.drafts)):
        offered = {chain("model").id: model.tokens[i], chain("synthetic_suffix").id: suffix.tokens[i]}.get(cid, [])
        assert d == offered[: len(d)] and (cid != chain("synthetic_suffix").id or suffix.tokens[i])
    signals, _ = chain_inputs(tables, step, history, k_max=4)
    assert signals["synthetic_suffix"].shape == (B, 4, 1) and torch.isnan(signals["synthetic_suffix"][0]).all()  # request 0: none
    ref = allocate(tables, signals, cost=cost)
    assert torch.equal(out.chain, ref.drafter) and torch.equal(out.depth, ref.depth)
    # SafeDecider: every registered chain the tables calibrate, the suffix chain included
    dec = SafeDecider(tables, model_id=tables.target_models[0], speculator=tables.meta["chains"]["model"]["ids"][0],
                      method="eagle", k_max=4, cost=cost)
    assert dec.chains == ["model", "ngram", "synthetic_suffix"]
    got = dec.decide(step)
    assert not got.passthrough and got.drafts == out.drafts and torch.equal(got.chain, out.chain)
