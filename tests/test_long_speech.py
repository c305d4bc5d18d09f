"""A text longer than the talker's window, spoken as segments of one request (`ChatText.speech_segments`, the
engine's `_next_segment`): on a tiny seeded Qwen3-TTS whose talker has 48 positions, a text of three windows
is cut at sentence ends and spoken end to end; the joined audio is audible and its seams step no more than
the signal does; a seeded request repeats (the server's run is a second run); the first audio is the first
segment's, as fast as a short text's; a short text is one segment, spoken as before."""

from __future__ import annotations

import time

import httpx
import numpy as np
import pytest
import torch
from audio_checks import assert_audible, assert_audio_close, assert_audio_equal
from server_harness import running_server

from omnimtp.codec.speech_tokenizer import tiny_speech_tokenizer
from omnimtp.engine.request import Request
from omnimtp.families.qwen3_tts import QWEN3_TTS_SAMPLING, Qwen3TTSFamily
from omnimtp.models.qwen3_tts import tiny_qwen3_tts
from omnimtp.pipeline import OmniPipeline
from omnimtp.server.app import create_app
from omnimtp.server.audio import to_pcm16
from omnimtp.server.scheduler import Engine
from omnimtp.tokenizer import byte_tokenizer

pytestmark = pytest.mark.usefixtures("one_torch_thread")

WINDOW = 48  # the talker's positions
MAX_FRAMES = 12  # per segment: a segment holds 48 - 8 - 12 = 28 template ids
MAX_SEGMENT_TOKENS = 10  # text bytes per segment: each sentence below fits, two do not
SENTENCES = ["Cats nap.", "Dogs run!", "你好。", "Why so?", "Sun set.", "好的。", "Owls hoot.", "Rain fell.",
             "Go home!", "We sat.", "Late now.", "Tea?", "Yes, tea.", "Bye now.", "The end."]
LONG_TEXT = " ".join(SENTENCES)
SEED = 3
# A seam's sample step, relative to the signal's 99th-percentile step: a click would be a jump of about the
# signal's range, far above it (measured on this model: at most 0.9).
SEAM_BOUND = 1.5
MODEL_ID = "tts-long"


def _family() -> Qwen3TTSFamily:
    model = tiny_qwen3_tts(0, talker={"max_position_embeddings": WINDOW})
    return Qwen3TTSFamily(model, byte_tokenizer(), codec=tiny_speech_tokenizer(0))


@pytest.fixture(scope="module")
def pipe():
    return OmniPipeline(family=_family(), max_frames=MAX_FRAMES, max_segment_tokens=MAX_SEGMENT_TOKENS)


@pytest.fixture(scope="module")
def long_run(pipe):
    """The long text streamed, seeded: (its audio chunks, its output)."""
    *chunks, output = list(pipe.stream_speech(LONG_TEXT, seed=SEED, sampling=QWEN3_TTS_SAMPLING))
    return chunks, output


def _segment_texts(family, text: str) -> list[str]:
    segments = list(family.speech_segments(text, family.voice(), MAX_FRAMES, MAX_SEGMENT_TOKENS))
    return [family.tokenizer.decode(ids[3:-5]) for ids in segments]


def test_a_text_of_three_windows_is_spoken_end_to_end_in_sentence_segments(pipe, long_run):
    family = pipe.family
    ids = family.speech_ids(LONG_TEXT)
    assert len(ids) >= 3 * WINDOW  # whole, it would not fit the talker
    assert family.talker_positions(ids, family.voice(), MAX_FRAMES) > family.max_positions
    texts = _segment_texts(family, LONG_TEXT)
    assert texts == SENTENCES  # each segment one whole sentence: every cut at a sentence end
    chunks, output = long_run
    assert len(output.segment_frames) == len(SENTENCES) and min(output.segment_frames) >= 1
    assert sum(output.segment_frames) == output.codes.shape[1]
    audio = np.concatenate(chunks)
    assert len(audio) == output.codes.shape[1] * family.codec.total_upsample
    assert_audible(audio)
    for start in np.cumsum([0, *output.segment_frames[:-1]]) * family.codec.total_upsample:
        assert_audible(audio[start:start + family.codec.total_upsample * 4])  # every segment speaks


def test_the_segments_join_without_clicks(pipe, long_run):
    """The codec sees one code sequence: the joined audio is the whole code sequence decoded at once, and
    the sample step at each seam stays within the signal's own steps."""
    chunks, output = long_run
    audio = np.concatenate(chunks)
    codec = pipe.family.codec
    whole = pipe.family.decode_audio([codec.new_stream()], [output.codes], [True])[0]
    assert_audio_close(audio, whole)
    steps = np.abs(np.diff(audio.astype(np.float64)))
    typical = np.percentile(steps, 99)
    seams = np.cumsum(output.segment_frames[:-1]) * codec.total_upsample
    seam_steps = np.array([steps[seam - 2 : seam + 1].max() for seam in seams])  # the steps into and out of it
    assert seam_steps.max() <= SEAM_BOUND * typical, (seam_steps / typical).round(2)


def test_the_first_audio_is_the_first_segments_and_comes_as_fast(pipe, long_run):
    """Segment 1 starts as soon as it is cut: the long text's first chunk is the first sentence's alone, and
    it comes about as soon (the whole text takes {len(SENTENCES)} segments of talker steps)."""
    def first_chunk(text: str) -> tuple[np.ndarray, float]:
        started = time.perf_counter()
        stream = pipe.stream_speech(text, seed=SEED, sampling=QWEN3_TTS_SAMPLING)
        chunk = next(stream)
        seconds = time.perf_counter() - started
        stream.close()
        return chunk, seconds

    short, short_seconds = first_chunk(SENTENCES[0])
    long, long_seconds = first_chunk(LONG_TEXT)
    assert_audible(short)
    np.testing.assert_array_equal(long, short)
    np.testing.assert_array_equal(long_run[0][0], short)
    assert long_seconds <= 5 * short_seconds + 0.5, (long_seconds, short_seconds)


def test_a_short_text_is_one_segment_spoken_as_before(pipe):
    """Within the budget and the window: one segment, the codes of the unsegmented path (its ids given)."""
    family = pipe.family
    text = SENTENCES[1]
    assert _segment_texts(family, text) == [text]
    output = pipe.speech(text, seed=SEED, sampling=QWEN3_TTS_SAMPLING)
    reference = pipe.speech(input_ids=family.speech_ids(text), seed=SEED, sampling=QWEN3_TTS_SAMPLING)
    assert output.segment_frames == [output.codes.shape[1]]
    assert torch.equal(output.codes, reference.codes)


def test_the_served_route_gives_the_pipelines_bytes(long_run):
    """/v1/audio/speech on the same weights, seeded: the pipeline's PCM, byte for byte (a second run of the
    seeded request: it repeats)."""
    engine = Engine(_family(), model_id=MODEL_ID, max_frames=MAX_FRAMES, max_segment_tokens=MAX_SEGMENT_TOKENS,
                    max_batch_size=2)
    with running_server(create_app(engine)) as base:
        body = {"model": MODEL_ID, "input": LONG_TEXT, "response_format": "pcm", "seed": SEED}
        reply = httpx.post(f"{base}/v1/audio/speech", json=body, timeout=300)
    assert reply.status_code == 200, reply.text
    assert reply.content == to_pcm16(np.concatenate(long_run[0])).tobytes()


def test_segments_are_for_a_whole_speech_text():
    with pytest.raises(ValueError, match="segments"):
        Request(0, [1, 2], max_new_tokens=1, max_frames=4, speaker="x", segments=[[3]])  # a chat request
    with pytest.raises(ValueError, match="segments"):
        Request(0, [], max_new_tokens=1, max_frames=4, speaker="x", is_chat=False, is_text_finished=False,
                segments=[[3]])
    given = [[3, 4]]
    request = Request(0, [1, 2], max_new_tokens=1, max_frames=4, speaker="x", is_chat=False, segments=given)
    assert list(request.segments) == [[3, 4]] and given == [[3, 4]]  # read, the caller's list unchanged


def test_the_first_segment_is_cut_before_the_rest_is_looked_at(pipe):
    """Segments are cut as they are asked for: the first costs a few token counts, not the whole text's."""
    family = pipe.family
    sizes = []
    speech_ids = family.speech_ids

    def counted(text: str) -> list[int]:
        sizes.append(text)
        return speech_ids(text)

    family.speech_ids = counted
    try:
        segments = family.speech_segments(" ".join([LONG_TEXT] * 8), family.voice(), MAX_FRAMES, MAX_SEGMENT_TOKENS)
        assert family.tokenizer.decode(next(segments)[3:-5]) == SENTENCES[0]
        num_first = len(sizes)
        rest = list(segments)
    finally:
        del family.speech_ids
    assert len(rest) == 8 * len(SENTENCES) - 1
    assert num_first <= 6 < len(sizes) // 10, (num_first, len(sizes))


def test_an_omni_speech_text_is_cut_by_the_same_budget_and_spoken_in_segments():
    """Qwen3-Omni's speech path (a `/v1/audio/speech` request's text): the same cut, the same segment loop."""
    from omnimtp.engine.core import EngineConfig, EngineCore
    from omnimtp.families.qwen3_omni import Qwen3OmniFamily
    from omnimtp.server.requests import EngineRequest

    family = Qwen3OmniFamily.tiny(0)
    engine = Engine(family, model_id="omni", max_frames=4, max_segment_tokens=MAX_SEGMENT_TOKENS)
    request = EngineRequest(messages=None, speak_text="Cats nap. Dogs run!", speaker=family.default_speaker,
                            sampling=QWEN3_TTS_SAMPLING, seed=SEED, max_new_tokens=0)
    segments = list(engine.speech_segments(request))
    header = len(family.speech_header_ids)
    assert [family.tokenizer.decode(ids[header:]) for ids in segments] == ["Cats nap.", "Dogs run!"]
    core = EngineCore(family, EngineConfig(max_frames=4))
    core.add(Request(0, segments[0], max_new_tokens=1, max_frames=4, speaker=family.default_speaker, is_chat=False,
                     segments=segments[1:], seed=SEED))
    while core.has_work():
        finished = [event.request for event in core.step() if event.is_finished]
    output = core.output(finished[0])
    assert finished[0].prompt_ids == segments[0] + segments[1]  # what the usage counts: every segment's ids
    assert len(output.segment_frames) == 2 and sum(output.segment_frames) == output.codes.shape[1]
    assert_audible(output.audio)


def test_a_seeded_long_text_is_the_same_alone_and_in_a_batch(pipe):
    """Its segments start at other steps than the batch's other rows' (a segment's prefill joins a running
    batch): the request's generators make its codes and audio the same."""
    text = " ".join(SENTENCES[:3])
    alone = pipe.speech(text, seed=SEED, sampling=QWEN3_TTS_SAMPLING)
    batch = pipe.speech([SENTENCES[4], text], seed=[9, SEED], sampling=QWEN3_TTS_SAMPLING)
    assert len(alone.segment_frames) == 3
    assert torch.equal(batch[1].codes, alone.codes) and batch[1].segment_frames == alone.segment_frames
    assert_audio_equal(batch[1].audio, alone.audio)


# --- a long text that arrives in pieces ---------------------------------------------------------------------

def _pieces(text: str, cuts: list[int]) -> list[str]:
    bounds = [0, *sorted(set(cuts)), len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


STREAM_SPLITS = {
    "whole": [],
    "characters": list(range(1, len(LONG_TEXT))),
    "uneven": [1, 2, 9, 10, 11, 31, 33, 60, 61, 62, 100, 101, 120, len(LONG_TEXT) - 1],
}


@pytest.mark.parametrize("split", STREAM_SPLITS)
def test_a_streamed_long_text_is_the_whole_texts_speech_however_it_is_split(pipe, long_run, split):
    """Three windows of text pushed into `speech_session` in pieces (one character at a time among them): cut
    into the segments of the whole text as it comes, it gives `speech(whole text)`'s codes and segments and
    `stream_speech`'s chunks, bit for bit; and the first segments speak before the text is complete."""
    chunks, expected = long_run
    pieces = _pieces(LONG_TEXT, STREAM_SPLITS[split])
    half = sum(len(piece) for piece in pieces[: len(pieces) // 2 + 1])
    got, early = [], 0
    with pipe.speech_session(seed=SEED, sampling=QWEN3_TTS_SAMPLING) as session:
        for piece in pieces:
            got += session.push(piece)
            if len(session.text) <= half:
                early = len(got)
        got += session.finish()
        output = session.output
    assert output.segment_frames == expected.segment_frames and len(output.segment_frames) == len(SENTENCES)
    assert torch.equal(output.codes, expected.codes)
    assert np.array_equal(output.audio, expected.audio)
    assert len(got) == len(chunks) and all(np.array_equal(a, b) for a, b in zip(got, chunks, strict=True))
    if split != "whole":
        assert early > 0  # audio of the first segments came while the text was still being written


def test_a_segment_whose_talker_ends_early_skips_the_rest_of_its_text(pipe):
    """At a frame cap below a segment's text rows the talker ends each segment early ("length"): the rest of
    its text is skipped and the next segment starts, as in `speech` on the whole text, also when the text
    arrives in pieces (a segment's end comes after its talker has ended)."""
    text = " ".join(SENTENCES[:4])
    capped = OmniPipeline(family=pipe.family, max_frames=3, max_segment_tokens=MAX_SEGMENT_TOKENS)
    whole = capped.speech(text, seed=SEED, sampling=QWEN3_TTS_SAMPLING)
    assert len(whole.segment_frames) == 4 and whole.finish_reason == "length"
    with capped.speech_session(seed=SEED, sampling=QWEN3_TTS_SAMPLING) as session:
        for character in text:
            session.push(character)
        session.finish()
    assert torch.equal(session.output.codes, whole.codes) and session.output.segment_frames == whole.segment_frames
    assert session.output.finish_reason == "length"
