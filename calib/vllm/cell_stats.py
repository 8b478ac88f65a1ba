"""What an engine's counters say about one served cell, and the state an engine forgets between cells.

vLLM's own spec-decode counters (``LLM.get_metrics``) per engine step, calib's serving statistics (this process's,
or the output rank's under tensor parallelism) differenced over the cell, the hooks' share of the wall time, and
the one-screen summary; :func:`forget_served` empties what the warm-up and earlier cells left behind, so that
every arm starts every cell from the same state (calib.vllm.serve_runner.serve_cell, bench/serve.py)."""

from __future__ import annotations

import logging

log = logging.getLogger("calib.serve")

_COUNTERS = {"vllm:spec_decode_num_drafts": "num_drafts", "vllm:spec_decode_num_draft_tokens": "num_draft_tokens",
             "vllm:spec_decode_num_accepted_tokens": "num_accepted_tokens", "vllm:generation_tokens": "generation_tokens",
             "vllm:iteration_tokens_total": "iterations"}


def spec_counters(llm) -> dict:
    """vLLM's own counters (``LLM.get_metrics``): spec-decode drafts / draft tokens / accepted, engine steps."""
    out = {}
    try:
        metrics = llm.get_metrics()
    except Exception:  # noqa: BLE001 - stats off or unavailable: the figures are then absent
        return out
    for m in metrics:
        key = _COUNTERS.get(m.name)
        if key is None:
            continue
        if key == "iterations":  # a histogram: one observation per engine step
            out[key] = out.get(key, 0) + int(getattr(m, "count", 0))
        elif hasattr(m, "value"):
            out[key] = out.get(key, 0) + int(m.value)
    return out


def step_figures(c: dict) -> dict:
    steps = c.get("iterations", 0)
    return {"steps": steps,
            "mean_verified_per_step": c.get("num_draft_tokens", 0) / steps if steps else 0.0,
            "mean_accepted_per_step": c.get("num_accepted_tokens", 0) / steps if steps else 0.0,
            "acceptance_rate": (c.get("num_accepted_tokens", 0) / c["num_draft_tokens"]
                                if c.get("num_draft_tokens") else None)}


def _stats_snapshot(st) -> dict | None:
    return None if st is None else {k: (list(v) if isinstance(v, list) else v) for k, v in st.as_dict().items()}


def _rank_snapshot(worker) -> dict | None:
    """In a worker process (``LLM.collective_rpc``): its serving statistics and its ranks' checks."""
    from calib.vllm import serving

    srv = serving.server()
    snap = _stats_snapshot(srv.stats) if srv is not None else None
    if snap is not None and srv.ranks is not None:
        snap.update(rank_checks=srv.ranks.checks, rank_disagreements=srv.ranks.disagreements)
    return snap


def _forget_in_worker(worker) -> dict:
    """In a worker (``LLM.collective_rpc``): the suffix trees' finished responses evicted, vLLM's suffix drafter's
    and calib's recomputed chains'; how many of each. calib's stand-aside stretch ends too (a stretch kept for a batch
    of the same size and temperatures would otherwise carry over into the next cell), and what it learnt while
    serving, the online correction and the step clock (a cell of code edits after one of chat read chat's acceptance
    and prices at first: on December 7 calib on the EAGLE engine verified 9 draft tokens a step there after chat, 27
    before it)."""
    from calib.chains.suffix import forget_responses
    from calib.vllm import serving

    cache = getattr(getattr(getattr(worker, "model_runner", None), "drafter", None), "suffix_cache", None)
    srv = serving.server()
    if srv is not None:
        srv.aside.forget()
        if srv.decider is not None:
            srv.decider.forget_learned()
        if srv.clock is not None:
            srv.clock.forget()
            srv.stats.clock.clear()  # its per-batch summary: the next cell's batches only
    return {"vllm": forget_responses(cache) if cache is not None else 0,
            "calib": sum(rec.forget_responses() for rec in (srv.recomputed.values() if srv is not None else ()))}


def forget_served(llm) -> None:
    """Before a timed cell: the engine forgets what the warm-up and earlier cells served, so that every arm starts
    every cell from the same state. vLLM's prefix cache is emptied (a re-served prompt is otherwise mostly cached,
    and an EAGLE engine re-computes a block more of it than other engines do: 128 tokens on this CPU backend), and
    the suffix trees' finished responses are evicted (they would draft a re-served greedy prompt from its own
    earlier output). Between cells only, never within one: a cell's own repeats stay what a server would see."""
    if llm.llm_engine.has_unfinished_requests():
        raise RuntimeError("forget_served: requests are still in flight; call it between cells")
    if not llm.reset_prefix_cache():
        log.warning("vLLM did not reset its prefix cache (requests still running?); the cell may reuse what an "
                    "earlier one cached")
    llm.collective_rpc(_forget_in_worker)


def serving_snapshot(llm) -> dict | None:
    """calib's serving statistics of the engine: this process's, or, where the engine runs its workers in
    processes of their own (tensor parallelism), the output rank's read through vLLM's ``collective_rpc``,
    with every rank's count of disagreements summed (calib.vllm.ranks)."""
    from calib.vllm import serving

    try:
        tp = int(llm.llm_engine.vllm_config.parallel_config.tensor_parallel_size)
    except AttributeError:  # a stand-in engine (tests): one process
        tp = 1
    if tp <= 1:
        return _stats_snapshot(serving.stats())
    snaps = llm.collective_rpc(_rank_snapshot)  # one per rank, in rank order: rank 0 is the output rank
    first = snaps[0]
    if first is not None:
        first["rank_disagreements"] = sum(int((s or {}).get("rank_disagreements", 0)) for s in snaps)
    return first


def stats_delta(a: dict | None, b: dict | None) -> dict | None:
    """The serving statistics of one cell: counters differenced (a tally of counters, ``history``, key by key),
    per-step lists sliced."""
    if b is None:
        return None
    a = a or {}
    out = {}
    for k, v in b.items():
        if isinstance(v, list):
            out[k] = v[len(a.get(k, [])):]
        elif _counter(v):
            out[k] = v - a.get(k, 0)
        elif isinstance(v, dict) and v and all(_counter(x) for x in v.values()):
            before = a.get(k) or {}
            out[k] = {name: x - before.get(name, 0) for name, x in v.items()}
        else:
            out[k] = v
    return out


def _counter(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def calib_figures(st: dict | None, wall: float) -> dict:
    if st is None:
        return {"allocator_ms_per_step": None, "calib": None}
    hook_ms = sum(st["hook_ms"]) + sum(st["plan_ms"]) + sum(st.get("observe_ms", []))
    return {"allocator_ms_per_step": sum(st["allocator_ms"]) / max(1, st["decided"]),
            "calib_ms_per_step": hook_ms / max(1, st["steps"]),
            "overhead_pct": 100.0 * hook_ms / 1e3 / wall if wall > 0 else None,
            "draft_ms_per_step": sum(st["draft_ms"]) / len(st["draft_ms"]) if st["draft_ms"] else None,
            "step_ms_median": sorted(st["step_ms"])[len(st["step_ms"]) // 2] if st["step_ms"] else None,
            "calib": {k: v for k, v in st.items() if not isinstance(v, list)}}


def summary(r: dict) -> str:
    """One screen: the answer first (tokens/s), then what speculation and calib did."""
    lines = [(f"{r['policy']} ({r['speculative']}, K={r['num_speculative_tokens']}) on {r['n_prompts']} "
              f"{r['prompts']} prompts, concurrency {r['concurrency']}, {r['sampling']}: "
              f"{r['tok_s']:.1f} tok/s ({r['output_tokens']} tokens in {r['wall_s']:.1f} s; TTFT "
              f"{r.get('ttft_ms_median', float('nan')):.0f} ms, TPOT {r.get('tpot_ms_median', float('nan')):.1f} ms, "
              "medians)")]
    if r["steps"]:
        lines.append(f"  {r['steps']} engine steps; per step {r['mean_verified_per_step']:.2f} draft tokens verified, "
                     f"{r['mean_accepted_per_step']:.2f} accepted")
    c = r.get("calib")
    if c:
        lines.append(f"  calib: {c['decided']} of {c['steps']} steps decided, {c['replaced']} of {c['requests']} "
                     f"request-steps changed ({c['truncated']} truncated, {c['substituted']} substituted, "
                     f"{c['emptied']} emptied); draft tokens {c['tokens_engine']} -> {c['tokens_out']}")
        if c.get("aside_engine") or c.get("aside_none"):
            lines.append(f"  stood aside on {c['aside_engine']} steps (vLLM's own drafts handed through) and "
                         f"{c['aside_none']} (no draft tokens scheduled)")
        if c.get("clock_probes"):
            lines.append(f"  {c['clock_probes']} steps without draft tokens for the step clock (knob clock_probe)")
        if c.get("planned"):
            lines.append(f"  draft passes {c['passes_engine']} -> {c['passes_planned']} on {c['planned']} steps")
        if c.get("oracle"):
            lines.append(f"  clock oracle: {c['oracle_known']} request-steps decided from the reference, "
                         f"{c['oracle_unknown']} unknown (vLLM's drafts kept); {c.get('oracle_padded', 0)} draft "
                         "tokens padded past the accepted prefix for a cheaper step")
        lines.append(f"  overhead {r['overhead_pct']:.1f}% of wall ({r['calib_ms_per_step']:.2f} ms/step; allocator "
                     f"{r['allocator_ms_per_step']:.2f} ms/step)"
                     + (f"; OFF: {c['disabled_reason']}" if c.get("disabled_reason") else "")
                     + (f"; {c['errors']} hook errors" if c.get("errors") else ""))
    return "\n".join(lines)
