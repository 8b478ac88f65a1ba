"""Routing captures from vLLM for real MoE targets: ``enable_return_routed_experts``.

vLLM 0.32 returns, per finished request, the experts each token routed to in every MoE layer
(``LLM(..., enable_return_routed_experts=True)`` → ``RequestOutput.outputs[0].routed_experts``,
``[seq_len, layers, top_k]``, prompt included unless ``SamplingParams.routed_experts_prompt_start``
skips it). That is the routing of the *committed* sequence, so it covers every round's accepted
positions (block indices 0..accept) and not its rejected drafts. :func:`routing_rows` turns it and
the collector's captured rounds (:mod:`calib.vllm.capture` records: ``context_len``, ``accepted``)
into the public routing layout with the bank's keys (the same ``round_idx`` as
:func:`calib.collect.assemble.build_tables`), ready for ``write_bank(..., routing=...)``.

Not wired into ``collect.py`` here (the runner is another module's): the runner would pass
``enable_return_routed_experts=True`` to ``LLM``, keep ``routed_experts`` per prompt and hand
:func:`routing_rows`'s result to ``write_bank``. Dense targets (the SmolLM2 testbed) return nothing;
their proxy routing comes from :mod:`calib.moe.capture`.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from calib.bank import schema


def routing_rows(rounds: dict[int, list[dict]], routed: dict[int, np.ndarray], categories: dict[int, str],
                 model: str, speculator: str, config: str, request_offset: int = 0,
                 ) -> tuple[np.ndarray, pa.Table]:
    """(uint8 [N, layers, top_k], routing_meta table) for the accepted positions of every round.

    ``rounds[idx]``: the captured records of prompt ``idx`` in step order (round_idx = list index);
    ``routed[idx]``: vLLM's ``routed_experts`` for that request, indexed by absolute position. A
    round's block starts at ``context_len - 1`` (the last committed token, fed in that pass).
    Positions beyond the returned array (the final token is never fed) are skipped.
    """
    experts, cols = [], {k: [] for k in (*schema.KEYS, *schema.ROUTING_META_COLUMNS)}
    for req, idx in enumerate(sorted(rounds)):
        arr = routed.get(idx)
        if arr is None:
            raise ValueError(f"prompt {idx}: vLLM returned no routed_experts (is the target an MoE model "
                             "and enable_return_routed_experts on?)")
        arr = np.asarray(arr)
        if arr.ndim != 3:
            raise ValueError(f"prompt {idx}: routed_experts must be [seq_len, layers, top_k], got {arr.shape}")
        if arr.size and (arr.min() < 0 or arr.max() > 255):
            raise ValueError(f"prompt {idx}: expert ids outside 0..255 do not fit the uint8 layout")
        for r_idx, rec in enumerate(rounds[idx]):
            start = int(rec["context_len"]) - 1
            for j in range(int(rec["accepted"]) + 1):
                pos = start + j
                if pos >= arr.shape[0]:
                    break
                for k, v in (("model", model), ("speculator", speculator), ("config", config),
                             ("category", categories[idx]), ("prompt_idx", idx), ("turn", 0), ("round_idx", r_idx),
                             ("routing_idx", len(experts)), ("routing_block_idx", j),
                             ("request_idx", request_offset + req), ("position", pos), ("accepted", True)):
                    cols[k].append(v)
                experts.append(arr[pos])
    types = {**schema.KEY_TYPES, **schema.ROUTING_META_COLUMNS}
    meta = pa.table({k: pa.array(v, type=types[k]) for k, v in cols.items()})
    if not experts:
        return np.zeros((0, 0, 0), dtype=np.uint8), meta
    return np.stack(experts).astype(np.uint8), meta


def routing_rows_from_capture(rounds: dict[int, list[dict]], categories: dict[int, str], model: str,
                              speculator: str, config: str) -> tuple[np.ndarray, pa.Table]:
    """The same layout from the collector's own routing hook (``routing.capture=true``): every position of
    every verify block, rejected drafts included (``accepted`` = block index <= accepted)."""
    experts, cols = [], {k: [] for k in (*schema.KEYS, *schema.ROUTING_META_COLUMNS)}
    for req, idx in enumerate(sorted(rounds)):
        for r_idx, rec in enumerate(rounds[idx]):
            if "routing" not in rec:
                raise ValueError(f"prompt {idx} round {r_idx}: the capture has no routing (collect with "
                                 "`python collect.py routing.capture=true` on an MoE target)")
            block = np.asarray(rec["routing"])
            for j in range(block.shape[0]):
                for k, v in (("model", model), ("speculator", speculator), ("config", config),
                             ("category", categories[idx]), ("prompt_idx", idx), ("turn", 0), ("round_idx", r_idx),
                             ("routing_idx", len(experts)), ("routing_block_idx", j), ("request_idx", req),
                             ("position", int(rec["routing_start"]) + j), ("accepted", j <= int(rec["accepted"]))):
                    cols[k].append(v)
                experts.append(block[j])
    types = {**schema.KEY_TYPES, **schema.ROUTING_META_COLUMNS}
    meta = pa.table({k: pa.array(v, type=types[k]) for k, v in cols.items()})
    if experts and (np.min(experts) < 0 or np.max(experts) > 255):
        raise ValueError("expert ids outside 0..255 do not fit the uint8 layout")
    return np.stack(experts).astype(np.uint8) if experts else np.zeros((0, 0, 0), np.uint8), meta


def attach(run_dir, out_dir=None, n_experts: int | None = None, proxy: bool = False,
           source: str | None = None) -> str:
    """Add the routing a collector run captured (``routing.capture=true``) to its bank.

    Reads ``run_dir/bank`` and ``run_dir/capture/*.jsonl``; engine requests are matched to the bank's
    prompts by their (accepted, drafted tokens) sequence of rounds. Writes ``out_dir`` (default
    ``run_dir/bank-routing``) atomically and validated.
    """
    from pathlib import Path

    from calib.bank import load, write_bank
    from calib.collect.assemble import read_capture

    run_dir = Path(run_dir)
    bank = load(run_dir / "bank")
    acc = bank.table(schema.ACCEPTANCE).sort_by([("prompt_idx", "ascending"), ("round_idx", "ascending")])
    spec = bank.table(schema.SPECULATOR).sort_by([("prompt_idx", "ascending"), ("round_idx", "ascending")])
    toks = schema.depth_matrix(spec, "tok")
    by_prompt: dict[int, list] = {}
    cats: dict[int, str] = {}
    for i, (p, a, c) in enumerate(zip(acc.column("prompt_idx").to_pylist(), acc.column("accept").to_pylist(),
                                      acc.column("category").to_pylist())):
        by_prompt.setdefault(p, []).append((a, tuple(int(t) for t in toks[i] if not np.isnan(t))))
        cats[p] = c
    captured = read_capture(run_dir / "capture")
    index: dict[tuple, list[str]] = {}
    for rid, recs in captured.items():
        index.setdefault(tuple((r["accepted"], tuple(r["drafted"])) for r in recs), []).append(rid)
    rounds = {}
    for p, seq in by_prompt.items():
        ids = index.get(tuple(seq))
        if not ids:
            raise ValueError(f"{run_dir}: no captured request matches prompt {p}'s {len(seq)} rounds")
        rounds[p] = captured[ids.pop(0)]
    m = bank.manifests()[0]
    arr, meta = routing_rows_from_capture(rounds, cats, m.get("model") or acc.column("model")[0].as_py(),
                                          acc.column("speculator")[0].as_py(), acc.column("config")[0].as_py())
    info = {"n_experts": n_experts, "top_k": int(arr.shape[2]), "layers": int(arr.shape[1]), "proxy": proxy,
            "source": source or "vLLM FusedMoERouter.select_experts (calib.vllm.capture, routing.capture=true)"}
    manifest = {k: v for k, v in m.items() if k not in ("n_rounds", "part")}
    manifest["routing"] = {k: v for k, v in info.items() if v is not None}
    ng = bank.table(schema.NGRAM) if bank.has(schema.NGRAM) else None
    out = Path(out_dir) if out_dir else run_dir / "bank-routing"
    write_bank(out, acc, spec, ng, manifest=manifest, overwrite=True, routing=(arr, meta))
    return str(out)
