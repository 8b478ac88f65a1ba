"""train.py ``scale=stream`` / ``scale=ray``: tables from banks of any size in bounded memory.

The banks are read part by part (a part is a bank folder: one replica of a fleet, :mod:`calib.bank.fleet`;
no whole-bank DataFrame is built). Three steps:

1. **A sample of whole prompts** (``scale.sample_rounds`` rounds, seeded: a prompt is in it when a hash of
   the seed, its category and index falls below the fraction that gives that many rounds) is cut from every
   part with ``pyarrow.dataset`` filters and written as a small bank. Everything that needs rows runs on it,
   as :mod:`calib.training` runs on a whole bank: the choice of calibrator per depth and context cell
   (grouped CV by prompt), the context-axis trials, the transfer guard and check, the row-hungry candidates
   (logistic, gradient boosting, MLP: both chains), the n-gram chain, the forecast and the accepted length.
   Where the banks hold no more than that many rounds the sample is every round and this is today's path.
2. **The model chain's sufficient statistics** over every part (:mod:`calib.training_stats`: per split,
   depth, context cell and confidence bin, the samples, accepts and sums), in this process or with Ray Data.
3. **Refit and score from them**: the chosen calibrators that fit from counts (identity, isotonic,
   histogram binning, temperature / Platt scaling without context inputs) are refitted on every train and
   validation sample's bins, the table re-encoded, and the per-depth metrics of the validation and test
   splits computed over every part (tables.json ``scale`` says what was done where).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds

from calib.bank import load, schema, write_bank
from calib.bank.fleet import bank_parts, part_rounds
from calib.chains import context_axes
from calib.sidefiles import read_json
from calib.training_stats import StatsSpec, in_order, per_depth_from_stats, refit_from_stats, stream_stats

log = logging.getLogger("calib.train")

SCALE_DEFAULTS = {"mode": "memory", "sample_rounds": 300_000, "bins": 1920, "seed": 0, "validate_parts": True,
                  "progress": False, "n_jobs": 1, "fit_jobs": 1, "ray": {}}


class PartsBank:
    """The parts as :func:`calib.training._bank_identity` and ``_chain_depths`` read them (paths and
    manifests; nothing is loaded)."""

    def __init__(self, paths: list[Path]):
        self.paths = list(paths)

    def manifests(self) -> list[dict]:
        return [read_json(p / schema.MANIFEST, missing_ok=True, hint="fix or delete run_manifest.json") or {}
                for p in self.paths]


def _in_sample(cats, idx, fraction: float, seed: int) -> np.ndarray:
    """Whether each prompt (category, index) is in the seeded sample of whole prompts."""
    u = np.array([int(hashlib.sha256(f"sample/{seed}/{c}/{i}".encode()).hexdigest()[:12], 16) / 16**12
                  for c, i in zip(cats, idx)])
    return u < fraction


def _sample_part(part: Path, out: Path, fraction: float, seed: int) -> int:
    """Write the rounds of ``part``'s sampled prompts as a bank at ``out``; returns their number (0: none,
    nothing written). Each file is read whole and filtered by its own key columns (no row order assumed
    between the files): one read per file, no scan with a filter and no join."""
    acc = _read_keys_encoded(part / schema.ACCEPTANCE)
    prompts = acc.select(["category", "prompt_idx"]).group_by(["category", "prompt_idx"]).aggregate([])
    keep = _in_sample(prompts.column("category").to_pylist(), prompts.column("prompt_idx").to_pylist(), fraction, seed)
    chosen = prompts.filter(pa.array(keep))
    if chosen.num_rows == 0:
        return 0
    by_cat = {c: pa.array(np.unique(chosen.filter(pc.equal(chosen.column("category"), c)).column("prompt_idx")))
              for c in pc.unique(chosen.column("category")).to_pylist()}

    def pick(t: pa.Table) -> pa.Table:
        mask = None
        cats = pc.cast(t.column("category"), pa.string()) if pa.types.is_dictionary(t.column("category").type) \
            else t.column("category")  # a dictionary's few values, compared per row as strings
        for c, idx in by_cat.items():
            m = pc.and_(pc.equal(cats, c), pc.is_in(t.column("prompt_idx"), value_set=idx))
            mask = m if mask is None else pc.or_(mask, m)
        return _keys_decoded(t.filter(mask))

    ngram = pick(_read_keys_encoded(part / schema.NGRAM)) if (part / schema.NGRAM).exists() else None
    manifest = read_json(part / schema.MANIFEST, missing_ok=True, hint="fix or delete run_manifest.json")
    a = pick(acc)
    write_bank(out, a, pick(_read_keys_encoded(part / schema.SPECULATOR)), ngram,
               manifest={**(manifest or {}), "sample_of": str(part)})
    return a.num_rows


_ENCODED = "calib_keys_encoded"  # schema metadata: the string keys read dictionary-encoded (decoded before writing)


def _read_keys_encoded(path: Path) -> pa.Table:
    """A bank file read whole with its string keys dictionary-encoded, as parquet stores them (a string per row
    and key costs more than the file's numbers); :func:`_keys_decoded` gives the file's own types back."""
    import pyarrow.parquet as pq

    names = pq.read_schema(path).names
    strings = [k for k in schema.KEYS if schema.KEY_TYPES[k] == pa.string() and k in names]
    t = pq.read_table(path, read_dictionary=strings)
    return t.replace_schema_metadata({**(t.schema.metadata or {}), _ENCODED.encode(): ",".join(strings).encode()})


def _keys_decoded(t: pa.Table) -> pa.Table:
    meta = dict(t.schema.metadata or {})
    encoded = meta.pop(_ENCODED.encode(), b"").decode().split(",")
    fields = [f.with_type(pa.string()) if f.name in encoded else f for f in t.schema]
    return t.cast(pa.schema(fields, metadata=meta or None))


class Refiner:
    """The parts behind a sample bank: their statistics refit and score the model chain
    (:func:`calib.training._train_chain`'s ``refine``)."""

    def __init__(self, cfg: dict, parts: list[Path], rounds: int, sample: dict, judged_only: bool):
        self.scale = {**SCALE_DEFAULTS, **(cfg.get("scale") or {})}
        self.split = cfg["split"]
        self.parts, self.rounds, self.sample, self.judged_only = parts, rounds, sample, judged_only
        self.parts_bank = PartsBank(parts)
        self.stats, self.spec, self.info = None, None, {}

    def chain_config(self, chain_cfg: dict) -> dict:
        """``chain_cfg`` with its grouped-CV folds, axis trials and transfer checks fitted ``scale.fit_jobs`` at
        a time (each fit keeps its one thread, so the scores and the choice do not depend on it)."""
        jobs = int(self.scale["fit_jobs"])
        sel = dict(chain_cfg.get("selection") or {})
        if jobs <= int(sel.get("n_jobs") or 1):
            return chain_cfg
        return {**chain_cfg, "selection": {**sel, "n_jobs": jobs}}

    def target_models(self) -> list[str]:
        models: set = set()
        for p in self.parts:
            for batch in ds.dataset(p / schema.ACCEPTANCE, format="parquet").to_batches(columns=["model"]):
                models.update(map(str, pc.unique(batch.column(0)).to_pylist()))
        return sorted(models)

    def refit(self, kind, res: dict) -> None:
        axes = context_axes(res["chain_cfg"])
        depths = max(kind.drafted_depth(p) for p in self.parts)
        self.spec = StatsSpec(depths=depths, bins=int(self.scale["bins"]), axes=tuple(a.name for a in axes),
                              edges=tuple(tuple(a.edges) for a in axes),
                              fractions=tuple(self.split["fractions"]), seed=int(self.split["seed"]),
                              judged_only=self.judged_only, validate=bool(self.scale["validate_parts"]))
        t0 = time.time()
        self.stats = stream_stats(self.parts, self.spec, self.scale["mode"], dict(self.scale.get("ray") or {}),
                                  bool(self.scale["progress"]), int(self.scale["n_jobs"]))
        t1 = time.time()
        done = refit_from_stats(res["estimator"], self.stats)
        self.info = {"statistics_wall_s": round(t1 - t0, 2), "refit_wall_s": round(time.time() - t1, 2), **done}
        log.info("%s chain: statistics of %d parts in %.1f s (%s); refitted from them: %s; kept from the sample: %s",
                 kind.name, len(self.parts), t1 - t0, self.scale["mode"], done["refitted"], done["kept"])

    def report(self, kind, table, chain_meta: dict, n_depths: int) -> list[dict]:
        """Overwrite the chain's validation and test metrics and sample counts with those of every part;
        returns the test rows (the summary's)."""
        chain_meta["sample_n_samples"] = chain_meta["n_samples"]
        chain_meta["n_samples"] = {s: int(self.stats["n"][i].sum()) for i, s in enumerate(("train", "val", "test"))}
        chain_meta["val"] = per_depth_from_stats(self.stats, self.spec, "val", table)
        chain_meta["test"] = per_depth_from_stats(self.stats, self.spec, "test", table)
        chain_meta["statistics"] = {"bins": self.spec.bins, "cells": self.spec.cells, **self.info}
        return chain_meta["test"]

    def meta(self) -> dict:
        """tables.json ``scale``."""
        return {"mode": self.scale["mode"], "parts": len(self.parts), "rounds": self.rounds, **self.sample}


def _check(scale: dict) -> None:
    """Refuse a ``scale`` setting by its dotted key, with the values it may take."""
    from calib.metrics import ECE_BINS

    if scale["mode"] not in ("memory", "stream", "ray"):
        raise ValueError(f"scale.mode={scale['mode']!r}: expected memory, stream or ray")
    for key, low in (("sample_rounds", 1), ("bins", ECE_BINS), ("n_jobs", 1), ("fit_jobs", 1)):
        v = scale[key]
        if isinstance(v, bool) or not isinstance(v, int) or v < low or (key == "bins" and v % ECE_BINS):
            raise ValueError(f"scale.{key}={v!r}: expected an integer >= {low}"
                             + (f", a multiple of {ECE_BINS} (the ECE bins)" if key == "bins" else ""))


@contextlib.contextmanager
def streamed(cfg: dict, judged_only: bool):
    """``(sample bank, Refiner)`` for ``cfg``'s banks and fleets (validated as one, :func:`bank_parts`); the
    sample's folder is removed on exit."""
    scale = {**SCALE_DEFAULTS, **(cfg.get("scale") or {})}
    _check(scale)
    t0 = time.time()
    parts = bank_parts(cfg["data"]["train"], check=True)
    rounds = sum(part_rounds(p) for p in parts)
    target, seed = int(scale["sample_rounds"]), int(scale["seed"])
    tmp = Path(tempfile.mkdtemp(prefix="calib-sample-"))
    try:
        if rounds <= target:
            sample = {"sample_rounds": rounds, "sample_fraction": 1.0}
            bank = load(parts, judged_only=judged_only)
        else:
            fraction = target / rounds
            written, n = [], 0
            outs = [tmp / f"part-{i:05d}" for i in range(len(parts))]
            got = in_order(_sample_part, [(p, o, fraction, seed) for p, o in zip(parts, outs)], int(scale["n_jobs"]))
            for out, k in zip(outs, got):
                if k:
                    written.append(out)
                    n += k
            if not written:
                raise ValueError(f"scale.sample_rounds={target}: the sample of whole prompts holds no round of "
                                 f"the {rounds} rounds; raise it")
            sample = {"sample_rounds": n, "sample_fraction": round(fraction, 6), "sample_seed": seed}
            bank = load(written, validate_on_open=False, judged_only=judged_only)  # write_bank validated them
        sample["listing_and_sample_wall_s"] = round(time.time() - t0, 2)
        log.info("%d parts, %d rounds; fitting on a sample of %d rounds of whole prompts (%.1f s)", len(parts),
                 rounds, sample["sample_rounds"], time.time() - t0)
        yield bank, Refiner(cfg, parts, rounds, sample, judged_only)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
