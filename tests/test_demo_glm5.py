"""The shipped GLM-5 demo (omnimtp/data/demo_glm5): layout and size, `load_target_and_head` loads it, greedy
speculative output == plain == transformers' `generate` with the DSA indexer choosing fewer keys than the
sequence (IndexShare on and off, sampled-drafts-by-argmax too), `omnimtp spec --model` on it; the DSA
indexer loss trains a GLM-5 head's indexer (no other loss reaches it); `ArgmaxDrafts` drafts one-hot."""

import json

import pytest
import torch

from omnimtp import MTPHead, MTPTrainConfig, SamplingParams, demo_model_dir, speculative_generate
from omnimtp.models.tiny_lm import tiny_lm
from omnimtp.mtp.demo import demo_heldout_prompts, load_demo_model
from omnimtp.mtp.train import train_mtp_head
from omnimtp.spec_decode.generate import plain_generate
from omnimtp.spec_decode.proposer import ArgmaxDrafts, MTPProposer

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MAX_NEW_TOKENS = 12


@pytest.fixture(scope="module")
def demo():
    return load_demo_model("glm5")


def test_layout_size_and_config():
    model_dir = demo_model_dir("glm5")
    assert model_dir != demo_model_dir()
    names = {p.name for p in model_dir.iterdir()}
    assert {"config.json", "model-mtp.safetensors", "model.safetensors.index.json", "tokenizer.json",
            "heldout_prompts.json"} <= names
    assert sum(p.stat().st_size for p in model_dir.iterdir()) <= 30 * 2**20
    config = json.loads((model_dir / "config.json").read_text())
    assert config["model_type"] == "glm_moe_dsa" and config["num_nextn_predict_layers"] == 1
    assert config["index_share_for_mtp_iteration"] is True
    assert config["first_k_dense_replace"] < config["num_hidden_layers"] and config["n_routed_experts"] > 1  # MoE
    assert len(demo_heldout_prompts("glm5")) >= 32
    with pytest.raises(ValueError, match="name"):
        demo_model_dir("glm6")


def test_loads_with_its_head(demo):
    target, head, _ = demo
    assert target.config.model_type == "glm_moe_dsa" and not target.training
    assert head.is_dsa and head.index_share and head.block.self_attn.indexer is not None


def test_greedy_speculative_equals_plain_and_generate_with_sparse_selection(demo):
    target, head, tokenizer = demo
    for i, text in enumerate(demo_heldout_prompts("glm5")[:2]):
        prompt = tokenizer(text, return_tensors="pt").input_ids
        assert prompt.shape[1] > target.config.index_topk  # every decoded row selects among more keys than it keeps
        reference = target.generate(prompt, max_new_tokens=MAX_NEW_TOKENS, do_sample=False, eos_token_id=-1)
        plain = plain_generate(target, prompt, max_new_tokens=MAX_NEW_TOKENS, eos_token_id=[])
        assert torch.equal(plain, reference)
        drafters = [head] if i else [ArgmaxDrafts(MTPProposer(head))]
        for drafter in drafters:
            out = speculative_generate(target, drafter, prompt, max_new_tokens=MAX_NEW_TOKENS,
                                       num_draft_tokens=3 + 2 * i, eos_token_id=-1)
            assert torch.equal(out.sequences, reference)
    head.index_share = False
    try:
        out = speculative_generate(target, head, prompt, max_new_tokens=MAX_NEW_TOKENS, num_draft_tokens=3,
                                   eos_token_id=-1)
    finally:
        head.index_share = True
    assert torch.equal(out.sequences, reference)
    assert out.stats.mean_acceptance_length > 1.3  # the trained head drafts (a random one accepts ~nothing)


def test_spec_cli_on_the_glm5_demo(demo, capsys):
    from omnimtp.cli import main

    prompt = demo_heldout_prompts("glm5")[5]
    args = ["spec", "--model", str(demo_model_dir("glm5")), "--prompt", prompt, "-k", "3", "--max-new-tokens", "8",
            "--compare", "--json"]
    assert main(args) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["outputs_match"] is True


def test_argmax_drafts_are_one_hot_under_sampling():
    target = tiny_lm("glm_moe_dsa", seed=0, index_topk=4)
    torch.manual_seed(0)
    head = MTPHead.from_config(target)
    prompt = torch.randint(3, 64, (1, 7), generator=torch.Generator().manual_seed(0))
    greedy = speculative_generate(target, ArgmaxDrafts(MTPProposer(head)), prompt, max_new_tokens=6,
                                  num_draft_tokens=2)
    assert torch.equal(greedy.sequences, target.generate(prompt, max_new_tokens=6, do_sample=False))

    calls = []

    class Recording(MTPProposer):
        def propose(self, block, num_draft_tokens, sampling, generators):
            tokens, probs = super().propose(block, num_draft_tokens, sampling, generators)
            calls.append((sampling, generators, tokens, probs))
            return tokens, probs

    speculative_generate(target, ArgmaxDrafts(Recording(head)), prompt, max_new_tokens=6, num_draft_tokens=2,
                         sampling=SamplingParams(temperature=1.0), seed=0)
    for sampling, generators, tokens, probs in calls:
        assert sampling.is_greedy and generators is None
        assert torch.equal(probs, torch.nn.functional.one_hot(tokens, probs.shape[-1]).to(probs.dtype))


@pytest.mark.parametrize("indexer_weight", [0.0, 2.0])
def test_indexer_loss_trains_the_heads_indexer(indexer_weight):
    target = tiny_lm("glm_moe_dsa", seed=0, index_topk=4)
    torch.manual_seed(1)
    head = MTPHead.from_config(target)
    indexer = head.block.self_attn.indexer
    before = {name: p.detach().clone() for name, p in indexer.named_parameters()}
    stream = torch.randint(3, 64, (400,), generator=torch.Generator().manual_seed(2))
    config = MTPTrainConfig(steps=4, batch_size=2, seq_len=16, lr=1e-2, eval_every=4, checkpoint_every=4,
                            tv_weight=0.0, indexer_weight=indexer_weight)
    train_mtp_head(target, head, stream, stream, config, progress=False)
    changed = [not torch.equal(before[name], p) for name, p in indexer.named_parameters()]
    assert all(changed) if indexer_weight else not any(changed)
    with pytest.raises(ValueError, match="indexer_weight"):
        MTPTrainConfig(indexer_weight=-1.0)
