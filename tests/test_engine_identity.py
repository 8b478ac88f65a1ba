"""The engine output-identity helper (tests/engine_identity.py) can fail: a real divergence with a wide
logit gap fails with a message naming prompt, position, tokens and gap; a near-tie passes.

Most cases are SYNTHETIC (a six-token vocabulary and scripted logits, no model). The last one runs the
real target (SmolLM2-135M in float32 through transformers, no vLLM) to check the byte-level vocabulary
and the constrained walk on real text.
"""

import pytest
import torch

from tests.engine_identity import TIE_TOLERANCE, Vocab, agreement, check_greedy_identity, find_divergence

A, B, AB, C, SPACE, STOP = 0, 1, 2, 3, 4, 9
PROMPT = [7]


def synthetic_vocab() -> Vocab:
    """SYNTHETIC: "a", "b", "ab", "c", " " and a stop token that stands for no text."""
    pieces = {A: b"a", B: b"b", AB: b"ab", C: b"c", SPACE: b" "}
    return Vocab(pieces, (STOP,), {**{i: p.decode() for i, p in pieces.items()}, STOP: "<stop>"})


def scripted(script: dict[tuple, dict[int, float]]):
    """SYNTHETIC logits: ``script[generated ids so far]`` gives the logits of named tokens, every other
    token sits at -10. Records each context it is asked about."""
    def logits(ids):
        logits.calls.append(tuple(ids[len(PROMPT):]))
        out = torch.full((10,), -10.0)
        for tok, value in script.get(tuple(ids[len(PROMPT):]), {}).items():
            out[tok] = value
        return out
    logits.calls = []
    return logits


def test_identical_outputs_pass_without_computing_logits():
    """SYNTHETIC: nothing parts, so the reference model is never run."""
    def never(ids):
        raise AssertionError("logits computed for identical outputs")

    outputs = {"p0": "ab c", "p1": "a"}
    prompts = {"p0": PROMPT, "p1": PROMPT}
    assert check_greedy_identity(outputs, dict(outputs), prompts, synthetic_vocab(), never) == []


def test_near_tie_passes_and_is_reported():
    """SYNTHETIC: the texts part after "ab" where "c" and "b" are tied to within float noise."""
    logits = scripted({(): {AB: 5.0, A: 1.0}, (AB,): {C: 4.0, B: 4.0 - 1e-5}})
    ties = check_greedy_identity({"chat-019": "abc"}, {"chat-019": "abb"}, {"chat-019": PROMPT},
                                 synthetic_vocab(), logits, labels=("eagle", "plain"))
    assert len(ties) == 1
    tie = ties[0]
    assert (tie.prompt_id, tie.position, tie.token_a, tie.token_b) == ("chat-019", 1, C, B)
    assert tie.gap == pytest.approx(1e-5, abs=1e-6) and tie.gap <= TIE_TOLERANCE


def test_wide_gap_fails_naming_prompt_position_tokens_and_gap():
    """SYNTHETIC: same parting point, but the target prefers "c" by 2 logits: a real divergence."""
    logits = scripted({(): {AB: 5.0}, (AB,): {C: 4.0, B: 2.0}})
    with pytest.raises(AssertionError) as err:
        check_greedy_identity({"chat-019": "abc", "chat-008": "a"}, {"chat-019": "abb", "chat-008": "a"},
                              {"chat-019": PROMPT, "chat-008": PROMPT}, synthetic_vocab(), logits,
                              labels=("eagle", "plain"))
    msg = str(err.value)
    assert "1/2 prompts identical" in msg and "prompt chat-019" in msg
    assert "generated token 1" in msg
    assert f"eagle emitted {C} 'c'" in msg and f"plain emitted {B} 'b'" in msg
    assert "logit gap 2.00e+00" in msg and "NOT a tie" in msg


def test_both_tokens_below_a_third_top1_is_not_a_tie():
    """SYNTHETIC: the runs disagree with each other and with the target's clear favourite "a"."""
    logits = scripted({(): {AB: 5.0}, (AB,): {C: 4.0, B: 4.0, A: 6.0}})
    with pytest.raises(AssertionError, match=r"top-1 0 'a'.*gap 2\.00e\+00"):
        check_greedy_identity({"p": "abc"}, {"p": "abb"}, {"p": PROMPT}, synthetic_vocab(), logits)


def test_walk_follows_the_engines_split_not_the_canonical_tokenization():
    """SYNTHETIC: the engine wrote "ab" as "a" + "b" (the reference prefers "a" over "ab"); the tie is
    looked up after ("a", "b"), the context the engine had, not after the canonical "ab"."""
    logits = scripted({(): {A: 3.0, AB: 1.0}, (A,): {B: 3.0}, (A, B): {C: 2.0, SPACE: 2.0 - 1e-4}})
    d = find_divergence("p", PROMPT, "abc", "ab ", synthetic_vocab(), logits)
    assert (d.position, d.char_offset, d.token_a, d.token_b) == (2, 2, C, SPACE)
    assert logits.calls == [(), (A,), (A, B)]


def test_one_run_ending_early_is_a_divergence_at_the_stop_token():
    """SYNTHETIC: one run stopped after "ab" where the target clearly continues with "c"."""
    logits = scripted({(): {AB: 5.0}, (AB,): {C: 3.0, STOP: 0.5}})
    with pytest.raises(AssertionError, match=r"emitted 3 'c'.*emitted 9 '<stop>'.*gap 2\.50e\+00"):
        check_greedy_identity({"p": "abc"}, {"p": "ab"}, {"p": PROMPT}, synthetic_vocab(), logits)


def test_text_the_vocabulary_cannot_write_is_an_error_not_a_pass():
    """SYNTHETIC: "z" is no token; the helper says so instead of guessing a position."""
    with pytest.raises(AssertionError, match="no token of the vocabulary continues text b"):
        find_divergence("p", PROMPT, "abc", "abz", synthetic_vocab(), scripted({(): {AB: 1.0}}))


def test_agreement_reports_a_rate_and_asserts_nothing_about_ties():
    agree = agreement({"x": "1", "y": "2", "z": "3"}, {"x": "1", "y": "two", "z": "3"},
                      ("eagle bf16", "plain bf16"))
    assert agree.rate == pytest.approx(2 / 3)
    assert str(agree) == "greedy agreement eagle bf16 vs plain bf16: 2/3 prompts identical (67%) (differ: y)"
    with pytest.raises(AssertionError, match="different prompts"):
        agreement({"x": "1"}, {"y": "1"})


def test_real_target_walk_finds_a_forced_divergence_and_its_gap():
    """The real target (transformers, float32): greedy-decode a smoke prompt, then build a second text
    that takes the runner-up token at step 4. The helper must put the parting at step 4 and fail with
    the target's real top-1/top-2 gap; two identical texts pass."""
    from calib.target import prepare_target
    from tests.engine_identity import HFReference

    ref = HFReference(prepare_target())
    prompt = ref.prompt_ids()["chat-008"]
    ids, fork_at = list(prompt), 4
    for step in range(fork_at + 1):
        logits = ref.logits(ids)
        top2 = torch.topk(logits, 2).indices.tolist()
        if step == fork_at:
            gap = float(logits[top2[0]] - logits[top2[1]])
            break
        ids.append(top2[0])
    common = ids[len(prompt):]
    text_a = ref.tokenizer.decode(common + [top2[0]])
    text_b = ref.tokenizer.decode(common + [top2[1]])
    # The byte-level table writes exactly what the tokenizer decodes.
    assert b"".join(ref.vocab.token_bytes[t] for t in common).decode() == ref.tokenizer.decode(common)
    d = find_divergence("chat-008", prompt, text_a, text_b, ref.vocab, ref.logits)
    assert d.position == fork_at and {d.token_a, d.token_b} == set(top2)
    assert d.gap == pytest.approx(gap, abs=1e-4)
    if gap > TIE_TOLERANCE:  # the usual case; a tie this close would pass, as it should
        parting = f"prompt chat-008: a and b part at generated token {fork_at} "
        with pytest.raises(AssertionError, match=parting):
            check_greedy_identity({"chat-008": text_a}, {"chat-008": text_b}, {"chat-008": prompt},
                                  ref.vocab, ref.logits)
    assert check_greedy_identity({"chat-008": text_a}, {"chat-008": text_a}, {"chat-008": prompt},
                                 ref.vocab, ref.logits) == []
