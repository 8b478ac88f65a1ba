"""vLLM routed_experts -> public routing layout, keyed like the collector's bank (SYNTHETIC rounds)."""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from calib.bank import read_routing, schema, validate, write_bank
from calib.collect.assemble import RunKeys, build_tables
from calib.cost.trajectories import Trajectories
from calib.moe.vllm_routing import routing_rows
from tests.engine_identity import assert_runs_match

ROOT = Path(__file__).resolve().parents[2]


def _rounds(rng, prompt_len, n_rounds, k=3):
    """SYNTHETIC captured records: context grows by accepted + 1 per round."""
    recs, ctx = [], prompt_len + 1  # the prefill's token is committed before the first round
    for step in range(n_rounds):
        drafted = rng.integers(0, 100, size=int(rng.integers(1, k + 1))).tolist()
        acc = int(rng.integers(0, len(drafted) + 1))
        recs.append({"req": "r", "step": step, "batch_size": 2, "drafted": drafted, "accepted": acc,
                     "context_len": ctx, "prompt_len": prompt_len, "ngram_tokens": drafted,
                     "ngram": {name: (True if name == "in_prompt" else 1) for name in schema.NGRAM_FEATURES}})
        ctx += acc + 1
    return recs, ctx


def test_routed_experts_become_a_valid_routing_bank(tmp_path):
    rng = np.random.default_rng(0)
    rounds, routed, finals = {}, {}, {}
    for idx, plen in ((0, 7), (1, 12)):
        rounds[idx], end = _rounds(rng, plen, 6)
        routed[idx] = np.argsort(rng.random((end - 1, 4, 16)), axis=2)[..., :2]  # [seq_len, layers, top_k]
        finals[idx] = list(range(end))
    keys = RunKeys("synthetic-moe", "ngram", "ngram-k3", 3, 3, True, 0.0)
    acc, spec, ng = build_tables(rounds, {0: "chat", 1: "code_edit"}, finals, keys)
    arr, meta = routing_rows(rounds, routed, {0: "chat", 1: "code_edit"}, "synthetic-moe", "ngram", "ngram-k3")
    bank = write_bank(tmp_path / "b", acc, spec, ng, routing=(arr, meta),
                      manifest={"routing": {"n_experts": 16, "top_k": 2, "layers": 4, "proxy": False}})
    assert validate(str(bank)) == []
    tr = Trajectories.from_bank(bank)
    # Accepted positions of every round = the whole generated trajectory from the prompt's end.
    assert [s.shape[0] for s in tr.seqs] == [sum(r["accepted"] + 1 for r in rounds[i]) for i in (0, 1)]
    first = meta.column("position").to_pylist()[0]
    np.testing.assert_array_equal(arr[0], routed[0][first])


@pytest.mark.engine
def test_collector_captures_moe_routing_from_vllm(tmp_path):
    """Slow (~40 s): a tiny RANDOM-weight Mixtral (SYNTHETIC, 2 layers, 8 experts, top-2) through
    `python collect.py routing.capture=true`; the routing hook's records become a valid routing bank whose
    accepted positions agree with vLLM's committed tokens, and capture does not change the output."""
    pytest.importorskip("vllm")
    import torch
    from transformers import AutoTokenizer, MixtralConfig, MixtralForCausalLM

    from calib.moe.vllm_routing import attach
    from calib.target import prepare_target

    tok = AutoTokenizer.from_pretrained(prepare_target())
    cfg = MixtralConfig(vocab_size=len(tok), hidden_size=256, intermediate_size=256, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2,
                        max_position_embeddings=1024, tie_word_embeddings=False,
                        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    MixtralForCausalLM(cfg).to(torch.bfloat16).save_pretrained(tmp_path / "tiny-mixtral")
    tok.save_pretrained(tmp_path / "tiny-mixtral")

    def collect(out, routing):
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_LOGGING_LEVEL": "WARNING"}
        cmd = [sys.executable, "collect.py", f"out_dir={out}", "prompts=smoke", "sampling.max_tokens=32",
               "progress=false", "model.name=tiny-mixtral", f"model.cache_dir={tmp_path}", "engine.max_model_len=1024",
               "engine.dtype=float32", f"routing.capture={'true' if routing else 'false'}"]
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False)
        assert proc.returncode == 0, proc.stderr[-4000:]

    collect(tmp_path / "on", True)
    collect(tmp_path / "off", False)
    # float32: identity that holds on any CPU; a parting is accepted only at a float tie of the target.
    assert_runs_match(tmp_path / "on", tmp_path / "off", ("routing on", "routing off"),
                      model_dir=tmp_path / "tiny-mixtral")
    bank = attach(tmp_path / "on", n_experts=8)
    assert validate(bank) == []
    rt = read_routing(bank)
    assert rt.experts.shape[1:] == (2, 2) and rt.meta.num_rows > 0
    # Every round's block: block index 0 sits at context_len - 1 and positions are consecutive.
    meta = rt.meta.to_pandas()
    assert (meta.groupby(["prompt_idx", "round_idx"])["position"].agg(lambda p: p.diff().dropna().eq(1).all())).all()


def test_shadow_router_hook_matches_the_router(tmp_path):
    """The collector's shadow-router hook picks what ShadowRouter.route picks (SYNTHETIC router)."""
    import torch

    from calib.moe.moefy import ShadowRouter
    from calib.vllm.capture import hook_shadow_router

    rng = np.random.default_rng(0)
    H, E, L = 8, 6, 3
    router = ShadowRouter([rng.normal(size=(E, H)).astype(np.float32) for _ in range(L)],
                          [rng.normal(size=E).astype(np.float32) for _ in range(L)],
                          [np.arange(12) % E for _ in range(L)], 2, {"synthetic": True})
    router.save(tmp_path / "router")

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.mlp = torch.nn.Linear(H, H)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList([Layer() for _ in range(L)])

        def forward(self, x):
            for layer in self.layers:
                x = layer.mlp(x)
            return x

    class Rec:
        def __init__(self):
            self.moe_rows = []

        def error(self, where, exc):
            raise exc

    net, rec = Net(), Rec()
    hook_shadow_router(rec, net, {"dir": str(tmp_path / "router")})
    x = torch.randn(5, H)
    with torch.no_grad():
        net(x)
        rows = list(rec.moe_rows)  # the recomputation below fires the hooks again
        inputs = [x]
        for layer in net.layers[:-1]:
            inputs.append(layer.mlp(inputs[-1]))
    assert len(rows) == L
    for layer in range(L):
        got = np.sort(rows[layer].numpy(), axis=1)
        want = np.sort(router.route(layer, inputs[layer].numpy()), axis=1)
        np.testing.assert_array_equal(got, want)
