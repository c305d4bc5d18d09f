"""PackedDecoder (packed thinker / talker decode on a slot KV cache) against transformers' modules."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import DynamicCache
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeThinkerTextModel

from omnimtp.models.tiny import tiny_qwen3_omni
from omnimtp.packed_decoder import KVCache, PackedDecoder, decoder_forward
from omnimtp.runtime.decoder import decoder_layers
from omnimtp.runtime.ops import CAUSAL, attention, causal_mask, rms_norm
from omnimtp.talker.loop import TalkerBatch
from omnimtp.thinker import ThinkerRun

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ATOL = 2e-5


@pytest.fixture(scope="module")
def model():
    return tiny_qwen3_omni(0)


def _modules(model):
    return {"talker": model.talker.model, "thinker": model.thinker.model.language_model}


def _reference_run(module, chunks):
    """HF forward over successive chunks [1, T, H] with a DynamicCache → per chunk (last post-norm row
    [1, H], hidden_states tuple)."""
    cache = DynamicCache(config=module.config)
    outs = []
    with torch.no_grad():
        for chunk in chunks:
            out = module(inputs_embeds=chunk, cache=cache, use_cache=True, output_hidden_states=True)
            outs.append((out.last_hidden_state[:, -1], out.hidden_states))
    return outs


@pytest.mark.parametrize("name", ["talker", "thinker"])
def test_prefill_and_decode_match_the_module(model, name):
    module = _modules(model)[name]
    decoder = PackedDecoder.from_module(module)
    num_layers = len(module.layers)
    gen = torch.Generator().manual_seed(0)
    chunks = [torch.randn(1, 9, 64, generator=gen), torch.randn(1, 4, 64, generator=gen)]  # a square block, then
    chunks += [torch.randn(1, 1, 64, generator=gen) for _ in range(40)]  # one that continues it, then steps
    reference = _reference_run(module, chunks)
    cache = KVCache(decoder, max_batch_size=3, capacity=8)  # grows several times on the way
    for step, (chunk, (ref_last, ref_hidden)) in enumerate(zip(chunks, reference, strict=True)):
        layer = step % (num_layers + 1)
        out = decoder_forward(decoder, cache, chunk, [2], capture_layer=layer)
        assert torch.isfinite(ref_last).all(), f"step {step}: the reference itself is not finite"
        assert torch.isfinite(out.last_hidden).all(), f"step {step}: not finite"
        torch.testing.assert_close(out.last_hidden, ref_last, atol=ATOL, rtol=0)
        torch.testing.assert_close(out.captured, ref_hidden[layer], atol=ATOL, rtol=0)
    assert cache.lengths == [0, 0, 9 + 4 + 40] and cache.capacity >= 53


def test_mrope_with_equal_axes_is_1d_rope(model):
    for module in _modules(model).values():
        assert module.config.rope_parameters["mrope_section"] and module.config.rope_parameters["interleaved"]
        decoder = PackedDecoder.from_module(module)
        positions = torch.tensor([[0, 1, 2, 7], [100, 1000, 4000, 8191]])  # [R, T]
        cos, sin = module.rotary_emb(torch.empty(0), positions[None].expand(3, -1, -1))  # [R, T, D] each
        ours_cos, signed_sin = decoder.rope.tables(positions, torch.float32)  # [R, T, 1, D]
        half = decoder.head_dim // 2
        assert torch.equal(ours_cos[:, :, 0], cos)
        assert torch.equal(torch.cat([-signed_sin[..., :half], signed_sin[..., half:]], -1)[:, :, 0], sin)


def test_mrope_angles_match_the_module_on_distinct_axes(model):
    """[3, R, T] position ids with different temporal / height / width positions (vision rows): the
    interleaved M-RoPE tables equal the module's bit for bit."""
    gen = torch.Generator().manual_seed(4)
    for module in _modules(model).values():
        decoder = PackedDecoder.from_module(module)
        position_ids = torch.randint(0, 4096, (3, 2, 5), generator=gen)  # [3, R, T]
        cos, sin = module.rotary_emb(torch.empty(0), position_ids)  # [R, T, D] each
        ours_cos, signed_sin = decoder.rope.tables(position_ids, torch.float32)  # [R, T, 1, D]
        half = decoder.head_dim // 2
        assert torch.equal(ours_cos[:, :, 0], cos)
        assert torch.equal(torch.cat([-signed_sin[..., :half], signed_sin[..., half:]], -1)[:, :, 0], sin)
        assert not torch.equal(ours_cos, decoder.rope.tables(position_ids[0], torch.float32)[0])  # the axes matter


def test_batched_rows_equal_each_row_alone(model):
    """Ragged slots stepped together (any slot order, one sitting out) give each slot's solo result."""
    decoder = PackedDecoder.from_module(model.talker.model)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randn(1, n, 64, generator=gen) for n in (5, 11, 8)]
    steps = [torch.randn(3, 1, 64, generator=gen) for _ in range(6)]
    solo = []
    for r in range(3):
        cache = KVCache(decoder, 1)
        decoder_forward(decoder, cache, prompts[r], [0])
        solo.append([decoder_forward(decoder, cache, step[r : r + 1], [0]).last_hidden for step in steps])
    cache = KVCache(decoder, 4, capacity=4)
    for slot, prompt in zip((3, 0, 1), prompts, strict=True):
        decoder_forward(decoder, cache, prompt, [slot])
    for step, x in enumerate(steps):
        out = decoder_forward(decoder, cache, x, [3, 0, 1]).last_hidden  # rows in slot order 3, 0, 1
        for r in range(3):
            torch.testing.assert_close(out[r : r + 1], solo[r][step], atol=ATOL, rtol=0)  # mv vs gemm rounding only
    cache.keep([1, 3])  # compaction: slot 0 ← old slot 1 (prompt 2), slot 1 ← old slot 3 (prompt 0)
    assert cache.lengths == [8 + 6, 5 + 6, 0, 0]
    x = torch.randn(2, 1, 64, generator=gen)
    out = decoder_forward(decoder, cache, x, [0, 1]).last_hidden
    for r, prompt_index in enumerate((2, 0)):
        alone = KVCache(decoder, 1)
        decoder_forward(decoder, alone, prompts[prompt_index], [0])
        for step in steps:
            decoder_forward(decoder, alone, step[prompt_index : prompt_index + 1], [0])
        expected = decoder_forward(decoder, alone, x[r : r + 1], [0]).last_hidden
        torch.testing.assert_close(out[r : r + 1], expected, atol=ATOL, rtol=0)  # mv vs gemm rounding only


@pytest.mark.parametrize("name", ["talker", "thinker"])
def test_a_forward_without_a_cache_equals_one_into_an_empty_cache_bit_for_bit(model, name):
    """cache None: each row's positions 0..T-1 on its own keys and values (none kept), the same bits as a prompt's
    forward into an empty slot (rows of several prompts, captured states, every row after the final norm)."""
    decoder = PackedDecoder.from_module(_modules(model)[name])
    x = torch.randn(2, 13, 64, generator=torch.Generator().manual_seed(3))
    for capture_layer in (None, 1, decoder.num_layers):
        cached = decoder_forward(decoder, KVCache(decoder, 2, capacity=13), x, [0, 1], capture_layer, all_final=True)
        uncached = decoder_forward(decoder, None, x, None, capture_layer, all_final=True)
        for a, b in zip(cached, uncached, strict=True):
            assert (a is None and b is None) or torch.equal(a, b)
    one = decoder_forward(decoder, None, x[:1, :1], None)  # one position: no mask (a GEMM, not the step's mv)
    torch.testing.assert_close(
        one.last_hidden, decoder_forward(decoder, KVCache(decoder, 1), x[:1, :1], [0]).last_hidden, atol=ATOL, rtol=0
    )
    with pytest.raises(ValueError, match="slots must be None without a cache"):
        decoder_forward(decoder, None, x, [0, 1])


def test_a_saved_slot_loaded_elsewhere_goes_on_bit_for_bit(model):
    """`save` / `load` (a parked talker request): the sequence moved to another slot of a smaller buffer, beside
    another sequence, gives the same next hidden states as where it was."""
    decoder = PackedDecoder.from_module(model.talker.model)
    gen = torch.Generator().manual_seed(1)
    prompt, steps = torch.randn(1, 12, 64, generator=gen), torch.randn(3, 1, 1, 64, generator=gen)
    cache = KVCache(decoder, 2, capacity=16)
    decoder_forward(decoder, cache, prompt, [1])
    saved = cache.save(1)
    expected = [decoder_forward(decoder, cache, step, [1]).last_hidden for step in steps]
    other = KVCache(decoder, 3, capacity=4)  # grows as it loads
    decoder_forward(decoder, other, torch.randn(1, 3, 64, generator=gen), [0])
    other.load(2, saved)
    assert other.lengths == [3, 0, 12] and saved.length == 12
    for step, hidden in zip(steps, expected, strict=True):
        assert torch.equal(decoder_forward(decoder, other, step, [2]).last_hidden, hidden)


def test_dense_mlp_layers_match_the_module(model):
    config = copy.deepcopy(model.config.thinker_config.text_config)
    config.mlp_only_layers = [0]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(3)
        module = Qwen3OmniMoeThinkerTextModel(config).eval()
    for p in module.parameters():  # the default init leaves experts empty / tiny: make every path matter
        torch.nn.init.normal_(p, std=0.2)
    decoder = PackedDecoder.from_module(module)
    assert decoder.layers[0].num_experts == 0 and decoder.layers[1].num_experts > 0
    chunks = [torch.randn(1, 6, 64)] + [torch.randn(1, 1, 64) for _ in range(5)]
    cache = KVCache(decoder, 1)
    for chunk, (ref_last, _) in zip(chunks, _reference_run(module, chunks), strict=True):
        torch.testing.assert_close(decoder_forward(decoder, cache, chunk, [0]).last_hidden, ref_last, atol=ATOL, rtol=0)


def test_thinker_run_greedy_tokens_equal_generate(model):
    """Many greedy steps, a ragged batch of two: each row's tokens equal HF's batch-1 generate."""
    prompts = [[256, 262, 72, 101, 108, 108, 111, 257, 10, 256, 263, 10], [256, 262, 72, 105, 257, 10, 256, 263, 10]]
    run = ThinkerRun(model.thinker, prompts, accept_hidden_layer=1, eos_token_ids=set(), max_new_tokens=40)
    while not run.is_finished:
        run.step()
    for prompt, ours in zip(prompts, run.output_ids, strict=True):
        with torch.no_grad():
            ref = model.thinker.generate(
                input_ids=torch.tensor([prompt]), max_new_tokens=40, do_sample=False, eos_token_id=None,
            )
        assert ours == ref[0, len(prompt):].tolist()


def test_bad_input(model):
    decoder = PackedDecoder.from_module(model.talker.model)
    with pytest.raises(ValueError, match="model"):
        PackedDecoder.from_module(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="dtype"):
        PackedDecoder.from_module(model.talker.model, dtype=torch.int32)
    with pytest.raises(ValueError, match="max_batch_size"):
        KVCache(decoder, 0)
    with pytest.raises(ValueError, match="capacity"):
        KVCache(decoder, 1, capacity=0)
    cache = KVCache(decoder, 2)
    with pytest.raises(ValueError, match="embeds"):
        decoder_forward(decoder, cache, torch.randn(1, 1, 32), [0])
    with pytest.raises(ValueError, match="embeds"):
        decoder_forward(decoder, cache, torch.randn(1, 1, 64, dtype=torch.float64), [0])
    with pytest.raises(ValueError, match="embeds"):
        decoder_forward(decoder, cache, torch.randn(0, 1, 64), [])
    for slots in ([0, 1], [2], [-1], [True]):
        with pytest.raises(ValueError, match="slots"):
            decoder_forward(decoder, cache, torch.randn(1, 1, 64), slots)
    with pytest.raises(ValueError, match="slots"):
        decoder_forward(decoder, cache, torch.randn(2, 1, 64), [1, 1])
    with pytest.raises(ValueError, match="slots"):
        cache.keep([0, 0])
    with pytest.raises(ValueError, match="capture_layer"):
        decoder_forward(decoder, cache, torch.randn(1, 1, 64), [0], capture_layer=3)
    assert cache.lengths == [0, 0]  # nothing was written by the rejected calls
    with pytest.raises(ValueError, match="decoder"):
        TalkerBatch(model.talker, 2, decoder="packed")
    with pytest.raises(ValueError, match="decoder"):
        ThinkerRun(model.thinker, [[1, 2]], accept_hidden_layer=1, eos_token_ids=set(), max_new_tokens=2, decoder=1)
    with pytest.raises(ValueError, match="accept_hidden_layer"):
        ThinkerRun(model.thinker, [[1, 2]], accept_hidden_layer=5, eos_token_ids=set(), max_new_tokens=2)
    with pytest.raises(ValueError, match="prompts"):
        ThinkerRun(model.thinker, [[1, 2], []], accept_hidden_layer=1, eos_token_ids=set(), max_new_tokens=2)


def test_big_expert_weights_are_shared_not_copied(model):
    """The routed experts and the shared expert are transformers' own tensors (no second copy in memory)."""
    module = model.talker.model
    layer, mlp = PackedDecoder.from_module(module).layers[0], module.layers[0].mlp
    assert layer.expert_gate_up.data_ptr() == mlp.experts.gate_up_proj.data_ptr()
    assert layer.expert_down.data_ptr() == mlp.experts.down_proj.data_ptr()
    assert layer.shared_gate_proj.data_ptr() == mlp.shared_expert.gate_proj.weight.data_ptr()
    assert layer.shared_up_proj.data_ptr() == mlp.shared_expert.up_proj.weight.data_ptr()
    assert layer.mlp_down.data_ptr() == mlp.shared_expert.down_proj.weight.data_ptr()


def test_tiny_model_builds_are_identical_and_finite():
    """transformers leaves the talker's routed experts as `torch.empty`; `tiny_qwen3_omni` must draw
    them from its seed. With uninitialised memory filled with NaN, a missed tensor would show."""
    previous = torch.utils.deterministic.fill_uninitialized_memory
    torch.utils.deterministic.fill_uninitialized_memory = True
    try:
        first, second = tiny_qwen3_omni(3).state_dict(), tiny_qwen3_omni(3).state_dict()
    finally:
        torch.utils.deterministic.fill_uninitialized_memory = previous
    for name, tensor in first.items():
        assert torch.equal(tensor, second[name]), name
        if tensor.is_floating_point():
            assert torch.isfinite(tensor).all(), name
    experts = first["talker.model.layers.0.mlp.experts.gate_up_proj"]
    assert experts.std() > 0.1  # drawn at initializer_range, not left near zero


@pytest.mark.parametrize("name", ["talker", "thinker", "dense"])
def test_one_row_decode_step_equals_the_general_path_bit_for_bit(model, name):
    """decoder_forward's batch-1 decode step (RoPE rows cached per position, no mask, torch.mv kernels)
    against the layers run with freshly computed RoPE tables on an identical cache."""
    if name == "dense":
        config = copy.deepcopy(model.config.thinker_config.text_config)
        config.mlp_only_layers = [0]
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(3)
            module = Qwen3OmniMoeThinkerTextModel(config).eval()
        for p in module.parameters():
            torch.nn.init.normal_(p, std=0.2)
    else:
        module = _modules(model)[name]
    decoder = PackedDecoder.from_module(module)
    num_layers = len(decoder.layers)
    gen = torch.Generator().manual_seed(5)
    prompt = torch.randn(1, 6, 64, generator=gen)
    fast, general = KVCache(decoder, 2, capacity=8), KVCache(decoder, 2, capacity=8)  # both grow
    decoder_forward(decoder, fast, prompt, [1])
    decoder_forward(decoder, general, prompt, [1])
    for step in range(12):
        x = torch.randn(1, 1, 64, generator=gen)
        layer = step % (num_layers + 2) if step % (num_layers + 2) <= num_layers else None
        ours = decoder_forward(decoder, fast, x, [1], capture_layer=layer)
        where = general.plan([1], 1)
        rope = decoder.rope.tables(torch.tensor([[where.start]]), x.dtype)
        hidden, captured = decoder_layers(decoder, x, rope, general.buffer, where, None, layer)
        general.commit([1], 1)
        last_hidden = rms_norm(hidden[:, -1], decoder.final_norm, decoder.eps)
        if layer == num_layers:
            captured = last_hidden[:, None]
        assert torch.equal(ours.last_hidden, last_hidden), step
        assert (ours.captured is None) == (captured is None)
        if layer is not None:
            assert ours.captured.shape == (1, 1, 64) and torch.equal(ours.captured, captured), step
    assert fast.lengths == general.lengths == [0, 18]
    assert torch.equal(fast.buffer, general.buffer)


@pytest.mark.parametrize("num_positions", [2, 37])
def test_a_square_causal_block_runs_sdpa_is_causal_with_the_masks_values(num_positions):
    """`CAUSAL` (what `decoder_forward` passes for every row's first T positions) gives the bits of the bool
    causal mask it stands for (SDPA's is_causal skips the blocks above the diagonal), with grouped heads."""
    generator = torch.Generator().manual_seed(num_positions)
    query = torch.randn(2, num_positions, 8, 16, generator=generator)
    keys, values = (torch.randn(2, 2, num_positions, 16, generator=generator) for _ in range(2))
    expected = attention(query, keys, values, causal_mask(num_positions, query.device), 0.25)
    assert torch.equal(attention(query, keys, values, CAUSAL, 0.25), expected)
    # the row after the last one is not visible: the output differs from every column visible
    assert not torch.equal(attention(query, keys, values, None, 0.25), expected)
