"""Sufficient statistics of the model chain, streamed part by part (one process, or Ray Data over the parts).

The calibrators of a raw confidence (identity, temperature / Platt, isotonic, histogram binning) are
functions of the confidence per depth and context cell; what they fit from is, per (split, depth,
context cell, confidence bin), the number of samples ``n`` and accepts ``k`` with a few sums of the
confidences in the bin. :func:`part_stats` computes them for one part of a bank (a bank folder: one
replica, or one slice of its traffic) from its censored samples (:func:`calib.labels.censored`, the
split by prompt of :func:`calib.labels.prompt_split`, the context of :func:`calib.labels.round_context`);
:func:`stream_stats` adds the parts up in their listed order, in this process or on a Ray cluster
(:func:`ray_stats`: ``ray.data.from_items(parts).map(part_stats)``, order preserved), so both give the
same numbers, bit for bit (each part's numbers are the same function of the same rows; the sum runs in
the same order). Memory: one part at a time, plus the statistics (``splits × depths × cells × bins``).

Accumulators (arrays ``[3 splits, D, C, B]``): ``n`` and ``k`` (int64); ``sc`` Σ conf, ``sz`` Σ logit(conf)
(temperature scaling's input), ``sc2`` Σ conf², ``sc1`` Σ conf over accepts, ``snll`` Σ the raw NLL
(float64). Bins (:func:`conf_bins`) nest in the ECE's equal-width bins, so the raw ECE is exact from them, and are
equal in logit inside each.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from calib.metrics import NLL_EPS

log = logging.getLogger("calib.train")

SPLITS = ("train", "val", "test")
INT_STATS = ("n", "k")
FLOAT_STATS = ("sc", "sz", "sc2", "sc1", "snll")
LOGIT_EPS = 1e-6  # calib.calibrators.base.logit's clip: temperature scaling's input


@dataclass(frozen=True)
class StatsSpec:
    """What :func:`part_stats` bins by: the context ``axes`` (names) and their ``edges`` (a resolved chain
    config's selected axes), ``depths`` D, confidence ``bins`` B, the split by prompt."""

    depths: int
    bins: int = 1920
    axes: tuple[str, ...] = ()
    edges: tuple[tuple[float, ...], ...] = ()
    fractions: tuple[float, ...] = (0.7, 0.15, 0.15)
    seed: int = 0
    judged_only: bool = True
    validate: bool = True
    extra: dict = field(default_factory=dict)

    @property
    def cells(self) -> int:
        return int(np.prod([len(e) + 1 for e in self.edges])) if self.edges else 1

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (len(SPLITS), self.depths, self.cells, self.bins)


def conf_bins(conf: np.ndarray, bins: int) -> np.ndarray:
    """Bin per confidence: its ECE bin (equal-width, right-closed as :func:`calib.metrics.equal_width_bins`),
    cut into ``bins // ECE_BINS`` sub-bins equal in logit over that ECE bin (a calibrator of the logit, as
    temperature scaling, sees the confidences near 0 and 1 spread out, not pooled into one bin)."""
    from calib.metrics import ECE_BINS, equal_width_bins

    sub = bins // ECE_BINS
    if sub * ECE_BINS != bins:
        raise ValueError(f"scale.bins={bins} must be a multiple of {ECE_BINS} (the ECE bins)")
    e = equal_width_bins(conf, ECE_BINS)

    def lg(p):
        p = np.clip(p, LOGIT_EPS, 1 - LOGIT_EPS)
        return np.log(p) - np.log1p(-p)

    lo, hi = lg(e / ECE_BINS), lg((e + 1) / ECE_BINS)
    j = np.floor((lg(conf) - lo) / (hi - lo) * sub).astype(np.int64)
    return e * sub + np.clip(j, 0, sub - 1)


def empty_stats(spec: StatsSpec) -> dict[str, np.ndarray]:
    return {**{s: np.zeros(spec.shape, np.int64) for s in INT_STATS},
            **{s: np.zeros(spec.shape, np.float64) for s in FLOAT_STATS}}


def _split_ids(category, prompt_idx: np.ndarray, spec: StatsSpec) -> np.ndarray:
    """0/1/2 (train/val/test) per round, :func:`calib.labels.prompt_split` computed once per prompt."""
    import pandas as pd
    import pyarrow as pa

    from calib.labels import prompt_split

    enc = pa.chunked_array(category).dictionary_encode().combine_chunks()
    cats = np.asarray(enc.dictionary.to_pylist(), dtype=object)
    key = enc.indices.to_numpy().astype(np.int64) * (int(prompt_idx.max(initial=0)) + 1) + prompt_idx
    codes, uniq = pd.factorize(key)
    names = prompt_split(cats[uniq // (int(prompt_idx.max(initial=0)) + 1)], uniq % (int(prompt_idx.max(initial=0)) + 1),
                         spec.fractions, spec.seed)
    ids = np.array([SPLITS.index(n) for n in names], dtype=np.int64)
    return ids[codes]


def read_part(part: Path, judged_only: bool = True):
    """acceptance ⋈ speculator of one part (keys, accept, acc*, conf*, temperature where recorded): the two
    files side by side where their rows are in the same key order (as calib writes them), else joined on the
    keys. With ``judged_only`` the rounds whose request carried target-only logit transforms are left out."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    from calib.bank import schema
    from calib.transforms import COLUMN

    keys = list(schema.KEYS)
    acc_names = ["accept", *schema.depth_columns(_names(part / schema.ACCEPTANCE), schema.ACC)]
    spec_all = _names(part / schema.SPECULATOR)
    spec_names = [*schema.depth_columns(spec_all, schema.CONF), *(["temperature"] if "temperature" in spec_all else [])]
    spec_names += [COLUMN] if judged_only and COLUMN in spec_all else []
    # the string keys (model, speculator, config, category) stay dictionary-encoded, as parquet stores them: a
    # string per row and key, twice, cost more than the confidences (~1 s of a 1M-round part's ~3 s read)
    strings = [k for k in keys if schema.KEY_TYPES[k] == pa.string()]
    acc = pq.read_table(part / schema.ACCEPTANCE, columns=keys + acc_names, read_dictionary=strings)
    spc = pq.read_table(part / schema.SPECULATOR, columns=keys + spec_names, read_dictionary=strings)
    if acc.num_rows == spc.num_rows and all(acc.column(k).equals(spc.column(k)) for k in keys):
        t = acc
        for n in spec_names:
            t = t.append_column(n, spc.column(n))
    else:  # joined on the keys' values (a dictionary's codes may differ between the files)
        acc, spc = (x.cast(pa.schema([pa.field(f.name, f.type.value_type) if pa.types.is_dictionary(f.type) else f
                                      for f in x.schema])) for x in (acc, spc))
        t = acc.join(spc, keys=keys, join_type="inner")
    if COLUMN in t.column_names:
        v = t.column(COLUMN)
        t = t.filter(pc.invert(pc.and_(pc.is_valid(v), pc.not_equal(pc.fill_null(v, ""), "")))).drop_columns([COLUMN])
    return t if isinstance(t, pa.Table) else pa.table(t)


def part_stats(part: str | Path, spec: StatsSpec) -> dict[str, np.ndarray]:
    """The statistics of one part (a bank folder; validated first with ``spec.validate``): every sample of
    the model chain (a round's depth reached, with a confidence) binned by split, depth, context cell and
    confidence. Rounds of requests with target-only logit transforms are left out with ``spec.judged_only``."""
    from calib.bank import schema
    from calib.bank.validate import BankError, validate
    from calib.calibrators.context import context_cells
    from calib.labels import censored, round_context

    part = Path(part)
    if spec.validate and (problems := validate(str(part))):
        raise BankError(problems)
    t = read_part(part, spec.judged_only)
    out = empty_stats(spec)
    width = schema.width(t.column_names, schema.CONF)
    if not width or t.num_rows == 0:
        return out
    if width > spec.depths:
        raise ValueError(f"{part}: drafted width {width} > {spec.depths}, the width the statistics were sized for")
    conf = schema.depth_matrix(t, schema.CONF, width)
    has = ~np.isnan(conf).all(axis=1)
    ctx = round_context(t, names=spec.axes) if spec.axes else {}  # before the filter: every round counts
    ctx = np.stack([ctx[a][has] for a in spec.axes], 1) if spec.axes else np.zeros((int(has.sum()), 0))
    acc = schema.depth_matrix(t, schema.ACC, schema.width(t.column_names))[has]
    conf = conf[has]
    round_split = _split_ids(t.column("category"), t.column("prompt_idx").to_numpy(), spec)[has]
    reached, label = censored(acc)
    rows, depth = np.nonzero(reached)
    c = conf[rows, depth]
    if np.isnan(c).any():
        i = int(rows[np.isnan(c)][0])
        raise ValueError(f"{part}: a reached depth without a confidence (round {i} of the judged rounds); "
                         f"validate the bank (python -m calib.bank validate {part})")
    y = label[rows, depth]
    split = round_split[rows]
    cell = context_cells(ctx[rows], [list(e) for e in spec.edges]) if spec.axes else np.zeros(len(c), np.int64)
    S, D, C, B = spec.shape
    idx = ((split * D + depth) * C + cell) * B + conf_bins(c, B)
    size = S * D * C * B
    yf = y.astype(np.float64)
    q = np.clip(c, NLL_EPS, 1.0 - NLL_EPS)
    zc = np.clip(c, LOGIT_EPS, 1 - LOGIT_EPS)
    weights = {"k": yf, "sc": c, "sz": np.log(zc) - np.log1p(-zc), "sc2": c * c, "sc1": c * yf,
               "snll": -np.where(y, np.log(q), np.log1p(-q))}
    out["n"] = np.bincount(idx, minlength=size).reshape(spec.shape).astype(np.int64)
    for name, w in weights.items():
        v = np.bincount(idx, weights=w, minlength=size).reshape(spec.shape)
        out[name] = np.rint(v).astype(np.int64) if name in INT_STATS else v
    return out


def _names(path: Path) -> list[str]:
    import pyarrow.parquet as pq

    return pq.read_schema(path).names


def add_stats(total: dict, part: dict) -> dict:
    for k in (*INT_STATS, *FLOAT_STATS):
        total[k] += part[k]
    return total


def stream_stats(parts: list[Path], spec: StatsSpec, mode: str = "stream", ray_cfg: dict | None = None,
                 progress: bool = False, n_jobs: int = 1) -> dict[str, np.ndarray]:
    """The statistics of every part added up in ``parts`` order: here (``stream``) one part at a time, or
    ``n_jobs`` parts at once in joblib processes (their results come back in order, so the sum is the
    same, bit for bit), or on a Ray cluster (``ray``, :func:`ray_stats`)."""
    if mode == "ray":
        return ray_stats(parts, spec, ray_cfg or {}, progress)
    total = empty_stats(spec)
    for stats in _progress(in_order(part_stats, [(p, spec) for p in parts], n_jobs), progress, "statistics",
                           len(parts)):
        add_stats(total, stats)
    return total


def in_order(fn, args: list[tuple], n_jobs: int = 1):
    """``fn(*a)`` for each of ``args``, yielded in their order: in this process with ``n_jobs`` 1, else in
    that many joblib processes (at most two results waiting per process: memory stays bounded)."""
    if n_jobs == 1 or len(args) < 2:
        return (fn(*a) for a in args)
    from joblib import Parallel, delayed

    return Parallel(n_jobs=min(n_jobs, len(args)), return_as="generator", pre_dispatch="2*n_jobs")(
        delayed(fn)(*a) for a in args)


def _progress(items, on: bool, what: str, total: int | None = None):
    if not on:
        return items
    from tqdm.auto import tqdm

    return tqdm(items, desc=what, unit="part", total=total)


def ray_stats(parts: list[Path], spec: StatsSpec, ray_cfg: dict, progress: bool = False) -> dict[str, np.ndarray]:
    """:func:`part_stats` of every part with Ray Data (one task per part, ``ray_cfg.concurrency`` at a time)
    on the cluster at ``ray_cfg.address`` (None: a local one of ``ray_cfg.num_cpus`` CPUs, started here
    and shut down after), added up in ``parts`` order (Ray Data's order preserved)."""
    try:
        import ray
    except ImportError as exc:
        raise ImportError("scale=ray needs Ray: pip install -c constraints.txt -e '.[ray]'") from exc
    started = not ray.is_initialized()
    if started:
        ray.init(address=ray_cfg.get("address"), num_cpus=ray_cfg.get("num_cpus"), include_dashboard=False,
                 log_to_driver=False, configure_logging=False)
    try:
        ctx = ray.data.DataContext.get_current()
        ctx.execution_options.preserve_order = True
        ctx.enable_progress_bars = bool(progress)
        items = [{"index": i, "part": str(p)} for i, p in enumerate(parts)]

        def one(row: dict) -> dict:
            return {"index": row["index"], **part_stats(row["part"], spec)}

        dset = ray.data.from_items(items, override_num_blocks=max(1, len(items))).map(
            one, concurrency=ray_cfg.get("concurrency") or None)
        total, expect = empty_stats(spec), 0
        for row in dset.iter_rows():
            if int(row["index"]) != expect:
                raise RuntimeError(f"Ray Data returned part {row['index']} where part {expect} was due; "
                                   "the sum must run in the parts' order")
            expect += 1
            add_stats(total, {k: np.asarray(row[k]).reshape(spec.shape) for k in (*INT_STATS, *FLOAT_STATS)})
        if expect != len(parts):
            raise RuntimeError(f"Ray Data returned {expect} of {len(parts)} parts")
        return total
    finally:
        if started:
            ray.shutdown()


def bin_points(stats: dict, splits=(0, 1), cell: int | None = None) -> tuple[np.ndarray, ...]:
    """``(depth, x mean conf, z mean logit, k, n)`` of every non-empty (depth, bin) of ``splits`` (default
    train + val: what the chosen calibrators are fitted on), in context ``cell`` (None: every cell pooled);
    what :meth:`fit_counts` takes."""
    def pick(name):
        a = stats[name][list(splits)].sum(axis=0)  # [D, C, B]
        return a.sum(axis=1) if cell is None else a[:, cell]

    n, k, sc, sz = (pick(s) for s in ("n", "k", "sc", "sz"))
    d, b = np.nonzero(n)
    nn = n[d, b].astype(np.float64)
    return d.astype(np.int64), sc[d, b] / nn, sz[d, b] / nn, k[d, b].astype(np.float64), nn


def refit_from_stats(est, stats: dict) -> dict:
    """Refit, in place, every chosen calibrator of ``est`` (a :class:`GroupedCVSelection`, or one per
    context cell) that fits from counts on the train + val statistics of its cell (the pooled fit on every
    cell's); candidates that need rows (feature models, temperature scaling with context inputs) keep
    their fit on the sample. Returns ``{"refitted": {name: fits}, "kept": {name: fits}}``."""
    from calib.calibrators.context import PerContextCell

    done: dict = {"refitted": {}, "kept": {}}

    def one(sel, cell):
        pts = bin_points(stats, cell=cell)
        if not len(pts[0]):
            return
        for name, e in sel.chosen_estimators_.items():
            if hasattr(e, "fit_counts") and getattr(e, "w_", np.zeros(0)).size == 0:
                e.fit_counts(*pts)
                done["refitted"][name] = done["refitted"].get(name, 0) + 1
            else:
                done["kept"][name] = done["kept"].get(name, 0) + 1

    if isinstance(est, PerContextCell):
        for c, sel in est.cells_.items():
            one(sel, c)
        if est.pooled_ is not None:
            one(est.pooled_, None)
    else:
        one(est, None)
    return done


def _cell_values(spec: StatsSpec) -> np.ndarray:
    """``[C, A]`` a context value per cell and axis that falls in that cell's bucket (-inf: bucket 0)."""
    sizes = [len(e) + 1 for e in spec.edges]
    out = np.zeros((spec.cells, len(sizes)))
    for c in range(spec.cells):
        rest = c
        for a in reversed(range(len(sizes))):
            j = rest % sizes[a]
            rest //= sizes[a]
            out[c, a] = -np.inf if j == 0 else spec.edges[a][j - 1]
    return out


def per_depth_from_stats(stats: dict, spec: StatsSpec, split: str, table) -> list[dict]:
    """:func:`calib.training_report._per_depth`'s rows (raw vs calibrated ECE / NLL / Brier per depth and
    pooled) from one split's statistics. The raw figures are exact; the calibrated ones read the table at
    each bin's mean confidence (within a bin the table moves by less than its grid step)."""
    from calib.metrics import ECE_BINS, equal_width_bins
    from calib.tables.export import table_predict

    s = SPLITS.index(split)
    n, k = stats["n"][s].astype(np.float64), stats["k"][s].astype(np.float64)  # [D, C, B]
    d, c, b = np.nonzero(n)
    x = stats["sc"][s][d, c, b] / n[d, c, b]
    inputs = np.column_stack([x, _cell_values(spec)[c]]) if spec.axes else x
    p = np.clip(table_predict(table, inputs, d), 0.0, 1.0)
    q = np.clip(p, NLL_EPS, 1 - NLL_EPS)
    nb, kb = n[d, c, b], k[d, c, b]
    ece_bin = b // (spec.bins // ECE_BINS)
    cal_bin = equal_width_bins(p, ECE_BINS)
    rows = []
    for depth in ["all", *range(spec.depths)]:
        m = np.ones(len(d), bool) if depth == "all" else d == depth
        N = nb[m].sum()
        if not N:
            continue

        def ece_of(bins, pn, m=m, N=N):
            cnt = np.bincount(bins[m], weights=kb[m] - pn[m], minlength=ECE_BINS)
            return float(np.abs(cnt).sum() / N)

        raw = {f: stats[f][s][d[m], c[m], b[m]].sum() for f in ("sc", "sc2", "sc1", "snll")}
        rows.append({"depth": depth, "n": int(N),
                     "raw_ece": ece_of(ece_bin, stats["sc"][s][d, c, b]),
                     "cal_ece": ece_of(cal_bin, nb * p),
                     "raw_nll": float(raw["snll"] / N),
                     "cal_nll": float(-(kb[m] * np.log(q[m]) + (nb[m] - kb[m]) * np.log1p(-q[m])).sum() / N),
                     "raw_brier": float((raw["sc2"] - 2 * raw["sc1"] + kb[m].sum()) / N),
                     "cal_brier": float((nb[m] * p[m] ** 2 - 2 * kb[m] * p[m] + kb[m]).sum() / N)})
    return rows
