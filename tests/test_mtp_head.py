"""MTPHead: structure, shared modules, checkpoint layout, round trip, transformers' use_mtp on our checkpoint."""

import json
import os

import pytest
import torch
from safetensors import safe_open

from omnimtp import MTPHead, load_target_and_head, speculative_generate
from omnimtp.models.tiny_lm import tiny_lm

FAMILIES = ["glm4_moe", "deepseek_v3"]


@pytest.fixture(scope="module", params=FAMILIES)
def target(request):
    return tiny_lm(request.param, seed=0)


def test_structure_and_only_own_parameters(target):
    torch.manual_seed(0)
    head = MTPHead.from_config(target)
    assert type(head.block) is type(target.model.layers[-1])
    assert head.block.self_attn.layer_idx == target.config.num_hidden_layers
    assert type(head.enorm) is type(target.model.norm) and type(head.shared_head_norm) is type(target.model.norm)
    assert head.eh_proj.in_features == 2 * target.config.hidden_size and head.eh_proj.bias is None
    assert head.embed_tokens is target.get_input_embeddings() and head.lm_head is target.get_output_embeddings()
    target_params = {id(p) for p in target.parameters()}
    assert not any(id(p) in target_params for p in head.parameters())
    assert not any(k.startswith(("embed", "lm_head")) for k in head.state_dict())


def test_forward_matches_the_formula(target):
    torch.manual_seed(1)
    head = MTPHead.from_config(target)
    ids = torch.randint(3, 64, (2, 5))
    prev = torch.randn(2, 5, target.config.hidden_size)
    out = head(ids, prev)
    x = head.eh_proj(torch.cat([head.enorm(target.model.embed_tokens(ids)), head.hnorm(prev)], -1))
    positions = torch.arange(1, 6)[None].expand(2, -1)
    cos_sin = target.model.rotary_emb(x, positions)
    mask = torch.full((5, 5), float("-inf")).triu(1)[None, None]
    expected = head.block(x, attention_mask=mask, position_ids=positions, position_embeddings=cos_sin)
    torch.testing.assert_close(out.hidden, expected)
    torch.testing.assert_close(out.logits, target.lm_head(head.shared_head_norm(expected)))
    # compute_logits=False skips the lm_head; logits() on any rows gives those rows' logits
    hidden_only = head(ids, prev, compute_logits=False)
    assert hidden_only.logits is None
    torch.testing.assert_close(hidden_only.hidden, out.hidden, rtol=0, atol=0)
    torch.testing.assert_close(head.logits(out.hidden[:, -1]), out.logits[:, -1])
    # an all-ones attention_mask is the same as none
    torch.testing.assert_close(head(ids, prev, attention_mask=torch.ones(2, 5, dtype=torch.long)).hidden, out.hidden)
    # with a cache, step by step == all at once
    cache = head.make_cache()
    first = head(ids[:, :3], prev[:, :3], cache=cache)
    second = head(ids[:, 3:], prev[:, 3:], cache=cache)
    torch.testing.assert_close(torch.cat([first.hidden, second.hidden], 1), out.hidden, atol=1e-5, rtol=1e-5)


def test_save_load_round_trip_and_key_layout(target, tmp_path):
    torch.manual_seed(2)
    head = MTPHead.from_config(target)
    target.save_pretrained(tmp_path)
    head.save_pretrained(tmp_path)
    n = target.config.num_hidden_layers
    with safe_open(os.path.join(tmp_path, "model-mtp.safetensors"), "pt") as f:
        keys = set(f.keys())
    with safe_open(os.path.join(tmp_path, "model-main.safetensors"), "pt") as f:
        # the block's keys are exactly what transformers writes for the target's own MoE layer
        layer_keys = {k.replace(f"model.layers.{n - 1}.", f"model.layers.{n}.") for k in f.keys() if f".{n - 1}." in k}
    own = {f"model.layers.{n}.{name}.weight" for name in ("enorm", "hnorm", "eh_proj", "shared_head.norm")}
    assert keys == layer_keys | own
    index = json.load(open(os.path.join(tmp_path, "model.safetensors.index.json")))
    assert set(index["weight_map"].values()) == {"model-main.safetensors", "model-mtp.safetensors"}
    loaded = MTPHead.from_pretrained(tmp_path, target)
    for (name, a), (_, b) in zip(head.state_dict().items(), loaded.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


def test_checkpoint_without_mtp_weights_raises(target, tmp_path):
    target.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="missing"):
        MTPHead.from_pretrained(tmp_path, target)
    with pytest.raises(ValueError, match="checkpoint_dir"):
        MTPHead.from_pretrained(tmp_path / "nope", target)


def test_greedy_equals_transformers_use_mtp_on_our_checkpoint(target, tmp_path):
    """transformers loads our head through its own MTP loader (which proves the key layout); greedy outputs
    of plain generate, generate(use_mtp=True) and speculative_generate agree."""
    torch.manual_seed(3)
    head = MTPHead.from_config(target)
    target.save_pretrained(tmp_path)
    head.save_pretrained(tmp_path)
    loaded_target, loaded_head = load_target_and_head(tmp_path)
    prompt = torch.randint(3, 64, (1, 6), generator=torch.Generator().manual_seed(4))
    plain = target.generate(prompt, max_new_tokens=12, do_sample=False)
    hf_mtp = loaded_target.generate(prompt, max_new_tokens=12, do_sample=False, use_mtp=True)
    ours = speculative_generate(loaded_target, loaded_head, prompt, max_new_tokens=12, num_draft_tokens=1)
    assert torch.equal(hf_mtp, plain) and torch.equal(ours.sequences, plain)


def test_first_draft_equals_transformers_mtp_draft(target, tmp_path):
    """Same weights, same inputs: our head's first draft logits equal transformers' MtpModel's."""
    from transformers.cache_utils import MtpCache
    from transformers.modeling_layers import MtpModel

    torch.manual_seed(5)
    head = MTPHead.from_config(target)
    target.save_pretrained(tmp_path)
    head.save_pretrained(tmp_path)
    loaded_target, loaded_head = load_target_and_head(tmp_path)
    mtp = MtpModel.from_pretrained(loaded_target)
    prompt = torch.randint(3, 64, (1, 7), generator=torch.Generator().manual_seed(6))
    hidden = loaded_target.model(prompt).last_hidden_state  # [1, 7, H] post-norm
    next_ids = torch.cat([prompt[:, 1:], torch.tensor([[9]])], 1)
    positions = torch.arange(1, 8)[None]
    _, hf_logits, _ = mtp(
        input_ids=next_ids, last_hidden_states=hidden, attention_mask=None, position_ids=positions,
        mtp_cache=MtpCache(config=loaded_target.config.get_mtp_config()),
    )
    ours = loaded_head(next_ids, hidden)
    torch.testing.assert_close(ours.logits[:, -1], hf_logits[:, -1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("top_k", [2, 4])  # some experts routed / every expert routed (the demo head's case)
def test_draft_step_matches_forward(top_k):
    """The packed step = forward (up to float rounding): a prefill, one-token steps that attend to the
    earlier slots, and a several-token block causal among itself; ragged rows behind a kv_mask."""
    target = tiny_lm("glm4_moe", seed=0)
    torch.manual_seed(3)
    head = MTPHead.from_config(target)
    head.block.mlp.gate.top_k = top_k
    assert head.supports_draft_step
    torch.nn.init.normal_(head.block.mlp.gate.weight, std=1.0)  # distinct routing weights per expert
    ids = torch.randint(3, 64, (1, 7))
    prev = torch.randn(1, 7, target.config.hidden_size)
    cache_a, cache_b = head.make_cache(), head.make_draft_cache(1, capacity=4)  # the packed cache grows
    expected = head(ids[:, :5], prev[:, :5], cache=cache_a)
    hidden, logits = head.draft_step(ids[:, :5], prev[:, :5], torch.arange(1, 6)[None], cache_b)
    torch.testing.assert_close(hidden, expected.hidden[:, -1:], atol=1e-5, rtol=1e-5)  # the drafting slot's
    torch.testing.assert_close(logits, expected.logits[:, -1], atol=1e-5, rtol=1e-5)
    for t in (5, 6):  # two steps: the second attends to the first step's cache slot
        position = torch.tensor([[t + 1]])
        expected = head(ids[:, t : t + 1], prev[:, t : t + 1], position_ids=position, cache=cache_a)
        hidden, logits = head.draft_step(ids[:, t : t + 1], prev[:, t : t + 1], position, cache_b)
        torch.testing.assert_close(hidden, expected.hidden, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(logits, expected.logits[:, 0], atol=1e-5, rtol=1e-5)
    assert cache_b.get_seq_length(head.layer_idx) == 7
    cache_a.crop(-4)
    cache_b.crop(-4)
    expected = head(ids[:, 3:7], prev[:, 3:7], position_ids=torch.arange(4, 8)[None], cache=cache_a)
    hidden, logits = head.draft_step(ids[:, 3:7], prev[:, 3:7], torch.arange(4, 8)[None], cache_b)
    torch.testing.assert_close(hidden, expected.hidden[:, -1:], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits, expected.logits[:, -1], atol=1e-5, rtol=1e-5)

    # two rows, the second left-padded by two slots: its real slots match the head alone on them
    batch_ids, batch_prev = ids[:, :5].repeat(2, 1), prev[:, :5].repeat(2, 1, 1)
    kv_mask = torch.ones(2, 5, dtype=torch.long)
    kv_mask[1, :2] = 0
    positions = torch.tensor([[1, 2, 3, 4, 5], [1, 1, 1, 2, 3]])
    batch_cache = head.make_draft_cache(2)
    hidden, logits = head.draft_step(batch_ids, batch_prev, positions, batch_cache, kv_mask, torch.tensor([4, 4]))
    alone = head(ids[:, 2:5], prev[:, 2:5])
    torch.testing.assert_close(hidden[1, 0], alone.hidden[0, -1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits[1], alone.logits[0, -1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits[0], head(ids[:, :5], prev[:, :5]).logits[0, -1], atol=1e-5, rtol=1e-5)
    # rows drafting from different slots: each row's own slot (causal: slot 3 sees slots 0..3 only)
    hidden, logits = head.draft_step(
        batch_ids, batch_prev, positions, head.make_draft_cache(2), kv_mask, torch.tensor([3, 4])
    )
    first_four = head(ids[:, :4], prev[:, :4])
    torch.testing.assert_close(hidden[0, 0], first_four.hidden[0, -1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits[0], first_four.logits[0, -1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits[1], alone.logits[0, -1], atol=1e-5, rtol=1e-5)


def test_draft_step_not_offered_for_deepseek_v3():
    assert not MTPHead.from_config(tiny_lm("deepseek_v3", seed=0)).supports_draft_step


def test_draft_rotary_tables_per_block_equal_the_one_position_tables_up_to_rounding():
    """The head's decoder makes rotary tables for DRAFT_ROPE_BLOCK positions per miss; each equals the
    one-position table (what the target's decode step uses) up to float rounding, across block edges."""
    from dataclasses import replace

    from omnimtp.mtp.head import DRAFT_ROPE_BLOCK

    torch.manual_seed(0)
    decoder = MTPHead.from_config(tiny_lm("glm4_moe", seed=0)).packed().decoder  # a head with a packed draft step
    assert decoder.step_rope_block == DRAFT_ROPE_BLOCK > 1
    exact = replace(decoder, step_rope={}, step_rope_block=1)
    for position in [0, 1, DRAFT_ROPE_BLOCK - 1, DRAFT_ROPE_BLOCK, 3 * DRAFT_ROPE_BLOCK + 5, 1000]:
        for ours, expected in zip(decoder.step_tables(position), exact.step_tables(position), strict=True):
            assert ours.shape == expected.shape
            torch.testing.assert_close(ours, expected, rtol=0, atol=1e-6)
