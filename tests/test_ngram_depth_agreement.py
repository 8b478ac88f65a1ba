"""The n-gram chain's per-depth agreement (calib.ngram.depth_agreement) through capture, banks, tables and serving,
on SYNTHETIC records and banks: a bank collected before calib recorded it stays usable (depth 0 reads the round's
agreement, deeper depths a bucket of their own), and a run that records it for some rounds only is refused."""

import numpy as np
import pytest

from calib.bank import load, validate, write_bank
from calib.chains import chain
from calib.chains.ngram import NOT_RECORDED, batch_feature_array, depth_agreement_matrix, round_feature_tensor
from calib.collect.assemble import RunKeys, build_tables
from calib.ngram import MATCH_FEATURES, find_match, find_matches
from tests.synthetic import synthetic_tables

KEYS = RunKeys(model="m", speculator="draft_model:x", config="c", width=3, chain_width=3,
               chain_verified=False, temperature=0.0)


def _rec(step, chain, context_len, depth=True):
    feats = {"match_n": 1, "occurrences": 2, "distance": 3, "in_prompt": True, "distinct_next": 1, "agreement": 0.5,
             "cont_len": 2, "context_len": context_len}
    if depth:
        feats["depth_agreement"] = [0.5, 1.0, 1.0][: len(chain)]
    return {"req": "0-abcdefgh", "step": step, "batch_size": 1, "drafted": [7], "accepted": 0,
            "context_len": context_len, "prompt_len": 3, "ngram_tokens": list(chain), "ngram": feats}


def test_capture_writes_it_per_depth_and_an_older_capture_leaves_the_columns_out(tmp_path):
    final = [10, 11, 12, 13, 20, 21, 22, 23]
    _, _, ng = build_tables({0: [_rec(1, [20, 21, 5], 4), _rec(2, [], 6)]}, {0: "chat"}, {0: final}, KEYS)
    assert ng.column("depth_agreement1").to_pylist() == [1.0, None]
    old = build_tables({0: [_rec(1, [20, 21, 5], 4, depth=False)]}, {0: "chat"}, {0: final}, KEYS)
    assert not [c for c in old[2].column_names if c.startswith("depth_agreement")]
    assert write_bank(tmp_path / "old", *old) and validate(str(tmp_path / "old")) == []
    with pytest.raises(ValueError, match="prompt 0 round 1: .* records no depth_agreement .* new out_dir"):
        build_tables({0: [_rec(1, [20, 21, 5], 4), _rec(2, [22, 23], 6, depth=False)]}, {0: "chat"}, {0: final}, KEYS)


def test_a_bank_without_it_reads_agreement_at_depth_0_and_not_recorded_deeper(tmp_path):
    acc, spec, ng = synthetic_tables(n_prompts=3, rounds_per_prompt=6, width=4, seed=2)
    old = ng.drop([c for c in ng.column_names if c.startswith("depth_agreement")])
    length = np.asarray(ng.column("ngram_len").to_pylist())
    got = depth_agreement_matrix(old, 4, length)
    on = np.arange(4)[None, :] < length[:, None]
    agreement = np.asarray(old.column("agreement").to_pylist(), dtype=float)
    assert np.array_equal(got[:, 0][on[:, 0]], agreement[on[:, 0]])
    assert (got[:, 1:][on[:, 1:]] == NOT_RECORDED).all() and np.isnan(got[~on]).all()
    # a bank that records it reads its own values; the table's tensor lays them out per depth
    new = depth_agreement_matrix(ng, 4, length)
    want = np.stack([np.asarray(ng.column(f"depth_agreement{j}").to_pylist(), dtype=float) for j in range(4)], 1)
    assert np.array_equal(np.nan_to_num(new, nan=-9), np.nan_to_num(want, nan=-9))
    x = round_feature_tensor(ng, ["match_n", "depth_agreement"], 4).numpy()
    assert np.allclose(np.nan_to_num(x[:, :, 1], nan=-9), np.nan_to_num(want, nan=-9).astype(np.float32))
    # samples of both kinds of bank together: every value set, the older bank's deep depths not recorded
    write_bank(tmp_path / "new", acc, spec, ng)
    acc2, spec2, ng2 = synthetic_tables(n_prompts=3, rounds_per_prompt=6, width=4, seed=5, speculator="older")
    write_bank(tmp_path / "old", acc2, spec2, ng2.drop([c for c in ng2.column_names if c.startswith("depth_agreement")]))
    both = chain("ngram").samples(load([tmp_path / "new", tmp_path / "old"]))
    old_only = chain("ngram").samples(load([tmp_path / "old"]))
    assert both.depth_agreement.notna().all() and len(both) > len(old_only)
    assert (old_only.depth_agreement[old_only.depth > 0] == NOT_RECORDED).all()
    assert (both.depth_agreement == NOT_RECORDED).sum() == (old_only.depth > 0).sum()


def test_serving_reads_the_batch_matchers_per_depth_columns():
    ctx = [5, 1, 2, 3, 9, 1, 2, 4, 7, 1, 2, 3, 8, 1, 2]
    tokens, feats = find_matches(np.array([ctx, ctx[:3] + [0] * 12], dtype=np.int32), [0, 1], [15, 3], [0, 0], 1, 4, 4)
    assert feats.shape == (2, len(MATCH_FEATURES) + 4)
    x = batch_feature_array(feats, [len(t) for t in tokens], ["match_n", "depth_agreement"], 4)
    assert x[0, :, 1].tolist() == pytest.approx(find_match(ctx, 1, 4, 4).depth_agreement)
    assert np.isnan(x[1]).all()  # no match: nothing to read
    assert (x[0, :, 0] == 2).all()


def test_check_bank_notes_an_older_bank_instead_of_refusing_it(tmp_path):
    from calib.tables import load as load_tables
    from tests.evaluate.fit_tables import fit_tables

    acc, spec, ng = synthetic_tables(n_prompts=24, rounds_per_prompt=10, width=4, seed=3)
    manifest = {"model": "synthetic-model", "speculator": "synthetic"}
    train = write_bank(tmp_path / "train", acc, spec, ng, manifest=manifest)
    tables = load_tables(fit_tables([train], tmp_path / "tables", ngram_features=("match_n", "depth_agreement"),
                                    ngram_edges=((2, 3, 4), (-0.5, 0.5, 0.99))))
    acc, spec, ng = synthetic_tables(n_prompts=6, rounds_per_prompt=10, width=4, seed=4)
    old = write_bank(tmp_path / "old", acc, spec, ng.drop([c for c in ng.column_names if c.startswith("depth_agr")]),
                     manifest=manifest)
    with pytest.warns(UserWarning, match="collected before calib recorded \\['depth_agreement'\\]"):
        tables.check_bank(old)
