"""The replay's prediction of a served arm: its goodput over no speculation's, read from eval's ladder.

A served arm (:class:`calib.policies.Arm` of a servable policy) maps to one replay row: the policy's
own row (``fixed``: ``fixed_<K>``) on the bank drafted by the arm's speculative method at the cell's
temperature, at ``B`` = the cell's concurrency. A prediction, not a clock: bench/serve.py prints it
beside the measured tokens/s of the same cell, and its two factors beside the clock's (:class:`Predicted`):
where the replay misses, whether it mispredicted the tokens a step or the price of the step.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from calib.sidefiles import read_json


def bank_kinds(metrics: dict) -> dict[str, tuple[str, float]]:
    """``{bank name: (speculative method, sampling temperature)}`` of the banks eval replayed (from each
    bank's run_manifest.json; banks without one are left out)."""
    out = {}
    for b in metrics.get("banks", []):
        manifest = Path(b.get("path", "")) / "run_manifest.json"
        if not manifest.is_file():
            continue
        m = read_json(manifest)
        method = m.get("method") or str(m.get("speculator", "")).split(":")[0]
        temp = (m.get("sampling") or {}).get("temperature")
        if method and temp is not None:
            out[b["name"]] = (method, float(temp))
    return out


def replay_row(policy_name: str, family: bool, k: int, dynamic=None, batch: int | None = None) -> str:
    """The ladder row a served policy is replayed as: a family serves its ``_<K>`` member; a policy served
    with a Dynamic SD schedule (``dynamic``: ``((first batch, last batch, K), ...)``, K capped at ``k``, what
    the engine is given) serves ``fixed_<K>`` of the schedule's K at ``batch`` (``no_spec`` where it is 0),
    not the policy's own row (``vllm_dsd``'s is the best table in hindsight, which the engine does not run)."""
    if dynamic:
        kb = next((min(int(g), k) for a, b, g in dynamic if int(a) <= int(batch) <= int(b)), k)
        return f"fixed_{kb}" if kb else "no_spec"
    return f"{policy_name}_{k}" if family else policy_name


@dataclass(frozen=True)
class Predicted:
    """The replay's prediction of one served arm in one cell, over no speculation's: ``speedup`` (goodput) and
    its two factors, ``speedup = tokens / step``: ``tokens``, the tokens a step commits (each lane's
    ``tokens_per_round``: 1 + accepted per request), and ``step``, a step's time (``tokens_per_round / goodput``).
    None where the ladder row records no tokens (an older metrics.json): the speed-up alone."""

    speedup: float
    tokens: float | None = None
    step: float | None = None


NOT_SPECULATING = Predicted(1.0, 1.0, 1.0)


def predicted(metrics: dict, *, row: str, method: str | None, temperature: float, category: str, batch: int,
              cost_model: str, kinds: dict | None = None) -> Predicted | None:
    """The replay's :class:`Predicted` of ``row`` in one cell, or None where eval did not replay it (no bank
    drafted by ``method`` at ``temperature``, that ``batch`` or ``cost_model``). ``method`` None (no speculation)
    predicts :data:`NOT_SPECULATING`. ``kinds``: :func:`bank_kinds` of ``metrics``, when a caller predicts many
    cells (read here otherwise)."""
    if method is None:
        return NOT_SPECULATING
    kinds = bank_kinds(metrics) if kinds is None else kinds
    banks = [name for name, (m, t) in kinds.items() if m == method and abs(t - temperature) < 1e-9]
    for bank in banks:
        at = {r["policy"]: r for r in metrics.get("ladder", [])
              if r["bank"] == bank and r["batch_size"] == batch and r["category"] == category
              and r["cost_model"] == cost_model}
        arm, none = at.get(row), at.get("no_spec")
        if arm is None or none is None or not none.get("goodput"):
            continue
        speedup = arm["goodput"] / none["goodput"]
        if arm.get("tokens_per_round") and none.get("tokens_per_round"):
            tokens = arm["tokens_per_round"] / none["tokens_per_round"]
            return Predicted(speedup, tokens, tokens / speedup)
        return Predicted(speedup)
    return None


def factor_errors(predictions: dict[str, Predicted | None], measured: dict[str, dict[str, float]]) -> dict:
    """{arm: {"tokens": predicted / measured − 1, "step": likewise}}: where the replay's error comes from, the
    tokens a step (its acceptance and its decisions) or the step's price (the cost model), for the arms with both
    factors on both sides (``measured``: :func:`calib.evaluate.clock.steady_factors`; no speculation, 1 against 1
    by construction, left out)."""
    out = {}
    for arm, p in predictions.items():
        m = measured.get(arm)
        if arm == "none" or p is None or p.tokens is None or p.step is None or not m:
            continue
        out[arm] = {"tokens": p.tokens / m["tokens"] - 1.0, "step": p.step / m["step"] - 1.0}
    return out
