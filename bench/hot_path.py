"""calib's own per-step work, part by part, without an engine: the real serving state driven through a stand-in runner.

    python bench/hot_path.py                                 # concurrency 1 4 16, both engines, shipped tables
    python bench/hot_path.py --concurrency 16 --engine eagle --profile 25   # the 25 costliest calls too

What it times is what :class:`calib.vllm.server.Server` does inside vLLM's step (docs/serving_hooks.md), in the
order the V1 runner calls it: the plan of draft passes before the drafter (n-gram recompute, table lookup,
forecast, ``plan_draft``), the decision after drafting (``Server.step``), and the online update after
verification (``Server.observe``). The runner is a stand-in (``SimpleNamespace``) holding what those hooks
read: the requests' token ids, temperatures, vLLM's drafts. The contexts are the real code-edit prompts
tokenized by the target's tokenizer; each request's continuation copies a span of its prompt (as code edits
do), and the model drafter's tokens and confidences are SYNTHETIC (drawn at a fixed seed): this bench measures
time, not acceptance. The engine's own time is bench/profile_step.py's (the real engine, one process per arm);
this one isolates calib's part so that a change to it can be judged in seconds, on a quiet or a busy machine
alike (``--vs``-style ratios: run it before and after on the same machine).

Warm or cold. Back to back, the hooks find their code and data in the CPU's caches. Inside the engine they do not:
each hook runs after the target's forward has streamed the model's weights (~540 MB in float32) through the caches,
so every line of Python, numpy and torch a hook touches comes from memory again. ``--evict-mb 600`` streams that
much between hooks (outside the timers), and the same work then costs what it costs inside the engine, or more
(docs/profile.md, "Cold caches").

Why argparse, not Hydra like train.py/eval.py: a handful of flags, no config tree from conf/.
"""

from __future__ import annotations

import json
import os
import statistics
import time
import zlib
from pathlib import Path

from calib.cli import parser as plain_parser

ROOT = Path(__file__).resolve().parents[1]
PARTS = ("plan", "decide", "observe")  # the hooks, in the runner's order within a step
# The serving thread's CPU time (calib's hooks run on one thread, torch at one thread): what calib costs the
# step, and a figure that holds on a busy machine, where wall time counts the other processes' turns too.
CLOCK = time.thread_time


def _tokenizer():
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(_target() / "tokenizer.json"))


def _target() -> Path:
    """The embedded target's HF folder (prepared once by collect.py/serve.py; its tokenizer and fingerprint)."""
    from calib.target import prepare_target

    return Path(prepare_target())


def _contexts(n: int, seed: int) -> list[list[int]]:
    """Token ids of the first ``n`` code-edit prompts (cycled), each with a continuation copied from itself."""
    import numpy as np

    tok = _tokenizer()
    texts = ["\n".join(m["content"] for m in json.loads(line)["messages"])
             for line in (ROOT / "data/prompts/code_edit.jsonl").open()]
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        ids = tok.encode(texts[i % len(texts)]).ids
        start = int(rng.integers(0, max(1, len(ids) - 200)))
        out.append((ids, ids[start: start + 200]))
    return out


class StandIn:
    """What the hooks read of vLLM's runner, for ``B`` requests decoding their continuations."""

    def __init__(self, contexts, engine: str, k: int, temperature: float, seed: int, max_len: int = 4096):
        from types import SimpleNamespace

        import numpy as np

        B = len(contexts)
        self.rng = np.random.default_rng(seed)
        self.k, self.engine = k, engine
        self.continuations = [c for _, c in contexts]
        self.emitted = [0] * B
        tokens = np.zeros((B, max_len), dtype=np.int32)
        n = np.zeros(B, dtype=np.int32)
        for b, (prompt, _) in enumerate(contexts):
            tokens[b, : len(prompt)] = prompt
            n[b] = len(prompt)
        req_ids = [f"req-{b}" for b in range(B)]
        self.batch = SimpleNamespace(
            req_ids=req_ids, req_id_to_index={r: b for b, r in enumerate(req_ids)},
            token_ids_cpu=tokens, num_tokens_no_spec=n, num_prompt_tokens=n.copy(),
            temperature_cpu=np.full(B, temperature, dtype=np.float32))
        method = "eagle" if engine == "eagle" else "ngram"
        sc = SimpleNamespace(method=method, num_speculative_tokens=k, prompt_lookup_min=1, prompt_lookup_max=4,
                             rejection_sample_method="standard",
                             model=str(ROOT / "data/drafters/eagle-smollm2-135m") if engine == "eagle" else None)
        sc.draft_model_config = SimpleNamespace(model=sc.model)
        self.runner = SimpleNamespace(
            speculative_config=sc, use_async_scheduling=False, model_config=SimpleNamespace(model=str(_target())),
            max_num_reqs=max(B, 16), max_model_len=max_len, input_batch=self.batch, requests={}, _draft_probs=None)

    def next_tokens(self, b: int, n: int) -> list[int]:
        c, e = self.continuations[b], self.emitted[b]
        return [int(t) for t in (c[e: e + n] if e + n <= len(c) else (c + c)[e % len(c): e % len(c) + n])]

    def append(self, b: int, toks: list[int]) -> None:
        n = int(self.batch.num_tokens_no_spec[b])
        self.batch.token_ids_cpu[b, n: n + len(toks)] = toks
        self.batch.num_tokens_no_spec[b] = n + len(toks)
        self.emitted[b] += len(toks)

    def model_draft(self, srv, passes: int) -> list[list[int]]:
        """The drafter's ``passes`` tokens per request with SYNTHETIC confidences (recorded as vLLM's hook would)."""
        import torch

        B = len(self.batch.req_ids)
        truth = [self.next_tokens(b, passes + 1)[1:] for b in range(B)]
        srv.rows = []
        drafts = [[] for _ in range(B)]
        for j in range(passes):
            conf = torch.from_numpy(self.rng.beta(4, 1.5, size=B).astype("float32"))
            for b in range(B):
                right = self.rng.random() < float(conf[b])
                drafts[b].append(truth[b][j] if right and j < len(truth[b]) else int(self.rng.integers(0, 49152)))
            srv.record_depth(None, conf)
        srv.finish_drafting(list(self.batch.req_ids))
        return drafts


def evictor(mb: int):
    """A call that streams ``mb`` MB through the caches, as a forward streams the weights (None for 0: warm)."""
    import numpy as np

    if mb <= 0:
        return None
    sweep = np.ones(mb * (1 << 20) // 4, dtype=np.float32)
    return lambda: float(sweep.sum())


def run(engine: str, B: int, steps: int, temperature: float, tables: str, cost: str, seed: int,
        profile: int = 0, aside_after: int = 4, evict_mb: int = 0) -> dict:
    """Per-part milliseconds (median, p90 over steps after a warm-up of 5) of ``steps`` steps at batch ``B``."""
    from types import SimpleNamespace

    import numpy as np
    import torch

    from calib.serve.knobs import ServeKnobs
    from calib.vllm.server import Server

    torch.set_num_threads(1)
    srv = Server(ServeKnobs(tables, cost=cost, aside_after=aside_after))
    stand = StandIn(_contexts(B, seed), engine, 4, temperature, seed)
    runner = stand.runner
    if srv.ensure(runner) is None:
        raise SystemExit(f"calib would not serve: {srv.stats.disabled_reason}")
    times = {p: [] for p in PARTS}
    prof = None
    if profile:
        import cProfile

        prof = cProfile.Profile()
    out_type = SimpleNamespace
    sampled_prev = None
    digest = 0  # CRC-32 of every step's draft lists: a change to calib's speed must not change it
    evict = evictor(evict_mb) or (lambda: None)  # before each hook, off the clock
    for s in range(steps):
        on = prof is not None and s >= 5  # calib's parts only: not the stand-in's drafting and bookkeeping
        sched = SimpleNamespace(num_spec_tokens_to_schedule=stand.k if engine == "eagle" else 0)
        evict()
        t0 = CLOCK()
        if on:
            prof.enable()
        if srv.planning:
            srv.plan_passes(runner, sched, sampled_prev)
            srv.note_passes(runner, sched)  # retiring requests from the model chain (calib/vllm/retire.py)
        if on:
            prof.disable()
        t1 = CLOCK()
        if sampled_prev is not None:  # bookkeeping: the tokens the previous verify committed
            for b, row in enumerate(sampled_prev.tolist()):
                stand.append(b, [t for t in row if t >= 0])
        if engine == "eagle":
            engine_drafts = stand.model_draft(srv, int(sched.num_spec_tokens_to_schedule))
        else:
            from calib.chains.ngram import propose

            engine_drafts = [propose(runner.input_batch.token_ids_cpu[b, : int(runner.input_batch.num_tokens_no_spec[b])],
                                     (1, 4, stand.k))[0] for b in range(B)]
        evict()
        t2 = CLOCK()
        if on:
            prof.enable()
        out = srv.step(runner, _Drafts(list(stand.batch.req_ids), engine_drafts))
        if on:
            prof.disable()
        t3 = CLOCK()
        drafts = out.draft_token_ids
        digest = zlib.crc32(repr([list(map(int, x)) for x in drafts]).encode(), digest)  # what was handed back
        truth = [stand.next_tokens(b, stand.k + 1) for b in range(B)]
        sampled = torch.full((B, stand.k + 1), -1, dtype=torch.int64)
        num_draft = []
        for b, x in enumerate(drafts):
            a = 0
            while a < len(x) and x[a] == truth[b][a]:
                a += 1
            sampled[b, : a + 1] = torch.tensor(truth[b][: a + 1])
            num_draft.append(len(x))
        evict()
        t4 = CLOCK()
        if on:
            prof.enable()
        srv.observe(runner, SimpleNamespace(num_draft_tokens=num_draft), sampled)
        if on:
            prof.disable()
        t5 = CLOCK()
        sampled_prev = sampled
        if s >= 5:
            times["plan"].append((t1 - t0) * 1e3)
            times["decide"].append((t3 - t2) * 1e3)
            times["observe"].append((t5 - t4) * 1e3)
    del out_type
    if prof is not None:
        import io
        import pstats

        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats(os.environ.get("HOT_PATH_SORT", "cumulative")).print_stats(profile)
        print(buf.getvalue())
    total = [sum(v) for v in zip(*times.values())]
    row = {"engine": engine, "concurrency": B, "temperature": temperature, "evict_mb": evict_mb, "steps": len(total),
           "decided": srv.stats.decided, "passthrough": srv.stats.passthrough, "errors": srv.stats.errors,
           "passes_planned": srv.stats.passes_planned, "planned": srv.stats.planned,
           "aside_engine": srv.stats.aside_engine, "aside_none": srv.stats.aside_none, "drafts_crc32": digest,
           "ms": {p: statistics.median(v) for p, v in times.items() if v},
           "total_ms": statistics.median(total), "total_p90_ms": float(np.percentile(total, 90))}
    if srv.stats.errors:
        raise SystemExit(f"calib's hooks raised {srv.stats.errors} times: {row}")
    return row


class _Drafts:
    """vLLM's ``DraftTokenIds``: request ids and one draft list per request."""

    def __init__(self, req_ids, draft_token_ids):
        self.req_ids, self.draft_token_ids = req_ids, draft_token_ids


def main(argv=None) -> None:
    ap = plain_parser(__doc__)
    ap.add_argument("--engine", nargs="+", default=["eagle", "ngram"], choices=["eagle", "ngram"])
    ap.add_argument("--concurrency", nargs="+", type=int, default=[1, 4, 16])
    ap.add_argument("--temperature", nargs="+", type=float, default=[0.0, 0.8])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--tables", default="runs/train/default")
    ap.add_argument("--cost", default="data/cost/smollm2-135m-cpu-step.json")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--aside-after", type=int, default=4,
                    help="serve.aside_after (0: decide every step, to time the decision itself)")
    ap.add_argument("--evict-mb", type=int, default=0, metavar="MB",
                    help="stream MB megabytes through the caches before each hook, as the target's forward does, so "
                         "that each starts cold as inside the engine (600 ~ SmolLM2-135M in float32; 0: warm)")
    ap.add_argument("--profile", type=int, default=0, help="print the N costliest calls (cProfile, cumulative)")
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    args = ap.parse_args(argv)
    rows = []
    print(f"{'engine':<7}{'c':>4}{'T':>5}  " + "".join(f"{p:>9}" for p in PARTS) + f"{'total':>9}{'p90':>8}  ms")
    for engine in args.engine:
        for temp in args.temperature:
            for B in args.concurrency:
                r = run(engine, B, args.steps, temp, args.tables, args.cost, args.seed, args.profile, args.aside_after,
                        args.evict_mb)
                rows.append(r)
                print(f"{engine:<7}{B:>4}{temp:>5}  " + "".join(f"{r['ms'].get(p, 0.0):>9.2f}" for p in PARTS)
                      + f"{r['total_ms']:>9.2f}{r['total_p90_ms']:>8.2f}", flush=True)
    if args.out:
        import sys

        from calib.atomic import write_json_atomic
        from calib.cost.step import this_machine

        write_json_atomic(args.out, {"command": " ".join(["python bench/hot_path.py", *(argv or sys.argv[1:])]),
                                     "date": time.strftime("%Y-%m-%d"), "cpu": this_machine(),
                                     "clock": "thread CPU time", "rows": rows})
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
