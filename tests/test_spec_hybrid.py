"""Hybrid targets (Qwen3-Next, Qwen3.5, Qwen3.5-MoE: Gated-DeltaNet layers + full attention): greedy speculative
decoding == `generate` for k = 1..4, batch 1 and a ragged batch of 3 whose rows accept different numbers of drafts;
a rollback leaves exactly the state of decoding the kept tokens one by one; their MTP heads (`mtp.*`)."""

import contextlib
import importlib

import pytest
import torch
from spec_checkpoints import train_save_load_and_spec
from spec_drafters import RecomputingDraft, ragged_batch
from transformers import DynamicCache

from omnimtp import MTPHead, speculative_generate
from omnimtp.models.tiny_lm import tiny_lm
from omnimtp.spec_decode import hybrid
from omnimtp.spec_decode.hybrid import crop_attention, linear_layer_indices, rollback, snapshot, verify_blocks

pytestmark = pytest.mark.usefixtures("one_torch_thread")

FAMILIES = ["qwen3_next", "qwen3_5", "qwen3_5_moe"]


@pytest.fixture(scope="module", params=FAMILIES)
def target(request):
    return tiny_lm(request.param, seed=0)


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_greedy_identical_to_generate(target, k):
    """A drafter right ~70% of the time makes rows accept 0..k drafts, differently per row and step, so every
    rollback length occurs; the random MTP head (almost always rejected) drafts on the same prompts."""
    torch.manual_seed(1)
    head = MTPHead.from_config(target)
    for ids, mask in (ragged_batch(seed=k),
                      (torch.randint(3, 64, (1, 6), generator=torch.Generator().manual_seed(k)), None)):
        reference = target.generate(ids, attention_mask=mask, max_new_tokens=14, do_sample=False, eos_token_id=-1)
        for drafter in (RecomputingDraft(target, corrupt_rate=0.3, seed=k), head):
            out = speculative_generate(target, drafter, ids, mask, max_new_tokens=14, num_draft_tokens=k,
                                       eos_token_id=-1)
            assert torch.equal(out.sequences, reference), (type(drafter).__name__, ids.shape)
        stats = out.stats
        assert stats.num_generated_tokens == 14 * ids.shape[0]


def _linear_attention_module(target):
    """transformers' modeling module of the target's linear-attention layers (where its delta rules live)."""
    layer = target.get_decoder().layers[linear_layer_indices(target)[0]]
    return importlib.import_module(type(layer.linear_attn).__module__)


def test_drafts_accepted_partially_and_fully(target, monkeypatch):
    """The drafter of the greedy test really exercises partial rollbacks and the all-accepted path; its verify
    blocks run the linear layers' recurrent rule."""
    ids, mask = ragged_batch(seed=9)
    module = _linear_attention_module(target)
    recurrent, block_widths = module.torch_recurrent_gated_delta_rule, []
    monkeypatch.setattr(module, "torch_recurrent_gated_delta_rule",
                        lambda query, *a, **kw: block_widths.append(query.shape[1]) or recurrent(query, *a, **kw))
    out = speculative_generate(
        target, RecomputingDraft(target, corrupt_rate=0.3, seed=9), ids, mask, max_new_tokens=14,
        num_draft_tokens=3, eos_token_id=-1,
    )
    rates = out.stats.acceptance_per_position
    assert 0.2 < rates[0] < 0.95 and rates[2] > 0.05, rates
    assert block_widths.count(4) == out.stats.num_steps * len(linear_layer_indices(target)), block_widths


def test_rollback_equals_decoding_the_kept_tokens(target):
    """After a 4-token block, rows keeping 1, 3 and 4 tokens hold the conv/recurrent states (and attention
    slots) of a cache that read only those tokens, one decode step at a time."""
    layers = linear_layer_indices(target)
    assert layers and len(layers) < target.config.num_hidden_layers
    decoder = target.get_decoder()
    prompt = torch.randint(3, 64, (3, 5), generator=torch.Generator().manual_seed(0))
    block = torch.randint(3, 64, (3, 4), generator=torch.Generator().manual_seed(1))
    num_kept = torch.tensor([1, 3, 4])
    positions = torch.arange(5, 9)[None].expand(3, -1)
    with torch.inference_mode():
        cache = DynamicCache(config=target.config)
        decoder(input_ids=prompt, cache=cache, use_cache=True)
        saved = snapshot(cache, layers)
        out = decoder(input_ids=block, position_ids=positions, cache=cache, use_cache=True, output_hidden_states=True)
        crop_attention(cache, 4 - 3)  # the batch keeps max n_b = 3 slots
        rollback(target, cache, saved, out.hidden_states, num_kept)
        for row in range(3):
            alone = DynamicCache(config=target.config)
            decoder(input_ids=prompt[row : row + 1], cache=alone, use_cache=True)
            for t in range(int(num_kept[row])):
                decoder(input_ids=block[row : row + 1, t : t + 1], position_ids=positions[:1, t : t + 1], cache=alone,
                        use_cache=True)
            for i in layers:
                for ours, theirs in zip((cache.layers[i].conv_states[0], cache.layers[i].recurrent_states[0]),
                                        (alone.layers[i].conv_states[0], alone.layers[i].recurrent_states[0]),
                                        strict=True):
                    torch.testing.assert_close(ours[row], theirs[0], atol=1e-5, rtol=1e-4)
        attention = next(i for i in range(target.config.num_hidden_layers) if i not in layers)
        assert cache.layers[attention].get_seq_length() == 5 + 3
    # nothing to undo when every row keeps the whole block
    with torch.inference_mode():
        before = [state.clone() for state in (cache.layers[layers[0]].conv_states[0],
                                              cache.layers[layers[0]].recurrent_states[0])]
        rollback(target, cache, snapshot(cache, layers), out.hidden_states, torch.tensor([4, 4, 4]))
        assert torch.equal(cache.layers[layers[0]].conv_states[0], before[0])


def test_a_verify_block_runs_the_recurrent_rule_and_other_forwards_keep_chunks(target, monkeypatch):
    """Inside `verify_blocks` a cached block of up to RECURRENT_MAX_TOKENS tokens takes the linear layers'
    recurrent rule (the decode step's: the states match decoding the block token by token); a longer block, a
    block over the state budget and every forward outside keep transformers' chunked rule."""
    decoder = target.get_decoder()
    layers = linear_layer_indices(target)
    prompt = torch.randint(3, 64, (3, 5), generator=torch.Generator().manual_seed(0))
    block = torch.randint(3, 64, (3, 12), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(5, 17)[None].expand(3, -1)
    calls = []

    def states_after(width: int, verifying: bool, steps: bool = False):
        cache = DynamicCache(config=target.config)
        decoder(input_ids=prompt, cache=cache, use_cache=True)
        module = _linear_attention_module(target)
        with verify_blocks(target) if verifying else contextlib.nullcontext():
            chunked, recurrent = module.torch_chunk_gated_delta_rule, module.torch_recurrent_gated_delta_rule
            monkeypatch.setattr(module, "torch_recurrent_gated_delta_rule",
                                lambda *a, **kw: calls.append("recurrent") or recurrent(*a, **kw))
            for t0, t1 in ([(t, t + 1) for t in range(width)] if steps else [(0, width)]):
                decoder(input_ids=block[:, t0:t1], position_ids=positions[:, t0:t1], cache=cache, use_cache=True)
            monkeypatch.setattr(module, "torch_recurrent_gated_delta_rule", recurrent)
            assert module.torch_chunk_gated_delta_rule is chunked
        return [(cache.layers[i].conv_states[0], cache.layers[i].recurrent_states[0]) for i in layers]

    with torch.inference_mode():
        decoded = states_after(4, verifying=False, steps=True)
        calls.clear()
        verified = states_after(4, verifying=True)
        assert calls == ["recurrent"] * len(layers)  # one call a linear layer, for the whole block
        for ours, theirs in zip(verified, decoded, strict=True):
            for a, b in zip(ours, theirs, strict=True):
                torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
        calls.clear()
        states_after(4, verifying=False)
        states_after(hybrid.RECURRENT_MAX_TOKENS + 1, verifying=True)
        monkeypatch.setattr(hybrid, "RECURRENT_MAX_STATE_BYTES", 0)
        states_after(4, verifying=True)
        assert calls == []


def test_head_structure_and_mtp_keys(target, tmp_path):
    torch.manual_seed(2)
    head = MTPHead.from_config(target)
    assert head.layout == "mtp_prefix" and head.checkpoint_prefix == "mtp."
    assert head.block.self_attn is not None and not hasattr(head.block, "linear_attn")  # a full-attention layer
    path = head.save_pretrained(tmp_path)
    from safetensors import safe_open

    with safe_open(path, "pt") as f:
        keys = set(f.keys())
    assert {f"mtp.{name}.weight" for name in ("fc", "pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")} <= keys
    assert all(k.startswith(("mtp.layers.0.", "mtp.fc.", "mtp.pre_fc_norm", "mtp.norm.")) for k in keys)
    if hasattr(head.block.mlp, "experts"):  # one module per expert, like the released checkpoints
        assert "mtp.layers.0.mlp.experts.0.gate_proj.weight" in keys and "mtp.layers.0.mlp.gate.weight" in keys
    config = target.config.get_text_config(decoder=True)
    config.mtp_num_hidden_layers = 2
    try:
        with pytest.raises(ValueError, match="mtp_num_hidden_layers"):
            MTPHead(target)
    finally:
        config.mtp_num_hidden_layers = 1


def test_train_mtp_cli_save_load_and_spec_cli(target, tmp_path, capsys):
    train_save_load_and_spec(target, tmp_path, capsys)
