"""stats.json: the summary a bank carries beside its parquet files (public layout)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from calib.bank import schema


def acc_matrix(acceptance: pa.Table) -> np.ndarray:
    """acc columns as float [N, D]: 1.0 / 0.0, NaN where not drafted."""
    return schema.depth_matrix(acceptance, schema.ACC)


def _summary(accept: np.ndarray, acc: np.ndarray) -> dict:
    hist = np.bincount(accept, minlength=1) if accept.size else np.zeros(1, dtype=np.int64)
    drafted = (~np.isnan(acc)).sum(axis=0)
    by_pos = np.where(drafted > 0, np.nansum(acc, axis=0) / np.maximum(drafted, 1), np.nan)
    return {
        "n_rounds": int(accept.size),
        "accept_hist": {str(a): int(n) for a, n in enumerate(hist) if n},
        "mean_accept": float(accept.mean()) if accept.size else 0.0,
        "mean_commits": float(accept.mean() + 1.0) if accept.size else 0.0,
        # P(acc_k = 1) over the rounds that drafted depth k.
        "accept_by_position": [None if np.isnan(v) else float(v) for v in np.atleast_1d(by_pos)],
        "mean_drafted": float((~np.isnan(acc)).sum(axis=1).mean()) if accept.size else 0.0,
    }


def compute_stats(acceptance: pa.Table) -> dict:
    accept = acceptance.column("accept").to_numpy(zero_copy_only=False).astype(np.int64)
    acc = acc_matrix(acceptance)
    out = _summary(accept, acc)
    cats = np.asarray(acceptance.column("category").to_pylist(), dtype=object)
    out["by_category"] = {
        str(c): _summary(accept[cats == c], acc[cats == c]) for c in sorted(set(cats.tolist()))
    }
    return out


def _shown(value) -> str:
    text = repr(value)
    return (text if len(text) <= 60 else text[:57] + "...") + f" ({type(value).__name__})"


def _is_number(value) -> bool:
    """A JSON number that fits a float64 (not a bool; an integer of 400 digits is not a statistic)."""
    return isinstance(value, float) or (isinstance(value, int) and not isinstance(value, bool)
                                        and abs(value) < 2**63)


def _is_count(value) -> bool:
    return _is_number(value) and value >= 0 and float(value).is_integer()


def compare_stats(claimed: dict, actual: dict, path: str = "stats") -> list[str]:
    """Differences between a stats.json and the stats recomputed from the data (known keys only).

    Each difference starts with the dotted key (``stats.by_category.chat.n_rounds``). A known key
    holding a value of the wrong type (a string where a number is, a list where an object is) is a
    difference too, never an exception: stats.json may be hand-edited."""
    if not isinstance(claimed, dict):
        return [f"{path} is {_shown(claimed)}, expected an object"]
    diffs = []
    for key, want in claimed.items():
        if key not in actual:
            continue  # public banks may carry fields calib does not compute
        got = actual[key]
        where = f"{path}.{key}"
        if isinstance(got, dict):
            if not isinstance(want, dict):
                diffs.append(f"{where} is {_shown(want)}, expected an object")
            elif key == "accept_hist":
                bad = next((k for k, v in want.items() if not _is_count(v)), None)
                if bad is not None:
                    diffs.append(f"{where} is {_shown(want)}, expected counts (integers >= 0); "
                                 f"{where}.{bad} is {_shown(want[bad])}")
                    continue
                want_n = {str(k): int(v) for k, v in want.items() if int(v)}
                if want_n != got:
                    diffs.append(f"{where} is {want_n}, the data give {got}")
            else:
                for sub in sorted(set(want) - set(got)):
                    diffs.append(f"{where}.{sub} is claimed but the data have no such group")
                for sub in sorted(set(want) & set(got)):
                    if isinstance(got[sub], dict):
                        diffs += compare_stats(want[sub], got[sub], f"{where}.{sub}")
        elif isinstance(got, list):
            if not isinstance(want, list) or not all(v is None or _is_number(v) for v in want):
                diffs.append(f"{where} is {_shown(want)}, expected a list of numbers (null where none)")
                continue
            a = np.array([np.nan if v is None else v for v in want], dtype=float)
            b = np.array([np.nan if v is None else v for v in got], dtype=float)
            n = min(a.size, b.size)
            extra = np.concatenate([a[n:], b[n:]])
            if not np.allclose(a[:n], b[:n], atol=1e-6, equal_nan=True) or not np.all(np.isnan(extra)):
                diffs.append(f"{where} is {want}, the data give {got}")
        elif _is_number(got):
            if not _is_number(want):
                diffs.append(f"{where} is {_shown(want)}, expected a number")
            elif not np.isclose(float(want), float(got), atol=1e-6, rtol=1e-6):
                diffs.append(f"{where} is {want}, the data give {got}")
    return diffs
