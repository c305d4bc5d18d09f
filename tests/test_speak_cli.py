import numpy as np
import soundfile
from audio_checks import assert_audible

from omnimtp.cli import main
from omnimtp.pipeline import OmniPipeline
from omnimtp.server.audio import to_pcm16


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
        # the first frame goes out alone (fast first audio), the other 7 in the next chunk
        assert "in 2 chunks" in err


def test_speak_prints_model_text_escaped(tmp_path, capsys):
    """The tiny model's random bytes reach the terminal escaped, never as raw control characters."""
    seen = ""
    for seed in range(4):
        assert main(["speak", "Hello", "-o", str(tmp_path / "a.wav"), "--seed", str(seed), "--max-new-tokens", "32",
                     "--max-frames", "2", *(["--stream"] if seed % 2 else [])]) == 0
        seen += capsys.readouterr().out
    assert not any(ch not in "\n\t" and not ch.isprintable() for ch in seen)
    assert "\\x" in seen or "\\u" in seen  # some random characters were unprintable, shown escaped


def test_a_built_in_tiny_model_says_once_that_its_weights_are_random(tmp_path, capsys):
    """Random bytes and finish=length are what random weights give: the command says so, once, for a built-in
    tiny model only (not for a checkpoint directory, even one saved from a tiny model)."""
    caps = ["--max-new-tokens", "4", "--max-frames", "3"]
    for model, words in ([], "its text is random bytes"), (["--model", "tiny-tts"], "its speech sounds like noise"):
        assert main(["speak", "Hello", "-o", str(tmp_path / "a.wav"), *model, *caps]) == 0
        notes = [line for line in capsys.readouterr().err.splitlines() if line.startswith("note: ")]
        assert len(notes) == 1 and "random weights" in notes[0] and words in notes[0], notes
    OmniPipeline.from_pretrained("tiny-tts").save_pretrained(tmp_path / "saved")
    assert main(["speak", "Hello", "-o", str(tmp_path / "a.wav"), "--model", str(tmp_path / "saved"), *caps]) == 0
    assert "note: " not in capsys.readouterr().err


def test_chat_answers_each_line(tmp_path, monkeypatch, capsys):
    lines = iter(["Hi", "And again", ""])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    assert main(["chat", "--out-dir", str(tmp_path), "--max-new-tokens", "4", "--max-frames", "3"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["answer_1.wav", "answer_2.wav"]


def test_chat_makes_its_out_dir(tmp_path, monkeypatch):
    lines = iter(["Hi", ""])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    out = tmp_path / "answers" / "today"
    assert main(["chat", "--out-dir", str(out), "--max-new-tokens", "4", "--max-frames", "3"]) == 0
    assert [p.name for p in out.iterdir()] == ["answer_1.wav"]


def test_chat_refuses_an_out_dir_it_cannot_make_before_loading(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert main(["chat", "--out-dir", str(blocker / "answers")]) == 2
    assert "omnimtp chat: error: --out-dir: cannot create" in capsys.readouterr().err


def _media_files(tmp_path, hz: float = 330.0):
    from media_samples import encode, tone
    from PIL import Image

    audio, image = tmp_path / f"question_{hz:g}.wav", tmp_path / "photo.png"
    audio.write_bytes(encode(tone(1.0, 22_050, hz=hz), 22_050))
    Image.effect_noise((64, 64), 50).convert("RGB").save(image)
    return str(audio), str(image)


def test_speak_answers_audio_and_an_image_without_text(tmp_path):
    audio, image = _media_files(tmp_path)
    out = tmp_path / "answer.wav"
    assert main(["speak", "--audio", audio, "--image", image, "-o", str(out), "--max-new-tokens", "4",
                 "--max-frames", "4"]) == 0
    samples, rate = soundfile.read(out, dtype="int16")
    assert rate == 24000 and len(samples) > 0
    assert_audible(samples)


def test_speak_hears_the_audio(tmp_path):
    """Greedy, same text: a different question audio gives a different answer."""
    answers = []
    for hz in (330.0, 2000.0):
        audio, _ = _media_files(tmp_path, hz)
        out = tmp_path / f"answer_{hz:g}.wav"
        assert main(["speak", "--audio", audio, "Answer.", "-o", str(out), "--max-new-tokens", "6",
                     "--max-frames", "4"]) == 0
        answers.append(soundfile.read(out, dtype="int16")[0])
    assert len(answers[0]) != len(answers[1]) or not np.array_equal(answers[0], answers[1])


def test_speak_refuses_bad_input_with_exit_code_2(tmp_path, capsys):
    audio, image = _media_files(tmp_path)
    junk = tmp_path / "junk.wav"
    junk.write_bytes(b"not audio at all" * 10)
    out = str(tmp_path / "a.wav")
    cases = [
        (["-o", out], "give the text to say, or --audio / --image"),
        (["Hi", "-o", str(tmp_path / "a.txt")], "--output must end in .wav, .flac, .mp3"),
        (["--audio", str(tmp_path / "missing.wav"), "-o", out], f"--audio {tmp_path / 'missing.wav'}: cannot read"),
        (["--audio", str(junk), "-o", out], f"--audio {junk}: is not audio that can be decoded"),
        (["--image", audio, "-o", out], f"--image {audio}: is not an image that can be decoded"),
        (["--audio", audio, "Hi", "-o", out, "--speaker", "nobody"], "nobody"),
    ]
    for args, words in cases:
        assert main(["speak", *args]) == 2, args
        err = capsys.readouterr().err
        assert err.startswith("omnimtp speak: error: ") and words in err, err
    assert not (tmp_path / "a.wav").exists()
