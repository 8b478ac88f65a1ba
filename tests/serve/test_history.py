"""RequestHistory keeps calib.labels' definitions of the history context axes (one definition): a
SYNTHETIC sequence of engine steps goes through RequestHistory and, as a bank's rounds, through
calib.labels.round_context; both give identical values (NaN where NaN)."""

from __future__ import annotations

import math

import numpy as np
import pyarrow as pa
import pytest

from calib.labels import HISTORY_COLUMNS, round_context
from calib.serve import RequestHistory


def _simulate(seed: int):
    """SYNTHETIC interleaved steps of several requests (one id reused after finish); returns the bank
    rows of the rounds (drafted >= 1) in step order, each with what RequestHistory said before it."""
    rng = np.random.default_rng(seed)
    hist = RequestHistory()
    # engine request id -> (prompt_idx, turn); "r1" finishes and is reused for another prompt
    active = {"r0": (0, 0), "r1": (1, 0), "r2": (0, 1)}
    n_rounds = {k: 0 for k in active}
    rows = []
    for step in range(40):
        if step == 20:
            hist.finish("r1")
            active["r1"], n_rounds["r1"] = (2, 0), 0
        ids = [*active, "never-seen"]  # values(), vectorised over a step's requests, is context() per request
        got = hist.values(ids)
        for b, req in enumerate(ids):
            want = hist.context(req)
            assert all(np.array_equal(got[n][b], want[n], equal_nan=True) for n in HISTORY_COLUMNS), (req, got, want)
        for req, (prompt, turn) in active.items():
            if rng.uniform() < 0.2:
                continue  # not scheduled this step
            drafted = int(rng.integers(0, 5))  # 0: no draft this step (no round in the bank)
            accepted = int(rng.integers(0, drafted + 1))
            before = hist.context(req)
            hist.observe(req, accepted, drafted)
            if drafted:
                rows.append({"prompt_idx": prompt, "turn": turn, "round_idx": n_rounds[req],
                             "accept": accepted, **{f"h_{k}": v for k, v in before.items()}})
                n_rounds[req] += 1
            else:
                assert hist.context(req) == pytest.approx(before, nan_ok=True)
    return rows


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_history_equals_labels_definitions(seed):
    rows = _simulate(seed)
    order = np.random.default_rng(seed + 100).permutation(len(rows))  # a bank's rows in any order
    rows = [rows[i] for i in order]
    n = len(rows)
    t = pa.table({"model": ["m"] * n, "speculator": ["s"] * n, "config": ["c"] * n, "category": ["chat"] * n,
                  "prompt_idx": [r["prompt_idx"] for r in rows], "turn": [r["turn"] for r in rows],
                  "round_idx": [r["round_idx"] for r in rows], "accept": [r["accept"] for r in rows]})
    ctx = round_context(t, HISTORY_COLUMNS)
    for name in HISTORY_COLUMNS:
        mine = np.array([r[f"h_{name}"] for r in rows], dtype=np.float64)
        assert np.array_equal(mine, ctx[name], equal_nan=True), name
    assert np.isnan(ctx["prev_accept"]).any() and (ctx["position"] > 0).any()  # both cases exercised


def test_first_round_observe_and_finish():
    h = RequestHistory()
    first = h.context("a")
    assert math.isnan(first["prev_accept"]) and math.isnan(first["mean_accept"]) and first["position"] == 0
    h.observe("a", 2)
    h.observe("a", 0, drafted=3)
    h.observe("a", 0, drafted=0)  # no round
    assert h.context("a") == {"prev_accept": 0.0, "mean_accept": 1.0, "position": 4.0}
    v = h.values(["a", "b"])
    assert v["position"].tolist() == [4.0, 0.0] and np.isnan(v["prev_accept"][1])
    h.finish("a")
    h.finish("never-seen")
    assert "a" not in h and len(h) == 0
    with pytest.raises(ValueError, match="accepted=4 > drafted=3"):
        h.observe("a", 4, drafted=3)
    with pytest.raises(ValueError, match=">= 0"):
        h.observe("a", -1)
    with pytest.raises(KeyError, match="temperature"):
        h.values(["a"], ["temperature"])


# -- read from the text (serving's history: RequestHistory(from_text=True)) ---------------------------------------


def _serve_text(seed: int, verify_whole: bool, n_requests: int = 3, steps: int = 30):
    """SYNTHETIC engine steps of requests generating fixed texts: at each step a request is offered a chain (a
    prefix of its text's continuation of random length, then wrong tokens; or nothing) and verifies a random prefix
    of it (``verify_whole``: all of it, as a bank's collector does), accepting the common prefix with the text,
    then emitting one more token of the text. Returns the bank rows of the rounds (accept = the whole chain's
    common prefix with the text, as verifying all of it would accept) with what the history said before each,
    and each round's emitted tokens."""
    rng = np.random.default_rng(seed)
    hist = RequestHistory(from_text=True)
    prompt = 5
    texts = {f"r{i}": rng.integers(0, 50, size=prompt + 200).tolist() for i in range(n_requests)}
    length = {r: prompt for r in texts}  # tokens the request holds
    rows, n_rounds = [], {r: 0 for r in texts}
    opened = {r: [] for r in texts}  # (start, chain) of each round
    ids = list(texts)
    for _ in range(steps):
        hist.settle(ids, lambda i: np.asarray(texts[ids[i]][: length[ids[i]]]))
        chains, verified, starts = [], [], []
        for r in ids:
            n = length[r]
            if rng.uniform() < 0.25:  # no chain offered: no round
                chains.append([]), verified.append(0), starts.append(n)
                continue
            good = int(rng.integers(0, 5))
            chain = texts[r][n: n + good] + [99] * int(rng.integers(0, 5 - good))  # 99: never in a text
            chain = chain[:4] or [99]
            d = len(chain) if verify_whole else int(rng.integers(0, len(chain) + 1))
            chains.append(chain), verified.append(d), starts.append(n)
        before = {r: hist.context(r) for r in ids}
        for r in ids:  # what the text read so far says of each earlier round: its common prefix with its chain
            seen = [_common(c, texts[r][x: length[r]]) for x, c in opened[r]]
            assert before[r]["mean_accept"] == (np.mean(seen) if seen else pytest.approx(math.nan, nan_ok=True))
            assert before[r]["prev_accept"] == (seen[-1] if seen else pytest.approx(math.nan, nan_ok=True))
        hist.open_rounds(ids, starts, chains, verified)
        for r, x, c in zip(ids, starts, chains):
            if c:
                opened[r].append((x, c))
        for r, chain, d in zip(ids, chains, verified):
            if not chain:
                length[r] += 1
                continue
            whole = 0
            while whole < len(chain) and chain[whole] == texts[r][length[r] + whole]:
                whole += 1
            rows.append({"prompt_idx": int(r[1:]), "round_idx": n_rounds[r], "accept": whole,
                         "emitted": min(whole, d) + 1, **{f"h_{k}": v for k, v in before[r].items()}})
            n_rounds[r] += 1
            length[r] += min(whole, d) + 1  # the verified accepted tokens, then the step's own
            hist.observe(r, min(whole, d), d)  # from the text: changes nothing
    return rows


def _common(chain, text) -> int:
    n = 0
    while n < min(len(chain), len(text)) and chain[n] == text[n]:
        n += 1
    return n


def _bank_context(rows):
    n = len(rows)
    t = pa.table({"model": ["m"] * n, "speculator": ["s"] * n, "config": ["c"] * n, "category": ["chat"] * n,
                  "prompt_idx": [r["prompt_idx"] for r in rows], "turn": [0] * n,
                  "round_idx": [r["round_idx"] for r in rows], "accept": [r["accept"] for r in rows]})
    return round_context(t, HISTORY_COLUMNS)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_from_text_equals_bank_definitions_when_verifying_whole_chains(seed):
    """Verifying every chain whole (a bank's collector), the history read from the text is the bank's."""
    rows = _serve_text(seed, verify_whole=True)
    ctx = _bank_context(rows)
    for name in HISTORY_COLUMNS:
        mine = np.array([r[f"h_{name}"] for r in rows], dtype=np.float64)
        assert np.array_equal(mine, ctx[name], equal_nan=True), name


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_from_text_counts_whole_chains_when_calib_verifies_a_prefix(seed):
    """calib verifying a prefix (or none) of a chain: prev_accept and mean_accept count each earlier round's whole
    chain against the text read so far (checked at every step in _serve_text): the bank's value once the text has
    passed the round, a lower bound before. Counted from the step's outcomes instead, both would be cut at the
    depth verified. position counts what each round's step emitted."""
    rows = _serve_text(seed, verify_whole=False)
    ctx = _bank_context(rows)
    mine = np.array([r["h_mean_accept"] for r in rows], dtype=np.float64)
    first = np.isnan(ctx["mean_accept"])
    assert np.array_equal(np.isnan(mine), first)
    assert (mine[~first] <= ctx["mean_accept"][~first] + 1e-12).all()  # a lower bound of the bank's
    assert (mine[~first] < ctx["mean_accept"][~first] - 1e-12).any()  # (one round still ahead of the text)
    by_request: dict = {}
    for r in rows:
        emitted_before = by_request.setdefault(r["prompt_idx"], 0)
        assert r["h_position"] == emitted_before
        by_request[r["prompt_idx"]] += r["emitted"]
    assert any(r["emitted"] < r["accept"] + 1 for r in rows)  # some round was cut: the case differs from a bank's


def test_from_text_round_waits_for_the_text():
    """A round whose chain runs past the text read so far counts its common prefix so far, and settles once the
    text passes its first mismatch or its last token; a request not in the call waits."""
    h = RequestHistory(from_text=True)
    h.open_rounds(["a", "b"], [3, 2], [[7, 8, 9], [5]], [1, 0])
    assert h.context("a") == {"prev_accept": 0.0, "mean_accept": 0.0, "position": 1.0}
    h.settle(["a"], lambda i: [0, 0, 0, 7, 8])  # a verified 7 (accepted), emitted 8: its third token not yet known
    assert h.context("a") == {"prev_accept": 2.0, "mean_accept": 2.0, "position": 2.0}
    h.settle(["a"], lambda i: [0, 0, 0, 7, 8, 9, 1])
    assert h.context("a")["mean_accept"] == 3.0 and h.context("a")["position"] == 2.0
    h.settle(["a"], lambda i: [0, 0, 0, 1, 1, 1, 1])  # settled: a later text does not reopen it
    assert h.context("a")["mean_accept"] == 3.0
    assert h.context("b")["mean_accept"] == 0.0  # b was not in the calls
    h.settle(["b"], lambda i: np.array([0, 0, 5]))
    assert h.context("b") == {"prev_accept": 1.0, "mean_accept": 1.0, "position": 1.0}  # emptied: 1 token emitted
    assert h.settled == {"rounds": 2, "whole": 4, "verified": 1}  # a: 3 whole, 1 verified; b: 1 whole, 0 verified
    h.observe("a", 0, drafted=2)  # the step's outcome: the text already said
    assert h.context("a")["mean_accept"] == 3.0
    h.finish("a")
    h.settle(["a"], lambda i: [])
    assert "a" not in h


def test_round_chains_takes_whole_chains():
    from calib.chains import Offer
    from calib.serve.history import round_chains

    offers = {"ngram": Offer([[1, 2, 3], [4, 5], [6]], None)}
    got = round_chains([[1], [], [9]], ["ngram", None, "ngram"], [[1, 2, 3, 4], [4, 5, 6], []],
                       offers, engine_chain="model")
    assert got == [[1, 2, 3], [4, 5, 6], [9]]  # the whole chain; the engine's when emptied; the verified if off
    assert round_chains([[1, 2]], ["model"], [[1, 2, 3, 4]], {}, engine_chain="model") == [[1, 2, 3, 4]]
