"""vLLM's suffix decoding as a replay peer (``vllm_suffix``, calib/policies/reference.py; issues 41, 45): replayed on
a shipped bank that records the suffix chain, skipped with a note on one that does not, and the bench's
``vllm_suffix`` arm registered beside ``vllm_ngram`` (vLLM's fixed K with ``speculative=suffix``)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from calib.cost import make_curve
from calib.evaluate.replay import ReplayConfig, replay

ROOT = Path(__file__).resolve().parents[2]
SUFFIX_BANK, NGRAM_BANK = ROOT / "data/banks/suffix-chat_code-t0", ROOT / "data/banks/ngram-chat_code-t0"
MATCH_EDGES = (2.0, 4.0, 8.0)  # the stand-in suffix table's bins of the tree's matched context length


def suffix_stand_in_tables(out: Path) -> Path:
    """Quick STAND-IN tables (NOT the project's calibrators, tests/evaluate/fit_tables.py's kind): fit_tables' n-gram
    cell rates on the n-gram bank's train split, and the suffix chain's accept rate per (depth, match_n bin) on the
    suffix bank's train split with a Beta(1, 1) prior. Enough to load both banks and replay them."""
    import torch

    from calib.bank import load as load_bank
    from calib.chains import Axis, chain
    from calib.chains.suffix import suffix_round_data
    from calib.labels import censored, prompt_split
    from calib.tables import GridTables, load, save
    from calib.tables.layout import ChainTable
    from tests.evaluate.fit_tables import fit_tables

    ngram = load(fit_tables([NGRAM_BANK], out / "ngram", split="train"))
    bank = load_bank(SUFFIX_BANK)
    rounds = bank.rounds(chains=[chain("suffix")])
    data = suffix_round_data(rounds, ["match_n"])
    cats = np.asarray(rounds.column("category").to_pylist(), dtype=object)
    train = prompt_split(cats, rounds.column("prompt_idx").to_numpy()) == "train"
    reached, label = censored(data.acc[train])
    k = data.acc.shape[1]
    cell = np.searchsorted(np.asarray(MATCH_EDGES), np.nan_to_num(data.inputs[train, 0, 0]), side="right")
    grid = np.zeros((k, len(MATCH_EDGES) + 1))
    for d in range(k):
        m = reached[:, d]
        n = np.bincount(cell[m], minlength=grid.shape[1])
        a = np.bincount(cell[m], weights=label[m, d], minlength=grid.shape[1])
        grid[d] = (a + 1) / (n + 2)
    suffix = ChainTable.build((Axis("match_n", edges=MATCH_EDGES),), grid, torch.tensor([MATCH_EDGES]),
                              torch.tensor([1]))
    meta = dict(ngram.meta)
    meta["chains"] = {**meta["chains"], "suffix": {"estimator": "cell rate (test stand-in)", "depths": k, "k": k,
                                                   "ids": ["suffix"]}}
    meta["banks"] = [str(NGRAM_BANK), str(SUFFIX_BANK)]
    return save(out / "tables", GridTables({"ngram": ngram.table("ngram"), "suffix": suffix}), meta=meta)


@pytest.fixture(scope="module")
def banks(tmp_path_factory):
    import calib.tables
    from calib.evaluate.data import load_eval_bank

    tables = calib.tables.load(suffix_stand_in_tables(tmp_path_factory.mktemp("suffix")))
    return load_eval_bank(SUFFIX_BANK, tables), load_eval_bank(NGRAM_BANK, tables)


def test_vllm_suffix_is_replayed_on_a_suffix_bank_and_skipped_with_a_note_elsewhere(banks):
    from calib.policies import camp_of

    suffix, ngram = banks
    assert suffix.primary == "suffix" and ngram.primary == "ngram" and "suffix" not in ngram.chains
    curve = make_curve("parametric", {"kind": "parametric", "weight_read": 1.0, "per_position": 0.01}, 64)
    cfg = ReplayConfig(batch_sizes=(1, 4), policies=["no_spec", "fixed", "vllm_suffix"], min_steps=4, max_steps=8)
    rows = replay([suffix, ngram], {"parametric": curve}, cfg, progress=False)
    by = {(r["bank"], r["batch_size"], r["category"], r["policy"]): r for r in rows}
    mine = [key for key in by if key[3].startswith("vllm_suffix_")]
    k = suffix.chains["suffix"].acc.shape[1]
    assert {key[3] for key in mine} == {f"vllm_suffix_{g}" for g in range(1, k + 1)}
    assert {key[0] for key in mine} == {suffix.name}  # the n-gram bank records no suffix chain: no rows there
    for bank, b, cat, name in mine:  # on a suffix bank vLLM's suffix arm is the bank's own drafter at γ
        fixed = by[(bank, b, cat, name.replace("vllm_suffix", "fixed"))]
        assert (by[(bank, b, cat, name)]["_tokens"], by[(bank, b, cat, name)]["_cost"]) == (fixed["_tokens"],
                                                                                              fixed["_cost"])
        assert by[(bank, b, cat, name)]["gamma"] == int(name.rsplit("_", 1)[1])
    assert {r["bank"] for r in rows if r["policy"] == "no_spec"} == {suffix.name, ngram.name}  # the rest replays
    skipped = [n for n in ngram.notes if n.startswith("vllm_suffix")]
    assert len(skipped) == 1 and "no suffix chain" in skipped[0]  # once, however many settings it skipped
    assert not [n for n in suffix.notes if n.startswith("vllm_suffix")]
    assert camp_of("vllm_suffix_4") == "peer"  # a peer in the report's Answer, beside vLLM's other arms


def test_vllm_suffix_is_a_registered_vllm_arm_like_vllm_ngram():
    from calib.evaluate import clock
    from calib.evaluate.prediction import replay_row

    arms = clock.arms()
    suffix, ngram = arms["vllm_suffix"], arms["vllm_ngram"]
    assert (suffix.policy, suffix.method, suffix.vllm) == (ngram.policy, "suffix", True)
    assert suffix.overrides == ("policy=fixed", "speculative=suffix")
    assert not suffix.default  # the suffix tree is an extra install (make install-suffix): run when named
    assert "vllm_suffix" in clock.vllm_spec_arms()  # counted among the best vLLM arms of a bench's cells
    # the bench predicts it from the replay's fixed_<K> row of a bank drafted by speculative=suffix
    assert replay_row(suffix.policy, suffix.family, 4) == "fixed_4"
