"""Verify-cost curves ``C(T)``: the cost of one target forward pass that scores ``T`` positions.

Four kinds, chosen in config (``conf/cost/``): ``parametric`` (weight read + per-position term),
``measured`` (a CSV from ``bench/verify_cost.py``), ``engine`` (an engine's whole step measured on the
clock, :mod:`calib.cost.step`) and ``moe`` (a verify *shape*'s experts read, :mod:`calib.cost.moe`), each returned as the allocator's price-mode tensor float64 ``[T_max + 1]`` and
checked finite and positive where it is made. The draft cost of a drafter: :mod:`calib.cost.draft`.
Design notes: docs/cost.md.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch


@dataclass
class CostCurve:
    name: str
    values: np.ndarray  # [T_max + 1], values[T] = C(T); values[0] = C(1) (never used: T >= B >= 1)
    unit: str

    def __post_init__(self) -> None:
        check_values(self.name, self.values)

    def __call__(self, t) -> np.ndarray:
        return self.values[np.asarray(t, dtype=np.int64)]

    def for_batch(self, batch: int) -> CostCurve:
        """The curve the allocator sees at batch size ``batch`` (the same for curves over T only)."""
        return self

    def with_context(self, context: np.ndarray | None) -> CostCurve:
        """The curve charging each step by ``context`` [S, B], the tokens cached per request (the same for curves
        that do not read it)."""
        return self

    def charge(self, depth: np.ndarray) -> np.ndarray:
        """Cost of each step [S] given the verified draft depths [S, B] (every request also verifies
        its bonus position). A curve over total positions sees only ``B + Σ depth``."""
        depth = np.asarray(depth)
        return self(depth.shape[-1] + depth.sum(axis=-1))

    def tensor(self, extra: float = 0.0, t_max: int | None = None) -> torch.Tensor:
        """Price-mode tensor ``C(T) + extra`` (extra: a sunk per-step cost such as drafting)."""
        v = self.values if t_max is None else self.values[: t_max + 1]
        return torch.from_numpy(v + extra)


class MoECurve(CostCurve):
    """A shape-dependent MoE verify cost (:class:`calib.cost.moe.MoECost`). ``values`` is the even-spread
    curve for the current batch size (1 until :meth:`for_batch`)."""

    def __init__(self, name: str, cost, t_max: int, unit: str, batch: int = 1):
        super().__init__(name, cost.even_curve(batch, t_max), unit)  # checks the values
        self.cost, self.t_max, self.batch = cost, t_max, batch

    def for_batch(self, batch: int) -> MoECurve:
        return self if batch == self.batch else MoECurve(self.name, self.cost, self.t_max, self.unit, batch)

    def charge(self, depth: np.ndarray) -> np.ndarray:
        from calib.cost.moe import depth_counts

        depth = np.asarray(depth, dtype=np.int64)
        return self.cost.step_cost(depth_counts(depth, int(depth.max(initial=0))))


def check_values(name: str, values: np.ndarray) -> None:
    """A curve ``[T_max + 1]`` must price at least ``T = 1`` and every ``C(T)`` must be finite and > 0."""
    values = np.asarray(values)
    if values.ndim != 1 or values.size < 2:
        raise ValueError(f"cost curve {name!r} has shape {values.shape}: it must be 1-D [T_max + 1] with "
                         "T_max >= 1 (a verify pass scores at least one position)")
    bad = ~np.isfinite(values) | (values <= 0)
    if bad.any():
        t = int(np.flatnonzero(bad)[0])
        raise ValueError(f"cost curve {name!r}: C({t}) = {float(values[t])!r}; every verify cost must be "
                         f"finite and positive ({int(bad.sum())} of {values.size} entries are not); check the "
                         "curve's config (conf/cost/)")


def read_curve_csv(path, column: str = "seconds") -> tuple[np.ndarray, np.ndarray]:
    """``(T, cost)`` sorted by ``T`` from a CSV with columns ``T`` and ``column``; a row with a missing,
    non-numeric, non-positive or non-finite value, or a repeated or non-positive ``T``, is an error
    naming the file and line, and so is a file with fewer than two rows (nothing to interpolate)."""
    if Path(path).is_dir():
        raise ValueError(f"{path} is a folder, not a CSV file: a measured curve is the file bench/verify_cost.py "
                         "writes (columns T, seconds[, seconds_min]); name the .csv itself")
    try:
        with open(path, newline="", encoding="utf-8-sig") as fh:  # -sig: a spreadsheet's byte-order mark is no column
            return _curve_rows(path, csv.DictReader(fh), column)
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not UTF-8 text (byte {exc.start}); a measured curve is a UTF-8 CSV "
                         "(bench/verify_cost.py): re-save it as UTF-8") from None
    except OSError as exc:
        raise ValueError(f"{path}: cannot be read ({exc.strerror or exc}); a measured curve is the CSV "
                         "bench/verify_cost.py writes") from None


def _curve_rows(path, reader, column: str) -> tuple[np.ndarray, np.ndarray]:
    """:func:`read_curve_csv`'s rows from the open ``reader``."""
    rows = []
    missing = [c for c in ("T", column) if c not in (reader.fieldnames or [])]
    if missing:
        raise ValueError(f"{path}: no column {missing} (columns: {reader.fieldnames}); a measured curve "
                         f"has columns T, seconds[, seconds_min] (bench/verify_cost.py)")
    seen: dict[int, int] = {}
    for r in reader:
        line = reader.line_num
        try:
            t, c = int(r["T"]), float(r[column])
        except (TypeError, ValueError):
            raise ValueError(f"{path}, line {line}: T={r['T']!r}, {column}={r[column]!r}: expected an "
                             f"integer T and a number") from None
        if t < 1:
            raise ValueError(f"{path}, line {line}: T={t}; a verify pass scores T >= 1 positions")
        if not (np.isfinite(c) and c > 0):
            raise ValueError(f"{path}, line {line}: {column}={c!r} at T={t}; a verify cost must be "
                             "finite and positive")
        if t in seen:
            raise ValueError(f"{path}, line {line}: T={t} again (first on line {seen[t]})")
        seen[t] = line
        rows.append((t, c))
    if len(rows) < 2:
        raise ValueError(f"{path}: {len(rows)} row(s); a measured curve needs at least two "
                         f"(T, {column}) rows to interpolate and extrapolate")
    rows.sort()
    return np.array([r[0] for r in rows], dtype=np.float64), np.array([r[1] for r in rows])


def make_curve(name: str, cfg: dict, t_max: int, root: str | Path = ".") -> CostCurve:
    kind = cfg.get("kind", name)
    if t_max < 1:
        raise ValueError(f"cost curve {name!r}: t_max={t_max}; a curve prices T = 1..t_max positions")
    if kind == "moe":
        from calib.cost.moe import MoECost

        return MoECurve(name, MoECost(cfg, root), t_max, cfg.get("unit", "s"))
    if kind == "engine":
        import logging

        from calib.cost.step import EngineStepCurve, load_step_cost, other_machine

        path = Path(cfg["path"])
        cost = load_step_cost(path if path.is_absolute() else Path(root) / path)
        elsewhere = other_machine(cost)
        if elsewhere:  # a replay priced by another machine's clock predicts that machine's speed-ups
            logging.getLogger("calib.cost").warning("cost curve %r (%s): %s; `python bench/prepare_replay.py` "
                                                    "profiles this one", name, path, elsewhere)
        charging = None
        if cfg.get("charge"):  # a richer model of the same engine the replay charges by (serving prices by `path`)
            charge = Path(cfg["charge"])
            charging = load_step_cost(charge if charge.is_absolute() else Path(root) / charge)
        try:
            return EngineStepCurve(name, cost, t_max, charging=charging)
        except ValueError as exc:  # e.g. a verify term that prices a step at 0 s: name the file that says so
            raise ValueError(f"{path}: {exc}; fix the file or re-run bench/profile_step.py --step-cost {path}") from None
    t = np.arange(t_max + 1, dtype=np.float64)
    if kind == "parametric":
        values = float(cfg["weight_read"]) + float(cfg["per_position"]) * t
        unit = cfg.get("unit", "weight reads")
    elif kind == "measured":
        path = Path(cfg["path"])
        if not path.is_absolute():
            path = Path(root) / path
        ts, secs = read_curve_csv(path, cfg.get("column", "seconds"))
        values = np.interp(t, ts, secs)
        if t_max > ts[-1] and len(ts) >= 2:  # linear beyond the grid, from the last segment's slope
            slope = (secs[-1] - secs[-2]) / (ts[-1] - ts[-2])
            beyond = t > ts[-1]
            values[beyond] = secs[-1] + slope * (t[beyond] - ts[-1])
        unit = cfg.get("unit", "s")
        if cfg.get("pad_to_cheaper", True):
            # An engine can pad a verify pass up to any larger shape that runs faster (CPU kernels
            # switch at some sizes: C(16) < C(15) here), so C(T) is at most every C(T' >= T).
            values = np.minimum.accumulate(values[::-1])[::-1]
    else:
        raise ValueError(f"cost curve {name!r}: kind must be parametric, measured, engine or moe, got {kind!r}")
    values[0] = values[1]
    return CostCurve(name, values, unit)  # checks every C(T)
