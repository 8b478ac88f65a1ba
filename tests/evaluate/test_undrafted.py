"""The replay serves a model-free drafter's steps without a draft (calib.evaluate.replay.undrafted), read from the
gaps between a request's rounds in the shipped banks (real: vLLM + SmolLM2-135M)."""

import json
import warnings
from pathlib import Path

import numpy as np
import pytest

from calib.evaluate.data import load_eval_bank
from calib.evaluate.replay.undrafted import undrafted_per_prompt, with_undrafted_steps

BANKS = Path(__file__).resolve().parents[2] / "data" / "banks"


def _bank(name):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load_eval_bank(BANKS / name, None)


@pytest.mark.parametrize("name", ["ngram-chat_code-t0", "ngram-chat_code-t0.8"])
def test_the_steps_between_rounds_account_for_the_engines_output(name):
    """Every output token is a prompt's first (prefill), a round's accept + 1, or an undrafted step; the steps before
    a request's first round and after its last are not seen, so the sum falls short by a little, never over."""
    bank = _bank(name)
    undrafted = sum(undrafted_per_prompt(bank).values())
    manifest = json.loads((BANKS / name / "run_manifest.json").read_text())
    seen = int((bank.chains[bank.primary].accept + 1).sum()) + undrafted + int(manifest["n_prompts"])
    assert undrafted > 0 and seen <= manifest["output_tokens"] and seen >= 0.95 * manifest["output_tokens"]


def test_undrafted_rounds_draft_nothing_and_keep_their_prompt():
    bank = _bank("ngram-chat_code-t0")
    counts = undrafted_per_prompt(bank)
    grown = with_undrafted_steps(bank)
    n, added = len(bank.category), sum(counts.values())
    assert len(grown.category) == n + added and grown.split.shape == grown.category.shape
    for chain in grown.chains.values():
        assert chain.acc.shape[0] == n + added and np.isnan(chain.acc[n:]).all()
        assert not chain.labelled[n:].any()  # nothing to score: calibration never sees them
    new = grown.prompt_idx[n:]
    assert {int(p): int((new == p).sum()) for p in np.unique(new)} == counts
    category = dict(zip(bank.prompt_idx.tolist(), bank.category.tolist()))
    assert all(category[int(p)] == c for p, c in zip(new, grown.category[n:]))


def test_a_model_drafter_drafts_every_step():
    bank = _bank("eagle-chat_code-t0")
    assert undrafted_per_prompt(bank) == {} and with_undrafted_steps(bank) is bank


def test_the_replay_of_an_ngram_bank_serves_its_undrafted_steps():
    """vLLM's n-gram arm (fixed_4) yields fewer tokens per step once the steps without a match are served; no
    speculation's yield stays one token per step."""
    from calib.evaluate.replay.config import ReplayConfig
    from calib.evaluate.replay.driver import replay
    from tests.evaluate.test_replay import curve as parametric

    bank = _bank("ngram-chat_code-t0")
    curve = {"parametric": parametric()}
    rows = {}
    for on in (False, True):
        cfg = ReplayConfig(batch_sizes=(4,), policies=["no_spec", "fixed"], min_steps=64, max_steps=64,
                           undrafted_steps=on, lanes=False)  # the dealt replay: lanes serve the gaps always
        rows[on] = {(r["category"], r["policy"]): r for r in replay([bank], curve, cfg, progress=False)}
    for cat in ("chat", "code_edit"):
        assert rows[True][(cat, "no_spec")]["tokens_per_round"] == pytest.approx(1.0)
        assert rows[True][(cat, "fixed_4")]["tokens_per_round"] < rows[False][(cat, "fixed_4")]["tokens_per_round"]
