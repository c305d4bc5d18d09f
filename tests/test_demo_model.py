"""The shipped demo checkpoint (omnimtp/data/demo_lm): size and layout, lossless greedy speculative decoding
on held-out prompts, a head that really drafts (τ well above a random head's ≈ 1), transformers' use_mtp."""

import json

import pytest
import torch

from omnimtp import demo_model_dir, speculative_generate
from omnimtp.mtp.demo import demo_heldout_prompts, load_demo_model

MAX_NEW_TOKENS = 32


@pytest.fixture(scope="module")
def demo():
    # One thread: on a busy 2-core machine two threads oversubscribe and each decode step slows down a lot.
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    target, head, tokenizer = load_demo_model()
    yield target, head, tokenizer
    torch.set_num_threads(num_threads)


def test_shipped_checkpoint_layout_and_size():
    model_dir = demo_model_dir()
    names = {p.name for p in model_dir.iterdir()}
    assert {"config.json", "model-mtp.safetensors", "model.safetensors.index.json", "tokenizer.json",
            "heldout_prompts.json"} <= names
    assert sum(p.stat().st_size for p in model_dir.iterdir()) <= 25 * 2**20
    config = json.loads((model_dir / "config.json").read_text())
    assert config["model_type"] == "glm4_moe" and config["num_nextn_predict_layers"] == 1
    assert config["first_k_dense_replace"] > config["num_hidden_layers"]  # every target layer dense
    weight_map = json.loads((model_dir / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(weight_map.values()) <= names
    mtp_keys = [k for k, v in weight_map.items() if v == "model-mtp.safetensors"]
    assert mtp_keys and all(k.startswith(f"model.layers.{config['num_hidden_layers']}.") for k in mtp_keys)


def test_greedy_speculative_equals_plain_greedy_on_heldout_prompts(demo):
    target, head, tokenizer = demo
    taus = []
    for text in demo_heldout_prompts()[:2]:
        prompt = tokenizer(text, return_tensors="pt").input_ids
        plain = target.generate(prompt, max_new_tokens=MAX_NEW_TOKENS, do_sample=False)
        out = speculative_generate(target, head, prompt, max_new_tokens=MAX_NEW_TOKENS, num_draft_tokens=3)
        assert torch.equal(out.sequences, plain)
        taus.append(out.stats.mean_acceptance_length)
    # A random head accepts almost nothing (τ ≈ 1); the trained one drafts most tokens.
    assert sum(taus) / len(taus) > 2.0


def test_ragged_batch_of_heldout_prompts_equals_plain_greedy(demo):
    target, head, tokenizer = demo
    texts = [t[: 60 + 60 * i] for i, t in enumerate(demo_heldout_prompts()[3:5])]
    tokenizer.padding_side = "left"
    batch = tokenizer(texts, return_tensors="pt", padding=True)
    plain = target.generate(**batch, max_new_tokens=16, do_sample=False)
    out = speculative_generate(target, head, batch.input_ids, batch.attention_mask, max_new_tokens=16,
                               num_draft_tokens=3)
    assert torch.equal(out.sequences, plain)


def test_transformers_use_mtp_on_the_shipped_checkpoint_equals_plain_greedy(demo):
    target, _, tokenizer = demo
    prompt = tokenizer(demo_heldout_prompts()[6], return_tensors="pt").input_ids
    plain = target.generate(prompt, max_new_tokens=24, do_sample=False)
    assert torch.equal(target.generate(prompt, max_new_tokens=24, do_sample=False, use_mtp=True), plain)


def test_spec_cli_defaults_to_the_shipped_model(demo, capsys):
    from omnimtp.cli import main

    prompt = demo_heldout_prompts()[7]
    assert main(["spec", "--prompt", prompt, "-k", "3", "--max-new-tokens", "16", "--compare", "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["outputs_match"] is True and result["mean_acceptance_length"] > 1.5
