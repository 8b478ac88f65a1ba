"""The parallel training-time-test unroll equals the engine's step-by-step drafting with a KV cache."""

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from calib.drafters.eagle import EagleHead
from calib.drafters.eagle.model import eagle_loss, replay_rounds


def _head_and_inputs():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    target = LlamaForCausalLM(cfg).eval()
    head = EagleHead(cfg).eval()
    for p in head.parameters():  # random init is near-identity in places; make every path matter
        p.data.normal_(0, 0.3)
    ids = torch.randint(0, 64, (2, 14), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        hidden = target(ids, output_hidden_states=True).hidden_states[-1]
    return head, target.get_input_embeddings()(ids[:, 1:]).detach(), hidden[:, :-1]


def _engine_chain(head, emb, hidden, anchor, steps):
    """What vLLM does for one anchor: prefill 0..anchor with target states, then feed the head its own
    output one position at a time (the true next token each time: the chain only goes on if accepted)."""
    cache = DynamicCache(config=head.config)

    def run(x, start):
        pos = torch.arange(start, start + x.shape[1])[None].expand(x.shape[0], -1)
        return head.layer(x, position_ids=pos, position_embeddings=head.rotary(x, pos),
                          past_key_values=cache, use_cache=True)

    out = run(head.fc(torch.cat([emb[:, :anchor + 1], hidden[:, :anchor + 1]], -1)), 0)[:, -1:]
    outs = [out]
    for s in range(1, steps):
        j = anchor + s
        out = run(head.fc(torch.cat([emb[:, j:j + 1], out], -1)), j)
        outs.append(out)
    return [o[:, 0] for o in outs]


def test_step_zero_is_the_plain_forward():
    head, emb, hidden = _head_and_inputs()
    with torch.no_grad():
        torch.testing.assert_close(head.unrolled(emb, hidden, 1)[0], head(emb, hidden), atol=1e-5, rtol=1e-4)


def test_unrolled_steps_match_step_by_step_drafting_with_a_kv_cache():
    head, emb, hidden = _head_and_inputs()
    steps = 4
    with torch.no_grad():
        par = head.unrolled(emb, hidden, steps)
        for anchor in [0, 3, 8]:
            ref = _engine_chain(head, emb, hidden, anchor, steps)
            for s in range(steps):
                # activations reach ~500 with these weights: compare relative to their scale
                err = (par[s][:, anchor + s] - ref[s]).abs().max() / ref[s].abs().max()
                assert err < 1e-5, f"anchor {anchor} step {s}: relative error {err:.2e}"
    # and the deeper steps really differ from teacher forcing (the test would pass vacuously otherwise)
    assert not torch.allclose(par[2], par[0], atol=1e-3)


def test_replayed_rounds_follow_the_engine():
    # anchors 0..7; from anchor 0: accept 2 -> next anchor 3: accept 0 -> 4: accept 3 -> 8: end
    assert replay_rounds([2, 9, 9, 0, 3, 9, 9, 9], 0) == (2 + 0 + 3) / 3
    assert replay_rounds([0, 0], 0) == 0.0 and replay_rounds([1], 5) is None


def test_loss_reports_per_step_agreement_and_accepted_length():
    head = _head_and_inputs()[0]
    target_ids = torch.randint(0, 64, (1, 15), generator=torch.Generator().manual_seed(4))
    embed = torch.nn.Embedding(64, 32)
    lm_head = torch.nn.Linear(32, 64, bias=False)
    hid = torch.randn(1, 15, 32, generator=torch.Generator().manual_seed(5))
    loss, parts = eagle_loss(head, embed, lm_head, target_ids, hid, steps=3, answer_from=4)
    loss.backward()  # every unrolled step is differentiable
    assert {"top1_step0", "top1_step1", "top1_step2", "accept_len", "accept_per_round"} <= parts.keys()
    assert 0 <= parts["accept_per_round"] <= 3 and 0 <= parts["accept_len"] <= 3
    assert head.fc.weight.grad is not None
