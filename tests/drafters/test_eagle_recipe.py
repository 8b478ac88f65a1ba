"""EAGLE recipe stages: the corpus keeps calib's own prompts out; hidden states are the post-norm
states vLLM hands the head; the training stage fits and exports on a tiny random target (synthetic)."""

import json
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaForCausalLM

from calib.drafters.eagle.corpus import build_corpus, excluded_prompts
from calib.drafters.eagle.distill import HiddenStateSequences, extract_hidden_states, hidden_state_count

ROOT = Path(__file__).resolve().parents[2]


def test_corpus_excludes_sample_and_test_prompts(tmp_path):
    kw = {"n_chat": 40, "n_rewrite": 10, "n_code_edit": 12, "seed": 3}
    corpus = build_corpus(exclude_dirs=[ROOT / "data" / "prompts"], **kw)
    assert corpus == build_corpus(exclude_dirs=[ROOT / "data" / "prompts"], **kw)  # deterministic
    assert {r["category"] for r in corpus} == {"chat", "code_edit"}
    ids, texts, files = excluded_prompts([ROOT / "data" / "prompts"])
    assert len(files) == 60 and len(texts) >= 120
    assert not ids & {r["id"] for r in corpus}
    assert not texts & {r["messages"][0]["content"] for r in corpus}
    assert not files & {r["source"]["file"] for r in corpus if "source" in r}
    # A prompt listed in an excluded file is dropped by its text (and, for code, by the file it quotes).
    banned = corpus[5]["messages"][0]["content"]
    code = next(r for r in corpus if "source" in r)
    (tmp_path / "held_out.jsonl").write_text(
        json.dumps({"id": "x-1", "category": "chat", "messages": [{"role": "user", "content": banned}]}) + "\n"
        + json.dumps({"id": "x-2", "category": "code_edit", "messages": [{"role": "user", "content": "edit"}],
                      "source": code["source"]}) + "\n")
    again = build_corpus(exclude_dirs=[ROOT / "data" / "prompts", tmp_path], **kw)
    assert banned not in {r["messages"][0]["content"] for r in again}
    assert code["source"]["file"] not in {r["source"]["file"] for r in again if "source" in r}


def _tiny_target_dir(path: Path) -> Path:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    LlamaForCausalLM(cfg).save_pretrained(path)
    return path


def _responses(n=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [{"id": f"s{i}", "category": "chat", "prompt_ids": torch.randint(0, 64, (5 + i,), generator=g).tolist(),
             "output_ids": torch.randint(0, 64, (20 + 3 * i,), generator=g).tolist()} for i in range(n)]


def test_hidden_states_are_post_norm_and_windows_cover_sequences(tmp_path):
    target_dir = _tiny_target_dir(tmp_path / "target")
    responses = _responses()
    out = extract_hidden_states(responses, str(target_dir), tmp_path / "hidden.safetensors", max_len=40)
    data = load_file(str(out))
    lengths = [min(40, len(r["prompt_ids"]) + len(r["output_ids"])) for r in responses]
    assert data["offsets"].tolist()[-1] == sum(lengths) == data["hidden"].shape[0]
    model = LlamaForCausalLM.from_pretrained(target_dir).eval()
    ids = torch.tensor([(responses[3]["prompt_ids"] + responses[3]["output_ids"])[:40]])
    with torch.no_grad():
        pre = model(ids, output_hidden_states=True).hidden_states
        post = model.model(ids).last_hidden_state
    a, b = data["offsets"][3].item(), data["offsets"][4].item()
    torch.testing.assert_close(data["hidden"][a:b].float(), post[0], atol=2e-2, rtol=2e-2)
    assert not torch.allclose(post[0], pre[-2][0], atol=1e-2)  # not a pre-norm residual state
    ds = HiddenStateSequences(out, indices=[3, 11], max_len=16)
    spans = [(w[0], w[1]) for w in ds.windows]
    assert spans[0][0] == a and all(e - s <= 16 for s, e in spans)
    assert sum(e - s for s, e in spans) == lengths[3] + lengths[11]
    assert ds[0]["hidden"].shape == (16, 32) and ds[0]["input_ids"].dtype == torch.long


def test_training_stage_fits_and_exports_on_a_tiny_target(tmp_path):
    from calib.drafters.eagle.recipe import train

    target_dir = _tiny_target_dir(tmp_path / "target")
    responses = _responses(20)
    (tmp_path / "responses.jsonl").write_text("".join(json.dumps(r) + "\n" for r in responses))
    hidden = extract_hidden_states(responses, str(target_dir), tmp_path / "hidden.safetensors")
    cfg = {"seed": 0, "logger": {"kind": "csv"},
           "train": {"window": 32, "val_fraction": 0.1, "max_epochs": 2, "max_time": None, "lr": 3e-3,
                     "weight_decay": 0.0, "warmup_steps": 2, "accumulate": 2, "token_weight": 0.3,
                     "hidden_noise": 0.05, "threads": None, "progress": False}}
    train(cfg, cfg["train"], str(target_dir), hidden, tmp_path / "head", tmp_path)
    tensors = load_file(str(tmp_path / "head" / "model.safetensors"))
    config = json.loads((tmp_path / "head" / "config.json").read_text())
    assert "fc.weight" in tensors and config["num_hidden_layers"] == 1 and config["calib_eagle"]["epoch"] == 1
    metrics = next(tmp_path.glob("eagle/*/metrics.csv")).read_text().splitlines()
    assert any("val_loss" in line and "val_accept_len" in line for line in metrics[:1]) and len(metrics) > 2
    # refinement (training-time test) starts from that head and writes its own
    refine = {**cfg["train"], "steps": 3, "step_decay": 0.8, "max_epochs": 1, "epoch_fraction": 0.5}
    train(cfg, refine, str(target_dir), hidden, tmp_path / "refined", tmp_path, init_from=tmp_path / "head")
    refined = load_file(str(tmp_path / "refined" / "model.safetensors"))
    assert refined.keys() == tensors.keys() and not torch.equal(refined["fc.weight"], tensors["fc.weight"])


def test_corpus_grows_without_changing_earlier_prompts():
    kw = {"n_chat": 30, "exclude_dirs": [ROOT / "data" / "prompts"], "seed": 1}
    small = build_corpus(n_rewrite=5, n_code_edit=6, **kw)
    big = build_corpus(n_rewrite=9, n_code_edit=10, n_howto=25, **kw)
    by_id = {r["id"]: r for r in big}
    assert all(by_id[r["id"]] == r for r in small)  # cached answers stay valid: same id, same prompt
    assert sum(r["id"].startswith("eagle-howto-") for r in big) == 25 and len(big) == len(small) + 33


def test_hidden_states_extend_when_the_corpus_grows(tmp_path):
    import pytest

    target_dir = _tiny_target_dir(tmp_path / "target")
    responses = _responses(10)
    whole = load_file(str(extract_hidden_states(responses, str(target_dir), tmp_path / "whole.safetensors")))
    part = tmp_path / "part.safetensors"
    extract_hidden_states(responses[:6], str(target_dir), part)
    assert hidden_state_count(part) == 6
    grown = load_file(str(extract_hidden_states(responses, str(target_dir), part)))
    assert hidden_state_count(part) == 10
    for k in whole:
        torch.testing.assert_close(grown[k], whole[k])
    changed = [dict(r) for r in responses]
    changed[2]["output_ids"] = changed[2]["output_ids"][::-1]
    with pytest.raises(ValueError, match="part.safetensors.*delete it"):
        extract_hidden_states(changed, str(target_dir), part)


def test_head_cost_ratio_counts_the_weights_both_models_multiply():
    """FLOPs per token are 2 x the matmul weights used: the head's fc + layer + shared lm_head vs the target's."""
    from calib.drafters.eagle.model import EagleHead, head_cost_ratio

    cfg = LlamaConfig(vocab_size=500, hidden_size=64, intermediate_size=96, num_hidden_layers=5,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    target = LlamaForCausalLM(cfg)
    head = EagleHead(cfg)

    def linear_weights(m):
        return sum(x.weight.numel() for x in m.modules() if isinstance(x, torch.nn.Linear))

    lm_head = target.lm_head.weight.numel()
    assert head_cost_ratio(cfg) == (linear_weights(head) + lm_head) / linear_weights(target)
    from transformers import AutoConfig

    from calib.target import prepare_target

    smol = AutoConfig.from_pretrained(prepare_target())  # SmolLM2-135M: the shipped head's budget is <= 0.25
    assert 0.2 < head_cost_ratio(smol) <= 0.25


def test_chunked_jsonl_survives_a_run_killed_mid_write(tmp_path):
    """A stage appends chunks; a kill can truncate the last line, which is cut off (and its chunk redone)."""
    import pytest

    from calib.drafters.eagle.distill import read_chunked_jsonl

    path = tmp_path / "responses.jsonl"
    path.write_text('{"id": "a"}\n{"id": "b"}\n{"id": "c", "outp')
    assert [r["id"] for r in read_chunked_jsonl(path)] == ["a", "b"]
    assert path.read_text() == '{"id": "a"}\n{"id": "b"}\n'
    path.write_text('{"id": "a"}\n{"id": "b"}')  # killed just before the newline
    assert [r["id"] for r in read_chunked_jsonl(path)] == ["a", "b"] and path.read_text().endswith("}\n")
    path.write_text('{"id": "a"}\nnot json\n{"id": "c"}\n')
    with pytest.raises(ValueError, match="line 2"):
        read_chunked_jsonl(path)
    assert read_chunked_jsonl(tmp_path / "absent.jsonl") == []
