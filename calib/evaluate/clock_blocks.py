"""README/docs figures redrawn from a serving bench's JSON alone (:mod:`calib.evaluate.clock` computes them).

Marked blocks (:data:`BLOCK`): ``<!-- clock:KIND SOURCE -->`` ... ``<!-- /clock -->`` where ``SOURCE`` is the
bench JSON's path relative to the project root and ``KIND`` one of :data:`RENDERERS`; :func:`redraw` rewrites
them, :func:`stale_blocks` says which differ from what their JSON renders (tests/test_doc_blocks.py fails on any).
"""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path

from calib.evaluate.clock import (
    ROOT,
    answer_figures,
    answer_lines,
    basis_ratios,
    calib_arms,
    deploy_lines,
    factor_table,
    fmt_pct,
    fmt_x,
    headroom_table,
    oracle_arms,
    prediction_errors,
    repetitions,
    repetitions_text,
    speedup_table,
    tok_s_table,
    vllm_arms,
)

FACTOR_SENTENCE = ("Where the replay's error comes from, in the steady state: its predicted tokens a step over no "
                   "speculation's against the clock's / a step's time likewise, each predicted / measured − 1 (the "
                   "first is acceptance and the arm's decisions, the second the cost model; the speed-up's error is "
                   "about the first less the second):")
BLOCK = re.compile(r"<!-- clock:(?P<kind>[a-z-]+) (?P<source>\S+) -->\n(?P<body>.*?)<!-- /clock -->", re.DOTALL)


def render_answer(result: dict, source: str, root: Path = ROOT) -> str:
    """The headline: calib's best arm against the best vLLM arm per cell, headroom, the replay's error."""
    table = result["table"]
    figures = answer_figures(table)
    best, head, err = figures["best"], figures["headroom"], figures["errors"]
    wins = sum(b >= 1.0 for b in best)
    served = (f"{repetitions_text(result)}, each cell served by every arm in turn" if result.get("interleave") == "cells"
              else f"{repetitions(result)} repetitions, arms alternated")
    s = (f"**On a clock — the answer** (`{result['command']}`, {result.get('date', '?')}, {result.get('cpu', '?')}, "
         f"{served}; [{Path(source).name}]({source})): ")
    if best:
        s += (f"calib's best arm is **{min(best):.2f}–{max(best):.2f}× the best vLLM arm** of each cell (no "
              f"speculation included; median {statistics.median(best):.2f}×), at least its equal in {wins} of "
              f"{len(best)} cells")
    if head:
        s += (f"; of the clock oracle's headroom over the best vLLM arm it captured {min(head):+.0%} to "
              f"{max(head):+.0%} (median {fmt_pct(statistics.median(head))}, {len(head)} greedy cells)")
    s += _decode_headroom_text(figures["headroom_decode"]) + "."
    lines = [s]
    if err:
        lines += ["", (f"The replay's predicted speed-ups over no speculation missed the clock's decode speed-ups by "
                       f"{statistics.median(err):.0%} (median) to {max(err):.0%} (worst) over {len(err)} (cell, arm) "
                       "pairs: a prediction, second to the clock.")]
    per_arm = answer_lines(table)
    if per_arm:
        lines += ["", *(f"- {line}" for line in per_arm)]
    return "\n".join(lines)


def _decode_headroom_text(decode: list[float]) -> str:
    """The headroom captured in the decode state, beside the tok/s figure ("" where no cell has it)."""
    if not decode:
        return ""
    return (f"; in the decode state (prefill and a cell's draining tail left out) {min(decode):+.0%} to "
            f"{max(decode):+.0%} (median {fmt_pct(statistics.median(decode))}, {len(decode)} cells)")


def _speedup_sentence(result: dict) -> str:
    """What the speed-up table measures and what the replay's error is taken against: the clock's figures a
    bench recorded (the steady state and the decode steps from December 5 on)."""
    table = result["table"]
    steady = any(r.get("steady_ratio_to_none") for r in table)
    steps = steady or any(r.get("decode_step_ratio_to_none") for r in table)
    measures = "output tok/s (prefill included) / decode speed by TPOT"
    if steps:
        measures += (" (a request's own prefill left out, its neighbours' chunks not) / decode speed over the engine "
                     "steps in which no request was in prefill")
    if steady:
        measures += " / over those of them with every client's request in flight (the steady state)"
    against = ("the last, the state the replay prices" if steady else
               "the last, the speed-up of the steps the replay prices" if steps else "the decode speed-up")
    return (f"Speed-up over no speculation, measured: {measures}; in brackets the replay's prediction for the same "
            f"cell (`python eval.py`, {result.get('cost_model')} cost model; a prediction, not a clock) and its "
            f"error against {against}:")


def render_tables(result: dict, source: str, root: Path = ROOT) -> str:
    """The bench's full tables (tok/s, speed-up over no speculation with the replay's prediction, headroom)."""
    arm_names = list(result["arms"])
    ident = result.get("identity_float32_greedy")
    same = (", ".join(f"{a} {o['identical']}/{o['prompts']}" for a, o in ident.items()) if ident else "not run")
    served = (f"every arm's engine alive and each cell served by every arm in turn, {repetitions_text(result)}"
              if result.get("interleave") == "cells" else f"arms alternated within each of {repetitions(result)} "
              "repetitions")
    parts = [f"Measured on the clock by `{result['command']}` on {result.get('date', '?')} ({result.get('cpu', '?')}, "
             f"{result['wall_s'] / 60:.0f} min, all arms in one run, {served}; [{Path(source).name}]({source})). "
             "Output tokens/s, median [min–max over the repetitions] (ratio to the best vLLM arm of the cell, no "
             "speculation included, "
             + ("the median of the per-repetition ratios):" if any("ratio_spread" in r for r in result["table"])
                else "the ratio of the medians: this bench predates pairwise ratios):"),
             "", tok_s_table(result["table"], arm_names), "",
             _speedup_sentence(result), "",
             speedup_table(result["table"], arm_names)]
    factors = factor_table(result["table"], arm_names)
    if factors:
        parts += ["", FACTOR_SENTENCE, "", factors]
    head = headroom_table(result["table"])
    if head:
        parts += ["", ("Headroom captured on the clock, per greedy cell: (calib − best vLLM arm) / (oracle − best "
                       "vLLM arm), the fastest oracle arm of the cell (it verifies exactly what the reference output "
                       "accepts); none where the oracle is not 2 % above the best vLLM arm"
                       + ("; in brackets the same quotient in the decode state the replay prices, the best vLLM arm "
                          "and the oracle taken there too (prefill and a cell's draining tail weigh on every arm's "
                          "tok/s alike and shrink the oracle's margin towards the clock's noise)"
                          if any(r.get("headroom_captured_decode") for r in result["table"]) else "") + ":"),
                  "", head]
    deploy = deploy_lines(result["table"])
    if deploy:
        # what an EAGLE engine still paid for its head in the run: every step's idle pass before calib retired requests
        # from the model chain (no head_skipped count), each request's prefill and first steps before it retired them
        # at admission too (no retired_at_admission count)
        counts = [r.get("calib") or {} for r in result.get("runs", [])]
        cost = ("still costs its head's pass over the requests that joined while the plan ran passes, until calib "
                "retires them from the model chain, and the model drafter's memory"
                if any("retired_at_admission" in c for c in counts) else
                "still costs its head's prefill and its pass over each request's first steps, until calib retires the "
                "request from the model chain" if any("head_skipped" in c for c in counts) else
                "costs its head's idle first pass every step")
        parts += ["", f"Where the tables say the model drafter does not pay (an EAGLE engine then {cost}):", "",
                  *(f"- {line}" for line in deploy)]
    parts += ["", f"float32 greedy outputs identical to no speculation (concurrency 4): {same}."]
    return "\n".join(parts)


def render_predictions(result: dict, source: str, root: Path = ROOT, tolerance: float = 0.10) -> str:
    """The replay's prediction beside the clock, arm by arm and cell by cell, and how many pairs are within
    ``tolerance``: the block for a bench's cells re-predicted by another replay (``--retable``)."""
    table, shown = result["table"], [a for a in result["arms"] if a != "none"]
    errors = [(row, a, e) for row in table for a, e in prediction_errors(row).items() if e is not None]
    within = sum(abs(e) <= tolerance for _, _, e in errors)
    how = (f"re-predicted by `{result['retable_command']}`" if result.get("retable_command") else
           f"predicted by `{result.get('replay')}`")
    lines = [(f"The replay's predicted speed-up over no speculation (a prediction) beside the clock's (measured, "
             f"`{result['command']}`, {result.get('date', '?')}), {how} ([{Path(source).name}]({source})): "
             f"**{within} of {len(errors)} (cell, arm) pairs within ±{tolerance:.0%}**. Each entry: measured → "
             "predicted (error), measured as the cell's basis (the steady state, else the decode steps):"), "",
             "| category | sampling | c | basis | " + " | ".join(shown) + " |", "|" + "---|" * (len(shown) + 4)]
    for row in table:
        measured, err = basis_ratios(row), prediction_errors(row)
        vals = [f"{fmt_x(measured.get(a))} → {fmt_x(row['predicted_vs_none'].get(a))} ({fmt_pct(err.get(a))})"
                if row["predicted_vs_none"].get(a) is not None else "–" for a in shown]
        lines.append(f"| {row['category']} | {row['sampling']} | {row['concurrency']} | {row.get('prediction_basis')} "
                     "| " + " | ".join(vals) + " |")
    factors = factor_table(table, list(result["arms"]))
    if factors:
        lines += ["", FACTOR_SENTENCE, "", factors]
    return "\n".join(lines)


def latest_cells(manifest: dict, root: Path = ROOT) -> list[tuple[dict, str, dict]]:
    """``(row, source, result)`` per cell of a grid manifest (``{"sources": [bench JSON, ...]}``, oldest first, paths
    relative to the project root): each cell's row from the last source that served it, in grid order."""
    sources = manifest.get("sources")
    if not (isinstance(sources, list) and sources and all(isinstance(x, str) for x in sources)):
        raise ValueError(f"a grid manifest's `sources` is a non-empty list of bench JSON paths (oldest first), got "
                         f"{sources!r}")
    latest: dict[tuple, tuple[dict, str, dict]] = {}
    for source in sources:
        path = root / source
        if not path.is_file():
            raise FileNotFoundError(f"the grid manifest lists {source}, which is not a file under {root}")
        try:
            result = json.loads(path.read_text())
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"the grid manifest lists {source}, which is not JSON ({exc})") from None
        if not (isinstance(result, dict) and isinstance(result.get("table"), list)):
            raise ValueError(f"the grid manifest lists {source}, which is not a bench/serve.py result (no `table`)")  # noqa: TRY004
        for i, row in enumerate(result["table"]):
            cell = [row.get(k) for k in ("category", "sampling", "concurrency")] if isinstance(row, dict) else None
            if cell is None or None in cell:
                raise ValueError(f"the grid manifest lists {source}, whose table row {i} names no cell (category, "
                                 f"sampling, concurrency): {str(row)[:120]}; re-table it (bench/serve.py --retable)")
            latest[tuple(cell)] = (row, source, result)
    if not latest:
        raise ValueError(f"the grid manifest's sources {sources} hold no cell (every `table` is empty); list the "
                         "bench/serve.py results that served the grid")
    return [latest[k] for k in sorted(latest, key=lambda k: (k[1] != "greedy", k[0], k[2]))]


def _oracle_vs_ngram(row: dict, field: str) -> float | None:
    """The fastest clock oracle of a greedy cell over vLLM's n-gram arm, by ``field`` (pairwise tok/s ratios, or a
    speed-up over no speculation)."""
    ratios = row.get(field) or {}
    ngram = ratios.get("vllm_ngram")
    oracles = [ratios[a] for a in oracle_arms() if ratios.get(a) is not None]
    return max(oracles) / ngram if oracles and ngram else None


def render_grid(manifest: dict, source: str, root: Path = ROOT, tolerance: float = 0.10) -> str:
    """One answer over the whole grid: each cell as its latest run measured it (:func:`latest_cells`), calib's best
    arm against the best vLLM arm that run served, the clock oracle against vLLM's n-gram arm, headroom captured
    and the replay's errors, every figure from the JSON named in its row."""
    cells = latest_cells(manifest, root)
    figures = answer_figures([row for row, _, _ in cells])
    best, head, errors = figures["best"], figures["headroom"], figures["errors"]  # errors: |the replay's error|
    # per cell: the fastest oracle over vLLM's n-gram arm by output tok/s and in the steady state
    oracle = [(_oracle_vs_ngram(row, "ratio_to_best_vllm"), _oracle_vs_ngram(row, "steady_ratio_to_none"))
              for row, _, _ in cells]
    by_tok = [t for (row, _, _), (t, _) in zip(cells, oracle) if row["sampling"] == "greedy" and t is not None]
    by_steady = [v for (row, _, _), (_, v) in zip(cells, oracle) if row["sampling"] == "greedy" and v is not None]
    peers = sorted({a for _, _, res in cells for a in res["arms"] if a in vllm_arms()})
    lines = [(f"**The answer on the clock, cell by cell** (each cell of the grid as its latest run measured it, "
              f"[{Path(source).name}]({source}); vLLM arms served: {', '.join(peers)}): calib's best arm is "
              f"**{min(best):.2f}–{max(best):.2f}× the best vLLM arm** of each cell, ≥ 0.98× in "
              f"{sum(b >= 0.98 for b in best)} of {len(best)} cells and ≥ 1.00× in {sum(b >= 1.0 for b in best)}; "
              f"the clock oracle is ≥ 1.00× vLLM's n-gram arm in {sum(v >= 1.0 for v in by_tok)} of {len(by_tok)} "
              f"greedy cells by output tok/s ({sum(v >= 1.0 for v in by_steady)} of {len(by_steady)} in the steady "
              f"decode state)" + (f"; of its headroom calib captured {min(head):+.0%} to {max(head):+.0%} (median "
                                  f"{fmt_pct(statistics.median(head))}, {len(head)} cells with a ceiling)" if head
                                  else "")
              + _decode_headroom_text(figures["headroom_decode"])
              + (f"; the replay (a prediction) put {sum(e <= tolerance for e in errors)} of {len(errors)} "
                 f"(cell, arm) pairs within ±{tolerance:.0%}." if errors else "; no replay predicted these runs.")),
             "",
             ("| category | sampling | c | best vLLM arm | calib's best arm [spread] | clock oracle / vLLM n-gram "
              f"(tok/s, steady) | headroom captured | replay within ±{tolerance:.0%} | run |"), "|" + "---|" * 9]
    for (row, src, _), (tok, steady) in zip(cells, oracle):
        mine = [a for a in calib_arms() if a in row["ratio_to_best_vllm"]]
        arm = max(mine, key=lambda a: row["ratio_to_best_vllm"][a]) if mine else None
        spread = (row.get("ratio_spread") or {}).get(arm)
        calib = "–" if arm is None else (f"{arm} {fmt_x(row['ratio_to_best_vllm'][arm])}"
                                         + (f" [{spread[0]:.2f}–{spread[1]:.2f}]" if spread else ""))
        orc = "–" if tok is None else f"{fmt_x(tok)}, {fmt_x(steady)}"
        got = [v for v in (row.get("headroom_captured") or {}).values() if v is not None]
        dec = [v for v in (row.get("headroom_captured_decode") or {}).values() if v is not None]
        err = [e for e in prediction_errors(row).values() if e is not None]
        within = f"{sum(abs(e) <= tolerance for e in err)} of {len(err)}" if err else "–"
        head = (fmt_pct(max(got)) if got else "–") + (f" ({fmt_pct(max(dec))} decode)" if dec else "")
        lines.append(f"| {row['category']} | {row['sampling']} | {row['concurrency']} | {row['best_vllm']} | {calib} "
                     f"| {orc} | {head} | {within} | [{Path(src).name}]({src}) |")
    return "\n".join(lines)


RENDERERS = {"answer": render_answer, "tables": render_tables, "predictions": render_predictions, "grid": render_grid}


def render(kind: str, source: str, root: Path = ROOT) -> str:
    if kind not in RENDERERS:
        raise ValueError(f"clock block kind {kind!r}: choose one of {sorted(RENDERERS)}")
    path = root / source
    if not path.is_file():
        raise FileNotFoundError(f"clock block cites {source}, which is not a file under {root}")
    return RENDERERS[kind](json.loads(path.read_text()), source, root)


def _rel(doc: Path, source: str, root: Path) -> str:
    """``source`` (relative to the project root) as a link relative to ``doc``'s folder."""
    import os

    return os.path.relpath(root / source, doc.resolve().parent)


def _body(doc: Path, m: re.Match, root: Path) -> str:
    """A marked block's text as its JSON renders it, its link relative to ``doc``."""
    return render(m["kind"], m["source"], root).replace(f"]({m['source']})", f"]({_rel(doc, m['source'], root)})")


def redraw(doc: Path, root: Path = ROOT, only: str | None = None) -> int:
    """Rewrite every marked block of ``doc`` (those citing ``only``, if given) from its JSON; the number
    rewritten. Written to a temp name, then renamed."""
    from calib.atomic import write_text_atomic

    text = doc.read_text()
    n = 0

    def sub(m):
        nonlocal n
        if only is not None and m["source"] != only:
            return m[0]
        n += 1
        return f"<!-- clock:{m['kind']} {m['source']} -->\n{_body(doc, m, root)}\n<!-- /clock -->"

    new = BLOCK.sub(sub, text)
    if new != text:
        write_text_atomic(doc, new)
    return n


def stale_blocks(doc: Path, root: Path = ROOT) -> list[str]:
    """The marked blocks of ``doc`` whose text differs from what their JSON renders (``file:line kind source``)."""
    text = doc.read_text()
    bad = []
    for m in BLOCK.finditer(text):
        if m["body"].rstrip("\n") != _body(doc, m, root):
            line = text[: m.start()].count("\n") + 1
            bad.append(f"{doc}:{line} clock:{m['kind']} {m['source']}: differs from what its JSON renders "
                       f"(`python bench/serve.py --from-json {m['source']} --readme {doc}` redraws it)")
    return bad
