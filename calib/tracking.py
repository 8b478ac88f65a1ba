"""Experiment tracking behind one small interface: W&B (offline by default), CSV files, or nothing.

Entry points pick one with the ``logger`` config group (``logger=wandb|csv|none``). W&B runs are
offline unless WANDB_MODE says otherwise, so nothing leaves the machine by default.
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
                 mode: str | None = None, name: str | None = None, tags=None):
        import wandb

        self.wandb = wandb
        self.run = wandb.init(project=project, dir=str(out_dir), config=config, job_type=job_type,
                              mode=mode or envs.WANDB_MODE, name=name,
                              tags=list(tags or []), reinit="finish_previous")

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
        art = self.wandb.Artifact(name, type=kind, metadata=metadata or {})
        for p in paths:
            art.add_file(str(p))
        self.run.log_artifact(art)

    def finish(self):
        self.run.finish()


def make_tracker(cfg: dict | None, out_dir: str | os.PathLike, config: dict, job_type: str) -> Tracker:
    """A tracker from a ``logger`` config: ``{kind: wandb|csv|none, project, mode, ...}``."""
    cfg = dict(cfg or {"kind": "none"})
    kind = cfg.pop("kind", "none")
    if kind == "wandb":
        return WandbTracker(cfg.get("project", "calib"), out_dir, config, job_type, cfg.get("mode"),
                            cfg.get("name"), cfg.get("tags"))
    if kind == "csv":
        return CSVTracker(Path(out_dir) / "csv")
    if kind == "none":
        return Tracker()
    raise ValueError(f"logger.kind={kind!r}: expected wandb, csv or none")


def _plain(v):
    return v if isinstance(v, (int, float, str, bool)) or v is None else json.dumps(v, default=str)


def _write_csv(path: Path, rows: list[dict]) -> None:
    cols = list(dict.fromkeys(c for r in rows for c in r))
    with atomic_path(path) as tmp, open(tmp, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=cols)
        w.writeheader()
        w.writerows(rows)
