"""``collect.py``'s job: run vLLM over a prompt set with capture on, in durable parts, into a bank.

A run folder holds ``parts/part-NNNNN/`` (each a small bank, visible only once complete: it is
written under a temp name, validated, marked ``_SUCCESS`` and renamed), ``collect_config.json``
(the config and its hash: a rerun with another config refuses to mix parts) and, at the end,
``bank/`` — the union of the parts with its manifest and stats. A killed run resumes by skipping
finished parts; Ctrl-C says how many parts are kept and the command that resumes (exit code 130).

Every setting comes from the resolved config, routing capture included (``routing.capture``,
``routing.shadow_router``), so all of it enters the run's hash. vLLM's processes receive the settings
they need through environment variables that :func:`_engine` writes from that config
(:func:`calib.vllm.engine.build_engine`: an inherited value is overwritten and named in a warning).
Progress moves once per finished prompt (vLLM's per-request completion), while parts stay the unit of
durability.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa
from tqdm.auto import tqdm
from tqdm.std import tqdm as plain_tqdm

from calib.atomic import write_json_atomic
from calib.bank import load, write_bank
from calib.chains import recomputed_chains
from calib.collect.assemble import RunKeys, build_tables, engine_request_prefix, read_capture, reconcile
from calib.fingerprint import identity
from calib.params import finite_number
from calib.prompts import encode_chat, load_prompts
from calib.sidefiles import field, read_json
from calib.vllm.engine import (  # capture hooks V1 with sync scheduling
    SYNC_SCHEDULING,
    V1_RUNNER,
    build_engine,
    chosen_dtype,
    cpu_dtype,
    speculative_config,
)

log = logging.getLogger("calib.collect")

SUCCESS = "_SUCCESS"
# Config keys that do not change what is collected (excluded from the run's hash).
_NOT_HASHED = ("out_dir", "progress", "overwrite")
# Variables written for vLLM's processes that mirror a user setting: an inherited value that differs
# is named in a warning (it used to win silently).
_CONFIG_OF_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "engine.in_process", "VLLM_CPU_KVCACHE_SPACE": "engine.kv_cache_gb",
                  "CALIB_ROUTING": "routing.capture", "CALIB_SHADOW_ROUTER": "routing.shadow_router"}


def config_hash(cfg: dict) -> str:
    payload = {k: v for k, v in cfg.items() if k not in _NOT_HASHED}
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:16]


class RunFolder:
    """Parts bookkeeping for one run folder."""

    def __init__(self, out_dir: str | os.PathLike, cfg: dict):
        self.dir = Path(out_dir)
        self.parts = self.dir / "parts"
        self.cfg = cfg
        self.hash = config_hash(cfg)
        self.identity: dict | None = None  # the run's target/drafter fingerprints (calib.fingerprint.identity)

    # What a collect run writes in its out_dir (``capture/`` is emptied at each start).
    OWN = ("collect_config.json", "parts", "capture", "bank", "outputs.json", "timing.json")

    def open(self) -> None:
        state = self.dir / "collect_config.json"
        if not state.exists() and self.dir.is_dir() and any(self.dir.iterdir()):
            held = sorted(p.name for p in self.dir.iterdir())
            shown = ", ".join(held[:8]) + (f" and {len(held) - 8} more" if len(held) > 8 else "")
            raise FileExistsError(
                f"out_dir {self.dir} is not empty ({shown}) and holds no collect_config.json, so it is not a "
                f"collect.py run folder; collect writes {', '.join(self.OWN)} there (and empties capture/): "
                "choose a new or empty out_dir")
        if state.exists():
            old = read_json(state, hint=f"it records the config of the parts in {self.parts}: restore it, "
                                        f"or use a new out_dir, or delete {self.dir} to start over")
            if old.get("hash") != self.hash:
                raise RuntimeError(
                    f"{self.dir} holds parts collected with another config (hash {old.get('hash')}, "
                    f"this run {self.hash}); refusing to mix them. Use a new out_dir, or delete "
                    f"{self.dir} to start over.")
        self.parts.mkdir(parents=True, exist_ok=True)
        write_json_atomic(state, {"hash": self.hash, "config": self.cfg})
        for stale in self.parts.glob(".part-*"):  # a part that was being written when killed
            shutil.rmtree(stale, ignore_errors=True)

    def part_dir(self, i: int) -> Path:
        return self.parts / f"part-{i:05d}"

    def done(self, i: int) -> bool:
        return (self.part_dir(i) / SUCCESS).exists()

    def write_part(self, i: int, tables: tuple[pa.Table, pa.Table, pa.Table], info: dict) -> None:
        final = self.part_dir(i)
        tmp_parent = Path(tempfile.mkdtemp(prefix=f".part-{i:05d}.", dir=self.parts))
        try:
            manifest = {"part": i, **info, **({"identity": self.identity} if self.identity else {})}
            bank = write_bank(tmp_parent / "bank", *tables, manifest=manifest)
            (bank / SUCCESS).write_text(json.dumps(info))
            os.replace(bank, final)
        finally:
            shutil.rmtree(tmp_parent, ignore_errors=True)

    def finished_parts(self) -> list[Path]:
        return sorted(p for p in self.parts.glob("part-*") if (p / SUCCESS).exists())


def check_config(cfg: dict) -> None:
    """Refuse a config the run cannot honour, before anything is loaded; errors name the key and the
    values it takes."""
    def fail(msg):
        raise ValueError(f"collect config: {msg}")

    for key in ("capture", "reconcile", "progress"):
        if not isinstance(cfg.get(key, True), bool):
            fail(f"{key}={cfg[key]!r}: expected true or false")
    for key in ("part_size", "concurrency"):
        if not isinstance(cfg.get(key), int) or isinstance(cfg.get(key), bool) or cfg[key] < 1:
            fail(f"{key}={cfg.get(key)!r}: expected a whole number >= 1")
    seed = cfg.get("seed", 0)
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        fail(f"seed={seed!r}: expected a whole number >= 0")
    sampling = cfg["sampling"]
    temperature, top_p = sampling.get("temperature"), sampling.get("top_p", 1.0)
    if not finite_number(temperature) or temperature < 0:  # NaN passed `< 0` and was recorded as the bank's T
        fail(f"sampling.temperature={temperature!r}: expected a finite number >= 0 (0: greedy)")
    if not finite_number(top_p) or not 0 < top_p <= 1:
        fail(f"sampling.top_p={top_p!r}: expected a number in (0, 1]")
    max_tokens = sampling.get("max_tokens")
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        fail(f"sampling.max_tokens={max_tokens!r}: expected a whole number >= 1")
    path = (cfg.get("model") or {}).get("path")
    if path is not None:
        if not isinstance(path, str) or not path.strip():
            fail(f"model.path={path!r}: expected an HF model folder or a hub id (org/name) cached locally, or null "
                 "for the embedded SmolLM2-135M-Instruct")
        from calib.target import resolve_target

        try:  # before the prompts and the engine: a target that is not there is the first thing said
            resolve_target(path, cfg.get("root", "."))
        except (FileNotFoundError, ValueError) as exc:
            fail(str(exc))
    routing = cfg.get("routing") or {}
    unknown = sorted(set(routing) - {"capture", "shadow_router"})
    if unknown:
        fail(f"routing.{unknown[0]} is not a setting; routing takes capture (true/false) and shadow_router "
             "(null or a folder)")
    if not isinstance(routing.get("capture", False), bool):
        fail(f"routing.capture={routing['capture']!r}: expected true or false")
    router = routing.get("shadow_router")
    if router is not None:
        if not routing.get("capture"):
            fail("routing.shadow_router is set but routing.capture is false: shadow routing is a routing "
                 "capture, set routing.capture=true too (or shadow_router=null)")
        folder = _shadow_router_dir(cfg)
        missing = [f for f in ("router.safetensors", "router.json") if not (folder / f).exists()]
        if missing:
            fail(f"routing.shadow_router={router!r}: {folder} lacks {', '.join(missing)}; build a router with "
                 "`python -m calib.moe stage=moefy` (default data/routing/smollm2-moefied/router)")


def _shadow_router_dir(cfg: dict) -> Path | None:
    router = (cfg.get("routing") or {}).get("shadow_router")
    if router is None:
        return None
    path = Path(router)
    return (path if path.is_absolute() else Path(cfg.get("root", ".")) / path).resolve()


def resume_command(argv: list[str] | None = None) -> str:
    """This process's command line, shell-quoted: running it again resumes the run (same config, same
    out_dir; finished parts are skipped)."""
    exe = sys.executable
    rel = os.path.relpath(exe) if os.path.isabs(exe) else exe
    if not rel.startswith(".."):  # `.venv/bin/python` reads better than an absolute path
        exe = rel
    return shlex.join([exe, *(sys.argv if argv is None else argv)])


def run(cfg: dict, command: str | None = None) -> Path | None:
    """Collect a bank as ``cfg`` (the resolved collect config) says; return the bank folder.

    With ``capture: false`` the engine runs plain (for overhead and output-identity checks): the
    outputs and timing are written, no bank (returns None). The prompts and the config are checked
    before the model loads. Ctrl-C prints one line (parts kept, ``command``: by default this
    process's command line, which resumes) and exits with code 130.
    """
    check_config(cfg)
    prompts = load_prompts(cfg["prompts"]["files"], cfg["prompts"].get("limit_per_file"),
                           root=cfg.get("root", "."))
    folder = RunFolder(cfg["out_dir"], cfg)
    try:
        return _collect(cfg, prompts, folder)
    except KeyboardInterrupt:
        part_size = int(cfg["part_size"])
        n_parts = (len(prompts) + part_size - 1) // part_size
        kept = len(folder.finished_parts()) if folder.parts.exists() else 0
        print(f"interrupted: {kept} of {n_parts} parts kept in {folder.dir}; resume with: "
              f"{command or resume_command()}", file=sys.stderr, flush=True)
        raise SystemExit(130) from None


def _per_request_progress(bar):
    """A ``use_tqdm`` factory for ``LLM.generate`` that moves ``bar`` once per finished request.

    vLLM calls the factory twice: with the prompt list to render (a positional iterable: returned
    as is, no bar) and with ``total=`` for its engine loop, whose bar is updated as each request
    finishes. That inner bar writes to a buffer nobody reads and forwards every update to ``bar``.
    """
    class _Forward(plain_tqdm):
        def update(self, n=1):
            bar.update(n)
            return super().update(n)

    def factory(*args, **kwargs):
        if args:
            return args[0]
        kwargs.pop("dynamic_ncols", None)  # no terminal behind the buffer
        return _Forward(file=io.StringIO(), **kwargs)

    return factory


def _collect(cfg: dict, prompts: list, folder: RunFolder) -> Path | None:
    from calib.target import target_dir

    t_start = time.time()
    spec_cfg, sampling = cfg["speculative"], cfg["sampling"]
    folder.open()

    cache_dir = Path(cfg["model"]["cache_dir"]) if cfg["model"].get("cache_dir") else None
    # model.path (a folder or a cached hub id) or the embedded SmolLM2 GGUF; its name is for messages only
    model_dir, model_name = target_dir(cfg["model"], cfg.get("root", "."))
    spec, speculator = speculative_config(spec_cfg, model_dir, cache_dir)
    if spec is None:
        cfg = {**cfg, "capture": False}
    k = int(spec_cfg["num_speculative_tokens"])
    # by content, not by folder name: what check_bank and serving compare (calib/fingerprint.py)
    folder.identity = identity(model_dir, (spec or {}).get("model"), spec_cfg["method"], k)
    if folder.identity["target"] is not None:
        folder.identity["target"]["name"] = model_name  # a hub id's snapshot folder is a commit hash
    ng = spec_cfg.get("ngram") or {}
    ngram_params = (int((spec or {}).get("prompt_lookup_min", ng.get("min_n", 1))),
                    int((spec or {}).get("prompt_lookup_max", ng.get("max_n", 4))), int(ng.get("k", k)))
    capture_dir = Path(cfg["out_dir"]) / "capture"
    temperature = float(sampling["temperature"])
    keys = RunKeys(model=model_name, speculator=speculator,
                   config=f"{spec_cfg['name']}-k{k}-t{temperature:g}", width=k,
                   chain_width=ngram_params[2],  # the engine drafts a recomputed chain: its labels are verified
                   chain_verified=any(c.name == speculator for c in recomputed_chains()),
                   temperature=temperature)

    part_size = int(cfg["part_size"])
    n_parts = (len(prompts) + part_size - 1) // part_size
    todo = [i for i in range(n_parts) if not folder.done(i)]
    log.info("%d prompts in %d parts; %d to do", len(prompts), n_parts, len(todo))
    if todo:
        shutil.rmtree(capture_dir, ignore_errors=True)  # records of a killed run are not reused
        llm, tokenizer = _engine(cfg, model_dir, spec, capture_dir, ngram_params)
        from vllm import SamplingParams

        progress = bool(cfg.get("progress", True))
        done_prompts = len(prompts) - sum(len(prompts[i * part_size: (i + 1) * part_size]) for i in todo)
        # closed on any exit, so a Ctrl-C message starts on a line of its own
        with tqdm(total=len(prompts), desc=f"collect {keys.config}", unit="prompt", initial=done_prompts,
                  disable=not progress) as bar:
            for i in todo:
                batch = prompts[i * part_size: (i + 1) * part_size]
                token_ids = [encode_chat(tokenizer, p.messages) for p in batch]
                params = [SamplingParams(temperature=temperature, top_p=float(sampling.get("top_p", 1.0)),
                                         max_tokens=int(sampling["max_tokens"]),
                                         seed=int(cfg["seed"]) + p.idx if temperature > 0 else None)
                          for p in batch]
                t0 = time.time()
                outputs = llm.generate([{"prompt_token_ids": t} for t in token_ids], params,
                                       use_tqdm=_per_request_progress(bar) if progress else False)
                wall = time.time() - t0
                info = _finish_part(folder, i, batch, token_ids, outputs, capture_dir, keys, wall,
                                    capture_on=bool(cfg.get("capture", True)),
                                    reconcile_on=bool(cfg.get("reconcile", True)))
                done_prompts += len(batch)
                if bar.n < done_prompts:  # vLLM reported fewer requests (or the bar is off): catch up
                    bar.update(done_prompts - bar.n)
                bar.set_postfix(rounds=info["n_rounds"], tok_s=f"{info['output_tokens'] / wall:.1f}")
        del llm
    return _merge(folder, cfg, keys, spec, model_dir, time.time() - t_start)




def _engine(cfg, model_dir, spec, capture_dir, ngram_params):
    capture = bool(cfg.get("capture", True))
    routing = capture and bool((cfg.get("routing") or {}).get("capture", False))
    log.info("collect: vLLM's V1 model runner with sync scheduling (VLLM_USE_V2_MODEL_RUNNER=0, "
             "async_scheduling=False): the runner calib's capture hooks")
    dtype, why = engine_dtype(cfg, model_dir)
    log.info("collect: %s", why)
    llm = build_engine(
        model_dir, {**cfg["engine"], "dtype": dtype}, max_num_seqs=int(cfg["concurrency"]), seed=int(cfg["seed"]),
        env={  # the config wins over inherited variables (vLLM's processes read these)
            "VLLM_ENABLE_V1_MULTIPROCESSING": not cfg["engine"]["in_process"],
            "VLLM_CPU_KVCACHE_SPACE": cfg["engine"]["kv_cache_gb"],
            "CALIB_COLLECT_DIR": capture_dir.resolve() if capture else None,
            "CALIB_NGRAM": ngram_params if capture else None,
            "CALIB_ROUTING": routing,
            "CALIB_SHADOW_ROUTER": _shadow_router_dir(cfg) if routing else None,
            "CALIB_CPU_SAMPLING_FIX": True,  # the plugin applies it on CPU builds only
            "CALIB_DTYPE_CHOICE": chosen_dtype(why),  # the engine line says it
            **V1_RUNNER,
        },
        config_of_env=_CONFIG_OF_ENV, speculative_config=spec, **SYNC_SCHEDULING,
        **({"per_request_spec_decode_metrics": "detailed"} if spec else {}))
    return llm, llm.get_tokenizer()


def engine_dtype(cfg: dict, model_dir: Path) -> tuple[str, str]:
    """``(dtype, why)`` the engine collects in: on a CPU, ``auto`` resolved as serve.py resolves it
    (:func:`calib.vllm.engine.cpu_dtype`), so that a bank's acceptance is the served engine's; elsewhere as set.
    The manifest records it (``dtype``); ``auto`` is recorded as the model's own dtype where its config says."""
    requested = str(cfg["engine"].get("dtype", "auto"))
    dtype, why = cpu_dtype(requested) if _is_cpu() else (requested, "as set (engine.dtype)")
    return dtype, why


def recorded_dtype(dtype: str, model_dir: Path) -> str:
    """The dtype a manifest records: ``dtype`` as the engine was given it, ``auto`` read from the model's
    config.json (``torch_dtype``) where it says."""
    if dtype != "auto":
        return dtype
    try:
        conf = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return "auto"
    return str(conf.get("torch_dtype") or conf.get("dtype") or "auto")


def _finish_part(folder, i, batch, token_ids, outputs, capture_dir, keys, wall, capture_on, reconcile_on):
    # The capture files grow over the whole run; request ids are unique, so pick this part's.
    by_prefix = {}
    for rid, recs in (read_capture(capture_dir) if capture_on else {}).items():
        by_prefix.setdefault(engine_request_prefix(rid), []).extend(recs)
    rounds, reference, finals = {}, {}, {}
    for p, ids, out in zip(batch, token_ids, outputs):
        rounds[p.idx] = sorted(by_prefix.get(out.request_id, []), key=lambda r: r["step"])
        m = out.outputs[0].spec_decode_metrics
        reference[p.idx] = (list(m.per_step_accepted), list(m.per_step_drafted)) if m else ([], [])
        finals[p.idx] = list(ids) + list(out.outputs[0].token_ids)
    if capture_on and reconcile_on:
        reconcile(rounds, reference, {p.idx: p.id for p in batch})
    rounds = {idx: r for idx, r in rounds.items() if r}
    cats = {p.idx: p.category for p in batch}
    info = {"prompts": [p.id for p in batch], "n_rounds": sum(map(len, rounds.values())),
            "output_tokens": sum(len(o.outputs[0].token_ids) for o in outputs), "wall_s": wall,
            "outputs": {p.id: o.outputs[0].text for p, o in zip(batch, outputs)}}
    if rounds:
        folder.write_part(i, build_tables(rounds, cats, finals, keys), info)
    else:  # nothing was drafted (e.g. no n-gram ever matched): record the part as done and empty
        folder.part_dir(i).mkdir(parents=True, exist_ok=True)
        (folder.part_dir(i) / SUCCESS).write_text(json.dumps(info))
    return info


def _merge(folder: RunFolder, cfg: dict, keys: RunKeys, spec: dict, model_dir: Path,
           wall: float) -> Path | None:
    import vllm

    infos = [_part_info(p) for p in folder.finished_parts()]
    outputs = {k: v for i in infos for k, v in i.get("outputs", {}).items()}
    write_json_atomic(folder.dir / "outputs.json", outputs)
    out_tokens = sum(i["output_tokens"] for i in infos)
    gen_wall = sum(i["wall_s"] for i in infos)
    write_json_atomic(folder.dir / "timing.json", {
        "output_tokens": out_tokens, "generate_wall_s": gen_wall, "capture": cfg.get("capture", True),
        "tokens_per_s": out_tokens / gen_wall if gen_wall else None})
    if not cfg.get("capture", True):
        print(f"capture off: {out_tokens} tokens at {out_tokens / max(gen_wall, 1e-9):.1f} tok/s "
              f"(outputs in {folder.dir / 'outputs.json'})")
        return None
    parts = [p for p in folder.finished_parts() if (p / "acceptance.parquet").exists()]
    if not parts:
        raise RuntimeError(f"no rounds were collected in {folder.dir}: nothing was drafted")
    bank = load(parts)
    recomputed = [k for k in recomputed_chains() if bank.has(k.bank_file)]
    tables = [bank.table(f) for f in ("acceptance.parquet", "speculator.parquet", *(k.bank_file for k in recomputed))]
    manifest = {
        "model": keys.model, "speculator": keys.speculator, "config": keys.config,
        "engine": "vllm-cpu" if _is_cpu() else "vllm", "engine_version": vllm.__version__,
        "model_runner": "V1", "async_scheduling": False,  # what capture hooks (V1_RUNNER, SYNC_SCHEDULING)
        "dtype": recorded_dtype(engine_dtype(cfg, model_dir)[0], model_dir),  # serving warns at another
        "method": spec["method"], "num_speculative_tokens": keys.width,
        "speculative_config": {k: v for k, v in spec.items() if k != "model"},
        "drafter": Path(spec["model"]).name if "model" in spec else None,
        "identity": folder.identity,  # target/drafter fingerprints, method, K (calib/fingerprint.py)
        **{k.manifest_key: {"width": keys.chain_width, "verified": keys.engine_verifies(k.name),
                            "labels": "verified" if keys.engine_verifies(k.name) else "counterfactual"}
           for k in recomputed if k.manifest_key},
        "sampling": dict(cfg["sampling"]), "seed": cfg["seed"], "concurrency": cfg["concurrency"],
        "prompt_set": cfg["prompts"]["name"], "prompt_files": list(cfg["prompts"]["files"]),
        "categories": sorted({c for c in tables[0].column("category").to_pylist()}),
        "n_prompts": sum(len(i["prompts"]) for i in infos),
        "output_tokens": out_tokens, "generate_wall_s": round(gen_wall, 2),
        "wall_time_s": round(wall, 2), "config_hash": folder.hash,
        "calib_version": _calib_version(), "extensions": ["tok", "entropy", "margin", "batch_size",
                                                          "temperature", *(k.bank_file for k in recomputed)],
    }
    out = write_bank(folder.dir / "bank", *tables, manifest=manifest, overwrite=True)
    _summary(out, manifest)
    return out


def _part_info(part: Path) -> dict:
    """A finished part's ``_SUCCESS`` record (JSON), its fields type-checked, naming the file."""
    hint = f"delete the part folder {part} and rerun to collect it again"
    info = read_json(part / SUCCESS, hint=hint)
    field(info, "prompts", list, part / SUCCESS, required=True, hint=hint)
    field(info, "output_tokens", int, part / SUCCESS, required=True, hint=hint)
    info["wall_s"] = field(info, "wall_s", float, part / SUCCESS, required=True, hint=hint)
    field(info, "outputs", dict, part / SUCCESS, default={}, hint=hint)
    return info


def _summary(bank_dir: Path, manifest: dict) -> None:
    stats = read_json(bank_dir / "stats.json", hint="the bank was just written: rerun to rewrite it")
    lines = [(f"bank {bank_dir}: {stats['n_rounds']} rounds, mean accepted {stats['mean_accept']:.3f} "
              f"(drafted {stats['mean_drafted']:.2f}), {manifest['output_tokens']} tokens at "
              f"{manifest['output_tokens'] / max(manifest['generate_wall_s'], 1e-9):.1f} tok/s")]
    for cat, s in stats["by_category"].items():
        lines.append(f"  {cat:<12} rounds {s['n_rounds']:>6}  mean accepted {s['mean_accept']:.3f}")
    print("\n".join(lines))


def _is_cpu() -> bool:
    try:
        from vllm.platforms import current_platform
    except ImportError:  # a stand-in vllm (tests): the machine's answer
        import torch

        return not torch.cuda.is_available()
    return current_platform.is_cpu()


def _calib_version() -> str:
    from calib import __version__

    return __version__
