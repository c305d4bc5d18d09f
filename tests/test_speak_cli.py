import soundfile

from omnimtp.cli import main


def test_speak_writes_a_24khz_file_of_whole_frames(tmp_path, capsys):
    for name, stream in [("a.wav", []), ("b.flac", ["--stream"])]:
        path = tmp_path / name
        assert main(["speak", "Hello", "-o", str(path), "--max-new-tokens", "6", "--max-frames", "8", *stream]) == 0
        audio, rate = soundfile.read(path)
        assert rate == 24000 and audio.ndim == 1
        assert len(audio) == 1920 * 8 - 555
    err = capsys.readouterr().err
    assert "time to first audio" in err and "RTF" in err


def test_chat_answers_each_line(tmp_path, monkeypatch, capsys):
    lines = iter(["Hi", "And again", ""])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    assert main(["chat", "--out-dir", str(tmp_path), "--max-new-tokens", "4", "--max-frames", "3"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["answer_1.wav", "answer_2.wav"]
