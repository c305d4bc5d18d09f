"""`omnimtp voice create` and `omnimtp speak --voice FILE` on a tiny Qwen3-TTS Base checkpoint."""

from __future__ import annotations

import numpy as np
import pytest
import soundfile
import torch
from audio_checks import assert_audible, assert_audio_close

from omnimtp.cli import main
from omnimtp.pipeline import OmniPipeline
from omnimtp.voice import Voice

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TEXT = "Hello there."
REF_TEXT = "A reference recording."


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    root = tmp_path_factory.mktemp("voice_cli")
    OmniPipeline.tiny(family="qwen3_tts", tts_model_type="base").save_pretrained(root / "base")
    t = np.arange(36_000) / 24_000
    samples = (0.3 * np.sin(2 * np.pi * 150 * t) * (0.5 + 0.5 * np.sin(2 * np.pi * 4 * t) ** 2)).astype(np.float32)
    soundfile.write(root / "ref.wav", samples, 24_000)
    return root, OmniPipeline.from_pretrained(root / "base", max_frames=6)


@pytest.mark.parametrize("flags, mode", [(["--text", REF_TEXT], "icl"),
                                         (["--text", REF_TEXT, "--x-vector-only"], "x_vector"),
                                         ([], "x_vector")])
def test_voice_create_then_speak_equals_the_python_api(base, tmp_path, capsys, flags, mode):
    root, pipe = base
    voice_path, wav_path = tmp_path / "me.safetensors", tmp_path / "hello.wav"
    assert main(["voice", "create", "--model", str(root / "base"), "--audio", str(root / "ref.wav"), *flags,
                 "-o", str(voice_path)]) == 0
    words = {"icl": "an in-context (icl)", "x_vector": "an x-vector"}[mode]
    assert f"{words} voice from 1.50 s of audio" in capsys.readouterr().err
    voice = Voice.load(voice_path)
    expected_voice = pipe.create_voice(root / "ref.wav", REF_TEXT if flags else None,
                                       x_vector_only="--x-vector-only" in flags)
    assert voice.mode == mode and torch.equal(voice.speaker_embedding, expected_voice.speaker_embedding)
    assert main(["speak", "--model", str(root / "base"), "--voice", str(voice_path), TEXT, "--max-frames", "6",
                 "-o", str(wav_path)]) == 0
    audio, rate = soundfile.read(wav_path, dtype="float32")
    expected = pipe.speech(TEXT, voice=expected_voice).audio
    assert rate == 24_000
    assert_audible(audio)
    assert_audio_close(audio, expected, rel=1e-3)  # 16-bit PCM in the file


def test_voice_cli_errors_name_the_flag(base, tmp_path, capsys):
    root, _ = base
    short = tmp_path / "short.wav"
    soundfile.write(short, np.zeros(2400, dtype=np.float32), 24_000)
    runs = [
        (["voice", "create", "--model", str(root / "base"), "--audio", str(short),
          "-o", str(tmp_path / "v.safetensors")],
         "--audio " + str(short) + ": ref_audio: 0.10 s of audio is shorter than the minimum of 1 s"),
        (["voice", "create", "--model", str(root / "base"), "--audio", str(short), "-o", str(tmp_path / "v.pt")],
         "--output must end in .safetensors"),
        (["speak", "--model", str(root / "base"), "--voice", str(tmp_path / "missing.safetensors"), TEXT, "-o",
          str(tmp_path / "x.wav")], "--voice: voice: no such file"),
    ]
    for argv, message in runs:
        assert main(argv) == 2
        assert message in capsys.readouterr().err


def test_batch_rows_speak_voice_files_on_a_base_model(base, tmp_path):
    """`omnimtp batch`'s actor on a Base checkpoint: a row's voice is a voice file, spoken as `speech` speaks
    the loaded Voice; a missing file is refused before Ray starts."""
    import io
    import json

    from omnimtp.batch import PipelineSpeaker, check_voices

    root, pipe = base
    voice = pipe.create_voice(root / "ref.wav", REF_TEXT)
    voice.save(tmp_path / "me.safetensors")
    actor = PipelineSpeaker(str(root / "base"), None, "wav", None, 6, 4)
    rows = [{"id": "a", "prompt": TEXT, "voice": str(tmp_path / "me.safetensors")}, {"id": "b", "prompt": "Hi"}]
    columns = actor({"request": [json.dumps(row) for row in rows]})
    expected = pipe.speech([TEXT, "Hi"], voice=[voice, None])
    assert columns["id"] == ["a", "b"]
    assert columns["num_frames"] == [out.codes.shape[1] for out in expected]
    for encoded, out in zip(columns["audio"], expected, strict=True):
        audio, rate = soundfile.read(io.BytesIO(encoded), dtype="float32")
        assert rate == 24_000
        assert_audio_close(audio, out.audio, rel=1e-3)  # 16-bit PCM
    check_voices(str(root / "base"), {str(tmp_path / "me.safetensors")})
    with pytest.raises(ValueError, match="voice: no voice file"):
        check_voices(str(root / "base"), {str(tmp_path / "missing.safetensors")})
