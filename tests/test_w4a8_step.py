"""A dense w4a8 decoder's decode step in one native call (`omnimtp.runtime.w4a8_step`): the op-by-op layers' values
up to rounding (with and without q/k norms and attention biases, one row, equal lengths, ragged rows, rows not in
consecutive slots), a row the same bits alone as in any batch and on any thread count, taken for w4a8 decode steps
only, and the Qwen3-TTS talker on it alone as in a batch."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2Config, Qwen2Model, Qwen3Config, Qwen3Model

from omnimtp.packed_decoder import KVCache, PackedDecoder, decoder_forward
from omnimtp.runtime import w4a8_step
from omnimtp.runtime.kernels import small_batch_linear as sbl

pytestmark = pytest.mark.skipif(not sbl.available(), reason=f"kernel unavailable: {sbl.unavailable_reason()}")

HIDDEN = 256


def _decoder(kind: str, mode: str | None = "w4a8") -> PackedDecoder:
    torch.manual_seed(0)
    widths = dict(hidden_size=HIDDEN, intermediate_size=384, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=64)
    if kind == "qwen3":  # per-head q/k norms, no biases
        model = Qwen3Model(Qwen3Config(head_dim=64, **widths))
    else:  # q/k/v biases, no q/k norms
        model = Qwen2Model(Qwen2Config(**widths))
        with torch.no_grad():
            for layer in model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    return PackedDecoder.from_module(model.eval(), quantize=mode)


def _decode(decoder, slots: list[int], prompt_lengths: list[int], steps: int = 4, native: bool = True,
            monkeypatch=None) -> torch.Tensor:
    """Prefill slot s with prompt_lengths[i] rows, then `steps` decode steps of every slot at once → [steps, R, H]
    (each slot's inputs seeded by the slot: the same alone and in a batch)."""
    if not native:
        monkeypatch.setattr(w4a8_step, "step_table", lambda decoder: None)
    cache = KVCache(decoder, 4, capacity=4)  # grows during the run
    outs = []
    with torch.inference_mode():
        for slot, length in zip(slots, prompt_lengths, strict=True):
            prompt = torch.randn(1, length, HIDDEN, generator=torch.Generator().manual_seed(slot))
            decoder_forward(decoder, cache, prompt, [slot])
        inputs = {s: torch.randn(steps, 1, 1, HIDDEN, generator=torch.Generator().manual_seed(10 + s)) for s in slots}
        for step in range(steps):
            embeds = torch.cat([inputs[s][step] for s in slots])  # [R, 1, H]
            outs.append(decoder_forward(decoder, cache, embeds, slots).last_hidden)
    if not native:
        monkeypatch.undo()
    return torch.stack(outs)


@pytest.mark.parametrize("kind", ["qwen3", "qwen2"])
@pytest.mark.parametrize(("slots", "lengths"), [([0], [5]), ([0, 1, 2], [5, 5, 5]), ([0, 1, 2], [5, 3, 6]),
                                                  ([1, 3], [4, 2])])
def test_the_native_step_equals_the_op_by_op_layers(kind, slots, lengths, monkeypatch):
    """One row (the 1-D path), rows of equal lengths, ragged rows (per-row columns and a mask) and rows in slots
    that are not consecutive: the native step's outputs (and the keys it cached, which the later steps read) are
    the op-by-op layers' up to rounding, which w4a8's int8 activations may turn into a grid step here and there (on
    a CPU whose torch ops round otherwise)."""
    decoder = _decoder(kind)
    assert w4a8_step.step_table(decoder) is not None
    native = _decode(decoder, slots, lengths)
    reference = _decode(decoder, slots, lengths, native=False, monkeypatch=monkeypatch)
    error = ((native - reference).norm() / reference.norm()).item()
    assert error < 5e-3, error  # 4e-8 to 7e-8 here; one int8 grid step about 1e-3; a wrong RoPE or column 1e-2+


def test_a_row_is_the_same_alone_as_in_any_batch_and_on_any_thread_count():
    decoder = _decoder("qwen3")
    batch = _decode(decoder, [0, 1, 2], [5, 3, 6])
    for i, (slot, length) in enumerate(zip([0, 1, 2], [5, 3, 6], strict=True)):
        assert torch.equal(_decode(decoder, [slot], [length])[:, 0], batch[:, i])
    assert torch.equal(_decode(decoder, [1, 3], [3, 6])[:, 0], batch[:, 1])  # another slot layout
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one_thread = _decode(decoder, [0, 1, 2], [5, 3, 6])
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one_thread, batch)
    assert torch.equal(_decode(decoder, [0, 1, 2], [5, 3, 6]), batch)  # repeatable


@pytest.mark.parametrize(("slots", "lengths"), [([0], [5]), ([0, 1, 2], [5, 3, 6])])
def test_a_bf16_cache_is_the_op_by_op_layers_on_it_and_near_the_fp32_cache(slots, lengths, monkeypatch):
    """`with_kv_dtype(torch.bfloat16)`: the cache holds bf16; the native step (which writes its keys and values
    rounded and reads them widened) equals the op-by-op layers on the same bf16 cache up to rounding, a row is
    the same bits alone as in a batch, and both stay near the fp32 cache's values (bf16's rounding, not garbage;
    not equal either: the cache really is bf16)."""
    decoder = _decoder("qwen3")
    bf16 = decoder.with_kv_dtype(torch.bfloat16)
    assert KVCache(bf16, 1).buffer.dtype == torch.bfloat16 and KVCache(decoder, 1).buffer.dtype == torch.float32
    native = _decode(bf16, slots, lengths)
    reference = _decode(bf16, slots, lengths, native=False, monkeypatch=monkeypatch)
    error = ((native - reference).norm() / reference.norm()).item()
    assert error < 5e-3, error
    fp32 = _decode(decoder, slots, lengths)
    error = ((native - fp32).norm() / fp32.norm()).item()
    assert 0 < error < 2e-2, error
    if len(slots) > 1:
        assert torch.equal(_decode(bf16, [slots[1]], [lengths[1]])[:, 0], native[:, 1])


def test_kv_dtype_other_than_bf16_of_fp32_is_a_value_error_naming_it():
    decoder = _decoder("qwen3")
    assert decoder.with_kv_dtype(torch.float32).kv_dtype is None and decoder.with_kv_dtype(None).kv_dtype is None
    with pytest.raises(ValueError, match="kv_dtype"):
        decoder.with_kv_dtype(torch.float16)


def test_the_native_step_runs_w4a8_decode_steps_only(monkeypatch):
    """One call a decode step (not one a layer), none for a prefill, a float or an int4 decoder."""
    calls = []
    kernel = sbl.w4a8_decode_step
    monkeypatch.setattr(sbl, "w4a8_decode_step", lambda *a, **k: calls.append(a[3]) or kernel(*a, **k))
    _decode(_decoder("qwen3"), [0, 1], [5, 3], steps=3)
    assert calls == [3, 3, 3]  # three layers each
    calls.clear()
    for mode in (None, "int4"):
        decoder = _decoder("qwen3", mode)
        assert w4a8_step.step_table(decoder) is None
        _decode(decoder, [0], [4], steps=2)
    assert calls == []


def test_bad_isa_is_a_value_error_naming_it():
    with pytest.raises(ValueError, match="isa"):
        sbl.w4a8_decode_step(torch.zeros(1, 8), None, None, 0, (1, 1, 2, 8), (8, 2, 8), 1e-6, torch.zeros(1, 2),
                             torch.zeros(1, 2), None, None, 1, (0, 0, 0), None, 1.0, isa="SSE2")


def test_the_qwen3_tts_talker_speaks_alone_as_in_a_batch_on_the_native_step(monkeypatch):
    """Tiny Qwen3-TTS in w4a8: its talker's decode steps run natively, and a request's codes are the same alone
    and in a batch."""
    from omnimtp.pipeline import OmniPipeline

    rows = []
    run = w4a8_step.run  # the talker's decode steps (the code predictor's are `run_block`'s)
    monkeypatch.setattr(w4a8_step, "run", lambda d, t, x, *a: rows.append(x.reshape(-1, x.shape[-1]).shape[0])
                        or run(d, t, x, *a))
    pipe = OmniPipeline.from_pretrained("tiny-tts", quantize="w4a8", max_frames=6)
    texts = ["Hello there.", "A second, longer sentence."]
    batch = pipe.speech(texts, voice="aiden", max_frames=6)
    assert rows and max(rows) == 2
    for text, together in zip(texts, batch, strict=True):
        alone = pipe.speech(text, voice="aiden", max_frames=6)
        assert torch.equal(alone.codes, together.codes)


def test_left_padded_rows_of_a_shared_length_cache_are_the_same_alone(monkeypatch):
    """The speculative loops' cache (every slot one length, padding masked by an additive kv_mask): a padded row's
    decode steps on the native step are its bits alone, without the padding."""
    from omnimtp.runtime.decoder import shared_length_forward

    calls = []
    kernel = sbl.w4a8_decode_step
    monkeypatch.setattr(sbl, "w4a8_decode_step", lambda *a, **k: calls.append(a[0].shape[0]) or kernel(*a, **k))
    decoder = _decoder("qwen3")
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randn(1, 3, HIDDEN, generator=g), torch.randn(1, 5, HIDDEN, generator=g)]
    steps = torch.randn(3, 2, 1, HIDDEN, generator=g)

    def run(rows: list[int]) -> torch.Tensor:
        longest = max(prompts[r].shape[1] for r in rows)
        pads = [longest - prompts[r].shape[1] for r in rows]
        cache = KVCache(decoder, len(rows), capacity=16)
        x = torch.cat([torch.cat([torch.zeros(1, pad, HIDDEN), prompts[r]], dim=1)
                       for r, pad in zip(rows, pads, strict=True)])
        kv_mask = torch.tensor([[0] * pad + [1] * (longest - pad) for pad in pads])
        positions = (kv_mask.cumsum(-1) - 1).clamp(min=0)
        outs = []
        with torch.inference_mode():
            shared_length_forward(decoder, cache, x, positions, kv_mask if any(pads) else None)
            for step in steps:
                kv_mask = torch.cat([kv_mask, torch.ones(len(rows), 1, dtype=kv_mask.dtype)], dim=1)
                positions = positions[:, -1:] + 1
                outs.append(shared_length_forward(decoder, cache, step[rows], positions,
                                                  kv_mask if any(pads) else None)[:, 0])
        return torch.stack(outs)  # [steps, R, H]

    batch = run([0, 1])
    assert calls == [2, 2, 2]  # the padded batch's steps ran natively too
    for row in (0, 1):
        assert torch.equal(run([row])[:, 0], batch[:, row])


def test_the_code_predictors_steps_run_natively_alone_as_in_a_batch(monkeypatch):
    """The eager w4a8 code predictor (a causal block of 2 positions, then 1, on its fixed buffer): one native call a
    step, the op-by-op steps' codes, and a row's codes and embeddings the same alone as in a batch."""
    from omnimtp.models.qwen3_tts import tiny_qwen3_tts
    from omnimtp.talker.code_predictor import CodePredictorRunner

    cp = tiny_qwen3_tts(0).talker.code_predictor
    runner = CodePredictorRunner(cp, 3, quantize="w4a8")
    g = torch.Generator().manual_seed(5)
    width = runner.hidden_size
    hidden, cb0 = torch.randn(3, width, generator=g), torch.randn(3, width, generator=g)
    calls = []
    kernel = sbl.w4a8_decode_step
    monkeypatch.setattr(sbl, "w4a8_decode_step", lambda *a, **k: calls.append(a[0].shape[0]) or kernel(*a, **k))
    batch = runner.run(hidden, cb0)
    steps = runner.num_code_groups - 1
    assert calls == [6] + [3] * (steps - 1)  # 3 rows × 2 positions, then 3 rows
    for row in range(3):
        alone = runner.run(hidden[row : row + 1], cb0[row : row + 1])
        assert torch.equal(alone.codes[0], batch.codes[row]) and torch.equal(alone.embed_sum[0], batch.embed_sum[row])
    monkeypatch.setattr(w4a8_step, "step_table", lambda decoder: None)
    reference = runner.run(hidden, cb0)
    assert torch.equal(reference.codes, batch.codes)


def test_auto_compiles_the_predictor_only_where_it_runs_op_by_op():
    """compile="auto" (what `serve` asks): a w4a8 predictor on the native step builds no graphs, an fp32 or int8 one
    compiles its frame; a server on the native step starts no warm-up."""
    from omnimtp.families.qwen3_omni import Qwen3OmniFamily
    from omnimtp.models.qwen3_tts import tiny_qwen3_tts
    from omnimtp.server.build import build_engine
    from omnimtp.talker.code_predictor import CodePredictorRunner

    cp = tiny_qwen3_tts(0).talker.code_predictor
    assert CodePredictorRunner(cp, 2, compile="auto", quantize="w4a8").compile_mode is None
    assert CodePredictorRunner(cp, 2, compile="auto", quantize="int8").compile_mode == "frame"
    assert CodePredictorRunner(cp, 2, compile="auto").compile_mode == "frame"
    with pytest.raises(ValueError, match="compile"):
        CodePredictorRunner(cp, 2, compile="always")
    assert not build_engine(None, max_batch_size=2, max_frames=4, compile_predictor="auto", quantize="w4a8").warm_up
    assert build_engine(None, max_batch_size=2, max_frames=4, compile_predictor="auto").warm_up
    assert Qwen3OmniFamily.tiny(0, compile_predictor="auto").predictor(2).compile_mode == "frame"
