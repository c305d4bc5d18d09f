"""code2wav's sliding-window transformer streamed for several streams in one forward (`StreamedTransformer`):
equal to transformers' forward within fp32 rounding, each stream's rows bit for bit the same alone and in any call,
on the shared decoder runtime (LayerScale, sliding windows, a KV slot per stream)."""

import gc

import pytest
import torch
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeCode2Wav

from omnimtp.codec import stream_transformer
from omnimtp.codec.speech_tokenizer import tiny_speech_tokenizer
from omnimtp.codec.streaming import StreamingCode2Wav
from omnimtp.models.tiny import tiny_qwen3_omni_config
from omnimtp.runtime.decoder import PackedDecoder
from omnimtp.runtime.kernels import small_batch_linear
from omnimtp.runtime.kv_cache import KVCache

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# Streamed transformer vs transformers' forward over all frames at once, max |Δ| relative to the output's peak:
# measured on the tiny models 6.9e-8 (Qwen3-Omni's) and 4.2e-7 (Qwen3-TTS's, its projections included) over 300
# frames in the chunks below (pieces and slides included), at the released Qwen3-TTS widths (random weights) 2.0e-6
# (benchmarks/RESULTS.md, "codec transformer batched"): the row kernel and the attention kernel sum in another order
# than MKL and SDPA. A dropped window or RoPE offset moves it far past the bound (the mutation check's).
TRANSFORMER_REL = 1e-5


@pytest.fixture(scope="module", params=["qwen3_omni", "qwen3_tts"])
def streamed(request):
    """(StreamingCode2Wav, transformers' forward of frames' inputs [T, H] → [T, H], input width) of either family."""
    if request.param == "qwen3_omni":
        config = tiny_qwen3_omni_config().code2wav_config
        config.num_hidden_layers = 2
        with torch.random.fork_rng():
            torch.manual_seed(0)
            code2wav = Qwen3OmniMoeCode2Wav(config).eval()
        with torch.no_grad():  # LayerScale's init (0.01) would hide most of a layer's output
            for layer in code2wav.pre_transformer.layers:
                layer.self_attn_layer_scale.scale.normal_(1.0, 0.3)
                layer.mlp_layer_scale.scale.normal_(1.0, 0.3)
        transformer = code2wav.pre_transformer
        decoder = StreamingCode2Wav(code2wav)

        def reference(x):
            with torch.no_grad():
                return transformer(inputs_embeds=x[None]).last_hidden_state[0]
        return decoder, reference, config.hidden_size
    tts = tiny_speech_tokenizer(seed=0)

    def reference(x):
        with torch.no_grad():
            return tts.pre_transformer.project(x[None])[0]
    return tts._streaming, reference, tts.latent_dim


def _run(decoder, streams, inputs, chunks):
    """Each stream's inputs [T_i, H] through the streamed transformer in its chunks (one call a step, every stream
    that still has frames in it) → each stream's outputs [T_i, H]."""
    outputs = [[] for _ in streams]
    done = [0] * len(streams)
    for step in range(max(len(c) for c in chunks)):
        members = [i for i, c in enumerate(chunks) if step < len(c)]
        counts = [chunks[i][step] for i in members]
        x = torch.cat([inputs[i][done[i] : done[i] + n] for i, n in zip(members, counts, strict=True)])
        hidden = decoder.transformer.run([streams[i] for i in members], x, counts, 64)
        for i, part in zip(members, hidden.split(counts), strict=True):
            outputs[i].append(part)
            done[i] += part.shape[0]
    return [torch.cat(o) for o in outputs]


def _inputs(num_frames, width, seed):
    return torch.randn(num_frames, width, generator=torch.Generator().manual_seed(seed))


def test_streamed_transformer_is_transformers_forward_within_fp32_rounding(streamed):
    """Chunks of 1 to 90 frames (longer than a piece, past the window and the slot's capacity, so pieces and
    slides run) give transformers' output over all frames within TRANSFORMER_REL of its peak."""
    decoder, reference, width = streamed
    chunks = [1, 2, 4, 1, 8, 90, 3, 70, 1, 40, 80]
    x = _inputs(sum(chunks), width, 1)
    ours = _run(decoder, [decoder.new_stream()], [x], [chunks])[0]
    expected = reference(x)
    error = float((ours - expected).abs().max() / expected.abs().max())
    assert error <= TRANSFORMER_REL, error
    assert stream_transformer.PIECE_FRAMES < 90 and decoder.transformer.capacity < sum(chunks)


def test_a_streams_rows_are_bit_for_bit_the_same_alone_and_in_any_call(streamed):
    """Three streams at different positions and chunk lengths (one of more than a piece) in calls together give each
    stream exactly its outputs alone, and each call's rows go through one forward (the weights read once)."""
    if not small_batch_linear.available():
        pytest.skip(f"no row kernel here: {small_batch_linear.unavailable_reason()}")
    decoder, _, width = streamed
    chunks = [[5, 1, 1, 2, 100, 1], [1, 3, 70, 1, 1, 4], [2, 2, 2]]
    inputs = [_inputs(sum(c), width, 10 + i) for i, c in enumerate(chunks)]
    alone = [_run(decoder, [decoder.new_stream()], [x], [c])[0] for x, c in zip(inputs, chunks, strict=True)]
    forwards, kernel_rows = [], []
    forward, run = stream_transformer.StreamedTransformer._forward, small_batch_linear._run
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(stream_transformer.StreamedTransformer, "_forward",
                      lambda self, *args: forwards.append(len(args[1])) or forward(self, *args))
        patch.setattr(small_batch_linear, "_run", lambda x, *rest: kernel_rows.append(x.shape[0]) or run(x, *rest))
        together = _run(decoder, [decoder.new_stream() for _ in chunks], inputs, chunks)
    for ours, theirs in zip(together, alone, strict=True):
        assert torch.equal(ours, theirs)
    # a call is one forward of its streams; a call with a 70- or 100-frame chunk takes two rounds of pieces of 64
    assert forwards == [3, 3, 3, 1, 2, 2, 1, 2]
    # every layer's matrices read once for all the rows of a forward, on the row kernel (e.g. the first call's
    # 5 + 1 + 2, the third's first round's 1 + 64 + 2)
    num_layers = decoder.transformer.module.config.num_hidden_layers
    assert kernel_rows[: 4 * num_layers] == [8] * (4 * num_layers)
    assert all(kernel_rows.count(rows) >= 4 * num_layers for rows in (67, 65, 36))


def test_streams_free_their_slots():
    """A stream's KV slot is taken when it is made and free again once it is collected: making and dropping streams
    does not grow the cache; a stream of another decoder is refused."""
    tts = tiny_speech_tokenizer(seed=0)
    codes = torch.randint(0, 2048, (16, 3), generator=torch.Generator().manual_seed(0))
    kept = [tts.new_stream() for _ in range(3)]
    size = tts._streaming.transformer.cache.max_batch_size
    for _ in range(10):
        stream = tts.new_stream()
        tts.decode_streams([stream], [codes])
        del stream
        gc.collect()
    assert tts._streaming.transformer.cache.max_batch_size == size
    assert len({s.slot for s in kept}) == 3
    other = tiny_speech_tokenizer(seed=0)
    with pytest.raises(ValueError, match="streams"):
        other.decode_streams([kept[0]], [codes])
    assert other.decode_streams([], []) == []


def test_the_streamed_transformer_holds_its_packs_alone(streamed):
    """On the row kernel the packed transformer keeps no float copies of its matrices (meta tensors of their shapes
    stand in: packing's fused q/k/v and gate/up are let go), and its float matrices come back only for the path
    without the kernel (`streaming.ROW_KERNEL_MAX_ROWS` 0), which still gives the kernel's outputs within
    rounding."""
    if not small_batch_linear.available():
        pytest.skip(f"no row kernel here: {small_batch_linear.unavailable_reason()}")
    decoder, _, width = streamed
    x = _inputs(6, width, 5)
    ours = decoder.transformer.run([decoder.new_stream()], x, [6], 64)
    packed = decoder.transformer._decoder()[0]
    assert {layer.qkv.device.type for layer in packed.layers} == {"meta"}
    assert {layer.gate_up.device.type for layer in packed.layers} == {"meta"}
    plain = decoder.transformer.run([decoder.new_stream()], x, [6], 0)
    torch.testing.assert_close(plain, ours, rtol=0, atol=TRANSFORMER_REL * float(ours.abs().max()))


def test_a_sliding_window_decoder_is_packed_only_when_asked_for():
    """PackedDecoder packs code2wav's sliding-window layers (LayerScale included) only given their window: the
    decoders that run no window mask refuse them, naming the option."""
    config = tiny_qwen3_omni_config().code2wav_config
    module = Qwen3OmniMoeCode2Wav(config).pre_transformer
    with pytest.raises(ValueError, match="sliding_window=72"):
        PackedDecoder.from_module(module)
    packed = PackedDecoder.from_module(module, sliding_window=72)
    assert packed.sliding_window == 72 and packed.layers[0].qk_norm is None
    assert torch.equal(packed.layers[0].attn_scale, module.layers[0].self_attn_layer_scale.scale)
    assert torch.equal(packed.layers[0].mlp_scale, module.layers[0].mlp_layer_scale.scale)


def test_kv_cache_slots_slide_and_grow():
    """`slide` keeps a slot's last positions at the front (its RoPE offset grows by what it drops); `add_slots` keeps
    what the slots held; `plan_positions` lays out one row a position, slot by slot."""
    shape = type("Dims", (), dict(num_layers=1, num_kv_heads=1, head_dim=2, dtype=torch.float32,
                                  device=torch.device("cpu")))
    cache = KVCache(shape, 2, capacity=6, is_growable=False)
    cache.buffer[0, 0, 1, 0, :5] = torch.arange(5.0)[:, None]
    cache.lengths[1] = 5
    cache.slide(1, 2)
    assert cache.lengths == [0, 2] and cache.rope_offsets == [0, 3]
    assert cache.buffer[0, 0, 1, 0, :2, 0].tolist() == [3.0, 4.0]
    assert cache.add_slots(2) == [2, 3] and cache.max_batch_size == 4
    assert cache.buffer[0, 0, 1, 0, :2, 0].tolist() == [3.0, 4.0] and cache.lengths == [0, 2, 0, 0]
    where = cache.plan_positions([1, 3], [2, 3])
    assert where.slot_index.tolist() == [1, 1, 3, 3, 3] and where.positions[:, 0].tolist() == [2, 3, 0, 1, 2]
    assert where.num_columns == 4 and where.in_place
    cache.commit_positions([1, 3], [2, 3])
    assert cache.lengths == [0, 4, 0, 3]
    with pytest.raises(ValueError, match="holds 6"):
        cache.plan_positions([1], [3])


def test_decode_attention_reads_each_rows_kv_row_in_place():
    """decode_attention's kv_rows: query rows reading rows of a shared buffer give bit for bit what they give on a
    gathered copy, each with its own mask row."""
    if not small_batch_linear.available():
        pytest.skip(f"no row kernel here: {small_batch_linear.unavailable_reason()}")
    generator = torch.Generator().manual_seed(3)
    query = torch.randn(5, 4, 16, generator=generator)
    keys, values = torch.randn(3, 2, 9, 16, generator=generator), torch.randn(3, 2, 9, 16, generator=generator)
    kv_rows = torch.tensor([2, 2, 0, 1, 2])
    mask = torch.rand(5, 9, generator=generator) > 0.3
    mask[:, 0] = True
    ours = small_batch_linear.decode_attention(query, keys, values, 0.25, mask, kv_rows)
    gathered = small_batch_linear.decode_attention(query, keys[kv_rows], values[kv_rows], 0.25, mask)
    assert torch.equal(ours, gathered)
    with pytest.raises(ValueError, match="kv_rows"):
        small_batch_linear.decode_attention(query, keys, values, 0.25, mask, torch.tensor([0, 1, 2, 3, 0]))


def test_a_decode_while_another_thread_compiles_runs_on_the_packs_with_the_same_bits(streamed, monkeypatch):
    """torch.compile's "compiling" flag is the process's, not a thread's: while a background warm-up compiles the
    code predictor, the engine thread's eager ops see it set (`omnimtp.runtime.tracing`). A decode then must run as
    it does otherwise: the same rows bit for bit, and no `torch.mv` of the meta matrices the streamed transformer
    holds in its packs' place (which failed every request decoded during a compile)."""
    if not small_batch_linear.available():
        pytest.skip(f"no row kernel here: {small_batch_linear.unavailable_reason()}")
    decoder, _, width = streamed
    chunks = [1, 2, 1, 3]
    x = _inputs(sum(chunks), width, 7)
    expected = _run(decoder, [decoder.new_stream()], [x], [chunks])[0]
    monkeypatch.setattr(torch.compiler, "_is_compiling_flag", True)
    assert torch.compiler.is_compiling()
    assert torch.equal(_run(decoder, [decoder.new_stream()], [x], [chunks])[0], expected)
