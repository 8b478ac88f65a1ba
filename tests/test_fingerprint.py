"""Identity by content (issue 29, Must 3): model-folder fingerprints, and check_bank / serving comparing them.

Tiny model folders (a config.json and a small safetensors file) built in tmp_path; no engine.
"""

import json
import shutil
import warnings

import pytest
import torch
from safetensors.torch import save_file

from calib.fingerprint import describe, fingerprint, identity, same_model
from calib.tables import TablesError, load, save
from calib.tables.io import TablesWarning
from tests.tables.test_tables import MANIFEST, _bank, _temps, tables  # noqa: F401 - the fixture

CONFIG = {"architectures": ["LlamaForCausalLM"], "hidden_size": 8, "num_hidden_layers": 1, "vocab_size": 16}


def _model(path, seed=0, config=None, arch=None):
    path.mkdir(parents=True)
    cfg = dict(config or CONFIG)
    if arch:
        cfg["architectures"] = [arch]
    (path / "config.json").write_text(json.dumps(cfg))
    g = torch.Generator().manual_seed(seed)
    save_file({"w": torch.randn(16, 8, generator=g), "b": torch.randn(8, generator=g)}, str(path / "model.safetensors"))
    return path


def test_fingerprint_holds_architecture_config_and_weights(tmp_path):
    fp = fingerprint(_model(tmp_path / "head"))
    assert fp["name"] == "head" and fp["architecture"] == "LlamaForCausalLM"
    assert len(fp["config_sha256"]) == 64 and len(fp["weights_sha256"]) == 64
    assert "head" in describe(fp) and "LlamaForCausalLM" in describe(fp)
    assert fingerprint(None) is None and fingerprint(tmp_path / "absent") is None


def test_a_renamed_folder_is_the_same_model(tmp_path):
    a = fingerprint(_model(tmp_path / "head"))
    shutil.copytree(tmp_path / "head", tmp_path / "renamed")
    b = fingerprint(tmp_path / "renamed")
    assert b["name"] == "renamed" and same_model(a, b)
    # where and by which transformers the config was written does not count
    cfg = {**CONFIG, "_name_or_path": "/somewhere/else", "transformers_version": "9.9"}
    (tmp_path / "renamed" / "config.json").write_text(json.dumps(cfg, indent=2))
    assert same_model(a, fingerprint(tmp_path / "renamed"))


def test_other_weights_config_or_architecture_differ(tmp_path):
    a = fingerprint(_model(tmp_path / "a"))
    assert not same_model(a, fingerprint(_model(tmp_path / "w", seed=1)))  # same shapes, other values
    assert not same_model(a, fingerprint(_model(tmp_path / "c", config={**CONFIG, "hidden_size": 9})))
    other = fingerprint(_model(tmp_path / "arch", arch="Qwen2ForCausalLM"))
    assert other["architecture"] == "Qwen2ForCausalLM" and not same_model(a, other)


def test_large_files_are_digested_by_their_ends(tmp_path, monkeypatch):
    """Only the header and the first / last EDGE_BYTES of data are read: a change there is seen."""
    import calib.fingerprint as f

    monkeypatch.setattr(f, "EDGE_BYTES", 64)
    path = _model(tmp_path / "m")
    before = f.weights_digest(path)
    raw = bytearray((path / "model.safetensors").read_bytes())
    raw[-1] ^= 0xFF
    (path / "model.safetensors").write_bytes(bytes(raw))
    assert f.weights_digest(path) != before


def test_identity_block(tmp_path):
    ident = identity(_model(tmp_path / "t"), None, "ngram", 4)
    assert ident["drafter"] is None and ident["method"] == "ngram" and ident["num_speculative_tokens"] == 4
    assert ident["target"]["name"] == "t"


# --- check_bank and the serving check by content -------------------------------------------------------

def _fitted_with(tmp_path, tables, target, drafter, name="tables"):  # noqa: F811
    """Tables whose one bank recorded ``target`` / ``drafter`` fingerprints (tables.json banks[].identity)."""
    bank = {"path": "b", "model": MANIFEST["model"], "speculator": "eagle:head", "method": "eagle",
            "identity": {"target": target, "drafter": drafter, "method": "eagle", "num_speculative_tokens": 4}}
    meta = {"target_models": [MANIFEST["model"]], "banks": [bank],
            "chains": {"model": {"ids": ["eagle:head"], "k": 4, "temperatures": _temps(0.0)},
                       "ngram": {"ids": ["ngram"], "k": 4, "temperatures": _temps(0.0)}}}
    return load(save(tmp_path / name, tables, meta))


def test_check_bank_compares_fingerprints_not_names(tmp_path, tables):  # noqa: F811
    target, head = _model(tmp_path / "SmolLM2"), _model(tmp_path / "head", seed=1, arch="EagleLlamaForCausalLM")
    t = _fitted_with(tmp_path, tables, fingerprint(target), fingerprint(head))
    # renamed target and drafter folders: names differ from those fitted on, the content is the same
    shutil.copytree(target, tmp_path / "my-target")
    shutil.copytree(head, tmp_path / "my-head")
    moved = {**MANIFEST, "model": "my-target", "speculator": "eagle:my-head",
             "identity": identity(tmp_path / "my-target", tmp_path / "my-head", "eagle", 4)}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        in_bank = {**moved, "model": MANIFEST["model"]}  # the synthetic rounds' model key
        assert t.check_bank(_bank(tmp_path, "renamed", speculator="eagle:my-head", manifest=in_bank)) == []
        assert t.check_bank(moved, path="engine") == []  # the serving check (an engine manifest)
    # another head under the same folder name: refused, naming both
    shutil.rmtree(head)
    _model(head, seed=2, arch="EagleLlamaForCausalLM")
    other = {**MANIFEST, "identity": identity(target, head, "eagle", 4)}
    with pytest.raises(TablesError, match=r"drafter: tables .* were fitted for 'head' \(EagleLlamaForCausalLM, "
                                          r"config .*\), bank engine has 'head' .*another model by content under "
                                          r"the same name"):
        t.check_bank(other, path="engine")
    # another target under the same name
    shutil.rmtree(target)
    _model(target, seed=3)
    with pytest.raises(TablesError, match=r"target model: .*'SmolLM2' .*another model by content under the same name"):
        t.check_bank({**MANIFEST, "identity": identity(target, tmp_path / "my-head", "eagle", 4)}, path="engine")


def test_without_fingerprints_on_one_side_names_are_compared_with_a_warning(tmp_path, tables):  # noqa: F811
    target, head = _model(tmp_path / "synthetic-model"), _model(tmp_path / "head", seed=1)
    new = _fitted_with(tmp_path, tables, fingerprint(target), fingerprint(head))
    with pytest.warns(TablesWarning, match="records no fingerprint .*compared by name only"):
        assert new.check_bank(_bank(tmp_path, "old")) != []  # an old bank: by name, and it matches
    old = _fitted_with(tmp_path, tables, None, None, name="old-tables")
    man = {**MANIFEST, "identity": identity(target, head, "eagle", 4)}
    with pytest.warns(TablesWarning, match="tables .*records no fingerprint"):
        old.check_bank(man, path="engine")
    with pytest.raises(TablesError, match="was drafted by 'eagle:other'"):  # the name fallback still refuses
        old.check_bank({**man, "speculator": "eagle:other"}, path="engine")
    with warnings.catch_warnings():  # neither side: the name comparison, as before fingerprints, silently
        warnings.simplefilter("error")
        assert old.check_bank(dict(MANIFEST), path="engine") == []


def test_bank_validate_checks_the_identity_block(tmp_path):
    from calib.bank import validate, write_bank
    from tests.synthetic import synthetic_tables

    ident = identity(_model(tmp_path / "t"), None, "ngram", 4)
    ok = write_bank(tmp_path / "ok", *synthetic_tables(), manifest={"model": "synthetic-model", "identity": ident})
    assert validate(str(ok)) == []
    old = write_bank(tmp_path / "old", *synthetic_tables(), manifest={"model": "synthetic-model"})
    assert validate(str(old)) == []  # banks before fingerprints stay valid
    man = json.loads((ok / "run_manifest.json").read_text())
    man["identity"]["drafter"] = "eagle:head"
    man["identity"]["num_speculative_tokens"] = 3
    man["num_speculative_tokens"] = 4
    (ok / "run_manifest.json").write_text(json.dumps(man))
    found = [str(p) for p in validate(str(ok))]
    assert any("identity.drafter" in p and "fingerprint object" in p for p in found)
    assert any("identity.num_speculative_tokens" in p and "says 3" in p for p in found)


def test_serving_reads_the_engines_target_and_drafter_folders(tmp_path):
    """What Server._build hands SafeDecider: the engine's folders by content (n-gram: no drafter)."""
    from types import SimpleNamespace as NS

    from calib.vllm.server import engine_identity

    target, head = _model(tmp_path / "t"), _model(tmp_path / "h", seed=1)
    runner = NS(model_config=NS(model=str(target)))
    ng = engine_identity(runner, NS(method="ngram", num_speculative_tokens=4, model=None,
                                    draft_model_config=NS(model=str(target))))
    assert ng["drafter"] is None and same_model(ng["target"], fingerprint(target))
    ea = engine_identity(runner, NS(method="eagle", num_speculative_tokens=3, model=str(head),
                                    draft_model_config=NS(model=str(head))))
    assert same_model(ea["drafter"], fingerprint(head)) and ea["method"] == "eagle" and ea["num_speculative_tokens"] == 3
