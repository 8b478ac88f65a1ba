"""Hostile inputs to the bank loaders, the bank validator and CLI, the prompt loader and the collect
side files (issue 25): each case damages a copy of a small SYNTHETIC bank (unit-test data made by
tests/synthetic.py, not engine data) or writes a bad file, and asserts that the refusal (or the
warning) names the file and the key / column / row, and that the call changed nothing: neither the
case's own folder (every entry point here only reads) nor the pristine bank outside it.

Table-driven: ``CASES`` lists (name, act, expected substrings). ``act(tmp, bank)`` corrupts what it
needs under ``tmp`` (``bank`` is a fresh copy of the pristine bank there) and returns a callable,
the call under test; its message is what it raises, or what it returns (a validator's findings, a
CLI's exit code and output), plus any warning or ``calib.bank`` log record it emitted. Expected
substrings may name ``{tmp}`` and ``{bank}``.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import os
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from calib.bank import BankError, load, validate, write_bank
from calib.bank.__main__ import main as cli
from calib.bank.io import DuplicateBankWarning, OverlappingBanksError
from calib.prompts import load_prompts
from calib.sidefiles import SideFileError
from tests.synthetic import synthetic_tables

N_ROUNDS = 20  # synthetic_tables(): 4 prompts x 5 rounds
MANIFEST = {"model": "synthetic-model", "speculator": "synthetic", "config": "synthetic-k4",
            "categories": ["chat", "code_edit"], "num_speculative_tokens": 4}
DEEP = b"[" * 10_000 + b"]" * 10_000
BINARY = bytes(range(256)) * 4


def _tables(n: int | None = None):
    acc, spec, ng = synthetic_tables()
    spec = spec.append_column("temperature", pa.array([0.0] * spec.num_rows, pa.float64()))
    spec = spec.append_column("batch_size", pa.array([2] * spec.num_rows, pa.int64()))
    if n is not None:
        acc, spec, ng = acc.slice(0, n), spec.slice(0, n), ng.slice(0, n)
    return acc, spec, ng


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    return write_bank(tmp_path_factory.mktemp("pristine") / "bank", *_tables(), manifest=MANIFEST)


# -- helpers the cases use -----------------------------------------------------------------------
def _set(bank: Path, file: str, column: str, row: int, value) -> None:
    """Rewrite one value of ``file`` (stats.json dropped when acceptance changes: checked apart)."""
    t = pq.read_table(bank / file)
    vals = t.column(column).to_pylist()
    vals[row] = value
    i = t.column_names.index(column)
    pq.write_table(t.set_column(i, t.schema.field(column), pa.array(vals, t.schema.field(column).type)),
                   bank / file)


def _findings(bank: Path, max_problems: int = 50):
    return lambda: "\n".join(str(p) for p in validate(str(bank), max_problems))


def _cli(*argv):
    def call():
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                rc = cli([str(a) for a in argv])
            except SystemExit as exc:  # argparse refusing an argument
                rc = exc.code
        return f"rc={rc}\n{err.getvalue()}\n{out.getvalue()}"
    return call


def _union(*paths):
    def call():
        bank = load(list(paths))
        return (f"paths={[str(p) for p in bank.paths]} rounds={bank.rounds().num_rows} "
                f"acceptance={bank.table('acceptance.parquet').num_rows}")
    return call


def _side(bank: Path, file: str, content: bytes | dict | list):
    raw = content if isinstance(content, bytes) else json.dumps(content).encode()
    (bank / file).write_bytes(raw)
    return _findings(bank)


def _stats_with(bank: Path, **changes):
    stats = json.loads((bank / "stats.json").read_text())
    stats.update(changes)
    return _side(bank, "stats.json", stats)


def _manifest_with(bank: Path, **changes):
    return _side(bank, "run_manifest.json", {**MANIFEST, **changes})


def _prompts(tmp: Path, raw: bytes):
    (tmp / "p.jsonl").write_bytes(raw)
    return lambda: load_prompts(["p.jsonl"], root=tmp)


def _owned_output(folder: Path) -> None:
    """A train.py output folder as calib published it (before outputs inside inputs were refused)."""
    from calib.atomic import publish_dir

    stage = folder.parent / ".stage"
    stage.mkdir()
    (stage / "tables.json").write_text("{}")
    publish_dir(stage, folder, job="train.py")


GOOD = b'{"id": "a-0", "category": "chat", "messages": [{"role": "user", "content": "Hi"}]}\n'


# -- the cases -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Case:
    name: str
    act: object  # (tmp, bank) -> the call under test
    expect: tuple[str, ...]
    raises: type[BaseException] | None = None  # None: the call returns (findings, output, a union)
    absent: tuple[str, ...] = ()  # substrings that must not appear (e.g. a doubled count)


def _link(tmp, bank):
    os.symlink(bank, tmp / "link")
    return tmp / "link"


def _copy(tmp, bank):
    return Path(shutil.copytree(bank, tmp / "copy"))


def _overlap(tmp, bank):
    return write_bank(tmp / "other", *_tables(10))  # the first 10 rounds again, other bytes


def _rewritten(tmp, bank):
    """The same 20 rounds, re-encoded (other parquet bytes): not a byte copy, the same keys."""
    other = _copy(tmp, bank)
    pq.write_table(pq.read_table(other / "acceptance.parquet"), other / "acceptance.parquet", compression="gzip")
    return other


def _no_tensors(tmp):
    from safetensors.numpy import save_file

    (tmp / "router").mkdir()
    save_file({"layers.0.weight": np.zeros((2, 2), np.float32)}, str(tmp / "router" / "router.safetensors"))
    return tmp / "router"


def _router_meta(tmp, meta):
    from calib.moe.moefy import ShadowRouter

    folder = _no_tensors(tmp)
    (folder / "router.json").write_bytes(meta if isinstance(meta, bytes) else json.dumps(meta).encode())
    return lambda: ShadowRouter.load(folder)


def _run_state(tmp, raw: bytes):
    from calib.collect.runner import RunFolder

    (tmp / "run").mkdir()
    (tmp / "run" / "collect_config.json").write_bytes(raw)
    return lambda: RunFolder(tmp / "run", {"seed": 0}).open()


def _part_success(tmp, info):
    from calib.collect.runner import _part_info

    (tmp / "part-00000").mkdir()
    (tmp / "part-00000" / "_SUCCESS").write_text(json.dumps(info))
    return lambda: _part_info(tmp / "part-00000")


def _capture(tmp, raw: bytes):
    from calib.collect.assemble import read_capture

    (tmp / "cap").mkdir()
    (tmp / "cap" / "capture-1.jsonl").write_bytes(raw)
    return lambda: read_capture(tmp / "cap")


SIDE_DAMAGE = [  # (name, content, expected) for both run_manifest.json and stats.json
    ("binary", BINARY, "is not UTF-8 text (byte 128)"),
    ("invalid-json", b'{"n_rounds": 20,,}', "is not valid JSON (line 1, column 17"),
    ("top-level-list", b"[1, 2, 3]", "top level is list, expected an object"),
    ("deep-nesting", DEEP, "is nested deeper than 64 levels"),
    ("empty", b"", "is not valid JSON (line 1, column 1"),
]

CASES = [
    # One bank, once.
    Case("same-path-twice", lambda tmp, b: _union(b, b),
         ("paths=['{bank}']", f"rounds={N_ROUNDS} ", f"acceptance={N_ROUNDS}",
          "WARNING DuplicateBankWarning: bank {bank} is listed twice; it is used once",
          "LOG calib.bank WARNING: bank {bank} is listed twice"), absent=(f"rounds={4 * N_ROUNDS}",)),
    Case("symlink-to-same-bank", lambda tmp, b: _union(b, _link(tmp, b)),
         ("paths=['{bank}']", f"rounds={N_ROUNDS} ",
          "bank {tmp}/link resolves to {bank}, the same folder as bank {bank}; {tmp}/link is dropped")),
    Case("copy-of-a-bank", lambda tmp, b: _union(b, _copy(tmp, b)),
         ("paths=['{bank}']", f"rounds={N_ROUNDS} ",
          "bank {tmp}/copy is a copy (the same acceptance.parquet, sha256 ", ") of bank {bank}")),
    Case("folder-holding-a-bank-and-its-link", lambda tmp, b: (_link(tmp, b), _union(tmp))[1],
         ("paths=['{bank}']", f"rounds={N_ROUNDS} ", "{tmp}/link resolves to {bank}")),
    Case("overlapping-keys", lambda tmp, b: _union(b, _overlap(tmp, b)),
         ("banks {bank} and {tmp}/other share 10 round key(s)",
          ("first: model='synthetic-model', speculator='synthetic', config='synthetic-k4', category='chat', "
           "prompt_idx=0, turn=0, round_idx=0"), "drop one of the two banks"), OverlappingBanksError),
    Case("re-encoded-copy-shares-every-key", lambda tmp, b: _union(b, _rewritten(tmp, b)),
         ("banks {bank} and {tmp}/copy share 20 round key(s)",), OverlappingBanksError),
    Case("stats-cli-counts-a-bank-once", lambda tmp, b: _cli("stats", b, b),
         ("rc=0", f'"n_rounds": {N_ROUNDS},', "LOG calib.bank WARNING: bank {bank} is listed twice"),
         absent=(f'"n_rounds": {2 * N_ROUNDS},',)),
    Case("stats-cli-overlap-refused", lambda tmp, b: _cli("stats", b, _overlap(tmp, b)),
         ("rc=1", "error: banks {bank} and {tmp}/other share 10 round key(s)")),
    Case("validate-cli-checks-a-folder-once", lambda tmp, b: _cli("validate", b, _link(tmp, b)),
         ("rc=0", "ok {bank}\n", "LOG calib.bank WARNING: bank {tmp}/link resolves to {bank}"),
         absent=("ok {tmp}/link",)),
    # A validator that says ok.
    Case("validate-max-problems-0", lambda tmp, b: (_set(b, "speculator.parquet", "conf0", 0, 7.0),
                                                    _cli("validate", "--max-problems", "0", b))[1],
         ("rc=2", "argument --max-problems: 0 would report no problems", "use a number >= 1")),
    Case("validate-max-problems-minus-1", lambda tmp, b: _cli("validate", "--max-problems", "-1", b),
         ("rc=2", "argument --max-problems: -1 would report no problems",)),
    Case("validate-max-problems-not-a-number", lambda tmp, b: _cli("validate", "--max-problems", "many", b),
         ("rc=2", "argument --max-problems: 'many' is not an integer")),
    Case("validate-function-max-problems-0", lambda tmp, b: _findings(b, 0),
         ("calib.bank.validate: parameter max_problems=0 is invalid", "an integer in [1, inf)"), ValueError),
    Case("validate-max-problems-1-still-fails", lambda tmp, b: (_set(b, "speculator.parquet", "conf0", 0, 7.0),
                                                                _cli("validate", "--max-problems", "1", b))[1],
         ("rc=1", "INVALID {bank} (1 problem(s))", "speculator.parquet, column conf0, row 0")),
    # Value ranges.
    *[Case(f"temperature-{name}", lambda tmp, b, v=value: (_set(b, "speculator.parquet", "temperature", 3, v),
                                                          _findings(b))[1],
           ("{bank}/speculator.parquet, column temperature, row 3: " + msg, "round_idx=3"))
      for name, value, msg in [("nan", float("nan"), "NaN temperature"),
                               ("negative", -0.5, "negative temperature"),
                               ("infinite", float("inf"), "infinite temperature"),
                               ("minus-infinite", float("-inf"), "infinite temperature")]],
    Case("batch-size-0", lambda tmp, b: (_set(b, "speculator.parquet", "batch_size", 5, 0), _findings(b))[1],
         ("{bank}/speculator.parquet, column batch_size, row 5: batch_size below 1",)),
    Case("confidence-above-1", lambda tmp, b: (_set(b, "speculator.parquet", "conf0", 2, 1.5), _findings(b))[1],
         ("{bank}/speculator.parquet, column conf0, row 2: confidence outside [0, 1]",)),
    Case("ngram-agreement-above-1",
         lambda tmp, b: (_set(b, "ngram.parquet", "agreement", int(np.flatnonzero(
             pq.read_table(b / "ngram.parquet").column("ngram_len").to_numpy() > 0)[0]), 2.0), _findings(b))[1],
         ("{bank}/ngram.parquet, column agreement, row ", "feature outside [0, 1.0]")),
    Case("ngram-chain-without-tokens", lambda tmp, b: (pq.write_table(
        (t := pq.read_table(b / "ngram.parquet")).drop_columns(
            [c for c in t.column_names if c.startswith("ngram_tok")]), b / "ngram.parquet"), _findings(b))[1],
         ("{bank}/ngram.parquet, column ngram_len, row ", "no ngram_tok columns")),
    Case("ngram-chain-missing-a-middle-acc-column", lambda tmp, b: (pq.write_table(
        pq.read_table(b / "ngram.parquet").drop_columns(["acc1"]), b / "ngram.parquet"), _findings(b))[1],
         ("{bank}/ngram.parquet, column acc1: column missing",)),
    # Side files: run_manifest.json and stats.json, whatever is wrong with them.
    *[Case(f"{file}-{name}", lambda tmp, b, f=file, c=content: _side(b, f, c), ("{bank}/" + file + ": " + msg,))
      for file in ("run_manifest.json", "stats.json") for name, content, msg in SIDE_DAMAGE],
    Case("run_manifest.json-bank-refused-on-open", lambda tmp, b: (_side(b, "run_manifest.json", DEEP),
                                                                   lambda: load(b))[1],
         ("invalid bank (1 problem(s))", "{bank}/run_manifest.json: is nested deeper than 64 levels"), BankError),
    Case("run_manifest.json-manifests-unvalidated", lambda tmp, b: (_side(b, "run_manifest.json", BINARY),
                                                                    lambda: load(b, False).manifests())[1],
         ("{bank}/run_manifest.json: is not UTF-8 text", "fix or delete run_manifest.json"), SideFileError),
    *[Case(f"run_manifest.json-mistyped-{key}", lambda tmp, b, k=key, v=value: _manifest_with(b, **{k: v}),
           ("{bank}/run_manifest.json, column " + key + f": key {key!r} is {value!r} ({type(value).__name__}), "
            f"expected {want}",))
      for key, value, want in [("n_rounds", "abc", "an integer"), ("categories", 3, "an array"),
                               ("num_speculative_tokens", True, "an integer"), ("model", 5, "a string"),
                               ("routing", [1], "an object")]],
    Case("run_manifest.json-category-not-a-string", lambda tmp, b: _manifest_with(b, categories=["chat", 1]),
         ("{bank}/run_manifest.json, column categories: holds 1 (int)",)),
    Case("run_manifest.json-routing-field-mistyped", lambda tmp, b: _manifest_with(b, routing={"top_k": "2"}),
         ("{bank}/run_manifest.json, column routing.top_k: key 'routing.top_k' is '2' (str)",)),
    # issue 43: a manifest that says T = 0 over rows sampled at 0.8 validated (and trained a two-temperature table)
    Case("run_manifest.json-temperature-disagrees-with-rows", lambda tmp, b: (
        _set(b, "speculator.parquet", "temperature", 4, 0.8), _set(b, "speculator.parquet", "temperature", 9, 0.8),
        _manifest_with(b, sampling={"name": "greedy", "temperature": 0.0}))[2],
         (("{bank}/speculator.parquet, column temperature, row 4: temperature 0.8, but run_manifest.json says "
           "sampling.temperature = 0"), "(2 rows in all)")),
    Case("train-output-inside-the-bank", lambda tmp, b: (_owned_output(b / "sub"), _findings(b))[1],
         ("{bank}/sub: holds the output of train.py inside this bank; move that folder out of the bank",)),
    Case("run_manifest.json-temperature-mistyped", lambda tmp, b: _manifest_with(b, sampling={"temperature": "hot"}),
         ("{bank}/run_manifest.json, column sampling.temperature: is 'hot', expected a finite number >= 0",)),
    Case("run_manifest.json-n_rounds-wrong", lambda tmp, b: _manifest_with(b, n_rounds=40),
         ("{bank}/run_manifest.json, column n_rounds: says 40 rounds, acceptance.parquet has 20",)),
    *[Case(f"stats.json-mistyped-{key}", lambda tmp, b, k=key, v=value: _stats_with(b, **{k: v}),
           ("{bank}/stats.json, column " + key + ": stats." + key + " is " + msg,))
      for key, value, msg in [("n_rounds", "abc", "'abc' (str), expected a number"),
                              ("mean_accept", [1.4], "[1.4] (list), expected a number"),
                              ("accept_hist", [6, 5], "[6, 5] (list), expected an object"),
                              ("accept_by_position", ["x"], "['x'] (list), expected a list of numbers"),
                              ("by_category", "chat", "'chat' (str), expected an object"),
                              ("n_rounds", True, "True (bool), expected a number")]],
    Case("stats.json-hist-count-mistyped", lambda tmp, b: _stats_with(b, accept_hist={"0": "six"}),
         ("{bank}/stats.json, column accept_hist: stats.accept_hist is {{'0': 'six'}} (dict), expected counts",
          "stats.accept_hist.0 is 'six' (str)")),
    Case("stats.json-category-mistyped", lambda tmp, b: _stats_with(b, by_category={"chat": [1]}),
         ("{bank}/stats.json, column by_category.chat: stats.by_category.chat is [1] (list), expected an object",)),
    Case("stats.json-huge-integer", lambda tmp, b: _side(b, "stats.json", b'{"n_rounds": 1' + b"0" * 400 + b"}"),
         ("{bank}/stats.json, column n_rounds: stats.n_rounds is 1000",)),
    # Prompt files.
    Case("prompts-malformed-line", lambda tmp, b: _prompts(tmp, GOOD + b'{"id": "a-1", "category": \n'),
         ("{tmp}/p.jsonl, line 2: bad prompt record (not JSON",), ValueError),
    Case("prompts-non-object-line", lambda tmp, b: _prompts(tmp, b'["a-0", "chat"]\n'),
         ("{tmp}/p.jsonl, line 1: bad prompt record (the line is a JSON list, not an object)",), ValueError),
    Case("prompts-missing-messages", lambda tmp, b: _prompts(tmp, GOOD + b'{"id": "a-1", "category": "chat"}\n'),
         ("{tmp}/p.jsonl, line 2: bad prompt record (field 'messages' is missing)",), ValueError),
    Case("prompts-empty-messages", lambda tmp, b: _prompts(tmp, b'{"id": "a", "category": "chat", "messages": []}'),
         ("{tmp}/p.jsonl, line 1:", "'messages' must be a non-empty list"), ValueError),
    Case("prompts-wrong-role", lambda tmp, b: _prompts(
        tmp, b'{"id": "a", "category": "chat", "messages": [{"role": "robot", "content": "x"}]}'),
         ("{tmp}/p.jsonl, line 1:", "messages[0].role is 'robot'; expected one of system, user"), ValueError),
    Case("prompts-content-not-text", lambda tmp, b: _prompts(
        tmp, b'{"id": "a", "category": "chat", "messages": [{"role": "user", "content": 3}]}'),
         ("{tmp}/p.jsonl, line 1:", "messages[0].content is 3; expected a string"), ValueError),
    Case("prompts-category-mistyped", lambda tmp, b: _prompts(
        tmp, b'{"id": "a", "category": ["chat"], "messages": [{"role": "user", "content": "x"}]}'),
         ("{tmp}/p.jsonl, line 1:", "'category' is ['chat']; expected a non-empty string"), ValueError),
    Case("prompts-empty-user-message", lambda tmp, b: _prompts(  # issue 43: it was collected
        tmp, b'{"id": "a", "category": "chat", "messages": [{"role": "user", "content": "  "}]}'),
         ("{tmp}/p.jsonl, line 1:", "messages[0].content is '  ': an empty user message"), ValueError),
    Case("prompts-category-with-a-newline", lambda tmp, b: _prompts(
        tmp, b'{"id": "a", "category": "chat\\n", "messages": [{"role": "user", "content": "x"}]}'),
         ("{tmp}/p.jsonl, line 1:", "'category' is 'chat\\n'; expected a name without surrounding spaces"), ValueError),
    Case("prompts-not-utf8", lambda tmp, b: _prompts(tmp, GOOD + GOOD.replace(b"a-0", b"a-1")
                                                     + b'{"id": "\xff\xfe", "category": "chat"}\n'),
         ("{tmp}/p.jsonl, line 3: not UTF-8 text", "re-save it as UTF-8"), ValueError),
    Case("prompts-deep-nesting", lambda tmp, b: _prompts(tmp, DEEP),
         ("{tmp}/p.jsonl, line 1: bad prompt record (",), ValueError),
    Case("prompts-folder-as-file", lambda tmp, b: ((tmp / "p.jsonl").mkdir(),
                                                   lambda: load_prompts(["p.jsonl"], root=tmp))[1],
         ("prompt file {tmp}/p.jsonl is a folder",), ValueError),
    # collect / moe side files.
    Case("collect_config.json-binary", lambda tmp, b: _run_state(tmp, BINARY),
         ("{tmp}/run/collect_config.json: is not UTF-8 text", "use a new out_dir"), SideFileError),
    Case("collect_config.json-list", lambda tmp, b: _run_state(tmp, b"[]"),
         ("{tmp}/run/collect_config.json: top level is list",), SideFileError),
    Case("part-_SUCCESS-mistyped", lambda tmp, b: _part_success(tmp, {"prompts": [], "output_tokens": "many",
                                                                     "wall_s": 1.0}),
         ("{tmp}/part-00000/_SUCCESS: key 'output_tokens' is 'many' (str), expected an integer",
          "delete the part folder"), SideFileError),
    Case("capture-truncated-line", lambda tmp, b: _capture(tmp, b'{"req": "0-x", "step": 1}\n{"req": "0-x", "st'),
         ("{tmp}/cap/capture-1.jsonl, line 2: not a JSON record",), RuntimeError),
    Case("capture-not-a-record", lambda tmp, b: _capture(tmp, b'[1, 2]\n'),
         ("{tmp}/cap/capture-1.jsonl, line 1: not a capture record",), RuntimeError),
    Case("router.json-mistyped", lambda tmp, b: _router_meta(tmp, {"layers": "1", "top_k": 2}),
         ("{tmp}/router/router.json: key 'layers' is '1' (str), expected an integer",), SideFileError),
    Case("router.json-binary", lambda tmp, b: _router_meta(tmp, BINARY),
         ("{tmp}/router/router.json: is not UTF-8 text",), SideFileError),
    Case("router-tensors-missing", lambda tmp, b: _router_meta(tmp, {"layers": 1, "top_k": 2}),
         ("{tmp}/router/router.safetensors: lacks layers.0.bias",), ValueError),
]


def _tree(root: Path) -> dict[str, str]:
    """Every file under ``root`` (links not followed) with a digest of its bytes."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in filenames + [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]:
            p = Path(dirpath) / name
            out[str(p.relative_to(root))] = ("link:" + os.readlink(p) if p.is_symlink()
                                             else hashlib.sha256(p.read_bytes()).hexdigest())
    return out


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines = []

    def emit(self, record):
        self.lines.append(f"LOG {record.name} {record.levelname}: {record.getMessage()}")


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_hostile(case, pristine, tmp_path, monkeypatch):
    before_pristine = _tree(pristine.parent)
    bank = Path(shutil.copytree(pristine, tmp_path / "bank"))
    call = case.act(tmp_path, bank)
    before = _tree(tmp_path)
    monkeypatch.chdir(tmp_path)  # a stray relative write would land in tmp_path and show below
    handler, logger = _Records(), logging.getLogger("calib.bank")
    logger.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if case.raises is None:
                text = call()
            else:
                with pytest.raises(case.raises) as info:
                    call()
                text = str(info.value)
    finally:
        logger.removeHandler(handler)
    text = "\n".join([str(text)] + [f"WARNING {w.category.__name__}: {w.message}" for w in caught] + handler.lines)
    for want in case.expect:
        want = want.format(tmp=tmp_path, bank=bank)
        assert want in text, f"{case.name}: expected {want!r} in:\n{text}"
    for unwanted in case.absent:
        assert unwanted.format(tmp=tmp_path, bank=bank) not in text, f"{case.name}: {unwanted!r} in:\n{text}"
    assert "Traceback" not in text
    assert _tree(tmp_path) == before, f"{case.name}: the call changed files in its folder"
    assert _tree(pristine.parent) == before_pristine, f"{case.name}: the pristine bank changed"


def test_the_pristine_bank_and_shipped_prompts_are_accepted(pristine, tmp_path):
    """The cases' control: the undamaged inputs pass, so each case's refusal is the damage's doing."""
    assert validate(str(pristine)) == []
    assert _cli("validate", pristine)().startswith("rc=0")
    agreeing = Path(shutil.copytree(pristine, tmp_path / "agreeing"))  # the rows' own temperature: no finding
    assert _manifest_with(agreeing, sampling={"name": "greedy", "temperature": 0})() == ""
    with warnings.catch_warnings():
        warnings.simplefilter("error", DuplicateBankWarning)
        assert load([pristine]).rounds().num_rows == N_ROUNDS
    root = Path(__file__).resolve().parents[2]
    for files, n in ((["data/prompts/smoke.jsonl"], 3), (["data/prompts/chat.jsonl", "data/prompts/code_edit.jsonl"], 120)):
        prompts = load_prompts(files, root=root)
        assert len(prompts) == n and [p.idx for p in prompts] == list(range(n))
    (tmp_path / "p.jsonl").write_bytes(GOOD + b"\n  \n" + GOOD.replace(b"a-0", b"a-1").replace(b"Hi", b"Hi\xe2\x80\xa8there"))
    assert [p.id for p in load_prompts([tmp_path / "p.jsonl"])] == ["a-0", "a-1"]
