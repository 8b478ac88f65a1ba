"""Exported tables on disk: ``tables.safetensors`` + ``tables.json``, written atomically, verified on load.

``tables.safetensors`` holds, per chain ``<name>`` the tables calibrate (:mod:`calib.chains`), the
tensors of its :class:`calib.tables.layout.ChainTable`:

=================  ================  =========================================================
name               dtype, shape      meaning
=================  ================  =========================================================
<name>.grid        float32 [D, C]    P(accept at depth k | reached) per cell (and grid point)
<name>.edges       float32 [A_b, E]  inner bin edges of the chain's binned axes, +inf padded
<name>.strides     int64 [A_b]       cell = Σ_a bucket_a · stride_a
=================  ================  =========================================================

``tables.json`` carries ``schema_version``, ``tensors_sha256`` (of the tensor file), ``json_sha256``
(of the JSON's own content, see :func:`json_digest`), ``target_models`` (the target models of the
banks fitted on), ``chains`` (per chain: its registry ``id`` = the allocator's ``drafter`` value,
``axes`` = the input features in the order an engine passes them, with their edges or grid points,
``ids`` of the drafters fitted on, ``k`` = the drafted depth the tables cover, the estimator and its
metrics), ``banks`` (identity of the banks fitted on: path, ``acceptance_sha256``, rounds; eval uses
the fingerprint to tell a training bank from an unseen one), ``split``, ``calib_version`` and
``git_commit``.

:func:`load` refuses tables whose schema version, tensor checksum or JSON digest is off: an edited
feature order or bin edge changes what the tensors mean without any error downstream, so tables
are re-exported, never edited. :meth:`Tables.check_bank` refuses a bank the tables do not fit
(target model, drafter, depth, n-gram features), naming both sides.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import warnings
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from calib.atomic import atomic_path, write_text_atomic
from calib.chains import CONTEXT, Axis
from calib.tables.layout import ChainTable, GridTables

# 2: tables.json carries json_sha256 (its own digest), target_models and per-chain ids / k.
# 3: one layout per registered chain (<name>.grid/.edges/.strides), tables.json lists `chains` with
#    their registry id and axes (was: drafters + ngram_features and four fixed tensor names).
SCHEMA_VERSION = 3
TENSORS = "tables.safetensors"
META = "tables.json"
PARTS = ("grid", "edges", "strides")  # a chain's tensors: "<chain>.<part>"


class TablesError(ValueError):
    """Tables that cannot be trusted (wrong schema version, checksum mismatch, missing pieces) or that
    do not fit the bank they are applied to."""


class TablesWarning(UserWarning):
    """A tables/bank cross-check that could not be made (the bank or the tables do not record it)."""


class Tables(GridTables):
    """Loaded tables: the allocator's :class:`GridTables` plus their metadata.

    Attributes:
        meta: the content of ``tables.json``.
        path: the tables folder (set by :func:`load`; None for tables built in memory), named in errors.
        reuse_last_row: see :mod:`calib.tables.layout`; saved in tables.json and restored by :func:`load`.
    """

    def __init__(self, chains: dict, meta: dict | None = None, path: str | os.PathLike | None = None,
                 reuse_last_row: bool = False):
        super().__init__(chains, reuse_last_row=bool(reuse_last_row))
        self.meta = dict(meta or {})
        self.path = None if path is None else Path(path)

    @property
    def target_models(self) -> list[str] | None:
        """Target models of the banks the tables were fitted on (None: not recorded)."""
        t = self.meta.get("target_models")
        return None if t is None else list(t)

    def chain_depth(self, chain: str) -> int | None:
        """The drafted depth K the tables cover for ``chain`` (a chain name): the recorded ``k``
        (the training banks' drafted width), else the rows of its grid, or None (any depth) for
        tables without a record that say ``reuse_last_row``."""
        k = self.meta.get("chains", {}).get(chain, {}).get("k")
        if k is not None:
            return int(k)
        if self.reuse_last_row:
            return None
        return self.table(chain).depths

    def check_bank(self, bank, path: str | os.PathLike | None = None) -> list[str]:
        """Refuse a bank these tables were not fitted for; return (and warn) what could not be checked.

        ``bank`` is a bank folder, a :class:`calib.bank.Bank` (each of its folders is checked) or a
        bank's ``run_manifest.json`` content as a dict (then ``path`` names it in messages). Checked:

        - the bank's target model (manifest ``model``) is one the tables were fitted for;
        - the tables calibrate the bank's verified chain (the n-gram chain for ``speculator: ngram``,
          else the model drafter), and for the model drafter the bank's ``speculator`` is one of the
          tables' drafter ids (EAGLE tables on a draft_model bank are refused);
        - the bank's drafted depth K (acceptance.parquet width; manifest ``num_speculative_tokens``
          for a dict) is at most the tables' K for that chain: a deeper bank would read its extra
          depths from the last row, fitted on another depth. A shallower bank is fine (its depths
          are all calibrated, and acceptance at depth d does not depend on how deep drafting goes);
        - every other chain the tables calibrate that the bank records (the n-gram chain of a model
          bank; any registered kind, by its ``drafted_depth`` hook): its depth; for the n-gram chain
          also the tables' feature columns (its axes, in ngram.parquet).

        Where the bank's manifest lacks ``model`` or ``speculator``, or the tables do not record a
        field, that check is skipped with a :class:`TablesWarning` naming it.

        Raises:
            TablesError: listing every mismatch with the tables folder, the bank path and both values.
        """
        if hasattr(bank, "paths") and hasattr(bank, "manifests"):  # a calib.bank.Bank: check each folder
            return [w for p in bank.paths for w in self.check_bank(p)]
        facts = _bank_facts(bank, path)
        tdir = str(self.path) if self.path is not None else "(tables not loaded from a folder)"
        bdir = facts["path"]
        drafters = self.meta.get("chains", {})
        problems, notes = [], []

        model, targets = facts["model"], self.target_models
        if model is None:
            notes.append(f"bank {bdir}: run_manifest.json records no `model`; cannot check that it was "
                         f"collected with the target the tables {tdir} were fitted for "
                         f"({targets if targets is not None else 'not recorded either'})")
        elif targets is None:
            notes.append(f"tables {tdir}: tables.json records no target_models; cannot check the bank "
                         f"{bdir}'s target {model!r}")
        elif model not in targets:
            problems.append(f"target model: tables {tdir} were fitted for {targets}, bank {bdir} was "
                            f"collected with {model!r}")

        spec, chain = facts["speculator"], facts["chain"]
        if chain is None:
            notes.append(f"bank {bdir}: run_manifest.json records no `speculator`; cannot check its "
                         f"drafter against the tables {tdir} ({self._ids_text()})")
        elif chain not in drafters:
            problems.append(f"drafter: tables {tdir} calibrate {sorted(drafters) or 'no drafter'}, bank {bdir}'s "
                            f"verified chain is the {chain} drafter ({spec!r})")
        else:
            ids = drafters[chain].get("ids")
            if _has_confidence(chain):  # a model drafter: its speculator name must be one fitted on
                if ids is None:
                    notes.append(f"tables {tdir}: tables.json records no model drafter ids; cannot check the "
                                 f"bank {bdir}'s speculator {spec!r}")
                elif spec not in ids:
                    problems.append(f"drafter: tables {tdir} were fitted for the model drafter(s) {list(ids)}, "
                                    f"bank {bdir} was drafted by {spec!r}")
            k_bank, k_tab = facts["k"], self.chain_depth(chain)
            if k_bank is not None and k_tab is not None and k_bank > k_tab:
                problems.append(f"depth: tables {tdir} cover {chain}-drafter depths 0..{k_tab - 1} (K={k_tab}), "
                                f"bank {bdir} drafts K={k_bank}; depths {k_tab}..{k_bank - 1} would silently "
                                f"reuse depth {k_tab - 1}'s calibration")

        for other in drafters:  # the other chains a bank records (the n-gram chain of a model bank, ...)
            k_bank, k_tab = facts["chain_k"].get(other), self.chain_depth(other) if other in self.chains else None
            if other != chain and k_bank and k_tab is not None and k_bank > k_tab:
                problems.append(f"depth: tables {tdir} cover {other}-chain depths 0..{k_tab - 1} (K={k_tab}), bank "
                                f"{bdir}'s {other} chain is {k_bank} deep")
        if "ngram" in drafters and (facts["has_ngram"] or chain == "ngram"):
            # context axes (temperature, ...) are read from the verified rounds, not ngram.parquet
            cols = facts["ngram_columns"]
            feats = [f for f in self.feature_names("ngram") if f not in CONTEXT]
            if cols is not None:
                missing = [f for f in feats if f not in cols]
                if missing:
                    problems.append(f"n-gram features: tables {tdir} read {feats}, bank {bdir}'s ngram.parquet "
                                    f"lacks {missing}")

        if problems:
            raise TablesError("tables and bank do not match:\n  - " + "\n  - ".join(problems)
                              + "\nuse tables fitted on banks of this target and drafter (python train.py "
                              "data.train=[BANK,...] out_dir=DIR), or evaluate the banks these tables were fitted for")
        for n in notes:
            warnings.warn(n, TablesWarning, stacklevel=2)
        return notes

    def _ids_text(self) -> str:
        d = self.meta.get("chains", {})
        return "; ".join(f"{c}: {d[c].get('ids', 'ids not recorded')}" for c in sorted(d)) or "no drafter"

    def has_chain(self, chain: str) -> bool:
        """Whether these tables calibrate ``chain`` (a chain name)."""
        return chain in self.chains

    def feature_names(self, chain: str) -> list[str]:
        """The input features of ``chain``'s table, in the order an engine passes them ([] if absent)."""
        return [a.name for a in self.chains[chain].axes] if chain in self.chains else []

    def accept_prob(self, chain: str, inputs, depth: int | None = None) -> torch.Tensor:
        """Calibrated P(accept | reached) of ``chain`` for ``inputs`` [rounds, L, A] (or [rounds, L] for a
        one-axis chain; column = depth), NaN kept.

        With ``depth`` given, ``inputs`` is any shape ``[..., A]`` (``[...]`` for one axis) and every
        row is read at that depth, which must be one the tables hold (``0 <= depth < D``; any
        ``depth >= 0`` when ``reuse_last_row``). Inputs are float tensors, numpy arrays or lists
        (converted to float32); confidences are probabilities in ``[0, 1]`` (NaN = no token); anything
        else is a ``ValueError``. Returns float32 ``[rounds, L]`` (with ``depth``: ``inputs``' leading shape).
        """
        from calib.tables.layout import as_float_tensor

        table = self.table(chain)
        if depth is None:
            return table.lookup(inputs, chain)
        x = as_float_tensor(inputs, chain)
        n_depths = table.depths
        if isinstance(depth, bool) or not isinstance(depth, (int, np.integer)):
            raise TypeError(f"depth must be an int, got {depth!r}")
        if depth < 0 or (depth >= n_depths and not self.reuse_last_row):
            raise ValueError(f"depth={depth}: these tables hold {chain} depths 0..{n_depths - 1} "
                             f"({chain}.grid is [D={n_depths}, C]); deeper depths need tables fitted on "
                             "them, or tables built with reuse_last_row=True")
        one_axis = len(table.axes) == 1
        lead = x.shape if one_axis else x.shape[:-1]
        flat = x.reshape(-1, 1, *(() if one_axis else (x.shape[-1],)))
        row = ChainTable(table.axes, table.grid[min(int(depth), n_depths - 1)][None, :], table.edges, table.strides)
        return row.lookup(flat, chain).reshape(lead)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def bank_fingerprint(bank_dir: str | os.PathLike) -> str:
    """A bank's content fingerprint: the sha256 of its acceptance.parquet (``banks[].acceptance_sha256``
    in tables.json). The same bank copied or moved elsewhere keeps it."""
    from calib.bank import schema

    return _sha256(Path(bank_dir) / schema.ACCEPTANCE)


def json_digest(meta: dict) -> str:
    """sha256 of ``meta`` without its ``json_sha256`` field, as canonical JSON (sorted keys, no spaces).

    Computed on the JSON as written (numbers already plain floats/ints), so a reader re-parsing the
    file gets the same digest; it covers ``tensors_sha256`` too, so one digest vouches for the pair.
    """
    body = {k: v for k, v in meta.items() if k != "json_sha256"}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(text.encode()).hexdigest()


def _has_confidence(chain: str) -> bool:
    """Whether ``chain`` is a registered kind with a raw confidence (a model drafter, named by its
    speculator)."""
    from calib.chains import chain as kind
    from calib.chains import chain_names

    return chain in chain_names() and kind(chain).confidence is not None


def _bank_facts(bank, path=None) -> dict:
    """What :meth:`Tables.check_bank` compares: from a bank folder (manifest + parquet schemas) or a
    manifest dict."""
    import pyarrow.parquet as pq

    from calib.bank import schema

    if isinstance(bank, dict):
        man, folder = bank, None
        where = str(path) if path is not None else "(a run_manifest.json given as a dict)"
    else:
        folder = Path(bank)
        where = str(folder)
        f = folder / schema.MANIFEST
        man = json.loads(f.read_text()) if f.exists() else {}
    spec = man.get("speculator")
    chain = None if spec is None else _verified_chain(spec, man.get("method"))
    ng_man = man.get("ngram_chain") if isinstance(man.get("ngram_chain"), dict) else {}
    facts = {"path": where, "model": man.get("model"), "speculator": spec, "chain": chain,
             "k": man.get("num_speculative_tokens"), "has_ngram": bool(ng_man), "ngram_columns": None,
             "chain_k": {"ngram": ng_man.get("width")}}  # drafted depth per chain the bank records
    if folder is not None:  # the data's own widths beat the manifest's
        from calib.chains import chains

        facts["k"] = schema.width(pq.read_schema(folder / schema.ACCEPTANCE).names) or facts["k"]
        facts["chain_k"] = {kind.name: kind.drafted_depth(folder) for kind in chains()}
        if (folder / schema.NGRAM).exists():
            facts.update(has_ngram=True, ngram_columns=set(pq.read_schema(folder / schema.NGRAM).names))
        else:
            facts["has_ngram"] = False
    return facts


def _verified_chain(speculator: str, method: str | None) -> str:
    """The chain a bank's engine verified: a model-free chain kind named by the speculator (or vLLM's
    method), else the (first registered) chain with a raw confidence, the model drafter."""
    from calib.chains import chains

    for kind in chains():
        if kind.confidence is None and kind.name in (speculator, method):
            return kind.name
    return next(k.name for k in chains() if k.confidence is not None)


def git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], check=False, capture_output=True, text=True, timeout=5,
                             cwd=Path(__file__).resolve().parent)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def save(out_dir: str | os.PathLike, tables: GridTables, meta: dict) -> Path:
    """Write ``tables.safetensors`` + ``tables.json`` into ``out_dir``, each via a temp file + rename.

    The tensor file goes in first and the JSON (which carries the tensor file's checksum) last, so
    a reader sees the old pair, the new pair, or (killed between the two renames) a pair that
    :func:`load` refuses by checksum, never a silent mix. For the pair *and* what goes with it
    (summary, pictures) to land as one unit, save into a staging folder and publish that
    (:func:`calib.atomic.staged_output`, as ``train.py`` does). Files get mode 0644.
    """
    from calib import __version__

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors, chain_meta = {}, {k: dict(v) for k, v in (meta.get("chains") or {}).items()}
    for name, table in tables.chains.items():
        for part in PARTS:
            tensors[f"{name}.{part}"] = getattr(table, part).detach().cpu().contiguous().to(
                torch.int64 if part == "strides" else torch.float32)
        entry = chain_meta.setdefault(name, {})
        entry["axes"] = [a.to_json() for a in table.axes]
        entry.setdefault("id", _chain_id(name))
    meta = {**meta, "chains": chain_meta}
    with atomic_path(out / TENSORS) as tmp:
        save_file(tensors, tmp, metadata={"schema_version": str(SCHEMA_VERSION)})
        full = {"schema_version": SCHEMA_VERSION, "calib_version": __version__, "git_commit": git_commit(),
                **meta, "reuse_last_row": bool(getattr(tables, "reuse_last_row", False)),
                "tensors_sha256": _sha256(tmp),
                "shapes": {n: list(t.shape) for n, t in tensors.items()}}
    full.pop("json_sha256", None)
    full = json.loads(json.dumps(full, default=float))  # the digest is over what a reader parses back
    full["json_sha256"] = json_digest(full)
    write_text_atomic(out / META, json.dumps(full, indent=2, sort_keys=True) + "\n")
    return out


def load(path: str | os.PathLike) -> Tables:
    """Load and verify tables from a folder (or its ``tables.json``); refuse anything off."""
    d = Path(path)
    if d.name == META:
        d = d.parent
    meta_path, tensor_path = d / META, d / TENSORS
    for p in (meta_path, tensor_path):
        if not p.exists():
            raise TablesError(f"{p} not found: a tables folder holds {TENSORS} and {META} "
                              "(written by `python train.py out_dir=...`)")
    try:
        meta = json.loads(meta_path.read_text())
    except json.JSONDecodeError as exc:
        raise TablesError(f"{meta_path}: not valid JSON ({exc})") from exc
    version = meta.get("schema_version")
    if version != SCHEMA_VERSION:
        raise TablesError(f"{meta_path}: schema_version {version!r}, this calib reads {SCHEMA_VERSION}; "
                          "re-export the tables with this calib version (python train.py out_dir=DIR)")
    recorded, actual = meta.get("json_sha256"), json_digest(meta)
    if actual != recorded:
        raise TablesError(f"{meta_path}: content sha256 {actual[:12]}… does not match its json_sha256 "
                          f"({str(recorded)[:12]}…): tables.json was edited after export. A changed feature "
                          "order, edge or depth changes what the tensors mean without any other error; "
                          "re-export the tables (python train.py out_dir=DIR overwrite=true) instead of "
                          "editing them")
    digest = _sha256(tensor_path)
    if digest != meta.get("tensors_sha256"):
        raise TablesError(f"{tensor_path}: sha256 {digest[:12]}… does not match tables.json "
                          f"({str(meta.get('tensors_sha256'))[:12]}…); the files are from different "
                          "exports or were modified; re-export the tables (python train.py out_dir=DIR)")
    tensors = load_file(tensor_path)
    chain_tables = {}
    for name, entry in (meta.get("chains") or {}).items():
        missing = [f"{name}.{p}" for p in PARTS if f"{name}.{p}" not in tensors]
        if missing:
            raise TablesError(f"{tensor_path}: missing tensors {missing}")
        try:
            chain_tables[name] = ChainTable(tuple(Axis.from_json(a) for a in entry["axes"]),
                                            *(tensors[f"{name}.{p}"] for p in PARTS))
        except (KeyError, TypeError, ValueError) as exc:
            raise TablesError(f"{d}: chain {name!r}: its axes in tables.json do not describe its tensors "
                              f"({exc}); re-export the tables") from exc
    return Tables(chain_tables, meta=meta, path=d, reuse_last_row=meta.get("reuse_last_row", False))


def _chain_id(name: str) -> int | None:
    """The registry id of chain ``name`` (None for a chain kind this process has not registered)."""
    from calib.chains import chain

    try:
        return chain(name).id
    except KeyError:
        return None
