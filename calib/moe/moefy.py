"""MoEfy a dense SwiGLU model for shadow routing (a CPU testbed; everything it yields is a PROXY).

No MoE weights are reachable here, so the testbed turns SmolLM2-135M's MLPs into "experts":

1. Calibration activations: the dense model reads calibration text (prompts plus a short greedy
   continuation); each layer's MLP input ``x`` and intermediate activation
   ``h = silu(gate x) * (up x)`` are kept.
2. Experts: the ``n_experts · expert_size`` neurons of a layer are split into equal groups by balanced
   k-means on their co-activation profile (the standardised |h| of each neuron over the calibration
   tokens, reduced by SVD): neurons that fire together share an expert.
3. Router: a linear map ``x -> logits`` per layer, fitted (softmax, KL) to each expert's share of the
   activation energy ``Σ_{n ∈ e} h_n² ‖down[:, n]‖²`` of the token.
4. Shadow routing: the dense model runs unchanged; the router's top-k per layer is recorded. Routing
   for real (keeping only the top-k experts' neurons) breaks the model, SwiGLU not being sparse.

Output (atomic): ``router.safetensors`` (``layers.{l}.weight`` [E, H], ``layers.{l}.bias`` [E],
``layers.{l}.expert_of_neuron`` int64 [I]) and ``router.json`` (config, per-layer top-k recall
and energy captured on held-out calibration tokens).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from calib.atomic import atomic_path, write_json_atomic
from calib.sidefiles import field, read_json

log = logging.getLogger("calib.moe")

ROUTER_FILE = "router.safetensors"
ROUTER_META = "router.json"


@dataclass
class ShadowRouter:
    """Per-layer linear routers and the neuron -> expert map of a MoEfied dense model."""

    weight: list  # [layers] float32 [E, H]
    bias: list  # [layers] float32 [E]
    expert_of_neuron: list  # [layers] int64 [I]
    top_k: int
    meta: dict

    @property
    def n_experts(self) -> int:
        return int(self.weight[0].shape[0])

    @property
    def layers(self) -> int:
        return len(self.weight)

    def route(self, layer: int, x: np.ndarray) -> np.ndarray:
        """Top-k expert ids (uint8 [T, k], most preferred first) for MLP inputs ``x`` [T, H]."""
        logits = x @ self.weight[layer].T + self.bias[layer]
        return np.argsort(-logits, axis=-1, kind="stable")[:, : self.top_k].astype(np.uint8)

    def save(self, out_dir: str | os.PathLike) -> Path:
        from safetensors.numpy import save_file

        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        tensors = {}
        for l, (w, b, e) in enumerate(zip(self.weight, self.bias, self.expert_of_neuron)):
            tensors[f"layers.{l}.weight"] = np.ascontiguousarray(w, dtype=np.float32)
            tensors[f"layers.{l}.bias"] = np.ascontiguousarray(b, dtype=np.float32)
            tensors[f"layers.{l}.expert_of_neuron"] = np.ascontiguousarray(e, dtype=np.int64)
        with atomic_path(out / ROUTER_FILE) as tmp:
            save_file(tensors, tmp, metadata={"format": "calib-moefy"})
        write_json_atomic(out / ROUTER_META, {**self.meta, "top_k": self.top_k, "n_experts": self.n_experts,
                                              "layers": self.layers})
        return out

    @classmethod
    def load(cls, out_dir: str | os.PathLike) -> ShadowRouter:
        from safetensors.numpy import load_file

        out = Path(out_dir)
        if not (out / ROUTER_FILE).exists():
            raise FileNotFoundError(f"{out / ROUTER_FILE}: no MoEfied router here (run `python -m calib.moe "
                                    "stage=moefy`)")
        t = load_file(out / ROUTER_FILE)
        hint = "remake the router (python -m calib.moe stage=moefy)"
        meta = read_json(out / ROUTER_META, hint=hint)
        n = field(meta, "layers", int, out / ROUTER_META, required=True, hint=hint)
        top_k = field(meta, "top_k", int, out / ROUTER_META, required=True, hint=hint)
        missing = [name for l in range(n) for name in (f"layers.{l}.weight", f"layers.{l}.bias",
                                                         f"layers.{l}.expert_of_neuron") if name not in t]
        if missing:
            raise ValueError(f"{out / ROUTER_FILE}: lacks {missing[0]} ({len(missing)} tensors missing) "
                             f"for the {n} layers {out / ROUTER_META} names; {hint}")
        return cls([t[f"layers.{l}.weight"] for l in range(n)], [t[f"layers.{l}.bias"] for l in range(n)],
                   [t[f"layers.{l}.expert_of_neuron"] for l in range(n)], top_k, meta)


# -- 1. calibration activations ----------------------------------------------------------------
def load_dense(target_dir: str | os.PathLike | None = None):
    """The dense target in float32 (HF folder from :func:`calib.target.prepare_target`)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from calib.target import prepare_target

    path = Path(target_dir) if target_dir else prepare_target()
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return tok, model


def encode_prompt(tok, messages) -> list[int]:
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # BatchEncoding in some versions
        ids = ids["input_ids"]
    return [int(i) for i in ids]


def calibration_activations(model, sequences: list[list[int]]):
    """Per layer: MLP inputs ``x`` [T, H] and intermediate activations ``h`` [T, I] (float32)."""
    import torch

    layers = model.model.layers
    xs = [[] for _ in layers]
    hs = [[] for _ in layers]

    def hook(l):
        def fn(mlp, args):
            x = args[0][0]
            xs[l].append(x.detach().numpy().copy())
            hs[l].append((mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x)).detach().numpy())
        return fn

    handles = [layer.mlp.register_forward_pre_hook(hook(l)) for l, layer in enumerate(layers)]
    try:
        with torch.no_grad():
            for seq in sequences:
                model(torch.tensor([seq]))
    finally:
        for h in handles:
            h.remove()
    return [np.concatenate(x) for x in xs], [np.concatenate(h) for h in hs]


def greedy_continue(model, ids: list[int], n: int, eos: int | None) -> list[int]:
    import torch

    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=eos,
                             pad_token_id=eos)
    return out[0].tolist()


# -- 2. balanced clustering of co-activation ---------------------------------------------------
def neuron_profiles(h: np.ndarray, dims: int) -> np.ndarray:
    """Each neuron as a point whose distances follow the correlation of |h| across tokens."""
    a = np.abs(h).astype(np.float64)
    a = (a - a.mean(0)) / (a.std(0) + 1e-8)
    _, s, vt = np.linalg.svd(a, full_matrices=False)
    emb = (vt[:dims].T * s[:dims])
    return emb / (np.linalg.norm(emb, axis=1, keepdims=True) + 1e-12)


def balanced_kmeans(points: np.ndarray, n_clusters: int, iters: int = 6, seed: int = 0) -> np.ndarray:
    """Cluster ``points`` [N, d] into ``n_clusters`` groups of exactly N / n_clusters.

    k-means for the start, then alternate: assign by a min-cost matching against each centroid
    replicated ``size`` times (the exact balanced assignment), recompute centroids.
    """
    from scipy.optimize import linear_sum_assignment
    from sklearn.cluster import KMeans

    n = points.shape[0]
    if n % n_clusters:
        raise ValueError(f"{n} neurons do not split into {n_clusters} equal experts")
    size = n // n_clusters
    centers = KMeans(n_clusters, n_init=1, random_state=seed).fit(points).cluster_centers_
    labels = None
    for _ in range(iters):
        d = ((points[:, None, :] - centers[None]) ** 2).sum(-1)
        _, col = linear_sum_assignment(np.repeat(d, size, axis=1))
        new = col // size
        if labels is not None and np.array_equal(new, labels):
            break
        labels = new
        centers = np.stack([points[labels == j].mean(0) for j in range(n_clusters)])
    return labels.astype(np.int64)


# -- 3. routers ---------------------------------------------------------------------------------
def expert_energy(h: np.ndarray, down_norm2: np.ndarray, labels: np.ndarray, n_experts: int) -> np.ndarray:
    """[T, E] each expert's energy Σ_{n∈e} h_n² ‖down[:, n]‖² (cross terms between neurons ignored)."""
    contrib = (h.astype(np.float64) ** 2) * down_norm2[None, :]
    onehot = np.eye(n_experts)[labels]  # [I, E]
    return contrib @ onehot


def fit_router(x: np.ndarray, share: np.ndarray, iters: int = 100, l2: float = 1e-4):
    """Softmax regression of ``share`` [T, E] on ``x`` [T, H] (KL loss, L-BFGS); returns (W, b)."""
    import torch

    xt = torch.from_numpy(x.astype(np.float32))
    mu, sd = xt.mean(0), xt.std(0) + 1e-6
    z = (xt - mu) / sd
    y = torch.from_numpy(share.astype(np.float32))
    w = torch.zeros(x.shape[1], share.shape[1], requires_grad=True)
    b = torch.zeros(share.shape[1], requires_grad=True)
    opt = torch.optim.LBFGS([w, b], max_iter=iters, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = -(y * torch.log_softmax(z @ w + b, dim=-1)).sum(-1).mean() + l2 * (w ** 2).sum()
        loss.backward()
        return loss

    opt.step(closure)
    with torch.no_grad():  # fold the standardisation into the weights: logits = x W' + b'
        w_eff = (w / sd[:, None]).T.numpy()
        b_eff = (b - (mu / sd) @ w).numpy()
    return w_eff.astype(np.float32), b_eff.astype(np.float32)


def topk_quality(logits: np.ndarray, energy: np.ndarray, k: int) -> tuple[float, float, float]:
    """(recall of the energy top-k, energy share captured by the router's top-k, by the ideal top-k)."""
    pick = np.argsort(-logits, axis=1)[:, :k]
    best = np.argsort(-energy, axis=1)[:, :k]
    recall = np.mean([len(set(a) & set(b)) / k for a, b in zip(pick, best)])
    total = energy.sum(1)
    got = np.take_along_axis(energy, pick, 1).sum(1) / total
    ideal = np.take_along_axis(energy, best, 1).sum(1) / total
    return float(recall), float(got.mean()), float(ideal.mean())


def moefy(cfg: dict, root: str | Path = ".") -> ShadowRouter:
    """The whole recipe (config: ``conf/moe.yaml`` → ``moefy``). Returns and saves the router."""
    import torch

    from calib.prompts import load_prompts

    torch.set_num_threads(int(cfg.get("threads", 1)))
    t0 = time.perf_counter()
    n_exp, k = int(cfg["n_experts"]), int(cfg["top_k"])
    tok, model = load_dense(cfg.get("target"))
    prompts = load_prompts(cfg["prompts"], root=root)
    lo, hi = cfg["prompt_range"]
    chosen = [p for p in prompts if lo <= _index_in_file(p, prompts) < hi]
    seqs = []
    for p in chosen:
        ids = encode_prompt(tok, p.messages)
        seqs.append(greedy_continue(model, ids, int(cfg["gen_tokens"]), tok.eos_token_id)
                    if cfg["gen_tokens"] else ids)
    t_gen = time.perf_counter() - t0
    xs, hs = calibration_activations(model, seqs)
    n_tok = xs[0].shape[0]
    rng = np.random.default_rng(int(cfg.get("seed", 0)))
    held = rng.random(n_tok) < float(cfg.get("heldout_fraction", 0.2))
    weights, biases, labels_all, quality = [], [], [], []
    for l, layer in enumerate(model.model.layers):
        h = hs[l]
        if h.shape[1] != n_exp * int(cfg["expert_size"]):
            raise ValueError(f"layer {l}: {h.shape[1]} neurons != n_experts {n_exp} x expert_size "
                             f"{cfg['expert_size']} (conf/moe.yaml moefy)")
        labels = balanced_kmeans(neuron_profiles(h[~held], int(cfg["profile_dims"])), n_exp,
                                 int(cfg["kmeans_iters"]), int(cfg.get("seed", 0)) + l)
        down2 = (layer.mlp.down_proj.weight.detach().numpy().astype(np.float64) ** 2).sum(0)
        energy = expert_energy(h, down2, labels, n_exp)
        share = energy / energy.sum(1, keepdims=True)
        w, b = fit_router(xs[l][~held], share[~held], int(cfg["router_iters"]), float(cfg["router_l2"]))
        rec, got, ideal = topk_quality(xs[l][held] @ w.T + b, energy[held], k)
        quality.append({"layer": l, "topk_recall": rec, "energy_captured": got, "energy_ideal": ideal})
        weights.append(w)
        biases.append(b)
        labels_all.append(labels)
        log.info("moefy layer %d: top-%d recall %.3f, energy %.3f (ideal %.3f)", l, k, rec, got, ideal)
    meta = {"proxy": True, "what": "shadow-routed MoEfied dense model (PROXY: not a real MoE)",
            "target": str(cfg.get("target") or "SmolLM2-135M-Instruct (calib.target)"),
            "expert_size": int(cfg["expert_size"]), "calibration_tokens": int(n_tok),
            "calibration_sequences": len(seqs), "heldout_tokens": int(held.sum()),
            "quality": quality, "mean_topk_recall": float(np.mean([q["topk_recall"] for q in quality])),
            "mean_energy_captured": float(np.mean([q["energy_captured"] for q in quality])),
            "runtime_s": {"generate": t_gen, "total": time.perf_counter() - t0},
            "config": {k_: v for k_, v in cfg.items() if k_ != "out"}}
    router = ShadowRouter(weights, biases, labels_all, k, meta)
    router.save(Path(root) / cfg["out"] if not Path(cfg["out"]).is_absolute() else cfg["out"])
    return router


def _index_in_file(p, prompts) -> int:
    """A prompt's index within its own file's category block (prompt_idx counts across files)."""
    same = [q.idx for q in prompts if q.category == p.category]
    return p.idx - min(same)
