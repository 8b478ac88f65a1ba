"""calib.serve.v2_estimator against the interface it implements (vLLM 0.32 Model Runner V2's
duck-typed acceptance estimator), on CPU, with SYNTHETIC tables (random grids, no fitted data):

(a) predict / step have the parameter names of vLLM's OnlineAcceptanceEstimator;
(b) predict writes, for live rows only, exactly calib's own reference lookup
    (``Tables.accept_prob(..., depth=step)``) of (max q, temperature, history context), for a 0-d
    draft_step and for a per-row draft_step (parallel drafting: request = row // K), with both
    implementations (the Triton kernel under Triton's interpreter, and the torch reference);
(c) step keeps the history context axes as calib.serve.history.RequestHistory defines them, for the
    requests in idx_mapping only (padded rows and other slots untouched);
(d) vLLM's own slot-admission function (adaptive_verification._assign_draft_token_budget, plain
    torch) run on our confidences admits the same depths as calib's budget-mode allocator.
    The manager class itself (AdaptiveVerificationManager) needs torch.cuda.Stream / Event in its
    constructor and is not exercised here.
"""

from __future__ import annotations

import inspect
import math
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton (vLLM does too)

import pytest

from calib.allocate import allocate_probs
from calib.chains import Axis
from calib.serve.history import RequestHistory
from calib.serve.v2_estimator import CalibAcceptanceEstimator, install
from calib.tables.io import load, save
from calib.tables.layout import ChainTable, GridTables
from tests.serve.decide_cases import META, synthetic_tables  # SYNTHETIC tables

G, D = 9, 4
V = 50  # vocabulary of the SYNTHETIC logits


def _interpreter_on() -> bool:
    try:
        from calib.allocate.triton_kernels import interpreting
    except ImportError:
        return False
    return interpreting()


IMPLS = ["reference", pytest.param("triton", marks=pytest.mark.skipif(
    not torch.cuda.is_available() and not _interpreter_on(),
    reason="Triton interpreter off: triton was imported before TRITON_INTERPRET=1 was set"))]


def _all_axes_tables(seed=0) -> GridTables:
    """SYNTHETIC tables whose model chain reads every context axis: conf x temperature (2) x
    prev_accept (3) x mean_accept (2) x position (2); D depths."""
    g = torch.Generator().manual_seed(seed)
    axes = (Axis("conf", points=G), Axis("temperature", edges=(0.4,)), Axis("prev_accept", edges=(0.0, 2.0)),
            Axis("mean_accept", edges=(1.0,)), Axis("position", edges=(3.5,)))
    cells = 2 * 3 * 2 * 2
    grid = torch.rand(D, cells * G, generator=g)
    edges = torch.tensor([[0.4, math.inf], [0.0, 2.0], [1.0, math.inf], [3.5, math.inf]])
    strides = torch.tensor([12 * G, 4 * G, 2 * G, G])
    return GridTables({"model": ChainTable.build(axes, grid, edges, strides)})


MODEL_META = {**META, "chains": {"model": META["chains"]["model"]}}


def _saved(tmp_path, tables, name="tables"):
    return load(save(tmp_path / name, tables, MODEL_META))


def _observe_both(est, hist, slots, accepted, drafted):
    """One verdict through est.step (vLLM's num_sampled / num_rejected) and RequestHistory.observe."""
    idx = torch.tensor(slots, dtype=torch.int64)
    acc = torch.tensor(accepted)
    dra = torch.tensor(drafted)
    # vLLM: num_sampled = accepted + 1 (the bonus token), num_rejected = admitted drafts - accepted;
    # a chunked-prefill row has both 0.
    num_sampled = torch.where(dra >= 0, acc + 1, 0).to(torch.int32)
    num_rejected = torch.where(dra >= 0, dra - acc, 0).to(torch.int32)
    est.step(idx, num_sampled, num_rejected)
    for s, a, d in zip(slots, accepted, drafted):
        if s >= 0 and d >= 0:
            hist.observe(f"slot{s}", a, d)


def _random_history(est, hist, n_slots, steps=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        slots = torch.randperm(n_slots, generator=g)[: n_slots // 2 + 1].tolist()
        drafted = torch.randint(0, D + 1, (len(slots),), generator=g).tolist()
        accepted = [int(torch.randint(0, d + 1, (1,), generator=g)) for d in drafted]
        _observe_both(est, hist, slots, accepted, drafted)


# --- (a) the interface -----------------------------------------------------------------------------

def test_signatures_match_vllm_online_estimator():
    ae = pytest.importorskip("vllm.v1.worker.gpu.spec_decode.acceptance_estimator")
    for name in ("predict", "step"):
        ours = list(inspect.signature(getattr(CalibAcceptanceEstimator, name)).parameters)
        theirs = list(inspect.signature(getattr(ae.OnlineAcceptanceEstimator, name)).parameters)
        assert ours == theirs, name
    # The constructor vLLM calls (speculator.py) takes these three first; ours takes the tables before.
    theirs = list(inspect.signature(ae.OnlineAcceptanceEstimator.__init__).parameters)
    ours = list(inspect.signature(CalibAcceptanceEstimator.__init__).parameters)
    assert ours[2:2 + len(theirs) - 1] == theirs[1:]


# --- (b) predict = calib's reference lookup ----------------------------------------------------------

def _expected(tables, est_inputs, slots, temps, hist, steps):
    """Per row: Tables.accept_prob at the row's depth of [max q (the estimator's), the row's
    temperature, RequestHistory's context], in the tables' axis order."""
    names = tables.feature_names("model")
    out = []
    for r, (s, d) in enumerate(zip(slots, steps)):
        ctx = hist.context(f"slot{s}")
        vals = {"conf": float(est_inputs[r, 0]), "temperature": float(temps[s]), **ctx}
        x = torch.tensor([[vals[n] for n in names]], dtype=torch.float32)
        out.append(float(tables.accept_prob("model", x, depth=int(d))[0]))
    return torch.tensor(out)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("which", ["decide", "all_axes"])
def test_predict_one_step_writes_calibs_lookup(tmp_path, impl, which):
    tables = _saved(tmp_path, synthetic_tables(3, chains=("model",)) if which == "decide" else _all_axes_tables(3))
    max_reqs, K = 10, D
    est = CalibAcceptanceEstimator(tables, max_reqs, K, "cpu", impl=impl)
    hist = RequestHistory()
    _random_history(est, hist, max_reqs, seed=1)
    g = torch.Generator().manual_seed(2)
    temps = torch.where(torch.rand(max_reqs, generator=g) < 0.5, 0.0, 0.9)  # [max_num_reqs]; 0 = greedy
    slots = [7, 2, 5, 0, -1, -1]  # batch order -> req_state_idx; two cudagraph-padded rows
    logits = 3 * torch.randn(len(slots), V, generator=g)
    sentinel = -7.0
    for step in range(K):
        conf = torch.full((max_reqs, K), sentinel)
        est.predict(logits, torch.tensor(slots), torch.tensor(step), conf, temps)
        x = est.inputs(logits, torch.tensor(slots), temps)
        live = [r for r, s in enumerate(slots) if s >= 0]
        want = _expected(tables, x[live], [slots[r] for r in live], temps, hist, [step] * len(live))
        got = conf[live, step]
        assert torch.equal(got, want), (step, got, want)
        # everything else untouched: other depths, padded rows' batch positions, rows past the batch
        mask = torch.ones_like(conf, dtype=torch.bool)
        mask[live, step] = False
        assert bool((conf[mask] == sentinel).all())
    # the confidence feature: max q of the temperature-scaled distribution (temperature 0: unscaled)
    t = temps[torch.tensor(slots).clamp(min=0)]
    scaled = logits / torch.where(t > 0, t, 1.0)[:, None]
    assert torch.allclose(x[:, 0], torch.softmax(scaled, dim=1).amax(dim=1), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("impl", IMPLS)
def test_predict_per_row_step_parallel_drafting(tmp_path, impl):
    """draft_step [num_tokens]: K consecutive rows per request (request = row // K), one depth each."""
    tables = _saved(tmp_path, _all_axes_tables(4))
    max_reqs, K = 6, D
    est = CalibAcceptanceEstimator(tables, max_reqs, K, "cpu", impl=impl)
    hist = RequestHistory()
    _random_history(est, hist, max_reqs, seed=4)
    g = torch.Generator().manual_seed(5)
    temps = torch.tensor([0.0, 0.9, 0.0, 0.7, 1.2, 0.0])
    req_slots = [4, 1, 3, -1]  # batch of 3 live requests + one padded request
    idx = torch.tensor(req_slots).repeat_interleave(K)  # [num_tokens]
    steps = torch.arange(K).repeat(len(req_slots))  # [num_tokens]
    logits = 3 * torch.randn(idx.numel(), V, generator=g)
    conf = torch.full((max_reqs, K), -7.0)
    est.predict(logits, idx, steps, conf, temps)
    x = est.inputs(logits, idx, temps)
    live = (idx >= 0).nonzero().squeeze(1)
    want = _expected(tables, x[live], idx[live].tolist(), temps, hist, steps[live].tolist())
    batch = live // K
    assert torch.equal(conf[batch, steps[live]], want)
    assert bool((conf[len(req_slots) - 1:] == -7.0).all())  # the padded request's row: untouched
    assert bool((conf[:3] != -7.0).all())


@pytest.mark.parametrize("impl", IMPLS)
def test_first_round_and_a_new_request_read_bucket_zero(tmp_path, impl):
    """A slot never observed (or reset by add_request) is in its first round: prev/mean NaN, position 0."""
    tables = _saved(tmp_path, _all_axes_tables(6))
    est = CalibAcceptanceEstimator(tables, 4, D, "cpu", impl=impl)
    hist = RequestHistory()
    _observe_both(est, hist, [1], [3], [4])
    est.add_request(1)
    hist.finish("slot1")
    logits = torch.randn(2, V)
    conf = torch.zeros(4, D)
    temps = torch.zeros(4)
    est.predict(logits, torch.tensor([1, 2]), torch.tensor(0), conf, temps)
    x = est.inputs(logits, torch.tensor([1, 2]), temps)
    assert torch.equal(conf[:2, 0], _expected(tables, x, [1, 2], temps, hist, [0, 0]))
    assert torch.isnan(x[:, 2:4]).all() and (x[:, 4] == 0).all()


def test_estimators_agree_and_differ_from_a_wrong_context(tmp_path):
    """The two implementations agree bit for bit; a different history changes the answer (the test can fail)."""
    if not (torch.cuda.is_available() or _interpreter_on()):
        pytest.skip("Triton interpreter off")
    tables = _saved(tmp_path, _all_axes_tables(7))
    ests = [CalibAcceptanceEstimator(tables, 8, D, "cpu", impl=i) for i in ("reference", "triton")]
    for e in ests:
        _random_history(e, RequestHistory(), 8, seed=8)
    logits = 2 * torch.randn(8, V, generator=torch.Generator().manual_seed(9))
    temps = torch.full((8,), 0.9)
    outs = []
    for e in ests:
        conf = torch.zeros(8, D)
        for s in range(D):
            e.predict(logits, torch.arange(8), torch.tensor(s), conf, temps)
        outs.append(conf)
    assert torch.equal(outs[0], outs[1])
    fresh = CalibAcceptanceEstimator(tables, 8, D, "cpu", impl="reference")  # no history at all
    conf = torch.zeros(8, D)
    for s in range(D):
        fresh.predict(logits, torch.arange(8), torch.tensor(s), conf, temps)
    assert not torch.equal(conf, outs[0])


# --- (c) step = RequestHistory -----------------------------------------------------------------------

def test_step_keeps_request_history_for_the_batch_only():
    tables = _all_axes_tables()
    max_reqs = 9
    est = CalibAcceptanceEstimator(tables, max_reqs, D, "cpu", impl="reference")
    hist = RequestHistory()
    g = torch.Generator().manual_seed(11)
    for it in range(12):
        slots = torch.randperm(max_reqs, generator=g)[:5].tolist()
        drafted = torch.randint(-1, D + 1, (5,), generator=g).tolist()  # -1: chunked prefill (0 sampled)
        accepted = [int(torch.randint(0, max(d, 0) + 1, (1,), generator=g)) for d in drafted]
        if it % 3 == 0:
            slots[-1] = -1  # a padded row
        before = est.history.clone()
        _observe_both(est, hist, slots, accepted, drafted)
        touched = {s for s, d in zip(slots, drafted) if s >= 0 and d > 0}
        for s in range(max_reqs):
            ctx = hist.context(f"slot{s}")
            want = torch.tensor([ctx["prev_accept"], ctx["mean_accept"], ctx["position"]], dtype=torch.float32)
            assert torch.equal(est.history[s], want) or (
                torch.isnan(want[:2]).all() and torch.isnan(est.history[s, :2]).all() and est.history[s, 2] == want[2]
            ), (it, s, est.history[s], want)
            if s not in touched:  # not a round of this step: unchanged
                assert torch.equal(torch.nan_to_num(est.history[s], nan=-1), torch.nan_to_num(before[s], nan=-1))


def test_step_history_differs_after_a_round():
    est = CalibAcceptanceEstimator(_all_axes_tables(), 3, D, "cpu", impl="reference")
    est.step(torch.tensor([0, 1]), torch.tensor([3, 1]), torch.tensor([1, 0]))  # slot 0: 2 of 3; slot 1: prefill
    assert est.history[0].tolist() == [2.0, 2.0, 3.0]
    assert torch.isnan(est.history[1, :2]).all() and est.history[1, 2] == 0.0


# --- construction checks and install ----------------------------------------------------------------

def test_refuses_tables_it_cannot_read():
    with pytest.raises(ValueError, match="not the 'model' chain"):
        CalibAcceptanceEstimator(GridTables({"ngram": synthetic_tables().chains["ngram"]}), 4, D, "cpu")
    with pytest.raises(ValueError, match="D=4"):
        CalibAcceptanceEstimator(synthetic_tables(), 4, D + 1, "cpu")
    CalibAcceptanceEstimator(GridTables(synthetic_tables().chains, reuse_last_row=True), 4, D + 1, "cpu")
    with pytest.raises(ValueError, match="impl"):
        CalibAcceptanceEstimator(synthetic_tables(), 4, D, "cpu", impl="cuda")


def test_install_replaces_the_speculators_estimator(tmp_path):
    path = save(tmp_path / "t", synthetic_tables(1, chains=("model",)), MODEL_META)

    class Speculator:  # the attributes of vLLM's DraftModelSpeculator that install reads
        max_num_reqs, num_speculative_steps, device = 5, D, torch.device("cpu")
        acceptance_estimator = object()

    class Manager:
        def __init__(self):
            self.added = []

        def add_request(self, req_idx):
            self.added.append(req_idx)

    spec, man = Speculator(), Manager()
    est = install(spec, path, adaptive_verification=man)
    assert spec.acceptance_estimator is est and isinstance(est, CalibAcceptanceEstimator)
    est.step(torch.tensor([2]), torch.tensor([2]), torch.tensor([1]))
    assert est.history[2, 0] == 1.0
    man.add_request(2)
    assert man.added == [2] and torch.isnan(est.history[2, 0])
    spec.acceptance_estimator = None
    with pytest.raises(RuntimeError, match="enable_adaptive_verification"):
        install(spec, path)


# --- (d) vLLM's admission on our outputs -------------------------------------------------------------

def test_vllm_admission_on_our_confidences_matches_calibs_budget_allocation(tmp_path):
    av = pytest.importorskip("vllm.v1.worker.gpu.spec_decode.adaptive_verification")
    tables = _saved(tmp_path, _all_axes_tables(12))
    max_reqs, K = 12, D
    est = CalibAcceptanceEstimator(tables, max_reqs, K, "cpu", impl="reference")
    _random_history(est, RequestHistory(), max_reqs, seed=13)
    g = torch.Generator().manual_seed(14)
    temps = torch.where(torch.rand(max_reqs, generator=g) < 0.5, 0.0, 0.8)
    slots = torch.tensor([3, 9, 0, 5, 11, 7, 1])
    conf = torch.ones(max_reqs, K)  # the manager's _confidence_probs, indexed by req_state_idx
    batch_conf = torch.full((max_reqs, K), -7.0)  # the speculator's draft_token_confidence_probs (batch order)
    logits = 4 * torch.randn(len(slots), V, generator=g)
    for s in range(K):
        est.predict(logits, slots, torch.tensor(s), batch_conf, temps)
    conf[slots] = batch_conf[: len(slots)]  # what record_confidences does
    probs = conf[slots]
    assert bool(((probs >= 0) & (probs <= 1)).all())  # every live slot written, probabilities
    for budget in (0, 3, 9, 17, len(slots) * K - 1):
        capacities = torch.full((len(slots),), K, dtype=torch.int32)
        if budget < len(slots) * K:
            av._assign_draft_token_budget(conf, slots, capacities, budget, K)
        ours = allocate_probs({"model": probs}, budget=budget)
        assert capacities.tolist() == ours.depth.tolist(), budget
        assert int(capacities.sum()) == budget


# --- the MoE routing hook on V2 (calib/vllm/capture.py, docs/serving_design.md claim 5 "Trap") ----

def test_routing_hook_records_nothing_until_a_v1_step(monkeypatch):
    """Model Runner V2 shares the model layers, so select_experts fires there, but the V1 wrappers that
    empty rec.moe_rows never run: the hook must record nothing until a V1 `_sample` has been seen."""
    router_mod = pytest.importorskip("vllm.model_executor.layers.fused_moe.router.fused_moe_router")
    from calib.vllm import capture

    ids = torch.tensor([[1, 2], [3, 0]])
    monkeypatch.setattr(router_mod.FusedMoERouter, "select_experts",
                        lambda self, *a, **k: (torch.ones(2, 2), ids))  # restored after the test

    class Rec:
        moe_rows: list
        v1_runner = False

        def __init__(self):
            self.moe_rows = []

        def error(self, where, exc):
            raise exc

    rec = Rec()
    capture.install_routing(rec)
    for _ in range(5):  # V2: passes without any V1 _sample
        router_mod.FusedMoERouter.select_experts(object())
    assert rec.moe_rows == []
    rec.v1_runner = True  # what the V1 _sample wrapper sets
    router_mod.FusedMoERouter.select_experts(object())
    assert len(rec.moe_rows) == 1 and torch.equal(rec.moe_rows[0], ids)
