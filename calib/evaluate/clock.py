"""The serving bench's answer on the clock (bench/serve.py): per cell, each arm's tokens/s, its ratio to the best
vLLM arm taken pair by pair, the headroom it captured of the clock oracle's, the replay's prediction and its
error; rendered as tables here, and as marked blocks in README/docs by :mod:`calib.evaluate.clock_blocks`.

A record is one (arm, repetition, cell) of bench/serve.py (``{"arm", "rep", "cell": {category, sampling,
concurrency}, "tok_s", "tpot_ms_median", ...}``); a row is one cell with every arm's figures (:func:`rows`).
The arms come from the servable policies of :mod:`calib.policies` (:func:`arms`): vLLM's own (no speculation
included) are the peers, calib's are judged against the best of them, and an oracle arm (greedy only: it
verifies exactly what the reference output accepts) is the ceiling.
"""

from __future__ import annotations

import functools
import statistics
from dataclasses import dataclass
from pathlib import Path

from calib.evaluate.prediction import Predicted, factor_errors

ROOT = Path(__file__).resolve().parents[2]
# bench/serve.py's cell at concurrency c serves the first max(MIN_CELL_PROMPTS, PROMPTS_PER_REQUEST * c) prompts of
# its category's file; the replay predicts that cell from the same prompts (eval.py replay.cell_prompts)
MIN_CELL_PROMPTS, PROMPTS_PER_REQUEST = 8, 2


# What a cell's prediction is judged against, in order of preference: {prediction_basis: the row's ratio field}
PREDICTION_BASES = {"steady decode": "steady_ratio_to_none", "decode steps": "decode_step_ratio_to_none",
                    "decode (TPOT)": "decode_ratio_to_none", "output tok/s": "ratio_to_none"}


def basis_ratios(row: dict) -> dict:
    """{arm: the measured speed-up over no speculation the row's prediction is judged against}."""
    return row.get(PREDICTION_BASES.get(row.get("prediction_basis"), ""), None) or {}


def cell_prompt_count(concurrency: int, min_prompts: int = MIN_CELL_PROMPTS) -> int:
    """How many prompts a bench cell at ``concurrency`` serves (two per concurrent request, at least ``min_prompts``)."""
    return max(int(min_prompts), PROMPTS_PER_REQUEST * int(concurrency))


@dataclass(frozen=True)
class ArmInfo:
    """One bench arm: the servable policy it runs and how the replay predicts it."""

    name: str
    policy: str  # registered policy name
    family: bool  # the policy is a family (its replay row is ``<policy>_<K>``)
    method: str | None  # the speculative config it serves with (None: no speculation)
    dynamic: tuple | None  # vLLM Dynamic SD's schedule, if any
    vllm: bool  # one of vLLM's own arms (no calib), no speculation included: the peers
    oracle: bool  # the clock oracle (greedy only; needs a reference output)
    overrides: tuple[str, ...]  # serve.py overrides
    default: bool
    replay_policy: str = ""  # the registered policy whose replay row predicts it ("" : ``policy``)


@functools.cache
def arms() -> dict[str, ArmInfo]:
    """``{arm: ArmInfo}`` from the servable policies, vLLM's first, then calib's (registration order within)."""
    import calib.policies

    out = {}
    for p in sorted(calib.policies.servable(), key=lambda p: p.serving.calib):
        for arm in p.serving.arms:
            out[arm.name] = ArmInfo(
                arm.name, p.name, p.family, arm.speculative if p.serving.speculate else None, p.serving.dynamic,
                vllm=not p.serving.calib, oracle=bool(getattr(p.serving, "oracle", False)),
                overrides=(f"policy={p.name}",) + ((f"speculative={arm.speculative}",) if arm.speculative else ()),
                default=arm.default, replay_policy=arm.replay or p.name)
    return out


def vllm_arms() -> tuple[str, ...]:
    return tuple(a for a, i in arms().items() if i.vllm)


def vllm_spec_arms() -> tuple[str, ...]:
    return tuple(a for a, i in arms().items() if i.vllm and i.method is not None)


def calib_arms() -> tuple[str, ...]:
    return tuple(a for a, i in arms().items() if not i.vllm and not i.oracle)


def oracle_arms() -> tuple[str, ...]:
    return tuple(a for a, i in arms().items() if i.oracle)


def _median(v):
    return statistics.median(v) if v else None


def _pairs(by_arm: dict[str, list], arm: str, ref: str, field: str = "tok_s") -> list[float]:
    """``field`` (a speed: tok/s) of ``arm`` over ``ref``'s, repetition by repetition (the two ran in the same
    repetition, arms alternated, so the machine's drift between repetitions cancels)."""
    a = {x["rep"]: x[field] for x in by_arm.get(arm, [])}
    b = {x["rep"]: x[field] for x in by_arm.get(ref, [])}
    return [a[r] / b[r] for r in sorted(set(a) & set(b)) if b[r] > 0]


def _decode_ratios(by_arm: dict[str, list]) -> dict:
    """{arm: no speculation's median TPOT / the arm's} over the repetitions (records without TPOT: none)."""
    tpot = {a: statistics.median(x["tpot_ms_median"] for x in rs) for a, rs in by_arm.items()
            if rs and all(x.get("tpot_ms_median") is not None for x in rs)}
    if not tpot.get("none"):
        return {}
    return {a: tpot["none"] / t for a, t in tpot.items() if t}


def _speed_ratios(by_arm: dict[str, list], field: str) -> dict:
    """{arm: its ``field`` (a speed in tokens/s, or any figure of a record) over no speculation's} as :func:`_ratios`
    takes tok/s; {} unless every arm's every repetition recorded it (:func:`calib.vllm.clients.decode_step_figures`;
    benches before December 5 did not)."""
    if "none" not in by_arm or any(not (x.get(field) or 0) > 0 for rs in by_arm.values() for x in rs):
        return {}
    med = {a: statistics.median(x[field] for x in rs) for a, rs in by_arm.items()}
    return _ratios(by_arm, med, "none", field)[0]


# The oracle must beat the best vLLM arm by this much for a headroom figure: below it the denominator is the
# clock's noise (two repetitions of a cell spread by a few per cent), and the quotient means nothing.
HEADROOM_FLOOR = 0.02


def headroom(ratio: float | None, oracle: float | None, floor: float = HEADROOM_FLOOR) -> float | None:
    """(calib − best vLLM) / (oracle − best vLLM), from both ratios to the best vLLM arm; None where the oracle
    is not measurably above the best vLLM arm (``floor``) or a figure is missing."""
    if ratio is None or oracle is None or oracle - 1.0 < floor:
        return None
    return (ratio - 1.0) / (oracle - 1.0)


def decode_headroom(row: dict) -> dict:
    """{calib arm: the headroom it captured in the decode state the row's prediction is judged in (its
    ``prediction_basis``: the steady state where recorded)}: :func:`headroom` over those speed-ups, the best vLLM
    arm and the fastest oracle taken by the same measure, so that prefill and a cell's half-empty tail, which weigh
    on every arm's tok/s alike, do not shrink the oracle's margin into the clock's noise. {} where the row holds no
    decode figures."""
    speed = basis_ratios(row) if row.get("prediction_basis") != "output tok/s" else {}
    peers = [speed[a] for a in vllm_arms() if speed.get(a)]
    ceiling = [speed[a] for a in oracle_arms() if speed.get(a)]
    if not peers or not ceiling:
        return {}
    best, top = max(peers), max(ceiling)
    return {a: headroom(speed[a] / best, top / best) for a in row.get("oracle", {}) if speed.get(a)}


def _oracle_of(arm: str, present: dict) -> str | None:
    """The ceiling ``arm`` is judged against: the fastest oracle arm of the cell (whichever engine it ran on)."""
    cands = [o for o in oracle_arms() if o in present]
    return max(cands, key=present.get) if cands else None


def _ratios(by_arm: dict[str, list], med: dict[str, float], ref: str | None, field: str = "tok_s") -> tuple[dict, dict]:
    """({arm: median of its per-repetition ratios to ``ref``}, {arm: [min, max] of them}); an arm that shares no
    repetition with ``ref`` gets the ratio of the medians."""
    if ref is None:
        return {}, {}
    pairs = {a: _pairs(by_arm, a, ref, field) for a in med}
    return ({a: (_median(p) if p else med[a] / med[ref]) for a, p in pairs.items()},
            {a: [min(p), max(p)] for a, p in pairs.items() if p})


def steady_factors(by_arm: dict[str, list]) -> dict[str, dict[str, float]]:
    """{arm: {"tokens": ..., "step": ...}}: the two factors of an arm's steady speed-up over no speculation (its steady
    tokens a step and step time over no speculation's, :func:`_speed_ratios`: pair by pair, the median), the state
    the replay prices; {} where a record holds no steady steps (benches before December 6, a cell that reached none)."""
    tokens = _speed_ratios(by_arm, "steady_tokens_per_step")
    step = _speed_ratios(by_arm, "steady_step_ms")
    return {a: {"tokens": tokens[a], "step": step[a]} for a in tokens if a in step}


def _as_predicted(v) -> Predicted | None:
    """A prediction as :class:`Predicted` (a bare number: the speed-up alone, without its factors)."""
    return v if v is None or isinstance(v, Predicted) else Predicted(float(v))


def rows(records: list, predicted: dict | None = None) -> list[dict]:
    """One row per cell: median tok/s per arm over repetitions with its [min, max]; each arm's ratio to the best
    vLLM arm of the cell (no speculation included), the median of the per-repetition ratios, with their
    spread; to the best vLLM speculation arm and to no speculation likewise; the decode speed-up by TPOT;
    the headroom captured per calib arm, by tok/s and in the decode state (:func:`decode_headroom`); the
    replay's predicted speed-up over no speculation and its relative error against the clock's decode speed-up
    (``predicted / measured − 1``): over the steps in which no request was in prefill, else by TPOT, else tok/s,
    whichever the records hold; and where the steady state was recorded, that speed-up's two factors, tokens a step
    and a step's time over no speculation's, beside the replay's (``steady_factors``, ``predicted_factors``,
    ``prediction_factor_error``: :mod:`calib.evaluate.prediction`). ``predicted``: {(category, sampling,
    concurrency, arm): :class:`Predicted`, or the speed-up alone}. A calib arm's repetition served with
    calib off (``calib_off``) is not counted; a cell where every repetition was is shown as OFF."""
    cells: dict[tuple, dict[str, list]] = {}
    off: dict[tuple, dict[str, str]] = {}
    for r in records:
        c = r["cell"]
        key = (c["category"], c["sampling"], c["concurrency"])
        cells.setdefault(key, {})
        if r.get("calib_off"):
            off.setdefault(key, {})[r["arm"]] = r["calib_off"]
            continue
        cells[key].setdefault(r["arm"], []).append(r)
    out = []
    for key in sorted(cells):
        by_arm = cells[key]
        med = {a: statistics.median(x["tok_s"] for x in rs) for a, rs in by_arm.items()}
        vllm = {a: med[a] for a in vllm_arms() if a in med}
        best = max(vllm, key=vllm.get) if vllm else None
        spec = {a: med[a] for a in vllm_spec_arms() if a in med}
        best_spec = max(spec, key=spec.get) if spec else None

        to_best, spread = _ratios(by_arm, med, best)
        to_spec, _ = _ratios(by_arm, med, best_spec)
        to_none, _ = _ratios(by_arm, med, "none" if "none" in med else None)
        preds = {a: _as_predicted((predicted or {}).get((*key, a))) for a in med}
        pred = {a: None if p is None else p.speedup for a, p in preds.items()}
        decode = _decode_ratios(by_arm)
        steps = _speed_ratios(by_arm, "decode_step_tok_s")
        steady = _speed_ratios(by_arm, "steady_tok_s")
        # the replay prices steady decode: B requests in flight, none in prefill. Its prediction is judged against
        # the steps the clock ran in that state; before those were recorded, against every step without a
        # prefill, TPOT (which still holds the neighbours' prefill chunks) or tok/s, in that order
        measured = {"steady_ratio_to_none": steady, "decode_step_ratio_to_none": steps,
                    "decode_ratio_to_none": decode, "ratio_to_none": to_none}
        basis_name = next((n for n, f in PREDICTION_BASES.items() if measured[f]), "output tok/s")
        basis = measured[PREDICTION_BASES[basis_name]]
        row = {"category": key[0], "sampling": key[1], "concurrency": key[2], "tok_s": med,
               "reps": {a: len(rs) for a, rs in by_arm.items()}, "best_vllm": best, "calib_off": off.get(key, {}),
               "ratio_to_best_vllm": to_best, "ratio_spread": spread,
               "best_vllm_speculative": best_spec, "ratio_to_best_vllm_speculative": to_spec,
               "calib_overhead_pct": {a: statistics.median(x["overhead_pct"] for x in rs)
                                      for a, rs in by_arm.items() if rs[0].get("overhead_pct") is not None},
               "ratio_to_none": to_none,
               "decode_ratio_to_none": decode,  # own prefill excluded: median TPOT of none / the arm's
               "decode_step_ratio_to_none": steps,  # every prefill excluded: steps with no request in prefill
               "steady_ratio_to_none": steady,  # and every client's request in flight: the state the replay prices
               "predicted_vs_none": pred,
               "prediction_basis": basis_name,
               "prediction_error": {a: (p / basis[a] - 1.0) if (p is not None and basis.get(a)) else None
                                    for a, p in pred.items() if a != "none"},
               "prediction_error_tok_s": {a: (p / to_none[a] - 1.0) if (p is not None and to_none.get(a)) else None
                                          for a, p in pred.items() if a != "none"},
               "tok_s_spread": {a: [min(x["tok_s"] for x in rs), max(x["tok_s"] for x in rs)]
                                for a, rs in by_arm.items()}}
        row["steady_factors"] = steady_factors(by_arm)  # {arm: {tokens, step}} over no speculation's
        row["predicted_factors"] = {a: {"tokens": p.tokens, "step": p.step} for a, p in preds.items()
                                    if p is not None and p.tokens is not None}
        row["prediction_factor_error"] = factor_errors(preds, row["steady_factors"])
        row["model_passes_share"] = _passes_share(by_arm)
        row["oracle"] = {a: _oracle_of(a, med) for a in med if a in calib_arms() and _oracle_of(a, med)}
        row["headroom_captured"] = {a: headroom(to_best.get(a), to_best.get(o)) for a, o in row["oracle"].items()}
        row["headroom_captured_decode"] = decode_headroom(row)
        out.append(row)
    return out


def _passes_share(by_arm: dict[str, list]) -> dict[str, float]:
    """Per calib arm that plans the model drafter's passes: the share of vLLM's draft passes it ran, over its
    repetitions (0: the head ran only its idle first pass, the model drafter's fixed cost)."""
    out = {}
    for arm, rs in by_arm.items():
        stats = [x.get("calib") or {} for x in rs]
        engine = sum(st.get("passes_engine", 0) for st in stats)
        if arm in calib_arms() and engine:
            out[arm] = sum(st.get("passes_planned", 0) for st in stats) / engine
    return out


# below this share of vLLM's draft passes, the model drafter is judged not to pay in a cell
IDLE_DRAFTER_SHARE = 0.05


def deploy_lines(table: list[dict]) -> list[str]:
    """Per cell where a calib arm with a model drafter ran under :data:`IDLE_DRAFTER_SHARE` of vLLM's draft passes
    (its tables said the drafter does not pay): which engine to deploy instead, with both arms' ratios (either, where
    the arm on the EAGLE engine measured the faster); an EAGLE engine then still pays its head's pass over the
    requests that joined while the plan ran passes, until they retire, and its memory (calib/vllm/retire.py;
    docs/profile.md)."""
    out = []
    for row in table:
        for arm, share in (row.get("model_passes_share") or {}).items():
            if share >= IDLE_DRAFTER_SHARE:
                continue
            ratio = row["ratio_to_best_vllm"]
            alt = [a for a in calib_arms() if a in ratio and a not in row["model_passes_share"]]
            best_alt = max(alt, key=ratio.get) if alt else None
            if best_alt is None:
                instead = f"deploy {row['best_vllm']} (the best vLLM arm)"
            else:
                alt_x, arm_x = ratio.get(best_alt) or 0.0, ratio.get(arm) or 0.0
                both = f"{best_alt} {fmt_x(ratio.get(best_alt))} vs {arm} {fmt_x(ratio.get(arm))} the best vLLM arm"
                # where the EAGLE engine measured faster all the same, say so rather than advise the slower one
                instead = (f"deploy the n-gram engine ({both})" if alt_x >= arm_x
                           else f"either engine ({both}); the n-gram engine loads no drafter")
                if max(alt_x, arm_x) < 1.0:
                    best = "no speculation" if row["best_vllm"] == "none" else row["best_vllm"]
                    instead += f"; {best} was faster than both here"
            out.append(f"{row['category']}/{row['sampling']}/c{row['concurrency']}: {arm} ran {share:.0%} of the "
                       f"model drafter's passes, which does not pay here: {instead}")
    return out


def unstable(table: list[dict], tolerance: float) -> list[str]:
    """Cells where an arm's per-repetition ratio to the best vLLM arm spreads wider than ``tolerance`` either
    side of its median (``(max − min) / 2 / median``): they need more repetitions."""
    bad = []
    for row in table:
        for a, (lo, hi) in row.get("ratio_spread", {}).items():
            m = row["ratio_to_best_vllm"].get(a)
            if m and (hi - lo) / 2 / m > tolerance:
                bad.append(f"{row['category']}/{row['sampling']}/c{row['concurrency']}/{a}")
    return bad


def unstable_cells(labels: list[str], cells: list[dict]) -> list[dict]:
    """The cells (bench/serve.py's ``{"category", "sampling", "concurrency", ...}``) that :func:`unstable`'s labels
    (``category/sampling/c<C>/arm``) name."""
    named = {tuple(label.split("/")[:3]) for label in labels}
    return [c for c in cells if (c["category"], c["sampling"], f"c{c['concurrency']}") in named]


def fmt_x(v) -> str:
    return "–" if v is None else f"{v:.2f}×"


def fmt_pct(v) -> str:
    """A signed percentage; one that rounds to 0 is written +0% (never -0%)."""
    return "–" if v is None else f"{0.0 if abs(v) < 0.005 else v:+.0%}"


def tok_s_table(table: list[dict], arm_names: list[str]) -> str:
    """Median tok/s [min–max over repetitions] (ratio to the best vLLM arm, pair by pair) per cell and arm."""
    lines = ["| category | sampling | c | " + " | ".join(arm_names) + " | best vLLM arm |",
             "|" + "---|" * (len(arm_names) + 4)]
    for row in table:
        vals = []
        for a in arm_names:
            if a not in row["tok_s"]:
                vals.append("OFF" if a in row["calib_off"] else "–")
                continue
            lo, hi = row["tok_s_spread"][a]
            spread = f" [{lo:.1f}–{hi:.1f}]" if row["reps"][a] > 1 else ""
            r = row["ratio_to_best_vllm"].get(a)
            vals.append(f"{row['tok_s'][a]:.1f}{spread}" + (f" ({r:.2f}×)" if r is not None else ""))
        lines.append(f"| {row['category']} | {row['sampling']} | {row['concurrency']} | " + " | ".join(vals)
                     + f" | {row['best_vllm']} |")
    return "\n".join(lines)


def speedup_table(table: list[dict], arm_names: list[str]) -> str:
    """Per cell and arm: the clock's speed-up over no speculation (tok/s / decode by TPOT / over the steps with
    no request in prefill, where recorded), the replay's prediction in brackets and its error against the
    row's ``prediction_basis``."""
    shown = [a for a in arm_names if a != "none"]
    lines = ["| category | sampling | c | " + " | ".join(shown) + " |", "|" + "---|" * (len(shown) + 3)]
    for row in table:
        vals = []
        for a in shown:
            m, p = row["ratio_to_none"].get(a), row["predicted_vs_none"].get(a)
            d = (row.get("decode_ratio_to_none") or {}).get(a)
            st = (row.get("decode_step_ratio_to_none") or {}).get(a)
            sd = (row.get("steady_ratio_to_none") or {}).get(a)
            e = (row.get("prediction_error") or {}).get(a)
            vals.append(fmt_x(m) + ("" if d is None else f" / {d:.2f}×") + ("" if st is None else f" / {st:.2f}×")
                        + ("" if sd is None else f" / {sd:.2f}×")
                        + ("" if p is None else f" ({p:.2f}×, {fmt_pct(e)})"))
        lines.append(f"| {row['category']} | {row['sampling']} | {row['concurrency']} | " + " | ".join(vals) + " |")
    return "\n".join(lines)


def factor_table(table: list[dict], arm_names: list[str]) -> str | None:
    """Per cell and arm, where the replay's error in the steady state comes from: its tokens a step over no
    speculation's against the clock's, and a step's time likewise, each ``predicted / measured − 1`` (the speed-up's
    error is about the first less the second); None where no row holds both sides."""
    shown = [a for a in arm_names if any(a in (r.get("prediction_factor_error") or {}) for r in table)]
    if not shown:
        return None
    lines = ["| category | sampling | c | " + " | ".join(shown) + " |", "|" + "---|" * (len(shown) + 3)]
    for row in table:
        err = row.get("prediction_factor_error") or {}
        vals = [f"{fmt_pct(err[a]['tokens'])} / {fmt_pct(err[a]['step'])}" if a in err else "–" for a in shown]
        lines.append(f"| {row['category']} | {row['sampling']} | {row['concurrency']} | " + " | ".join(vals) + " |")
    return "\n".join(lines)


def headroom_table(table: list[dict]) -> str | None:
    """Per greedy cell: the best vLLM arm, the oracle's ratio to it and each calib arm's headroom captured."""
    mine = [a for a in calib_arms() if any(a in r.get("headroom_captured", {}) for r in table)]
    if not mine:
        return None
    lines = ["| category | c | best vLLM arm | oracle / best vLLM | " + " | ".join(f"{a}: ratio, headroom" for a in mine)
             + " |", "|" + "---|" * (len(mine) + 4)]
    for row in table:
        if not row.get("headroom_captured"):
            continue
        orcs = sorted({o for o in row["oracle"].values()})
        orc = ", ".join(f"{o} {fmt_x(row['ratio_to_best_vllm'].get(o))}" for o in orcs)
        dec = row.get("headroom_captured_decode") or {}
        vals = [f"{fmt_x(row['ratio_to_best_vllm'].get(a))}, {fmt_pct(row['headroom_captured'].get(a))}"
                + (f" ({fmt_pct(dec[a])} in {row['prediction_basis']})" if dec.get(a) is not None else "")
                if a in row["headroom_captured"] else "–" for a in mine]
        lines.append(f"| {row['category']} | {row['concurrency']} | {row['best_vllm']} | {orc} | " + " | ".join(vals)
                     + " |")
    return "\n".join(lines)


def answer_lines(table: list[dict]) -> list[str]:
    """Per calib arm: its range of ratios to the best vLLM arm (and to the best vLLM speculation arm) and of
    headroom captured, over the cells it served; then the cells it was OFF in."""
    out = []
    for arm in calib_arms():
        r = [row["ratio_to_best_vllm"][arm] for row in table if arm in row["ratio_to_best_vllm"]]
        s = [row["ratio_to_best_vllm_speculative"][arm] for row in table
             if arm in row["tok_s"] and arm in row["ratio_to_best_vllm_speculative"]]
        h = [row["headroom_captured"][arm] for row in table if row.get("headroom_captured", {}).get(arm) is not None]
        if r:
            line = f"{arm}: {min(r):.2f}-{max(r):.2f}x the best vLLM arm (no speculation included)"
            if s:
                line += f", {min(s):.2f}-{max(s):.2f}x the best vLLM speculation arm"
            line += f", over {len(r)} cells"
            if h:
                line += f"; headroom captured {min(h):+.0%} to {max(h):+.0%} over {len(h)} greedy cells"
            d = [row["headroom_captured_decode"][arm] for row in table
                 if (row.get("headroom_captured_decode") or {}).get(arm) is not None]
            if d:
                line += f" ({min(d):+.0%} to {max(d):+.0%} in the decode state, over {len(d)})"
            out.append(line)
        off = [f"{row['category']}/{row['sampling']}/c{row['concurrency']}" for row in table
               if arm in row["calib_off"] and arm not in row["tok_s"]]
        if off:
            out.append(f"{arm}: calib was OFF in {len(off)} cells, not counted ({', '.join(off)}): "
                       f"{next(row['calib_off'][arm] for row in table if arm in row['calib_off'])}")
    return out


def repetitions(result: dict) -> int:
    return len({r["rep"] for r in result.get("runs", [])}) or max(
        (max(row["reps"].values(), default=0) for row in result["table"]), default=0)


def repetitions_text(result: dict) -> str:
    """``"2 repetitions"``, or ``"2-3 repetitions (more where ...)"`` where further repetitions served only the cells
    whose ratios still spread wider than the run's tolerance."""
    counts = [n for row in result["table"] for n in row.get("reps", {}).values()]
    lo, hi = (min(counts), max(counts)) if counts else (repetitions(result),) * 2
    if lo == hi:
        return f"{hi} repetitions"
    return (f"{lo}–{hi} repetitions (more where a ratio still spread wider than ±{result.get('tolerance', 0):.0%} "
            "of its median)")


def prediction_errors(row: dict) -> dict:
    """{arm: predicted / measured speed-up over no speculation − 1} of a row (recomputed for a bench that
    predates the field)."""
    if "prediction_error" in row:
        return row["prediction_error"]
    m = row.get("decode_ratio_to_none") or row.get("ratio_to_none") or {}
    return {a: p / m[a] - 1.0 for a, p in (row.get("predicted_vs_none") or {}).items()
            if p is not None and m.get(a) and a != "none"}


def answer_figures(table: list[dict]) -> dict[str, list[float]]:
    """The answer's figures over a bench's cells, for every place that states it (README/docs blocks, eval's
    report): ``best`` per cell, calib's best arm over the best vLLM arm; ``headroom``, per greedy cell with a
    ceiling, the most headroom a calib arm captured (``headroom_decode``: in the decode state); ``errors``, |the
    replay's error| per (cell, arm)."""
    mine = calib_arms()
    best = [max(row["ratio_to_best_vllm"][a] for a in mine if a in row["ratio_to_best_vllm"])
            for row in table if any(a in row["ratio_to_best_vllm"] for a in mine)]
    errors = [abs(e) for row in table for e in prediction_errors(row).values() if e is not None]
    return {"best": best, "headroom": _most_per_cell(table, "headroom_captured"),
            "headroom_decode": _most_per_cell(table, "headroom_captured_decode"), "errors": errors}


def _most_per_cell(table: list[dict], field: str) -> list[float]:
    """Per row with any figure in ``field`` ({calib arm: headroom or None}), the most a calib arm captured."""
    got = [[v for v in (row.get(field) or {}).values() if v is not None] for row in table]
    return [max(v) for v in got if v]
