"""Quantized routed experts (int8, int4, w4a8) on omnimtp's CPU kernel: each of an MoE block's two matmuls is one
kernel call for every picked expert (rows grouped by expert), a row gets the bits its expert's matrix gives it alone,
a token's output does not depend on the other tokens, and quantized MoE decoders (Qwen3-Omni's thinker and talker,
a tiny glm4_moe) equal the same decoders on the dequantized experts."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from omnimtp.models.tiny import tiny_qwen3_omni
from omnimtp.models.tiny_lm import tiny_lm
from omnimtp.packed_decoder import KVCache, PackedDecoder, decoder_forward
from omnimtp.runtime import moe
from omnimtp.runtime.kernels import small_batch_linear as sbl
from omnimtp.runtime.ops import QUANTIZE_MODES, expert_linear, linear, quantize_experts, quantize_weight

pytestmark = [
    pytest.mark.usefixtures("one_torch_thread"),
    pytest.mark.skipif(not sbl.available(), reason=f"kernel unavailable: {sbl.unavailable_reason()}"),
]


def _experts(num_experts: int, hidden: int, inter: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(num_experts, 2 * inter, hidden, generator=g)
    return gate_up, torch.randn(num_experts, hidden, inter, generator=g)


def _picks(num_tokens: int, num_experts: int, top_k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(num_experts, generator=g)[:top_k] for _ in range(num_tokens)])  # [N, k]


def _one_row(x: torch.Tensor, expert: int, gate_up, down) -> torch.Tensor:
    """One (token, expert) row through the single-matrix kernel: what the grouped call must give it."""
    gate, up = linear(x[None], None, packed=gate_up.expert(expert)).chunk(2, dim=-1)
    return linear(F.silu(gate) * up, None, packed=down.expert(expert))[0]


@settings(max_examples=40, deadline=None)
@given(
    num_experts=st.integers(2, 9), top_k=st.integers(1, 4), num_tokens=st.integers(1, 9),
    widths=st.sampled_from([(32, 16), (48, 40), (256, 128), (136, 24)]), mode=st.sampled_from(QUANTIZE_MODES),
    seed=st.integers(0, 99),
)
def test_grouped_experts_give_each_row_its_experts_bits_alone(num_experts, top_k, num_tokens, widths, mode, seed):
    hidden, inter = widths
    top_k = min(top_k, num_experts)
    gate_up_f, down_f = _experts(num_experts, hidden, inter, seed)
    gate_up, down = quantize_experts(gate_up_f, mode), quantize_experts(down_f, mode)
    x = torch.randn(num_tokens, hidden, generator=torch.Generator().manual_seed(seed + 1))
    top_experts = _picks(num_tokens, num_experts, top_k, seed)
    out = moe.quantized_expert_outputs(x, top_experts, gate_up, down)  # [N*k, H]
    assert out.shape == (num_tokens * top_k, hidden)
    expected = torch.stack([
        _one_row(x[t], int(top_experts[t, r]), gate_up, down) for t in range(num_tokens) for r in range(top_k)
    ])
    assert torch.equal(out, expected)


@pytest.mark.parametrize("mode", QUANTIZE_MODES)
def test_quantized_experts_equal_the_dequantized_experts(mode):
    """Within fp32 rounding of the matmul by the dequantized weights (and, in w4a8, inputs), stage by stage; and
    the whole block differs from the float experts by the quantization only."""
    num_experts, hidden, inter, top_k = 6, 256, 128, 3
    gate_up_f, down_f = _experts(num_experts, hidden, inter, 0)
    gate_up, down = quantize_experts(gate_up_f, mode), quantize_experts(down_f, mode)
    for index in range(num_experts):  # each expert quantized as a matrix alone
        alone = quantize_weight(gate_up_f[index], mode)
        assert torch.equal(gate_up.expert(index).packed, alone.packed)
        assert torch.equal(gate_up.expert(index).scales, alone.scales)
    x = torch.randn(7, hidden, generator=torch.Generator().manual_seed(1))
    top_experts = _picks(7, num_experts, top_k, 2)
    flat = top_experts.reshape(-1)
    order = torch.argsort(flat, stable=True)
    experts, counts = torch.unique_consecutive(flat[order], return_counts=True)
    offsets = F.pad(counts.cumsum(0), (1, 0))
    rows = x[order // top_k]
    got = expert_linear(rows, gate_up, experts, offsets)
    for i, expert in enumerate(experts.tolist()):
        weight = gate_up.expert(expert)
        xd = weight.dequantized_input(rows[offsets[i] : offsets[i + 1]])
        reference = xd @ weight.dequantized().T
        bound = 1e-5 * (xd.abs() @ weight.dequantized().abs().T) + 1e-6
        assert ((got[offsets[i] : offsets[i + 1]] - reference).abs() <= bound).all()
    weights = torch.rand(7, top_k)
    quantized = moe.combine(moe.quantized_expert_outputs(x, top_experts, gate_up, down), weights, x.dtype)
    exact = moe.combine(moe.expert_outputs(x, top_experts, gate_up_f, down_f), weights, x.dtype)
    error = ((quantized - exact).norm() / exact.norm()).item()
    assert 0 < error < (0.02 if mode == "int8" else 0.3)


@pytest.mark.parametrize("mode", QUANTIZE_MODES)
def test_a_token_is_the_same_alone_as_among_others(mode):
    """The one-token path (no sort) and the grouped path give a token the same bits, whatever else is routed."""
    gate_up_f, down_f = _experts(8, 64, 32, 3)
    gate_up, down = quantize_experts(gate_up_f, mode), quantize_experts(down_f, mode)
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(4))
    top_experts = _picks(5, 8, 2, 5)
    batch = moe.quantized_expert_outputs(x, top_experts, gate_up, down).view(5, 2, 64)
    for t in range(5):
        assert torch.equal(moe.quantized_expert_outputs(x[t], top_experts[t], gate_up, down), batch[t])
        assert torch.equal(moe.quantized_expert_outputs(x[t : t + 1], top_experts[t : t + 1], gate_up, down), batch[t])


def test_two_threads_split_the_experts_and_give_the_same_bits():
    gate_up_f, down_f = _experts(8, 256, 128, 6)
    gate_up, down = quantize_experts(gate_up_f, "w4a8"), quantize_experts(down_f, "w4a8")
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(7))
    top_experts = _picks(3, 8, 4, 8)
    one = moe.quantized_expert_outputs(x, top_experts, gate_up, down)
    torch.set_num_threads(2)
    try:
        two = moe.quantized_expert_outputs(x, top_experts, gate_up, down)
    finally:
        torch.set_num_threads(1)
    assert torch.equal(one, two)


@pytest.fixture(scope="module")
def omni():
    return tiny_qwen3_omni(0)


def _moe_decoders(omni):
    return {
        "thinker": PackedDecoder.from_module(omni.thinker.model.language_model),
        "talker": PackedDecoder.from_module(omni.talker.model),  # with a gated shared expert
        "glm4_moe": PackedDecoder.from_causal_lm(tiny_lm("glm4_moe", 0)),  # group-limited router, shared experts
    }


def _dequantized(decoder: PackedDecoder, quantized: PackedDecoder) -> PackedDecoder:
    """`decoder` with its routed and shared experts replaced by `quantized`'s dequantized weights (attention
    kept float: what this compares is the MLP)."""
    layers = []
    for layer, qlayer, q in zip(decoder.layers, quantized.layers, quantized.quantized_layers, strict=True):
        if layer.router is None:
            layers.append(replace(layer, gate_up=q[2].dequantized(), mlp_down=q[3].dequantized()))
            continue
        gate_up, down = (
            torch.stack([w.expert(e).dequantized() for e in range(layer.num_experts)]) for w in qlayer.quantized_experts
        )
        shared = {}
        if q[2] is not None:
            shared_gate_up, shared_down = q[2].dequantized(), q[3].dequantized()
            if layer.shared_gate_proj is not None:
                gate, up = shared_gate_up.chunk(2)
                shared = dict(shared_gate_proj=gate, shared_up_proj=up, mlp_down=shared_down)
            else:
                shared = dict(gate_up=shared_gate_up, mlp_down=shared_down)
        layers.append(replace(
            layer, expert_gate_up=gate_up, expert_down=down, expert_gate_up_views=tuple(gate_up.unbind(0)),
            expert_down_views=tuple(down.unbind(0)), **shared,
        ))
    return replace(decoder, layers=tuple(layers), row_kernel=None)


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_moe_decoders_equal_their_dequantized_experts(omni, mode, monkeypatch):
    calls = []
    grouped = sbl.quantized_experts
    monkeypatch.setattr(sbl, "quantized_experts", lambda *a: calls.append(a[0].shape[0]) or grouped(*a))
    for name, decoder in _moe_decoders(omni).items():
        quantized = decoder.quantized(mode)
        num_moe = sum(layer.router is not None for layer in decoder.layers)
        assert num_moe, name
        for layer in quantized.layers:  # no float expert left in a quantized layer
            assert layer.expert_gate_up is None and layer.expert_down is None and not layer.expert_gate_up_views
        # attention in float on both sides: quantize only the MLPs' effect
        float_attention = tuple(
            (None, None, *q[2:]) for q in quantized.quantized_layers
        )
        attention_float = replace(
            quantized,
            layers=tuple(replace(ql, qkv=fl.qkv, o=fl.o) for ql, fl in zip(quantized.layers, decoder.layers,
                                                                            strict=True)),
            quantized_layers=float_attention,
        )
        dequantized = _dequantized(decoder, quantized)
        embeds = torch.randn(2, 5, decoder.hidden_size, generator=torch.Generator().manual_seed(1))
        calls.clear()
        outs = [decoder_forward(d, KVCache(d, 2, 8), embeds, [0, 1]).last_hidden
                for d in (attention_float, dequantized, decoder)]
        assert len(calls) == 2 * num_moe, name  # one call per matmul per MoE layer, every row in it
        assert all(rows == 2 * 5 * decoder.layers[-1].router.top_k for rows in calls), name
        torch.testing.assert_close(outs[0], outs[1], rtol=1e-4, atol=1e-4, msg=name)
        error = ((outs[0] - outs[2]).norm() / outs[2].norm()).item()
        assert 0 < error < (0.05 if mode == "int8" else 0.6), name


@pytest.mark.parametrize("name", ["talker", "glm4_moe"])
def test_a_quantized_moe_decoder_steps_a_row_as_in_a_batch(omni, name):
    """A quantized MoE decoder's rows are independent: one row stepped alone equals the same row in a batch of
    three, bit for bit, through attention, router, routed experts and shared experts."""
    module = omni.talker.model if name == "talker" else tiny_lm("glm4_moe", 0).get_decoder()
    decoder = PackedDecoder.from_module(module, quantize="w4a8")
    g = torch.Generator().manual_seed(2)
    prompt = torch.randn(3, 4, decoder.hidden_size, generator=g)
    step = torch.randn(3, 1, decoder.hidden_size, generator=g)
    batch_cache = KVCache(decoder, 3, 8)
    decoder_forward(decoder, batch_cache, prompt, [0, 1, 2])
    batch = decoder_forward(decoder, batch_cache, step, [0, 1, 2]).last_hidden
    cache = KVCache(decoder, 1, 8)
    decoder_forward(decoder, cache, prompt[1:2], [0])
    alone = decoder_forward(decoder, cache, step[1:2], [0]).last_hidden
    assert torch.equal(alone[0], batch[1])


def test_a_quantized_omni_thinker_runs_an_int8_lm_head(omni, monkeypatch):
    """A quantized Qwen3-Omni family's thinker logits come from its int8 head, one kernel call a step, within the
    int8 grid of the float head's logits; the float family keeps the float head."""
    from omnimtp.families.qwen3_omni import Qwen3OmniFamily
    from omnimtp.runtime.ops import QuantizedWeight

    family = Qwen3OmniFamily(omni, quantize="w4a8")
    head = family.thinker_decoder.quantized_lm_head
    assert isinstance(head, QuantizedWeight) and head.group_size is None and not head.int8_activations
    assert Qwen3OmniFamily(omni).thinker_decoder.quantized_lm_head is None
    weight = omni.thinker.lm_head.weight
    hidden = torch.randn(3, weight.shape[1], generator=torch.Generator().manual_seed(5))
    got = linear(hidden, None, packed=head)
    bound = 1e-5 * (hidden.abs() @ head.dequantized().abs().T) + 1e-6
    assert ((got - hidden @ head.dequantized().T).abs() <= bound).all()
    calls = []
    quantized = sbl.quantized_linear
    monkeypatch.setattr(sbl, "quantized_linear", lambda *a: calls.append(a[3]) or quantized(*a))
    from omnimtp import OmniPipeline

    OmniPipeline.tiny(quantize="w4a8").generate("Hi", max_new_tokens=3, max_frames=2)
    assert calls.count(weight.shape[0]) == 3  # the prefill's step and two decode steps, each one head call
