import numpy as np
import soundfile

from omnimtp.cli import main
from omnimtp.pipeline import OmniPipeline
from omnimtp.server.audio import to_pcm16
from audio_checks import assert_audible


def test_speak_writes_the_pipelines_speech_as_a_24khz_file(tmp_path, capsys):
    expected = OmniPipeline.tiny().generate([{"role": "user", "content": "Hello"}], max_new_tokens=6, max_frames=8)
    expected_pcm = to_pcm16(expected.audio).astype(np.int32)
    for name, stream in [("a.wav", []), ("b.flac", ["--stream"])]:
        path = tmp_path / name
        assert main(["speak", "Hello", "-o", str(path), "--max-new-tokens", "6", "--max-frames", "8", *stream]) == 0
        audio, rate = soundfile.read(path, dtype="int16")
        assert rate == 24000 and audio.ndim == 1
        assert len(audio) == 1920 * 8 - 555
        assert_audible(audio)
        # speak writes streamed chunks (== the one-shot decode up to float rounding) through libsndfile's
        # own float → int16 conversion: at most 1 LSB from the pipeline's samples
        assert np.abs(audio.astype(np.int32) - expected_pcm).max() <= 1
    err = capsys.readouterr().err
    assert "time to first audio" in err and "RTF" in err


def test_chat_answers_each_line(tmp_path, monkeypatch, capsys):
    lines = iter(["Hi", "And again", ""])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    assert main(["chat", "--out-dir", str(tmp_path), "--max-new-tokens", "4", "--max-frames", "3"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["answer_1.wav", "answer_2.wav"]
