"""Tables: export grids, round trip, checksum and version refusal (SYNTHETIC fits)."""

import json

import numpy as np
import pandas as pd
import pytest
import torch

from calib.calibrators.base import with_depth
from calib.calibrators.binning import IsotonicPerDepth
from calib.calibrators.features import LogisticAcceptance
from calib.tables import ChainTable, GridTables, TablesError, load, save
from calib.tables.export import model_grid, ngram_grid, table_predict
from calib.tables.io import TablesWarning
from tests.synthetic import two_chain_tables

FEATS = ["match_n", "agreement"]


@pytest.fixture
def tables():
    rng = np.random.default_rng(0)
    c = rng.uniform(size=5000)
    d = rng.integers(0, 3, 5000)
    y = (rng.uniform(size=5000) < c**2).astype(int)
    grid, change = model_grid(IsotonicPerDepth().fit(with_depth(c, d), y), 3, 65)
    assert (np.diff(grid, axis=1) >= 0).all() and change < 1e-9  # isotonic is already monotone
    df = pd.DataFrame({"match_n": rng.integers(1, 5, 5000), "agreement": rng.uniform(size=5000),
                       "depth": rng.integers(0, 3, 5000)})
    yy = (rng.uniform(size=5000) < 0.2 * df.match_n).astype(int)
    model = LogisticAcceptance(features=["match_n", "agreement"]).fit(df, yy)
    edges, strides, ngrid, info = ngram_grid(model, df, ["match_n", "agreement"], [[1.5, 2.5, 3.5], [0.5]], 3)
    assert info["cells"] == 8 and strides.tolist() == [2, 1]
    # A cell's value is the mean prediction of the samples in it.
    pred = model.accept_proba(df)
    m = (df.depth == 1) & (df.match_n == 2) & (df.agreement >= 0.5)
    assert ngrid[1, 1 * 2 + 1] == pytest.approx(pred[m.to_numpy()].mean(), rel=1e-5)
    t = two_chain_tables(grid, edges, strides, ngrid, features=FEATS)
    table_p = table_predict(t.chains["ngram"], df[FEATS], df.depth)
    assert np.corrcoef(table_p, pred)[0, 1] > 0.95
    return t


def test_round_trip(tmp_path, tables):
    save(tmp_path, tables, {})
    t = load(tmp_path)
    for name in ("model", "ngram"):
        for part in ("grid", "edges", "strides"):
            assert torch.equal(getattr(t.chains[name], part), getattr(tables.chains[name], part))
        assert t.chains[name].axes == tables.chains[name].axes
    assert t.has_chain("model") and t.feature_names("ngram") == FEATS
    meta = json.loads((tmp_path / "tables.json").read_text())
    assert meta["schema_version"] == 3 and meta["chains"]["model"]["id"] == 1 and meta["chains"]["ngram"]["id"] == 2
    assert meta["chains"]["ngram"]["axes"][1] == {"name": "agreement", "kind": "bins", "edges": [0.5]}
    assert meta["chains"]["model"]["axes"] == [{"name": "conf", "kind": "interpolate", "points": 65}]
    conf = torch.tensor([[0.0, 0.5, float("nan")], [1.0, 0.25, 0.75]])
    p = t.accept_prob("model", conf)
    assert torch.isnan(p[0, 2]) and not torch.isnan(p[1]).any()
    assert t.accept_prob("model", conf[:, 1:2], depth=1)[1, 0] == p[1, 1]
    feats = torch.tensor([[[2.0, 0.7], [1.0, 0.1]]])
    assert t.accept_prob("ngram", feats[:, 1], depth=1)[0] == t.accept_prob("ngram", feats)[0, 1]
    assert not list(tmp_path.glob(".tables.tmp-*"))


def test_checksum_refusal(tmp_path, tables):
    save(tmp_path, tables, {})
    raw = bytearray((tmp_path / "tables.safetensors").read_bytes())
    raw[-1] ^= 0xFF
    (tmp_path / "tables.safetensors").write_bytes(bytes(raw))
    with pytest.raises(TablesError, match="sha256"):
        load(tmp_path)


def test_version_refusal(tmp_path, tables):
    save(tmp_path, tables, {})
    meta = json.loads((tmp_path / "tables.json").read_text())
    meta["schema_version"] = 999
    (tmp_path / "tables.json").write_text(json.dumps(meta))
    with pytest.raises(TablesError, match="schema_version 999"):
        load(tmp_path)


def test_missing_files(tmp_path):
    with pytest.raises(TablesError, match="not found"):
        load(tmp_path)


def test_edited_json_is_refused(tmp_path, tables):
    """tables.json is covered by its own digest: an edited feature order no longer loads (it used to,
    silently dropping n-gram AUROC 0.81 -> 0.67 on the sample banks)."""
    save(tmp_path, tables, {})
    meta = json.loads((tmp_path / "tables.json").read_text())
    assert meta["json_sha256"] and meta["tensors_sha256"]
    axes = meta["chains"]["ngram"]["axes"]
    meta["chains"]["ngram"]["axes"] = axes[::-1]  # same tensors, another meaning
    (tmp_path / "tables.json").write_text(json.dumps(meta, indent=2, sort_keys=True))
    with pytest.raises(TablesError, match="edited after export.*re-export"):
        load(tmp_path)
    # Re-indenting alone (same content) is not an edit.
    meta["chains"]["ngram"]["axes"] = axes
    (tmp_path / "tables.json").write_text(json.dumps(meta))
    assert load(tmp_path).feature_names("ngram") == FEATS


def test_old_schema_is_refused_with_re_export(tmp_path, tables):
    save(tmp_path, tables, {})
    meta = json.loads((tmp_path / "tables.json").read_text())
    meta["schema_version"] = 2  # model_grid / ngram_* tensors and `drafters`: refused, not misread
    (tmp_path / "tables.json").write_text(json.dumps(meta))
    with pytest.raises(TablesError, match="schema_version 2, this calib reads 3; re-export"):
        load(tmp_path)


def test_saved_files_are_public(tmp_path, tables):
    import os

    umask = os.umask(0o022)
    try:
        save(tmp_path / "t", tables, {"drafters": {}})
    finally:
        os.umask(umask)
    modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "t").iterdir()}
    assert modes == {"tables.safetensors": 0o644, "tables.json": 0o644}  # was 0600 (tempfile)


# --- tables x bank cross-checks (issue 12 item 2) ---------------------------------------------------

MANIFEST = {"model": "synthetic-model", "speculator": "eagle:head", "method": "eagle", "num_speculative_tokens": 4}


def _bank(tmp_path, name="bank", width=4, speculator="eagle:head", manifest=None, temperature=0.0):
    """A SYNTHETIC bank; ``temperature`` (a number, a list cycled over the rounds, or None = no column)
    is speculator.parquet's temperature column."""
    import pyarrow as pa

    from calib.bank import write_bank
    from tests.synthetic import synthetic_tables

    man = {**MANIFEST, "speculator": speculator, "num_speculative_tokens": width} if manifest is None else manifest
    acceptance, spec, ngram = synthetic_tables(n_prompts=6, rounds_per_prompt=4, width=width, speculator=speculator)
    if temperature is not None:
        temps = temperature if isinstance(temperature, list) else [temperature]
        spec = spec.append_column(pa.field("temperature", pa.float64()),
                                  pa.array([temps[i % len(temps)] for i in range(spec.num_rows)], pa.float64()))
    return write_bank(tmp_path / name, acceptance, spec, ngram, manifest=man)


def _temps(*values):
    return {"values": list(values), "n_values": len(values), "min": min(values), "max": max(values),
            "unrecorded_samples": 0}


def _fitted(tmp_path, tables, k=4, ids=("eagle:head",), target="synthetic-model", temperatures=(0.0,)):
    rec = {"temperatures": _temps(*temperatures)} if temperatures else {}
    meta = {"target_models": [target], "chains": {"model": {"ids": list(ids), "k": k, **rec},
                                                  "ngram": {"ids": ["ngram"], "k": k, **rec}}}
    return load(save(tmp_path / "tables", tables, meta))


def test_check_bank_accepts_a_matching_bank(tmp_path, tables):
    import warnings

    t = _fitted(tmp_path, tables)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing unchecked either
        assert t.check_bank(_bank(tmp_path)) == []
        assert t.check_bank(_bank(tmp_path, "shallow", width=2)) == []  # K=2 bank: depths 0-1 are calibrated


def test_check_bank_refuses_a_deeper_bank(tmp_path, tables):
    """K=2 tables on a K=4 bank used to read depths 2-3 from row 1, silently."""
    t = _fitted(tmp_path, tables, k=2)
    bank = _bank(tmp_path)
    with pytest.raises(TablesError, match=r"depth: tables .*tables cover model-drafter depths 0..1 \(K=2\), bank "
                                          rf"{bank} drafts K=4"):
        t.check_bank(bank)


def test_check_bank_refuses_another_drafter_or_target(tmp_path, tables):
    t = _fitted(tmp_path, tables)
    other = _bank(tmp_path, "dm", speculator="draft_model:first24layers")
    with pytest.raises(TablesError, match=r"\['eagle:head'\], bank .*dm was drafted by 'draft_model:first24layers'"):
        t.check_bank(other)
    renamed = _bank(tmp_path, "renamed", manifest={**MANIFEST, "model": "synthetic-model"})
    t2 = _fitted(tmp_path / "x", tables, target="Other-7B")
    with pytest.raises(TablesError, match=r"fitted for \['Other-7B'\], bank .*renamed was collected with "
                                          r"'synthetic-model'"):
        t2.check_bank(renamed)
    # as a manifest dict (the serve path has no bank folder)
    with pytest.raises(TablesError, match="bank engine-config was drafted by 'draft_model:x'"):
        t.check_bank({**MANIFEST, "speculator": "draft_model:x"}, path="engine-config")
    # the tables do not calibrate the bank's verified chain at all
    only_ngram = load(save(tmp_path / "ng", GridTables({"ngram": tables.chains["ngram"]}),
                           {"target_models": ["synthetic-model"], "chains": {"ngram": {"ids": ["ngram"], "k": 4}}}))
    with pytest.raises(TablesError, match=r"calibrate \['ngram'\], bank .* verified chain is the model drafter"):
        only_ngram.check_bank(_bank(tmp_path))


def test_check_bank_refuses_a_deeper_second_chain(tmp_path, tables):
    """The n-gram chain a model bank records is checked against the tables' n-gram K (registry hook)."""
    meta = {"target_models": ["synthetic-model"], "chains": {"model": {"ids": ["eagle:head"], "k": 4},
                                                            "ngram": {"ids": ["ngram"], "k": 2}}}
    t = load(save(tmp_path / "tables", tables, meta))
    with pytest.raises(TablesError, match=r"cover ngram-chain depths 0..1 \(K=2\), bank .*'s ngram chain is 4 deep"):
        t.check_bank(_bank(tmp_path))


def test_check_bank_refuses_missing_ngram_features(tmp_path, tables):
    t = _fitted(tmp_path, tables)
    bank = _bank(tmp_path)
    import pyarrow.parquet as pq

    ng = pq.read_table(bank / "ngram.parquet")
    pq.write_table(ng.drop(["agreement"]), bank / "ngram.parquet")
    with pytest.raises(TablesError, match=r"read \['match_n', 'agreement'\], bank .*ngram.parquet lacks \['agreement'\]"):
        t.check_bank(bank)


def test_check_bank_warns_what_it_cannot_check(tmp_path, tables):
    t = _fitted(tmp_path, tables)
    bank = _bank(tmp_path, manifest={"num_speculative_tokens": 4})
    with pytest.warns(TablesWarning) as rec:
        notes = t.check_bank(bank)
    assert len(notes) == 2 and "records no `model`" in notes[0] and "records no `speculator`" in notes[1]
    assert {str(w.message) for w in rec} == set(notes)
    # no temperature on either side: said, not skipped silently
    with pytest.warns(TablesWarning) as rec:
        notes = _fitted(tmp_path / "old", tables, temperatures=()).check_bank(_bank(tmp_path, "b2", temperature=None))
    assert len(notes) == 1 and "no temperature column" in notes[0] and "model: not recorded" in notes[0]


def test_check_bank_refuses_a_bank_at_another_temperature(tmp_path, tables):
    """A T = 0.8 bank on tables fitted at T = 0 used to be evaluated without a word (issue 25)."""
    import warnings

    t = _fitted(tmp_path, tables, temperatures=(0.0,))  # one temperature: still recorded
    hot = _bank(tmp_path, "hot", temperature=0.8)
    with pytest.raises(TablesError) as err:
        t.check_bank(hot)
    msg = str(err.value)
    assert f"tables {tmp_path / 'tables'} were fitted at temperatures [0] (model and ngram chains)" in msg
    assert f"bank {hot} samples at temperature [0.8], outside that range" in msg
    assert f"python train.py data.train=[...,{hot}]" in msg
    both = _fitted(tmp_path / "both", tables, temperatures=(0.0, 0.8))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert both.check_bank(hot) == [] and both.check_bank(_bank(tmp_path, "mixed", temperature=[0.0, 0.8])) == []
    with pytest.warns(TablesWarning, match=r"temperature \[0.4\], between the temperatures"):
        both.check_bank(_bank(tmp_path, "mid", temperature=0.4))
    neg = _bank(tmp_path, "neg")  # a negative temperature written behind the bank validator's back
    import pyarrow as pa
    import pyarrow.parquet as pq

    spec = pq.read_table(neg / "speculator.parquet")
    temps = pa.array([-1.0 if i % 2 else 0.0 for i in range(spec.num_rows)], pa.float64())
    pq.write_table(spec.set_column(spec.column_names.index("temperature"), "temperature", temps),
                   neg / "speculator.parquet")
    with pytest.raises(TablesError, match=rf"bank {neg} holds temperature \[-1\], which no sampler uses"):
        both.check_bank(neg)
    # no temperature column: the manifest's sampling.temperature stands in
    dict_bank = _bank(tmp_path, "man", temperature=None, manifest={**MANIFEST, "sampling": {"temperature": 0.8}})
    with pytest.raises(TablesError, match=r"samples at temperature \[0.8\]"):
        t.check_bank(dict_bank)
    # a manifest dict without a temperature (an engine's) is left to check_temperature
    assert t.check_bank(dict(MANIFEST), path="engine") == []


def test_check_temperature_for_serving(tmp_path, tables):
    t = _fitted(tmp_path, tables, temperatures=(0.0, 0.8))
    assert t.check_temperature(0.0) == [] and t.check_temperature(0.8, chains=["model"]) == []
    with pytest.raises(TablesError, match=r"fitted at temperatures \[0, 0.8\] \(model and ngram chains\), "
                                          r"sampling.temperature samples at temperature \[1.2\]"):
        t.check_temperature(1.2, where="sampling.temperature")
    for bad in (float("nan"), -0.1, float("inf"), "hot"):
        with pytest.raises(ValueError, match=rf"sampling.temperature: temperature={bad!r} is invalid; a sampling "
                                             r"temperature is a finite number >= 0"):
            t.check_temperature(bad, where="sampling.temperature")
    with pytest.warns(TablesWarning, match="records no fitted temperatures"):
        _fitted(tmp_path / "old", tables, temperatures=()).check_temperature(0.8)
    assert t.unfitted_temperatures(torch.tensor([0.0, 0.8, 0.8])) == []
    assert t.unfitted_temperatures([0.0, 1.5, 1.5, 2.0]) == [1.5, 2.0]
    assert t.unfitted_temperatures([1.5, 3.0]) == [3.0]  # each once


def test_reuse_last_row_survives_save_and_load(tmp_path, tables):
    """Tables saying their last row stands for deeper depths keep saying so on disk; without a recorded
    K, check_bank then accepts a deeper bank (with one, the recorded K still binds)."""
    def first_rows(reuse_last_row):
        return GridTables({n: ChainTable(t.axes, t.grid[:2], t.edges, t.strides) for n, t in tables.chains.items()},
                          reuse_last_row=reuse_last_row)

    deep = first_rows(True)
    meta = {"target_models": ["synthetic-model"],
            "chains": {"model": {"ids": ["eagle:head"], "temperatures": _temps(0.0)},
                       "ngram": {"ids": ["ngram"], "temperatures": _temps(0.0)}}}
    t = load(save(tmp_path / "t", deep, meta))
    assert t.reuse_last_row and not load(save(tmp_path / "u", tables, meta)).reuse_last_row
    assert t.check_bank(_bank(tmp_path)) == []  # K=4 bank on 2 rows: allowed, the tables say so
    with pytest.raises(TablesError, match=r"K=2\), bank .* drafts K=4"):
        load(save(tmp_path / "v", first_rows(False), meta)).check_bank(_bank(tmp_path, "b2"))


def test_fitted_temperatures_are_recorded_even_for_one_temperature():
    """'One temperature gives an empty axis' (issue 25): the axis has no edges, the record still says 0."""
    from calib.tables.export import fitted_temperatures

    one = pd.DataFrame({"temperature": [0.0] * 5})
    assert fitted_temperatures(one) == {"values": [0.0], "n_values": 1, "min": 0.0, "max": 0.0, "unrecorded_samples": 0}
    two = pd.DataFrame({"temperature": [0.8, 0.0, np.nan, 0.8]})
    assert fitted_temperatures(two) == {"values": [0.0, 0.8], "n_values": 2, "min": 0.0, "max": 0.8,
                                        "unrecorded_samples": 1}
    none = fitted_temperatures(pd.DataFrame({"conf": [0.5]}))
    assert none["values"] == [] and none["min"] is None and none["unrecorded_samples"] == 1
    bad = pd.DataFrame({"temperature": [0.0, -0.5], "speculator": ["s", "s"], "prompt_idx": [0, 3]})
    with pytest.raises(ValueError, match=r"chain 'model': 1 training samples .* \(first: -0.5 at speculator='s', "
                                         r"prompt_idx=3\)"):
        fitted_temperatures(bad, "model")


def test_encode_chain_records_the_temperatures(tmp_path):
    from calib.chains import chain
    from calib.tables.export import encode_chain

    rng = np.random.default_rng(1)
    n = 2000
    df = pd.DataFrame({"conf": rng.uniform(size=n), "depth": rng.integers(0, 2, n),
                       "temperature": rng.choice([0.0, 0.8], n)})
    df["label"] = (rng.uniform(size=n) < df.conf).astype(int)
    est = IsotonicPerDepth().fit(with_depth(df.conf.to_numpy(), df.depth.to_numpy()), df.label.to_numpy())
    for ctx in ({"axes": {"temperature": {"edges": [0.4]}}}, {}):
        table, info = encode_chain(chain("model"), est, df, {"grid_points": 9, "context": ctx}, 2)
        assert info["temperatures"]["values"] == [0.0, 0.8]
        t = load(save(tmp_path / str(len(ctx)), GridTables({"model": table}), {"chains": {"model": info}}))
        assert t.fitted_temperatures("model")["max"] == 0.8
