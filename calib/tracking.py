"""Experiment tracking behind one small interface: W&B (offline by default), CSV files, or nothing.

Entry points pick one with the ``logger`` config group (``logger=wandb|csv|none``). W&B runs are
offline unless WANDB_MODE says otherwise, so nothing leaves the machine by default (``wandb sync <run
folder>`` uploads one later; ``WANDB_MODE=online`` logs live). This is calib's one logging path: Lightning's
own loggers stay off (``calib.calibrators.lightning_fit``). Runs are named ``<job>:<output folder>`` unless
``logger.name`` says otherwise, and grouped by ``logger.group`` (the experiment). Lineage: train.py logs
the tables as an artifact; eval.py declares the tables it evaluates as its input (:meth:`use_artifact`; an
offline run, which W&B does not let use artifacts, records their digest in its config instead).
"""

from __future__ import annotations

import csv
import json
import os
import shutil
from pathlib import Path

from calib import envs
from calib.atomic import atomic_path


class Tracker:
    """No-op base: ``logger=none``."""

    def log(self, scalars: dict, step: int | None = None) -> None: ...

    def log_image(self, key: str, path: str | os.PathLike) -> None: ...

    def log_table(self, key: str, rows: list[dict]) -> None: ...

    def log_artifact(self, name: str, kind: str, paths: list[str | os.PathLike], metadata: dict | None = None) -> None: ...

    def use_artifact(self, name: str, kind: str, paths: list[str | os.PathLike], metadata: dict | None = None) -> None:
        """Declare files this run reads (e.g. the tables eval evaluates) as its input artifact."""

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

    def _artifact(self, name, kind, paths, metadata):
        art = self.wandb.Artifact(name, type=kind, metadata=metadata or {})
        for p in paths:
            art.add_file(str(p))
        return art

    def log_artifact(self, name, kind, paths, metadata=None):
        self.run.log_artifact(self._artifact(name, kind, paths, metadata))

    def use_artifact(self, name, kind, paths, metadata=None):
        # the same name and content as train.py logged: W&B matches it by digest, so the lineage
        # bank -> tables -> eval is an edge of the online run graph. W&B refuses use_artifact offline
        # ("Cannot use artifact when in offline mode"): an offline run records its input's name, type and
        # content digest in its config instead (the same files train.py's artifact holds).
        if self.run.offline:
            import hashlib

            digest = hashlib.sha256()
            for p in sorted(map(str, paths)):
                digest.update(Path(p).read_bytes())
            self.run.config.update({"input_artifacts": {name: {"type": kind, "sha256": digest.hexdigest(),
                                                                "files": [str(p) for p in paths]}}},
                                   allow_val_change=True)
            return
        self.run.use_artifact(self._artifact(name, kind, paths, metadata))

    def finish(self):
        self.run.finish()


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
