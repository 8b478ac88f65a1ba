"""The chains serving recomputes from each request's tokens (:func:`calib.chains.recomputed_chains`: prompt lookup,
suffix decoding, any kind registered with a ``propose_batch``, ``proposer`` or ``propose``), each computed once per
engine step and shared by the plan of draft passes (:mod:`calib.vllm.planning`) and the decision after drafting
(:class:`calib.vllm.server.Server`).

Nothing here names a chain kind: what differs between kinds is registered with the kind (:class:`calib.chains.ChainKind`:
``settings``, ``engine_settings`` and ``serve_knob`` for its settings; ``propose_batch`` with ``batch_features``, or
the per-request ``proposer``/``propose`` with ``step_features``, for its chain and the table's own inputs).
"""

from __future__ import annotations

import logging

import numpy as np

log = logging.getLogger("calib.serve")


class StepContexts:
    """The requests' token histories at one hook: row ``rows[b]`` of the engine's token buffer
    (``token_ids_cpu[:num_tokens_no_spec]``), then request ``b``'s tokens in ``extra`` when bookkeeping has not
    appended this step's tokens yet (the plan before a padded EAGLE drafter): vLLM's sampled token ids ``[>= B, S]``
    (numpy; negative: none), or one list per request. ``keys[b]`` = (request id, context length, last token): the same
    before bookkeeping (with ``extra``) and after it, so the plan and the decision find each other's chains."""

    def __init__(self, batch, rows: list[int], extra=None):
        B = len(rows)
        self.batch, self.rows = batch, rows
        # a few scalar reads and lists per request, where each numpy call would start cold inside the engine
        # (docs/profile.md); numpy only for what the compiled matcher reads
        nums, buf = batch.num_tokens_no_spec, batch.token_ids_cpu
        n = [int(nums[r]) for r in rows]
        last = [int(buf[r, m - 1]) if m > 0 else -1 for r, m in zip(rows, n)]  # -1: an empty buffer
        self.n_buf = np.array(n, dtype=np.int64)
        total = n
        if extra is None:  # no tokens past the buffer (None: the matcher's zeros)
            self.n_extra = self.pad = None
        else:
            kept = _kept_tokens(extra, B)
            width = max(1, max((len(k) for k in kept), default=0))
            self.n_extra = np.array([len(k) for k in kept], dtype=np.int64)
            self.pad = np.array([k + [0] * (width - len(k)) for k in kept], dtype=np.int64).reshape(B, width)
            total = [m + len(k) for m, k in zip(n, kept)]
            last = [k[-1] if k else t for k, t in zip(kept, last)]
        ids = batch.req_ids
        self.keys = tuple(zip([ids[i] for i in rows], total, last))

    def tokens(self, b: int) -> np.ndarray:
        """Request ``b``'s token ids (the buffer's row, then its ``extra`` tokens)."""
        ctx = self.batch.token_ids_cpu[self.rows[b], : int(self.n_buf[b])]
        if self.n_extra is None or not self.n_extra[b]:
            return ctx
        return np.concatenate([ctx, self.pad[b, : self.n_extra[b]].astype(ctx.dtype)])


def _kept_tokens(extra, B: int) -> list[list[int]]:
    """Each of the first ``B`` requests' non-negative tokens in ``extra`` (rows of vLLM's sampled token ids, -1
    padded: numpy, a tensor's ``tolist`` or lists), in order."""
    rows = extra[:B].tolist() if isinstance(extra, np.ndarray) else extra[:B]
    if len(rows) < B:
        raise ValueError(f"{len(rows)} rows of sampled token ids for {B} requests")
    return [[int(t) for t in r if t >= 0] for r in rows]


class Recomputed:
    """One recomputed chain kind at serving: its settings, the table's own feature names ``own``, each request's
    latest chain (by its context key) and the latest step's chains, so that a step computes them once."""

    def __init__(self, kind, given, k: int, own, max_model_len: int | None):
        self.kind, self.name, self.k, self.own, self.max_model_len = kind, kind.name, int(k), list(own), max_model_len
        self.settings = kind.settings(given, k) if kind.settings is not None else given
        # per request, where the kind has no batch path: its recomputation (a stateful kind's state)
        self.each = None if kind.propose_batch is not None else kind.recompute(given, k)
        self.matches: dict[str, tuple] = {}  # req_id -> (context key, tokens [<= k], features)
        self.last: tuple | None = None  # (keys, tokens, signal) of the latest step asked for

    def warm(self) -> None:
        """Compile the batch path now (numba: ~1 s once per machine), not in the first step; vLLM's buffer is int32."""
        if self.kind.propose_batch is not None:
            self.kind.propose_batch(np.zeros((1, 8), dtype=np.int32), [0], [8], [0], self.settings, self.max_model_len,
                                    np.zeros((1, 1), dtype=np.int64), np.zeros(1, dtype=np.int64))

    def chains(self, ctx: StepContexts):
        """``(tokens [B][<= k], signal float32 [B, W, F])``: the chain each request of ``ctx`` offers and the table's
        own inputs (``own``), NaN beyond a request's chain. A request is recomputed only when its context is new
        (one call for all of them on the batch path), and a step asked twice (the plan, then the decision) gets
        the same lists and tensor back."""
        last = self.last
        if last is not None and last[0] == ctx.keys:
            return last[1], last[2]
        matches = self.matches
        miss = [b for b, key in enumerate(ctx.keys) if (matches.get(key[0]) or (None,))[0] != key]
        every = self._propose(ctx, miss) if miss else None  # the batch path's features [B, F] when all were new
        hits = [matches[key[0]] for key in ctx.keys]
        tokens = [h[1] for h in hits]
        lengths = [len(t) for t in tokens]
        width = max(1, max(lengths, default=0))
        if self.kind.propose_batch is not None:
            signal = self.kind.batch_features(every if len(miss) == len(hits) else [h[2] for h in hits], lengths,
                                              self.own, width)
        else:
            signal = self.kind.step_features([h[2] for h in hits], lengths, self.own, width)
        self.last = (ctx.keys, tokens, signal)
        return tokens, signal

    def _propose(self, ctx: StepContexts, miss: list[int]):
        """Recompute the requests ``miss`` (positions in ``ctx``); the batch path returns their features ``[M, F]``."""
        batch, k = ctx.batch, self.k
        if self.each is None:  # the batch path: one call for every request whose context is new
            at = slice(None) if len(miss) == len(ctx.keys) else miss  # every request: no copies
            rows = ctx.rows if len(miss) == len(ctx.keys) else [ctx.rows[b] for b in miss]
            extra = (None, None) if ctx.n_extra is None else (ctx.pad[at], ctx.n_extra[at])
            toks, feats = self.kind.propose_batch(batch.token_ids_cpu, rows, ctx.n_buf[at],
                                                  np.asarray(batch.num_prompt_tokens)[rows], self.settings,
                                                  self.max_model_len, *extra)
            for j, b in enumerate(miss):
                self.matches[ctx.keys[b][0]] = (ctx.keys[b], toks[j][:k], feats[j])
            return feats
        for b in miss:
            key = ctx.keys[b]
            t, f = self.each.propose(key[0], ctx.tokens(b), int(batch.num_prompt_tokens[ctx.rows[b]]),
                                     self.max_model_len)
            self.matches[key[0]] = (key, [int(x) for x in t[:k]], f)
        return None

    def end_step(self) -> None:
        """The decision has read this step's chains: a kind recomputed per request (a stateful one, whose draft may
        move with its shared state, as the suffix trees' does) is recomputed at every decided step, as it always
        was; the batch path keeps each request's chain until its context moves."""
        if self.each is not None:
            self.matches.clear()
            self.last = None

    def finish(self, req_id: str) -> None:
        self.matches.pop(req_id, None)
        if self.each is not None:
            self.each.finish(req_id)

    def forget_responses(self) -> int:
        """A stateful kind's memory of finished requests dropped (the suffix trees' cached responses; its
        ``forget_responses``, where it has one): how many."""
        forget = getattr(self.each, "forget_responses", None)
        return int(forget()) if forget is not None else 0


def recomputed_for(tables, calibrated, drafted, sc, knobs, k: int, max_model_len: int | None) -> dict[str, Recomputed]:
    """``{name: Recomputed}`` of every recomputed chain kind the tables calibrate (``calibrated``: the decider's
    chains), in registry order: with vLLM's settings where vLLM drafts it (``drafted``, the engine's chain kind;
    :attr:`calib.chains.ChainKind.engine_settings`), else the serving knob registered for it
    (:attr:`calib.chains.ChainKind.serve_knob`) or its defaults; a kind whose implementation is not installed is
    left out (logged)."""
    from calib.chains import recomputed_chains, split_context
    from calib.serve.decide import feature_names

    out = {}
    for kind in recomputed_chains():
        if kind.name not in calibrated:
            continue
        if drafted is not None and kind.name == drafted.name and kind.engine_settings is not None:
            given = kind.engine_settings(sc)
        else:
            given = getattr(knobs, kind.serve_knob) if kind.serve_knob else None
        try:
            rec = Recomputed(kind, given, k, (), max_model_len)
        except ImportError as exc:  # its implementation is not installed: not offered
            log.warning("calib serve: the %s chain is not offered (%s)", kind.name, exc)
            continue
        rec.own = split_context(feature_names(tables, kind.name), kind.name)[0]
        out[kind.name] = rec
    return out
