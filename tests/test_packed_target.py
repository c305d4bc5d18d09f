"""The packed target (omnimtp.spec_decode.packed_target) against transformers' forward on the same weights: logits of
prefill and decode (shipped demo LM; tiny Glm4Moe with dense + MoE layers, Qwen3, Llama, Qwen2), kv_mask holes +
crop, buffer growth, repacking after a weight edit; speculative decoding on it (`target_backend`) and the plain
`plain_generate` loop == `target.generate` greedy; seeded sampling repeats; backend selection and errors."""

import pytest
import torch
from transformers import (
    DynamicCache,
    Glm4MoeConfig,
    Glm4MoeForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from omnimtp import MTPHead, SamplingParams, plain_generate, speculative_generate
from omnimtp.models.tiny_lm import tiny_lm
from omnimtp.mtp.demo import demo_heldout_prompts, load_demo_model
from omnimtp.runtime.kv_cache import KVCache
from omnimtp.spec_decode.generate import _packed_or_none
from omnimtp.spec_decode.packed_target import packed_forward, packed_logits, packed_target, unsupported_reason

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ATOL = 1e-4
VOCAB = 64


def _common(**kw):
    return dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, max_position_embeddings=256, initializer_range=0.2,
                pad_token_id=0, eos_token_id=2, bos_token_id=1, **kw)


def _glm4_moe_grouped():
    """Dense layer 0, MoE layer 1 with 2 groups (top-1 group), non-zero correction bias, scaling 2.5, biases."""
    return Glm4MoeConfig(**_common(
        first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
        moe_intermediate_size=32, n_group=2, topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True,
        partial_rotary_factor=0.5, use_qk_norm=False, attention_bias=True,
    ))


CONFIGS = {
    "glm4_moe_grouped": (_glm4_moe_grouped, Glm4MoeForCausalLM),
    "qwen3": (lambda: Qwen3Config(**_common()), Qwen3ForCausalLM),
    "llama": (lambda: LlamaConfig(**_common()), LlamaForCausalLM),
    "qwen2": (lambda: Qwen2Config(**_common()), Qwen2ForCausalLM),
}


def _build(name: str, seed: int = 0):
    if name == "tiny_glm4_moe":  # qk norm, partial rotary, MoE layer 1
        return tiny_lm("glm4_moe", seed=seed)
    make_config, model_cls = CONFIGS[name]
    config = make_config()
    config._attn_implementation = "sdpa"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(config).eval()
        with torch.no_grad():
            for module in model.modules():
                if hasattr(module, "e_score_correction_bias"):
                    module.e_score_correction_bias.normal_(0.0, 0.1)
                if isinstance(module, torch.nn.Linear) and module.bias is not None:
                    module.bias.normal_(0.0, 0.2)
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = 2
    return model


@pytest.fixture(scope="module")
def demo():
    target, head, tokenizer = load_demo_model()
    prompts = [tokenizer(text, return_tensors="pt").input_ids for text in demo_heldout_prompts()[:3]]
    return target, head, prompts


def _reference(target, input_ids, position_ids, kv_mask, cache):
    """transformers' hidden and logits with the spec loop's conventions (no mask when all slots are valid)."""
    mask = None if bool(kv_mask.all()) else kv_mask
    hidden = target.get_decoder()(input_ids=input_ids, attention_mask=mask, position_ids=position_ids,
                                  cache=cache, use_cache=True).last_hidden_state
    return hidden, target.get_output_embeddings()(hidden).float()


def _compare_prefill_and_decode(target, prompt):
    packed = packed_target(target)
    cache, ref_cache = KVCache(packed, 1, capacity=8), DynamicCache(config=target.config)
    length = prompt.shape[1]
    steps = [(prompt, torch.arange(length)[None]),  # prefill (grows the 8-slot buffer)
             (prompt[:, :1], torch.tensor([[length]])),  # one token
             (prompt[:, 1:4], torch.arange(length + 1, length + 4)[None])]  # a verify-like block
    num_slots = 0
    with torch.inference_mode():
        for ids, positions in steps:
            num_slots += ids.shape[1]
            kv_mask = torch.ones(1, num_slots, dtype=torch.long)
            hidden = packed_forward(packed, cache, ids, positions, kv_mask)
            ref_hidden, ref_logits = _reference(target, ids, positions, kv_mask, ref_cache)
            torch.testing.assert_close(hidden, ref_hidden, atol=ATOL, rtol=0)
            torch.testing.assert_close(packed_logits(packed, hidden), ref_logits, atol=ATOL, rtol=0)
    assert cache.length == num_slots and cache.capacity >= num_slots


def test_demo_logits_match_transformers(demo):
    target, _, prompts = demo
    assert unsupported_reason(target) is None
    _compare_prefill_and_decode(target, prompts[0])


@pytest.mark.parametrize("name", ["tiny_glm4_moe", *CONFIGS])
def test_tiny_logits_match_transformers(name):
    target = _build(name)
    assert unsupported_reason(target) is None
    prompt = torch.randint(3, VOCAB, (1, 9), generator=torch.Generator().manual_seed(3))
    _compare_prefill_and_decode(target, prompt)


@pytest.mark.parametrize("name", ["glm4_moe_grouped", "qwen2"])
def test_bf16_logits_match_transformers(name):
    """bf16 rounds every op: biases inside the matmul, router in fp32, the MoE sum cast back as transformers
    does (a bias added after the matmul alone is off by ~0.1 here)."""
    target = _build(name).to(torch.bfloat16)
    prompt = torch.randint(3, VOCAB, (1, 9), generator=torch.Generator().manual_seed(3))
    packed = packed_target(target)
    with torch.inference_mode():
        hidden = packed_forward(packed, KVCache(packed, 1), prompt, torch.arange(9)[None])
        torch.testing.assert_close(packed_logits(packed, hidden), target(prompt).logits.float(), atol=0.03, rtol=0)


@pytest.mark.parametrize("name", ["tiny_glm4_moe", "glm4_moe_grouped", "qwen3"])
def test_kv_mask_holes_and_crop_match_transformers(name):
    """Ragged left-padded prefill, a 4-slot block, crop of 2 with row 0 keeping 1 slot (a hole), then
    another block: every real token's logits == transformers with the same cache operations and mask."""
    target = _build(name)
    packed = packed_target(target)
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(3, VOCAB, (2, 6), generator=g)
    kv_mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    ids[0, :2] = 0
    positions = (kv_mask.cumsum(-1) - 1).masked_fill(kv_mask == 0, 1)
    cache, ref_cache = KVCache(packed, 2), DynamicCache(config=target.config)
    block = torch.randint(3, VOCAB, (2, 4), generator=g)
    block_positions = positions[:, -1:] + 1 + torch.arange(4)
    next_block = torch.randint(3, VOCAB, (2, 3), generator=g)
    with torch.inference_mode():
        hidden = packed_forward(packed, cache, ids, positions, kv_mask)
        ref_hidden, _ = _reference(target, ids, positions, kv_mask, ref_cache)
        real = kv_mask.bool()
        torch.testing.assert_close(hidden[real], ref_hidden[real], atol=ATOL, rtol=0)
        assert torch.isfinite(hidden).all()  # padding queries see their own slot: no NaN leaks into K/V

        kv_mask = torch.cat([kv_mask, torch.ones(2, 4, dtype=torch.long)], dim=1)
        hidden = packed_forward(packed, cache, block, block_positions, kv_mask)
        ref_hidden, _ = _reference(target, block, block_positions, kv_mask, ref_cache)
        torch.testing.assert_close(hidden, ref_hidden, atol=ATOL, rtol=0)

        cache.crop(-2)
        ref_cache.crop(-2)
        assert cache.get_seq_length() == ref_cache.get_seq_length() == 8
        kv_mask = torch.cat([kv_mask[:, :6], torch.tensor([[1, 0], [1, 1]]), torch.ones(2, 3, dtype=torch.long)], 1)
        next_positions = torch.tensor([[5], [8]]) + torch.arange(3)
        hidden = packed_forward(packed, cache, next_block, next_positions, kv_mask)
        ref_hidden, ref_logits = _reference(target, next_block, next_positions, kv_mask, ref_cache)
        torch.testing.assert_close(hidden, ref_hidden, atol=ATOL, rtol=0)
        torch.testing.assert_close(packed_logits(packed, hidden), ref_logits, atol=ATOL, rtol=0)


def test_cache_crop_semantics_and_errors():
    packed = packed_target(_build("qwen3"))
    cache = KVCache(packed, 1, capacity=2)
    ids = torch.randint(3, VOCAB, (1, 5))
    with torch.inference_mode():
        packed_forward(packed, cache, ids, torch.arange(5)[None])
    assert cache.length == 5 and cache.capacity >= 5
    cache.crop(-2)
    assert cache.length == 3
    cache.crop(10)  # like DynamicCache: keeping more than there is keeps everything
    assert cache.length == 3
    cache.crop(1)
    assert cache.length == 1
    with pytest.raises(ValueError, match="batch_size"):
        KVCache(packed, 0)
    with pytest.raises(ValueError, match="kv_mask"):
        packed_forward(packed, cache, ids[:, :2], torch.arange(2)[None], torch.ones(1, 2))
    with pytest.raises(ValueError, match="input_ids"):
        packed_forward(packed, cache, ids[0], torch.arange(5))


def test_packed_target_is_repacked_after_a_weight_edit():
    target = _build("llama")
    first = packed_target(target)
    assert packed_target(target) is first
    with torch.no_grad():
        target.model.layers[1].mlp.down_proj.weight.mul_(2.0)
    second = packed_target(target)
    assert second is not first
    _compare_prefill_and_decode(target, torch.randint(3, VOCAB, (1, 6)))


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5])
def test_demo_greedy_packed_speculative_equals_generate(demo, k):
    target, head, prompts = demo
    for prompt in prompts:
        reference = target.generate(prompt, max_new_tokens=32, do_sample=False, eos_token_id=-1)
        out = speculative_generate(target, head, prompt, max_new_tokens=32, num_draft_tokens=k, eos_token_id=-1,
                                   target_backend="packed")
        assert torch.equal(out.sequences, reference)
        if k == 3:
            assert out.stats.mean_acceptance_length > 1.5  # the trained head really drafts
            assert torch.equal(plain_generate(target, prompt, max_new_tokens=32, eos_token_id=-1), reference)


def _ragged(prompts, lengths, pad_id):
    width = max(lengths)
    ids = torch.full((len(lengths), width), pad_id)
    mask = torch.zeros_like(ids)
    for row, (prompt, n) in enumerate(zip(prompts, lengths, strict=True)):
        ids[row, width - n:] = prompt[0, :n]
        mask[row, width - n:] = 1
    return ids, mask


def test_demo_greedy_packed_ragged_batch(demo):
    target, head, prompts = demo
    ids, mask = _ragged(prompts, (40, 25, 33), target.generation_config.pad_token_id)
    reference = target.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False, eos_token_id=-1)
    for k in (2, 4):
        out = speculative_generate(target, head, ids, mask, max_new_tokens=24, num_draft_tokens=k, eos_token_id=-1,
                                   target_backend="packed")
        assert torch.equal(out.sequences, reference)
    assert torch.equal(plain_generate(target, ids, mask, max_new_tokens=24, eos_token_id=-1), reference)


@pytest.mark.parametrize("name", ["tiny_glm4_moe", "glm4_moe_grouped", "qwen2"])
def test_tiny_greedy_ragged_with_eos(name):
    """Ragged batch, an EOS some rows emit mid-way: packed speculative and packed plain == generate."""
    target = _build(name)
    torch.manual_seed(1)
    head = MTPHead.from_config(target) if name != "qwen2" else None
    g = torch.Generator().manual_seed(5)
    ids, mask = _ragged([torch.randint(3, VOCAB, (1, 7), generator=g)] * 3, (7, 4, 6), 0)
    free = target.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, eos_token_id=-1)
    eos = int(free[0, ids.shape[1] + 3])
    reference = target.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, eos_token_id=eos)
    ids_before = ids.clone()
    assert torch.equal(plain_generate(target, ids, mask, max_new_tokens=12, eos_token_id=eos), reference)
    if head is not None:
        for k in (1, 3):
            out = speculative_generate(target, head, ids, mask, max_new_tokens=12, num_draft_tokens=k,
                                       eos_token_id=eos, target_backend="packed")
            assert torch.equal(out.sequences, reference)
    assert torch.equal(ids, ids_before)


def test_sampled_seeded_runs_repeat():
    target = _build("tiny_glm4_moe")
    torch.manual_seed(1)
    head = MTPHead.from_config(target)
    ids, mask = _ragged([torch.randint(3, VOCAB, (1, 6), generator=torch.Generator().manual_seed(9))] * 2, (6, 4), 0)
    sampling = SamplingParams(temperature=0.9, top_k=20)
    kwargs = dict(max_new_tokens=10, num_draft_tokens=3, sampling=sampling, seed=[3, 4], eos_token_id=-1)
    first = speculative_generate(target, head, ids, mask, target_backend="packed", **kwargs)
    again = speculative_generate(target, head, ids, mask, target_backend="packed", **kwargs)
    assert torch.equal(first.sequences, again.sequences)
    # Same draws in the same order on (rounding-level) equal logits: the transformers backend agrees.
    other = speculative_generate(target, head, ids, mask, target_backend="transformers", **kwargs)
    assert torch.equal(first.sequences, other.sequences)
    plain = [plain_generate(target, ids, mask, max_new_tokens=10, sampling=sampling, seed=[3, 4], eos_token_id=-1)
             for _ in range(2)]
    assert torch.equal(plain[0], plain[1])
    assert not torch.equal(plain[0], plain_generate(target, ids, mask, max_new_tokens=10, sampling=sampling,
                                                     seed=[5, 6], eos_token_id=-1))


def test_backend_selection_and_errors():
    target = _build("tiny_glm4_moe")
    torch.manual_seed(1)
    head = MTPHead.from_config(target)
    prompt = torch.randint(3, VOCAB, (1, 5))
    with pytest.raises(ValueError, match="target_backend"):
        speculative_generate(target, head, prompt, max_new_tokens=4, num_draft_tokens=2, target_backend="fast")
    assert _packed_or_none(target, "auto") is packed_target(target)
    assert _packed_or_none(target, "transformers") is None

    mla = tiny_lm("deepseek_v3", seed=0)  # MLA attention: not packable
    assert "deepseek_v3" in unsupported_reason(mla)
    torch.manual_seed(1)
    mla_head = MTPHead.from_config(mla)
    with pytest.raises(ValueError, match="target_backend='packed'.*deepseek_v3"):
        speculative_generate(mla, mla_head, prompt, max_new_tokens=4, num_draft_tokens=2, target_backend="packed")
    with pytest.raises(ValueError, match="target_backend='packed'.*deepseek_v3"):
        plain_generate(mla, prompt, max_new_tokens=4, target_backend="packed")
    with pytest.raises(ValueError, match="target_backend"):
        plain_generate(target, prompt, max_new_tokens=4, target_backend="fast")
    plain = mla.generate(prompt, max_new_tokens=8, do_sample=False, eos_token_id=-1)
    assert torch.equal(plain_generate(mla, prompt, max_new_tokens=8, eos_token_id=-1), plain)  # fell back
    assert torch.equal(plain_generate(target, prompt, max_new_tokens=8, eos_token_id=-1, target_backend="transformers"),
                       target.generate(prompt, max_new_tokens=8, do_sample=False, eos_token_id=-1))
    assert _packed_or_none(mla, "auto") is None
    reference = mla.generate(prompt, max_new_tokens=8, do_sample=False, eos_token_id=-1)
    out = speculative_generate(mla, mla_head, prompt, max_new_tokens=8, num_draft_tokens=2, eos_token_id=-1)
    assert torch.equal(out.sequences, reference)  # "auto" fell back to transformers
    with pytest.raises(ValueError, match="max_new_tokens"):
        plain_generate(target, prompt, max_new_tokens=0)


@pytest.mark.parametrize("backend", ["packed", "transformers"])
def test_a_cache_that_keeps_some_rows_goes_on_as_those_rows_did(backend):
    """`keep_cache_rows` (a speculative batch whose finished rows leave): the kept rows, in a new order, give
    the same next logits as they did in the whole batch."""
    from transformers import DynamicCache

    from omnimtp.runtime.kv_cache import keep_cache_rows
    from omnimtp.spec_decode.generate import _target_forward

    target = tiny_lm("glm4_moe", seed=0)
    packed = _packed_or_none(target, backend)
    ids = torch.randint(3, 64, (4, 7), generator=torch.Generator().manual_seed(3))
    positions = torch.arange(7).expand(4, -1)
    step, step_positions = ids[:, :1] + 1, torch.full((4, 1), 7)
    mask = torch.ones(4, 8, dtype=torch.long)

    def cache():
        return KVCache(packed, 4, capacity=16) if packed is not None else DynamicCache(config=target.config)

    with torch.inference_mode():
        whole = cache()
        _target_forward(target, packed, ids, positions, mask[:, :7], whole)
        _, expected, _ = _target_forward(target, packed, step, step_positions, mask, whole)
        some = cache()
        _target_forward(target, packed, ids, positions, mask[:, :7], some)
        keep_cache_rows(some, [3, 1])
        assert some.get_seq_length() == 7
        kept = torch.tensor([3, 1])
        _, logits, _ = _target_forward(target, packed, step[kept], step_positions[kept], mask[kept], some)
    torch.testing.assert_close(logits, expected[kept], atol=1e-5, rtol=0)
    assert torch.equal(logits.argmax(-1), expected[kept].argmax(-1))
    with pytest.raises(ValueError, match="slots|rows"):
        keep_cache_rows(some, [])
