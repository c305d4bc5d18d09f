"""Qwen3-ASR as a family: the prompt, features and greedy tokens of the reference (`qwen_asr`, on the same tiny
seeded checkpoint in the released layout), a request alone equals it in a batch, quantized runs, the released
layout round trip, and bad input."""

from __future__ import annotations

import numpy as np
import pytest
import qwen_asr_reference as reference
import torch
from asr_checks import RATE, run_requests, speechlike

from omnimtp.engine.core import EngineConfig, EngineCore
from omnimtp.engine.request import Request
from omnimtp.families.asr_stream import StreamingRecognition
from omnimtp.families.qwen3_asr import Qwen3ASRFamily, parse_transcript
from omnimtp.models.qwen3_asr import EncoderLinear, Qwen3ASRModel, encode_audio, fast_audio_encoder, tiny_qwen3_asr
from omnimtp.pipeline import OmniPipeline
from omnimtp.runtime.ops import PackedGemm, linear, many_row_mode_reason, packed_gemm_kind
from omnimtp.sampling import SamplingParams
from omnimtp.thinker import multimodal_prefill


@pytest.fixture(scope="module")
def family():
    return Qwen3ASRFamily.tiny(0)


@pytest.fixture(scope="module")
def ref(family):
    return reference.reference_model(family.model)


def test_prompt_and_features_are_the_reference_processors(family):
    """The released prompt (`_build_text_prompt`'s string, a forced language's "language X<asr_text>" after it)
    through the reference's processor gives our ids and features; a context's special-token string stays text."""
    processor = reference.reference_processor(family.processor)
    samples = speechlike(1.3, 1)
    for language, context in ((None, ""), ("en", "Names: Qwen, Omni."), ("Chinese", "上文")):
        ids, media = family.transcription_inputs(samples, language, context)
        prompt = (f"<|im_start|>system\n{context}<|im_end|>\n<|im_start|>user\n<|audio_start|><|audio_pad|>"
                  "<|audio_end|><|im_end|>\n<|im_start|>assistant\n")
        if language is not None:
            prompt += f"language {family.transcription_language(language)}<asr_text>"
        expected = processor(text=[prompt], audio=[samples], return_tensors="pt")
        assert ids == expected["input_ids"][0].tolist()
        assert torch.equal(media.input_features, expected["input_features"])
        assert torch.equal(media.feature_attention_mask, expected["feature_attention_mask"])
    ids, _ = family.transcription_inputs(samples, None, "<|im_end|>")
    assert ids.count(family.tokenizer.convert_tokens_to_ids("<|im_end|>")) == 2  # the template's two, not a third


def test_greedy_tokens_equal_the_reference(family, ref):
    """Greedy transcripts of two audios, with and without a forced language and context, are the reference's
    `generate` tokens on the same checkpoint."""
    pipe = OmniPipeline(family=family, max_new_tokens=24)
    for seconds, seed, language, context in ((2.0, 2, None, ""), (0.7, 3, "en", "Hello"), (3.1, 4, "zh", "")):
        samples = speechlike(seconds, seed)
        ours = pipe.transcribe(samples, language=language, prompt=context)
        ids, media = family.transcription_inputs(samples, language, context)
        expected = reference.greedy_ids(ref, ids, media.input_features, media.feature_attention_mask,
                                        family.eos_token_ids, 24)
        assert ours.text_ids == expected
        assert len(set(expected)) > 3  # a reply that depends on the audio and the step, not one token repeated


def test_a_request_alone_equals_it_in_a_batch(family):
    """Greedy and seeded-sampled requests give the same tokens alone and batched with others."""
    specs = [(speechlike(1.5, 5), None, None), (speechlike(0.9, 6), SamplingParams(temperature=0.9), 11),
             (speechlike(2.4, 7), SamplingParams(temperature=1.0, top_k=20), 12)]
    requests = []
    for i, (samples, sampling, seed) in enumerate(specs):
        ids, media = family.transcription_inputs(samples, None, "")
        requests.append(lambda i=i, ids=ids, media=media, sampling=sampling, seed=seed: Request(
            i, ids, max_new_tokens=16, max_frames=1, speaker=None, thinker_sampling=sampling, seed=seed, media=media))
    alone = [run_requests(family, [make()])[0] for make in requests]
    batched = run_requests(family, [make() for make in requests])
    assert alone == batched
    assert len({tuple(ids) for ids in alone}) == 3


@pytest.mark.parametrize("mode", ["int8", "w4a8"])
def test_quantized_transcribes_alone_as_in_a_batch_and_starts_as_the_float_model(family, mode):
    """A quantized Qwen3-ASR (decoder and head) runs on the engine and a request alone equals it batched; int8
    starts as the float model on these audios (4-bit weights move a tiny model's logits too far to ask that)."""
    quantized = Qwen3ASRFamily(family.model, family.tokenizer, quantize=mode)
    audios = [speechlike(1.2, 8), speechlike(2.0, 9)]
    inputs = [family.transcription_inputs(samples, None, "") for samples in audios]

    def make(fam):
        return [Request(i, ids, max_new_tokens=8, max_frames=1, speaker=None, media=media)
                for i, (ids, media) in enumerate(inputs)]

    alone = [run_requests(quantized, [request])[0] for request in make(quantized)]
    assert run_requests(quantized, make(quantized)) == alone
    if mode == "int8":
        assert [ids[0] for ids in alone] == [ids[0] for ids in run_requests(family, make(family))]


def test_a_bf16_kv_cache_transcribes_alone_as_in_a_batch_near_the_fp32_cache(family):
    """kv_dtype="bfloat16" (w4a8): the thinker's cache is bf16, a request alone equals it batched, and the first
    token is the fp32 cache's (a tiny random model's later tokens may flip on the cache's rounding: the released
    widths' agreement is in benchmarks/RESULTS.md); bad values name kv_dtype."""
    fp32_cache = Qwen3ASRFamily(family.model, family.tokenizer, quantize="w4a8")
    bf16_cache = Qwen3ASRFamily(family.model, family.tokenizer, quantize="w4a8", kv_dtype="bfloat16")
    assert bf16_cache.thinker_decoder.kv_dtype == torch.bfloat16 and fp32_cache.thinker_decoder.kv_dtype is None
    inputs = [family.transcription_inputs(samples, None, "") for samples in (speechlike(1.2, 8), speechlike(2.0, 9))]

    def make():
        return [Request(i, ids, max_new_tokens=8, max_frames=1, speaker=None, media=media)
                for i, (ids, media) in enumerate(inputs)]

    alone = [run_requests(bf16_cache, [request])[0] for request in make()]
    assert run_requests(bf16_cache, make()) == alone
    assert [ids[0] for ids in alone] == [ids[0] for ids in run_requests(fp32_cache, make())]
    for bad, kwargs in (("float16", {"quantize": "w4a8"}), ("bfloat16", {}), ("bfloat16", {"quantize": "int8"})):
        with pytest.raises(ValueError, match="kv_dtype"):
            Qwen3ASRFamily(family.model, family.tokenizer, kv_dtype=bad, **kwargs)
    pipe = OmniPipeline.from_pretrained("tiny-asr", quantize="w4a8", kv_dtype="bfloat16", max_new_tokens=4)
    assert pipe.family.thinker_decoder.kv_dtype == torch.bfloat16


def test_the_released_layout_round_trips(family, tmp_path):
    """save_pretrained writes config.json + model.safetensors (the tied head not stored) that from_pretrained reads
    back to the same transcript; a file that does not match its config is refused naming path."""
    OmniPipeline(family=family, max_new_tokens=12).save_pretrained(tmp_path)
    pipe = OmniPipeline.from_pretrained(tmp_path)  # its caps, feature extractor and tokenizer too
    assert pipe.config.max_new_tokens == 12 and pipe.processor.feature_extractor.feature_size == 16
    samples = speechlike(1.0, 10)
    assert pipe.transcribe(samples).text_ids == OmniPipeline(family=family, max_new_tokens=12).transcribe(
        samples).text_ids
    from safetensors.torch import load_file, save_file

    weights = load_file(tmp_path / "model.safetensors")
    assert "thinker.lm_head.weight" not in weights
    weights.pop("thinker.model.norm.weight")
    save_file(weights, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="path: .*missing"):
        Qwen3ASRModel.from_pretrained(tmp_path)


def test_transcript_language_and_streamed_text():
    """The reply's "language X<asr_text>" names the language and is not part of the text, streamed or not."""
    assert parse_transcript("language English<asr_text> Hello there. ") == ("English", "Hello there.")
    assert parse_transcript("language None<asr_text>") == (None, "")
    assert parse_transcript("no tag at all") == (None, "no tag at all")
    assert parse_transcript("language English<asr_text>Hi", "English") == ("English", "language English<asr_text>Hi")
    family = Qwen3ASRFamily.tiny(0)
    deltas = family.transcript_deltas(None)
    pieces = [deltas.push(d) for d in ("lang", "uage Eng", "lish<asr", "_text> Hel", "lo ", "there.")]
    assert pieces[:3] == ["", "", ""] and "".join(pieces) + deltas.finish() == "Hello there."


def test_bad_input_names_the_argument(family):
    pipe = OmniPipeline(family=family, max_new_tokens=4)
    samples = speechlike(0.5, 11)
    with pytest.raises(ValueError, match="^language: 'klingon'"):
        pipe.transcribe(samples, language="klingon")
    with pytest.raises(ValueError, match="^prompt:"):
        pipe.transcribe(samples, prompt=3)
    with pytest.raises(ValueError, match="^audio:"):
        pipe.transcribe(np.zeros(0, dtype=np.float32))
    with pytest.raises(ValueError, match="^prompt: this model has no chat"):
        pipe.generate("Hi")
    with pytest.raises(ValueError, match="^text: this model does not speak"):
        pipe.speech("Hi")
    with pytest.raises(ValueError, match="^speaker:"):
        family.check_speaker("ethan")


def test_the_command_line_transcribes_with_tiny_asr_and_checks_the_aligner_path(tmp_path, capsys):
    from pathlib import Path

    from omnimtp.cli import main

    question = Path(__file__).resolve().parents[1] / "examples" / "question.wav"
    assert main(["transcribe", str(question), "--model", "tiny-asr", "--max-new-tokens", "3"]) == 0
    assert main(["serve", "--model", "tiny-asr", "--aligner-model", str(tmp_path)]) == 2
    assert "--aligner-model: " in capsys.readouterr().err
    (tmp_path / "config.json").write_text('{"model_type": "qwen3_asr", "thinker_config": {}}')
    assert main(["serve", "--model", "tiny-asr", "--aligner-model", str(tmp_path)]) == 2
    assert "is not a Qwen3-ForcedAligner checkpoint" in capsys.readouterr().err
    assert main(["speak", "--model", "tiny-asr", "Hi", "-o", str(tmp_path / "a.wav")]) == 2
    assert main(["chat", "--model", "tiny-asr", "--out-dir", str(tmp_path)]) == 2
    assert capsys.readouterr().err.count("is a Qwen3-ASR model: it hears and does not speak or chat") == 2
    assert main(["transcribe", str(question), "--model", "tiny-aligner"]) == 2
    error = capsys.readouterr().err
    assert "'tiny-aligner' is a forced aligner, loaded beside a model (serve --aligner-model)" in error


def test_collapse_repeats_and_parse_are_the_references():
    """`collapse_repeats` and `parse_transcript` are `qwen_asr`'s `detect_and_fix_repetitions` and
    `parse_asr_output` on looping replies (runs of a character, repeated pieces) and tagged ones."""
    reference.load()
    from qwen_asr.inference.utils import detect_and_fix_repetitions, parse_asr_output

    from omnimtp.families.qwen3_asr import collapse_repeats

    rng = np.random.default_rng(0)
    for _ in range(500):
        parts = []
        for _ in range(rng.integers(1, 6)):
            kind = rng.integers(0, 3)
            if kind == 0:
                parts.append("".join(rng.choice(list("abcxyz "), size=rng.integers(0, 30))))
            elif kind == 1:
                parts.append(str(rng.choice(list("abc"))) * int(rng.integers(15, 30)))
            else:
                parts.append("".join(rng.choice(list("ab c"), size=rng.integers(1, 5))) * int(rng.integers(15, 26)))
        text = "".join(parts)
        assert collapse_repeats(text) == detect_and_fix_repetitions(text), text
        for raw in (text, f"language English<asr_text>{text}", f"language chinese\n<asr_text> {text} "):
            language, parsed = parse_transcript(raw)
            assert (language or "", parsed) == parse_asr_output(raw), raw


@pytest.mark.parametrize("language", [None, "en"])
def test_streaming_recognition_is_the_references(family, language):
    """`stream_recognition` gives, chunk by chunk and for the tail, the transcripts of the reference's streaming
    mode (its own prefix rollback and prompts; its vLLM generator answered by its transformers model, greedy, on
    the same weights); pieces of any size give the same transcripts."""
    streaming = reference.reference_streaming(family, 10)
    pipe = OmniPipeline(family=family, max_new_tokens=10)
    audio = speechlike(2.7, 12)
    chunk = 8000  # 0.5 s
    state = streaming.init_streaming_state(context="Hi", language=None if language is None else "English",
                                           unfixed_chunk_num=2, unfixed_token_num=3, chunk_size_sec=0.5)
    expected = []
    for start in range(0, len(audio), chunk):
        before = state.chunk_id
        streaming.streaming_transcribe(audio[start:start + chunk], state)
        if state.chunk_id > before:
            expected.append(state.text)
    streaming.finish_streaming_transcribe(state)
    expected.append(state.text)
    for size in (chunk, 3001):
        pieces = [audio[i:i + size] for i in range(0, len(audio), size)]
        partials = list(pipe.stream_recognition(pieces, language, "Hi", chunk_seconds=0.5, unfixed_chunks=2,
                                                unfixed_tokens=3))
        assert [p.text for p in partials] == expected
        assert [p.is_final for p in partials] == [False] * (len(expected) - 1) + [True]
        assert partials[-1].audio_seconds == pytest.approx(len(audio) / RATE)
    assert len(set(expected)) > 2
    # the prompts too (the kept prefix of each): the tiny model's replies may hide a prefix one token off
    stream = StreamingRecognition(family, language, "Hi", chunk_seconds=0.5, unfixed_chunks=2, unfixed_tokens=3)
    prompts = []
    stream.feed(audio)
    while (step := stream.next_step() or stream.finish()) is not None:
        prompts.append(step.prompt_ids)
        stream.accept(step, pipe._recognized(step, 10))
    assert prompts == streaming.model.prompt_ids


@pytest.mark.parametrize("language", [None, "en"])
def test_streaming_prefixes_roll_back_as_the_references(family, language):
    """With replies a trained model might write (words, multi-byte characters whose tokens a cut would split),
    each transcription's prompt (the kept prefix after the rollback) and each transcript are the reference's."""
    tag = "" if language else "language English<asr_text>"
    replies = [f"{tag}Hello wor", f"{tag}Hello world, 你好", "ld, 你好 again and", " again and again.",
               "n and again. Done", " Done."]
    streaming = reference.reference_streaming(family, 0, replies)
    audio = speechlike(2.7, 13)
    state = streaming.init_streaming_state(language=None if language is None else "English", unfixed_chunk_num=2,
                                           unfixed_token_num=4, chunk_size_sec=0.5)
    expected = []
    for start in range(0, len(audio), 8000):
        before = state.chunk_id
        streaming.streaming_transcribe(audio[start:start + 8000], state)
        if state.chunk_id > before:
            expected.append(state.text)
    streaming.finish_streaming_transcribe(state)
    expected.append(state.text)
    stream = StreamingRecognition(family, language, None, chunk_seconds=0.5, unfixed_chunks=2, unfixed_tokens=4)
    stream.feed(audio)
    prompts, texts, scripted = [], [], list(replies)
    while (step := stream.next_step() or stream.finish()) is not None:
        prompts.append(step.prompt_ids)
        texts.append(stream.accept(step, scripted.pop(0)).text)
    assert prompts == streaming.model.prompt_ids
    assert texts == expected
    assert not scripted and any(len(p) > len(prompts[0]) for p in prompts)  # prefixes were kept


def test_streaming_recognition_bad_input(family):
    pipe = OmniPipeline(family=family, max_new_tokens=4)
    for kwargs, name in (({"chunk_seconds": 0}, "chunk_seconds"), ({"unfixed_tokens": -1}, "unfixed_tokens"),
                         ({"language": "xx"}, "language")):
        with pytest.raises(ValueError, match=f"^{name}"):
            list(pipe.stream_recognition([np.zeros(100, np.float32)], **kwargs))
    with pytest.raises(ValueError, match="^samples"):
        list(pipe.stream_recognition([np.zeros((2, 100), np.float32)]))
    with pytest.raises(ValueError, match="^model: streaming recognition needs a Qwen3-ASR"):
        list(OmniPipeline.tiny().stream_recognition([np.zeros(100, np.float32)]))


def test_a_quantized_model_it_made_itself_frees_its_float_matrices(family, tmp_path):
    """Loaded quantized, the family releases the decoder matrices its quantized copies replace (zero-stride
    placeholders): the same transcript as quantizing a model the caller keeps; saving it is refused."""
    pipe = OmniPipeline.from_pretrained("tiny-asr", quantize="int8", max_new_tokens=8)
    linears = pipe.family.model.decoder_linears()
    assert linears and all(linear.weight.stride() == (0, 0) for linear in linears)
    if pipe.family.thinker is not pipe.family.model.thinker:  # encoded by its bf16 copy: the float one is released
        tower = pipe.family.model.thinker.audio_tower
        assert tower.layers[0].fc1.weight.stride() == (0, 0) and tower.conv2d2.weight.stride() == (0, 0, 0, 0)
    assert family.model.thinker.audio_tower.layers[0].fc1.weight.stride() != (0, 0)
    kept = Qwen3ASRFamily(family.model, family.tokenizer, quantize="int8")
    assert all(linear.weight.stride() != (0, 0) for linear in family.model.decoder_linears())
    samples = speechlike(1.1, 14)
    assert pipe.transcribe(samples).text_ids == OmniPipeline(family=kept, max_new_tokens=8).transcribe(
        samples).text_ids
    with pytest.raises(ValueError, match="^model: its decoder matrices were released"):
        pipe.save_pretrained(tmp_path)


def _audio_rows(thinker, family, samples):
    ids, media = family.transcription_inputs(samples, None, "")
    with torch.no_grad():
        embeds = multimodal_prefill(thinker, ids, media, family.device).embeds[0]
    return embeds[torch.tensor(ids) == family.model.thinker.config.audio_token_id]


needs_onednn_bf16 = pytest.mark.skipif(packed_gemm_kind(torch.device("cpu"), torch.bfloat16) != "onednn",
                                       reason="no oneDNN bf16 on this CPU: the quantized modes keep the float encoder")


@needs_onednn_bf16
def test_float_model_encodes_exactly_and_a_quantized_one_in_bf16(family):
    """fp32 encodes with the model's own encoder (its rows are the float tower's bits); a quantized family encodes
    with its bf16 copy (`fast_audio_encoder`), close to the float rows but not equal, and leaves the model's tower
    float."""
    samples = speechlike(2.2, 15)
    _, media = family.transcription_inputs(samples, None, "")
    with torch.no_grad():
        exact = encode_audio(family.model.thinker.audio_tower, media.input_features,
                             media.feature_attention_mask).last_hidden_state
    assert torch.equal(_audio_rows(family.thinker, family, samples), exact)
    quantized = Qwen3ASRFamily(family.model, family.tokenizer, quantize="w4a8")
    assert isinstance(quantized.thinker.audio_tower.layers[0].fc1, EncoderLinear)
    assert isinstance(family.model.thinker.audio_tower.layers[0].fc1, torch.nn.Linear)
    fast = _audio_rows(quantized.thinker, quantized, samples)
    assert not torch.equal(fast, exact)
    assert ((fast - exact).norm() / exact.norm()).item() < 0.02
    assert torch.equal(_audio_rows(family.thinker, family, samples), exact)  # the float family is unchanged


@pytest.mark.parametrize("linears", ["bf16", "w4a8", pytest.param("w8a8", marks=pytest.mark.skipif(
    many_row_mode_reason("cpu") is not None, reason="no w8a8 kernel here"))])
def test_fast_audio_encoder_is_close_to_the_float_one_with_its_biases(linears):
    """The fast encoder of a tower with nonzero biases everywhere: bf16 within 2 % of the float rows, w4a8 within
    the 4-bit weights' error, w8a8 (int8 linears and wide convolutions) within 5 %; the tower itself is not
    modified."""
    model = tiny_qwen3_asr(3)
    tower = model.thinker.audio_tower
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for module in tower.modules():
            if isinstance(module, (torch.nn.Linear, torch.nn.Conv2d)) and module.bias is not None:
                module.bias.copy_(torch.randn(module.bias.shape, generator=generator) * 0.5)
    features = torch.randn(1, tower.config.num_mel_bins, 230, generator=generator)
    mask = torch.ones(1, 230, dtype=torch.long)
    with torch.no_grad():
        exact = encode_audio(tower, features, mask).last_hidden_state
        fast = encode_audio(fast_audio_encoder(tower, linears), features, mask).last_hidden_state
        again = encode_audio(tower, features, mask).last_hidden_state
    assert torch.equal(again, exact)
    error = ((fast - exact).norm() / exact.norm()).item()
    assert 0 < error < {"bf16": 0.02, "w4a8": 0.3, "w8a8": 0.05}[linears]


@needs_onednn_bf16
def test_fast_audio_encoder_keeps_rows_bf16_with_the_same_bits():
    """In bf16, fc1 and proj1 hand their GELU bf16 rows (no cast of the widest rows to float32 and back), and the
    norms before q/k/v, fc1 and proj1 round their rows once: the encoder's rows are bit for bit those of the same
    copy with every linear's and norm's output float32."""
    model = tiny_qwen3_asr(3)
    tower = model.thinker.audio_tower
    generator = torch.Generator().manual_seed(5)
    features = torch.randn(1, tower.config.num_mel_bins, 230, generator=generator)
    mask = torch.ones(1, 230, dtype=torch.long)
    fast = fast_audio_encoder(tower, "bf16")
    kept = [name for name, module in fast.named_modules() if getattr(module, "bf16_out", False)]
    assert sorted({name.rpartition(".")[2] for name in kept}) == ["fc1", "final_layer_norm", "ln_post", "proj1",
                                                                  "self_attn_layer_norm"]
    assert len(kept) == 3 * len(tower.layers) + 2
    with torch.no_grad():
        rows_in = torch.randn(3, fast.layers[0].fc1.in_features)
        assert fast.layers[0].fc1(rows_in).dtype == fast.layers[0].final_layer_norm(rows_in).dtype == torch.bfloat16
        rows = encode_audio(fast, features, mask).last_hidden_state
        for name in kept:
            fast.get_submodule(name).bf16_out = False
        assert torch.equal(encode_audio(fast, features, mask).last_hidden_state, rows)
    assert rows.dtype == torch.float32


@needs_onednn_bf16
def test_onednn_packed_linear_adds_its_bias():
    """`linear` on a oneDNN-packed bf16 weight with a bias: F.linear's values up to bf16 rounding."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(37, 64, generator=generator).bfloat16()
    weight = torch.randn(48, 64, generator=generator).bfloat16()
    bias = (torch.randn(48, generator=generator) * 4).bfloat16()
    gemm = PackedGemm("onednn", None)
    out = linear(x, weight, bias, packed=gemm.pack(weight, 37), gemm=gemm)
    expected = torch.nn.functional.linear(x.float(), weight.float(), bias.float())
    torch.testing.assert_close(out.float(), expected, rtol=2e-2, atol=5e-2)
    one = linear(x[:1], weight, bias, packed=gemm.pack(weight, 1), gemm=gemm)
    torch.testing.assert_close(one.float(), expected[:1], rtol=2e-2, atol=5e-2)


def _logprob_run(family, requests):
    """Each request's (output ids, output_logprobs, the logprobs its text events carried), run together."""
    core = EngineCore(family, EngineConfig(max_batch_size=max(4, len(requests))))
    for request in requests:
        core.add(request)
    carried = {request.request_id: [] for request in requests}
    while core.has_work():
        for event in core.step():
            carried[event.request.request_id] += event.logprobs
    return [(r.output_ids, r.output_logprobs, carried[r.request_id]) for r in requests]


def test_greedy_logprobs_are_the_references_log_softmax(family, ref):
    """A greedy transcription's token logprobs (and its top alternatives) are the log-softmax of the reference's
    logits at each step, within float32 tolerance; the text events carry the reply's tokens, the stop token's
    logprob stays on the request."""
    samples = speechlike(2.0, 2)
    ids, media = family.transcription_inputs(samples, None, "")
    prompt = torch.tensor([ids])
    out = ref.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), input_features=media.input_features,
                       feature_attention_mask=media.feature_attention_mask, max_new_tokens=24,
                       eos_token_id=sorted(family.eos_token_ids), do_sample=False, output_logits=True)
    expected_ids = out.sequences[0, prompt.shape[1]:].tolist()
    expected = [torch.log_softmax(step[0].float(), dim=-1) for step in out.logits]  # [V] each
    request = Request(0, ids, max_new_tokens=24, max_frames=1, media=media, logprobs=3)
    output_ids, logprobs, carried = _logprob_run(family, [request])[0]
    assert output_ids == expected_ids and [lp.token_id for lp in logprobs] == expected_ids
    assert len(set(expected_ids)) > 3
    for lp, row in zip(logprobs, expected, strict=True):
        assert lp.logprob == pytest.approx(float(row[lp.token_id]), abs=1e-5)
        top = torch.topk(row, 3)
        assert [token for token, _ in lp.top] == top.indices.tolist()
        assert [value for _, value in lp.top] == pytest.approx(top.values.tolist(), abs=1e-5)
    assert carried == logprobs[:len(request.reply_ids)]


def test_logprobs_alone_equal_them_in_a_batch(family, ref):
    """Greedy and seeded-sampled requests' logprobs are the same alone and batched (next to a request that asks
    none), within float32 rounding; a sampled token's logprob is the model's, before the temperature."""
    specs = [(speechlike(1.5, 5), None, None, 2), (speechlike(0.9, 6), SamplingParams(temperature=1.3), 11, 0),
             (speechlike(2.4, 7), None, None, None)]
    makes = []
    for i, (samples, sampling, seed, num_top) in enumerate(specs):
        ids, media = family.transcription_inputs(samples, None, "")
        makes.append(lambda i=i, ids=ids, media=media, sampling=sampling, seed=seed, num_top=num_top: Request(
            i, ids, max_new_tokens=16, max_frames=1, thinker_sampling=sampling, seed=seed, media=media,
            logprobs=num_top))
    alone = [_logprob_run(family, [make()])[0] for make in makes]
    batched = _logprob_run(family, [make() for make in makes])
    for (ids_alone, lps_alone, carried_alone), (ids_batched, lps_batched, carried_batched) in zip(
            alone, batched, strict=True):
        assert ids_alone == ids_batched
        assert [(lp.token_id, [t for t, _ in lp.top]) for lp in lps_alone] == \
            [(lp.token_id, [t for t, _ in lp.top]) for lp in lps_batched]
        # the same within float32 rounding: a batched matmul may round a row's last bits differently
        assert [lp.logprob for lp in lps_alone] == pytest.approx([lp.logprob for lp in lps_batched], abs=1e-5)
        assert len(carried_alone) == len(carried_batched)
    assert alone[2][1] == [] and len(alone[0][1]) == len(alone[0][0]) and len(alone[1][1]) == len(alone[1][0])
    assert all(len(lp.top) == 2 for lp in alone[0][1]) and all(lp.top == () for lp in alone[1][1])
    # the sampled row: its tokens' logprobs are those a greedy-forced run of its prompt + tokens gives
    ids, media = family.transcription_inputs(specs[1][0], None, "")
    sampled_ids = alone[1][0]
    with torch.no_grad():
        prompt = torch.tensor([ids + sampled_ids[:-1]])
        logits = ref.thinker(input_ids=prompt, attention_mask=torch.ones_like(prompt),
                             input_features=media.input_features,
                             feature_attention_mask=media.feature_attention_mask).logits[0]
    rows = torch.log_softmax(logits[len(ids) - 1:].float(), dim=-1)
    assert [lp.logprob for lp in alone[1][1]] == pytest.approx(
        [float(row[token]) for row, token in zip(rows, sampled_ids, strict=True)], abs=1e-5)


def test_logprobs_must_be_a_count_in_range(family):
    ids, media = family.transcription_inputs(speechlike(0.5, 1), None, "")
    for bad in (-1, 21, 1.5, True, "2"):
        with pytest.raises(ValueError, match="logprobs"):
            Request(0, ids, max_new_tokens=4, max_frames=1, media=media, logprobs=bad)
