"""Capture: every speculative round as one JSON line, a subscriber of :mod:`calib.vllm.patches`.

Drafting (per-depth confidence, entropy, margin), verification (accepted tokens, each recomputed
chain kind's fragment: :func:`calib.chains.recomputed_chains`) and, for MoE targets, the routing of verified positions (docs/vllm_wing.md). Capture
never raises into the engine and never changes what it computes.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from pathlib import Path

import numpy as np
import torch

from calib.sidefiles import field, read_json
from calib.transforms import target_only_transforms
from calib.vllm.patches import RunnerSubscriber

log = logging.getLogger("calib.collect")


class Recorder:
    """Per-process capture state."""

    def __init__(self, out_dir: str, chain_settings: dict, k: int, serving=None):
        self.serving = serving  # calib's serving state in this process (its decisions), or None
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.out_dir / f"capture-{os.getpid()}.jsonl"
        self._fh = None  # opened at the first record: a process that never records (the engine's front end,
        # a tensor-parallel rank other than the output rank) leaves no empty file
        # name -> the recomputation of each recomputed chain kind (calib.chains.ChainKind.recompute): its
        # capture fragment, ``{name}_tokens`` and ``{name}`` (features), beside every round
        from calib.chains import recomputed_chains

        self.recompute = {}
        for kind in recomputed_chains():
            try:
                self.recompute[kind.name] = kind.recompute(chain_settings.get(kind.name), k)
            except ImportError as exc:  # an optional implementation (the suffix tree's) is not installed
                log.warning("calib capture: the %s chain is not recorded (%s)", kind.name, exc)
        self.active: set[str] = set()  # requests a recomputation has seen (finished when they leave the batch)
        self.proposed: dict[tuple, tuple] = {}  # (chain, req_id) -> (context length, tokens, features) of this step
        self.step = 0
        self.errors = 0
        self.local = threading.local()
        self.pending: dict[str, dict] = {}  # req_id -> drafter signals of its last drafting pass
        self.moe_rows: list = []  # topk_ids [tokens, top_k] of each MoE layer of the current pass, in call order
        self.v1_runner = False  # set by the first V1 `_sample`: the routing hook records only then (claim 5)

    @property
    def fh(self):
        if self._fh is None:
            self._fh = open(self.path, "a", buffering=1 << 16)  # noqa: SIM115 - open for the process's life
        return self._fh

    def error(self, where: str, exc: BaseException) -> None:
        self.errors += 1
        if self.errors <= 3:
            log.exception("calib capture failed in %s (engine output unaffected): %s", where, exc)
        self.fh.write(json.dumps({"capture_error": f"{where}: {exc!r}"}) + "\n")

    # -- drafting -------------------------------------------------------------------------------
    def depth_rows(self) -> list | None:
        return getattr(self.local, "rows", None)

    def start_drafting(self) -> None:
        self.local.rows = []

    def record_depth(self, token_ids: torch.Tensor, probs: torch.Tensor) -> None:
        """One depth of a drafting pass: probs [rows, vocab] of the distribution sampled from."""
        rows = self.depth_rows()
        if rows is None:
            return
        p = probs.float()
        top2 = torch.topk(p, 2, dim=-1).values
        conf = p.gather(-1, token_ids.view(-1, 1).long()).squeeze(-1)
        entropy = -(p * torch.log(p.clamp_min(1e-30))).sum(-1)
        rows.append(torch.stack([conf, entropy, top2[:, 0] - top2[:, 1]], dim=-1))

    def finish_drafting(self, req_ids: list[str]) -> None:
        rows, self.local.rows = self.local.rows, None
        if not rows:
            return
        signals = torch.stack(rows, dim=1).cpu().numpy()  # [batch, depth, 3]
        for i, req_id in enumerate(req_ids[: signals.shape[0]]):
            self.pending[req_id] = {
                "conf": signals[i, :, 0].tolist(),
                "entropy": signals[i, :, 1].tolist(),
                "margin": signals[i, :, 2].tolist(),
            }

    # -- verification ---------------------------------------------------------------------------
    def record_verify(self, runner, spec_decode_metadata, sampled_token_ids: torch.Tensor) -> None:
        self.step += 1
        batch = runner.input_batch
        num_draft = spec_decode_metadata.num_draft_tokens
        sampled = sampled_token_ids.cpu().numpy()
        drafts = spec_decode_metadata.draft_token_ids.cpu().numpy()
        starts = np.concatenate([[0], np.cumsum(num_draft)])
        n_active = len(num_draft)
        routing = token_starts = positions = None
        if self.moe_rows:
            routing = np.stack([r.cpu().numpy() for r in self.moe_rows], axis=1)  # [tokens, layers, top_k]
            token_starts = runner.query_start_loc.np[: n_active + 1]
            positions = runner.positions[: int(token_starts[-1])].cpu().numpy()
        max_model_len = getattr(runner, "max_model_len", None)
        serving = self.serving if self.serving is not None and self.serving.decider is not None else None
        requests = getattr(runner, "requests", None)  # req_id -> CachedRequestState (its sampling_params)
        for i, req_id in enumerate(batch.req_ids[:n_active]):
            d = int(num_draft[i])
            signals = self.pending.pop(req_id, None)
            if d == 0:
                continue
            # Rejection-sampler row: accepted drafts, then the bonus/recovered token, then -1s.
            accepted = int((sampled[i] != -1).sum()) - 1
            context_len = int(batch.num_tokens_no_spec[i])
            context = batch.token_ids_cpu[i, :context_len]
            prompt_len = int(batch.num_prompt_tokens[i])
            rec = {
                "req": req_id, "step": self.step, "batch_size": n_active,
                "drafted": drafts[starts[i]: starts[i + 1]].tolist(), "accepted": accepted,
                "context_len": context_len, "prompt_len": prompt_len,
            }
            for name, chain in self.recompute.items():  # each recomputed chain's fragment
                seen = self.proposed.get((name, req_id))
                if seen is not None and seen[0] == context_len:  # a stateful chain, proposed when vLLM's drafter was
                    tokens, feats = seen[1:]
                else:
                    tokens, feats = chain.propose(req_id, context, prompt_len, max_model_len)
                rec[f"{name}_tokens"], rec[name] = [int(t) for t in tokens], feats
            self.active.add(req_id)
            if signals is not None:
                rec.update({name: v[:d] for name, v in signals.items()})
            # target-only logit transforms of the request (calib/transforms.py): the bank marks the round
            state = requests.get(req_id) if requests is not None else None
            rec["logit_transforms"] = list(target_only_transforms(getattr(state, "sampling_params", None)))
            if serving is not None:  # calib chose what was verified: say which chain (labels per chain)
                rec["verified_chain"] = serving.chosen.pop(req_id, None)
            if routing is not None:
                lo, hi = int(token_starts[i]), int(token_starts[i + 1])
                rec["routing"] = routing[lo:hi].tolist()
                rec["routing_start"] = int(positions[lo])
            self.fh.write(json.dumps(rec) + "\n")
        self.fh.flush()
        if not any(getattr(c, "stateful", True) for c in self.recompute.values()):
            self.finish_gone(batch.req_ids)

    def propose_step(self, runner) -> None:
        """Once per engine step, after bookkeeping (where vLLM's own proposer of a model-free chain runs): each
        stateful recomputed chain proposes for every request of the batch in batch order, as vLLM's suffix
        proposer does (its trees see the same tokens in the same order, so the chain is the one vLLM drafts)."""
        stateful = {n: c for n, c in self.recompute.items() if getattr(c, "stateful", True)}
        if not stateful:
            return
        batch = runner.input_batch
        max_model_len = getattr(runner, "max_model_len", None)
        self.proposed = {}
        for i, req_id in enumerate(batch.req_ids):
            n, prompt_len = int(batch.num_tokens_no_spec[i]), int(batch.num_prompt_tokens[i])
            if n <= prompt_len or (max_model_len is not None and n >= max_model_len):
                continue  # a prefill that has sampled nothing yet, or a request at the length limit
            context = batch.token_ids_cpu[i, :n]
            for name, chain in stateful.items():
                self.proposed[name, req_id] = (n, *chain.propose(req_id, context, prompt_len, max_model_len))
            self.active.add(req_id)
        self.finish_gone(batch.req_ids)

    def finish_gone(self, req_ids) -> None:
        """The recomputations forget the requests that left the batch."""
        gone = self.active - set(req_ids)
        for req_id in gone:
            for chain in self.recompute.values():
                chain.finish(req_id)
        self.active -= gone


class CaptureSubscriber(RunnerSubscriber):
    """The recorder's side of the patch set; with ``shadow_router`` (a folder holding
    ``router.safetensors``) the shadow routers are hooked on the target at the first verify."""

    def __init__(self, recorder: Recorder, shadow_router: str | None = None):
        self.rec = recorder
        self.shadow = {"dir": str(shadow_router), "hooked": False} if shadow_router else None

    def before_take(self, runner) -> None:
        try:
            self.rec.propose_step(runner)
        except Exception as exc:  # noqa: BLE001 - capture must never break the engine
            self.rec.error("propose_step", exc)

    def before_verify(self, runner) -> None:
        rec = self.rec
        rec.v1_runner = True  # this process runs the V1 model runner (V2 never calls this)
        if self.shadow is not None and not self.shadow["hooked"]:
            # The first step is a pure prefill (no round), so hooking here loses no round's routing;
            # load_model is overridden per platform, this method is not.
            self.shadow["hooked"] = True
            try:
                hook_shadow_router(rec, runner.get_model(), self.shadow)
            except Exception as exc:  # noqa: BLE001
                rec.error("shadow-router", exc)

    def after_verify(self, runner, spec_decode_metadata, output) -> None:
        if spec_decode_metadata is not None:
            try:
                self.rec.record_verify(runner, spec_decode_metadata, output.sampled_token_ids)
            except Exception as exc:  # noqa: BLE001 - capture must never break the engine
                self.rec.error("verify", exc)
        self.rec.moe_rows = []  # this pass's routing is consumed (or a prefill's, not a round's)

    def before_propose(self, runner, scheduler_output, sampled_token_ids) -> None:
        self.rec.start_drafting()

    def after_propose(self, runner) -> None:
        self.rec.moe_rows = []  # a drafter's own MoE layers are not the target's routing
        try:
            self.rec.finish_drafting(list(runner.input_batch.req_ids))
        except Exception as exc:  # noqa: BLE001
            self.rec.error("propose", exc)

    def wants_depths(self) -> bool:
        return self.rec.depth_rows() is not None

    def draft_depth(self, token_ids, probs, max_q) -> None:
        try:
            self.rec.record_depth(token_ids, probs)
        except Exception as exc:  # noqa: BLE001
            self.rec.error("draft", exc)


def start_capture(out_dir: str, chain_settings: dict, k: int, routing: bool = False,
                  shadow_router: str | None = None, serving=None) -> CaptureSubscriber:
    """This process's recorder, as a subscriber of the patch set.

    ``chain_settings``: name -> the settings of a recomputed chain kind recorded beside each round (a kind not
    named takes its defaults), ``k`` their depth. ``routing``: also
    record the MoE routing of every verified position; with ``shadow_router`` the routing of a dense
    target's shadow routers instead. ``serving``: the serving state whose choices are recorded.
    """
    rec = Recorder(out_dir, chain_settings, k, serving=serving)
    subscriber = CaptureSubscriber(rec, shadow_router if routing else None)
    if routing and subscriber.shadow is None:
        install_routing(rec)
    log.info("calib capture installed (pid %d) -> %s", os.getpid(), rec.path)
    return subscriber


def install_routing(rec: Recorder) -> None:
    """Keep every MoE layer's expert choice (``topk_ids``) of the current forward pass.

    V1 only: the V1 events of :class:`CaptureSubscriber` are what empty ``rec.moe_rows`` after each pass. Model
    Runner V2 (vLLM 0.32's GPU default) shares the model layers, so ``select_experts`` fires there
    too, but never calls those wrappers, and the rows would grow without bound
    (docs/serving_design.md, claim 5). The plugin cannot tell V1 from V2 when it installs (the
    runner is chosen later, from the engine's config), so the check is made per call:
    ``rec.v1_runner``, set by the first V1 ``_sample``. The pass before it is the first prefill, whose
    routing is no round's and was dropped anyway.
    """
    from vllm.model_executor.layers.fused_moe.router.fused_moe_router import FusedMoERouter

    orig_select = FusedMoERouter.select_experts

    def select_experts(self, *args, **kwargs):
        topk_weights, topk_ids = orig_select(self, *args, **kwargs)
        if not rec.v1_runner:  # V2 (or no V1 step yet): nothing would ever empty rec.moe_rows
            return topk_weights, topk_ids
        try:
            rec.moe_rows.append(topk_ids.detach().to("cpu", copy=True))
        except Exception as exc:  # noqa: BLE001
            rec.error("routing", exc)
        return topk_weights, topk_ids

    FusedMoERouter.select_experts = select_experts


def hook_shadow_router(rec: Recorder, model, shadow: dict) -> None:
    """Forward pre-hooks on the target's ``layers.{i}.mlp``: the linear router's top-k of each token."""
    import re

    from safetensors.torch import load_file

    folder = Path(shadow["dir"])
    weights = load_file(folder / "router.safetensors")
    hint = "remake the router (python -m calib.moe stage=moefy) or point routing.shadow_router elsewhere"
    top_k = field(read_json(folder / "router.json", hint=hint), "top_k", int, folder / "router.json",
                  required=True, hint=hint)
    found = {}
    for name, module in model.named_modules():
        m = re.search(r"(?:^|\.)layers\.(\d+)\.mlp$", name)
        if m:
            found[int(m.group(1))] = module
    if sorted(found) != list(range(len(found))) or f"layers.{len(found) - 1}.weight" not in weights:
        raise RuntimeError(f"shadow router in {folder} does not fit the model's {len(found)} MLP layers")

    def hook(layer):
        w = weights[f"layers.{layer}.weight"].float()
        b = weights[f"layers.{layer}.bias"].float()

        def fn(module, args):
            try:
                x = args[0].float()
                rec.moe_rows.append(torch.topk(x @ w.t().to(x.device) + b.to(x.device), top_k, dim=-1)
                                    .indices.to("cpu"))
            except Exception as exc:  # noqa: BLE001
                rec.error("shadow-router", exc)
        return fn

    for layer, module in sorted(found.items()):
        module.register_forward_pre_hook(hook(layer))
    log.info("calib shadow router hooked on %d MLP layers (top-%d)", len(found), top_k)
