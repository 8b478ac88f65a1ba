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
    suffix = Offer([[10 + i, 11, 12, 13] if i % 3 else [] for i in range(B)], torch.full((B, 4), 0.95))
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
    _served_by_the_server(dec)


# -- collection and serving through calib's vLLM layer (capture, assembly, the bank writer and validator,
# Server): the same one file and one registration, nothing else names the kind -------------------------------
FINALS = {0: [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 1, 2, 5, 6, 7, 8, 9, 3, 5, 6, 7, 8, 9, 4, 5, 6, 7, 8, 9, 5, 6, 7],
          1: [3, 1, 4, 1, 5, 9, 2, 6, 3, 1, 4, 1, 5, 9, 2, 6, 3, 1, 4, 1, 5, 9, 2, 6, 3, 1, 4, 1, 5, 9, 2, 6]}
PROMPT = 8


def _batch(ctx: dict):
    """Stands for vLLM's InputBatch over requests at context lengths ``ctx`` (their final tokens: FINALS)."""
    from types import SimpleNamespace

    rows = sorted(ctx)
    buf = np.zeros((len(rows), 40), dtype=np.int32)
    for b, i in enumerate(rows):
        buf[b, : ctx[i]] = FINALS[i][: ctx[i]]
    return SimpleNamespace(req_ids=[f"{i}-abcdefgh" for i in rows], token_ids_cpu=buf,
                           num_tokens_no_spec=np.array([ctx[i] for i in rows]),
                           num_prompt_tokens=np.array([PROMPT] * len(rows)), temperature_cpu=np.zeros(len(rows)))


def test_collected_from_the_engine_and_served_by_calib_with_its_one_file(tmp_path, suffix_chain):
    from types import SimpleNamespace

    from calib.bank import validate
    from calib.collect.assemble import RunKeys, build_tables, engine_request_prefix, read_capture
    from calib.vllm.capture import Recorder

    # counted: the kind is one file; no file of the project's code or config names it; one registration added it
    root = Path(__file__).resolve().parents[1]
    defined = Path(__import__(SUFFIX.samples.__module__, fromlist=["x"]).__file__).resolve()
    assert defined == root / "tests" / "synthetic_suffix.py"
    naming = [p for d in ("calib", "conf", "bench") for p in (root / d).rglob("*") if p.is_file()
              and p.suffix in (".py", ".yaml") and SUFFIX.name in p.read_text(errors="ignore")]
    naming += [p for p in root.glob("*.py") if SUFFIX.name in p.read_text()]
    assert naming == []
    assert [k.name for k in chains()].count(SUFFIX.name) == 1

    # capture: vLLM's runner stood in for (a model drafter whose drafts accept two tokens of three)
    rec = Recorder(str(tmp_path / "capture"), {}, 3)
    assert SUFFIX.name in rec.recompute
    ctx = {0: PROMPT + 1, 1: PROMPT + 1}
    for step in range(1, 7):
        batch = _batch(ctx)
        runner = SimpleNamespace(input_batch=batch, requests={}, max_model_len=2048)
        rec.propose_step(runner)  # after bookkeeping: where vLLM's own model-free proposers run
        drafts = [FINALS[i][ctx[i]: ctx[i] + 2] + [99] for i in sorted(ctx)]
        meta = SimpleNamespace(num_draft_tokens=[3] * len(drafts),
                               draft_token_ids=torch.tensor([t for d in drafts for t in d]))
        sampled = torch.tensor([FINALS[i][ctx[i]: ctx[i] + 3] + [-1] for i in sorted(ctx)])
        rec.record_verify(runner, meta, sampled)
        ctx = {i: n + 3 for i, n in ctx.items()}
    rounds = {int(engine_request_prefix(r)): recs for r, recs in read_capture(tmp_path / "capture").items()}
    keys = RunKeys("synthetic-model", "eagle:x", "eagle-k3-t0", 3, 3, chain_verified=False, temperature=0.0)
    tables = build_tables(rounds, {0: "code_edit", 1: "chat"}, FINALS, keys)
    bank = write_bank(tmp_path / "collected", *tables)
    assert validate(str(bank)) == []  # the bank writer and the validator know its file from the registration
    t = load_bank(bank).rounds(chains=[SUFFIX])
    src = t.column(f"{PREFIX}label_source").to_pylist()
    assert src.count("counterfactual") >= 6  # the repeating motifs offer chains, labelled from the final tokens
    for r, recs in rounds.items():  # what capture recorded is what the kind proposes from the same tokens
        for x in recs:
            want = SUFFIX.propose(np.array(FINALS[r][: x["context_len"]]), {"k": 3})[0]
            assert x[f"{SUFFIX.name}_tokens"] == want
    # a broken file of the kind is refused, naming its file and column
    import pyarrow.parquet as pq

    bad = pq.read_table(bank / BANK_FILE)
    pq.write_table(bad.drop([SCORE]), bank / BANK_FILE)
    assert any(p.column == SCORE and p.file.endswith(BANK_FILE) for p in validate(str(bank)))


def _served_by_the_server(dec):
    """Server recomputes the kind from the engine's token buffer and offers it; the decider verifies it."""
    from calib.serve import StepInputs
    from calib.serve.knobs import ServeKnobs
    from calib.vllm.recomputed import StepContexts
    from calib.vllm.server import Server

    srv = Server(ServeKnobs("unused-tables"))
    srv.k, srv.max_model_len = 4, 2048
    srv.recompute_chains(dec, chain("model"), None)  # every recomputed kind the tables calibrate, registry order
    assert list(srv.recomputed) == ["ngram", SUFFIX.name] and srv.recomputed[SUFFIX.name].own == [SCORE]
    batch = _batch({0: 20, 1: 20})
    tokens, signal = srv.recomputed[SUFFIX.name].chains(StepContexts(batch, [0, 1]))
    offers = {SUFFIX.name: Offer(tokens, signal)}
    want = [SUFFIX.propose(np.array(FINALS[i][:20]), {"k": 4})[0] for i in (0, 1)]
    assert offers[SUFFIX.name].tokens == want and all(want)
    model = Offer([[1, 2, 3, 4]] * 2, torch.full((2, 4), 0.02))
    got = dec.decide(StepInputs(batch.req_ids, [0.0, 0.0], {"model": model, **offers}))
    assert chain(SUFFIX.name).id in got.chain.tolist()
    srv.finished(batch.req_ids)


def test_a_bank_records_its_chain_files_layouts(tmp_path):
    """A bank written while the kind was registered is validated by its recorded layout where no registered kind
    describes the file (python -m calib.bank validate imports no chain kind)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from calib.bank import validate

    acceptance, speculator, ngram = synthetic_tables(n_prompts=6, rounds_per_prompt=8)
    table = pq.read_table(add_to_bank(write_bank(tmp_path / "plain", acceptance, speculator, ngram)) / BANK_FILE)
    register_chain(SUFFIX)
    try:
        bank = write_bank(tmp_path / "bank", acceptance, speculator, ngram, table, manifest={"model": "synthetic-model"})
    finally:
        unregister_chain(SUFFIX.name)
    with pytest.raises(KeyError):
        chain(SUFFIX.name)
    assert validate(str(bank)) == []
    broken = table.set_column(table.column_names.index(SCORE), SCORE, pa.array(np.full(table.num_rows, 1.5)))
    pq.write_table(broken, bank / BANK_FILE)
    found = validate(str(bank))
    assert found and found[0].file.endswith(BANK_FILE) and found[0].column == SCORE and "outside" in found[0].message
