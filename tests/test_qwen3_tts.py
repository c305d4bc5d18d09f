"""Qwen3-TTS end to end against the `qwen_tts` reference on tiny seeded checkpoints in the released layout.

Greedy codes are compared bit for bit with the reference's `Qwen3TTSForConditionalGeneration.generate(
do_sample=False, subtalker_dosample=False)` on the same checkpoint directory, loaded by both sides'
`from_pretrained`. The reference's `max_new_tokens` counts talker tokens, and the last one makes no frame,
so N frames are its `max_new_tokens=N + 1`.
"""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
import qwen_tts_reference
import torch
from audio_checks import assert_audible, assert_audio_close, rms_dbfs

from omnimtp.codec.speech_tokenizer import tiny_speech_tokenizer
from omnimtp.families.qwen3_tts import QWEN3_TTS_SAMPLING, Qwen3TTSFamily
from omnimtp.models.qwen3_tts import TINY_CODEC_IDS, tiny_qwen3_tts
from omnimtp.pipeline import OmniPipeline
from omnimtp.runtime.kernels import small_batch_linear
from omnimtp.sampling import SamplingParams
from omnimtp.tokenizer import byte_tokenizer

pytestmark = pytest.mark.usefixtures("one_torch_thread")

FRAMES = 8
TEXT = "Hello there, tiny voice."
OTHER_TEXT = "Short one"
INSTRUCTIONS = "A calm, low voice, speaking slowly."


def _save(path, tts_model_type: str, seed: int) -> str:
    """A tiny checkpoint in the released layout: config.json, generation_config.json, model.safetensors, the
    text tokenizer files and speech_tokenizer/ (decoder weights only)."""
    tiny_qwen3_tts(seed, tts_model_type).save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    tiny_speech_tokenizer(seed).save_pretrained(os.path.join(path, "speech_tokenizer"))
    return os.fspath(path)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen3_tts")
    return {"custom_voice": _save(root / "custom_voice", "custom_voice", 0),
            "voice_design": _save(root / "voice_design", "voice_design", 1)}


@pytest.fixture(scope="module")
def pipes(checkpoints):
    return {kind: OmniPipeline.from_pretrained(path, max_frames=FRAMES) for kind, path in checkpoints.items()}


@pytest.fixture(scope="module")
def references(checkpoints):
    return {kind: qwen_tts_reference.talker_model(path) for kind, path in checkpoints.items()}


_REFERENCE_CODES: dict = {}


def reference_codes(reference, ids, speaker=None, language=None, instruct_ids=None, *, frames=FRAMES,
                    non_streaming_mode=False, repetition_penalty=1.05) -> torch.Tensor:
    """The reference's greedy codes [16, T] for one request (cached: the batch test reuses them)."""
    key = (id(reference), tuple(ids), speaker, language, instruct_ids, frames, non_streaming_mode, repetition_penalty)
    if key not in _REFERENCE_CODES:
        codes, _ = reference.generate(
            input_ids=[torch.tensor([ids])],
            instruct_ids=None if instruct_ids is None else [torch.tensor([instruct_ids])],
            languages=[language or "auto"], speakers=[speaker], non_streaming_mode=non_streaming_mode,
            do_sample=False, subtalker_dosample=False, max_new_tokens=frames + 1, repetition_penalty=repetition_penalty,
        )
        _REFERENCE_CODES[key] = codes[0].T.contiguous()
    return _REFERENCE_CODES[key]


CUSTOM_CASES = [("aiden", "english"), ("vivian", "chinese"), ("eric", None)]  # eric: a Sichuan-dialect speaker


@pytest.mark.parametrize("voice, language", CUSTOM_CASES)
def test_custom_voice_codes_match_reference(pipes, references, voice, language):
    pipe = pipes["custom_voice"]
    out = pipe.speech(TEXT, voice=voice.upper(), language=language)
    ids = pipe.family.speech_ids(TEXT)
    expected = reference_codes(references["custom_voice"], ids, voice, language)
    assert out.codes.shape[0] == 16 and out.codes.shape[1] >= 2
    assert torch.equal(out.codes, expected)
    assert out.finish_reason == ("length" if out.codes.shape[1] == FRAMES else "stop")  # eric's stops on codec EOS
    # the codes above come from the talker's steps on omnimtp's row kernel (fp32, where it builds)
    assert (pipe.family.talker_decoder.row_kernel is not None) == small_batch_linear.available()


def test_voice_language_and_dialect_rows_change_the_codes(pipes):
    """Each row of the prefill matters: another speaker, another language, auto vs a language, and a
    dialect speaker's Chinese (its dialect row) vs its English."""
    pipe = pipes["custom_voice"]
    codes = {case: pipe.speech(TEXT, voice=case[0], language=case[1]).codes
             for case in [("aiden", "english"), ("vivian", "english"), ("aiden", "chinese"), ("aiden", None),
                          ("eric", "chinese"), ("eric", "english")]}
    assert not torch.equal(codes["aiden", "english"], codes["vivian", "english"])
    assert not torch.equal(codes["aiden", "english"], codes["aiden", "chinese"])
    assert not torch.equal(codes["aiden", "english"], codes["aiden", None])
    assert not torch.equal(codes["eric", "chinese"], codes["eric", "english"])
    assert torch.equal(codes["eric", "chinese"], pipe.speech(TEXT, voice="eric").codes)  # auto: the dialect too


def test_voice_design_codes_match_reference(pipes, references):
    pipe = pipes["voice_design"]
    out = pipe.speech(TEXT, instructions=INSTRUCTIONS, language="english")
    family = pipe.family
    instruct_ids = family.voice(None, "english", INSTRUCTIONS).instruct_ids
    assert instruct_ids == tuple(family.tokenizer.encode(f"<|im_start|>user\n{INSTRUCTIONS}<|im_end|>\n"))
    expected = reference_codes(references["voice_design"], family.speech_ids(TEXT), None, "english", instruct_ids)
    assert torch.equal(out.codes, expected)
    other = pipe.speech(TEXT, instructions="A bright, fast voice.", language="english")
    assert not torch.equal(out.codes, other.codes)


def test_non_streaming_layout_matches_reference(checkpoints, references):
    pipe = OmniPipeline.from_pretrained(checkpoints["custom_voice"], max_frames=FRAMES, non_streaming_mode=True)
    out = pipe.speech(TEXT, voice="aiden", language="english")
    expected = reference_codes(references["custom_voice"], pipe.family.speech_ids(TEXT), "aiden", "english",
                               non_streaming_mode=True)
    assert torch.equal(out.codes, expected)


def test_ragged_batch_rows_equal_their_references(pipes, references):
    pipe = pipes["custom_voice"]
    texts = [TEXT, OTHER_TEXT, TEXT]
    voices, languages = ["aiden", "vivian", "eric"], ["english", "chinese", None]
    outs = pipe.speech(texts, voice=voices, language=languages)
    for out, text, voice, language in zip(outs, texts, voices, languages, strict=True):
        expected = reference_codes(references["custom_voice"], pipe.family.speech_ids(text), voice, language)
        assert torch.equal(out.codes, expected)


def test_input_ids_and_a_checkpoint_without_tokenizer(checkpoints, pipes, tmp_path):
    path = tmp_path / "no_tokenizer"
    shutil.copytree(checkpoints["custom_voice"], path,
                    ignore=shutil.ignore_patterns("tokenizer*", "special_tokens_map.json", "chat_template*"))
    pipe = OmniPipeline.from_pretrained(path, max_frames=FRAMES)
    assert pipe.tokenizer is None
    ids = pipes["custom_voice"].family.speech_ids(TEXT)
    out = pipe.speech(input_ids=ids, voice="aiden", language="english")
    assert torch.equal(out.codes, pipes["custom_voice"].speech(TEXT, voice="aiden", language="english").codes)
    with pytest.raises(ValueError, match="text"):
        pipe.speech(TEXT, voice="aiden")


def test_repetition_penalty_matches_reference(pipes, references):
    """The default greedy penalty (1.05) and a strong one change the codes, as the reference's do."""
    pipe = pipes["custom_voice"]
    ids = pipe.family.speech_ids(OTHER_TEXT)
    default = pipe.speech(OTHER_TEXT, voice="vivian", language="chinese")
    assert torch.equal(default.codes, reference_codes(references["custom_voice"], ids, "vivian", "chinese"))
    without = pipe.speech(OTHER_TEXT, voice="vivian", language="chinese", sampling=SamplingParams(temperature=0.0))
    assert not torch.equal(default.codes, without.codes)
    greedy = SamplingParams(temperature=0.0, repetition_penalty=3.0)
    out = pipe.speech(OTHER_TEXT, voice="vivian", sampling=greedy, max_frames=16)
    expected = reference_codes(references["custom_voice"], ids, "vivian", None, frames=16, repetition_penalty=3.0)
    assert torch.equal(out.codes, expected)
    plain = pipe.speech(OTHER_TEXT, voice="vivian", sampling=SamplingParams(temperature=0.0), max_frames=16)
    assert not torch.equal(out.codes, plain.codes)


def test_min_new_tokens_and_eos_match_reference(checkpoints):
    """With codec EOS made the argmax everywhere (a bias on codec_head), both sides speak exactly the two
    frames min_new_tokens allows and stop."""
    pipe = OmniPipeline.from_pretrained(checkpoints["custom_voice"], max_frames=FRAMES)
    reference = qwen_tts_reference.talker_model(checkpoints["custom_voice"])
    for talker in (pipe.family.talker, reference.talker):
        head = torch.nn.Linear(talker.codec_head.in_features, talker.codec_head.out_features, bias=True)
        with torch.no_grad():
            head.weight.copy_(talker.codec_head.weight)
            head.bias.zero_()
            head.bias[TINY_CODEC_IDS["codec_eos_token_id"]] = 1e4
        talker.codec_head = head
    out = pipe.speech(TEXT, voice="aiden")
    expected = reference_codes(reference, pipe.family.speech_ids(TEXT), "aiden", None)
    assert out.codes.shape == (16, 2) and out.finish_reason == "stop"
    assert torch.equal(out.codes, expected)


def test_sampled_requests_repeat_and_do_not_depend_on_the_batch(pipes):
    pipe = pipes["custom_voice"]
    alone = pipe.speech(OTHER_TEXT, voice="vivian", sampling=QWEN3_TTS_SAMPLING, seed=7)
    again = pipe.speech(OTHER_TEXT, voice="vivian", sampling=QWEN3_TTS_SAMPLING, seed=7)
    batch = pipe.speech([TEXT, OTHER_TEXT], voice=["aiden", "vivian"], sampling=QWEN3_TTS_SAMPLING, seed=[3, 7])
    greedy = pipe.speech(OTHER_TEXT, voice="vivian")
    assert torch.equal(alone.codes, again.codes)
    assert torch.equal(alone.codes, batch[1].codes)
    assert not torch.equal(alone.codes, greedy.codes)
    assert not torch.equal(
        alone.codes, pipe.speech(OTHER_TEXT, voice="vivian", sampling=QWEN3_TTS_SAMPLING, seed=8).codes
    )


@pytest.mark.parametrize("kind, arguments, match", [
    ("custom_voice", {"voice": "nobody"}, r"voice: unknown voice 'nobody'; voices: \['aiden', 'eric', 'vivian'\]"),
    ("custom_voice", {"language": "klingon"},
     r"language: unknown language 'klingon'; languages: \['auto', 'chinese', 'english'\]"),
    ("custom_voice", {"language": "sichuan_dialect"}, "language: unknown language"),
    ("custom_voice", {"instructions": "whisper"}, "instructions: this custom_voice 0b6 model ignores instructions"),
    ("voice_design", {}, "instructions: a VoiceDesign model needs instructions"),
    ("voice_design", {"instructions": "  "}, "instructions: a VoiceDesign model needs instructions"),
    ("voice_design", {"instructions": "calm", "voice": "aiden"}, "voice: a VoiceDesign model has no named voices"),
    ("custom_voice", {"text": ""}, "text: empty text"),
    ("custom_voice", {"text": []}, "text: empty text"),
    ("custom_voice", {"text": None, "input_ids": [256, 263, 10, 257]}, "input_ids"),
    ("custom_voice", {"sampling": 0.9}, "sampling must be None or a SamplingParams"),
    ("custom_voice", {"max_frames": 0}, "max_frames must be an integer >= 1"),
    ("custom_voice", {"text": ["a", "b"], "voice": ["aiden"]}, "voice: 1 values for 2 texts"),
])
def test_bad_input_is_a_value_error_naming_the_argument(pipes, kind, arguments, match):
    arguments = {"text": TEXT, **arguments}
    with pytest.raises(ValueError, match=match):
        pipes[kind].speech(**arguments)


def test_a_tts_model_has_no_chat(pipes):
    with pytest.raises(ValueError, match="prompt: this model has no chat"):
        pipes["custom_voice"].generate("Hello")


def test_tiny_pipeline_and_save_pretrained_round_trip(tmp_path):
    pipe = OmniPipeline.tiny(family="qwen3_tts")
    assert isinstance(pipe.family, Qwen3TTSFamily) and pipe.family.speakers == ("aiden", "eric", "vivian")
    design = OmniPipeline.tiny(family="qwen3_tts", tts_model_type="voice_design")
    assert design.family.tts_model_type == "voice_design"
    pipe.save_pretrained(tmp_path / "saved")
    loaded = OmniPipeline.from_pretrained(tmp_path / "saved", max_frames=4)
    out = pipe.speech(OTHER_TEXT, max_frames=4)
    assert torch.equal(loaded.speech(OTHER_TEXT).codes, out.codes)
    assert np.array_equal(loaded.speech(OTHER_TEXT).audio, out.audio)
    assert -40.0 <= rms_dbfs(out.audio) <= -6.0  # the tiny model speaks at speech level
    qwen_tts_reference.talker_model(tmp_path / "saved")  # the reference loads what we save


def test_codec_dtype_bfloat16_changes_only_the_audio_and_within_its_stated_error(tmp_path):
    """`codec_dtype="bfloat16"` runs the decoder's conv stack in bf16: the same codes, audio within 20 dB SNR
    of fp32's (docs/tts.md: 22.5–23.5 dB measured) and not equal to it, a request alone as in a batch; a bad
    value, or a Qwen2.5-Omni model, is a ValueError naming codec_dtype."""
    texts = [OTHER_TEXT, "A second text, a little longer than the first one."]
    fp32 = OmniPipeline.tiny(family="qwen3_tts", max_frames=12)
    bf16 = OmniPipeline.tiny(family="qwen3_tts", max_frames=12, codec_dtype="bfloat16")
    assert fp32.family.codec.conv_dtype == torch.float32 and bf16.family.codec.conv_dtype == torch.bfloat16
    expected, alone = fp32.speech(texts[0]), bf16.speech(texts[0])
    assert torch.equal(alone.codes, expected.codes) and alone.audio.dtype == np.float32
    assert_audible(alone.audio)
    noise = ((alone.audio.astype(np.float64) - expected.audio) ** 2).sum()
    assert 0 < noise <= 10 ** (-20 / 10) * (expected.audio.astype(np.float64) ** 2).sum()
    assert np.array_equal(bf16.speech(texts)[0].audio, alone.audio)
    for bad in ("float16", torch.bfloat16, 1):
        with pytest.raises(ValueError, match="codec_dtype"):
            OmniPipeline.tiny(family="qwen3_tts", codec_dtype=bad)
    with pytest.raises(ValueError, match="codec_dtype"):
        OmniPipeline.tiny(family="qwen2_5", codec_dtype="bfloat16")
    with pytest.raises(ValueError, match="float32 weights are gone"):  # nothing written: no checkpoint that sounds off
        bf16.save_pretrained(tmp_path / "rounded")
    assert not (tmp_path / "rounded").exists()


# --- audio ----------------------------------------------------------------------------------------------


def test_audio_matches_reference_generate_and_decode(checkpoints, pipes, references):
    """Ours end to end == the reference's generate + its speech tokenizer's decode, up to float rounding."""
    pipe = pipes["custom_voice"]
    out = pipe.speech(TEXT, voice="aiden", language="english")
    codes = reference_codes(references["custom_voice"], pipe.family.speech_ids(TEXT), "aiden", "english")
    tokenizer = qwen_tts_reference.load_speech_tokenizer(os.path.join(checkpoints["custom_voice"], "speech_tokenizer"))
    with torch.no_grad():
        expected = tokenizer.decode(audio_codes=codes.T[None]).audio_values[0].float().numpy()
    assert out.sample_rate == 24_000 and out.audio.dtype == np.float32
    assert out.audio.shape == (1920 * codes.shape[1],)
    assert_audible(out.audio)
    assert_audio_close(out.audio, expected)


def test_streamed_chunks_join_into_the_one_shot_audio(pipes):
    pipe = pipes["voice_design"]
    items = list(pipe.stream_speech(TEXT, instructions=INSTRUCTIONS))
    *chunks, output = items
    one_shot = pipe.speech(TEXT, instructions=INSTRUCTIONS)
    assert len(chunks) >= 2 and chunks[0].shape == (1920,)  # a 1-frame first chunk
    assert torch.equal(output.codes, one_shot.codes)
    assert_audible(one_shot.audio)
    assert_audio_close(np.concatenate(chunks), one_shot.audio)
    assert np.array_equal(np.concatenate(chunks), output.audio)


def test_speak_cli_on_a_tts_checkpoint(checkpoints, pipes, tmp_path):
    import subprocess
    import sys

    import soundfile

    output = tmp_path / "out.wav"
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    command = [sys.executable, "-m", "omnimtp.cli", "speak", "--model", checkpoints["custom_voice"], TEXT,
               "--voice", "aiden", "--language", "english", "--max-frames", str(FRAMES), "-o", str(output)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, cwd=repo, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr
    audio, sample_rate = soundfile.read(output, dtype="float32")
    expected = pipes["custom_voice"].speech(TEXT, voice="aiden", language="english").audio
    assert sample_rate == 24_000
    assert_audio_close(audio, expected, rel=1e-3)  # 16-bit PCM in the file


def test_batch_job_actor_speaks_tts_rows(checkpoints, pipes):
    """`omnimtp batch`'s actor on a Qwen3-TTS checkpoint: each row's text in its voice, as `speech` gives it."""
    import json

    from omnimtp.batch import PipelineSpeaker

    actor = PipelineSpeaker(checkpoints["custom_voice"], None, "wav", None, FRAMES, 4)
    rows = [{"id": "a", "prompt": TEXT, "voice": "aiden", "language": "english"},
            {"id": "b", "prompt": OTHER_TEXT, "voice": "vivian", "seed": 7}]
    columns = actor({"request": [json.dumps(row) for row in rows]})
    assert columns["id"] == ["a", "b"]
    expected = [pipes["custom_voice"].speech(TEXT, voice="aiden", language="english"),
                pipes["custom_voice"].speech(OTHER_TEXT, voice="vivian", sampling=QWEN3_TTS_SAMPLING, seed=7)]
    assert columns["num_frames"] == [out.codes.shape[1] for out in expected]
    assert all(len(audio) > 44 for audio in columns["audio"])
