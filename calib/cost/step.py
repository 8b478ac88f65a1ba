"""An engine step's cost as measured on the clock: what the replay charges a step, part by part.

:func:`fit_step_cost` fits :class:`StepCost` to ``bench/profile_step.py``'s rows (one per engine step,
milliseconds per part); the fit is written beside the verify-cost curves (``data/cost/*-step.json``)
and read back by :func:`load_step_cost`. :class:`EngineStepCurve` is it as the replay's cost curve
(``conf/cost/engine.yaml``, kind ``engine``). The model and its fit: docs/cost.md, "Engine step cost".
"""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from calib.cost import CostCurve

# bench/profile_step.py's parts that make up each term of the model (the rest of a step is "verify").
DRAFTER_PARTS = {"idle": ("drafter_first_pass",), "lm_head": ("drafter_lm_head",),
                 "more": ("drafter_more_passes",)}
CHAIN_PARTS = ("ngram_propose",)
CALIB_PARTS = ("calib",)
# 2 added the ``sampled`` term (a version-1 file reads with it zero); 3 verify's C and Q; 4 ``small_t``; 5 ``t_residual``
# over every T the profile stepped (4's ``small_t``, read into it, held T <= 8 only)
STEP_COST_VERSION = 5
READABLE_VERSIONS = (1, 2, 3, 4, 5)
# verify as measured at each T (StepCost.t_residual): the target's matrix products over T rows do not cost a line (one
# AMD EPYC stepped T = 5 positions 15 % faster than T = 1, and T = 9..20 10-20 % below the line fitted to all its
# steps, docs/cost.md), so the profile's plain steps keep their median residual from the linear fit at each T up to
# SMALL_T_MAX, and in each bin between T_BIN_EDGES above it, where at least T_MIN_STEPS of them stepped
SMALL_T_MAX = 8
T_BIN_EDGES = (8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024)
T_MIN_STEPS = 20
# past the last measured T the residual fades to the line over this many positions (an unmeasured T is the line's)
T_FADE = 8
# verify's inputs: T positions, B requests; with a profile that recorded each step's context (3), C thousands of tokens
# in the requests' KV caches (rows' ``context``: read once a step per request) and Q thousands of (query, key) pairs
# attended over (rows' ``query_keys``: each position against its request's cache)
VERIFY_INPUTS = ("T", "B", "C", "Q")
CONTEXT_INPUTS = ("C", "Q")
# what each term is read over (StepCost's docstring): a slope over anything else is not one this calib can price
TERM_INPUTS = {"verify": VERIFY_INPUTS, "idle": ("T",), "lm_head": ("B",), "more": ("B",), "chain": ("B",),
               "calib": ("B",), "sampled": ("D", "R")}


@dataclass(frozen=True)
class Linear:
    """``intercept + Σ slope_x · x`` in seconds over the named inputs (``T``: positions, ``B``: batch)."""

    intercept: float
    slopes: dict  # {input name: seconds per unit}

    def __call__(self, **inputs) -> np.ndarray:
        out = np.asarray(self.intercept, dtype=np.float64)
        for name, slope in self.slopes.items():
            out = out + slope * np.asarray(inputs[name], dtype=np.float64)
        return out


@dataclass(frozen=True)
class StepCost:
    """One engine's step, in seconds (fitted by :func:`fit_step_cost`).

    Attributes:
        verify: every step pays it: scheduling, inputs, the target's forward and LM head over ``T``
            positions of ``B`` requests, the sampler/verify and bookkeeping (of ``T``, ``B`` and, when the
            profile recorded each step's context, ``C``, the thousands of tokens its requests have cached, ``Σ_r c_r``,
            and ``Q``, the thousands of (query, key) pairs its attention reads, ``Σ_r n_r·c_r + n_r(n_r+1)/2`` for
            ``n_r`` positions of a request with ``c_r`` tokens cached).
        idle: a loaded model drafter's first forward over the step's ``T`` positions: run every step
            it is loaded, even when 0 tokens are drafted (it keeps the drafter's KV cache right).
        lm_head: one draft pass's LM head and sampling over ``B`` rows (of ``B``).
        more: each draft pass after the first: a drafter forward over ``B`` rows (of ``B``).
        chain: a model-free chain's proposer per step (vLLM's n-gram lookup; of ``B``).
        calib: calib's hooks per step when it serves (decision, plan, n-gram recompute; of ``B``).
        source: what it was fitted on (the profile's command, date, engine).
        sampled: what a step under sampling (any request at T > 0) spends beyond ``verify`` when it
            verifies ``D >= 1`` draft tokens (of ``D`` and ``R``, the requests with draft tokens): the
            rejection sampler's random path (a softmax over the vocabulary at every draft position, a
            vocabulary of exponentials per request drawn: ``R`` of them where calib serves,
            calib.vllm.sampled; vLLM's own draw takes every request of the step, so a profile of vLLM's arms
            records ``R = B``), which a greedy step and a step without draft tokens skip. Zero where no
            sampled profile was fitted.
    """

    verify: Linear
    idle: Linear
    lm_head: Linear
    more: Linear
    chain: Linear
    calib: Linear
    source: dict
    sampled: Linear = field(default_factory=lambda: Linear(0.0, {"D": 0.0, "R": 0.0}))
    # {T: seconds}: verify's measured median residual from the linear fit at T positions (each T up to SMALL_T_MAX, a
    # bin's median T above it; JSON keys are strings); interpolated between, fading to the line over T_FADE past the last
    t_residual: dict = field(default_factory=dict)

    @property
    def context_aware(self) -> bool:
        """Whether ``verify`` reads a step's context (``C``, ``Q``: a profile that recorded it)."""
        return any(k in self.verify.slopes for k in CONTEXT_INPUTS)

    @property
    def context_mean(self) -> float:
        """Tokens cached per request, the mean over the steps ``verify`` was fitted on (``source.context_mean``):
        where a step's own context is not known (serving's price curve) ``C`` and ``Q`` are read at it, so that a
        context-aware model prices such a step as a context-free fit to the same profile would."""
        return float(self.source.get("context_mean", 0.0) or 0.0)

    def verify_at(self, T, B, cached=None, queries=None, context: float | None = None) -> np.ndarray:
        """``verify`` over ``T`` positions of ``B`` requests; a context-aware one with ``cached`` (thousands of tokens
        cached, ``C``) and ``queries`` (thousands of query-key pairs, ``Q``), each, where not given, from ``B``
        requests (``T`` positions) at ``context`` tokens cached per request (None: :attr:`context_mean`)."""
        if not self.context_aware:
            return self.verify(T=T, B=B) + self.t_residual_at(T)
        mean = (self.context_mean if context is None else float(context)) / 1e3
        cached = np.asarray(B, dtype=np.float64) * mean if cached is None else cached
        queries = np.asarray(T, dtype=np.float64) * mean if queries is None else queries
        return self.verify(T=T, B=B, C=cached, Q=queries) + self.t_residual_at(T)

    def price_curve(self, t_max: int, batch: int, drafter: bool = False, context: float | None = None) -> np.ndarray:
        """float64 ``[t_max + 1]``: a step's verify over ``T`` positions of ``batch`` requests (``T = 0`` priced as 1) at
        ``context`` tokens cached per request (:meth:`verify_at`), plus the idle drafter's forward where one is loaded:
        the curve serving and the replay's policies price by."""
        t = np.arange(t_max + 1, dtype=np.float64)
        t[0] = 1
        return np.asarray(self.verify_at(t, batch, context=context) + (self.idle(T=t) if drafter else 0.0),
                          dtype=np.float64)

    def t_residual_at(self, T) -> np.ndarray:
        """Seconds :attr:`t_residual` adds to the linear ``verify`` at ``T`` positions (0 without it, and more than
        :data:`T_FADE` positions past the last measured): the measured residuals interpolated, fading to 0 over the
        ``T_FADE`` positions past the last."""
        return _t_residual_at(self.t_residual, T)

    def speculating_sampled(self, draft_tokens, drafting) -> np.ndarray:
        """Seconds a sampled step adds for verifying ``draft_tokens`` from ``drafting`` requests (0 for none: no
        jump without drafts)."""
        d = np.asarray(draft_tokens, dtype=np.float64)
        return np.where(d > 0, self.sampled(D=d, R=drafting), 0.0)

    def draft(self, passes, batch: int) -> np.ndarray:
        """Seconds of ``passes`` model draft passes over ``batch`` rows (the idle forward not included)."""
        passes = np.asarray(passes, dtype=np.float64)
        return passes * self.lm_head(B=batch) + np.maximum(passes - 1, 0) * self.more(B=batch)


def _fit(x: np.ndarray, y: np.ndarray, names: tuple[str, ...]) -> Linear:
    """Least squares ``y ≈ a + X b`` with ``a, b >= 0`` (a negative term is dropped and the rest refitted)."""
    keep = list(range(len(names)))
    while True:
        design = np.column_stack([np.ones(len(y)), *(x[:, i] for i in keep)])
        coef, *_ = np.linalg.lstsq(design, y, rcond=None)
        neg = [j for j in range(1, len(coef)) if coef[j] < 0]
        if not neg:
            break
        keep.pop(neg[0] - 1)
    slopes = {names[i]: float(c) for i, c in zip(keep, coef[1:])}
    return Linear(max(float(coef[0]), 0.0), {**{n: 0.0 for n in names}, **slopes})


def _part_ms(row: dict, parts) -> float:
    return sum(float(row["ms"].get(p, 0.0)) for p in parts)


def fit_step_cost(rows: list[dict], source: dict) -> StepCost:
    """Fit :class:`StepCost` to profile rows ``{"batch", "tokens", "passes", "step_ms", "ms": {part: ms}}``
    (bench/profile_step.py's steady decode steps; every arm's rows together), each optionally with
    ``"draft_tokens"`` (default ``tokens - batch``) and ``"sampled"`` (a step under sampling; default False).
    ``verify`` is fitted on the rows without the sampled path's extra work (greedy steps, and sampled steps
    without draft tokens), with each ``T``'s measured residual kept beside the line (``t_residual``);
    ``sampled`` on what the sampled steps with draft tokens spent beyond it."""
    if not rows:
        raise ValueError("fit_step_cost: no profile rows (run bench/profile_step.py)")
    B = np.array([r["batch"] for r in rows], dtype=np.float64)
    T = np.array([r["tokens"] for r in rows], dtype=np.float64)
    D = np.array([r.get("draft_tokens", r["tokens"] - r["batch"]) for r in rows], dtype=np.float64)
    # the exponentials drawn: for the requests with drafts (calib's lean draw, recorded), else for every request
    R = np.array([r.get("drafting", r["batch"]) for r in rows], dtype=np.float64)
    jumped = np.array([bool(r.get("sampled", False)) for r in rows]) & (D > 0)
    passes = np.array([r.get("passes", 0) for r in rows], dtype=np.float64)
    drafter = [p for parts in DRAFTER_PARTS.values() for p in parts]
    own = (*drafter, *CHAIN_PARTS, *CALIB_PARTS)
    verify_s = np.array([r["step_ms"] - _part_ms(r, own) for r in rows]) / 1e3
    idle_s = np.array([_part_ms(r, DRAFTER_PARTS["idle"]) for r in rows]) / 1e3
    loaded = idle_s > 0
    plain = ~jumped if (~jumped).any() else np.ones(len(rows), dtype=bool)
    # each step's context (tokens cached, query-key pairs), where the profile recorded it: verify is then fitted on
    # those rows alone (a profile of an older bench beside a newer one lends its drafter and chain parts, not its verify)
    keyed = np.array(["query_keys" in r and "context" in r for r in rows])
    source = dict(source)
    if keyed.any():
        C = np.array([float(r.get("context", 0.0)) for r in rows]) / 1e3
        Q = np.array([float(r.get("query_keys", 0.0)) for r in rows]) / 1e3
        plain, jumped = plain & keyed, jumped & keyed
        fits = {"verify": _fit(np.column_stack([T[plain], B[plain], C[plain], Q[plain]]), verify_s[plain],
                               VERIFY_INPUTS)}
        source["context_mean"] = float(1e3 * C[plain].sum() / B[plain].sum())  # tokens cached per request
        ran = fits["verify"](T=T, B=B, C=C, Q=Q)
    else:
        fits = {"verify": _fit(np.column_stack([T[plain], B[plain]]), verify_s[plain], ("T", "B"))}
        ran = fits["verify"](T=T, B=B)
    t_residual = _t_residual(T[plain], verify_s[plain] - ran[plain])
    ran = ran + _t_residual_at(t_residual, T)
    fits["sampled"] = (_fit(np.column_stack([D[jumped], R[jumped]]), verify_s[jumped] - ran[jumped], ("D", "R"))
                       if jumped.any() and (plain & ~jumped).any() else Linear(0.0, {"D": 0.0, "R": 0.0}))
    fits["idle"] = _fit(T[loaded, None], idle_s[loaded], ("T",)) if loaded.any() else Linear(0.0, {"T": 0.0})
    for name, mask, denom in (("lm_head", passes > 0, passes), ("more", passes > 1, passes - 1)):
        y = np.array([_part_ms(r, DRAFTER_PARTS[name]) for r in rows]) / 1e3
        fits[name] = (_fit(B[mask, None], y[mask] / denom[mask], ("B",)) if mask.any()
                      else Linear(0.0, {"B": 0.0}))
    for name, parts in (("chain", CHAIN_PARTS), ("calib", CALIB_PARTS)):
        y = np.array([_part_ms(r, parts) for r in rows]) / 1e3
        mask = y > 0
        fits[name] = _fit(B[mask, None], y[mask], ("B",)) if mask.any() else Linear(0.0, {"B": 0.0})
    return StepCost(**fits, source=source, t_residual=t_residual)


def _t_residual(T: np.ndarray, residual: np.ndarray) -> dict:
    """{T: median residual} of the plain steps at each ``T <= SMALL_T_MAX`` positions, and in each bin between
    :data:`T_BIN_EDGES` above it (keyed by the bin's median T), with at least :data:`T_MIN_STEPS` of them
    (:attr:`StepCost.t_residual`)."""
    out = {}
    for t in range(1, SMALL_T_MAX + 1):
        at = residual[T == t]
        if at.size >= T_MIN_STEPS:
            out[t] = float(np.median(at))
    for lo, hi in itertools.pairwise(T_BIN_EDGES):
        inside = (T > lo) & (T <= hi)
        if inside.sum() >= T_MIN_STEPS:
            out[round(float(np.median(T[inside])))] = float(np.median(residual[inside]))
    return out


def _t_residual_at(t_residual: dict, T) -> np.ndarray:
    T = np.asarray(T, dtype=np.float64)
    if not t_residual:
        return np.zeros_like(T)
    at = sorted((float(t), float(r)) for t, r in t_residual.items())
    xs, ys = [t for t, _ in at] + [at[-1][0] + T_FADE], [r for _, r in at] + [0.0]
    return np.interp(T, xs, ys, left=ys[0], right=0.0)


def save_step_cost(cost: StepCost, path) -> None:
    """Write ``cost`` as JSON to ``path`` (a temp name, then renamed)."""
    from calib.atomic import write_text_atomic

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json.dumps({"version": STEP_COST_VERSION, "unit": "s", **asdict(cost)}, indent=1) + "\n")


def load_step_cost(path) -> StepCost:
    """The :class:`StepCost` in ``path``; a ``ValueError`` naming the file and key if it is not one."""
    from calib.sidefiles import read_json

    doc = read_json(Path(path), hint="an engine step-cost model is written by bench/profile_step.py --step-cost")
    if doc.get("version") not in READABLE_VERSIONS:
        raise ValueError(f"{path}: version {doc.get('version')!r}; this calib reads step-cost versions "
                         f"{list(READABLE_VERSIONS)} (re-run bench/profile_step.py --step-cost {path})")
    terms = {}
    optional = ("sampled",) if doc["version"] == 1 else ()
    for key in ("verify", "idle", "lm_head", "more", "chain", "calib", "sampled"):
        term = doc.get(key)
        if term is None and key in optional:
            continue
        if key == "verify" and isinstance(term, dict) and not set(term.get("slopes") or {}) <= set(VERIFY_INPUTS):
            raise ValueError(f"{path}: verify: slopes over {sorted(term['slopes'])}; this calib reads "
                             f"{list(VERIFY_INPUTS)} (re-run bench/profile_step.py --step-cost {path})")
        slopes = term.get("slopes") if isinstance(term, dict) else None
        if isinstance(slopes, dict) and not set(slopes) <= set(TERM_INPUTS[key]):
            raise ValueError(f"{path}: {key}: slopes over {sorted(slopes)}; this calib prices {key} over "
                             f"{list(TERM_INPUTS[key])} only (re-run bench/profile_step.py --step-cost {path})")
        ok = (isinstance(term, dict) and isinstance(term.get("slopes"), dict)
              and all(_nonneg(v) for v in [term.get("intercept"), *term["slopes"].values()]))
        if not ok:
            raise ValueError(f"{path}: {key}: expected {{intercept, slopes: {{input: seconds}}}} with finite "
                             f"values >= 0, got {term!r}")
        terms[key] = Linear(float(term["intercept"]), {k: float(v) for k, v in term["slopes"].items()})
    # version 4 kept T <= SMALL_T_MAX only, as ``small_t``; the same residuals, read the same way
    key, top = ("small_t", SMALL_T_MAX) if doc["version"] == 4 else ("t_residual", T_BIN_EDGES[-1])
    t_residual = doc.get(key, {})
    if not (isinstance(t_residual, dict) and all(
            str(t).isdigit() and 1 <= int(t) <= top
            and isinstance(r, (int, float)) and not isinstance(r, bool) and math.isfinite(r)
            for t, r in t_residual.items())):
        raise ValueError(f"{path}: {key}: expected {{positions 1..{top}: finite seconds}}, got {t_residual!r} "
                         f"(re-run bench/profile_step.py --step-cost {path})")
    source = doc.get("source", {})
    if not isinstance(source, dict):  # a file's content: a ValueError as every refusal here
        raise ValueError(f"{path}: source: {source!r} ({type(source).__name__}); expected an object (the profile's "  # noqa: TRY004
                         f"command, date, cpu, device) or no key at all (re-run bench/profile_step.py --step-cost {path})")
    return StepCost(**terms, source=source, t_residual={int(t): float(r) for t, r in t_residual.items()})


def this_machine() -> str:
    """The CPU a step cost is measured on: its model name, its cores, and the vector extensions that decide
    bf16 speed (one model name, "AMD EPYC", ran bf16 4x apart with and without AVX-512: docs/profile.md)."""
    import os

    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown"
    name = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")),
                "unknown")
    flags = next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), [])
    isa = [f for f in ("avx512f", "avx512_bf16", "amx_bf16") if f in flags] or ["no AVX-512"]
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    # a process pinned to fewer cores (taskset) steps at another speed: its own machine, as far as prices go
    cores = f"{os.cpu_count()} cores" if usable == os.cpu_count() else f"{usable} of {os.cpu_count()} cores"
    return f"{name}, {cores}, {' '.join(isa)}"


def accelerator_name(device: str) -> str | None:
    """The model of the accelerator an engine on ``device`` steps on (torch's ``get_device_name``, e.g. "NVIDIA H100
    80GB HBM3"); None on a CPU, or where torch cannot say. Two GPUs of one kind price a step apart (an A100's step
    cost is not an H100's), so a step cost records it beside the kind (``source.accelerator``)."""
    if device == "cpu":
        return None
    try:
        import torch

        backend = getattr(torch, device, None)
        return str(backend.get_device_name(0)) if backend is not None and backend.is_available() else None
    except Exception:  # noqa: BLE001 - a backend that cannot answer: the kind alone is compared
        return None


def other_machine(cost: StepCost, device: str = "cpu") -> str | None:
    """A sentence when ``cost`` was fitted on another machine than this one (its prices may be far off), else None.

    ``device``: what the engine steps on (vLLM's ``device_config.device_type``). A CPU engine compares CPUs
    (model, cores, the vector extensions that decide bf16 speed); any other device is compared by kind, since a
    step cost records the device it was measured on (``source.device``, "cpu" where it records none), and by model
    where both the fit and this process know it (``source.accelerator``, :func:`accelerator_name`)."""
    refit = "re-run bench/profile_step.py --step-cost PATH on this engine; docs/deployment.md"
    fitted, fitted_device = cost.source.get("cpu"), str(cost.source.get("device") or "cpu")
    if device != "cpu":
        if fitted_device == device:
            fitted_model, model = cost.source.get("accelerator"), accelerator_name(device)
            if not (fitted_model and model and fitted_model != model):
                return None
            return (f"the step cost was fitted on {device} {fitted_model!r}, this engine steps on {device} {model!r}: "
                    f"its prices may be far off ({refit})")
        return (f"the step cost was fitted on {fitted_device} ({fitted or 'no CPU recorded'}), this engine steps on "
                f"{device}: its prices are not this engine's ({refit})")
    here = this_machine()
    if fitted_device == "cpu" and (not fitted or fitted == here):
        return None
    where = fitted if fitted_device == "cpu" else f"{fitted_device} ({fitted or 'no CPU recorded'})"
    return f"the step cost was fitted on {where!r}, this machine is {here!r}: its prices may be far off ({refit})"


def _nonneg(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0


class EngineStepCurve(CostCurve):
    """:class:`StepCost` as the replay's cost curve: ``values[T]`` is a step's verify over ``T`` positions
    of the current batch (:meth:`for_batch`), plus the idle drafter's forward when a model drafter is
    loaded (:meth:`with_drafter`), plus, for a step under sampling (:meth:`with_sampling`), the sampled
    path's extra work at every ``T`` above the batch; :meth:`draft`, :meth:`chain` and :meth:`calib` price
    the rest.

    ``values`` are the prices a policy decides by, as serving prices (a context-aware model read at its
    :attr:`StepCost.context_mean`). :meth:`charge` is what a step costs: by ``charging`` where given (a richer
    model of the same engine than the one serving is given, ``cost.engine.charge``), and, with
    :meth:`with_context` (``context`` [S, B], tokens cached per request and step), each step's own attention."""

    def __init__(self, name: str, cost: StepCost, t_max: int, unit: str = "s", batch: int = 1,
                 drafter: bool = False, sampled: bool = False, charging: StepCost | None = None,
                 context: np.ndarray | None = None):
        values = cost.price_curve(t_max, batch, drafter)
        if sampled:
            t = np.maximum(np.arange(t_max + 1, dtype=np.float64), 1)  # T = 0 priced as 1, as price_curve does
            drafts = np.maximum(t - batch, 0)  # the requests drafting are not known from T: at most min(B, D)
            values = values + cost.speculating_sampled(drafts, np.minimum(drafts, batch))
        super().__init__(name, np.asarray(values, dtype=np.float64), unit)
        self.cost, self.t_max, self.batch, self.drafter, self.sampled = cost, t_max, batch, drafter, sampled
        self.charging = charging
        self.context = context  # [S, B] tokens cached per request at each step, or None

    def _with(self, **change) -> EngineStepCurve:
        now = {"batch": self.batch, "drafter": self.drafter, "sampled": self.sampled}
        if all(now[k] == v for k, v in change.items()):
            return self
        return EngineStepCurve(self.name, self.cost, self.t_max, self.unit, **{**now, **change},
                               charging=self.charging, context=self.context)

    def for_batch(self, batch: int) -> EngineStepCurve:
        return self._with(batch=batch)

    def with_drafter(self, loaded: bool) -> EngineStepCurve:
        """This curve with a model drafter loaded (its idle forward in every step) or not."""
        return self._with(drafter=bool(loaded))

    def with_sampling(self, sampled: bool) -> EngineStepCurve:
        """This curve for steps under sampling (the sampled path's extra work priced) or greedy ones."""
        return self._with(sampled=bool(sampled))

    def with_context(self, context: np.ndarray | None) -> EngineStepCurve:
        """This curve charging each step's attention by ``context`` [S, B] (tokens cached per request; the prices
        stay as serving's)."""
        if context is None and self.context is None:
            return self
        return EngineStepCurve(self.name, self.cost, self.t_max, self.unit, self.batch, self.drafter, self.sampled,
                               charging=self.charging, context=context)

    def charge(self, depth: np.ndarray) -> np.ndarray:
        """A step's cost given its verified draft depths ``[S, B]``: the verify over its ``B + Σ depth`` positions (with
        :meth:`with_context` and a context-aware model, its own cached tokens and query-key pairs; else as
        :attr:`values` prices it), the idle drafter's forward where one is loaded, and under sampling the sampled
        path's extra work at the step's own draft tokens and drafting requests (the curve's values assume the most)."""
        depth = np.asarray(depth)
        model = self.charging or self.cost
        T = depth.shape[-1] + depth.sum(axis=-1)
        cached = queries = None
        if self.context is not None and model.context_aware:
            q = 1 + depth  # a request's positions: its bonus and its drafts
            cached = np.broadcast_to(self.context, depth.shape).sum(axis=-1) / 1e3
            queries = (q * self.context + q * (q + 1) / 2).sum(axis=-1) / 1e3
        cost = model.verify_at(T, self.batch, cached, queries) + (model.idle(T=T) if self.drafter else 0.0)
        if not self.sampled:
            return cost
        return cost + model.speculating_sampled(depth.sum(axis=-1), (depth > 0).sum(axis=-1))

    def draft(self, passes) -> np.ndarray:
        return self.cost.draft(passes, self.batch)

    def chain(self) -> float:
        return float(self.cost.chain(B=self.batch))

    def calib(self) -> float:
        return float(self.cost.calib(B=self.batch))
