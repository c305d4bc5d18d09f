"""Qwen3-TTS Base voice cloning against the `qwen_tts` reference on a tiny seeded Base checkpoint in the
released layout, loaded by both sides' `from_pretrained`.

The reference side is its `Qwen3TTSForConditionalGeneration`: `extract_speaker_embedding` for the x-vector,
`generate(voice_clone_prompt=..., ref_ids=...)` for the codes (greedy: do_sample=False,
subtalker_dosample=False; N frames are its max_new_tokens=N + 1), given the reference codes our encoder made;
those codes are checked against transformers' own `MimiModel.from_pretrained` on the same encoder weights.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import qwen_tts_reference
import soundfile
import torch
from audio_checks import assert_audible, assert_audio_close

from omnimtp.families.qwen3_tts import QWEN3_TTS_SAMPLING
from omnimtp.models.speaker_encoder import log_mel, mel_filters
from omnimtp.pipeline import OmniPipeline
from omnimtp.voice import Voice

pytestmark = pytest.mark.usefixtures("one_torch_thread")

FRAMES = 8
SAMPLE_RATE = 24_000
TEXT = "Hello there, tiny voice."
SHORT_TEXT = "Hi"
REF_TEXT = "A reference recording."


def recording(seconds: float, pitch: float, seed: int) -> np.ndarray:
    """A voiced-speech-like test signal: a pitch with harmonics, a syllable-rate envelope and a little noise."""
    t = np.arange(int(seconds * SAMPLE_RATE)) / SAMPLE_RATE
    rng = np.random.default_rng(seed)
    voiced = sum(np.sin(2 * np.pi * pitch * k * t) / k for k in range(1, 6))
    envelope = 0.5 + 0.5 * np.sin(2 * np.pi * 4 * t) ** 2
    return (0.2 * voiced * envelope + 0.01 * rng.standard_normal(t.size)).astype(np.float32)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_tts_base") / "base"
    OmniPipeline.tiny(family="qwen3_tts", tts_model_type="base").save_pretrained(path)
    return os.fspath(path)


@pytest.fixture(scope="module")
def pipe(checkpoint):
    return OmniPipeline.from_pretrained(checkpoint, max_frames=FRAMES)


@pytest.fixture(scope="module")
def non_streaming_pipe(checkpoint):
    return OmniPipeline.from_pretrained(checkpoint, max_frames=FRAMES, non_streaming_mode=True)


@pytest.fixture(scope="module")
def reference(checkpoint):
    return qwen_tts_reference.talker_model(checkpoint)


@pytest.fixture(scope="module")
def audio():
    return {"low": recording(2.0, 120.0, 0), "high": recording(1.2, 260.0, 1)}


@pytest.fixture(scope="module")
def voices(pipe, audio):
    return {"x_vector": pipe.create_voice((audio["low"], SAMPLE_RATE), x_vector_only=True),
            "icl": pipe.create_voice((audio["low"], SAMPLE_RATE), REF_TEXT),
            "icl_short": pipe.create_voice((audio["high"], SAMPLE_RATE), "Hi."),
            "other": pipe.create_voice((audio["high"], SAMPLE_RATE), x_vector_only=True)}


def reference_codes(
    reference, pipe, text, voice: Voice | None, *, non_streaming_mode=False, sampled=False
) -> torch.Tensor:
    """The reference's greedy codes [16, T] for one request in `voice` (None: no voice-clone prompt)."""
    ids = torch.tensor([pipe.family.speech_ids(text)])
    kwargs = {}
    if voice is not None:
        is_icl = voice.mode == "icl"
        kwargs["voice_clone_prompt"] = {
            "ref_code": [voice.ref_codes.T if is_icl else None], "ref_spk_embedding": [voice.speaker_embedding],
            "x_vector_only_mode": [not is_icl], "icl_mode": [is_icl],
        }
        if is_icl:
            kwargs["ref_ids"] = [torch.tensor([pipe.family.tokenizer.encode(
                f"<|im_start|>assistant\n{voice.ref_text}<|im_end|>\n")])]
    codes, _ = reference.generate(input_ids=[ids], languages=["auto"], non_streaming_mode=non_streaming_mode,
                                  do_sample=False, subtalker_dosample=False, max_new_tokens=FRAMES + 1, **kwargs)
    return codes[0].T.contiguous()


# --- speaker encoder and reference codes ----------------------------------------------------------


def test_log_mel_matches_the_reference_mel_spectrogram(audio):
    """Our filters (transformers' mel_filter_bank) are librosa's slaney filters, and the log-mel is the
    reference's `mel_spectrogram(..., fmin=0, fmax=12000)`, up to float rounding."""
    import librosa

    qwen_tts_reference.load()
    from qwen_tts.core.models.modeling_qwen3_tts import mel_spectrogram

    expected_filters = torch.from_numpy(librosa.filters.mel(sr=SAMPLE_RATE, n_fft=1024, n_mels=128, fmin=0, fmax=12000))
    assert torch.allclose(mel_filters(), expected_filters, rtol=0, atol=1e-6 * float(expected_filters.max()))
    samples = torch.from_numpy(audio["low"])[None]
    expected = mel_spectrogram(samples, n_fft=1024, num_mels=128, sampling_rate=SAMPLE_RATE, hop_size=256,
                               win_size=1024, fmin=0, fmax=12000)
    ours = log_mel(samples)
    assert ours.shape == expected.shape == (1, 128, 1 + (samples.shape[1] - 256) // 256)
    assert float(expected.std()) > 1.0  # a signal, not the log floor
    assert torch.allclose(ours, expected, rtol=0, atol=1e-4)


def test_speaker_embedding_matches_reference_extract_speaker_embedding(pipe, reference, audio):
    for samples in audio.values():
        ours = pipe.create_voice((samples, SAMPLE_RATE)).speaker_embedding
        expected = reference.extract_speaker_embedding(samples, SAMPLE_RATE).float()
        assert ours.shape == expected.shape == (pipe.family.talker.config.hidden_size,)
        assert float(expected.abs().max()) > 0.05
        assert torch.allclose(ours, expected, rtol=0, atol=1e-5 * float(expected.abs().max()))
    first, second = (pipe.create_voice((a, SAMPLE_RATE)).speaker_embedding for a in audio.values())
    assert not torch.allclose(first, second, atol=1e-3)


def test_reference_codes_equal_transformers_mimi_encode(checkpoint, pipe, audio, tmp_path):
    """The file's encoder weights, written as a flat Mimi checkpoint and loaded by transformers' own
    `MimiModel.from_pretrained` (its checkpoint conversion), encode to the codes our encoder gives."""
    from safetensors.torch import load_file, save_file
    from transformers import MimiModel

    tokenizer_dir = os.path.join(checkpoint, "speech_tokenizer")
    flat = {k.removeprefix("encoder."): v
            for k, v in load_file(os.path.join(tokenizer_dir, "model.safetensors")).items()
            if k.startswith("encoder.")}
    save_file(flat, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(tokenizer_dir, "config.json")) as f:
        config = json.load(f)
    (tmp_path / "config.json").write_text(json.dumps({**config["encoder_config"], "model_type": "mimi"}))
    mimi = MimiModel.from_pretrained(tmp_path).eval()
    partial = audio["low"][: 10 * 1920 + 700]  # a partial last frame is kept, as Mimi's encode keeps it
    for samples in (*audio.values(), partial):
        ours = pipe.family.speech_encoder.encode(samples)
        with torch.no_grad():
            expected = mimi.encode(torch.from_numpy(samples)[None, None]).audio_codes[0, :16]
        num_frames = -(-len(samples) // 1920)
        assert ours.shape == (16, num_frames)
        assert torch.equal(ours, expected[:, :num_frames])
        assert len(torch.unique(ours[0])) > 2  # the codes follow the audio
    resampled = pipe.family.speech_encoder.encode(audio["low"][::2].copy(), 12_000)  # resampled to 24 kHz first
    assert resampled.shape == (16, 25)


# --- codes and audio vs the reference -------------------------------------------------------------


@pytest.mark.parametrize("name, text, non_streaming_mode", [
    ("x_vector", TEXT, False),
    ("icl", TEXT, False),             # more text rows than reference frames: the surplus is trailing text
    ("icl_short", SHORT_TEXT, False),  # more reference frames than text rows: T(tts_pad) fills the text side
    ("icl", SHORT_TEXT, True),
    ("x_vector", TEXT, True),
])
def test_clone_codes_match_reference(pipe, non_streaming_pipe, reference, voices, name, text, non_streaming_mode):
    voice = voices[name]
    pipe = non_streaming_pipe if non_streaming_mode else pipe
    out = pipe.speech(text, voice=voice)
    expected = reference_codes(reference, pipe, text, voice, non_streaming_mode=non_streaming_mode)
    assert out.codes.shape[0] == 16 and out.codes.shape[1] >= 2
    assert torch.equal(out.codes, expected)


def test_icl_prompt_layouts_cover_both_pairings(pipe, voices):
    """The two streaming ICL cases above differ as named: transcript + text rows (with T(tts_eos)) against
    the reference frames (with C(bos))."""
    def rows(voice, text):
        return len(voice.ref_text_ids) + len(pipe.family.speech_ids(text)) - 8 + 1, voice.ref_codes.shape[1] + 1

    num_text, num_codec = rows(voices["icl"], TEXT)
    assert num_text > num_codec
    num_text, num_codec = rows(voices["icl_short"], SHORT_TEXT)
    assert num_text < num_codec


def test_clone_audio_matches_reference_decode(checkpoint, pipe, reference, voices):
    """x-vector: the reference tokenizer's decode of the codes; ICL: its decode of reference codes ++ codes with
    the reference's share cut (generate_voice_clone), which our codec stream gives by decoding the reference
    codes first. Up to float rounding, on audible audio."""
    tokenizer = qwen_tts_reference.load_speech_tokenizer(os.path.join(checkpoint, "speech_tokenizer"))
    for name in ("x_vector", "icl"):
        voice = voices[name]
        out = pipe.speech(TEXT, voice=voice)
        codes = out.codes if voice.ref_codes is None else torch.cat([voice.ref_codes, out.codes], dim=1)
        with torch.no_grad():
            expected = tokenizer.decode(audio_codes=codes.T[None]).audio_values[0].float().numpy()
        expected = expected[(codes.shape[1] - out.codes.shape[1]) * 1920:]
        assert out.audio.shape == (1920 * out.codes.shape[1],)
        assert_audible(out.audio)
        assert_audio_close(out.audio, expected)


def test_ragged_batch_mixing_clone_modes_and_a_plain_request(pipe, reference, voices):
    """An x-vector, two ICL voices and a request without a voice (no speaker row: the reference's generate
    without a voice-clone prompt) in one batch: each row is itself alone and the reference's."""
    texts = [TEXT, SHORT_TEXT, TEXT, SHORT_TEXT]
    row_voices = [voices["x_vector"], voices["icl"], voices["icl_short"], None]
    outs = pipe.speech(texts, voice=row_voices)
    for out, text, voice in zip(outs, texts, row_voices, strict=True):
        assert torch.equal(out.codes, pipe.speech(text, voice=voice).codes)
        assert torch.equal(out.codes, reference_codes(reference, pipe, text, voice))


def test_another_recording_or_mode_changes_the_codes(pipe, voices):
    codes = {name: pipe.speech(TEXT, voice=voice).codes for name, voice in voices.items()}
    codes["plain"] = pipe.speech(TEXT).codes
    names = list(codes)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            assert not torch.equal(codes[a], codes[b]), (a, b)
    assert torch.equal(pipe.speech(TEXT, voice=voices["icl"], x_vector_only=True).codes, codes["x_vector"])


def test_inline_clone_equals_create_voice(pipe, audio, voices, tmp_path):
    path = tmp_path / "ref.flac"
    soundfile.write(path, audio["low"], SAMPLE_RATE, subtype="PCM_24")
    from_file = pipe.create_voice(path, REF_TEXT)
    assert from_file.ref_codes.shape == voices["icl"].ref_codes.shape and from_file.seconds == pytest.approx(2.0)
    inline = pipe.speech(TEXT, ref_audio=(audio["low"], SAMPLE_RATE), ref_text=REF_TEXT)
    assert torch.equal(inline.codes, pipe.speech(TEXT, voice=voices["icl"]).codes)
    resampled = pipe.create_voice((recording(2.0, 120.0, 0)[::2].copy(), 12_000), x_vector_only=True)
    assert resampled.speaker_embedding.shape == voices["x_vector"].speaker_embedding.shape


def test_streamed_clone_joins_into_the_one_shot_audio(pipe, voices):
    *chunks, output = list(pipe.stream_speech(TEXT, voice=voices["icl"]))
    one_shot = pipe.speech(TEXT, voice=voices["icl"])
    assert len(chunks) >= 2 and torch.equal(output.codes, one_shot.codes)
    assert_audible(one_shot.audio)
    assert_audio_close(np.concatenate(chunks), one_shot.audio)


def test_sampled_clones_repeat_and_do_not_depend_on_the_batch(pipe, voices):
    voice = voices["icl"]
    alone = pipe.speech(TEXT, voice=voice, sampling=QWEN3_TTS_SAMPLING, seed=5)
    again = pipe.speech(TEXT, voice=voice, sampling=QWEN3_TTS_SAMPLING, seed=5)
    batch = pipe.speech([SHORT_TEXT, TEXT], voice=[voices["x_vector"], voice], sampling=QWEN3_TTS_SAMPLING, seed=[9, 5])
    assert torch.equal(alone.codes, again.codes) and torch.equal(alone.codes, batch[1].codes)
    assert not torch.equal(alone.codes, pipe.speech(TEXT, voice=voice, sampling=QWEN3_TTS_SAMPLING, seed=6).codes)
    assert not torch.equal(alone.codes, pipe.speech(TEXT, voice=voice).codes)


def test_voice_file_and_bytes_round_trip_speak_the_same(pipe, voices, tmp_path):
    for name in ("x_vector", "icl"):
        voice = voices[name]
        voice.save(tmp_path / f"{name}.safetensors")
        loaded, from_bytes = Voice.load(tmp_path / f"{name}.safetensors"), Voice.from_bytes(voice.to_bytes())
        assert loaded.mode == from_bytes.mode == voice.mode and loaded.ref_text == voice.ref_text
        expected = pipe.speech(TEXT, voice=voice).codes
        assert torch.equal(pipe.speech(TEXT, voice=loaded).codes, expected)
        assert torch.equal(pipe.speech(TEXT, voice=from_bytes).codes, expected)


def test_precomputed_parts_make_the_same_voice(pipe, voices):
    icl = voices["icl"]
    rebuilt = pipe.create_voice(speaker_embedding=icl.speaker_embedding.numpy(), ref_codes=icl.ref_codes,
                                ref_text_ids=icl.ref_text_ids)
    assert rebuilt.mode == "icl"
    assert torch.equal(pipe.speech(TEXT, voice=rebuilt).codes, pipe.speech(TEXT, voice=icl).codes)
    x_vector = pipe.create_voice(speaker_embedding=icl.speaker_embedding.tolist())
    assert x_vector.mode == "x_vector"


def test_the_callers_arrays_are_not_mutated(pipe, audio, voices):
    samples = audio["low"].copy()
    embedding = voices["icl"].speaker_embedding.clone()
    codes = voices["icl"].ref_codes.clone()
    voice = pipe.create_voice((samples, SAMPLE_RATE), REF_TEXT)
    pipe.create_voice(speaker_embedding=embedding, ref_codes=codes, ref_text_ids=voice.ref_text_ids)
    pipe.speech(TEXT, voice=voice)
    assert np.array_equal(samples, audio["low"])
    assert torch.equal(embedding, voices["icl"].speaker_embedding) and torch.equal(codes, voices["icl"].ref_codes)


# --- bad input ------------------------------------------------------------------------------------


@pytest.mark.parametrize("arguments, match", [
    ({"ref_audio": (recording(0.5, 120.0, 0), SAMPLE_RATE)},
     r"ref_audio: 0\.50 s of audio is shorter than the minimum"),
    ({"ref_audio": (np.zeros(61 * SAMPLE_RATE, dtype=np.float32), SAMPLE_RATE)}, "ref_audio: 61.0 s of audio is over"),
    ({"ref_audio": (np.zeros((2, SAMPLE_RATE), dtype=np.float32), SAMPLE_RATE)}, "ref_audio: samples must be a 1-D"),
    ({"ref_audio": "/nonexistent/ref.wav"}, "ref_audio: cannot read"),
    ({}, "ref_audio: give a reference recording"),
    ({"speaker_embedding": torch.zeros(7)}, "speaker_embedding: has 7 values; this model's x-vector has 64"),
    ({"speaker_embedding": torch.zeros(64, dtype=torch.long)}, "speaker_embedding: a float vector"),
    ({"speaker_embedding": torch.zeros(64), "ref_codes": torch.zeros(16, 4, dtype=torch.long)},
     "ref_text: in-context cloning with ref_codes needs ref_text"),
    ({"speaker_embedding": torch.zeros(64), "ref_codes": torch.zeros(8, 4, dtype=torch.long), "ref_text": "Hi."},
     "ref_codes: has 8 code groups; this model has 16"),
    ({"speaker_embedding": torch.zeros(64), "ref_codes": torch.full((16, 4), 500), "ref_text": "Hi."},
     r"ref_codes: holds code 500, outside the codebook \[0, 128\)"),
    ({"speaker_embedding": torch.zeros(64), "ref_text": "Hi."}, "ref_codes: in-context cloning needs ref_audio"),
    ({"ref_audio": (recording(1.5, 120.0, 0), SAMPLE_RATE), "ref_text": "  "}, "ref_text: expected a non-empty"),
    ({"ref_audio": (recording(1.5, 120.0, 0), SAMPLE_RATE), "x_vector_only": 1}, "x_vector_only: expected a bool"),
])
def test_bad_clone_input_is_a_value_error_naming_the_argument(pipe, arguments, match):
    with pytest.raises(ValueError, match=match):
        pipe.create_voice(**arguments)


def test_undecodable_audio_is_refused(pipe, tmp_path):
    path = tmp_path / "noise.wav"
    path.write_bytes(b"RIFF not really a wave file")
    with pytest.raises(ValueError, match="ref_audio: is not audio that can be decoded"):
        pipe.create_voice(path)


def test_speech_clone_arguments_are_checked(pipe, voices, audio):
    with pytest.raises(ValueError, match="ref_audio: give either a voice or ref_audio"):
        pipe.speech(TEXT, voice=voices["icl"], ref_audio=(audio["low"], SAMPLE_RATE))
    with pytest.raises(ValueError, match="ref_text: a transcript goes with ref_audio"):
        pipe.speech(TEXT, ref_text=REF_TEXT)
    with pytest.raises(ValueError, match="x_vector_only: applies to cloned voices"):
        pipe.speech(TEXT, x_vector_only=True)
    with pytest.raises(ValueError, match="voice: a Base model speaks cloned voices"):
        pipe.speech(TEXT, voice="aiden")


def test_cloning_on_a_custom_voice_model_is_refused(voices, audio):
    custom = OmniPipeline.tiny(family="qwen3_tts", max_frames=4)
    with pytest.raises(ValueError, match="voice: voice cloning needs a Qwen3-TTS Base model; this is a custom_voice"):
        custom.speech(TEXT, voice=voices["x_vector"])
    with pytest.raises(ValueError, match="ref_audio: voice cloning needs a Qwen3-TTS Base model"):
        custom.speech(TEXT, ref_audio=(audio["low"], SAMPLE_RATE))
    with pytest.raises(ValueError, match="ref_audio: voice cloning needs a Qwen3-TTS Base model"):
        custom.create_voice((audio["low"], SAMPLE_RATE))
    with pytest.raises(ValueError, match="voice: voice cloning needs"):
        list(custom.stream_speech(TEXT, voice=voices["icl"]))


def test_the_tiny_base_model_is_the_same_whatever_the_global_generator():
    """`tiny(seed, "base")` draws every weight from its own seed: two builds after different global seeds are
    equal (a tiny encoder whose biases came from torch's global generator gave other ICL codes each time)."""
    from omnimtp.codec.speech_encoder import tiny_speech_tokenizer_encoder

    torch.manual_seed(1)
    first = tiny_speech_tokenizer_encoder(0).state_dict()
    torch.manual_seed(2)
    second = tiny_speech_tokenizer_encoder(0).state_dict()
    assert first.keys() == second.keys()
    assert all(torch.equal(first[name], second[name]) for name in first)


@pytest.mark.parametrize("mode", ["x_vector", "icl"])
def test_a_cloned_voice_spoken_from_streamed_text_is_the_whole_texts_speech(pipe, voices, mode):
    """`speech_session` with a cloned voice: the text pushed in pieces gives the codes and audio of
    `stream_speech(whole text)` (an in-context clone's prefill holds the whole text, so it waits for it)."""
    kwargs = {"voice": voices[mode], "seed": 5, "sampling": QWEN3_TTS_SAMPLING}
    *expected, output = list(pipe.stream_speech(TEXT, **kwargs))
    assert_audible(output.audio)
    with pipe.speech_session(**kwargs) as session:
        chunks = [chunk for piece in ("Hello the", "re, tiny", " voice.") for chunk in session.push(piece)]
        if mode == "icl":
            assert chunks == []  # nothing before the text is finished
        chunks += session.finish()
    assert torch.equal(session.output.codes, output.codes)
    assert np.array_equal(np.concatenate(chunks), np.concatenate(expected))
