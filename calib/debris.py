"""Debris of killed runs: the staging folders a run killed outright (SIGKILL, the OOM killer, a power cut)
leaves beside its out_dir, where no handler could remove them (:mod:`calib.atomic` removes its staging folder
on every exit it sees). Each staging folder is named after the process that owns it (``.NAME.tmp-PID@HOST-*``,
:func:`calib.atomic.staging_dir`), so the next run at the same place can tell debris from a live run's work.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path


def _stage_prefix(target: Path) -> str:
    return f".{target.name}.tmp-"


def _host() -> str:
    return "".join(c if c.isalnum() else "_" for c in os.uname().nodename)[:64] or "host"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # PermissionError: another user's process, alive
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def clean_stale_staging(target: str | os.PathLike) -> list[Path]:
    """Remove the staging folders beside ``target`` whose run was killed before it could clean up (SIGKILL,
    the OOM killer, a power cut): those named after a process of this host that no longer runs. A staging
    folder of a live process, of another host (a shared file system) or without an owner in its name (from
    an older calib) is left, with a warning naming it; so is a ``.NAME.old-*`` folder, which may hold the
    previous output of a run killed while publishing. Returns the folders removed."""
    target, log = Path(target), logging.getLogger("calib.atomic")
    prefix, removed = _stage_prefix(target), []
    try:
        siblings = [p for p in target.parent.iterdir() if p.name.startswith((prefix, f".{target.name}.old-"))]
    except OSError:
        return removed
    for p in sorted(siblings):
        owner_part = p.name[len(prefix):].split("-", 1)[0] if p.name.startswith(prefix) else ""
        pid, _, host = owner_part.partition("@")
        if pid.isdigit() and host == _host() and not _alive(int(pid)):
            shutil.rmtree(p, ignore_errors=True)
            log.warning("removed %s: the staging folder of run %s on this host, which no longer runs (killed "
                        "before it could clean up)", p, pid)
            removed.append(p)
        elif not (pid.isdigit() and host == _host()):
            what = ("the previous output moved aside by a run killed while publishing: check it, then move it "
                    f"back to {target} or delete it") if ".old-" in p.name else \
                "a staging folder of a run that did not finish (owner unknown, or on another host): delete it " \
                "once no run writes there"
            log.warning("%s beside %s: %s", p, target, what)
    return removed
