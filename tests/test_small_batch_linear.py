"""omnimtp's small-batch fp32 linear kernel (AVX-512 or AVX2) against F.linear, and its fallbacks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
    Qwen3OmniMoeTalkerCodePredictorModelForConditionalGeneration,
)

from omnimtp.models.tiny import tiny_code_predictor_config
from omnimtp.runtime.kernels import small_batch_linear as sbl
from omnimtp.runtime.ops import packed_gemm_kinds
from omnimtp.talker.code_predictor import CodePredictorRunner

needs_kernel = pytest.mark.skipif(not sbl.available(), reason=f"kernel unavailable: {sbl.unavailable_reason()}")


def _tensors(rows: int, in_features: int, out_features: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, in_features, generator=g), torch.randn(out_features, in_features, generator=g)


@needs_kernel
@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 40), in_features=st.integers(1, 70), out_features=st.integers(1, 300), seed=st.integers(0, 99)
)
def test_equals_f_linear_up_to_rounding_for_any_shape(rows, in_features, out_features, seed):
    """Up to 300 outputs: several groups of panels (and a partial last group) for every row count."""
    x, weight = _tensors(rows, in_features, out_features, seed)
    x_before, weight_before = x.clone(), weight.clone()
    packed = sbl.pack_weight(weight)
    out = sbl.small_batch_linear(x, packed, out_features)
    assert out.shape == (rows, out_features) and out.dtype == torch.float32
    torch.testing.assert_close(out, F.linear(x, weight), rtol=1e-5, atol=1e-5 * in_features**0.5)
    assert torch.equal(x, x_before) and torch.equal(weight, weight_before)  # inputs untouched


@needs_kernel
def test_a_row_alone_equals_its_row_in_any_batch_and_any_thread_count():
    """Bit for bit: a row's sums run in the same order whatever the other rows (passes of 16 rows
    included) and however the panels are split over threads."""
    x, weight = _tensors(37, 96, 200, seed=1)
    packed = sbl.pack_weight(weight)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one_thread = sbl.small_batch_linear(x, packed, 200)
        torch.set_num_threads(2)
        two_threads = sbl.small_batch_linear(x, packed, 200)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one_thread, two_threads)
    for b in (0, 15, 16, 36):
        assert torch.equal(sbl.small_batch_linear(x[b : b + 1], packed, 200)[0], one_thread[b]), b
    assert torch.equal(sbl.small_batch_linear(x[3:11], packed, 200), one_thread[3:11])


@needs_kernel
def test_the_row_tiling_changes_no_bit():
    """Tiles of any size, passes of any length (each tile re-reads the weights from cache): every row sums
    in the same order, so every tiling gives this CPU's values bit for bit."""
    x, weight = _tensors(37, 96, 200, seed=4)
    packed = sbl.pack_weight(weight)
    expected = sbl.small_batch_linear(x, packed, 200)
    for tiling in [(1, 1), (4, 16), (5, 7), (6, 64), (8, 16), (16, 16), (16, 40)]:
        assert torch.equal(sbl.small_batch_linear(x, packed, 200, tiling=tiling), expected), tiling
    for bad in [(0, 16), (17, 32), (8, 4), (8.0, 16)]:
        with pytest.raises(ValueError, match="tiling"):
            sbl.small_batch_linear(x, packed, 200, tiling=bad)


@needs_kernel
def test_real_dims_and_non_contiguous_input():
    x, weight = _tensors(8, 1024, 3 * 512, seed=2)
    packed = sbl.pack_weight(weight)
    torch.testing.assert_close(sbl.small_batch_linear(x, packed, 1536), F.linear(x, weight), rtol=1e-5, atol=1e-4)
    strided = torch.randn(1024, 8).t()  # [8, 1024], not contiguous
    torch.testing.assert_close(sbl.small_batch_linear(strided, packed, 1536), F.linear(strided, weight),
                               rtol=1e-5, atol=1e-4)
    assert sbl.small_batch_linear(x[:0], packed, 1536).shape == (0, 1536)


@needs_kernel
def test_bad_arguments_raise_value_errors_naming_them():
    x, weight = _tensors(4, 32, 48, seed=3)
    packed = sbl.pack_weight(weight)
    with pytest.raises(ValueError, match="weight"):
        sbl.pack_weight(weight.double())
    with pytest.raises(ValueError, match="weight"):
        sbl.pack_weight(weight[0])
    with pytest.raises(ValueError, match="x"):
        sbl.small_batch_linear(x.double(), packed, 48)
    with pytest.raises(ValueError, match="x"):
        sbl.small_batch_linear(x[0], packed, 48)
    with pytest.raises(ValueError, match="features"):
        sbl.small_batch_linear(torch.randn(4, 31), packed, 48)
    with pytest.raises(ValueError, match="out_features"):
        sbl.small_batch_linear(x, packed, 64)
    with pytest.raises(ValueError, match="out_features"):
        sbl.small_batch_linear(x, packed, 16)
    with pytest.raises(ValueError, match="packed"):
        sbl.small_batch_linear(x, weight, 48)


# --- one query position's attention ------------------------------------------------------------------------


def _cache_views(num_kv_heads: int, length: int, head_dim: int, capacity: int, seed: int):
    """Keys and values [1, Nkv, length, D] as a KV cache holds them: views of [1, Nkv, capacity, D] buffers."""
    g = torch.Generator().manual_seed(seed)
    buffers = torch.randn(2, 1, num_kv_heads, capacity, head_dim, generator=g) * 2
    return buffers[0][:, :, :length], buffers[1][:, :, :length]


@needs_kernel
@settings(max_examples=40, deadline=None)
@given(num_kv_heads=st.integers(1, 8), group=st.sampled_from([1, 2, 3, 4, 7, 16]),
       head_dim=st.sampled_from([8, 16, 64, 128, 256]), length=st.integers(1, 300), seed=st.integers(0, 99))
def test_decode_attention_equals_sdpa_up_to_rounding(num_kv_heads, group, head_dim, length, seed):
    """Every group size (odd ones too: the query heads in register blocks of 4, 2 and 1), head width (64, 128 and
    256 on the AVX-512 code, the others one key at a time) and length (one key included; lengths that are not a
    multiple of 4 or 16 leave partial blocks), on a cache's strided views: SDPA's values (transformers'
    grouped-query attention) up to fp32 rounding, the inputs untouched."""
    keys, values = _cache_views(num_kv_heads, length, head_dim, length + 7, seed)
    query = torch.randn(num_kv_heads * group, head_dim, generator=torch.Generator().manual_seed(seed + 1))
    before = [t.clone() for t in (query, keys, values)]
    scale = head_dim**-0.5
    out = sbl.decode_attention(query, keys, values, scale)
    expected = F.scaled_dot_product_attention(query[None, :, None], keys, values, scale=scale, enable_gqa=True)
    assert out.shape == (num_kv_heads * group * head_dim,) and out.dtype == torch.float32
    torch.testing.assert_close(out, expected.reshape(-1), rtol=1e-5, atol=1e-5 * float(values.abs().max()))
    assert all(torch.equal(t, b) for t, b in zip((query, keys, values), before, strict=True))


@needs_kernel
def test_decode_attention_is_the_same_on_any_thread_count_and_survives_large_scores():
    """Bit for bit on 1 and 2 threads (a head's sums run in the same order on either); scores of ±1e4 (exp
    overflows unless the maximum is taken out first) give SDPA's values; out-of-range shapes, mixed dtypes and
    dtypes it has no form for are ValueErrors."""
    keys, values = _cache_views(4, 333, 128, 400, seed=3)
    query = torch.randn(8, 128, generator=torch.Generator().manual_seed(4))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one_thread = sbl.decode_attention(query, keys, values, 0.09)
        torch.set_num_threads(2)
        two_threads = sbl.decode_attention(query, keys, values, 0.09)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one_thread, two_threads)
    for head_dim in (128, 96):  # the AVX-512 code's width and one of the code that takes a key at a time
        keys, values = _cache_views(4, 333, head_dim, 400, seed=3)
        query = torch.randn(8, head_dim, generator=torch.Generator().manual_seed(4))
        out = sbl.decode_attention(query, keys, values, 100.0)
        expected = F.scaled_dot_product_attention(query[None, :, None], keys, values, scale=100.0, enable_gqa=True)
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out, expected.reshape(-1), rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="head_dim 512"):
        sbl.decode_attention(torch.randn(2, 512), *_cache_views(1, 5, 512, 5, seed=0), 1.0)
    with pytest.raises(ValueError, match="32 query heads over 1"):
        sbl.decode_attention(torch.randn(32, 8), *_cache_views(1, 5, 8, 5, seed=0), 1.0)
    with pytest.raises(ValueError, match="query, keys and values must all be one of"):
        sbl.decode_attention(torch.randn(2, 8).bfloat16(), *_cache_views(1, 5, 8, 5, seed=0), 1.0)
    with pytest.raises(ValueError, match="float16"):
        sbl.decode_attention(*(t.half() for t in (torch.randn(2, 8), *_cache_views(1, 5, 8, 5, seed=0))), 1.0)


@needs_kernel
@pytest.mark.parametrize("prefix", [True, False])
def test_decode_attention_of_rows_with_a_mask_equals_sdpa_and_each_row_alone(prefix):
    """Rows at their own lengths in one call (a batched decode step: a bool mask, True = visible): SDPA's values
    with that mask up to rounding, and each row bit for bit what it gets alone over its visible keys without a
    mask (a masked key is left out, not weighted by zero: the unwritten cache past a row's length may hold
    anything, NaN included). prefix False: visible keys scattered, as any bool mask may have them."""
    num_rows, num_kv_heads, length, head_dim = 5, 2, 70, 64
    g = torch.Generator().manual_seed(9)
    cache = torch.randn(2, num_rows, num_kv_heads, 96, head_dim, generator=g)
    keys, values = cache[0][:, :, :length], cache[1][:, :, :length]
    query = torch.randn(num_rows, 8, head_dim, generator=g)
    lengths = torch.tensor([70, 1, 33, 64, 2])
    if prefix:
        visible = torch.arange(length)[None] < lengths[:, None]  # [R, S]
    else:
        visible = torch.rand(num_rows, length, generator=g) < 0.6
        visible[:, 0] = True
    keys.masked_fill_(~visible[:, None, :, None], float("nan"))  # what a masked key holds must not matter
    out = sbl.decode_attention(query, keys, values, 0.125, visible)
    clean_keys = keys.nan_to_num(0.0)
    expected = F.scaled_dot_product_attention(query[:, :, None], clean_keys, values, attn_mask=visible[:, None, None],
                                              scale=0.125, enable_gqa=True)
    torch.testing.assert_close(out, expected.reshape(num_rows, -1), rtol=1e-5, atol=1e-5)
    for r in range(num_rows):
        seen = visible[r].nonzero()[:, 0]
        alone = sbl.decode_attention(query[r], keys[r : r + 1, :, seen], values[r : r + 1, :, seen], 0.125)
        assert torch.equal(alone, out[r]), r


def _ulp_bf16(x: torch.Tensor) -> torch.Tensor:
    """The spacing of bf16 values at |x| (fp32): 2^(exponent - 7), normals only."""
    return torch.ldexp(torch.ones_like(x), torch.frexp(x.abs().clamp(min=2**-120))[1] - 8)


@needs_kernel
@settings(max_examples=30, deadline=None)
@given(num_kv_heads=st.integers(1, 4), group=st.sampled_from([1, 2, 8, 16]), head_dim=st.sampled_from([8, 64, 128]),
       length=st.integers(1, 200), num_rows=st.integers(1, 3), seed=st.integers(0, 99))
def test_bf16_decode_attention_is_fp32_attention_rounded_once(num_kv_heads, group, head_dim, length, num_rows, seed):
    """A bf16 cache (a bf16 decoder's): fp32 SDPA on the widened tensors, rounded to bf16 once (within one bf16
    step, and the sums' fp32 rounding: it may fall on either side of a rounding boundary), in bf16; within bf16
    tolerance of SDPA's own bf16 kernel (which rounds its probabilities too); the inputs untouched."""
    g = torch.Generator().manual_seed(seed)
    cache = (torch.randn(2, num_rows, num_kv_heads, length + 5, head_dim, generator=g) * 2).bfloat16()
    keys, values = cache[0][:, :, :length], cache[1][:, :, :length]
    query = torch.randn(num_rows, num_kv_heads * group, head_dim, generator=g).bfloat16()
    before = [t.clone() for t in (query, keys, values)]
    scale = head_dim**-0.5
    out = sbl.decode_attention(query, keys, values, scale)
    assert out.dtype == torch.bfloat16 and out.shape == (num_rows, num_kv_heads * group * head_dim)
    exact = F.scaled_dot_product_attention(query.float()[:, :, None], keys.float(), values.float(), scale=scale,
                                           enable_gqa=True).reshape(num_rows, -1)
    fp32_error = 1e-5 * float(values.float().abs().max())  # the sums' rounding, where terms cancel near 0
    assert ((out.float() - exact).abs() <= _ulp_bf16(exact) + fp32_error).all()
    # nearly all equal to the exact value rounded (an occasional sum's fp32 rounding falls across the boundary)
    assert int((out.float() != exact.bfloat16().float()).sum()) <= 2 + out.numel() // 100
    sdpa = F.scaled_dot_product_attention(query[:, :, None], keys, values, scale=scale, enable_gqa=True)
    torch.testing.assert_close(out, sdpa.reshape(num_rows, -1), rtol=0.02, atol=0.02)
    assert all(torch.equal(t, b) for t, b in zip((query, keys, values), before, strict=True))


@needs_kernel
def test_bf16_decode_attention_of_rows_with_a_mask_is_each_row_alone_and_rounds_nan_and_ties():
    """bf16 rows at their own lengths (NaN in the masked keys): each row bit for bit what it gets alone; a row with
    no visible key is NaN, as SDPA's; outputs rounded to nearest, ties to even (values of one key head: exactly
    its value row, already bf16, so any rounding but to nearest-even of the exact sum would show on sums of two)."""
    g = torch.Generator().manual_seed(2)
    cache = torch.randn(2, 3, 2, 40, 64, generator=g).bfloat16()
    keys, values = cache[0], cache[1]
    query = torch.randn(3, 4, 64, generator=g).bfloat16()
    visible = torch.arange(40)[None] < torch.tensor([40, 3, 17])[:, None]
    keys.masked_fill_(~visible[:, None, :, None], float("nan"))
    out = sbl.decode_attention(query, keys, values, 0.125, visible)
    for r in range(3):
        seen = visible[r].nonzero()[:, 0]
        alone = sbl.decode_attention(query[r], keys[r : r + 1, :, seen], values[r : r + 1, :, seen], 0.125)
        assert alone.dtype == torch.bfloat16 and torch.equal(alone, out[r]), r
    nothing = sbl.decode_attention(query[:1], keys[:1], values[:1], 0.125, torch.zeros(1, 40, dtype=torch.bool))
    assert torch.isnan(nothing.float()).all()
    # two keys with equal scores (zero queries): the exact mean of two bf16 values, a tie where they differ in the
    # last place only: 1 and 1 + 2^-7 → 1 + 2^-8, even is 1 (down); 1 + 2^-7 and 1 + 2 * 2^-7 → even is the upper
    pair = torch.tensor([[1.0, 1.0 + 2**-7, 1.0 + 3 * 2**-7], [1.0 + 2**-7, 1.0 + 2 * 2**-7, 1.0 + 2 * 2**-7]])
    mean = sbl.decode_attention(torch.zeros(1, 3).bfloat16(), torch.zeros(1, 1, 2, 3).bfloat16(),
                                pair.bfloat16()[None, None], 1.0)
    assert mean.tolist() == [1.0, 1.0 + 2 * 2**-7, 1.0 + 2 * 2**-7]


@needs_kernel
def test_one_position_a_rows_attention_runs_on_the_kernel_only_where_it_applies(monkeypatch):
    """`ops.attention`: one position a row (either layout of the query, one row or several), fp32 or bf16 (all
    alike), no mask or a bool one, no gradient: the kernel; an additive mask, gradients, more
    positions or the code predictor's written-out form (fp32_manual): SDPA or that form, as before."""
    from omnimtp.runtime import ops

    calls = []
    kernel = sbl.decode_attention
    monkeypatch.setattr(sbl, "decode_attention", lambda *args: calls.append(args) or kernel(*args))
    keys, values = _cache_views(2, 9, 16, 12, seed=5)
    query = torch.randn(4, 16)
    flat = ops.attention(query, keys, values, None, 0.25)
    assert len(calls) == 1 and flat.shape == (64,)
    assert torch.equal(ops.attention(query[None, None], keys, values, None, 0.25), flat.view(1, 1, -1))
    visible = torch.ones(1, 1, 1, 9, dtype=torch.bool)
    assert torch.equal(ops.attention(query, keys, values, visible, 0.25), flat)
    rows = torch.randn(3, 1, 4, 16)
    batch_keys, batch_values = (torch.cat([t, t.flip(2), t * 2]) for t in (keys, values))
    lengths_mask = (torch.arange(9)[None] < torch.tensor([9, 4, 7])[:, None])[:, None, None]
    batched = ops.attention(rows, batch_keys, batch_values, lengths_mask, 0.25)
    assert len(calls) == 4 and batched.shape == (3, 1, 64)
    assert torch.equal(batched[1, 0], ops.attention(rows[1, 0], batch_keys[1:2, :, :4], batch_values[1:2, :, :4],
                                                    None, 0.25))
    ops.attention(query, keys, values, torch.zeros(1, 1, 1, 9), 0.25)  # additive
    with torch.enable_grad():
        ops.attention(query.clone().requires_grad_(), keys, values, None, 0.25)
    ops.attention(torch.randn(1, 2, 4, 16), keys, values, None, 0.25)
    ops.attention(rows[:1], keys, values, torch.zeros(1, 1, 9), 0.25, fp32_manual=True)
    assert len(calls) == 5  # only the row alone above
    bf16 = ops.attention(query.bfloat16(), keys.bfloat16(), values.bfloat16(), None, 0.25)  # a bf16 decoder's step
    assert len(calls) == 6 and bf16.dtype == torch.bfloat16
    assert torch.equal(bf16, kernel(query.bfloat16(), keys.bfloat16(), values.bfloat16(), 0.25))
    bf16_rows = ops.attention(rows.bfloat16(), batch_keys.bfloat16(), batch_values.bfloat16(), lengths_mask, 0.25)
    assert len(calls) == 7 and bf16_rows.shape == (3, 1, 64) and bf16_rows.dtype == torch.bfloat16


@needs_kernel
@pytest.mark.parametrize("num_kv_heads, num_heads, head_dim, on_kernel", [
    (2, 32, 64, True), (2, 34, 64, False),  # 16 query heads a KV head; 17
    (1, 4, 256, True), (1, 4, 264, False),  # head_dim 256; 264
])
def test_decode_attention_runs_on_the_kernel_only_within_its_range(monkeypatch, num_kv_heads, num_heads, head_dim,
                                                                   on_kernel):
    """Past 16 query heads a KV head or a head_dim of 256, one position a row falls back to SDPA (the kernel
    refuses them), with SDPA's values."""
    from omnimtp.runtime import ops

    calls = []
    kernel = sbl.decode_attention
    monkeypatch.setattr(sbl, "decode_attention", lambda *args: calls.append(args) or kernel(*args))
    g = torch.Generator().manual_seed(num_heads + head_dim)
    keys, values = (torch.randn(2, num_kv_heads, 9, head_dim, generator=g) for _ in range(2))
    query = torch.randn(2, 1, num_heads, head_dim, generator=g)
    out = ops.attention(query, keys, values, None, 0.1)
    expected = F.scaled_dot_product_attention(query.transpose(1, 2), keys, values, scale=0.1, enable_gqa=True)
    torch.testing.assert_close(out, expected.transpose(1, 2).reshape(2, 1, -1), rtol=1e-5, atol=1e-5)
    assert len(calls) == on_kernel


@needs_kernel
def test_one_mask_shared_by_several_rows_runs_on_the_kernel(monkeypatch):
    """A bool mask [1, 1, 1, S] for every row of a batched decode step: the kernel, with SDPA's values under
    that mask for every row."""
    from omnimtp.runtime import ops

    calls = []
    kernel = sbl.decode_attention
    monkeypatch.setattr(sbl, "decode_attention", lambda *args: calls.append(args) or kernel(*args))
    g = torch.Generator().manual_seed(3)
    keys, values = (torch.randn(3, 2, 11, 16, generator=g) for _ in range(2))
    query = torch.randn(3, 1, 8, 16, generator=g)
    visible = torch.rand(1, 1, 1, 11, generator=g) < 0.5
    visible[..., 0] = True
    out = ops.attention(query, keys, values, visible, 0.25)
    expected = F.scaled_dot_product_attention(query.transpose(1, 2), keys, values, attn_mask=visible, scale=0.25,
                                              enable_gqa=True)
    torch.testing.assert_close(out, expected.transpose(1, 2).reshape(3, 1, -1), rtol=1e-5, atol=1e-5)
    assert len(calls) == 1 and not visible.all()


@pytest.fixture
def fresh_library(monkeypatch, tmp_path):
    """The kernel loader with its cache cleared (and restored afterwards), building into tmp_path."""
    monkeypatch.setenv("OMNIMTP_CACHE_DIR", str(tmp_path))
    sbl._library.cache_clear()
    yield tmp_path
    monkeypatch.undo()
    sbl._library.cache_clear()
    sbl.available()


def test_disabled_by_environment_falls_back_to_mkl(fresh_library, monkeypatch):
    from omnimtp.runtime import ops

    monkeypatch.setenv("OMNIMTP_NATIVE_KERNELS", "0")
    assert not sbl.available()
    assert "OMNIMTP_NATIVE_KERNELS" in sbl.unavailable_reason()
    keys, values = _cache_views(2, 9, 16, 12, seed=5)  # a decode step's attention: SDPA's, exactly
    query = torch.randn(4, 16)
    expected = F.scaled_dot_product_attention(query[None, :, None], keys, values, scale=0.25, enable_gqa=True)
    assert torch.equal(ops.attention(query, keys, values, None, 0.25), expected.reshape(-1))
    assert "row" not in packed_gemm_kinds(torch.device("cpu"), torch.float32)
    cp = Qwen3OmniMoeTalkerCodePredictorModelForConditionalGeneration(
        tiny_code_predictor_config(num_code_groups=4)
    ).eval()
    runner = CodePredictorRunner(cp, 4)
    assert runner.packed_gemm_kind == ("mkl" if torch.backends.mkl.is_available() else None)
    with pytest.raises(ValueError, match="row.*OMNIMTP_NATIVE_KERNELS"):
        CodePredictorRunner(cp, 4, packed_gemm="row")
    with pytest.raises(RuntimeError, match="not available"):
        sbl.small_batch_linear(torch.randn(2, 16), sbl.pack_weight(torch.randn(16, 16)), 16)


@pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() != "AVX512", reason="needs an AVX-512 CPU")
def test_a_failing_compiler_leaves_the_kernel_off_with_the_reason(fresh_library, monkeypatch):
    monkeypatch.setenv("CC", "false")  # exists and always fails
    assert not sbl.available()
    assert "could not build" in sbl.unavailable_reason()
    assert not list(fresh_library.rglob("*.so"))


@needs_kernel
def test_the_build_is_cached_per_source_and_compiler(fresh_library):
    assert sbl.available()
    built = list(fresh_library.rglob("*.so"))
    assert len(built) == 1
    mtime = built[0].stat().st_mtime_ns
    sbl._library.cache_clear()
    assert sbl.available()  # found in the cache, not rebuilt
    assert list(fresh_library.rglob("*.so")) == built and built[0].stat().st_mtime_ns == mtime



@pytest.mark.skipif(sbl._compiler() is None, reason="needs a C compiler")
def test_a_cached_library_others_could_have_written_is_not_loaded(fresh_library):
    """Loading a shared library runs its code: a cached one (or its directory) that another user could
    have written is refused, with the path in the reason."""
    built = sbl._build(sbl._compiler())  # compiles on any x86 host; only running it needs AVX-512
    assert built.stat().st_mode & 0o022 == 0 and built.parent.stat().st_mode & 0o077 == 0
    built.chmod(0o777)
    with pytest.raises(RuntimeError, match="writable by group or others"):
        sbl._build(sbl._compiler())
    built.chmod(0o755)
    built.parent.chmod(0o777)
    with pytest.raises(RuntimeError, match=str(built.parent)):
        sbl._build(sbl._compiler())
    built.parent.chmod(0o700)
    assert sbl._build(sbl._compiler()) == built
