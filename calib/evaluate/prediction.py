"""The replay's prediction of a served arm: its goodput over no speculation's, read from eval's ladder.

A served arm (:class:`calib.policies.Arm` of a servable policy) maps to one replay row: the policy's
own row (``fixed``: ``fixed_<K>``) on the bank drafted by the arm's speculative method at the cell's
temperature, at ``B`` = the cell's concurrency. A prediction, not a clock: bench/serve.py prints it
beside the measured tokens/s of the same cell.
"""

from __future__ import annotations

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


def predicted_speedup(metrics: dict, *, row: str, method: str | None, temperature: float, category: str,
                      batch: int, cost_model: str, kinds: dict | None = None) -> float | None:
    """The replay's goodput of ``row`` over ``no_spec``'s in one cell, or None where eval did not replay
    it (no bank drafted by ``method`` at ``temperature``, that ``batch`` or ``cost_model``). ``method``
    None (no speculation) predicts 1. ``kinds``: :func:`bank_kinds` of ``metrics``, when a caller
    predicts many cells (read here otherwise)."""
    if method is None:
        return 1.0
    kinds = bank_kinds(metrics) if kinds is None else kinds
    banks = [name for name, (m, t) in kinds.items() if m == method and abs(t - temperature) < 1e-9]
    for bank in banks:
        gp = {r["policy"]: r["goodput"] for r in metrics.get("ladder", [])
              if r["bank"] == bank and r["batch_size"] == batch and r["category"] == category
              and r["cost_model"] == cost_model}
        if row in gp and gp.get("no_spec"):
            return gp[row] / gp["no_spec"]
    return None
