"""Captured rounds (JSON lines from :mod:`calib.vllm.capture`) → bank tables, plus reconciliation."""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa

from calib.bank import schema
from calib.ngram import label_chain


class ReconciliationError(RuntimeError):
    """Captured accept counts disagree with vLLM's own per-request spec-decode metrics."""


class CaptureError(RuntimeError):
    """The capture hooks reported failures; the bank would be incomplete."""


@dataclass(frozen=True)
class RunKeys:
    """Bank key values and labelling rules shared by every round of one collection run."""

    model: str
    speculator: str
    config: str
    width: int  # D: acc/conf columns (num_speculative_tokens)
    chain_width: int  # columns of every recomputed chain's own file (its K)
    # the engine verified the recomputed chain kind named by ``speculator`` (vLLM's method drafts it)
    chain_verified: bool
    temperature: float

    def engine_verifies(self, chain: str) -> bool:
        return self.chain_verified and self.speculator == chain


def _capture_records(f: Path):
    """(line number, record) of a capture file; a CaptureError naming the file and line for a line
    that is not a JSON object with the fields the hooks write (a truncated or corrupted capture)."""
    try:
        text = f.read_bytes().decode("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise CaptureError(f"{f}: unreadable capture file ({exc}); rerun the part to capture it again") from exc
    for line_no, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except (RecursionError, ValueError) as exc:
            raise CaptureError(f"{f}, line {line_no}: not a JSON record ({exc}); the capture is truncated "
                               "or corrupted: rerun the part to capture it again") from None
        if not isinstance(rec, dict) or ("capture_error" not in rec and not
                                         (isinstance(rec.get("req"), str) and isinstance(rec.get("step"), int))):
            raise CaptureError(f"{f}, line {line_no}: not a capture record (a JSON object with 'req' and "
                               "'step'); rerun the part to capture it again")
        yield line_no, rec


def read_capture(capture_dir: str | Path) -> dict[str, list[dict]]:
    """Records grouped by engine request id, in step order. Raises on reported hook failures."""
    by_req: dict[str, list[dict]] = defaultdict(list)
    errors = []
    for f in sorted(Path(capture_dir).glob("capture-*.jsonl")):
        for line_no, rec in _capture_records(f):
            if "capture_error" in rec:
                errors.append(f"{f.name}:{line_no}: {rec['capture_error']}")
                continue
            by_req[rec["req"]].append(rec)
    if errors:
        raise CaptureError(f"{len(errors)} capture failure(s), first: {errors[0]}")
    for recs in by_req.values():
        recs.sort(key=lambda r: r["step"])
    return by_req


def engine_request_prefix(engine_req_id: str) -> str:
    """vLLM appends '-<8 random chars>' to the caller's request id."""
    return engine_req_id.rsplit("-", 1)[0]


def reconcile(captured: dict[int, list[dict]], reference: dict[int, tuple[list[int], list[int]]],
              prompt_ids: dict[int, str]) -> None:
    """Compare per-request (accepted, drafted) sequences with vLLM's ``per_step_*`` metrics."""
    problems = []
    for idx, (ref_acc, ref_drafted) in sorted(reference.items()):
        recs = captured.get(idx, [])
        got_acc = [r["accepted"] for r in recs]
        got_drafted = [len(r["drafted"]) for r in recs]
        if got_acc != list(ref_acc) or got_drafted != list(ref_drafted):
            first = next((i for i, (a, b) in enumerate(zip(got_acc, ref_acc)) if a != b),
                         min(len(got_acc), len(ref_acc)))
            problems.append(f"prompt {idx} ({prompt_ids.get(idx)}): captured {len(got_acc)} rounds, "
                            f"vLLM reports {len(ref_acc)}; first difference at round {first}")
    extra = sorted(set(captured) - set(reference))
    if extra:
        problems.append(f"rounds captured for prompts vLLM reports no spec-decode steps for: {extra[:5]}")
    if problems:
        raise ReconciliationError("capture does not reconcile with vLLM's per-request metrics:\n  "
                                  + "\n  ".join(problems[:10]))


def build_tables(rounds: dict[int, list[dict]], categories: dict[int, str],
                 final_tokens: dict[int, list[int]], keys: RunKeys) -> tuple[pa.Table, ...]:
    """acceptance and speculator tables for the rounds of a set of prompts, then one table per recomputed chain
    kind the records carry (:func:`calib.chains.recomputed_chains`, its capture fragment ``{name}_tokens`` and
    ``{name}``), in registry order."""
    from calib.chains import recomputed_chains

    kinds = [k for k in recomputed_chains()
             if any(f"{k.name}_tokens" in rec for recs in rounds.values() for rec in recs)]
    D = keys.width
    acc_cols: dict[str, list] = defaultdict(list)
    spec_cols: dict[str, list] = defaultdict(list)
    chain_cols: dict[str, dict[str, list]] = {k.name: defaultdict(list) for k in kinds}
    for idx in sorted(rounds):
        for r_idx, rec in enumerate(rounds[idx]):
            key = {"model": keys.model, "speculator": keys.speculator, "config": keys.config,
                   "category": categories[idx], "prompt_idx": idx, "turn": 0, "round_idx": r_idx}
            for table in (acc_cols, spec_cols, *chain_cols.values()):
                for k, v in key.items():
                    table[k].append(v)
            drafted, a = rec["drafted"], rec["accepted"]
            # Serving on while collecting: calib may have verified a recomputed chain instead of the
            # speculator's draft. Then the speculator's columns stay empty (its draft was not
            # verified) and that chain's row carries the verdict, so each chain's labels stay its own.
            chosen = rec.get("verified_chain")
            substituted = (chosen in chain_cols and not keys.engine_verifies(chosen) and bool(drafted)
                           and list(rec.get(f"{chosen}_tokens") or [])[: len(drafted)] == list(drafted))
            if substituted:
                drafted, a = [], 0
            d = len(drafted)
            if d > D:
                raise ValueError(f"prompt {idx} round {r_idx}: {d} drafted tokens > width {D}")
            acc_cols["accept"].append(a)
            for k in range(D):
                acc_cols[f"acc{k}"].append((1 if k < a else 0) if k < d else None)
                spec_cols[f"tok{k}"].append(drafted[k] if k < d else None)
                for name in ("conf", "entropy", "margin"):
                    vals = rec.get(name)
                    spec_cols[f"{name}{k}"].append(float(vals[k]) if vals is not None and k < d else None)
            spec_cols["batch_size"].append(rec["batch_size"])
            spec_cols["temperature"].append(keys.temperature)
            spec_cols["verified_chain"].append(chosen)
            lt = rec.get("logit_transforms")  # names (calib/transforms.py); absent: not recorded
            spec_cols["logit_transforms"].append(None if lt is None else ",".join(lt))
            for kind in kinds:
                verified = keys.engine_verifies(kind.name) or (substituted and chosen == kind.name)
                _chain_row(chain_cols[kind.name], kind, rec, idx, r_idx, final_tokens[idx], keys, verified)
    order = list(schema.KEYS)
    acceptance = pa.table({c: acc_cols[c] for c in order + ["accept"] + [f"acc{k}" for k in range(D)]})
    spec_names = order + [f"{p}{k}" for p in ("conf", "tok", "entropy", "margin") for k in range(D)]
    round_names = ["batch_size", "temperature"]
    if any(v is not None for v in spec_cols["verified_chain"]):  # only banks collected with serving on
        round_names.append("verified_chain")
    if any(v is not None for v in spec_cols["logit_transforms"]):  # captures that record the requests' transforms
        round_names.append("logit_transforms")
    speculator = pa.table({c: spec_cols[c] for c in spec_names + round_names},
                          schema=_schema(spec_names + round_names, schema.SPECULATOR))
    chain_tables = []
    for kind in kinds:
        names = kind.bank.column_names(keys.chain_width)
        # a per-depth feature family no chain of these records carries (a capture from before calib recorded it)
        # is left out whole; one that only some carry cannot be filled in
        for prefix in kind.bank.depth_features:
            lacking = chain_cols[kind.name].pop(f"_lacking_{prefix}", [])
            if not lacking:
                continue
            if len(lacking) < sum(1 for n in chain_cols[kind.name][kind.bank.length] if n):
                idx, r_idx = lacking[0]
                raise ValueError(f"prompt {idx} round {r_idx}: its {kind.name} chain records no {prefix} while "
                                 f"others of this run do (a collection resumed across calib versions?): collect "
                                 f"again into a new out_dir")
            names = [c for c in names if not schema.depth_columns([c], prefix)]
        chain_tables.append(pa.table({c: chain_cols[kind.name][c] for c in names}, schema=_schema(names, kind.bank_file)))
    return (acceptance, speculator, *chain_tables)


def _chain_row(cols, kind, rec, idx, r_idx, final, keys: RunKeys, verified: bool) -> None:
    """One round of a recomputed chain's own file (its layout: :attr:`calib.chains.ChainKind.bank`): the chain
    the capture recorded, its features, and its labels (verified by the engine, else counterfactual)."""
    spec, L = kind.bank, keys.chain_width
    chain = list(rec.get(f"{kind.name}_tokens") or [])[:L]
    feats = rec.get(kind.name) or {}
    if verified:
        drafted = rec["drafted"]
        if chain[: len(drafted)] != drafted:
            raise ReconciliationError(
                f"prompt {idx} round {r_idx}: recomputed {kind.name} chain {chain} does not reproduce "
                f"vLLM's draft {drafted}")
        chain, source, accept = drafted, "verified", rec["accepted"]
        mask = [1 if j < accept else 0 for j in range(len(chain))]
    elif chain:
        source = "counterfactual"
        accept, mask = label_chain(chain, rec["context_len"], final)
    else:
        source, accept, mask = "none", None, []
    cols[spec.length].append(len(chain))
    for name in spec.features:
        cols[name].append(feats.get(name) if chain else None)
    cols["accept"].append(accept)
    cols["verified"].append(verified)
    cols["label_source"].append(source)
    for j in range(L):
        cols[f"{spec.token}{j}"].append(chain[j] if j < len(chain) else None)
        for prefix in spec.depth_features:
            if j == 0 and chain and feats.get(prefix) is None:
                cols[f"_lacking_{prefix}"].append((idx, r_idx))
            vals = feats.get(prefix) or []
            cols[f"{prefix}{j}"].append(float(vals[j]) if j < len(chain) and j < len(vals) else None)
        cols[f"acc{j}"].append(mask[j] if j < len(mask) else None)


def _schema(names, file) -> pa.Schema:
    """Explicit column types, so that all-null columns are typed (float64 for unnamed extras)."""
    return pa.schema([pa.field(n, schema.column_type(n, file) or pa.float64()) for n in names])
