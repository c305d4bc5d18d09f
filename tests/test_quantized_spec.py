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


def test_adaptive_drafting_calibrates_and_runs_on_the_quantized_target(monkeypatch):
    """k = "auto": the costs are measured on the quantized target (the float one is never packed) and greedy
    output is still plain greedy's on it."""
    from omnimtp.spec_decode import packed_target as packed_module

    monkeypatch.setenv("OMNIMTP_DRAFT_COST_CACHE", "0")
    target = tiny_lm("glm4_moe", seed=2)
    torch.manual_seed(3)
    head = MTPHead.from_config(target)
    ids = torch.randint(3, 64, (1, 6), generator=torch.Generator().manual_seed(6))
    out = speculative_generate(target, head, ids, max_new_tokens=10, num_draft_tokens="auto", eos_token_id=-1,
                               quantize="int4")
    assert out.stats.is_adaptive and list(packed_module._PACKED[target]) == ["int4"]
    assert torch.equal(out.sequences, plain_generate(target, ids, max_new_tokens=10, eos_token_id=-1, quantize="int4"))


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


# --- `omnimtp quantize` of an MTP family's checkpoint ----------------------------------------------------------


@pytest.mark.parametrize("mode", ["int8", "w4a8"])
def test_a_quantized_mtp_checkpoint_decodes_as_quantizing_at_load(demo, tmp_path, mode):
    """The shipped demo LM converted: `load_target_and_head` on the copy gives the stored matrices bit for bit what
    quantizing the float checkpoint at load makes, the same greedy speculative and plain tokens, its quantized
    layers' float weights as zero-stride placeholders, and the float NextN head as stored."""
    from safetensors import safe_open

    from omnimtp import load_target_and_head
    from omnimtp.mtp.demo import demo_model_dir
    from omnimtp.quantized_checkpoint import quantize_checkpoint

    target, head, prompts = demo
    summary = quantize_checkpoint(demo_model_dir(), tmp_path / "q", mode)
    assert summary["decoders"] == {"model": target.config.num_hidden_layers}
    with safe_open(tmp_path / "q" / "model-00001.safetensors", "pt") as f:  # no float copy of a quantized matrix
        assert not any(".self_attn." in key or ".mlp." in key for key in f.keys())
    loaded_target, loaded_head = load_target_and_head(tmp_path / "q")
    for name, parameter in loaded_target.named_parameters():
        is_quantized = ".self_attn." in name and "_proj" in name or ".mlp." in name
        assert (set(parameter.stride()) == {0}) == is_quantized, name
    for name, value in head.state_dict().items():
        assert torch.equal(loaded_head.state_dict()[name], value), name
    at_load, stored = packed_target(target, mode), packed_target(loaded_target)
    assert stored.quantize == mode
    for ours, theirs in zip(stored.quantized_layers, at_load.quantized_layers, strict=True):
        for a, b in zip(ours, theirs, strict=True):
            assert torch.equal(a.packed, b.packed) and torch.equal(a.scales, b.scales)
    for prompt in prompts[:2]:
        kwargs = dict(max_new_tokens=24, num_draft_tokens=3, eos_token_id=-1)
        reference = speculative_generate(target, head, prompt, quantize=mode, **kwargs)
        assert torch.equal(speculative_generate(loaded_target, loaded_head, prompt, **kwargs).sequences,
                           reference.sequences)
        assert torch.equal(plain_generate(loaded_target, prompt, max_new_tokens=24, eos_token_id=-1),
                           reference.sequences)


def test_quantized_mtp_checkpoint_refusals(demo, tmp_path):
    from omnimtp import load_target_and_head
    from omnimtp.mtp.demo import demo_model_dir
    from omnimtp.quantized_checkpoint import load_quantized_target_and_head, quantize_checkpoint

    with pytest.raises(ValueError, match="quantize"):
        quantize_checkpoint(demo_model_dir(), tmp_path / "bad", "int3")
    with pytest.raises(ValueError, match="src: .*'glm_moe_dsa'"):  # GLM-5 (MLA + DSA): no packed target
        quantize_checkpoint(demo_model_dir("glm5"), tmp_path / "glm5", "int8")
    quantize_checkpoint(demo_model_dir(), tmp_path / "q", "int8")
    with pytest.raises(ValueError, match="quantize='int4'.*'int8'"):
        load_quantized_target_and_head(tmp_path / "q", quantize="int4")
    target, head = load_target_and_head(tmp_path / "q")
    prompt = demo[2][0][:, :6]
    with pytest.raises(ValueError, match="quantize='int4'.*'int8'"):
        speculative_generate(target, head, prompt, max_new_tokens=2, num_draft_tokens=2, quantize="int4")
    with pytest.raises(ValueError, match="quantize=None.*target_backend='transformers'"):  # its float weights: none
        plain_generate(target, prompt, max_new_tokens=2, target_backend="transformers")
    with pytest.raises(ValueError, match="dst"):
        quantize_checkpoint(demo_model_dir(), tmp_path / "q", "int8")


def test_the_cli_quantizes_an_mtp_checkpoint_that_spec_loads(tmp_path, capsys):
    from omnimtp.mtp.demo import demo_model_dir

    assert main(["quantize", str(demo_model_dir()), str(tmp_path / "q"), "--quantize", "w4a8", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["decoders"] == {"model": 12}
    assert main(["spec", "--model", str(tmp_path / "q"), "--prompt", "def add(a, b):", "-k", "3",
                 "--max-new-tokens", "16", "--compare", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["quantize"] == "w4a8" and result["outputs_match"] is True


def test_a_quantized_moe_mtp_checkpoint_reads_its_routed_experts_one_by_one(tmp_path):
    """A tiny glm4_moe checkpoint with a MoE layer (its routed experts stored one module per expert, as transformers
    writes them): the converted copy decodes as the float checkpoint quantized at load."""
    from omnimtp import load_target_and_head
    from omnimtp.quantized_checkpoint import quantize_checkpoint

    target = tiny_lm("glm4_moe", seed=0)
    torch.manual_seed(0)
    head = MTPHead.from_config(target)
    target.save_pretrained(tmp_path / "src")
    head.save_pretrained(tmp_path / "src")
    quantize_checkpoint(tmp_path / "src", tmp_path / "q", "w4a8")
    loaded_target, loaded_head = load_target_and_head(tmp_path / "q")
    experts = next(layer.mlp.experts for layer in loaded_target.model.layers if hasattr(layer.mlp, "experts"))
    assert set(experts.gate_up_proj.stride()) == {0}
    ids = torch.randint(3, 64, (2, 7), generator=torch.Generator().manual_seed(4))
    kwargs = dict(max_new_tokens=12, num_draft_tokens=2, eos_token_id=-1)
    reference = speculative_generate(target, head, ids, quantize="w4a8", **kwargs).sequences
    assert torch.equal(speculative_generate(loaded_target, loaded_head, ids, **kwargs).sequences, reference)
    assert torch.equal(plain_generate(loaded_target, ids, max_new_tokens=12, eos_token_id=-1), reference)
