"""MTP speculative decoding on a quantized target (`quantize=` of `speculative_generate` / `plain_generate`,
`omnimtp spec --quantize`): greedy speculative == greedy plain on the same quantized target (shipped demo LM; a tiny
glm4_moe with routed experts, ragged); the packed quantized target == the transformers model run with the
dequantized weights (what is quantized: every layer's linears and routed experts, the LM head in int8); a row's bits
are its own in any batch; refusals name `quantize`."""

import copy
import json

import pytest
import torch

from omnimtp import MTPHead, plain_generate, speculative_generate
from omnimtp.cli import main
from omnimtp.models.tiny_lm import tiny_lm
from omnimtp.mtp.demo import demo_heldout_prompts, load_demo_model
from omnimtp.runtime.kv_cache import KVCache
from omnimtp.spec_decode.packed_target import packed_forward, packed_logits, packed_target

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def demo():
    target, head, tokenizer = load_demo_model()
    prompts = [tokenizer(text, return_tensors="pt").input_ids for text in demo_heldout_prompts()[:3]]
    return target, head, prompts


@pytest.mark.parametrize("mode", ["int8", "int4", "w4a8"])
def test_greedy_speculative_equals_greedy_plain_on_the_quantized_demo(demo, mode):
    target, head, prompts = demo
    for prompt in prompts:
        plain = plain_generate(target, prompt, max_new_tokens=32, eos_token_id=-1, quantize=mode)
        for k in (1, 3):
            out = speculative_generate(target, head, prompt, max_new_tokens=32, num_draft_tokens=k, eos_token_id=-1,
                                       quantize=mode)
            assert torch.equal(out.sequences, plain)
            assert out.stats.mean_acceptance_length > 1.5  # the float head still drafts for the quantized target
    assert packed_target(target, mode).quantize == mode


def test_a_ragged_batch_with_routed_experts_on_a_quantized_target():
    """tiny glm4_moe (a MoE layer: shared and routed experts quantized), a ragged batch whose rows end at an EOS
    mid-way: speculative == plain, and each row == that row alone (the quantized kernels compute rows on their own)."""
    target = tiny_lm("glm4_moe", seed=0)
    torch.manual_seed(1)
    head = MTPHead.from_config(target)
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(3, 64, (1, 7), generator=g)
    ids = torch.cat([prompt, prompt.roll(1, 1), prompt.flip(1)])
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    free = plain_generate(target, ids, mask, max_new_tokens=12, eos_token_id=-1, quantize="w4a8")
    eos = int(free[0, ids.shape[1] + 3])
    plain = plain_generate(target, ids, mask, max_new_tokens=12, eos_token_id=eos, quantize="w4a8")
    for k in (1, 3):
        out = speculative_generate(target, head, ids, mask, max_new_tokens=12, num_draft_tokens=k, eos_token_id=eos,
                                   quantize="w4a8")
        assert torch.equal(out.sequences, plain)
    for row in (0, 2):  # unpadded rows: alone they are the same prompt
        alone = speculative_generate(target, head, ids[row:row + 1], max_new_tokens=12, num_draft_tokens=3,
                                     eos_token_id=eos, quantize="w4a8")
        width = alone.sequences.shape[1]
        assert torch.equal(alone.sequences[0], plain[row, :width])


def _dequantized_model(target, packed):
    """A copy of `target` whose quantized weights (every layer's q/k/v, o, gate/up, down, shared and routed experts,
    the LM head) are the packed quantized target's dequantized ones: what the quantized target should compute."""
    model = copy.deepcopy(target)
    with torch.no_grad():
        for layer, packed_layer, (qkv, o, gate_up, down) in zip(
            model.model.layers, packed.layers, packed.quantized_layers, strict=True
        ):
            attn = layer.self_attn
            sizes = [attn.q_proj.weight.shape[0], attn.k_proj.weight.shape[0], attn.v_proj.weight.shape[0]]
            for proj, weight in zip((attn.q_proj, attn.k_proj, attn.v_proj), qkv.dequantized().split(sizes),
                                    strict=True):
                proj.weight.copy_(weight)
            attn.o_proj.weight.copy_(o.dequantized())
            mlp = getattr(layer.mlp, "shared_experts", layer.mlp)
            gate, up = gate_up.dequantized().chunk(2)
            mlp.gate_proj.weight.copy_(gate)
            mlp.up_proj.weight.copy_(up)
            mlp.down_proj.weight.copy_(down.dequantized())
            if packed_layer.quantized_experts is not None:
                experts = layer.mlp.experts
                for e in range(experts.gate_up_proj.shape[0]):
                    experts.gate_up_proj[e].copy_(packed_layer.quantized_experts[0].expert(e).dequantized())
                    experts.down_proj[e].copy_(packed_layer.quantized_experts[1].expert(e).dequantized())
        model.lm_head.weight.copy_(packed.quantized_lm_head.dequantized())
    return model


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_the_quantized_target_computes_with_its_dequantized_weights(mode):
    """Weight-only modes: the packed quantized target's logits == transformers' forward with the dequantized
    weights up to fp32 rounding, far closer than to the float model's (so the layers, experts and LM head are
    really quantized, and nothing else is)."""
    target = tiny_lm("glm4_moe", seed=0)
    assert any(hasattr(layer.mlp, "experts") for layer in target.model.layers)
    packed = packed_target(target, mode)
    assert packed.quantized_lm_head is not None and packed.quantized_lm_head.group_size is None  # int8 in any mode
    assert all(layer.qkv is None and layer.expert_gate_up is None for layer in packed.layers)  # no float copy kept
    ids = torch.randint(3, 64, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        logits = packed_logits(packed, packed_forward(packed, KVCache(packed, 2, capacity=9), ids,
                                                      torch.arange(9).expand(2, -1)))
        reference = _dequantized_model(target, packed)(ids).logits
        float_logits = target(ids).logits
    error = (logits - reference).abs().max().item()
    assert error < 1e-4
    assert (float_logits - reference).abs().max().item() > 100 * error


def test_a_verify_block_row_is_the_same_alone_as_in_a_batch(demo):
    """3 rows × 8 positions (24 rows for the linears: past the float row kernel's 16): each row's hidden states and
    logits on the quantized target equal the row run alone, bit for bit."""
    target, _, prompts = demo
    packed = packed_target(target, "w4a8")
    ids = torch.cat([prompt[:, :8] for prompt in prompts])  # [3, 8]
    positions = torch.arange(8).expand(3, -1)
    with torch.inference_mode():
        batch = packed_forward(packed, KVCache(packed, 3, capacity=8), ids, positions)
        batch_logits = packed_logits(packed, batch)
        for row in range(3):
            alone = packed_forward(packed, KVCache(packed, 1, capacity=8), ids[row:row + 1], positions[:1])
            assert torch.equal(alone[0], batch[row])
            assert torch.equal(packed_logits(packed, alone)[0], batch_logits[row])


def test_refusals_name_quantize(demo):
    target, head, prompts = demo
    prompt = prompts[0][:, :6]
    with pytest.raises(ValueError, match="quantize"):
        plain_generate(target, prompt, max_new_tokens=2, quantize="int3")
    with pytest.raises(ValueError, match="quantize='int8'.*target_backend='transformers'"):
        speculative_generate(target, head, prompt, max_new_tokens=2, num_draft_tokens=2, quantize="int8",
                             target_backend="transformers")
    mla = tiny_lm("deepseek_v3", seed=0)  # MLA attention: no packed target, so no quantized one
    torch.manual_seed(1)
    with pytest.raises(ValueError, match="quantize='w4a8'.*deepseek_v3"):
        speculative_generate(mla, MTPHead.from_config(mla), torch.randint(3, 64, (1, 5)), max_new_tokens=2,
                             num_draft_tokens=2, quantize="w4a8")
    off_cpu = tiny_lm("glm4_moe", seed=0).to("meta")
    with pytest.raises(ValueError, match="quantize='int8' has no kernel on meta"):
        plain_generate(off_cpu, torch.randint(3, 64, (1, 5)), max_new_tokens=2, quantize="int8")


def test_spec_cli_quantize_compares_with_plain_decoding_on_the_quantized_target(capsys):
    assert main(["spec", "--prompt", "def add(a, b):", "-k", "3", "--max-new-tokens", "16", "--quantize", "int8",
                 "--compare", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["quantize"] == "int8" and result["outputs_match"] is True
    assert "generate_tokens_per_s" not in result  # transformers' generate runs the float model: not compared
