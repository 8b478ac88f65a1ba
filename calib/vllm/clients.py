"""Closed-loop clients on an in-process vLLM engine, and what a cell's clock says of them.

:func:`generate` serves prompts as ``concurrency`` clients that each send their next request when the last
one returns (vLLM's ``bench serve`` with a fixed number of users). It records per request when it was
sent, its first token and its end (:func:`latency_figures`: vLLM's TTFT and TPOT), and per engine step its
wall time, the tokens it produced and whether any request in it was still in prefill
(:func:`decode_step_figures`).

Why per step: the replay (``eval.py``) prices decode steps only. TPOT leaves a request's own prefill out
but not its neighbours': at concurrency 16 on code edits, a request's decode shares most of its steps with
another request's prompt chunks (a thousand-token prompt costs tens of decode steps), so TPOT and tok/s
both fold prefill into a speed-up that the replay never modelled. The steps in which every request in
flight had already produced a token are pure decode: their tokens over their time is the decode speed
the replay predicts.
"""

from __future__ import annotations

import math
import statistics
import time

_REQUESTS = iter(range(1 << 62))  # request ids unique across the cells one engine serves


def generate(llm, inputs: list, params: list, concurrency: int, on_done=None, times: list | None = None,
             steps: list | None = None) -> list:
    """Serve ``inputs`` keeping at most ``concurrency`` requests in flight; outputs in input order. ``times``
    (a list) receives per input ``(sent, first token, finished)`` perf_counter seconds (the engine streams
    every step's tokens: ``RequestOutputKind.CUMULATIVE``, vLLM's default); ``steps`` (a list) receives per
    engine step ``(wall seconds, tokens produced, pure decode, requests in flight)``, pure decode meaning
    that every request in flight had produced its first token before the step."""
    engine = llm.llm_engine
    out = [None] * len(inputs)
    clock = [[math.nan] * 3 for _ in inputs]  # [len(inputs)][sent, first token, finished]
    produced = [0] * len(inputs)  # [len(inputs)]: output tokens seen so far
    ids: dict[str, int] = {}
    nxt = inflight = 0
    while nxt < len(inputs) or inflight:
        while nxt < len(inputs) and inflight < concurrency:
            rid = f"calib-{next(_REQUESTS)}"
            ids[rid] = nxt
            clock[nxt][0] = time.perf_counter()
            engine.add_request(rid, inputs[nxt], params[nxt])
            nxt += 1
            inflight += 1
        pure = all(not math.isnan(clock[i][1]) for i in ids.values())
        running = len(ids)
        start = time.perf_counter()
        step_out = engine.step()
        now = time.perf_counter()
        tokens = 0
        for o in step_out:
            i = ids.get(o.request_id)
            if i is None:
                continue
            n = len(o.outputs[0].token_ids) if o.outputs else 0
            tokens += n - produced[i]
            produced[i] = n
            if math.isnan(clock[i][1]) and n:
                clock[i][1] = now
            if o.finished:
                clock[i][2] = now
                out[ids.pop(o.request_id)] = o
                inflight -= 1
                if on_done is not None:
                    on_done()
        if steps is not None:
            steps.append((now - start, tokens, pure, running))
    if times is not None:
        times[:] = [tuple(c) for c in clock]
    return out


def latency_figures(times: list, outputs: list) -> dict:
    """vLLM's ``bench serve`` latencies from :func:`generate`'s ``times``: mean / median TTFT (sent to first
    token) and TPOT (first token to finished, per output token after the first; requests of one token have
    none), milliseconds; and the decode speed they imply, requests in flight aside: ``1000 / median TPOT``
    tokens/s per request (the request's own prefill excluded, unlike ``tok_s``; its neighbours' not)."""
    ttft = [(f - s) * 1e3 for (s, f, _), o in zip(times, outputs) if o is not None and not math.isnan(f)]
    tpot = [(d - f) * 1e3 / (len(o.outputs[0].token_ids) - 1) for (_, f, d), o in zip(times, outputs)
            if o is not None and not math.isnan(f + d) and len(o.outputs[0].token_ids) > 1]
    med = statistics.median(tpot) if tpot else math.nan
    return {"ttft_ms_mean": statistics.fmean(ttft) if ttft else math.nan,
            "ttft_ms_median": statistics.median(ttft) if ttft else math.nan,
            "tpot_ms_mean": statistics.fmean(tpot) if tpot else math.nan, "tpot_ms_median": med,
            "decode_tok_s_per_request": 1e3 / med if tpot and med > 0 else math.nan}


def decode_step_figures(steps: list, concurrency: int | None = None) -> dict:
    """From :func:`generate`'s ``steps``: ``decode_steps`` (pure decode steps: no request in prefill),
    ``decode_step_tok_s`` (their tokens over their wall time: the engine's decode speed with prefill left
    out, what the replay predicts), ``decode_step_share`` (their share of the cell's engine time) and
    ``decode_batch_mean`` (requests in flight per pure decode step, weighted by time); and the same of the
    steady steps, the pure decode steps with ``concurrency`` requests in flight (``steady_*``). NaN without one."""
    pure = [(dt, n, b) for dt, n, p, b in steps if p and dt > 0]
    total = sum(dt for dt, *_ in steps)
    wall = sum(dt for dt, _, _ in pure)
    tokens = sum(n for _, n, _ in pure)
    # steady: pure decode with every client's request in flight, the state the replay prices at B = concurrency
    # (a cell's first and last steps run fewer: its tail, which speculation lengthens, is no steady state)
    steady = [(dt, n) for dt, n, b in pure if concurrency and b == concurrency]
    steady_s = sum(dt for dt, _ in steady)
    out = {"steady_steps": len(steady),
           "steady_tok_s": sum(n for _, n in steady) / steady_s if steady_s > 0 else math.nan,
           "steady_step_ms": 1e3 * steady_s / len(steady) if steady else math.nan,
           "steady_tokens_per_step": sum(n for _, n in steady) / len(steady) if steady else math.nan}
    return {**out, "decode_steps": len(pure),
            "decode_step_tok_s": tokens / wall if wall > 0 else math.nan,
            "decode_step_ms": 1e3 * wall / len(pure) if pure else math.nan,  # mean wall time of one
            "decode_tokens_per_step": tokens / len(pure) if pure else math.nan,  # tokens of one, all requests
            "decode_step_share": wall / total if total > 0 else math.nan,
            "decode_batch_mean": sum(dt * b for dt, _, b in pure) / wall if wall > 0 else math.nan}
