"""SYNTHETIC cases for calib.serve.decide's tests (random grids with context axes, tests/synthetic.py style): tables,
request histories, a step's offers, a cost curve, and the checks every decision must pass. Not real data."""

from __future__ import annotations

import math

import torch

from calib.chains import Axis, Offer, chain
from calib.chains.ngram import step_feature_tensor
from calib.serve import RequestHistory, SafeDecider, StepInputs
from calib.tables.layout import ChainTable, GridTables

NAN = float("nan")
G, D = 9, 4
NG_OWN = ["match_n", "agreement"]


def synthetic_tables(seed: int = 0, model_scale=1.0, ngram_scale=1.0, chains=("model", "ngram")) -> GridTables:
    """SYNTHETIC tables: model = conf x temperature (2) x prev_accept (3); n-gram = match_n (3) x
    agreement (2) x temperature (2) x mean_accept (2) x position (2)."""
    g = torch.Generator().manual_seed(seed)
    m_axes = (Axis("conf", points=G), Axis("temperature", edges=(0.4,)), Axis("prev_accept", edges=(0.0, 2.0)))
    m = ChainTable.build(m_axes, model_scale * torch.rand(D, 6 * G, generator=g).sort(dim=1).values,
                         torch.tensor([[0.4, math.inf], [0.0, 2.0]]), torch.tensor([3 * G, G]))
    n_axes = (Axis("match_n", edges=(1.5, 2.5)), Axis("agreement", edges=(0.5,)), Axis("temperature", edges=(0.4,)),
              Axis("mean_accept", edges=(1.0,)), Axis("position", edges=(3.5,)))
    n = ChainTable.build(n_axes, ngram_scale * torch.rand(D, 48, generator=g),
                         torch.tensor([[1.5, 2.5], [0.5, math.inf], [0.4, math.inf], [1.0, math.inf], [3.5, math.inf]]),
                         torch.tensor([16, 8, 4, 2, 1]))
    both = {"model": m, "ngram": n}
    return GridTables({c: both[c] for c in chains})


def synthetic_history(req_ids, seed=0) -> RequestHistory:
    g = torch.Generator().manual_seed(seed)
    h = RequestHistory()
    for r in req_ids:
        for _ in range(int(torch.randint(0, 4, (1,), generator=g))):  # 0 rounds: first round, NaN
            d = int(torch.randint(1, 5, (1,), generator=g))
            h.observe(r, int(torch.randint(0, d + 1, (1,), generator=g)), d)
    return h


def step_inputs(req_ids, temp, model_tokens=None, model_conf=None, ngram_tokens=None, ngram_features=None,
          ngram_probs=None) -> StepInputs:
    """StepInputs offering the model chain and/or the n-gram chain (None: not offered)."""
    offers = {}
    if model_tokens is not None:
        offers["model"] = Offer(model_tokens, model_conf)
    if ngram_tokens is not None:
        offers["ngram"] = Offer(ngram_tokens, ngram_features, ngram_probs)
    return StepInputs(req_ids, temp, offers)


def offered_tokens(inputs, name):
    return inputs.offers[name].tokens if name in inputs.offers else None


def with_probs(inputs, name, probs):
    from dataclasses import replace

    return StepInputs(inputs.req_ids, inputs.temperature,
                      {**inputs.offers, name: replace(inputs.offers[name], probs=probs)})


def random_inputs(B=6, K=5, L=5, seed=0, model=True, ngram=True) -> StepInputs:
    g = torch.Generator().manual_seed(seed)
    req_ids = [f"req-{i}" for i in range(B)]
    mt = [torch.randint(0, 1000, (int(torch.randint(0, K + 1, (1,), generator=g)),), generator=g).tolist()
          for _ in range(B)]
    conf = torch.rand(B, K, generator=g)
    nt = [torch.randint(0, 1000, (int(torch.randint(0, L + 1, (1,), generator=g)),), generator=g).tolist()
          for _ in range(B)]
    feats = [{"match_n": int(torch.randint(1, 5, (1,), generator=g)), "agreement": float(torch.rand(1, generator=g))}
             if t else None for t in nt]
    temp = torch.where(torch.rand(B, generator=g) < 0.5, 0.0, 0.8)
    return step_inputs(req_ids, temp, mt if model else None, conf if model else None,
                 nt if ngram else None,
                 step_feature_tensor(feats, [len(t) for t in nt], NG_OWN, L) if ngram else None)


def cheap_curve(B, K=5):
    return torch.linspace(1.0, 1.5, B + 2 * K * B + 1)


def check_drafts(out, inputs, k_max):
    for i in range(len(inputs.req_ids)):
        d, c = out.drafts[i], int(out.chain[i])
        assert len(d) <= k_max and len(d) == int(out.depth[i])
        assert all(isinstance(x, int) and x >= 0 for x in d)
        if c == 0:
            assert d == []
        else:
            src = offered_tokens(inputs, "model") if c == chain("model").id else offered_tokens(inputs, "ngram")
            assert d == src[i][: len(d)] and len(d) <= len(src[i])


META = {"target_models": ["synthetic-model"],
        "chains": {"model": {"ids": ["eagle:head"], "k": D}, "ngram": {"ids": ["ngram"], "k": D}}}


def synthetic_decider(path, **kw):
    """A SafeDecider of the SYNTHETIC tables at ``path`` for an EAGLE engine at K = 4 (``kw`` overrides)."""
    args = {"model_id": "synthetic-model", "speculator": "eagle:head", "method": "eagle", "k_max": 4,
            "cost": cheap_curve(8), **kw}
    return SafeDecider(path, **args)
