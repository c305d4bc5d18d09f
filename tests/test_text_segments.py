"""`omnimtp.text_segments.split_text`: a long text cut for speech at sentence ends, then clause marks, then
between words, then between characters, the same rule for English and Chinese. Every case also checks the
two invariants: the segments joined are the text, and each is within the budget."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from omnimtp.text_segments import OpenSegment, SegmentStream, split_text


def _split(text: str, max_size: int, size=len) -> list[str]:
    segments = split_text(text, max_size, size)
    assert "".join(segments) == text
    assert all(segment and size(segment) <= max_size for segment in segments)
    return segments


def test_a_text_within_the_budget_is_one_segment():
    assert _split("Hello there. How are you?", 100) == ["Hello there. How are you?"]
    assert split_text("", 5) == []


def test_english_is_cut_at_sentence_ends_and_sentences_are_packed():
    text = "One two. Three four five! Six? Seven eight nine ten."
    assert _split(text, 21) == ["One two. ", "Three four five! ", "Six? ", "Seven eight nine ten."]
    assert _split(text, 30) == ["One two. Three four five! ", "Six? Seven eight nine ten."]


def test_a_sentence_over_the_budget_is_cut_at_clauses_then_words():
    text = "First, the long part; then the rest: done. Short."
    # the pieces of a sentence cut finer are not packed with the next sentence
    assert _split(text, 16) == ["First, ", "the long part; ", "then the rest: ", "done. ", "Short."]
    assert _split("alpha beta gamma delta epsilon", 12) == ["alpha beta ", "gamma delta ", "epsilon"]


def test_a_dot_inside_a_word_or_number_is_not_a_sentence_end():
    assert _split("Pi is 3.14 and e is 2.71. Next one.", 26) == ["Pi is 3.14 and e is 2.71. ", "Next one."]


def test_closing_quotes_stay_with_their_sentence():
    assert _split('He said "Stop." Then he left.', 16) == ['He said "Stop." ', "Then he left."]
    assert _split("「你好。」他说。", 5) == ["「你好。」", "他说。"]


def test_chinese_is_cut_at_its_marks_without_spaces():
    text = "你好。今天天气很好，我们去公园吧！好的；走、跑、跳。"
    assert _split(text, 9) == ["你好。", "今天天气很好，", "我们去公园吧！", "好的；走、跑、跳。"]
    assert _split("今天天气很好，我们去公园吧", 8) == ["今天天气很好，", "我们去公园吧"]


def test_mixed_english_and_chinese():
    text = "Hello 世界。这是一个测试, and more. 好的！OK?"
    assert _split(text, 12) == ["Hello 世界。", "这是一个测试, ", "and more. ", "好的！OK?"]


def test_no_punctuation_is_cut_between_words_and_none_between_characters():
    assert _split("the quick brown fox jumps over the lazy dog", 15) == [
        "the quick ", "brown fox ", "jumps over the ", "lazy dog"]
    assert _split("一二三四五六七八九十", 4) == ["一二三四", "五六七八", "九十"]


def test_a_single_word_over_the_budget_is_cut_between_characters():
    assert _split("a supercalifragilistic word", 8) == ["a ", "supercal", "ifragili", "stic ", "word"]


def test_line_breaks_end_sentences():
    assert _split("Title\nFirst line here\nSecond", 18) == ["Title\n", "First line here\n", "Second"]


def test_the_budget_counts_with_the_given_size():
    """A size in UTF-8 bytes (a byte tokenizer's tokens): a Chinese character is three."""
    def num_bytes(text: str) -> int:
        return len(text.encode())

    assert _split("你好。再见。", 9, num_bytes) == ["你好。", "再见。"]
    assert split_text("好", 2, num_bytes) == ["好"]  # one character is never cut, even over the budget


@pytest.mark.parametrize("max_size", [0, -1, 1.5, True, "3"])
def test_a_bad_budget_is_a_value_error_naming_it(max_size):
    with pytest.raises(ValueError, match="max_size"):
        split_text("text", max_size)


def test_text_must_be_a_string():
    with pytest.raises(ValueError, match="text"):
        split_text(["a"], 3)


# --- the same rule for a text that arrives in pieces (`SegmentStream`) --------------------------------------

PIECES = st.sampled_from(["a", "bb", "ccc", " ", "  ", ".", ". ", "!", "?", ",", ", ", ";", "\n", "。", "，", "好",
                          "\"", "」", "xxxxxxx", "3.5", "…"])


@settings(max_examples=400, deadline=None)
@given(parts=st.lists(PIECES, max_size=25), max_size=st.integers(1, 14),
       cuts=st.lists(st.integers(0, 80), max_size=6))
def test_a_streamed_text_is_cut_as_the_whole_and_never_takes_a_cut_back(parts, max_size, cuts):
    """Pushed in any split, the segments are `split_text`'s; each segment handed out is final at once; the
    certain part of the open segment always ends up in that segment; `is_cut` only when the whole text is."""
    text = "".join(parts)
    expected = split_text(text, max_size)
    bounds = [0, *sorted({min(cut, len(text)) for cut in cuts}), len(text)]
    stream = SegmentStream(max_size)
    segments = []
    for start, end in zip(bounds, bounds[1:], strict=False):
        segments += stream.push(text[start:end])
        assert segments == expected[: len(segments)]
        if stream.open is not None:
            assert expected[len(segments)].startswith(stream.open.text[: stream.open.num_certain])
        assert not stream.is_cut or len(expected) > 1
    segments += stream.finish()
    assert segments == expected and stream.is_cut == (len(expected) > 1)


def test_a_segment_is_final_once_the_next_piece_cannot_join_it():
    stream = SegmentStream(12)
    assert stream.push("One. Two") == [] and stream.open == OpenSegment("One. Two", 5)  # might still be one
    assert stream.push(", thr") == ["One. "]  # "One. Two, thr" is over the budget: "Two, thr..." cannot join
    assert stream.open == OpenSegment("Two, thr", 5) and stream.is_cut
    assert stream.push("ee. Four five six.") == ["Two, three. ", "Four five "]
    assert stream.finish() == ["six."] and stream.open is None
    with pytest.raises(ValueError, match="already finished"):
        stream.push("more")


def test_a_word_being_written_is_not_certain_but_the_words_before_it_are():
    stream = SegmentStream(100)
    stream.push("Hello there yo")
    assert stream.open == OpenSegment("Hello there yo", len("Hello there "))
    stream.push("u. Next")
    assert stream.open == OpenSegment("Hello there you. Next", len("Hello there you. "))
    with pytest.raises(ValueError, match="text: expected a string"):
        stream.push(3)
    with pytest.raises(ValueError, match="max_size"):
        SegmentStream(0)
