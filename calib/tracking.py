"""Experiment tracking behind one small interface: W&B (offline by default), CSV files, or nothing.

Entry points pick one with the ``logger`` config group (``logger=wandb|csv|none``). W&B runs are
offline unless WANDB_MODE says otherwise, so nothing leaves the machine by default (``wandb sync <run
folder>`` uploads one later; ``WANDB_MODE=online`` logs live). This is calib's one logging path: Lightning's
own loggers stay off (``calib.calibrators.lightning_fit``). Runs are named ``<job>:<output folder>`` unless
``logger.name`` says otherwise, and grouped by ``logger.group`` (the experiment). Lineage: train.py logs
the tables as an artifact; a job declares what it reads as its input (:meth:`Tracker.use_artifact`: eval.py the
tables it evaluates; a folder such as a bank is declared by reference, checksummed where it lies, not uploaded).
An offline run, which W&B does not let use artifacts, records each input's name, type, paths and content digest
in its config (``input_artifacts``); once the run is synced, ``python -m calib.tracking declare-inputs
OUT_DIR`` declares them on it (:func:`declare_inputs`), refusing inputs whose content changed since the run.
"""

from __future__ import annotations

import csv
import hashlib
import json
import os
import shutil
import sys
from pathlib import Path

from calib import envs
from calib.atomic import atomic_path, write_json_atomic

INPUTS_FILE = "calib_inputs.json"  # an offline run's recorded inputs, in its files folder


class Tracker:
    """No-op base: ``logger=none``."""

    def log(self, scalars: dict, step: int | None = None) -> None: ...

    def log_image(self, key: str, path: str | os.PathLike) -> None: ...

    def log_table(self, key: str, rows: list[dict]) -> None: ...

    def log_artifact(self, name: str, kind: str, paths: list[str | os.PathLike], metadata: dict | None = None) -> None: ...

    def use_artifact(self, name: str, kind: str, paths: list[str | os.PathLike], metadata: dict | None = None) -> None:
        """Declare files or folders this run reads (the tables eval evaluates, the banks train fits on) as its
        input artifact ``name`` of type ``kind``."""

    def finish(self) -> None: ...


class CSVTracker(Tracker):
    """Scalars to ``<dir>/metrics.csv``; tables to ``<dir>/<key>.csv``; images copied."""

    def __init__(self, out_dir: str | os.PathLike):
        self.dir = Path(out_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.rows: list[dict] = []

    def log(self, scalars, step=None):
        self.rows.append({"step": step, **scalars})

    def log_image(self, key, path):
        shutil.copy(path, self.dir / f"{key.replace('/', '_')}{Path(path).suffix}")

    def log_table(self, key, rows):
        if rows:
            _write_csv(self.dir / f"{key.replace('/', '_')}.csv", rows)

    def finish(self):
        if self.rows:
            _write_csv(self.dir / "metrics.csv", self.rows)


class WandbTracker(Tracker):
    def __init__(self, project: str, out_dir: str | os.PathLike, config: dict, job_type: str,
                 mode: str | None = None, name: str | None = None, tags=None, group: str | None = None):
        import wandb

        self.wandb = wandb
        self.run = wandb.init(project=project, dir=str(out_dir), config=config, job_type=job_type,
                              mode=mode or envs.WANDB_MODE, name=name or run_name(job_type, out_dir),
                              group=group, tags=list(tags or []), reinit="finish_previous")

    def log(self, scalars, step=None):
        self.run.log(scalars, step=step)

    def log_image(self, key, path):
        self.run.log({key: self.wandb.Image(str(path))})

    def log_table(self, key, rows):
        if rows:
            cols = list(dict.fromkeys(c for r in rows for c in r))
            # W&B types a column by its values: a column mixing text and numbers (depth 0..K-1 and
            # "all") is logged as text.
            mixed = {c for c in cols if any(isinstance(r.get(c), str) for r in rows)}
            data = [[str(r.get(c)) if c in mixed else _plain(r.get(c)) for c in cols] for r in rows]
            self.run.log({key: self.wandb.Table(columns=cols, data=data)})

    def log_artifact(self, name, kind, paths, metadata=None):
        self.run.log_artifact(_artifact(self.wandb, name, kind, paths, metadata))

    def use_artifact(self, name, kind, paths, metadata=None):
        # the same name and content as train.py logged: W&B matches it by digest, so the lineage
        # bank -> tables -> eval is an edge of the online run graph. W&B refuses use_artifact offline
        # ("Cannot use artifact when in offline mode"): an offline run records its input's name, type, paths
        # and content digest in its config instead, for declare_inputs once the run is synced.
        if self.run.offline:
            recorded = dict(self.run.config.get("input_artifacts") or {})
            recorded[name] = {"type": kind, "sha256": content_digest(paths),
                              "files": [str(Path(p).resolve()) for p in paths]}
            self.run.config.update({"input_artifacts": recorded}, allow_val_change=True)
            # the run's files folder travels with it (wandb sync uploads it); declare_inputs reads it back
            write_json_atomic(Path(self.run.dir) / INPUTS_FILE, {"project": self.run.project, "inputs": recorded})
            return
        self.run.use_artifact(_artifact(self.wandb, name, kind, paths, metadata))

    def finish(self):
        sync_file = getattr(self.run.settings, "sync_file", None) if self.run.offline else None
        self.run.finish()
        if sync_file:
            _settled(Path(sync_file))


def _settled(path: Path, quiet_s: float = 0.5, limit_s: float = 20.0) -> None:
    """Wait until ``path`` has not changed for ``quiet_s`` (at most ``limit_s``): on a loaded machine W&B's service
    process can still append to an offline run's file after ``finish`` returns, and the caller publishes the
    folder, recording each file's digest, right after."""
    import time

    def stamp():
        try:
            st = path.stat()
        except FileNotFoundError:
            return None
        return st.st_size, st.st_mtime_ns

    last, since, end = stamp(), time.monotonic(), time.monotonic() + limit_s
    while time.monotonic() < end:
        time.sleep(0.05)
        now = stamp()
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            return


def _artifact(wandb, name: str, kind: str, paths, metadata: dict | None = None):
    """A W&B artifact of ``paths``: files added as they are (their content is the artifact's), folders (banks) as
    references that W&B checksums where they lie."""
    art = wandb.Artifact(name, type=kind, metadata=metadata or {})
    for p in map(Path, paths):
        if p.is_dir():
            art.add_reference(p.resolve().as_uri(), name=p.name)
        else:
            art.add_file(str(p))
    return art


def _files(paths) -> list[Path]:
    """The files ``paths`` name, a folder's (recursively, links not followed) in path order."""
    out = []
    for p in sorted(map(Path, paths), key=str):
        if p.is_dir():
            out += sorted((f for f in p.rglob("*") if f.is_file() and not f.is_symlink()), key=str)
        elif p.is_file():
            out.append(p)
        else:
            raise FileNotFoundError(f"input {p} does not exist (or is not a file or a folder)")
    return out


def content_digest(paths) -> str:
    """sha256 over the bytes of every file ``paths`` name (a folder's files in path order), read in blocks."""
    h = hashlib.sha256()
    for f in _files(paths):
        with open(f, "rb") as fh:
            for block in iter(lambda fh=fh: fh.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()


def make_tracker(cfg: dict | None, out_dir: str | os.PathLike, config: dict, job_type: str) -> Tracker:
    """A tracker from a ``logger`` config: ``{kind: wandb|csv|none, project, mode, ...}``."""
    cfg = dict(cfg or {"kind": "none"})
    kind = cfg.pop("kind", "none")
    if kind == "wandb":
        return WandbTracker(cfg.get("project", "calib"), out_dir, config, job_type, cfg.get("mode"),
                            cfg.get("name"), cfg.get("tags"), cfg.get("group"))
    if kind == "csv":
        return CSVTracker(Path(out_dir) / "csv")
    if kind == "none":
        return Tracker()
    raise ValueError(f"logger.kind={kind!r}: expected wandb, csv or none")


def run_name(job_type: str, out_dir: str | os.PathLike) -> str:
    """A run's default name: ``<job>:<output folder>`` (a staging folder ``.NAME.tmp-*`` counts as NAME)."""
    folder = Path(out_dir).name
    if folder.startswith(".") and ".tmp-" in folder:
        folder = folder[1:folder.index(".tmp-")]
    return f"{job_type}:{folder}"


def _plain(v):
    return v if isinstance(v, (int, float, str, bool)) or v is None else json.dumps(v, default=str)


def _write_csv(path: Path, rows: list[dict]) -> None:
    cols = list(dict.fromkeys(c for r in rows for c in r))
    with atomic_path(path) as tmp, open(tmp, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=cols)
        w.writeheader()
        w.writerows(rows)


def offline_runs(folder: str | os.PathLike) -> list[Path]:
    """The W&B offline run folders ``folder`` is or holds (an output folder's ``wandb/offline-run-*``)."""
    folder = Path(folder)
    if folder.name.startswith("offline-run-"):
        return [folder]
    runs = sorted(folder.glob("wandb/offline-run-*")) + sorted(folder.glob("offline-run-*"))
    if not runs:
        raise FileNotFoundError(f"{folder}: no W&B offline run here (expected wandb/offline-run-* in an output folder, "
                                "or the offline-run-* folder itself)")
    return runs


def recorded_inputs(run_dir: str | os.PathLike) -> dict:
    """What an offline run recorded of its inputs (its files folder's :data:`INPUTS_FILE`): ``{project,
    inputs: {name: {type, sha256, files}}}``; no inputs where it recorded none."""
    from calib.sidefiles import read_json

    return read_json(Path(run_dir) / "files" / INPUTS_FILE, dict, missing_ok=True,
                     hint="it is what calib's tracker wrote beside the run") or {"inputs": {}}


def declare_inputs(folder: str | os.PathLike, project: str | None = None, entity: str | None = None,
                   wandb=None) -> dict[str, list[str]]:
    """Declare the inputs each offline run in ``folder`` recorded on the same run online (``wandb sync`` it
    first): W&B resumes the run by its id and uses an artifact of the same files, so the lineage edge an offline
    run could not draw appears. Refused, naming the run, the input and both digests: an input whose files are
    gone or changed since the run (the edge would point at other content). Returns {run folder: names declared}."""
    if wandb is None:
        import wandb
    done = {}
    for run_dir in offline_runs(folder):
        record = recorded_inputs(run_dir)
        inputs = dict(record.get("inputs") or {})
        for name, rec in inputs.items():
            now = content_digest(rec["files"])
            if now != rec["sha256"]:
                raise ValueError(f"{run_dir}: input {name!r} ({rec['type']}) recorded sha256 {rec['sha256'][:12]}..., "
                                 f"its files {rec['files']} now hold {now[:12]}...: they changed since the run; "
                                 "not declared")
        if not inputs:
            done[str(run_dir)] = []
            continue
        run_id = run_dir.name.rsplit("-", 1)[-1]
        run = wandb.init(id=run_id, project=project or record.get("project") or "calib", entity=entity,
                         resume="must", mode="online")
        try:
            for name, rec in inputs.items():
                run.use_artifact(_artifact(wandb, name, rec["type"], rec["files"]))
        finally:
            run.finish()
        done[str(run_dir)] = sorted(inputs)
    return done


CLI_DOC = """Declare what an offline W&B run read (its input tables, banks) on the run once it is synced: W&B
cannot use artifacts offline, so calib records them beside the run, and this draws the lineage edges.

    wandb sync runs/eval/default/wandb/offline-run-*
    python -m calib.tracking declare-inputs runs/eval/default

Inputs whose files changed since the run are refused, naming both digests (the edge would point at other
content).
"""


def main(argv=None) -> int:
    """``python -m calib.tracking declare-inputs OUT_DIR [--project P] [--entity E]``."""
    from calib.cli import parser

    ap = parser(CLI_DOC, prog="python -m calib.tracking")
    sub = ap.add_subparsers(dest="command", required=True)
    d = sub.add_parser("declare-inputs", help="declare an offline run's recorded inputs on the synced run")
    d.add_argument("folder", help="an output folder holding wandb/offline-run-*, or such a run folder")
    d.add_argument("--project", default=None, help="the W&B project the run was synced to (default: the "
                                                   "run's own)")
    d.add_argument("--entity", default=None, help="the W&B entity (default: yours)")
    args = ap.parse_args(argv)
    try:
        done = declare_inputs(args.folder, args.project, args.entity)
    except (FileNotFoundError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    for run, names in done.items():
        print(f"{run}: {', '.join(names) if names else 'no recorded inputs'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
