"""The transfer checks of a chain (:func:`calib.training.transfer_check`, fit on some categories and scored on the
others, both ways) run side by side: the transfer guard's for every candidate, the report's for the chosen one.
``selection.n_jobs`` joblib processes run them at once; each fit keeps its one thread, so the numbers are the
same with any ``n_jobs``. The caller hands the check in (``check``: a module-level function, which a worker
process imports by name), so this module does not import calib.training, which imports it."""

from __future__ import annotations

from collections.abc import Callable

import pandas as pd

from calib.training_stats import in_order


def ways(transfer: dict) -> tuple:
    """``((fit_on, eval_on), (eval_on, fit_on))`` of a ``transfer`` block."""
    return (transfer["fit_on"], transfer["eval_on"]), (transfer["eval_on"], transfer["fit_on"])


def transfer_checks(check: Callable, kind, samples: pd.DataFrame, chain_cfg: dict, models: list,
                    transfer: dict) -> list:
    """``check`` (:func:`calib.training.transfer_check`, with context) of each of ``models``, both ways
    (:func:`ways`), in that order: its result, None (a side without rows), or the exception where a side cannot
    be fitted."""
    both = ways(transfer)
    # the baseline's fit and score depend only on the way, not on the model: fitted once per way
    jobs = [(check, kind.name, samples, chain_cfg, None, transfer["baseline"], src, dst, ("baseline",))
            for src, dst in both]
    jobs += [(check, kind.name, samples, chain_cfg, m, transfer["baseline"], src, dst, ("model",)) for m in models
             for src, dst in both]
    got = list(in_order(_check_or_error, jobs, int((chain_cfg.get("selection") or {}).get("n_jobs") or 1)))
    base, out = got[:len(both)], []
    for i, r in enumerate(got[len(both):]):
        b = base[i % len(both)]
        out.append(b if b is None or isinstance(b, Exception) else r if r is None or isinstance(r, Exception)
                   else {**r, "baseline": b["baseline"]})
    return out


def _check_or_error(check: Callable, kind_name: str, *args):
    """One check in a worker (the chain kind by name: its functions are not all picklable)."""
    from calib.chains import chain

    *args, which = args
    try:
        return check(chain(kind_name), *args, context=True, which=which)
    except (ValueError, RuntimeError) as exc:
        return exc
