"""The clock oracle (issue 41): verification allocation with perfect knowledge, served through calib's hooks.

The reference output of each prompt comes from an earlier no-speculation run (greedy, the same prompts and
``max_tokens``: ``python serve.py policy=no_spec sampling=greedy ... reference_out=PATH``, or
:func:`calib.vllm.serve_runner.serve_cell`'s ``tokens``, written by :func:`write_reference`). At each engine
step, for each request, the oracle compares each chain's draft (the offers :meth:`calib.vllm.server.Server.offers`
builds: vLLM's own draft, and beside a model drafter the n-gram chain calib recomputes) with the reference
continuation of the output so far, verifies exactly the accepted prefix (the longest common prefix of the draft
and the continuation; ``[]`` when it is 0) and picks the chain that commits more (ties to the cheaper: the
model-free n-gram chain; both 0: ``[]``). It runs through the same hooks as calib (``Server.step``), so its
step costs what calib's would with perfect knowledge: the ceiling of verification allocation on the clock.

Where the step's price falls with more positions (a CPU whose matrix products run a few rows faster than one: an
AMD EPYC stepped T = 5 positions 15 % faster than T = 1, docs/cost.md), committing the same tokens in a cheaper step
is perfect knowledge too: :func:`pad_to_cheapest` then verifies draft tokens past the accepted prefix, each the
first a verification rejects (or one after it), up to the cheapest step the offers reach. The output is the same
token for token; only the step's shape changes. A price that never falls (every shipped cost) pads nothing.

Greedy only. A request whose continuation is unknown (its prompt is not in the reference, its output so far
parted from the reference's, or it samples at a temperature > 0) keeps the engine's own draft (counted:
``ServeStats.oracle_unknown``). Engine-independent: no vLLM import; :class:`Oracle` reads only the numpy
arrays of vLLM's input batch (``token_ids_cpu``, ``num_prompt_tokens``, ``num_tokens_no_spec``).

Reference file (JSON, written atomically, never pickle)::

    {"format": "calib-oracle-reference/1", "max_tokens": 128, "dtype": "float32",
     "outputs": {"<prompt key>": [output token ids], ...}}

where the prompt key is :func:`prompt_key` of the prompt's token ids (the chat-encoded prompt the engine sees).
"""

from __future__ import annotations

import hashlib
import json
import math
import numbers
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

FORMAT = "calib-oracle-reference/1"


def prompt_key(token_ids) -> str:
    """The prompt's key in a reference: the sha256 hex digest of its token ids as little-endian int64 bytes
    (so a list, an int32 numpy row or a tensor's ``.tolist()`` of the same ids give the same key)."""
    ids = np.asarray(token_ids)
    if ids.ndim != 1 or (ids.size and not np.issubdtype(ids.dtype, np.integer)):
        raise ValueError(f"prompt token ids must be a flat sequence of ints, got shape {ids.shape} {ids.dtype}")
    return hashlib.sha256(np.ascontiguousarray(ids, dtype="<i8").tobytes()).hexdigest()


def _is_key(k) -> bool:
    return isinstance(k, str) and len(k) == 64 and all(c in "0123456789abcdef" for c in k)


def _token_list(v) -> bool:
    return isinstance(v, list) and all(isinstance(t, numbers.Integral) and not isinstance(t, bool) and t >= 0
                                       for t in v)


def check_reference(obj, where: str = "reference") -> None:
    """Refuse (``ValueError`` naming ``where`` and the bad key) what is not a reference of :data:`FORMAT`."""
    if not isinstance(obj, Mapping):
        raise ValueError(f"{where}: not a JSON object; expected a calib oracle reference ({FORMAT})")  # noqa: TRY004 -- a file's content
    if obj.get("format") != FORMAT:
        raise ValueError(f"{where}: key 'format' is {obj.get('format')!r}; expected {FORMAT!r}")
    extra = sorted(set(obj) - {"format", "max_tokens", "dtype", "outputs"})
    if extra:
        raise ValueError(f"{where}: unknown key(s) {extra}; a reference holds format, max_tokens, dtype, outputs")
    mt = obj.get("max_tokens")
    if not isinstance(mt, numbers.Integral) or isinstance(mt, bool) or mt < 1:
        raise ValueError(f"{where}: key 'max_tokens' is {mt!r}; expected an int >= 1 (the run's sampling.max_tokens)")
    if not isinstance(obj.get("dtype"), str) or not obj["dtype"]:
        raise ValueError(f"{where}: key 'dtype' is {obj.get('dtype')!r}; expected the engine dtype (a string)")
    outputs = obj.get("outputs")
    if not isinstance(outputs, Mapping):
        raise ValueError(f"{where}: key 'outputs' is {type(outputs).__name__}; "  # noqa: TRY004 -- a file's content
                         "expected {prompt key: [token ids]}")
    for k, v in outputs.items():
        if not _is_key(k):
            raise ValueError(f"{where}: outputs key {k!r:.80} is not a prompt key (64 lowercase hex digits, "
                             "calib.serve.oracle.prompt_key)")
        if not _token_list(v):
            raise ValueError(f"{where}: outputs[{k!r}] is not a list of token ids (ints >= 0)")
        if len(v) > mt:
            raise ValueError(f"{where}: outputs[{k!r}] holds {len(v)} tokens, more than max_tokens={mt}")


class Reference:
    """The reference outputs of a greedy no-speculation run, by :func:`prompt_key`."""

    def __init__(self, outputs: Mapping[str, Sequence[int]], max_tokens: int, dtype: str, path: str | None = None):
        where = f"oracle reference {path}" if path else "oracle reference"
        obj = {"format": FORMAT, "max_tokens": max_tokens, "dtype": dtype,
               "outputs": {k: [int(t) for t in v] if not isinstance(v, list) else v for k, v in outputs.items()}}
        check_reference(obj, where)
        self.max_tokens, self.dtype, self.path = int(max_tokens), str(dtype), path
        self.outputs = {k: np.asarray(v, dtype=np.int64) for k, v in obj["outputs"].items()}

    @classmethod
    def load(cls, path: str | Path) -> Reference:
        """The reference in ``path``; a ``ValueError`` (``FileNotFoundError``) naming the file and the bad key."""
        p = Path(path)
        if not p.is_file():
            raise FileNotFoundError(f"oracle reference {p}: no such file (make one with `python serve.py "
                                    f"policy=no_spec sampling=greedy reference_out={p}`)")
        try:
            obj = json.loads(p.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"oracle reference {p}: not JSON ({exc})") from None
        check_reference(obj, f"oracle reference {p}")
        return cls(obj["outputs"], obj["max_tokens"], obj["dtype"], path=str(p))

    def __len__(self) -> int:
        return len(self.outputs)

    def __contains__(self, key: str) -> bool:
        return key in self.outputs

    def continuation(self, key: str, generated_so_far, limit: int | None = None) -> list[int] | None:
        """The reference's tokens after ``generated_so_far`` (at most ``limit``), or None when the prompt is
        unknown or the output so far parted from the reference's. ``[]`` where the output so far holds the
        whole reference: the request has finished (a verify step appends every accepted token, past EOS or
        ``max_tokens`` too, which the engine then drops), or, in a run of a larger ``max_tokens`` than the
        reference's, it goes on where the reference cannot tell (lossless: nothing is verified)."""
        ref = self.outputs.get(key)
        if ref is None:
            return None
        so_far = np.asarray(generated_so_far, dtype=np.int64).reshape(-1)
        n = so_far.shape[0]
        if not np.array_equal(ref[:n], so_far[: ref.shape[0]]):
            return None
        end = ref.shape[0] if limit is None else min(ref.shape[0], n + int(limit))
        return ref[n:end].tolist()


def unreplaceable(path: str | Path) -> str | None:
    """Why a reference must not be written to ``path``: a folder, or an existing file that is not a clock-oracle
    reference (a prompt file, a bench result: the run would replace it with its outputs); None where writing
    there replaces nothing of the user's. serve.py's config check refuses such a path before the run, and
    :func:`write_reference` before it writes."""
    path = Path(path)
    if path.is_dir():
        return f"{path} is a folder; name the reference file to write (a new .json path)"
    if path.exists():
        from calib.sidefiles import SideFileError, read_json

        try:
            obj = read_json(path)
        except SideFileError:
            obj = None
        if not (isinstance(obj, dict) and obj.get("format") == FORMAT):
            return (f"{path} exists and is not a clock-oracle reference ({FORMAT}): the run would replace it with "
                    "its outputs; name a new file, or delete that one")
    return None


def write_reference(path: str | Path, outputs: Mapping[str, Sequence[int]], max_tokens: int, dtype: str) -> Path:
    """Write ``outputs`` ({:func:`prompt_key`: output token ids}) as a reference file, atomically (a temp file
    beside ``path``, then one rename); checked first, so a bad entry is refused before anything is written, and so
    is a ``path`` that holds something else (:func:`unreplaceable`)."""
    from calib.atomic import write_text_atomic

    why = unreplaceable(path)
    if why is not None:
        raise FileExistsError(f"oracle reference not written: {why}")

    obj = {"format": FORMAT, "max_tokens": int(max_tokens), "dtype": str(dtype),
           "outputs": {str(k): [int(t) for t in v] for k, v in sorted(outputs.items())}}
    check_reference(obj, f"oracle reference {path}")
    body = ",\n".join(f"  {json.dumps(k)}: {json.dumps(v, separators=(',', ':'))}" for k, v in obj["outputs"].items())
    text = (f'{{"format": {json.dumps(FORMAT)}, "max_tokens": {obj["max_tokens"]}, "dtype": {json.dumps(obj["dtype"])},'
            f'\n "outputs": {{\n{body}\n }}}}\n')
    return write_text_atomic(path, text)


def accepted_prefix(draft: Sequence[int], continuation: Sequence[int]) -> int:
    """How many leading tokens of ``draft`` greedy verification accepts: its longest common prefix with the
    reference ``continuation``."""
    n = 0
    for a, b in zip(draft, continuation):
        if int(a) != int(b):
            break
        n += 1
    return n


def _in_order(offers: Mapping[str, object], first: Sequence[str]) -> list[str]:
    """The offered chain names, those in ``first`` first (in its order), then the rest in ``offers``' order."""
    return [c for c in first if c in offers] + [c for c in offers if c not in first]


def oracle_choice(offers: Mapping[str, Sequence[Sequence[int]]], continuations: Sequence[Sequence[int] | None],
                  cheaper_first: Sequence[str] = (), engine_chain: str | None = None,
                  engine_drafts: Sequence[Sequence[int]] | None = None
                  ) -> tuple[list[list[int]], list[str | None], list[bool]]:
    """The oracle's step: ``(drafts [B][<= K], chosen chain name or None per row, known flags [B])``.

    ``offers``: {chain name: its draft per request [B][<= K]}; ``continuations``: the reference continuation
    per request, None where unknown; ``cheaper_first``: chain names, cheapest first (ties go to the earlier;
    offered chains it does not name come after, in ``offers``' order). A known row verifies the accepted
    prefix of the chain that commits most (``[]`` and None when none commits a token). An unknown row keeps
    ``engine_drafts[b]`` (the engine's own draft, chain ``engine_chain``; ``[]`` without them), known False."""
    B = len(continuations)
    for name, rows in offers.items():
        if len(rows) != B:
            raise ValueError(f"chain {name!r} offers {len(rows)} drafts for {B} requests")
    if engine_drafts is not None and len(engine_drafts) != B:
        raise ValueError(f"{len(engine_drafts)} engine drafts for {B} requests")
    order = _in_order(offers, cheaper_first)
    drafts, chosen, known = [], [], []
    for b, cont in enumerate(continuations):
        if cont is None:
            own = [int(t) for t in engine_drafts[b]] if engine_drafts is not None else []
            drafts.append(own)
            chosen.append(engine_chain if own else None)
            known.append(False)
            continue
        best, name = 0, None
        for c in order:
            n = accepted_prefix(offers[c][b], cont)
            if n > best:
                best, name = n, c
        drafts.append([int(t) for t in offers[name][b][:best]] if name is not None else [])
        chosen.append(name)
        known.append(True)
    return drafts, chosen, known


def pad_to_cheapest(drafts: Sequence[Sequence[int]], chosen: Sequence[str | None], known: Sequence[bool],
                    offers: Mapping[str, Sequence[Sequence[int]]], continuations: Sequence[Sequence[int] | None],
                    price: np.ndarray, order: Sequence[str] = ()) -> tuple[list[list[int]], list[str | None]]:
    """:func:`oracle_choice`'s step padded to the cheapest step that commits the same tokens: ``(drafts [B][<= K],
    chain name or None per row)``.

    ``price``: the step's price by positions ``T`` (``price[T]``, the serving cost curve: T = B + draft tokens). A
    known row whose reference goes on past its accepted prefix ``n`` may verify more of a chain's draft: the chosen
    chain's tokens after ``n`` (where none was chosen, the first chain in ``order``, then ``offers``' order, that
    offers any), whose first differs from the reference's next token (``n`` is the longest common prefix), so
    verification rejects it and commits exactly what the prefix alone commits. How many each row verifies:
    :func:`calib.allocate.padding.cheapest_padding` (none where the price never falls)."""
    # here, not at the top: calib.allocate imports torch, and serve.py --help imports this module
    from calib.allocate.padding import cheapest_padding

    drafts, chosen = [list(map(int, x)) for x in drafts], list(chosen)
    names = _in_order(offers, order)
    spare: list[list[int]] = [[] for _ in drafts]
    for b, (cont, ok) in enumerate(zip(continuations, known)):
        n = len(drafts[b])
        if not ok or cont is None or len(cont) <= n:  # unknown, or the reference ends here: nothing sure to reject
            continue
        source = chosen[b] if chosen[b] is not None else next((c for c in names if len(offers[c][b]) > 0), None)
        if source is not None:
            spare[b] = [int(t) for t in offers[source][b][n:]]
            if spare[b] and chosen[b] is None:
                chosen[b] = source
    base = len(drafts) + sum(len(x) for x in drafts)
    taken = cheapest_padding([len(x) for x in spare], base, price).tolist()
    padded = [x + spare[b][: taken[b]] for b, x in enumerate(drafts)]
    return padded, [c if padded[b] else None for b, c in enumerate(chosen)]


def all_committed(ngram: Sequence[Sequence[int]] | None, continuations: Sequence[Sequence[int] | None],
                  k: int) -> bool:
    """Whether every request's n-gram chain already commits ``min(k, len(continuation))`` tokens (so no model
    draft can commit more); False where a continuation is unknown or there is no n-gram chain."""
    if ngram is None or len(ngram) != len(continuations):
        return False
    return all(c is not None and accepted_prefix(t, c) >= min(int(k), len(c)) for t, c in zip(ngram, continuations))


class Oracle:
    """The oracle's serving state in one engine process: the reference, and each running request's prompt key
    (computed once per request id, dropped by :meth:`finish`)."""

    def __init__(self, reference: Reference, price: np.ndarray | None = None):
        self.reference = reference
        self.keys: dict[str, str] = {}  # req_id -> prompt key
        # [T_max + 1] the step's price by positions (serving's cost curve), or None: no padding (pad_to_cheapest)
        self.price = None if price is None else np.asarray(price, dtype=np.float64)
        self.padded = 0  # draft tokens verified past an accepted prefix to reach a cheaper step

    def continuations(self, batch, rows: Sequence[int], req_ids: Sequence[str], temperatures: Sequence[float],
                      limit: int, extra: Sequence[Sequence[int]] | None = None) -> list[list[int] | None]:
        """Per request (batch row ``rows[b]`` of vLLM's input batch): the reference continuation of its output
        so far (``token_ids_cpu[i, num_prompt_tokens[i]:num_tokens_no_spec[i]]``, then ``extra[b]`` where
        bookkeeping has not appended this step's tokens yet), at most ``limit`` tokens; None where unknown
        (prompt not in the reference, output parted from it, or a temperature > 0: greedy only)."""
        out = []
        for b, (i, r) in enumerate(zip(rows, req_ids)):
            if float(temperatures[b]) != 0.0:
                out.append(None)
                continue
            p, n = int(batch.num_prompt_tokens[i]), int(batch.num_tokens_no_spec[i])
            key = self.keys.get(r)
            if key is None:
                key = self.keys[r] = prompt_key(batch.token_ids_cpu[i, :p])
            so_far = batch.token_ids_cpu[i, p:n]
            if extra is not None and extra[b]:
                so_far = np.concatenate([so_far, np.asarray(extra[b], dtype=so_far.dtype)])
            out.append(self.reference.continuation(key, so_far, limit))
        return out

    def finish(self, req_id: str) -> None:
        self.keys.pop(req_id, None)

    def decide(self, inputs, continuations: Sequence[Sequence[int] | None], engine_chain: str,
               engine_drafts: Sequence[Sequence[int]]):
        """``(StepDecision, known flags [B])`` of :func:`oracle_choice` on the step's offers
        (:class:`calib.serve.StepInputs`), padded by :func:`pad_to_cheapest` where :attr:`price` is given: chain ids
        int8, depth int32, expected accepted float32 (the accepted prefix where known: every token before the
        padding is accepted; NaN where the engine's own draft was kept), probs None."""
        import torch

        from calib.chains import NO_CHAIN, chain
        from calib.serve.decide import StepDecision

        start = time.perf_counter()
        offers = {name: offer.tokens for name, offer in inputs.offers.items()}
        cheaper = sorted(offers, key=lambda n: chain(n).confidence is not None)  # model-free chains first
        drafts, chosen, known = oracle_choice(offers, continuations, cheaper, engine_chain, engine_drafts)
        accepted = torch.tensor([len(x) for x in drafts], dtype=torch.float32)
        if self.price is not None:
            before = sum(len(x) for x in drafts)
            drafts, chosen = pad_to_cheapest(drafts, chosen, known, offers, continuations, self.price, cheaper)
            self.padded += sum(len(x) for x in drafts) - before
        ids = torch.tensor([chain(c).id if c is not None else NO_CHAIN for c in chosen], dtype=torch.int8)
        depth = torch.tensor([len(x) for x in drafts], dtype=torch.int32)
        expected = torch.where(torch.tensor(known, dtype=torch.bool), accepted, torch.tensor(math.nan))
        return StepDecision(list(inputs.req_ids), drafts, ids, depth, expected,
                            (time.perf_counter() - start) * 1e3, probs=None), known

    def passes(self, ngram: Sequence[Sequence[int]] | None, continuations: Sequence[Sequence[int] | None],
               k: int) -> int:
        """A model drafter's passes this step: 0 where every request's n-gram chain already commits
        ``min(k, what is left of its reference)`` (:func:`all_committed`), else ``k`` (vLLM's): an EAGLE draft
        cannot be known before drafting."""
        return 0 if all_committed(ngram, continuations, k) else int(k)
