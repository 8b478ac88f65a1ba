"""The replay's driver: draw every setting's steps, run the policies a config asks for, sum and rank them.

:func:`replay` is what ``eval.py`` runs; the accounting and the policies are described in docs/policies.md.
"""

from __future__ import annotations

import math

import numpy as np

from calib.cost import CostCurve
from calib.evaluate.replay.config import ReplayConfig
from calib.evaluate.replay.lanes import requests_of, run_lanes
from calib.evaluate.replay.redecide import residual_batch
from calib.evaluate.replay.undrafted import with_undrafted_steps
from calib.labels import censored
from calib.policies import BASE_TOTALS, REFERENCE, PolicyResult, closure, policy, policy_of_row
from calib.policies.setting import COVERED_WEIGHTINGS, Setting, StepBatch, step_weights, written


def train_mean_curve(bank) -> np.ndarray:
    """Primary chain's P(accept k | reached k) [K] pooled over the training split (NaN: never reached);
    ``bank`` a :class:`calib.evaluate.data.EvalBank`."""
    chain = bank.chains[bank.primary]
    acc = chain.acc[bank.split == "train"]
    if acc.shape[0] == 0:
        acc = chain.acc
    reached, label = censored(acc)
    n = reached.sum(axis=0)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(n > 0, (reached & label).sum(axis=0) / np.maximum(n, 1), np.nan)


def draw_steps(n_rounds: int, batch: int, cfg: ReplayConfig, rng: np.random.Generator) -> np.ndarray:
    """[S, B] row indices, ``S ≈ passes · n_rounds / B`` clipped to ``[min_steps, max_steps]``: the rows dealt
    out in shuffled passes, each pass every row once (so a setting of one pass replays each recorded round
    exactly once: the cell's own mix of drafted and undrafted steps, with no draw-to-draw noise), rows distinct
    within a step when the pool allows it."""
    steps = int(np.clip(math.ceil(cfg.passes * n_rounds / batch), cfg.min_steps, cfg.max_steps))
    if n_rounds < batch:
        return rng.integers(0, n_rounds, size=(steps, batch))
    need = steps * batch
    deck = np.concatenate([rng.permutation(n_rounds) for _ in range(-(-need // n_rounds))])[:need]
    out = deck.reshape(steps, batch)
    # a step that straddles two passes can deal a row twice: trade each repeat with a later deal (every row is
    # still dealt as often) that neither step then holds twice; the rare repeat no trade fixes stays
    for s in np.flatnonzero([len(np.unique(r)) < batch for r in out]):
        seen: set[int] = set()
        for j in range(batch):
            x = int(out[s, j])
            if x in seen:
                for k in range((s + 1) * batch, need):
                    t, y = divmod(k, batch)
                    if int(out[t, y]) not in seen and int(out[t, y]) not in out[s] and x not in out[t]:
                        out[s, j], out[t, y] = out[t, y], x
                        break
            seen.add(int(out[s, j]))
    return out


def replay_setting(sb: StepBatch, curve: CostCurve, cfg: ReplayConfig, train_curve: np.ndarray) -> dict:
    """{row name: :class:`PolicyResult`} of every step policy ``cfg.policies`` asks for, what they and the
    reference ``best_fixed`` need (``no_spec``, ``fixed``), for one setting and one cost curve."""
    s = Setting(sb, curve, cfg, train_curve)
    out: dict[str, PolicyResult] = {}
    for name in closure([*cfg.policies, REFERENCE]):
        p = policy(name)
        if p.kind == "step":
            out.update(_computed(p, s))
    return out


def _computed(p, s: Setting) -> dict[str, PolicyResult]:
    """{row: result} of step policy ``p`` on ``s``, each charged calib's own time where calib serves it."""
    res = p.compute(s)
    if res is None:
        return {}
    hooks = s.overhead(p.serving is not None and p.serving.calib)  # calib's own time, where it serves
    if not p.family:
        return {p.name: _charged(PolicyResult(*res), hooks)}
    for row in res:
        if not p.owns(row):
            raise ValueError(f"policy {p.name!r} returned row {row!r}; a family's rows are {p.name}_<x>")
    return {row: _charged(PolicyResult(*r), hooks) for row, r in res.items()}


def _charged(res: PolicyResult, hooks: float) -> PolicyResult:
    return res if hooks == 0 else res._replace(cost=res.cost + hooks)


def summarise(results: dict, B: int, covered: np.ndarray | None = None, weighting: str = "positions") -> dict:
    """Totals per step-policy row (hindsight policies are added by :func:`replay`).

    ``covered`` [S, B], read under ``weighting`` (``positions`` or ``throughput``; ``rounds`` or no ``covered``: each
    round once, :func:`calib.policies.setting.step_weights`): the tokens the collecting engine committed in each round. A
    recorded round then stands for the stretch of text it covered, not for one step: a policy committing ``p``
    tokens where the collector committed ``c`` crosses that stretch in ``c / p`` steps. So step ``s`` counts
    ``w_s = mean_i c_si / p_si`` times (its B requests advance in lockstep) and every policy writes the same
    text, ``Σ c``. Counting each round once instead over-weights the long matches of a policy that commits
    more than the collector (a copied span the collector crossed in many rounds, the policy in one)."""
    rows = {}
    for name, (tok, cost, pos, extra) in results.items():
        total = _level_totals(tok, cost, pos, covered, weighting)
        rows[name] = {**total, "rounds": total["steps"] * B, **extra}
    return rows


def _level_totals(tok, cost, pos, covered, weighting: str) -> dict:
    w = step_weights(tok, covered, weighting)
    return {"tokens": float(np.sum(written(tok, covered, weighting))), "cost": float(np.dot(w, cost)),
            "positions": float(np.dot(w, pos)), "steps": float(w.sum())}


def summarise_redecided(results: dict, sb: StepBatch, curve: CostCurve, cfg: ReplayConfig,
                        train_curve: np.ndarray) -> dict:
    """:func:`summarise` with ``replay.redecide``: a row that committed less than a round's stretch decides again
    on the rest of it (:mod:`calib.evaluate.replay.redecide`), level by level until every stretch is crossed; each
    level's steps count the text they crossed, ``min(stretch left, tokens)`` of each round. ``curve`` is the
    setting's B's, not yet bound to a context (each level binds its own)."""
    rows = {}
    for name, (tok, cost, pos, extra) in results.items():
        level, left, total = sb, sb.covered, dict.fromkeys(("tokens", "cost", "positions", "steps"), 0.0)
        while True:
            for k, v in _level_totals(tok, cost, pos, np.minimum(left, tok), cfg.weighting).items():
                total[k] += v
            nxt = residual_batch(level, tok, left)
            if nxt is None:
                break
            level, left = nxt
            s = Setting(level, curve.with_context(level.cached), cfg, train_curve)
            tok, cost, pos, _ = _computed(policy_of_row(name), s)[name]
        rows[name] = {**total, "rounds": total["steps"] * sb.B, **extra}
    return rows


def on_lanes(results: dict, req, B: int, curve: CostCurve, cfg: ReplayConfig, train_curve: np.ndarray) -> dict:
    """Totals of every row of ``results`` (the dealt replay's) served on ``B`` lanes
    (:mod:`calib.evaluate.replay.lanes`), each with its dealt result's extras (figures of the whole setting)."""
    rows = {}
    for name, res in results.items():
        p = policy_of_row(name)
        lanes = run_lanes(req, B, name, lambda s, p=p: _computed(p, s), curve, cfg, train_curve, p.stateful)
        rows[name] = {**lanes, **res.extra}
    return rows


def add_hindsight(totals: dict, pooled: dict, wanted) -> dict:
    """``totals`` with every hindsight policy of ``wanted`` (registration order) appended."""
    for name in wanted:
        p = policy(name)
        if p.kind == "hindsight":
            row = p.compute(totals, pooled)
            if row is not None:
                totals[name] = dict(row)
    return totals


def ladder_rows(totals: dict, meta: dict, policies) -> list[dict]:
    """Goodput, ratio to best_fixed and headroom captured for one setting's totals; the rows of the
    policies named in ``policies`` (a family's rows first), in ``totals`` order."""
    gp = {k: v["tokens"] / v["cost"] for k, v in totals.items()}
    g_bf, g_or = gp.get(REFERENCE), gp.get("oracle")
    owner = {k: policy_of_row(k) for k in totals}
    asked = set(policies)
    keep = [k for k in totals if owner[k] is not None and owner[k].family and owner[k].name in asked] + \
           [k for k in totals if owner[k] is not None and not owner[k].family and k in asked]
    rows = []
    for k in keep:
        v = totals[k]
        head = ((gp[k] - g_bf) / (g_or - g_bf)
                if g_bf is not None and g_or is not None and g_or - g_bf > 1e-12 * abs(g_bf) else float("nan"))
        rows.append({**meta, "policy": k, "goodput": gp[k],
                     "vs_best_fixed": gp[k] / g_bf if g_bf else float("nan"),
                     "headroom_captured": head,
                     "tokens_per_round": v["tokens"] / v["rounds"],
                     "verified_per_round": v["positions"] / v["rounds"],
                     "steps": v["steps"], "rounds": v["rounds"],
                     **{x: y for x, y in v.items() if x not in BASE_TOTALS},
                     "_tokens": v["tokens"], "_cost": v["cost"], "_positions": v["positions"]})
    return rows


def cell_rows(bank, rows: np.ndarray, batch: int, cell_prompts: tuple[int, int] | None) -> np.ndarray:
    """The ``rows`` (of one category) replayed at ``batch``: all of them, or with ``cell_prompts`` = ``(min,
    per_request)`` those of the first ``max(min, per_request · batch)`` prompts in the order they were collected
    (``prompt_idx``), the prompts bench/serve.py's cell at that concurrency serves. A prompt that left no round
    in the bank (nothing drafted) is not counted."""
    if cell_prompts is None:
        return rows
    low, per_request = cell_prompts
    prompts = np.unique(bank.prompt_idx[rows])  # sorted: the collection's order
    return rows[np.isin(bank.prompt_idx[rows], prompts[: max(low, per_request * batch)])]


def replay(banks, curves: dict[str, CostCurve], cfg: ReplayConfig, progress: bool = True) -> list[dict]:
    """Every (bank, category, B, cost curve) setting; also category "all" (the sum over categories).
    Step policies are replayed setting by setting; hindsight policies are added once every category of a
    (bank, B, cost curve) is in (``vllm_dsd`` needs them all)."""
    from tqdm.auto import tqdm

    settings = []
    if cfg.undrafted_steps:  # a model-free drafter's steps without a draft, served too (replay/undrafted.py)
        banks = [with_undrafted_steps(b) for b in banks]
    for bank in banks:
        test = np.nonzero(bank.split == "test")[0]
        for cat in sorted(set(bank.category[test].tolist())):
            rows = test[bank.category[test] == cat]
            for b in cfg.batch_sizes:
                settings.append((bank, cat, cell_rows(bank, rows, b, cfg.cell_prompts), b))
    wanted = closure([*cfg.policies, REFERENCE])
    rng = np.random.default_rng(cfg.seed)
    bar = tqdm(settings, desc="replay", unit="setting", disable=not progress)
    pooled: dict = {}
    done: list[tuple[dict, dict, tuple]] = []  # (meta, totals, pooled key) per replayed setting, in order
    for bank, cat, rows, b in bar:
        bar.set_postfix_str(f"{bank.name} {cat} B={b}")
        idx = draw_steps(len(rows), b, cfg, rng)
        sb = StepBatch(bank, rows, idx)
        train_curve = train_mean_curve(bank)
        lanes = requests_of(bank, rows) if cfg.lanes else None
        if cfg.lanes and lanes is None:
            note = "replay.lanes: replayed dealt (the bank records no round positions, or its rounds overlap)"
            if note not in bank.notes:
                bank.notes.append(note)
        for cname, curve in curves.items():
            b_curve = curve.for_batch(b)
            res = replay_setting(sb, b_curve.with_context(sb.cached), cfg, train_curve)
            redecided = cfg.redecide and cfg.weighting in COVERED_WEIGHTINGS  # under `rounds` a round has no stretch
            totals = (on_lanes(res, lanes, b, curve, cfg, train_curve) if lanes is not None
                      else summarise_redecided(res, sb, b_curve, cfg, train_curve) if redecided
                      else summarise(res, b, sb.covered, cfg.weighting))
            meta = {"bank": bank.name, "batch_size": b, "category": cat, "cost_model": cname, "unit": curve.unit}
            key = (bank.name, b, cname, curve.unit)
            done.append((meta, totals, key))
            for pol, v in totals.items():
                acc = pooled.setdefault(key, {}).setdefault(pol, {"tokens": 0.0, "cost": 0.0, "positions": 0.0,
                                                                   "steps": 0, "rounds": 0})
                for f in BASE_TOTALS:
                    acc[f] += v[f]
                for x in policy_of_row(pol).pooled_extra:
                    if x in v:
                        acc[x] = v[x]
    ladder: list[dict] = []
    for meta, totals, key in done:
        ladder.extend(ladder_rows(add_hindsight(totals, pooled[key], wanted), meta, cfg.policies))
    for (bname, b, cname, unit), totals in pooled.items():
        add_hindsight(totals, totals, wanted)
        meta = {"bank": bname, "batch_size": b, "category": "all", "cost_model": cname, "unit": unit}
        ladder.extend(ladder_rows(totals, meta, cfg.policies))
    return ladder
