"""Qwen3-ForcedAligner: word and character timestamps equal to the reference (`qwen_asr`'s `Qwen3ForcedAligner`
on the same tiny seeded checkpoint in the released layout), its word splitting and its repair of bins that run
backwards, and bad input."""

from __future__ import annotations

import numpy as np
import pytest
import qwen_asr_reference as reference
import torch
from asr_checks import RATE, speechlike

from omnimtp.families.aligner_words import script_language, split_words, words_of
from omnimtp.families.qwen3_aligner import AlignedWord, Qwen3ForcedAligner, repair_bins
from omnimtp.media import MediaLimits
from omnimtp.models.qwen3_asr import EncoderLinear
from omnimtp.runtime.ops import packed_gemm_kind


@pytest.fixture(scope="module")
def aligner():
    return Qwen3ForcedAligner.tiny(0)


@pytest.fixture(scope="module")
def ref(aligner):
    return reference.reference_aligner(aligner)


@pytest.mark.parametrize(("text", "language", "seconds", "seed"), [
    ("Hello, world! It's a test of twelve words, or so it seems.", "English", 3.0, 1),
    ("你好，世界！今天 天气 很好abc", "Chinese", 2.2, 2),
    ("Bonjour à tous, ça va?", "fr", 1.4, 3),
    ("今日はいい天気ですね。東京タワーに行きました", "ja", 2.0, 7),
    ("안녕하세요, 저는 학생입니다. 오늘 날씨가 좋네요", "Korean", 2.2, 8),
])
def test_timestamps_equal_the_reference(aligner, ref, text, language, seconds, seed):
    if language in ("ja", "Korean"):
        reference.need_word_splitters()
    samples = speechlike(seconds, seed)
    ours = aligner.align(samples, text, language)
    theirs = ref.align(audio=(samples, RATE), text=text, language=_name(language))[0]
    assert [(w.word, w.start, w.end) for w in ours] == [(i.text, i.start_time, i.end_time) for i in theirs]
    assert len({w.start for w in ours}) > 1  # the bins depend on the position (a test that can fail)


def _name(language: str) -> str:
    return {"fr": "French", "ja": "Japanese"}.get(language, language)


def test_split_words_is_the_references():
    reference.load()
    from qwen_asr.inference.qwen3_forced_aligner import Qwen3ForceAlignProcessor

    processor = Qwen3ForceAlignProcessor()
    for text in ("Hello, world!", "don't stop — 3.14 and 1,000", "你好，世界abc 测试 x你y", "  ", "¿Qué tal? Ça va.",
                 "mixed中文and English", "emoji 🙂 here", "tab\tand\nnewline"):
        assert split_words(text) == processor.tokenize_space_lang(text), text


JAPANESE = ("今日はいい天気ですね。", "東京タワーに行きました！ABCと123", "ｶﾀｶﾅとカタカナ、漢字", "  ", "don't 日本語")
KOREAN = ("안녕하세요, 저는 학생입니다.", "오늘 날씨가 좋네요! 123 ABC", "대한민국의 수도는 서울이다", " ")


def test_japanese_and_korean_words_are_the_references():
    """Japanese words are nagisa's and Korean words soynlp's with the reference's word list, cleaned as the
    reference cleans them; a text without a language is split by its script."""
    reference.need_word_splitters()
    reference.load()
    from qwen_asr.inference.qwen3_forced_aligner import Qwen3ForceAlignProcessor
    from soynlp.tokenizer import LTokenizer

    processor = Qwen3ForceAlignProcessor()
    for text in JAPANESE:
        assert words_of(text, "Japanese") == processor.tokenize_japanese(text), text
    korean = LTokenizer(scores=processor.ko_score)
    for text in KOREAN:
        assert words_of(text, "Korean") == processor.tokenize_korean(korean, text), text
    assert words_of(KOREAN[0], "Korean") != split_words(KOREAN[0])  # (the dictionary splits words: can fail)
    assert [script_language(t) for t in ("カタカナ", "ひらがな", "漢字", "한국어", "Hello", "")] == [
        "Japanese", "Japanese", None, "Korean", None, None]
    assert words_of(JAPANESE[1], None) == words_of(JAPANESE[1], "Japanese")
    assert words_of(KOREAN[1], None) == words_of(KOREAN[1], "Korean")
    assert words_of("漢字 only", None) == ["漢", "字", "only"]  # no kana: Chinese, a character each


def test_without_the_word_splitters_japanese_and_korean_are_refused_naming_language(aligner, monkeypatch):
    import sys

    from omnimtp.families import aligner_words

    aligner_words._korean_tokenizer.cache_clear()
    monkeypatch.setitem(sys.modules, "nagisa", None)  # import nagisa -> ImportError
    monkeypatch.setitem(sys.modules, "soynlp.tokenizer", None)
    samples = speechlike(0.5, 5)
    with pytest.raises(ValueError, match=r"^language: Japanese words are split with nagisa, which is not installed "
                       r"\(pip install 'omnimtp\[cjk\]'\)"):
        aligner.align(samples, "こんにちは", "ja")
    with pytest.raises(ValueError, match="^language: Korean words are split with soynlp"):
        aligner.align(samples, "안녕하세요", None)
    assert [w.word for w in aligner.align(samples, "hello there", None)] == ["hello", "there"]
    aligner_words._korean_tokenizer.cache_clear()


def test_repair_bins_is_the_references():
    """The reference's `fix_timestamp` on random bins (many running backwards, with ties) and on edge cases."""
    reference.load()
    from qwen_asr.inference.qwen3_forced_aligner import Qwen3ForceAlignProcessor

    processor = Qwen3ForceAlignProcessor()
    rng = np.random.default_rng(0)
    cases = [[80.0], [0.0, 0.0], [400.0, 80.0, 160.0], [80.0, 4000.0, 160.0, 240.0],
             [80.0, 160.0, 0.0, 0.0, 0.0, 800.0]]
    cases += [(rng.integers(0, 12, size=rng.integers(1, 24)) * 80.0).tolist() for _ in range(300)]
    for bins in cases:
        assert repair_bins(bins) == processor.fix_timestamp(np.array(bins, dtype=np.float32)), bins
    assert repair_bins([]) == []


def test_quantized_aligner_runs_and_repeats(aligner):
    quantized = Qwen3ForcedAligner(aligner.model, aligner.tokenizer, quantize="int8")
    # quantized, the audio encoder is the bf16 copy; float, the model's own thinker (the reference's rows)
    assert aligner.thinker is aligner.model.thinker
    if packed_gemm_kind(torch.device("cpu"), torch.bfloat16) == "onednn":
        assert isinstance(quantized.thinker.audio_tower.layers[0].fc1, EncoderLinear)
    samples = speechlike(1.5, 4)
    first = quantized.align(samples, "one two three", "en")
    assert first == quantized.align(samples, "one two three", "en")
    assert [w.word for w in first] == ["one", "two", "three"]
    assert all(isinstance(w, AlignedWord) and 0 <= w.start <= w.end for w in first)


def test_bad_input_names_the_argument(aligner):
    samples = speechlike(0.5, 5)
    assert aligner.align(samples, " ,. ", "English") == []
    with pytest.raises(ValueError, match="^language: 'xx'"):
        aligner.align(samples, "hi", "xx")
    with pytest.raises(ValueError, match="^text:"):
        aligner.align(samples, None, "en")
    with pytest.raises(ValueError, match="^audio:"):
        aligner.align(np.zeros(0, dtype=np.float32), "hi", "en")
    with pytest.raises(ValueError, match="^audio: 401.0 s is longer than the aligner's time bins reach .400 s."):
        aligner.align(np.zeros(401 * RATE, dtype=np.float32), "hi", "en", MediaLimits(max_audio_seconds=500))
    with pytest.raises(ValueError, match="^path:"):
        Qwen3ForcedAligner.from_pretrained("/nonexistent/aligner")


def test_a_quantized_aligner_it_made_itself_frees_its_float_matrices(aligner):
    own = Qwen3ForcedAligner.tiny(0, quantize="int8")
    assert all(linear.weight.stride() == (0, 0) for linear in own.model.decoder_linears())
    samples = speechlike(1.3, 6)
    kept = Qwen3ForcedAligner(aligner.model, aligner.tokenizer, quantize="int8")
    assert own.align(samples, "one two three four", "en") == kept.align(samples, "one two three four", "en")


def test_a_checkpoint_in_the_released_layout_aligns_as_its_model(aligner, tmp_path):
    """The tiny aligner saved in the released layout (config.json, model.safetensors, preprocessor_config.json and
    the tokenizer files) loads by from_pretrained with its feature extractor and aligns as the model it was saved
    from; an ASR checkpoint there is refused naming path."""
    aligner.model.save_pretrained(tmp_path)
    aligner.processor.save_pretrained(tmp_path)
    loaded = Qwen3ForcedAligner.from_pretrained(tmp_path)
    assert loaded.processor.feature_extractor.to_dict() == aligner.processor.feature_extractor.to_dict()
    samples = speechlike(1.2, 9)
    assert loaded.align(samples, "one two three", "en") == aligner.align(samples, "one two three", "en")
    from omnimtp.families.qwen3_asr import Qwen3ASRFamily

    Qwen3ASRFamily.tiny(0).model.save_pretrained(tmp_path / "asr")
    aligner.processor.save_pretrained(tmp_path / "asr")
    with pytest.raises(ValueError, match="^path: .* is a Qwen3-ASR model"):
        Qwen3ForcedAligner.from_pretrained(tmp_path / "asr")

