"""Hostile inputs to the tables loader, the tables x bank temperature check, the allocator and the serving
decider (issue 25), table-driven; every refusal names the file / key / tensor / request and the value.

Tables are SYNTHETIC (random grids, tests/synthetic.py style). A hand-edited tables.json is refused by its
own digest first (tests/tables), so the mistyped-content cases here recompute the digests (json_digest,
the tensor file's sha256, shapes) to reach the checks behind them, as a file written by something other
than calib would.
"""

from __future__ import annotations

import hashlib
import json
import math
import warnings
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch
from safetensors.torch import load_file, save_file

from calib.chains import Axis
from calib.tables import TablesError, load, save
from calib.tables.io import TablesWarning, json_digest
from calib.tables.layout import ChainTable, GridTables

NAN, INF = float("nan"), float("inf")
G, D = 5, 3
TEMPS = {"values": [0.0, 0.8], "n_values": 2, "min": 0.0, "max": 0.8, "unrecorded_samples": 0}


def _grid_tables() -> GridTables:
    """SYNTHETIC: model = conf (G points) x temperature (edge 0.4); n-gram = match_n (2 edges) x agreement
    (1 edge) x temperature (edge 0.4)."""
    g = torch.Generator().manual_seed(0)
    model = ChainTable.build((Axis("conf", points=G), Axis("temperature", edges=(0.4,))),
                             torch.rand(D, 2 * G, generator=g).sort(dim=1).values, torch.tensor([[0.4]]),
                             torch.tensor([G]))
    ngram = ChainTable.build((Axis("match_n", edges=(1.5, 2.5)), Axis("agreement", edges=(0.5,)),
                              Axis("temperature", edges=(0.4,))), torch.rand(D, 12, generator=g),
                             torch.tensor([[1.5, 2.5], [0.5, INF], [0.4, INF]]), torch.tensor([4, 2, 1]))
    return GridTables({"model": model, "ngram": ngram})


META = {"target_models": ["synthetic-model"], "split": {"fractions": [0.7, 0.15, 0.15], "seed": 0},
        "banks": [{"path": "b", "acceptance_sha256": "0" * 64}],
        "chains": {"model": {"ids": ["eagle:head"], "k": D, "depths": D, "temperatures": TEMPS,
                             "forecast": {"axes": [{"name": "temperature", "kind": "bins", "edges": [0.4]}],
                                          "values": [[0.6, 0.4]] * D, "samples": [[1, 1]] * D}},
                   "ngram": {"ids": ["ngram"], "k": D, "depths": D, "temperatures": TEMPS}}}


@pytest.fixture
def folder(tmp_path) -> Path:
    out = save(tmp_path / "tables", _grid_tables(), META)
    load(out)  # the untouched export loads
    return out


def _rewrite(folder: Path, meta_edit=None, tensor_edit=None, keep_shapes=False) -> None:
    """Edit the export as another writer would and recompute every digest so that load's checks behind
    them are reached: tensor_edit(tensors dict) in place, then meta_edit(meta) in place."""
    meta = json.loads((folder / "tables.json").read_text())
    if tensor_edit is not None:
        tensors = load_file(folder / "tables.safetensors")
        tensor_edit(tensors)
        save_file(tensors, folder / "tables.safetensors")
        if not keep_shapes:
            meta["shapes"] = {n: list(t.shape) for n, t in tensors.items()}
    meta["tensors_sha256"] = hashlib.sha256((folder / "tables.safetensors").read_bytes()).hexdigest()
    if meta_edit is not None:
        meta_edit(meta)
    meta["json_sha256"] = json_digest(meta)
    (folder / "tables.json").write_text(json.dumps(meta))


def _walk(meta, path: str):
    """``(container, last key)`` of the ``/``-separated ``path`` (list indices as numbers; tensor names
    such as ``model.grid`` hold dots)."""
    node, parts = meta, path.split("/")
    for p in parts[:-1]:
        node = node[int(p)] if isinstance(node, list) else node[p]
    last = parts[-1]
    return node, int(last) if isinstance(node, list) else last


def _set(path: str, value):
    """A meta edit setting ``path`` to ``value``."""
    def edit(meta):
        node, key = _walk(meta, path)
        node[key] = value
    return edit


def _drop(path: str):
    def edit(meta):
        node, key = _walk(meta, path)
        del node[key]
    return edit


def _nest(depth: int) -> str:
    return "[" * depth + "]" * depth


# --- tables.json that is not one calib wrote (content reaches the checks behind the digest) -------------

JSON_CASES = [
    ("chains is a list", _set("chains", []), ["chains = [] (list) is invalid", "an object"]),
    ("a chain is a number", _set("chains", {"model": 5}), ["chains.model = 5 (int) is invalid"]),
    ("no chains", _set("chains", {}), ["chains = {}", "calibrate no chain"]),
    ("k a word", _set("chains/model/k", "four"), ["chains.model.k = 'four' (str) is invalid", "an integer in [1, inf)"]),
    ("k zero", _set("chains/ngram/k", 0), ["chains.ngram.k = 0"]),
    ("k a bool", _set("chains/model/k", True), ["chains.model.k = True (bool)"]),
    ("ids a string", _set("chains/model/ids", "eagle:head"), ["chains.model.ids = 'eagle:head' (str)", "a list of strings"]),
    ("axes empty", _set("chains/model/axes", []), ["chains.model.axes = []", "a non-empty list of axis objects"]),
    ("axis kind unknown", _set("chains/model/axes/0/kind", "spline"), ["chains.model.axes[0].kind = 'spline'"]),
    ("points negative", _set("chains/model/axes/0/points", -3), ["chains.model.axes[0].points = -3"]),
    ("points missing", _drop("chains/model/axes/0/points"), ["chains.model.axes[0].points is missing"]),
    ("edges unsorted", _set("chains/ngram/axes/0/edges", [2.5, 1.5]), ["chains.ngram.axes[0].edges = [2.5, 1.5]",
                                                                        "ascending order"]),
    ("edges words", _set("chains/ngram/axes/1/edges", ["half"]), ["chains.ngram.axes[1].edges = ['half']"]),
    ("axis name missing", _drop("chains/ngram/axes/1/name"), ["chains.ngram.axes[1].name is missing"]),
    ("interpolated axis 1", _set("chains/ngram/axes/1", {"name": "x", "kind": "interpolate", "points": 3}),
     ["only axis 0"]),
    ("temperatures unsorted", _set("chains/model/temperatures/values", [0.8, 0.0]),
     ["chains.model.temperatures.values = [0.8, 0.0]", "finite numbers >= 0 in ascending order"]),
    ("temperature negative", _set("chains/model/temperatures/min", -1.0), ["chains.model.temperatures.min = -1.0"]),
    ("temperature range off", _set("chains/ngram/temperatures/max", 0.5), ["chains.ngram.temperatures", "inconsistent"]),
    ("forecast out of range", _set("chains/model/forecast/values", [[1.5, 0.2]] * D),
     ["chains.model.forecast.values = [[1.5, 0.2]", "probabilities in [0, 1]"]),
    ("forecast cells", _set("chains/model/forecast/values", [[0.5]] * D), ["forecast.values has 1 cells per depth",
                                                                           "its axes cut 2"]),
    ("target_models a string", _set("target_models", "synthetic-model"), ["target_models = 'synthetic-model' (str)"]),
    ("reuse_last_row a word", _set("reuse_last_row", "yes"), ["reuse_last_row = 'yes' (str)", "a bool"]),
    ("shapes a list", _set("shapes", []), ["shapes = [] (list)"]),
    ("a shape a word", _set("shapes/model.grid", "big"), ["shapes.model.grid = 'big'"]),
    ("no shapes", _drop("shapes"), ["key 'shapes' is missing"]),
    ("split fractions", _set("split/fractions", [0.5, 0.5]), ["split.fractions = [0.5, 0.5]"]),
    ("banks an object", _set("banks", {}), ["banks = {} (dict)"]),
    ("bank fingerprint a number", _set("banks/0/acceptance_sha256", 7), ["banks[0].acceptance_sha256 = 7"]),
    ("tensor checksum a number", _set("tensors_sha256", 5), ["tensors_sha256 = 5 (int)"]),
    ("schema version a string", _set("schema_version", "3"), ["schema_version '3', this calib reads 3"]),
    ("depths off", _set("chains/model/depths", D + 1), [f"model.grid has {D} depth rows", f"depths says {D + 1}"]),
    # issue 43: a chain this calib does not know is refused by name, not loaded and evaluated
    ("unknown chain", lambda meta: meta["chains"].__setitem__("medusa", meta["chains"].pop("ngram")),
     ["chains lists ['medusa'], not a chain this calib knows (registered: ", "'ngram'"]),
]


@pytest.mark.parametrize("edit, expected", [c[1:] for c in JSON_CASES], ids=[c[0] for c in JSON_CASES])
def test_mistyped_tables_json_is_refused_naming_the_key(folder, edit, expected):
    _rewrite(folder, meta_edit=edit)
    with pytest.raises(TablesError) as err:
        load(folder)
    msg = str(err.value)
    assert str(folder) in msg and all(e in msg for e in expected), msg


RAW_CASES = [
    ("binary", b"\x89PNG\r\n\x1a\n\x00\xff\xfe", "is not UTF-8 text"),
    ("not JSON", b"{chains: model}", r"is not valid JSON \(line 1"),
    ("deeply nested", _nest(100_000).encode(), "nested deeper than"),
    ("top-level list", b"[1, 2]", "top level is list"),
    ("empty", b"", "is not valid JSON"),
]


@pytest.mark.parametrize("raw, expected", [c[1:] for c in RAW_CASES], ids=[c[0] for c in RAW_CASES])
def test_a_tables_json_that_is_not_json_is_refused_naming_the_file(folder, raw, expected):
    (folder / "tables.json").write_bytes(raw)
    with pytest.raises(TablesError, match=expected) as err:
        load(folder)
    assert str(folder / "tables.json") in str(err.value)


@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity"])
def test_nan_or_infinity_in_tables_json_is_refused(folder, constant):
    """Strict JSON (issue 43): Python writes NaN/Infinity for a float metric, strict parsers refuse them, and
    a NaN where calib reads a number is silently wrong; calib's export writes null instead."""
    text = (folder / "tables.json").read_text()
    (folder / "tables.json").write_text(text.replace('"calib_version"', f'"note": {constant}, "calib_version"', 1))
    with pytest.raises(TablesError, match=f"{constant} is not JSON") as err:
        load(folder)
    assert str(folder / "tables.json") in str(err.value)


def test_export_writes_a_nan_metric_as_null(tmp_path):
    meta = {**META, "chains": {**META["chains"], "model": {**META["chains"]["model"], "ece": float("nan")}}}
    out = save(tmp_path / "t", _grid_tables(), meta)
    assert "NaN" not in (out / "tables.json").read_text()
    assert load(out).meta["chains"]["model"]["ece"] is None


@pytest.mark.parametrize("name", ["tables.safetensors", "tables.json"])
def test_a_folder_where_a_tables_file_belongs_is_named(folder, name):
    (folder / name).unlink()
    (folder / name).mkdir()
    with pytest.raises(TablesError, match="is a folder, not a file") as err:
        load(folder)
    assert str(folder / name) in str(err.value)


def _t(name, fn):
    def edit(tensors):
        tensors[name] = fn(tensors[name].clone())
    return edit


def _at(index, value):
    def fn(t):
        t[index] = value
        return t
    return fn


TENSOR_CASES = [
    ("grid above 1", _t("model.grid", _at((1, 3), 1.5)), "tensor model.grid[1, 3] = 1.5 is not a probability in [0, 1]"),
    ("grid negative", _t("ngram.grid", _at((0, 7), -0.25)), "tensor ngram.grid[0, 7] = -0.25"),
    ("grid NaN", _t("model.grid", _at((2, 0), NAN)), "tensor model.grid[2, 0] = nan"),
    ("grid inf", _t("ngram.grid", _at((1, 1), INF)), "tensor ngram.grid[1, 1] = inf"),
    ("edges unsorted", _t("ngram.edges", _at((0, 1), 1.0)), "tensor ngram.edges[0, 1] = 1.0 (axis 'match_n'): smaller"),
    ("edges NaN", _t("ngram.edges", _at((1, 0), NAN)), "tensor ngram.edges[1, 0] = nan (axis 'agreement'): NaN"),
    ("edges -inf", _t("model.edges", _at((0, 0), -INF)), "tensor model.edges[0, 0] = -inf (axis 'temperature'): -inf"),
    ("edge after padding", _t("ngram.edges", lambda t: _at((1, 1), 0.5)(_at((1, 0), INF)(t))),
     "ngram.edges[1, 1] = 0.5 (axis 'agreement'): a finite edge after the +inf padding"),
    ("edges not the axes'", _t("ngram.edges", _at((0, 0), 1.25)), ("tensor ngram.edges[0] holds [1.25, 2.5], "
                                                                 "tables.json's axis 'match_n' says [1.5, 2.5]")),
    ("stride negative", _t("ngram.strides", _at(0, -4)), "tensor ngram.strides[0] = -4 (axis 'match_n') is negative"),
    ("stride zero", _t("ngram.strides", _at(1, 0)), "tensor ngram.strides[1] = 0 (axis 'agreement') is 0 on an axis"),
    ("grid float64", _t("model.grid", lambda t: t.double()), ("tensor model.grid is torch.float64, the layout's is "
                                                             "torch.float32")),
    ("strides float", _t("ngram.strides", lambda t: t.float()), "tensor ngram.strides is torch.float32"),
    ("grid too narrow", _t("model.grid", lambda t: t[:, :G].contiguous()), "grid has 5 cells, the axes reach 9"),
]


@pytest.mark.parametrize("edit, expected", [c[1:] for c in TENSOR_CASES], ids=[c[0] for c in TENSOR_CASES])
def test_tensor_values_out_of_range_are_refused_naming_tensor_index_and_value(folder, edit, expected):
    _rewrite(folder, tensor_edit=edit)
    with pytest.raises(TablesError) as err:
        load(folder)
    msg = str(err.value)
    assert str(folder) in msg and expected in msg, msg


def test_shapes_must_agree_with_tables_json(folder):
    _rewrite(folder, tensor_edit=_t("model.grid", lambda t: torch.cat([t, t[:1]])), keep_shapes=True)
    with pytest.raises(TablesError, match=rf"tensor model.grid has shape \[{D + 1}, {2 * G}\], tables.json's "
                                          rf"shapes.model.grid says \[{D}, {2 * G}\]"):
        load(folder)


def test_tensors_must_be_exactly_those_listed(folder):
    def extra(tensors):
        tensors["suffix.grid"] = torch.zeros(1, 1)
    _rewrite(folder, tensor_edit=extra, keep_shapes=True)
    with pytest.raises(TablesError, match=r"not listed: \['suffix.grid'\]"):
        load(folder)

    def missing(tensors):
        del tensors["ngram.strides"]
    _rewrite(folder, tensor_edit=missing)
    with pytest.raises(TablesError, match=r"missing tensors \['ngram.strides'\]"):
        load(folder)


def test_a_tensor_file_that_is_not_safetensors_is_refused(folder):
    (folder / "tables.safetensors").write_bytes(b"\x00" * 64)
    _rewrite(folder)  # its checksum recorded: the parse is reached
    with pytest.raises(TablesError, match=r"tables.safetensors: not a readable safetensors file"):
        load(folder)


# --- check_bank: the bank's temperatures against the tables' ---------------------------------------------

def _bank(tmp_path, name, temperature):
    """SYNTHETIC bank whose speculator.parquet temperature column cycles ``temperature`` (None: no column)."""
    from calib.bank import write_bank
    from tests.synthetic import synthetic_tables

    acc, spec, ng = synthetic_tables(n_prompts=4, rounds_per_prompt=3, width=D, speculator="eagle:head")
    if temperature is not None:
        vals = temperature if isinstance(temperature, list) else [temperature]
        spec = spec.append_column(pa.field("temperature", pa.float64()),
                                  pa.array([vals[i % len(vals)] for i in range(spec.num_rows)], pa.float64()))
    man = {"model": "synthetic-model", "speculator": "eagle:head", "method": "eagle", "num_speculative_tokens": D}
    return write_bank(tmp_path / name, acc, spec, ng, manifest=man)


def _tables_at(tmp_path, *temps):
    rec = {"values": list(temps), "n_values": len(temps), "min": min(temps), "max": max(temps),
           "unrecorded_samples": 0} if temps else None
    chains = {c: {"ids": ids, "k": D, **({"temperatures": rec} if rec else {})}
              for c, ids in (("model", ["eagle:head"]), ("ngram", ["ngram"]))}
    return load(save(tmp_path / f"tables-{'-'.join(map(str, temps)) or 'none'}", _grid_tables(),
                     {"target_models": ["synthetic-model"], "chains": chains}))


TEMPERATURE_CASES = [  # (tables fitted at, bank sampled at, outcome, what the message names)
    ((0.0,), 0.0, "ok", []),
    ((0.0, 0.8), [0.0, 0.8], "ok", []),
    ((0.0,), 0.8, "refused", ["were fitted at temperatures [0]", "samples at temperature [0.8]",
                              "python train.py data.train=[..."]),
    ((0.0, 0.8), 1.2, "refused", ["were fitted at temperatures [0, 0.8]", "samples at temperature [1.2]"]),
    ((0.8,), [0.0, 0.8], "refused", ["samples at temperature [0]"]),
    ((0.0, 0.8), 0.4, "warned", ["temperature [0.4], between the temperatures"]),
    ((), 0.8, "warned", ["records no fitted temperatures for the model and ngram chains", "temperature [0.8]"]),
    ((0.0,), None, "warned", ["no temperature column", "model: temperatures [0]"]),
]


@pytest.mark.parametrize("fitted, sampled, outcome, expected", TEMPERATURE_CASES,
                         ids=[f"{c[0]}-{c[1]}-{c[2]}" for c in TEMPERATURE_CASES])
def test_check_bank_temperatures(tmp_path, fitted, sampled, outcome, expected):
    tables, bank = _tables_at(tmp_path, *fitted), _bank(tmp_path, "bank", sampled)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if outcome == "refused":
            with pytest.raises(TablesError) as err:
                tables.check_bank(bank)
            msg = str(err.value)
            assert str(tables.path) in msg and str(bank) in msg
        else:
            notes = tables.check_bank(bank)
            msg = " ".join(notes)
    warned = [w for w in caught if issubclass(w.category, TablesWarning)]
    assert (len(warned) > 0) == (outcome == "warned"), [str(w.message) for w in warned]
    assert all(e in msg for e in expected), msg


@pytest.mark.parametrize("value, error, expected", [
    (1.5, TablesError, "sampling.temperature samples at temperature [1.5], outside that range"),
    (-0.1, ValueError, "sampling.temperature: temperature=-0.1 is invalid"),
    (NAN, ValueError, "temperature=nan is invalid"),
    (INF, ValueError, "temperature=inf is invalid"),
    (True, ValueError, "temperature=True is invalid"),
])
def test_serving_temperature_check(tmp_path, value, error, expected):
    tables = _tables_at(tmp_path, 0.0, 0.8)
    with pytest.raises(error) as err:
        tables.check_temperature(value, where="sampling.temperature")
    assert expected in str(err.value)
    assert tables.check_temperature(0.8, where="sampling.temperature") == []


# --- allocator and decider inputs ------------------------------------------------------------------------

def _signals(temp: float) -> dict:
    x = torch.tensor([[[0.9, 0.0], [0.7, 0.0]], [[0.8, temp], [0.6, temp]]])  # request 1's temperature
    return {"model": x}


ALLOCATE_CASES = [  # (kwargs, signals temperature, what the ValueError names)
    ({"budget": 2}, NAN, "signals['model'][1, 0, 1] = nan: request 1's sampling temperature"),
    ({"budget": 2}, -1.0, "signals['model'][1, 0, 1] = -1.0: request 1's sampling temperature"),
    ({"cost": torch.linspace(1, 2, 8)}, INF, "signals['model'][1, 0, 1] = inf"),
    ({"budget": -3}, 0.0, "allocate: parameter budget=-3 is invalid; it must be None or an integer in [0, inf)"),
    ({"budget": 2.0}, 0.0, "allocate: parameter budget=2.0 is invalid"),
    ({"budget": 2, "impl": "fast"}, 0.0, "allocate: parameter impl='fast' is invalid"),
    ({"cost": [1.0, 2.0]}, 0.0, "allocate: parameter cost=[1.0, 2.0] is invalid"),
    ({"cost": torch.tensor([1.0, 1.0, 0.0, 1.0])}, 0.0, "cost[2] = 0.0: the verify pass without draft tokens"),
]


@pytest.mark.parametrize("kwargs, temp, expected", ALLOCATE_CASES, ids=[c[2][:40] for c in ALLOCATE_CASES])
def test_allocator_inputs(kwargs, temp, expected):
    from calib.allocate import allocate

    with pytest.raises(ValueError) as err:
        allocate(load_tables_in_memory(), _signals(temp), **kwargs)
    assert expected in str(err.value), str(err.value)


def load_tables_in_memory() -> GridTables:
    return GridTables({"model": _grid_tables().chains["model"]}, reuse_last_row=True)


def _step(temps) -> object:
    from calib.chains import Offer
    from calib.serve import StepInputs

    B = len(temps)
    return StepInputs([f"r{i}" for i in range(B)], temps, {"model": Offer([[1, 2]] * B, torch.full((B, 2), 0.7))})


DECIDER_CASES = [  # (SafeDecider / decide_step keyword overrides, what the ValueError names)
    ({"k_max": 0}, "parameter k_max=0 is invalid; it must be an integer in [1, inf)"),
    ({"k_max": "4"}, "parameter k_max='4' is invalid"),
    ({"budget": -1, "cost": None}, "parameter budget=-1 is invalid"),
    ({"max_failures": 0}, "parameter max_failures=0 is invalid"),
    ({"speculator": None}, "parameter speculator=None is invalid; it must be a non-empty string"),
    ({"chains": "model"}, "parameter chains='model' is invalid; it must be a list of registered chain names"),
    ({"impl": "cuda"}, "parameter impl='cuda' is invalid"),
    ({"cost": torch.tensor([1.0])}, "`cost` has 1 entries"),
]


@pytest.mark.parametrize("kw, expected", DECIDER_CASES, ids=[c[1][:40] for c in DECIDER_CASES])
def test_decider_construction(folder, kw, expected):
    from calib.serve import SafeDecider

    args = {"model_id": "synthetic-model", "speculator": "eagle:head", "method": "eagle", "k_max": D,
            "cost": torch.linspace(1.0, 2.0, 16), **kw}
    with pytest.raises(ValueError) as err:
        SafeDecider(folder, **args)
    assert expected in str(err.value), str(err.value)


@pytest.mark.parametrize("temps, expected", [
    ([0.0, NAN], "temperature[1] = nan (request 'r1'): a sampling temperature must be a finite number >= 0"),
    ([-0.5, 0.0], "temperature[0] = -0.5 (request 'r0')"),
    ([0.0, INF, -1.0], "temperature[1] = inf (request 'r1')"),
    ([0.0], "temperature has 1 entries for B=1"),  # (replaced below: one fewer temperature than requests)
    ([None, 0.0], "temperature[0] = nan"),
])
def test_decider_request_temperatures(folder, temps, expected):
    from calib.chains import Offer
    from calib.serve import RequestHistory, decide_step

    step = _step(temps)
    if len(temps) == 1:
        step.req_ids = ["r0", "r1"]
        step.offers = {"model": Offer([[1]] * 2, torch.full((2, 1), 0.7))}
        expected = "temperature has 1 entries for B=2 requests"
    with pytest.raises(ValueError) as err:
        decide_step(load(folder), step, RequestHistory(), k_max=D, cost=torch.linspace(1.0, 2.0, 16))
    assert expected in str(err.value), str(err.value)


def test_decider_logs_an_unfitted_temperature_once_and_decides(folder, caplog):
    import logging

    from calib.serve import RequestHistory, SafeDecider

    dec = SafeDecider(folder, model_id="synthetic-model", speculator="eagle:head", method="eagle", k_max=D,
                      cost=torch.linspace(1.0, 2.0, 16))
    with caplog.at_level(logging.WARNING, logger="calib.serve"):
        for _ in range(3):
            out = dec.decide(_step([1.7, 0.0]))
            assert not out.passthrough
    msgs = [r.getMessage() for r in caplog.records]
    assert len(msgs) == 1 and "request temperature 1.7 outside the temperatures the tables" in msgs[0]
    assert str(folder) in msgs[0] and "temperatures [0, 0.8]" in msgs[0]
    assert dec.failures == 0 and isinstance(dec.history, RequestHistory)
    assert math.isfinite(float(out.expected_accepted.sum())) and np.isfinite(out.expected_accepted.numpy()).all()


def test_a_request_id_twice_in_one_step_is_refused_naming_it(folder):
    """Two lists for one request id in a step would be decided twice and overwrite each other in the engine:
    decide_step refuses it naming the id and its positions; the serving decider passes the step through."""
    from calib.serve import RequestHistory, SafeDecider, decide_step

    step = _step([0.0, 0.0, 0.0])
    step.req_ids = ["r0", "r1", "r0"]
    with pytest.raises(ValueError, match=r"request id 'r0' appears 2 times in one step \(positions \[0, 2\]\)"):
        decide_step(load(folder), step, RequestHistory(), k_max=D, cost=torch.linspace(1.0, 2.0, 16))
    dec = SafeDecider(folder, model_id="synthetic-model", speculator="eagle:head", method="eagle", k_max=D,
                      cost=torch.linspace(1.0, 2.0, 16))
    assert dec.decide(step).passthrough and dec.failures == 1
