"""The "w8a8" linear for many rows (int8 weights per output channel, each row's activations quantized to int8 as the
matmul starts, oneDNN's int8 GEMM): it equals the matmul by the dequantized weight and input up to fp32 rounding,
its rounding of a row is the formula's, a row's values are the same alone and in any batch, and unusable modes are
refused naming the argument."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from asr_checks import run_requests, speechlike

from omnimtp.runtime.kernels import small_batch_linear as sbl
from omnimtp.runtime.ops import check_many_row_mode, linear, many_row_mode_reason, quantize_weight

needs_w8a8 = pytest.mark.skipif(many_row_mode_reason("cpu") is not None, reason=f"w8a8: {many_row_mode_reason('cpu')}")

RTOL = 1e-5  # fp32 rounding of an exact int32 sum times two scales, relative to sum_k |x_k w_k|


@needs_w8a8
@pytest.mark.parametrize(("rows", "in_features", "out_features"), [(1, 64, 16), (5, 100, 37), (96, 256, 300),
                                                                   (300, 1024, 200)])
def test_equals_the_dequantized_matmul_and_rounds_within_half_a_step(rows, in_features, out_features):
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, in_features, generator=g) * torch.rand(rows, 1, generator=g) * 4
    weight = torch.randn(out_features, in_features, generator=g) * 0.05
    bias = torch.randn(out_features, generator=g)
    x_before, weight_before = x.clone(), weight.clone()
    q = quantize_weight(weight, "w8a8")
    assert q.mode == "w8a8"
    out = linear(x, None, bias, packed=q)
    xd, wd = q.dequantized_input(x), q.dequantized()
    reference = xd.double() @ wd.double().T + bias.double()
    assert out.shape == (rows, out_features) and out.dtype == torch.float32
    bound = RTOL * (xd.abs() @ wd.abs().T).double() + 1e-6
    assert ((out.double() - reference).abs() <= bound).all()
    assert torch.equal(x, x_before) and torch.equal(weight, weight_before)
    # weights within half a step of their channel's grid, inputs within half a step of their row's
    assert ((wd - weight).abs() <= weight.abs().amax(1, keepdim=True) / 127 / 2 * (1 + 1e-5)).all()
    assert ((xd - x).abs() <= x.abs().amax(1, keepdim=True) / 127 / 2 * (1 + 1e-5)).all()
    # and the whole matmul close to the float one (int8 on both sides: a fraction of a percent here)
    exact = x @ weight.T + bias
    assert (out - exact).norm() / exact.norm() < 0.02


@needs_w8a8
def test_a_row_is_the_same_bits_alone_and_in_any_batch():
    g = torch.Generator().manual_seed(1)
    x, weight = torch.randn(700, 512, generator=g), torch.randn(1000, 512, generator=g) * 0.05
    bias = torch.randn(1000, generator=g)
    q = quantize_weight(weight, "w8a8")
    batch = linear(x, None, bias, packed=q)
    for start, size in ((0, 1), (5, 1), (3, 2), (10, 7), (64, 33), (100, 600)):
        assert torch.equal(linear(x[start : start + size], None, bias, packed=q), batch[start : start + size])
    rows = linear(x.view(7, 100, 512), None, bias, packed=q)  # leading dims flattened, the same rows
    assert torch.equal(rows.view(700, 1000), batch)
    assert linear(x.bfloat16(), None, packed=q).dtype == torch.bfloat16


@needs_w8a8
def test_rows_are_rounded_as_the_formula_says():
    """scale = max|x| / 127, q = round(x * (127 / max|x|)) in fp32, ties to even, +128 for oneDNN's unsigned bytes;
    an all-zero row: 128s and scale 0 (zeros out); a NaN or an infinity: NaN out for that row only."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(9, 77, generator=g) * 3
    x[1, :4] = torch.tensor([1.0, -0.5, 0.25, 127.0])  # 127 is the maximum: 0.5 * 1 is a tie (rounds to 0)
    x[3] = 0.0
    x[5, 7] = float("nan")
    x[6, 0] = float("inf")
    q, scales = sbl.quantize_rows_u8(x)
    values = x.numpy()
    for row in (0, 1, 2, 4, 7, 8):
        amax = np.abs(values[row]).max()
        inv = np.float32(127.0) / amax
        expected = np.clip(np.rint(values[row] * inv), -127, 127) + 128
        assert np.array_equal(q[row].numpy(), expected.astype(np.uint8))
        assert scales[row, 0].item() == np.float32(amax / np.float32(127.0))
    assert q[1, 1].item() == 128 and q[1, 3].item() == 255
    assert (q[[3, 5, 6]] == 128).all() and scales[3, 0].item() == 0.0 and scales[[5, 6], 0].isnan().all()
    out = linear(x, None, packed=quantize_weight(torch.randn(20, 77, generator=g), "w8a8"))
    assert (out[3] == 0).all() and out[[5, 6]].isnan().all() and out[[0, 1, 2, 4, 7, 8]].isfinite().all()


def test_many_row_modes_are_checked_naming_the_argument():
    with pytest.raises(ValueError, match="int8_compute"):
        check_many_row_mode("w4a8", "cpu", "int8_compute")
    with pytest.raises(ValueError, match="mode='w8a8'.*CPU only"):
        check_many_row_mode("w8a8", "meta")
    with pytest.raises(ValueError, match="mode"):
        quantize_weight(torch.zeros(4, 4, device="meta"), "w8a8")


# --- int8_compute: Qwen3-ASR's audio encoder and prefill, the forced aligner's encoder and forward ----------------

@needs_w8a8
def test_int8_compute_asr_encodes_and_prefills_on_w8a8_and_a_request_alone_equals_it_batched():
    from omnimtp.engine.request import Request
    from omnimtp.families.qwen3_asr import Qwen3ASRFamily
    from omnimtp.models.qwen3_asr import EncoderLinear
    from omnimtp.packed_decoder import KVCache, decoder_forward
    from omnimtp.thinker import multimodal_prefill

    family = Qwen3ASRFamily.tiny(0)
    fast = Qwen3ASRFamily(family.model, family.tokenizer, quantize="w4a8", int8_compute=True)
    fc1 = fast.thinker.audio_tower.layers[0].fc1
    assert isinstance(fc1, EncoderLinear) and fc1.quantized.mode == "w8a8"
    assert fast.prefill_decoder.quantize == "w8a8" and fast.thinker_decoder.quantize == "w4a8"
    samples = speechlike(2.0, 4)
    ids, media = fast.transcription_inputs(samples, None, "")
    audio = torch.tensor(ids) == family.model.thinker.config.audio_token_id
    with torch.no_grad():
        exact = multimodal_prefill(family.thinker, ids, media, family.device).embeds
        prefill = multimodal_prefill(fast.thinker, ids, media, fast.device).embeds
    error = ((prefill[0, audio] - exact[0, audio]).norm() / exact[0, audio].norm()).item()
    assert 0 < error < 0.05  # int8 weights and rows: close to the float encoder's rows, not equal
    # the prompt's keys are the w8a8 decoder's (not the w4a8 one's the steps run on)
    run = fast.new_thinker([ids], [None], [None], 4, media=[media])
    run.step()
    expected, other = (KVCache(decoder, 1, capacity=len(ids) + 4) for decoder in (fast.prefill_decoder,
                                                                                   fast.thinker_decoder))
    decoder_forward(fast.prefill_decoder, expected, prefill, [0])
    decoder_forward(fast.thinker_decoder, other, prefill, [0])
    keys = run.kv.layer_views[-1][0][0, :, : len(ids)]
    assert torch.equal(keys, expected.layer_views[-1][0][0, :, : len(ids)])
    assert not torch.equal(keys, other.layer_views[-1][0][0, :, : len(ids)])
    audios = [speechlike(1.2, 8), speechlike(2.0, 9), speechlike(0.7, 10)]
    inputs = [fast.transcription_inputs(a, None, "") for a in audios]

    def make():
        return [Request(i, ids, max_new_tokens=8, max_frames=1, speaker=None, media=media)
                for i, (ids, media) in enumerate(inputs)]

    alone = [run_requests(fast, [request])[0] for request in make()]
    assert run_requests(fast, make()) == alone


@needs_w8a8
def test_int8_compute_aligner_runs_its_forward_on_w8a8_and_is_close_to_the_float_one():
    from omnimtp.families.qwen3_aligner import Qwen3ForcedAligner

    aligner = Qwen3ForcedAligner.tiny(0)
    fast = Qwen3ForcedAligner(aligner.model, aligner.tokenizer, int8_compute=True)
    assert fast.decoder.quantize == "w8a8" and fast.decoder.quantized_lm_head is not None
    assert fast.thinker.audio_tower.layers[0].fc1.quantized.mode == "w8a8"
    samples, text = speechlike(2.5, 3), "one two three four five six"
    words = fast.align(samples, text, "en")
    assert [w.word for w in words] == text.split() and all(w.start <= w.end for w in words)
    assert fast.align(samples, text, "en") == words  # repeats
    assert aligner.decoder.quantize is None  # the float aligner is unchanged


def test_int8_compute_is_checked_naming_it():
    from omnimtp.families.qwen3_aligner import Qwen3ForcedAligner
    from omnimtp.families.qwen3_asr import Qwen3ASRFamily

    family = Qwen3ASRFamily.tiny(0)
    with pytest.raises(ValueError, match="^int8_compute"):
        Qwen3ASRFamily(family.model, family.tokenizer, int8_compute="yes")
    with pytest.raises(ValueError, match="^int8_compute"):
        Qwen3ForcedAligner(Qwen3ForcedAligner.tiny(0).model, family.tokenizer, int8_compute=1)
    if many_row_mode_reason("cpu") is None:
        with pytest.raises(ValueError, match="^int8_compute: a quantized checkpoint"):
            Qwen3ASRFamily(family.model, family.tokenizer, quantize="w4a8", stored={}, int8_compute=True)


@needs_w8a8
def test_int8_compute_is_a_transcribe_and_serve_flag_for_the_models_that_hear(capsys):
    """`--int8-compute` reaches a Qwen3-ASR model (transcribe's --model; serve's --model and --asr-model) and the
    aligner (serve's --aligner-model), and nothing else: a command that would load no such model refuses it."""
    from pathlib import Path

    from omnimtp.cli import build_parser, main
    from omnimtp.pipeline import OmniPipeline
    from omnimtp.server.build import build_app

    question = str(Path(__file__).resolve().parents[1] / "examples" / "question.wav")
    assert main(["transcribe", question, "--model", "tiny-asr", "--quantize", "w4a8", "--int8-compute",
                 "--max-new-tokens", "4", "--json"]) == 0
    heard = capsys.readouterr().out
    fast = OmniPipeline.from_pretrained("tiny-asr", quantize="w4a8", int8_compute=True)
    assert fast.family.int8_compute
    assert f'"text_ids": {fast.transcribe(question, max_new_tokens=4).text_ids}' in heard
    assert main(["transcribe", question, "--int8-compute"]) == 2
    assert "--int8-compute: for a Qwen3-ASR model" in capsys.readouterr().err

    parse = build_parser().parse_args
    engine, app = build_app(parse(["serve", "--model", "tiny-asr", "--aligner-model", "tiny-aligner",
                                   "--quantize", "w4a8", "--int8-compute", "--no-warm-up"]))
    assert engine.family.int8_compute and app.state.serving.aligner.int8_compute
    engine, app = build_app(parse(["serve", "--asr-model", "tiny-asr", "--int8-compute", "--no-warm-up"]))
    assert app.state.serving.asr.engine.family.int8_compute and engine.family.speaks  # the omni model: as it was
    engine, app = build_app(parse(["serve", "--model", "tiny-asr", "--no-warm-up"]))
    assert not engine.family.int8_compute and engine.family.kv_dtype is None
    engine, app = build_app(parse(["serve", "--asr-model", "tiny-asr", "--quantize", "w4a8", "--kv-dtype", "bfloat16",
                                   "--no-warm-up"]))
    assert app.state.serving.asr.engine.family.kv_dtype == "bfloat16"
    assert main(["serve", "--int8-compute"]) == 2
    assert "--int8-compute: for a Qwen3-ASR model (--model or --asr-model)" in capsys.readouterr().err
    assert main(["serve", "--kv-dtype", "bfloat16"]) == 2
    assert "--kv-dtype: for a Qwen3-ASR model" in capsys.readouterr().err
    assert main(["transcribe", question, "--model", "tiny-asr", "--quantize", "w4a8", "--kv-dtype", "bfloat16",
                 "--max-new-tokens", "4", "--json"]) == 0
    bf16_kv = OmniPipeline.from_pretrained("tiny-asr", quantize="w4a8", kv_dtype="bfloat16")
    assert f'"text_ids": {bf16_kv.transcribe(question, max_new_tokens=4).text_ids}' in capsys.readouterr().out
    assert main(["transcribe", question, "--model", "tiny-asr", "--kv-dtype", "bfloat16"]) == 2  # (w4a8 only)
    assert "kv_dtype" in capsys.readouterr().err
