"""OmniPipeline against transformers' Qwen3-Omni `generate(return_audio=True)` on the same weights."""

import json

import numpy as np
import pytest
import torch
from audio_checks import assert_audible, assert_audio_close, assert_audio_equal
from reference_omni import reference_generate

from omnimtp.engine.core import EngineConfig
from omnimtp.pipeline import OmniPipeline
from omnimtp.sampling import SamplingParams
from omnimtp.talker.loop import TalkerBatch

pytestmark = pytest.mark.usefixtures("one_torch_thread")


MAX_NEW_TOKENS = 10
MAX_FRAMES = 30


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_omni")
    OmniPipeline.tiny(seed=0).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def pipe(checkpoint):
    return OmniPipeline.from_pretrained(checkpoint)


def _prompt(pipe, text):
    return pipe.tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, return_dict=False
    )


def test_greedy_equals_reference_batch_1_and_ragged_batch_2(pipe, monkeypatch):
    prompts = [_prompt(pipe, "Hello there, how are you?"), _prompt(pipe, "Hi")]
    single = pipe.generate(input_ids=prompts[0], max_new_tokens=MAX_NEW_TOKENS, max_frames=MAX_FRAMES)
    batch = pipe.generate(input_ids=prompts, max_new_tokens=MAX_NEW_TOKENS, max_frames=MAX_FRAMES)
    for prompt, ours in [(prompts[0], single), (prompts[0], batch[0]), (prompts[1], batch[1])]:
        ref_ids, ref_codes, ref_audio = reference_generate(pipe.model, prompt, MAX_NEW_TOKENS, MAX_FRAMES, monkeypatch)
        assert ours.text_ids == ref_ids
        assert ref_codes.shape[1] >= 10  # enough frames for the talker's text rows and penalty to matter
        assert torch.equal(ours.codes, ref_codes)
        assert ours.audio.shape[0] == 1920 * ours.codes.shape[1] - 555
        assert_audio_close(ours.audio, ref_audio, rel=1e-5)
    assert torch.equal(single.codes, batch[0].codes)
    assert_audio_equal(batch[0].audio, single.audio)


def test_the_embedded_default_speaks_at_speech_level():
    """`OmniPipeline.tiny()` (what `omnimtp speak` runs without --model) gives audio at speech level, so
    every audio comparison on it compares a real signal: RMS 0.05–0.2 (−26 to −14 dBFS), peak below clipping."""
    out = OmniPipeline.tiny().generate("Hello")
    rms = float(np.sqrt(np.mean(out.audio.astype(np.float64) ** 2)))
    assert 0.05 <= rms <= 0.2 and float(np.abs(out.audio).max()) < 1.0


def test_streamed_equals_generated(pipe):
    kwargs = dict(max_new_tokens=MAX_NEW_TOKENS, max_frames=MAX_FRAMES)
    full = pipe.generate("Tell me a story", **kwargs)
    events = list(pipe.stream("Tell me a story", **kwargs))
    chunks = [e.audio for e in events if e.audio is not None]
    first_chunk_frames = EngineConfig().first_chunk_frames
    assert len(chunks) >= 2 and len(chunks[0]) == 1920 * first_chunk_frames - 555  # a small first chunk
    assert "".join(e.text for e in events) == full.text
    for chunk in chunks:
        assert_audible(chunk)
    # generate decodes in one block: the chunks join into the one-shot decode (float rounding aside)
    assert_audio_close(np.concatenate(chunks), full.audio, rel=1e-5)
    assert events[-1].finish_reason == full.finish_reason
    assert torch.equal(events[-1].output.codes, full.codes)


def test_first_audio_arrives_before_the_thinker_finishes(pipe):
    events = list(pipe.stream("Hello", max_new_tokens=40, max_frames=10))
    first_audio = next(i for i, e in enumerate(events) if e.audio is not None)
    text_events = [i for i, e in enumerate(events) if e.audio is None and e.output is None]
    assert first_audio < text_events[-1]


@pytest.mark.parametrize("family", ["qwen3_omni", "qwen3_tts", "qwen2_5"])
def test_a_first_chunk_goes_out_before_the_talker_forward_toward_the_next_frame(family, pipe, monkeypatch):
    """The step that completes a first chunk's frames decodes it and hands it out before the talker's forward for
    the next frame, where the codec looks at no later frame (Qwen3-Omni's code2wav, the 12 Hz decoder);
    Qwen2.5's token2wav holds samples back until later frames come, so there the forward goes first."""
    log = []
    advance = TalkerBatch.advance

    def logged_advance(self, taken):
        log.append("forward")
        return advance(self, taken)

    monkeypatch.setattr(TalkerBatch, "advance", logged_advance)
    if family == "qwen3_tts":
        tiny = OmniPipeline.tiny(family=family, max_frames=MAX_FRAMES)
        events = (e if isinstance(e, np.ndarray) else None for e in tiny.stream_speech("Hello there"))
    else:
        model = pipe if family == "qwen3_omni" else OmniPipeline.tiny(family=family, max_frames=MAX_FRAMES)
        events = (e.audio for e in model.stream("Hello", max_new_tokens=MAX_NEW_TOKENS, max_frames=MAX_FRAMES))
    for audio in events:
        if audio is not None and audio.size:
            log.append("audio")
            break
    if family == "qwen2_5":
        assert log[0] == "forward" and "audio" in log
    else:  # first_chunk_frames talker steps before the first audio, all but the last with their forwards
        forwards = EngineConfig().first_chunk_frames - 1
        assert log[: forwards + 1] == ["forward"] * forwards + ["audio"]


def test_seeded_sampling_repeats_and_is_batch_invariant(pipe):
    sampling = dict(thinker_sampling=SamplingParams(temperature=1.0, top_k=20),
                    talker_sampling=SamplingParams(temperature=0.9, top_k=50, repetition_penalty=1.05),
                    max_new_tokens=MAX_NEW_TOKENS, max_frames=MAX_FRAMES)
    a = pipe.generate("Hello", seed=7, **sampling)
    b = pipe.generate("Hello", seed=7, **sampling)
    other = pipe.generate("Hello", seed=8, **sampling)
    batch = pipe.generate(["Something else entirely", "Hello"], seed=[3, 7], **sampling)
    assert a.text_ids == b.text_ids and torch.equal(a.codes, b.codes)
    assert_audio_equal(a.audio, b.audio)
    assert not torch.equal(a.codes, other.codes)
    assert batch[1].text_ids == a.text_ids and torch.equal(batch[1].codes, a.codes)
    assert_audio_equal(batch[1].audio, a.audio)
    streamed = [e for e in pipe.stream(["Something else entirely", "Hello"], seed=[3, 7], **sampling)]
    audio = np.concatenate([e.audio for e in streamed if e.index == 1 and e.audio is not None])
    assert_audio_close(audio, a.audio, rel=1e-5)  # streamed chunks == the one-shot decode up to rounding
    alone = np.concatenate([e.audio for e in pipe.stream("Hello", seed=7, **sampling) if e.audio is not None])
    assert_audio_equal(audio, alone)  # and a streamed request's float audio does not depend on its batch


def test_codec_dtype_bfloat16_changes_only_the_audio_and_leaves_the_model_as_it_is(pipe, checkpoint, tmp_path):
    """`codec_dtype="bfloat16"` runs code2wav's conv stack on a bf16 copy: the same text and codes, audio within
    20 dB SNR of fp32's (docs/speech.md: 31 dB measured at the released widths) and not equal to it, a request
    alone as in a batch; the model's own code2wav stays float32, so the pipeline saves the checkpoint it
    loaded. Qwen2.5-Omni's token2wav, a bad value, or a ready family with the option: a ValueError naming
    codec_dtype."""
    bf16 = OmniPipeline.from_pretrained(checkpoint, codec_dtype="bfloat16")
    assert bf16.family.codec.conv_dtype == torch.bfloat16 and pipe.family.codec.conv_dtype == torch.float32
    limits = dict(max_new_tokens=MAX_NEW_TOKENS, max_frames=MAX_FRAMES)
    expected, alone = pipe.generate("Hello", **limits), bf16.generate("Hello", **limits)
    assert alone.text_ids == expected.text_ids and torch.equal(alone.codes, expected.codes)
    assert alone.audio.dtype == np.float32 and alone.audio.shape == expected.audio.shape
    assert_audible(alone.audio)
    noise = ((alone.audio.astype(np.float64) - expected.audio) ** 2).sum()
    assert 0 < noise <= 10 ** (-20 / 10) * (expected.audio.astype(np.float64) ** 2).sum()
    assert_audio_equal(bf16.generate(["Something else entirely", "Hello"], **limits)[1].audio, alone.audio)
    assert {p.dtype for p in bf16.model.code2wav.parameters()} == {torch.float32}
    bf16.save_pretrained(tmp_path / "saved")  # the float32 weights it loaded, not rounded ones
    saved = OmniPipeline.from_pretrained(tmp_path / "saved").model.code2wav.state_dict()
    assert all(torch.equal(saved[k], v) for k, v in pipe.model.code2wav.state_dict().items())
    for bad in ("float16", torch.bfloat16):
        with pytest.raises(ValueError, match="codec_dtype"):
            OmniPipeline.tiny(codec_dtype=bad)
    with pytest.raises(ValueError, match="codec_dtype: Qwen2.5-Omni"):
        OmniPipeline.tiny(family="qwen2_5", codec_dtype="bfloat16")
    with pytest.raises(ValueError, match="codec_dtype: give it to the family"):
        OmniPipeline(family=pipe.family, codec_dtype="bfloat16")
    model = OmniPipeline.tiny().model  # a checkpoint stored in bf16 runs its own dtype unless codec_dtype says
    model.code2wav.to(torch.bfloat16)
    assert OmniPipeline(model, pipe.tokenizer).family.codec.code2wav is model.code2wav
    fp32 = OmniPipeline(model, pipe.tokenizer, codec_dtype="float32", max_new_tokens=4, max_frames=12)
    assert fp32.family.codec.conv_dtype == torch.float32
    assert next(model.code2wav.decoder.parameters()).dtype == torch.bfloat16
    assert_audible(fp32.generate("Hello").audio)  # the bf16 transformer's rows enter the fp32 stack
    from omnimtp.server.build import build_engine  # `serve --codec-dtype` on the embedded model

    assert build_engine(None, max_batch_size=2, max_frames=None, codec_dtype="bfloat16").family.codec.conv_dtype == (
        torch.bfloat16)


def test_talker_without_eos_stops_at_max_frames(pipe):
    # the tiny talker's codec head never favours EOS on this prompt within 7 frames: the cap ends it
    out = pipe.generate("Hello", max_new_tokens=MAX_NEW_TOKENS, max_frames=7)
    assert out.talker_finish_reason == "length" and out.finish_reason == "length"
    assert out.codes.shape == (16, 7)
    assert out.audio.shape == (1920 * 7 - 555,)


class _EosFavouringHead(torch.nn.Module):
    """The talker's codec head plus a large logit on codec EOS, so EOS wins at the first frame."""

    def __init__(self, head: torch.nn.Linear, eos: int):
        super().__init__()
        self.head = head
        self.eos = eos

    def forward(self, hidden):
        logits = self.head(hidden)
        boost = torch.zeros(logits.shape[-1], dtype=logits.dtype, device=logits.device)
        boost[self.eos] = 1e4
        return logits + boost


def test_talker_eos_gives_stop(pipe):
    talker = pipe.model.talker
    eos = pipe.model.config.talker_config.codec_eos_token_id
    original = talker.codec_head
    talker.codec_head = _EosFavouringHead(original, eos)
    try:
        out = pipe.generate("Hello", max_new_tokens=MAX_NEW_TOKENS, max_frames=MAX_FRAMES)
    finally:
        talker.codec_head = original
    assert out.talker_finish_reason == "stop" and out.codes.shape[1] < MAX_FRAMES


def test_bad_input(pipe, tmp_path):
    with pytest.raises(ValueError, match="prompt"):
        pipe.generate("")
    with pytest.raises(ValueError, match="prompt"):
        pipe.generate(input_ids=[])
    with pytest.raises(ValueError, match="prompt"):
        pipe.generate("x" * 5000)
    with pytest.raises(ValueError, match="speaker"):
        pipe.generate("Hello", speaker="nobody")
    with pytest.raises(ValueError, match="max_frames"):
        pipe.generate("Hello", max_frames=0)
    with pytest.raises(ValueError, match="path"):
        OmniPipeline.from_pretrained(tmp_path / "missing")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match="qwen3_omni_moe"):
        OmniPipeline.from_pretrained(tmp_path)


def test_speaker_is_case_insensitive(pipe):
    a = pipe.generate("Hi", speaker="CHELSIE", max_new_tokens=4, max_frames=5)
    b = pipe.generate("Hi", speaker="chelsie", max_new_tokens=4, max_frames=5)
    assert torch.equal(a.codes, b.codes)


def test_generate_admits_talker_inputs_built_in_one_projection(pipe, monkeypatch):
    """generate runs the thinker first and builds each request's talker inputs from all its rows in one
    text projection (transformers' construction, `projection="reference"`), bit for bit."""
    from omnimtp.talker.loop import TalkerBatch
    from omnimtp.talker.qwen3_inputs import build_qwen3_talker_inputs
    from omnimtp.thinker import ThinkerRun

    admitted = []
    original_admit = TalkerBatch.admit

    def recording_admit(self, requests):
        admitted.extend(requests)
        return original_admit(self, requests)

    monkeypatch.setattr(TalkerBatch, "admit", recording_admit)
    prompt = _prompt(pipe, "Hello there, how are you?")
    out = pipe.generate(input_ids=prompt, max_new_tokens=MAX_NEW_TOKENS, max_frames=4)
    assert len(admitted) == 1 and admitted[0].is_text_finished  # one admission, with the whole reply
    run = ThinkerRun(pipe.model.thinker, [prompt], accept_hidden_layer=pipe.accept_hidden_layer,
                     eos_token_ids=pipe.eos_token_ids, max_new_tokens=MAX_NEW_TOKENS, decoder=pipe.thinker_decoder)
    embeds, hidden = [], []
    while not run.is_finished:
        for event in run.step():
            embeds.append(event.embeds)
            hidden.append(event.hidden)
    assert run.output_ids[0] == out.text_ids
    expected = build_qwen3_talker_inputs(
        pipe.model, prompt, run.output_ids[0], torch.cat(embeds), torch.cat(hidden), run.finish_reasons[0], "ethan",
        projection="reference",
    )
    assert torch.equal(admitted[0].prefill_embeds, expected.prefill_embeds)
    assert torch.equal(admitted[0].trailing_text, expected.trailing_text)
    assert torch.equal(admitted[0].tts_pad_embed, expected.tts_pad_embed)


def test_the_qwen3_omni_family_implements_the_engine_interface():
    """Every method of the engine's `Family` interface exists on `Qwen3OmniFamily` with the same
    parameters, so the core needs nothing else from a family."""
    import inspect

    from omnimtp.engine.family import Family
    from omnimtp.families.qwen3_omni import Qwen3OmniFamily

    names = [name for name, value in vars(Family).items() if inspect.isfunction(value) and not name.startswith("_")]
    assert len(names) >= 10
    for name in names:
        expected = list(inspect.signature(getattr(Family, name)).parameters)
        actual = list(inspect.signature(getattr(Qwen3OmniFamily, name)).parameters)
        if isinstance(inspect.getattr_static(Qwen3OmniFamily, name), staticmethod):
            actual = ["self", *actual]
        assert actual == expected, name
    for attribute in ("sample_rate", "num_code_groups"):
        assert attribute in Family.__annotations__
