"""Shadow-routing capture: speculative decoding on the dense target with the MoEfied routers watching.

A transformers-based stand-in for the vLLM collector (the vLLM hook route is left for a real MoE
target, see README): greedy speculative decoding with vLLM's prompt-lookup (n-gram) drafter rule
(:func:`calib.ngram.find_match`), one request at a time. Each round verifies the block
``[last committed token, d_1 .. d_k]`` in one forward pass with a KV cache; the router of every
layer reads the MLP input of every block position and its top-k is recorded. Accepted = the greedy
prediction matched, exactly as vLLM's rejection sampler at temperature 0, so the output equals plain
greedy decoding (checked on the first prompt when ``check_greedy``).

Writes a bank in the public layout: acceptance.parquet, speculator.parquet (``conf{k}`` null: the
n-gram drafter has no confidence; ``tok{k}``, batch_size 1, temperature 0), routing.npy +
routing_meta.parquet, run_manifest.json (with ``routing``: n_experts, top_k, layers, proxy=true),
outputs.json. A step where the context offers no n-gram match verifies a one-position block and is
kept as a round with nothing drafted, so a request's accepted positions form its whole trajectory.
"""

from __future__ import annotations

import inspect
import logging
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

from calib.atomic import write_json_atomic
from calib.bank import schema, write_bank
from calib.moe.moefy import ShadowRouter, encode_prompt, load_dense
from calib.ngram import find_match

log = logging.getLogger("calib.moe")

MODEL_KEY = "SmolLM2-135M-Instruct-MoEfied-proxy"


class _RouteHooks:
    """Forward pre-hooks on every layer's MLP: router top-k of each position of the current pass."""

    def __init__(self, model, router: ShadowRouter):
        self.router = router
        self.on = False
        self.rows: list = [None] * router.layers
        self.handles = [layer.mlp.register_forward_pre_hook(self._hook(l))
                        for l, layer in enumerate(model.model.layers)]

    def _hook(self, l):
        def fn(mlp, args):
            if self.on:
                self.rows[l] = self.router.route(l, args[0][0].detach().numpy())
        return fn

    def take(self) -> np.ndarray:
        """uint8 [T, layers, top_k] of the last pass."""
        out = np.stack(self.rows, axis=1)
        self.rows = [None] * len(self.rows)
        return out

    def remove(self):
        for h in self.handles:
            h.remove()


def speculate(model, hooks: _RouteHooks, prompt: list[int], max_new: int, k: int, ngram: tuple[int, int],
              eos: int | None):
    """Greedy n-gram speculative decoding of one request. Returns (generated ids, rounds), each round
    ``(drafted ids, accepted count, block start position, routing uint8 [1 + len(drafted), L, k])``."""
    import torch
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    # transformers renamed past_key_values to cache in 5.2x; pass whichever this version takes.
    kw = "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"
    with torch.no_grad():
        out = model(torch.tensor([prompt]), use_cache=True, **{kw: cache})
    gen = [int(out.logits[0, -1].argmax())]  # the prefill's token (not a draft round)
    rounds = []
    while len(gen) < max_new and gen[-1] != eos:
        context = prompt + gen
        n = len(context) - 1  # position of the last committed token, not yet in the cache
        match = find_match(np.asarray(context), ngram[0], ngram[1], min(k, max_new - len(gen)), len(prompt))
        drafts = [int(t) for t in match.tokens]
        block = [context[-1]] + drafts
        hooks.on = True
        try:
            with torch.no_grad():
                out = model(torch.tensor([block]), use_cache=True, **{kw: cache},
                            position_ids=torch.arange(n, n + len(block))[None])
        finally:
            hooks.on = False
        routing = hooks.take()
        pred = out.logits[0].argmax(-1).tolist()
        a = 0
        while a < len(drafts) and drafts[a] == pred[a]:
            a += 1
        commit = drafts[:a] + [pred[a]]
        if eos in commit:
            commit = commit[: commit.index(eos) + 1]
        gen.extend(commit)
        if len(drafts) > a:  # drop the rejected inputs; the bonus token is fed next round
            cache.crop(-(len(drafts) - a))
        rounds.append((drafts, a, n, routing))
    return gen[:max_new] if eos not in gen else gen, rounds


def capture(cfg: dict, root: str | Path = ".") -> Path:
    """Run the capture described by ``conf/moe.yaml`` → ``capture``; returns the bank folder."""
    import torch

    from calib.prompts import load_prompts

    torch.set_num_threads(int(cfg.get("threads", 1)))
    root = Path(root)
    t0 = time.perf_counter()
    router = ShadowRouter.load(_resolve(root, cfg["router"]))
    tok, model = load_dense(cfg.get("target"))
    prompts = load_prompts(cfg["prompts"], limit_per_file=int(cfg["prompts_per_file"]), root=root)
    hooks = _RouteHooks(model, router)
    k, ngram, max_new = int(cfg["k"]), tuple(cfg["ngram"]), int(cfg["max_new_tokens"])
    config_key = f"ngram-k{k}-n{ngram[0]}-{ngram[1]}-greedy-shadow{router.n_experts}x{router.top_k}"
    acc_rows, spec_rows, meta_rows, experts, outputs = [], [], [], [], {}
    try:
        for req, p in enumerate(prompts):
            ids = encode_prompt(tok, p.messages)
            gen, rounds = speculate(model, hooks, ids, max_new, k, ngram, tok.eos_token_id)
            if req == 0 and cfg.get("check_greedy", True):
                _check_greedy(model, tok, ids, gen, max_new, p.id)
            outputs[p.id] = tok.decode(gen, skip_special_tokens=True)
            keys = {"model": MODEL_KEY, "speculator": "ngram", "config": config_key, "category": p.category,
                    "prompt_idx": p.idx, "turn": 0}
            _append_rounds(rounds, keys, req, k, acc_rows, spec_rows, meta_rows, experts)
            log.info("capture %s: %d tokens in %d rounds (%.2f accepted/round)", p.id, len(gen), len(rounds),
                     np.mean([r[1] for r in rounds]) if rounds else 0.0)
    finally:
        hooks.remove()
    acc_t = _table(acc_rows, schema.ACCEPTANCE)
    spec_t = _table(spec_rows, schema.SPECULATOR)
    meta_t = _table(meta_rows, schema.ROUTING_META)
    arr = np.stack(experts).astype(np.uint8)
    manifest = {"model": MODEL_KEY, "speculator": "ngram", "config": config_key,
                "categories": sorted({p.category for p in prompts}), "num_speculative_tokens": k,
                "engine": "transformers (calib.moe.capture; greedy, batch 1)", "routing": _routing_info(router, cfg),
                "prompts": list(cfg["prompts"]), "prompts_per_file": int(cfg["prompts_per_file"]),
                "max_new_tokens": max_new, "ngram": list(ngram),
                "runtime_s": round(time.perf_counter() - t0, 1)}
    out = write_bank(_resolve(root, cfg["out"]), acc_t, spec_t, manifest=manifest, overwrite=True,
                     routing=(arr, meta_t))
    write_json_atomic(out / "outputs.json", outputs)
    log.info("capture: %d rounds, %d routed positions -> %s (%.0f s)", len(acc_rows), len(arr), out,
             time.perf_counter() - t0)
    return out


def _check_greedy(model, tok, ids: list[int], gen: list[int], max_new: int, prompt_id: str) -> None:
    """Refuse a capture whose speculative output differs from the dense model's own greedy decoding."""
    import torch

    with torch.no_grad():
        ref = model.generate(torch.tensor([ids]), max_new_tokens=max_new, do_sample=False,
                             eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id)
    ref = ref[0, len(ids):].tolist()
    if ref != gen[: len(ref)]:
        raise RuntimeError(f"prompt {prompt_id}: speculative output differs from greedy decoding")


def _append_rounds(rounds: list, keys: dict, req: int, k: int, acc_rows: list, spec_rows: list,
                   meta_rows: list, experts: list) -> None:
    """One request's rounds ``(drafts, accepted, start, routing [positions, layers, top_k])`` as bank rows
    (acceptance, speculator, routing meta) and routed positions, appended in round order."""
    for r, (drafts, a, start, routing) in enumerate(rounds):
        keys_r = {**keys, "round_idx": r}
        acc_rows.append({**keys_r, "accept": a, **{f"acc{j}": (1 if j < a else 0) if j < len(drafts) else None
                                                    for j in range(k)}})
        spec_rows.append({**keys_r, **{f"conf{j}": None for j in range(k)},
                          **{f"tok{j}": drafts[j] if j < len(drafts) else None for j in range(k)},
                          "batch_size": 1, "temperature": 0.0})
        for j in range(routing.shape[0]):
            meta_rows.append({**keys_r, "routing_idx": len(experts), "routing_block_idx": j,
                              "request_idx": req, "position": start + j, "accepted": j <= a})
            experts.append(routing[j])


def _routing_info(router, cfg: dict) -> dict:
    """The bank manifest's ``routing``: the shadow router's shape and quality (a PROXY capture)."""
    return {"n_experts": router.n_experts, "top_k": router.top_k, "layers": router.layers, "proxy": True,
            "source": "shadow routing of a MoEfied SmolLM2-135M-Instruct (dense model ran; linear routers "
                      "recorded their top-k) -- a PROXY for a real MoE target",
            "router": str(cfg["router"]), "router_mean_topk_recall": router.meta.get("mean_topk_recall"),
            "router_mean_energy_captured": router.meta.get("mean_energy_captured")}


def _resolve(root: Path, p) -> Path:
    return Path(p) if Path(p).is_absolute() else root / p


def _table(rows: list[dict], file: str) -> pa.Table:
    names = list(rows[0])
    fields = []
    for n in names:
        typ = schema.column_type(n, file)
        if typ is None and n.startswith("tok"):
            typ = pa.int64()
        fields.append(pa.field(n, typ or pa.infer_type([r[n] for r in rows])))
    return pa.table({n: [r[n] for r in rows] for n in names}, schema=pa.schema(fields))
