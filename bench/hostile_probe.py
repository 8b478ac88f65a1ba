"""A hostile probe of kinds tests/hostile/ had not tried (issue 43, Must 7): what a new user feeds the entry points
(step-cost files, measured cost CSVs, ``CALIB_SERVE``, prompt files, tables folders, ``bench/serve.py --from-json``
and its grid manifests, config overrides of keys no hostile test set) called where each entry point reads it.

    python bench/hostile_probe.py [--only SUBSTRING] [--out FILE] [-v]

Each case builds its input in a fresh temp folder and calls the loader / validator / entry point that reads it, and
its outcome is classified by what came back:

- ``ok``: a valid input (spelled oddly: a BOM, CRLF, a space or non-ASCII in a path) accepted as it should be;
- ``clear``: refused with an error that names what the case says it must (the file, key or row) and is not a bare
  Python error (KeyError, IndexError, TypeError, AttributeError, OSError, JSONDecodeError, ...);
- ``warning``: accepted with a warning or a log record (WARNING or above) that names it;
- ``unclear``: refused, but the message does not name what is wrong (or a valid input refused);
- ``silent``: a bad input accepted without a word;
- ``crash``: a bare Python error escaping (a traceback that does not say what is wrong);
- ``data loss``: a file the case wrote before the call was changed or removed by it.

The counts before and after the fixes of December 5: docs/hostile.md. SYNTHETIC inputs only (no bank, no model).

Why argparse, not Hydra like train.py/eval.py: a test harness over the entry points' own readers (the Hydra configs
among them, composed per case); its settings are a filter and an output file.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import os
import sys
import tempfile
import traceback
import warnings
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")

# bare Python errors: escaping, they say where the code failed, not what is wrong with the input
BARE = (KeyError, IndexError, AttributeError, TypeError, ZeroDivisionError, RecursionError, UnicodeDecodeError,
        json.JSONDecodeError, OSError, StopIteration, AssertionError, NameError)
OUTCOMES = ("ok", "clear", "warning", "unclear", "silent", "crash", "data loss")
STEP = json.loads((ROOT / "data/cost/smollm2-135m-cpu-step.json").read_text())
PROMPT = {"id": "a-0", "category": "chat", "messages": [{"role": "user", "content": "Hi"}]}


@dataclass(frozen=True)
class Case:
    name: str
    kind: str
    build: object  # (tmp: Path) -> the call under test
    named: tuple[str, ...] = ()  # what a clear message must hold ({tmp}: the case's folder)
    accept: bool = False  # a valid input: accepted is ``ok``


# -- inputs -------------------------------------------------------------------------------------------------------
def _write(path: Path, content) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content if isinstance(content, bytes) else json.dumps(content).encode())
    return path


def _step(**change) -> dict:
    doc = json.loads(json.dumps(STEP))
    for key, value in change.items():
        node, *rest = key.split("__")
        if rest:
            doc[node][rest[0]] = value
        elif value is None:
            doc.pop(node)
        else:
            doc[node] = value
    return doc


def _engine_curve(path: Path):
    """The replay's engine curve (eval.py ``cost=engine cost.engine.path=PATH``), charged over a small batch."""
    def call():
        import numpy as np

        from calib.cost import make_curve

        curve = make_curve("engine", {"kind": "engine", "path": str(path)}, 16)
        curve.for_batch(2).with_drafter(True).with_sampling(True).charge(np.array([1, 3]))
        return curve
    return call


def _serving_curve(text: str):
    """What a serving process prices with (``serve.cost``): the price curve and, for a step cost, its sampled term."""
    def call():
        from calib.cost.serving import cost_curve, sampled_price, serving_step_cost, step_pass_price

        serving_step_cost.cache_clear()
        cost_curve(text, 16, drafter_loaded=True)
        sampled_price(text)
        step_pass_price(text, 2, 2)
    return call


def _cost(doc) -> object:
    return lambda tmp: _engine_curve(_write(tmp / "step-cost.json", doc))


def _csv(raw: bytes, column: str = "seconds", folder: bool = False):
    def build(tmp):
        path = tmp / "verify.csv"
        path.mkdir() if folder else _write(path, raw)
        return _serving_curve(f"{path}:{column}")
    return build


def _knobs(values):
    """``vllm serve`` with ``CALIB_SERVE`` set: the knobs, then the price curve its cost names."""
    def build(tmp):
        text = values if isinstance(values, str) else json.dumps({"tables": str(tmp / "tables"), **values})
        text = text.replace("{tmp}", str(tmp))

        def call():
            from calib.serve.knobs import ServeKnobs

            knobs = ServeKnobs.from_json(text)
            _serving_curve(knobs.cost)()
            return knobs
        return call
    return build


def _prompts(raw: bytes, name: str = "p.jsonl"):
    def build(tmp):
        from calib.prompts import load_prompts

        path = _write(tmp / name, raw)
        return lambda: load_prompts([str(path)])
    return build


def _line(**change) -> bytes:
    return json.dumps({**PROMPT, **change}).encode() + b"\n"


def _tables(tmp: Path) -> Path:
    """A small SYNTHETIC tables export (random grids; tests/hostile/test_tables.py's shape)."""
    import torch

    from calib.chains import Axis
    from calib.tables import save
    from calib.tables.layout import ChainTable, GridTables

    g = torch.Generator().manual_seed(0)
    model = ChainTable.build((Axis("conf", points=5), Axis("temperature", edges=(0.4,))),
                             torch.rand(3, 10, generator=g).sort(dim=1).values, torch.tensor([[0.4]]),
                             torch.tensor([5]))
    temps = {"values": [0.0, 0.8], "n_values": 2, "min": 0.0, "max": 0.8, "unrecorded_samples": 0}
    meta = {"target_models": ["synthetic-model"], "split": {"fractions": [0.7, 0.15, 0.15], "seed": 0},
            "banks": [{"path": "b", "acceptance_sha256": "0" * 64}],
            "chains": {"model": {"ids": ["eagle:head"], "k": 3, "depths": 3, "temperatures": temps}}}
    return save(tmp / "tables", GridTables({"model": model}), meta)


def _tables_case(damage):
    def build(tmp):
        from calib.tables import load

        target = damage(tmp, _tables(tmp))
        return lambda: load(target)
    return build


def _symlink_loop(tmp, folder):
    os.symlink(tmp / "loop", tmp / "loop")
    return tmp / "loop"


def _empty_file(name):
    def damage(tmp, folder):
        (folder / name).write_bytes(b"")
        return folder
    return damage


def _unicode_tables(tmp, folder):
    return folder.rename(tmp / "mes tables é")


def _bench(doc=None, raw: bytes | None = None, folder=False, missing=False, rows=None):
    """``python bench/serve.py --from-json FILE`` (the report of a finished run or a grid manifest)."""
    def build(tmp):
        path = tmp / "bench.json"
        if folder:
            path.mkdir()
        elif not missing:
            _write(path, raw if raw is not None else doc)
        if rows is not None:  # a grid manifest listing one source with these rows
            _write(tmp / "src.json", {"table": rows, "arms": []})
            _write(path, {"sources": [os.path.relpath(tmp / "src.json", ROOT)]})
        return lambda: _bench_main(["--from-json", str(path)])
    return build


def _bench_main(argv):
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_serve_probe", ROOT / "bench" / "serve.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main(argv)


def _retable_onto_itself(tmp):
    path = _write(tmp / "bench.json", {"table": [], "arms": ["none"], "runs": [], "replay": None})
    return lambda: _bench_main(["--from-json", str(path), "--retable", str(path)])


def _reference_onto_prompts(tmp):
    """``python serve.py policy=no_spec speculative=none reference_out=PATH`` with PATH the user's prompt file: the
    config check, then (where it passes) the reference written at the run's end as serve_runner writes it."""
    path = _write(tmp / "p.jsonl", _line())

    def call():
        from calib.serve.oracle import write_reference

        _config("serve", "policy=no_spec", "speculative=none", f"reference_out={path}")(tmp)()
        write_reference(path, {}, max_tokens=64, dtype="float32")
    return call


def _config(job: str, *overrides: str):
    """The job's composed config (conf/, as the entry point composes it) through its config check."""
    def build(tmp):
        def call():
            from hydra import compose, initialize_config_dir
            from omegaconf import OmegaConf

            from calib.policies.config_store import store_policy_configs

            base = {"train": ["out_dir=x"], "eval": [f"root={ROOT}"], "serve": [f"root={ROOT}"],
                    "collect": [f"root={ROOT}", "out_dir=x"]}[job]
            store_policy_configs()
            with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
                cfg = OmegaConf.to_container(compose(job, overrides=[*base, *overrides]), resolve=True)
            if job == "collect":
                from calib.collect.runner import check_config
                return check_config(cfg)
            from calib.config_checks import check_serve, check_train
            from calib.evaluate.checks import check_eval
            return {"train": check_train, "eval": check_eval, "serve": check_serve}[job](cfg)
        return call
    return build


# -- the cases ----------------------------------------------------------------------------------------------------
SC = "step-cost.json"
CASES = [
    # step-cost files (cost.engine.path=, serve.cost=)
    Case("cost-folder", "step cost", lambda tmp: _engine_curve((tmp / SC).mkdir() or tmp / SC), (SC, "folder")),
    Case("cost-profile-not-fit", "step cost", _cost({"rows": [{"B": 1, "T": 2, "verify": 30.0}], "command": "x"}),
         (SC, "version")),
    Case("cost-version-99", "step cost", _cost(_step(version=99)), (SC, "version 99")),
    Case("cost-term-missing", "step cost", _cost(_step(more=None)), (SC, "more")),
    Case("cost-negative-slope", "step cost", _cost(_step(verify__slopes={"T": -0.001, "B": 0.0})), (SC, "verify")),
    Case("cost-nan-intercept", "step cost", lambda tmp: _engine_curve(_write(
        tmp / SC, json.dumps(_step()).replace('"intercept": 0.0013420210706906936', '"intercept": NaN').encode())),
         (SC, "idle")),
    Case("cost-intercept-a-string", "step cost", _cost(_step(calib__intercept="0.002")), (SC, "calib")),
    Case("cost-unknown-input", "step cost", _cost(_step(idle__slopes={"X": 0.001})), (SC, "idle", "X")),
    Case("cost-wrong-input-for-term", "step cost", _cost(_step(lm_head__slopes={"T": 0.001})), (SC, "lm_head", "T")),
    Case("cost-source-not-an-object", "step cost", _cost(_step(source="my laptop")), (SC, "source")),
    Case("cost-verify-all-zero", "step cost", _cost(_step(verify={"intercept": 0.0, "slopes": {"T": 0.0}})),
         (SC, "verify")),
    Case("cost-unicode-space-path", "step cost", lambda tmp: _engine_curve(_write(tmp / "coût é" / SC, _step())),
         accept=True),
    # measured verify-cost CSVs (serve.cost=PATH.csv[:column], cost=measured)
    Case("csv-bom", "cost csv", _csv(b"\xef\xbb\xbfT,seconds\n1,0.05\n2,0.06\n"), accept=True),
    Case("csv-crlf", "cost csv", _csv(b"T,seconds\r\n1,0.05\r\n2,0.06\r\n"), accept=True),
    Case("csv-folder", "cost csv", _csv(b"", folder=True), ("verify.csv", "folder")),
    Case("csv-not-utf8", "cost csv", _csv(b"T,seconds\n1,0.05\n2,\xff\xfe\n"), ("verify.csv", "UTF-8")),
    # CALIB_SERVE (vllm serve)
    Case("knobs-chains-a-string", "CALIB_SERVE", _knobs({"chains": "model"}), ("chains", "'model'")),
    Case("knobs-draft-cost-nan", "CALIB_SERVE", _knobs('{"tables": "t", "draft_cost": NaN}'), ("draft_cost",)),
    Case("knobs-aside-after-bool", "CALIB_SERVE", _knobs({"aside_after": True}), ("aside_after",)),
    Case("knobs-cost-missing-file", "CALIB_SERVE", _knobs({"cost": "{tmp}/nope.json"}), ("nope.json", "missing")),
    Case("knobs-cost-semicolon", "CALIB_SERVE", _knobs({"cost": "1.0;0.01"}), ("cost", "1.0;0.01")),
    Case("knobs-top-level-list", "CALIB_SERVE", _knobs('["runs/train/default"]'), ("CALIB_SERVE",)),
    # prompt files
    Case("prompts-bom", "prompts", _prompts(b"\xef\xbb\xbf" + _line()), accept=True),
    Case("prompts-crlf-unicode-path", "prompts", _prompts(_line().replace(b"\n", b"\r\n"), "mes prompts é.jsonl"),
         accept=True),
    Case("prompts-no-user-message", "prompts", _prompts(_line(messages=[{"role": "system", "content": "Be brief."}])),
         ("p.jsonl", "line 1", "user")),
    Case("prompts-two-records-one-line", "prompts", _prompts(_line().rstrip() + b" " + _line(id="a-1")),
         ("p.jsonl", "line 1")),
    Case("prompts-ends-with-assistant", "prompts", _prompts(_line(messages=[
        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}])), ("p.jsonl", "line 1", "assistant")),
    # tables folders
    Case("tables-symlink-loop", "tables", _tables_case(_symlink_loop), ("loop",)),
    Case("tables-zero-byte-json", "tables", _tables_case(_empty_file("tables.json")), ("tables.json",)),
    Case("tables-zero-byte-tensors", "tables", _tables_case(_empty_file("tables.safetensors")), ("tables.safetensors",)),
    Case("tables-unicode-space-path", "tables", _tables_case(_unicode_tables), accept=True),
    # bench/serve.py --from-json
    Case("bench-json-missing", "bench json", _bench(missing=True), ("bench.json",)),
    Case("bench-json-folder", "bench json", _bench(folder=True), ("bench.json", "folder")),
    Case("bench-json-invalid", "bench json", _bench(raw=b'{"table": [,]}'), ("bench.json", "JSON")),
    Case("bench-json-a-list", "bench json", _bench(doc=[1, 2]), ("bench.json",)),
    Case("bench-json-no-table", "bench json", _bench(doc={"runs": []}), ("bench.json", "table")),
    Case("grid-row-without-category", "grid manifest", _bench(rows=[{"sampling": "greedy", "concurrency": 1}]),
         ("src.json", "category")),
    Case("grid-source-empty-table", "grid manifest", _bench(rows=[]), ("src.json",)),
    Case("bench-retable-onto-itself", "bench json", _retable_onto_itself, ("--retable", "bench.json")),
    Case("serve-reference-out-a-prompt-file", "config", _reference_onto_prompts, ("reference_out", "p.jsonl")),
    # config overrides of keys no hostile test set
    Case("collect-temperature-nan", "config", _config("collect", "sampling.temperature=nan"), ("sampling.temperature",)),
    Case("collect-top-p-word", "config", _config("collect", "sampling.top_p=high"), ("sampling.top_p",)),
    Case("collect-max-tokens-bool", "config", _config("collect", "sampling.max_tokens=true"), ("sampling.max_tokens",)),
    Case("collect-seed-negative", "config", _config("collect", "seed=-1"), ("seed",)),
    Case("eval-cost-engine-path-folder", "config", _config("eval", "cost=engine", "cost.engine.path=data/cost"),
         ("cost.engine.path", "data/cost")),
    Case("eval-depth-min-labels-0", "config", _config("eval", "metrics.depth_min_labels=0"), ("metrics.depth_min_labels",)),
    Case("serve-enforce-eager-word", "config", _config("serve", "engine.enforce_eager=maybe"), ("engine.enforce_eager",)),
    Case("serve-seed-negative", "config", _config("serve", "seed=-1"), ("seed=-1",)),
    Case("train-trial-samples-0", "config", _config("train", "context.trial_samples=0"), ("context.trial_samples",)),
]


# -- running and classifying --------------------------------------------------------------------------------------
def _tree(root: Path) -> dict[str, str]:
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in filenames:
            p = Path(dirpath) / name
            if not p.is_symlink():
                out[str(p.relative_to(root))] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(f"{record.name} {record.levelname}: {record.getMessage()}")


def run_case(case: Case) -> dict:
    with tempfile.TemporaryDirectory(prefix="hostile-") as d:
        tmp = Path(d)
        call = case.build(tmp)
        before = _tree(tmp)
        handler = _Records()
        logging.getLogger().addHandler(handler)
        out, err = io.StringIO(), io.StringIO()
        exc: BaseException | None = None
        try:
            with warnings.catch_warnings(record=True) as caught, contextlib.redirect_stdout(out), \
                    contextlib.redirect_stderr(err):
                warnings.simplefilter("always")
                try:
                    call()
                except SystemExit as e:
                    exc = None if e.code in (0, None) else e
                except Exception as e:  # noqa: BLE001 - what escapes is the outcome
                    exc = e
        finally:
            logging.getLogger().removeHandler(handler)
        after = _tree(tmp)
        named = [n.format(tmp=tmp) for n in case.named]
        said = [f"{w.category.__name__}: {w.message}" for w in caught] + handler.lines
        if exc is not None:
            msg = f"{type(exc).__name__}: {exc}"
            bare = isinstance(exc, BARE) and not isinstance(exc, (SystemExit,)) and type(exc).__module__ == "builtins"
            bare = bare or isinstance(exc, json.JSONDecodeError)
            if bare:
                outcome = "crash"
            elif case.accept or not all(n in msg for n in named):
                outcome = "unclear"
            else:
                outcome = "clear"
            detail = msg if not bare else msg + " | " + traceback.format_exception(exc)[-2].strip().splitlines()[0]
        elif case.accept:
            outcome, detail = "ok", "; ".join(said)[:300]
        else:
            loud = [s for s in said if all(n in s for n in named)]
            outcome, detail = ("warning", loud[0]) if loud else ("silent", "; ".join(said)[:300])
        lost = [p for p, digest in before.items() if after.get(p) != digest]
        if lost:
            outcome, detail = "data loss", f"changed or removed: {lost}"
        return {"case": case.name, "kind": case.kind, "outcome": outcome,
                "detail": " ".join(str(detail).split())[:400]}


def main(argv=None) -> int:
    from calib.cli import parser as plain_parser

    ap = plain_parser(__doc__)
    ap.add_argument("--only", default=None, help="run the cases whose name holds this")
    ap.add_argument("--out", default=None, help="write the outcomes and counts as JSON (atomically)")
    ap.add_argument("-v", "--verbose", action="store_true", help="print each case's message")
    args = ap.parse_args(argv)
    logging.disable(logging.NOTSET)
    cases = [c for c in CASES if args.only is None or args.only in c.name]
    rows = [run_case(c) for c in cases]
    width = max(len(r["case"]) for r in rows)
    for r in rows:
        print(f"{r['case']:<{width}}  {r['kind']:<13}  {r['outcome']:<9}" + (f"  {r['detail']}" if args.verbose else ""))
    counts = {o: sum(r["outcome"] == o for r in rows) for o in OUTCOMES}
    print(f"\n{len(rows)} cases: " + ", ".join(f"{n} {o}" for o, n in counts.items())
          + f" ({counts['silent'] / max(len(rows), 1):.0%} silent)")
    if args.out:
        from calib.atomic import write_json_atomic

        write_json_atomic(args.out, {"cases": len(rows), "counts": counts, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
