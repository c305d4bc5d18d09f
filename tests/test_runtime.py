"""omnimtp.runtime: one owner per piece of decoder math, used by every decoder; CPU kernels only on CPU."""

from __future__ import annotations

import ast
import inspect
import re

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
    Qwen3OmniMoeTalkerCodePredictorModelForConditionalGeneration,
)

import omnimtp
import omnimtp.mtp.head
import omnimtp.packed_decoder
import omnimtp.spec_decode.packed_target
import omnimtp.spec_decode.proposer
import omnimtp.talker.code_predictor
import omnimtp.talker.loop
import omnimtp.thinker
from omnimtp.models.tiny import tiny_code_predictor_config, tiny_qwen3_omni
from omnimtp.models.tiny_lm import tiny_lm
from omnimtp.mtp.head import MTPHead
from omnimtp.runtime.kv_cache import KVCache
from omnimtp.runtime.ops import attention, packed_gemm_available, packed_gemm_kind, packed_gemm_kinds, rms_norm
from omnimtp.spec_decode.packed_target import packed_forward, packed_target
from omnimtp.spec_decode.proposer import DraftInput, MTPProposer
from omnimtp.talker.code_predictor import CodePredictorRunner
from omnimtp.talker.loop import TalkerBatch
from omnimtp.thinker import ThinkerRun

pytestmark = pytest.mark.usefixtures("one_torch_thread")

DECODER_MODULES = [
    omnimtp.packed_decoder, omnimtp.spec_decode.packed_target, omnimtp.talker.code_predictor, omnimtp.mtp.head,
    omnimtp.thinker, omnimtp.talker.loop, omnimtp.spec_decode.proposer,
]
# what only omnimtp.runtime may define
OWN_MATH = re.compile(r"rms_?norm|linear|attend|attention|rope|rotate|expert|router|write_kv|kv_?cache|mlp", re.I)


@pytest.mark.parametrize("device", ["cuda", "meta", "xpu", "mps"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_no_cpu_kernel_is_chosen_for_another_device(device, dtype):
    assert packed_gemm_kinds(torch.device(device), dtype) == []
    assert packed_gemm_kinds(device, dtype) == []
    assert packed_gemm_kind(device, dtype) is None and not packed_gemm_available(device, dtype)


def test_code_predictor_and_packed_target_run_on_the_meta_device():
    """Plain torch ops end to end where no CPU kernel applies: shapes come out, nothing is packed."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        cp = Qwen3OmniMoeTalkerCodePredictorModelForConditionalGeneration(tiny_code_predictor_config(num_code_groups=4))
    cp = cp.eval().to("meta")
    runner = CodePredictorRunner(cp, 2)
    assert runner.packed_gemm_kind is None and not runner.packed_gemm
    with pytest.raises(ValueError, match="packed_gemm"):
        CodePredictorRunner(cp, 2, packed_gemm="mkl")
    hidden = torch.empty(2, cp.config.hidden_size, device="meta")
    out = runner.run(hidden, hidden)
    assert out.codes.shape == (2, 3) and out.codes.device.type == "meta" and not runner._gemms

    config = Qwen3Config(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    target = Qwen3ForCausalLM(config).eval().to("meta")
    packed = packed_target(target)
    cache = KVCache(packed, 2, capacity=4)
    ids = torch.zeros(2, 6, dtype=torch.long, device="meta")
    with torch.inference_mode():
        hidden = packed_forward(packed, cache, ids, torch.zeros(2, 6, dtype=torch.long, device="meta"))
    assert hidden.shape == (2, 6, 64) and hidden.device.type == "meta" and cache.length == 6


def test_every_decoder_keeps_its_keys_in_the_one_kv_cache():
    model = tiny_qwen3_omni(0)
    run = ThinkerRun(model.thinker, [[256, 262, 10]], accept_hidden_layer=1, eos_token_ids=set(), max_new_tokens=2)
    talker = TalkerBatch(model.talker, 2)
    assert isinstance(run.kv, KVCache) and isinstance(talker.kv, KVCache)
    assert isinstance(talker.frames.predictor.kv, KVCache) and not talker.frames.predictor.kv.is_growable
    assert talker.frames.predictor.kv.capacity == model.talker.code_predictor.config.num_code_groups

    target = tiny_lm("glm4_moe", seed=0)
    torch.manual_seed(1)
    head = MTPHead.from_config(target)
    proposer = MTPProposer(head)
    ids = torch.randint(3, 64, (1, 4))
    block = DraftInput(
        input_ids=ids, next_ids=ids, hidden=torch.randn(1, 4, target.config.hidden_size),
        position_ids=torch.arange(4)[None], kv_mask=torch.ones(1, 4, dtype=torch.long), last_index=torch.tensor([3]),
    )
    drafts, _ = proposer.propose(block, 3, omnimtp.SamplingParams(temperature=0.0), None)
    assert drafts.shape == (1, 3) and isinstance(proposer.cache, KVCache) and proposer.cache.length == 4


@pytest.mark.parametrize("module", DECODER_MODULES, ids=lambda m: m.__name__)
def test_decoders_define_no_math_of_their_own(module):
    """Norms, linears, attention, RoPE, MoE and KV caches come from omnimtp.runtime only."""
    tree = ast.parse(inspect.getsource(module))
    own = [node.name for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.ClassDef))]
    assert [name for name in own if OWN_MATH.search(name)] == []
    calls = {node.func.attr for node in ast.walk(tree)
             if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)}
    assert not calls & {"scaled_dot_product_attention", "rms_norm", "mv"}, module.__name__


def test_no_private_name_is_imported_across_modules():
    root = inspect.getfile(omnimtp).rsplit("/", 1)[0]
    offenders = []
    for path in sorted(__import__("pathlib").Path(root).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("omnimtp"):
                offenders += [f"{path.name}: {alias.name}" for alias in node.names
                            if alias.name.startswith("_") and not alias.name.endswith("__")]
    assert offenders == []


@pytest.mark.parametrize("eps", [1e-5, 1e-6])
def test_fp32_rms_norm_equals_torch_fused_op_bit_for_bit(eps):
    """The fp32 CPU norm written op by op gives `F.rms_norm`'s bits on the shapes the decoders run: one row
    [H], a step [R, 1, H], a verify [R, k+1, H], a prefill, and rows of every scale."""
    gen = torch.Generator().manual_seed(0)
    for size in (64, 256, 896, 1024):
        weight = torch.randn(size, generator=gen)
        for shape in ((size,), (1, 1, size), (1, 4, size), (16, size), (4, 4, size), (3, 37, size)):
            for scale in (1e-3, 1.0, 1e3):
                x = torch.randn(shape, generator=gen) * scale
                assert torch.equal(rms_norm(x, weight, eps), torch.nn.functional.rms_norm(x, (size,), weight, eps=eps))


def test_rms_norm_variants_and_attention_variants_agree():
    gen = torch.Generator().manual_seed(0)
    x, weight = torch.randn(3, 5, 64, generator=gen), torch.randn(64, generator=gen)
    torch.testing.assert_close(rms_norm(x, weight, 1e-6), rms_norm(x, weight, 1e-6, fused=False), rtol=0, atol=1e-6)
    query = torch.randn(2, 3, 4, 16, generator=gen)  # [R, T, Nq, D]
    keys, values = torch.randn(2, 2, 5, 16, generator=gen), torch.randn(2, 2, 5, 16, generator=gen)
    additive = torch.full((3, 5), float("-inf")).triu(3)  # [T, S]: row t sees columns <= t + 2
    sdpa = attention(query, keys, values, (additive == 0)[None, None], 0.25)
    manual = attention(query, keys, values, additive, 0.25, fp32_manual=True)
    torch.testing.assert_close(sdpa, manual, rtol=1e-5, atol=1e-5)


def test_kv_cache_crop_snapshot_and_fixed_capacity():
    class Dims:
        num_layers, num_kv_heads, head_dim, dtype, device = 1, 1, 2, torch.float32, torch.device("cpu")

    cache = KVCache(Dims, 3, capacity=2)
    cache.plan([0, 1, 2], 3)
    cache.commit([0, 1, 2], 3)
    assert cache.capacity >= 3 and cache.length == 3
    saved = cache.snapshot()
    cache.plan([1], 2)
    cache.commit([1], 2)
    with pytest.raises(ValueError, match="lengths"):
        _ = cache.length
    cache.restore(saved)
    cache.crop(-1)
    assert cache.lengths == [2, 2, 2]
    fixed = KVCache(Dims, 1, capacity=2, is_growable=False)
    with pytest.raises(ValueError, match="holds 2"):
        fixed.plan([0], 3)
