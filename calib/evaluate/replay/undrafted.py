"""The steps a model-free drafter's engine decoded without a draft, as rounds the replay serves too.

vLLM's n-gram proposer (and the suffix tree) drafts only where the context matches; a step without a match
decodes one token and leaves no round in the bank. A replay of the recorded rounds alone serves every request a
draft on every step, so it over-predicts such an engine: on the served chat prompts (float32, greedy, 64 tokens)
1,558 of the n-gram engine's 3,992 decode steps had no draft, and the replay put vLLM's n-gram arm at 1.55x no
speculation at concurrency 1 where the clock measured 1.18x.

The bank says where those steps were: consecutive rounds of a request are ``context_len`` apart, ``accept + 1``
of which the earlier round decoded; the rest were steps without a draft. :func:`with_undrafted_steps` adds one
round per such step, drafted by no chain (every chain's accept mask NaN: nothing to verify, one token decoded),
to the replay's copy of the bank. Steps before a request's first round and after its last are not seen (on the
served banks: 66 of 1,624 greedy, 186 of 2,685 sampled). A model drafter drafts on every step: its banks gain none.
"""

from __future__ import annotations

import numpy as np

from calib.evaluate.data import Chain, EvalBank


def undrafted_per_prompt(bank: EvalBank) -> dict[int, int]:
    """``{prompt_idx: steps without a draft between its rounds}`` of a bank whose engine drafted a model-free
    chain (its primary chain's bank file records ``context_len``); ``{}`` for any other bank."""
    from calib.bank import load, schema
    from calib.chains import chain

    kind = chain(bank.primary)
    if not kind.bank_file or bank.chains[bank.primary].p_raw is not None:
        return {}
    table = load(bank.path).table(kind.bank_file)
    if "context_len" not in table.column_names:
        return {}
    # a request is its round keys but the round (banks read together keep theirs apart: config, speculator, ...)
    request = [k for k in schema.KEYS if k != "round_idx"]
    cols = {k: np.asarray(table.column(k).to_pylist() if k in ("model", "speculator", "config", "category")
                          else table.column(k).to_numpy()) for k in (*schema.KEYS, "context_len", "accept")}
    order = np.lexsort([cols[k] for k in reversed(schema.KEYS)])
    p, turn = cols["prompt_idx"][order], cols["turn"][order]
    ctx, acc = cols["context_len"][order].astype(np.int64), cols["accept"][order].astype(np.int64)
    same = np.logical_and.reduce([cols[k][order][1:] == cols[k][order][:-1] for k in request])  # one request's
    gaps = np.where(same, ctx[1:] - ctx[:-1] - (acc[:-1] + 1), 0)
    if (gaps < 0).any():
        i = int(np.flatnonzero(gaps < 0)[0])
        raise ValueError(f"{bank.path}: {kind.bank_file}: prompt {p[i]} turn {turn[i]}: context_len "
                         f"{ctx[i + 1]} after {ctx[i]} with {acc[i]} accepted: rounds that overlap")
    out: dict[int, int] = {}
    for prompt, g in zip(p[1:][gaps > 0], gaps[gaps > 0]):
        out[int(prompt)] = out.get(int(prompt), 0) + int(g)
    return out


def with_undrafted_steps(bank: EvalBank) -> EvalBank:
    """``bank`` with one round per undrafted step (:func:`undrafted_per_prompt`), drafted by no chain, each with
    its prompt's category, split, temperature and context cell; ``bank`` itself where there are none."""
    counts = undrafted_per_prompt(bank)
    if not counts:
        return bank
    first = {int(p): i for i, p in reversed(list(enumerate(bank.prompt_idx)))}  # a prompt's first round
    src = np.repeat([first[p] for p in counts], list(counts.values()))  # [N] the round each new one copies

    def grow(a: np.ndarray | None, blank: bool) -> np.ndarray | None:
        if a is None:
            return None
        extra = np.full((src.size, *a.shape[1:]), np.nan) if blank else a[src]
        return np.concatenate([a, extra.astype(a.dtype, copy=False)])

    note = f"{src.size} steps without a draft replayed as undrafted rounds"
    if note not in bank.notes:
        bank.notes.append(note)  # the report's bank notes; the copy shares the list, as policies note on it
    chains = {k: Chain(c.drafter, grow(c.acc, True), grow(c.p_cal, True), grow(c.p_raw, True),
                       grow(c.p_forecast, True), grow(c.context, False)) for k, c in bank.chains.items()}
    return EvalBank(bank.name, bank.path, grow(bank.category, False), grow(bank.prompt_idx, False),
                    grow(bank.split, False), chains, bank.primary, bank.temperature, bank.seen, bank.scope,
                    bank.notes, grow(bank.round_temperature, False), grow(bank.cached, False))
