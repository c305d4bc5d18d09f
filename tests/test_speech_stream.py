"""Text streamed into speech: ids committed only once later text cannot change them, a talker that waits for the
text rows it has not got, the Python session and `/v1/audio/speech/stream`.

The guarantee under test: the audio does not depend on how the text was split or when it arrived. A seeded
request whose text comes in pieces gives the codes of the whole text and the streamed chunks of
`OmniPipeline.stream_speech` (the PCM bytes of `/v1/audio/speech`), bit for bit, on audible audio."""

from __future__ import annotations

import inspect
import unicodedata
from dataclasses import replace

import numpy as np
import pytest
import torch
from audio_checks import assert_audible
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from omnimtp.engine.core import EngineCore
from omnimtp.engine.request import Request, Status
from omnimtp.families.qwen3_tts import QWEN3_TTS_SAMPLING
from omnimtp.handoff import assemble_talker_chunks
from omnimtp.pipeline import OmniPipeline
from omnimtp.tokenizer import QWEN2_SPLIT_PATTERN, StreamedTextIds

pytestmark = pytest.mark.usefixtures("one_torch_thread")

FRAMES = 28
TEXT = "Hi, tiny voice: 12 日本!"  # 26 bytes: the talker speaks every row within FRAMES


@pytest.fixture(scope="module")
def tts():
    return OmniPipeline.tiny(family="qwen3_tts", max_frames=FRAMES)


@pytest.fixture(scope="module")
def omni():
    return OmniPipeline.tiny(max_frames=FRAMES)


@pytest.fixture(scope="module")
def omni2_5():
    return OmniPipeline.tiny(family="qwen2_5", max_frames=FRAMES)


# --- ids: a split never changes them ----------------------------------------------------------------------

# Characters where tokenizers cut, merge or normalize: letters, digits, spaces and newlines, punctuation, CJK,
# a combining accent (NFC joins it to its letter), and pieces of special tokens and role words.
PIECES = st.sampled_from(["a", "b", "e", "Z", "x", "1", "7", " ", "  ", "\n", "\t", ",", ".", "!", "'", "'s", "<",
                          "|", ">", "_", "日", "本", "語", "\u0301", "é", "<|im_end|>", "<|im_", "end|>",
                          "<|im_start|>", "assistant", "assist", "ant", "user", "s", "😀"])
TEXTS = st.lists(PIECES, min_size=1, max_size=14).map("".join)


def _splits(text: str, cuts: list[int]) -> list[str]:
    points = sorted({min(c, len(text)) for c in cuts})
    return [text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=True)]


def _streamed(text_ids: StreamedTextIds, pieces: list[str]) -> list[int]:
    ids = []
    for piece in pieces:
        ids += text_ids.push(piece)
    return ids + text_ids.finish()


def _qwen2_style_tokenizer() -> Tokenizer:
    """A byte-level BPE with Qwen2's normalizer (NFC), pre-tokenizer and specials, trained on a little text: the
    merges, NFC and the regex a released Qwen tokenizer applies, which the tiny byte tokenizer lacks."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    corpus = [
        "Hello there, the assistant said: 12 apples and 7 bananas! It's éa, e\u0301b.\n\n", "日本語の本 user x  y"
    ] * 20
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|im_start|>", "<|im_end|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    return tokenizer


QWEN2_STYLE = _qwen2_style_tokenizer()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=TEXTS, cuts=st.lists(st.integers(0, 60), max_size=8))
@example(text="1assistant<|im_end|>", cuts=[])  # "assistant" matches as a whole word only: not after "1"
@example(text="1assistant<|im_end|>", cuts=[1, 4])
def test_streamed_ids_are_the_whole_texts_ids(tts, omni, text, cuts):
    """Any split of any text: the pieces' ids joined == the ids of the whole text, for the tiny Qwen3-TTS tokenizer
    (specials read inside the template), the tiny Qwen3-Omni one (specials read as text) and a Qwen2-style BPE."""
    pieces = _splits(text, cuts)
    if text.strip():
        assert _streamed(tts.family.speech_text_ids(), pieces) == tts.family.speech_ids(text)
        assert _streamed(omni.family.speech_text_ids(), pieces) == omni.family.speech_ids(text)
    head, tail = "<|im_start|>assistant\n", "<|im_end|>\n"
    expected = QWEN2_STYLE.encode(head + text + tail, add_special_tokens=False).ids
    assert _streamed(StreamedTextIds(QWEN2_STYLE, head=head, tail=tail), pieces) == expected


def test_ids_are_committed_a_word_behind_and_held_at_a_possible_special(tts):
    text_ids = StreamedTextIds(QWEN2_STYLE)
    assert text_ids.push("Hello th") == QWEN2_STYLE.encode("Hello").ids  # " th" may still grow
    assert text_ids.push("ere, x<|im_") == QWEN2_STYLE.encode(" there,").ids  # " x" and what may become <|im_end|>
    assert text_ids.push("end|> y") == QWEN2_STYLE.encode(" x<|im_end|>").ids
    assert text_ids.finish() == QWEN2_STYLE.encode(" y").ids
    assert unicodedata.normalize("NFC", "e\u0301") == "é"
    accented = StreamedTextIds(QWEN2_STYLE)
    assert accented.push("ae") + accented.push("\u0301b c") + accented.finish() == QWEN2_STYLE.encode("ae\u0301b c").ids


def test_the_tiny_tokenizer_still_gives_bytes(tts):
    text = "Hello, wörld 12  日本\n\n x"
    ids = tts.family.tokenizer.encode(text, add_special_tokens=False)
    assert ids == list(text.encode("utf-8"))


# --- talker inputs: the rows of a split text are the whole text's rows ------------------------------------------


@pytest.mark.parametrize("kind", ["tts", "omni", "omni2_5"])
def test_streamed_talker_inputs_are_the_whole_texts_bit_for_bit(tts, omni, omni2_5, kind):
    """`SpeechTextStream`'s chunks joined == `speech_talker_inputs` of all the ids (prefill, every trailing row,
    the end rows), for several splits of the ids, each row's bits included."""
    pipe = {"tts": tts, "omni": omni, "omni2_5": omni2_5}[kind]
    family = pipe.family
    speaker = family.voice("aiden", "english") if kind == "tts" else family.default_speaker
    ids = family.speech_ids(TEXT)
    whole = family.speech_talker_inputs(ids, speaker)
    num_spoken = len(ids) - len(family.speech_stream(speaker).closing_ids)  # a template's tail comes at the end
    for cuts in ([], [4], [5, 6, 7, 20], list(range(1, num_spoken))):
        stream = family.speech_stream(speaker)
        bounds = [0, *cuts, len(ids)]
        chunks = [chunk for a, b in zip(bounds, bounds[1:], strict=False)
                  for chunk in stream.push(ids[a:b], b == len(ids))]
        joined = assemble_talker_chunks(chunks)
        assert (len(chunks) > 2) == (len(cuts) > 2)
        for name in ("prefill_embeds", "prefill_ids", "trailing_text", "tts_pad_embed"):
            assert torch.equal(getattr(joined, name), getattr(whole, name)), name


# --- the engine: a talker that waits for its text ------------------------------------------------------------


def _request(family, voice, *, seed=None, sampling=None, request_id=0) -> Request:
    return Request(request_id, [], max_new_tokens=1, max_frames=FRAMES, speaker=voice, talker_sampling=sampling,
                   seed=seed, is_chat=False, is_text_finished=False)


def test_a_request_waits_for_its_next_text_row_while_others_speak(tts):
    """Mid-text the request's talker row does not step (no padding row is fed): its frames stop at the rows it
    has, the engine says it has no ready work, and a whole-text request in the same batch goes on speaking."""
    family = tts.family
    core = EngineCore(family, tts.config)
    voice = family.voice("aiden", "english")
    streamed = _request(family, voice)
    core.add(streamed)
    text_ids = family.speech_text_ids()
    ids = text_ids.push("Hello there ")  # head (3) + "Hello" + " there": the first id is in the prefill
    core.push_speech_ids(0, ids, is_finished=False)
    while core.has_ready_work():
        list(core.step())
    num_rows = len(ids) - 4  # every committed id after the first is one trailing row
    assert len(streamed.frames) == num_rows  # one frame per trailing row (the prefill samples its code 0)
    other = Request(1, family.speech_ids(TEXT), max_new_tokens=1, max_frames=FRAMES, speaker=voice, is_chat=False)
    core.add(other)
    for _ in range(5):
        list(core.step())
    assert len(streamed.frames) == num_rows and len(other.frames) == 5
    core.push_speech_ids(0, text_ids.finish(), is_finished=True)
    while core.has_work():
        list(core.step())
    whole = tts.speech("Hello there ", voice="aiden", language="english")
    assert torch.equal(core.output(streamed).codes, whole.codes)


def test_requests_waiting_for_text_hold_no_slot(tts):
    """At max_batch_size 1: a request with no text ids yet is not admitted, one whose talker spoke all its text so
    far is parked (its talker state out of the batch), so a whole-text request runs meanwhile; then the parked one
    resumes and speaks the whole text's codes, and the other's are its codes alone."""
    family = tts.family
    core = EngineCore(family, replace(tts.config, max_batch_size=1))
    voice = family.voice("aiden", "english")
    silent, streamed = _request(family, voice, request_id=0), _request(family, voice, request_id=1)
    core.add(silent)
    core.add(streamed)
    text_ids = family.speech_text_ids()
    core.push_speech_ids(1, text_ids.push("Hello there "), is_finished=False)
    while core.has_ready_work():
        list(core.step())
    assert silent.status is Status.WAITING and streamed.is_parked and streamed.frames
    assert streamed.parked_talker is not None and core.talker.request_ids == []
    other = Request(2, family.speech_ids(TEXT), max_new_tokens=1, max_frames=FRAMES, speaker=voice, is_chat=False)
    core.add(other)
    for _ in range(4 * FRAMES):
        if other.status is Status.FINISHED:
            break
        list(core.step())
    assert other.status is Status.FINISHED and streamed.is_parked and silent.status is Status.WAITING
    core.push_speech_ids(1, text_ids.finish(), is_finished=True)
    core.abort(0)
    while core.has_work():
        list(core.step())
    whole = tts.speech("Hello there ", voice="aiden", language="english")
    assert torch.equal(core.output(streamed).codes, whole.codes)
    assert torch.equal(core.output(other).codes, tts.speech(TEXT, voice="aiden", language="english").codes)


def test_a_request_parked_before_its_first_audio_does_not_hold_back_background_work(tts):
    """A request whose talker spoke all its text so far before its first audio chunk waits for text, not for the
    engine: a background request (which waits while a first audio is due) is admitted and finishes meanwhile."""
    family = tts.family
    core = EngineCore(family, replace(tts.config, first_chunk_frames=8))
    voice = family.voice("aiden", "english")
    streamed = _request(family, voice)
    core.add(streamed)
    core.push_speech_ids(0, family.speech_text_ids().push("Hi "), is_finished=False)
    while core.has_ready_work():
        list(core.step())
    assert streamed.is_parked and streamed.frames and streamed.first_audio_at is None
    background = Request(1, family.speech_ids(TEXT), max_new_tokens=1, max_frames=4, speaker=voice, is_chat=False,
                         is_background=True)
    core.add(background)
    for _ in range(20):
        if background.status is Status.FINISHED:
            break
        list(core.step())
    assert background.status is Status.FINISHED and len(background.frames) == 4 and streamed.is_parked
    core.abort(0)


def test_abort_frees_a_parked_request(tts):
    family = tts.family
    core = EngineCore(family, tts.config)
    request = _request(family, family.voice("aiden"))
    core.add(request)
    core.push_speech_ids(0, family.speech_text_ids().push("Hello there "), is_finished=False)
    while core.has_ready_work():
        list(core.step())
    assert request.is_parked and request.parked_talker is not None and core.talker.request_ids == []
    core.abort(0)
    assert not core.has_work() and request.parked_talker is None
    assert core.push_speech_ids(0, [1], is_finished=True) is False


def test_a_failed_step_fails_parked_requests_too(tts):
    """A step that raises: `fail_running` returns the parked request with the running one (so the driver fails
    both and neither client waits forever), frees its talker state, and leaves a request still waiting for its
    first text queued."""
    family = tts.family
    core = EngineCore(family, tts.config)
    voice = family.voice("aiden")
    parked, silent = _request(family, voice, request_id=0), _request(family, voice, request_id=1)
    core.add(parked)
    core.add(silent)
    core.push_speech_ids(0, family.speech_text_ids().push("Hello there "), is_finished=False)
    while core.has_ready_work():
        list(core.step())
    assert parked.is_parked and parked.parked_talker is not None
    running = Request(2, family.speech_ids(TEXT), max_new_tokens=1, max_frames=FRAMES, speaker=voice, is_chat=False)
    core.add(running)
    list(core.step())
    assert running.is_in_talker

    def broken_forward(taken):
        raise RuntimeError("a model error")

    core.talker.advance = broken_forward  # the talker forward of a step fails
    with pytest.raises(RuntimeError, match="a model error"):
        list(core.step())
    failed = core.fail_running()
    assert sorted(r.request_id for r in failed) == [0, 2]
    assert all(r.status is Status.ABORTED and not r.is_parked and r.parked_talker is None for r in failed)
    assert list(core.waiting) == [silent] and not core.running and core.talker.request_ids == []


# --- the Python session ----------------------------------------------------------------------------------------

SPLITS = [
    [TEXT],
    [TEXT[:1], TEXT[1:7], TEXT[7:8], TEXT[8:23], TEXT[23:]],
    [TEXT[i : i + 3] for i in range(0, len(TEXT), 3)],
]


def _session_audio(pipe, pieces, **kwargs):
    with pipe.speech_session(**kwargs) as session:
        chunks = [chunk for piece in pieces for chunk in session.push(piece)]
        chunks += session.finish()
        return chunks, session.output


@pytest.mark.parametrize("sampled", [False, True])
def test_session_equals_stream_speech_however_the_text_is_split(tts, sampled):
    kwargs = {"voice": "vivian", "language": "english", "seed": 11,
              "sampling": QWEN3_TTS_SAMPLING if sampled else None}
    *expected, output = list(tts.stream_speech(TEXT, **kwargs))
    assert_audible(np.concatenate(expected))
    assert torch.equal(output.codes, tts.speech(TEXT, **kwargs).codes)
    for pieces in SPLITS:
        chunks, session_output = _session_audio(tts, pieces, **kwargs)
        assert len(chunks) == len(expected)
        assert all(np.array_equal(a, b) for a, b in zip(chunks, expected, strict=True))
        assert torch.equal(session_output.codes, output.codes)
        assert np.array_equal(session_output.audio, output.audio)


@pytest.mark.parametrize("kind", ["omni", "omni2_5"])
def test_omni_session_equals_the_whole_text_however_it_is_split(omni, omni2_5, kind):
    """Qwen3-Omni's and Qwen2.5-Omni's speech path (the text spoken as a reply): the codes and chunks of the
    whole text (as the engine speaks a whole-text speech request) for every split."""
    omni = omni if kind == "omni" else omni2_5
    whole_chunks, whole = _session_audio(omni, [TEXT], voice=None, seed=3)
    assert_audible(whole.audio)
    ids = omni.family.speech_ids(TEXT)
    core = EngineCore(omni.family, omni.config)
    core.add(Request(0, ids, max_new_tokens=1, max_frames=FRAMES, speaker=omni.family.default_speaker, seed=3,
                     is_chat=False))
    while core.has_work():
        for event in core.step():
            if event.is_finished:
                plain = core.output(event.request)
    assert torch.equal(plain.codes, whole.codes) and np.array_equal(plain.audio, whole.audio)
    for pieces in SPLITS[1:] if kind == "omni" else SPLITS[2:]:
        chunks, output = _session_audio(omni, pieces, seed=3)
        assert torch.equal(output.codes, whole.codes)
        assert len(chunks) == len(whole_chunks)
        assert all(np.array_equal(a, b) for a, b in zip(chunks, whole_chunks, strict=True))


def test_session_bad_input(tts, omni):
    with pytest.raises(ValueError, match="voice: unknown voice"):
        tts.speech_session(voice="nobody")
    with pytest.raises(ValueError, match="language: this model takes no language"):
        omni.speech_session(language="english")
    with pytest.raises(ValueError, match="speaker"):
        omni.speech_session(voice="nobody")
    session = tts.speech_session()
    with pytest.raises(ValueError, match="text: expected a string"):
        session.push(3)
    session.push("  ")
    with pytest.raises(ValueError, match="text: empty text"):
        session.finish()
    session.push("Hi there")
    session.finish()
    assert session.is_finished
    with pytest.raises(ValueError, match="text: the session's text is finished"):
        session.push("more")


def test_a_session_silent_past_its_text_idle_timeout_ends(tts):
    """`speech_session(text_idle_timeout=...)`: text that keeps coming within it is spoken as usual (a piece with
    no settled ids still counts as text); after a longer pause the next push raises TimeoutError naming it, the
    request is dropped (its parked talker state freed) and the session is closed."""
    import time

    from omnimtp.limits import DEFAULT_TIMEOUT_TEXT_IDLE_S

    assert inspect.signature(tts.speech_session).parameters["text_idle_timeout"].default == DEFAULT_TIMEOUT_TEXT_IDLE_S
    for value in (0, -1.0, float("nan"), True, "1"):
        with pytest.raises(ValueError, match="text_idle_timeout"):
            tts.speech_session(text_idle_timeout=value)
    session = tts.speech_session(voice="aiden", text_idle_timeout=0.3)
    session.push("Hello there you ")
    request = session._request
    assert request.is_parked and request.parked_talker is not None
    for _ in range(3):
        time.sleep(0.2)
        session.push("a")  # no settled ids (a word still being written), but text came
    time.sleep(0.5)
    with pytest.raises(TimeoutError, match="text_idle_timeout: no text came for 0.3 s"):
        session.push(" more")
    assert not session._core.has_work() and request.parked_talker is None and not session.is_finished
    with pytest.raises(ValueError, match="closed"):
        session.finish()


# --- /v1/audio/speech/stream ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def servers():
    from server_harness import running_server

    from omnimtp.families.qwen3_omni import Qwen3OmniFamily
    from omnimtp.families.qwen3_tts import Qwen3TTSFamily
    from omnimtp.server.app import create_app
    from omnimtp.server.scheduler import Engine

    engines = {"tts": Engine(Qwen3TTSFamily.tiny(0), model_id="tts", max_frames=FRAMES, max_batch_size=4),
               "omni": Engine(Qwen3OmniFamily.tiny(0), model_id="omni", max_frames=FRAMES, max_batch_size=4)}
    with running_server(create_app(engines["tts"])) as tts_url, running_server(create_app(engines["omni"])) as omni_url:
        yield {"tts": tts_url, "omni": omni_url, "engines": engines}


def _ws(servers, kind):
    from websockets.sync.client import connect

    return connect(servers[kind].replace("http://", "ws://") + "/v1/audio/speech/stream", open_timeout=30)


def _recv(ws) -> dict:
    import json

    return json.loads(ws.recv(timeout=120))


def _send(ws, event: dict) -> None:
    import json

    ws.send(json.dumps(event))


def _stream_pcm(ws, pieces, config: dict | None = None, delay_s: float = 0.0) -> tuple[bytes, dict]:
    """One request on an open session: its audio deltas joined, and its done event."""
    import base64
    import time

    if config is not None:
        _send(ws, {"type": "session.config", **config})
        assert _recv(ws)["type"] == "session.configured"
    for piece in pieces:
        _send(ws, {"type": "input_text.delta", "delta": piece})
        time.sleep(delay_s)
    _send(ws, {"type": "input_text.done"})
    audio = b""
    while (event := _recv(ws))["type"] == "audio.delta":
        audio += base64.b64decode(event["delta"])
    assert event["type"] == "done", event
    return audio, event


def _http_pcm(servers, kind, text, **fields) -> bytes:
    import httpx

    response = httpx.post(servers[kind] + "/v1/audio/speech", timeout=300,
                          json={"input": text, "response_format": "pcm", **fields})
    assert response.status_code == 200, response.text
    return response.content


def test_split_text_with_delays_gives_the_pcm_of_v1_audio_speech(servers):
    config = {"voice": "vivian", "language": "english", "seed": 5}
    expected = _http_pcm(servers, "tts", TEXT, **config)
    assert_audible(np.frombuffer(expected, dtype=np.int16))
    with _ws(servers, "tts") as ws:
        for pieces, delay in zip(SPLITS, (0.0, 0.05, 0.01), strict=True):
            audio, done = _stream_pcm(ws, pieces, config, delay)
            assert audio == expected
            assert (done["usage"]["output_tokens"] == len(expected) // 2 // 1920
                    and done["finish_reason"] in ("stop", "length"))
    omni_expected = _http_pcm(servers, "omni", TEXT, voice="ethan", seed=2)
    assert_audible(np.frombuffer(omni_expected, dtype=np.int16))
    with _ws(servers, "omni") as ws:
        for pieces, delay in zip(SPLITS, (0.0, 0.02, 0.0), strict=True):
            assert _stream_pcm(ws, pieces, {"voice": "ethan", "seed": 2}, delay)[0] == omni_expected


def test_concurrent_sessions_and_a_plain_request_give_their_bytes_alone(servers):
    import threading

    texts = [TEXT, "Short one, then more.", "日本語 and digits 123.", "Another, longer line of text."]
    expected = [_http_pcm(servers, "tts", text, voice="aiden", seed=i, temperature=0.9) for i, text in enumerate(texts)]
    results: dict = {}

    def session(i):
        with _ws(servers, "tts") as ws:
            text = texts[i]
            pieces = [text[j : j + 1 + i] for j in range(0, len(text), 1 + i)]
            results[i] = _stream_pcm(ws, pieces, {"voice": "aiden", "seed": i, "temperature": 0.9}, 0.005)[0]

    def plain():
        results["http"] = _http_pcm(servers, "tts", texts[0], voice="aiden", seed=0, temperature=0.9)

    threads = ([threading.Thread(target=session, args=(i,)) for i in range(len(texts))]
               + [threading.Thread(target=plain)])
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    for i, pcm in enumerate(expected):
        assert_audible(np.frombuffer(pcm, dtype=np.int16))
        assert results[i] == pcm
    assert results["http"] == expected[0]


BAD_EVENTS = [
    ({"type": "input_text.delta"}, "delta", "missing_required_parameter"),
    ({"type": "input_text.delta", "delta": 3}, "delta", "invalid_value"),
    ({"type": "input_text.done"}, "type", "invalid_value"),
    ({"type": "response.create"}, "type", "invalid_event"),
    ({"type": "session.config", "voice": "nobody"}, "voice", "invalid_value"),
    ({"type": "session.config", "language": "klingon"}, "language", "invalid_value"),
    ({"type": "session.config", "response_format": "wav"}, "response_format", "invalid_value"),
    ({"type": "session.config", "input": "hi"}, "input", "unknown_parameter"),
    ({"type": "session.config", "seed": "1"}, "seed", "invalid_value"),
    ({"type": "session.config", "model": "other"}, "model", "model_not_found"),
]


def test_bad_events_get_error_events_and_the_session_goes_on(servers):
    with _ws(servers, "tts") as ws:
        for i, (event, param, code) in enumerate(BAD_EVENTS):
            _send(ws, {**event, "event_id": f"evt_{i}"})
            error = _recv(ws)
            assert error["type"] == "error" and error["error"]["param"] == param and error["error"]["code"] == code
            assert error["error"]["event_id"] == f"evt_{i}"
        audio, _ = _stream_pcm(ws, ["Hi there"], {"voice": "aiden", "seed": 1})
        assert audio == _http_pcm(servers, "tts", "Hi there", voice="aiden", seed=1)


def test_text_over_the_limit_and_events_during_a_request(servers):
    with _ws(servers, "tts") as ws:
        _send(ws, {"type": "session.config", "voice": "aiden", "seed": 4})
        assert _recv(ws)["session"] == {"voice": "aiden", "seed": 4, "speed": 1.0, "response_format": "pcm"}
        _send(ws, {"type": "input_text.delta", "delta": "Hello "})
        _send(ws, {"type": "input_text.delta", "delta": "x" * 4096})
        error = _recv(ws)
        assert error["error"]["param"] == "delta" and error["error"]["code"] == "string_above_max_length"
        _send(ws, {"type": "session.config", "voice": "eric"})
        assert _recv(ws)["error"]["code"] == "request_in_progress"
        audio, _ = _stream_pcm(ws, ["there"])
        assert audio == _http_pcm(servers, "tts", "Hello there", voice="aiden", seed=4)


def test_a_text_of_exactly_the_limit_is_taken_and_one_character_more_is_not(servers):
    from omnimtp.server.schemas import MAX_SPEECH_INPUT_CHARS

    with _ws(servers, "omni") as ws:  # the tiny TTS talker's positions end before 4,096 characters do
        _send(ws, {"type": "session.config", "voice": "ethan"})
        _recv(ws)
        _send(ws, {"type": "input_text.delta", "delta": "Hi " + "x" * (MAX_SPEECH_INPUT_CHARS - 3), "event_id": "at"})
        _send(ws, {"type": "input_text.delta", "delta": "y", "event_id": "over"})
        # events answer in order, so the first error is the first delta's, if it was refused; the speech of
        # 4,096 characters is not waited for (the closed socket cancels it)
        while (event := _recv(ws))["type"] != "error":
            assert event["type"] == "audio.delta", event
        assert (event["error"]["event_id"], event["error"]["code"]) == ("over", "string_above_max_length")


def test_a_streamed_text_longer_than_a_segment_gives_the_bytes_of_v1_audio_speech(servers):
    """The talker's positions hold each segment of a streamed text, as they hold a whole text's: a text of
    several segments (the server's 150-token budget) sent in pieces is spoken end to end, as /v1/audio/speech
    speaks it; only the prompt-token limit applies to the whole text (an error naming `delta`)."""
    from omnimtp.server.requests import EngineRequest

    engine = servers["engines"]["tts"]
    text = " ".join(f"Sentence {i} is here." for i in range(20))
    request = EngineRequest(messages=None, speak_text=text, speaker=engine.family.voice(),
                            sampling=QWEN3_TTS_SAMPLING, seed=None, max_new_tokens=0)
    assert len(list(engine.speech_segments(request))) == 3  # what /v1/audio/speech speaks
    with _ws(servers, "tts") as ws:
        _send(ws, {"type": "session.config", "voice": "aiden", "seed": 5})
        _recv(ws)
        audio, done = _stream_pcm(ws, [text[:7], text[7:200], text[200:]])
    assert done["usage"]["input_tokens"] == sum(len(ids) for ids in engine.speech_segments(request))
    assert audio == _http_pcm(servers, "tts", text, voice="aiden", seed=5)
    with _ws(servers, "tts") as ws:
        _send(ws, {"type": "session.config", "voice": "aiden", "seed": 5})
        _recv(ws)
        _send(ws, {"type": "input_text.delta", "delta": "日" * 3000})  # 9,000 byte ids: over the 8,192 of a prompt
        error = _recv(ws)["error"]
    assert error["param"] == "delta" and error["code"] == "string_above_max_length" and "8192" in error["message"]


def test_whitespace_then_done_frees_the_request(servers):
    import time

    engine = servers["engines"]["tts"]
    with _ws(servers, "tts") as ws:
        _send(ws, {"type": "session.config", "voice": "aiden", "seed": 6})
        _recv(ws)
        _send(ws, {"type": "input_text.delta", "delta": "  \n "})
        _send(ws, {"type": "input_text.done"})
        assert _recv(ws)["error"]["code"] == "invalid_value"
        deadline = time.monotonic() + 30
        while (engine._core.running or engine._core.waiting) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not engine._core.running and not engine._core.waiting
        audio, _ = _stream_pcm(ws, ["Hi there"])  # the session goes on with a new request
        assert audio == _http_pcm(servers, "tts", "Hi there", voice="aiden", seed=6)


def test_a_disconnect_mid_request_frees_the_slot(servers):
    import time

    engine = servers["engines"]["tts"]
    with _ws(servers, "tts") as ws:
        _send(ws, {"type": "session.config", "voice": "aiden"})
        _recv(ws)
        _send(ws, {"type": "input_text.delta", "delta": "Hello there, a text that never ends "})
        assert _recv(ws)["type"] == "audio.delta"
        assert len(engine._core.running) == 1
    deadline = time.monotonic() + 30
    while engine._core.running and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not engine._core.running and not engine._core.talker.rows


def test_the_non_streaming_layout_waits_for_the_whole_text():
    """`non_streaming_mode` puts the text in the prefill: nothing goes to the talker before the text is done."""
    from omnimtp.families.qwen3_tts import Qwen3TTSFamily

    family = Qwen3TTSFamily.tiny(0, non_streaming_mode=True)
    voice = family.voice("aiden")
    ids = family.speech_ids(TEXT)
    stream = family.speech_stream(voice)
    assert stream.push(ids[:10]) == [] and stream.push(ids[10:-5]) == []
    [chunk] = stream.push(ids[-5:], is_finished=True)
    whole = family.speech_talker_inputs(ids, voice)
    assert chunk.is_finished and torch.equal(chunk.prefill_embeds, whole.prefill_embeds)
    assert chunk.trailing_text.shape[0] == 0 == whole.trailing_text.shape[0]


# --- sessions waiting for text: no slot held, and a bound on the wait -------------------------------------------

TEXT_IDLE_S = 1.0


@pytest.fixture(scope="module")
def slot_server():
    from server_harness import running_server

    from omnimtp.families.qwen3_tts import Qwen3TTSFamily
    from omnimtp.server.app import create_app
    from omnimtp.server.scheduler import Engine

    engine = Engine(Qwen3TTSFamily.tiny(0), model_id="tts", max_frames=FRAMES, max_batch_size=2,
                    timeout_text_idle=TEXT_IDLE_S)
    with running_server(create_app(engine)) as url:
        yield {"tts": url, "engine": engine}


def test_sessions_trickling_text_do_not_hold_up_a_plain_request(slot_server):
    """Two sessions fill both slots' worth of requests and then trickle a character every 0.1 s (their requests
    wait for text between characters); a plain POST /v1/audio/speech meanwhile is served as if they were not
    there: well within a bound far above its time alone (seconds on the tiny model), and with its bytes alone."""
    import threading
    import time

    import httpx

    config = {"voice": "aiden", "seed": 3}
    expected = _http_pcm(slot_server, "tts", TEXT, **config)
    assert_audible(np.frombuffer(expected, dtype=np.int16))
    is_served, num_open = threading.Event(), threading.Semaphore(0)

    def trickle():
        with _ws(slot_server, "tts") as ws:
            _send(ws, {"type": "session.config", **config})  # a seed whose talker speaks on (no codec EOS)
            _recv(ws)
            _send(ws, {"type": "input_text.delta", "delta": "Hello there "})
            num_open.release()
            deadline = time.monotonic() + 60
            while not is_served.is_set() and time.monotonic() < deadline:
                _send(ws, {"type": "input_text.delta", "delta": "a"})
                time.sleep(0.1)

    sessions = [threading.Thread(target=trickle) for _ in range(2)]
    for thread in sessions:
        thread.start()
    try:
        for _ in sessions:
            assert num_open.acquire(timeout=60)
        time.sleep(0.5)  # their first text is spoken: they wait for more
        started = time.monotonic()
        response = httpx.post(slot_server["tts"] + "/v1/audio/speech", timeout=30,
                              json={"input": TEXT, "response_format": "pcm", **config})
        elapsed = time.monotonic() - started
    finally:
        is_served.set()
        for thread in sessions:
            thread.join(60)
    assert response.status_code == 200 and response.content == expected
    assert elapsed < 20, elapsed


def test_a_session_silent_past_the_text_timeout_ends_its_request(slot_server):
    """A request that waits for text longer than --timeout-text-idle ends with an error event naming it, its slot
    and talker state are freed, and the session's next delta starts a request that speaks as /v1/audio/speech."""
    import json
    import threading
    import time

    import httpx

    def poll_metrics(gauges: list, done: threading.Event) -> None:
        while not done.is_set():
            text = httpx.get(slot_server["tts"] + "/metrics", timeout=10).text
            gauges.append({name: float(line.split()[-1]) for line in text.splitlines()
                           for name in ("omnimtp_parked_requests", "omnimtp_active_requests", "omnimtp_queue_depth")
                           if line.startswith(name + " ")})
            time.sleep(0.02)

    engine = slot_server["engine"]
    with _ws(slot_server, "tts") as ws:
        _send(ws, {"type": "session.config", "voice": "aiden", "seed": 3})
        _recv(ws)
        for first in ("Hello there ", " "):  # spoken and then waiting; or no ids yet (never admitted)
            # while it waits it is parked or queued, never counted as holding a slot
            gauges, done = [], threading.Event()
            poller = threading.Thread(target=poll_metrics, args=(gauges, done))
            _send(ws, {"type": "input_text.delta", "delta": first})
            started = time.monotonic()
            poller.start()
            while (event := json.loads(ws.recv(timeout=30)))["type"] == "audio.delta":
                pass
            waited = time.monotonic() - started
            done.set()
            poller.join(30)
            assert any(g["omnimtp_parked_requests"] + g["omnimtp_queue_depth"] == 1
                       and g["omnimtp_active_requests"] == 0 for g in gauges), gauges
            assert event["type"] == "error" and event["error"]["code"] == "timeout_text_idle", event
            assert event["error"]["type"] == "invalid_request_error"  # the client's pause, not a server error
            assert "--timeout-text-idle" in event["error"]["message"] and TEXT_IDLE_S <= waited < 30
            assert not engine._core.running and not engine._core.waiting and not engine._core.talker.rows
        audio, _ = _stream_pcm(ws, ["Hi there"])
        assert audio == _http_pcm(slot_server, "tts", "Hi there", voice="aiden", seed=3)


@pytest.mark.parametrize("value", [0, -1.0, float("nan"), float("inf"), True, "1"])
def test_the_text_timeout_is_a_positive_number(slot_server, value):
    from omnimtp.cli import build_parser
    from omnimtp.limits import DEFAULT_TIMEOUT_TEXT_IDLE_S
    from omnimtp.server.scheduler import Engine

    with pytest.raises(ValueError, match="timeout_text_idle"):
        Engine(slot_server["engine"].family, timeout_text_idle=value)
    assert build_parser().parse_args(["serve"]).timeout_text_idle == DEFAULT_TIMEOUT_TEXT_IDLE_S
    assert build_parser().parse_args(["serve", "--timeout-text-idle", "0.5"]).timeout_text_idle == 0.5


def _health_latencies(url: str, stop) -> list[float]:
    """`/health`'s response times, polled back to back until `stop` is set (call in a thread)."""
    import time

    import httpx

    latencies = []
    with httpx.Client(base_url=url, timeout=60) as http:
        while not stop.is_set():
            started = time.perf_counter()
            assert http.get("/health").status_code == 200
            latencies.append(time.perf_counter() - started)
            time.sleep(0.01)
    return latencies


def test_a_burst_of_tiny_deltas_does_not_hold_up_the_server(servers, monkeypatch):
    """2,000 one-character deltas sent at once: `/health` answers within a bound far below the burst's work with
    every buffered event run without a yield and each delta re-tokenizing the whole text (seconds),
    the text is tokenized once per batch of deltas that arrived together, not once per delta, and the deltas are
    taken in order (an event after them is answered after them)."""
    import threading
    import time

    engine = servers["engines"]["tts"]
    checks, check_speech_text = [], engine.check_speech_text
    monkeypatch.setattr(engine, "check_speech_text", lambda text, name: checks.append(1) or check_speech_text(
        text, name))
    stop, result = threading.Event(), {}
    poller = threading.Thread(target=lambda: result.setdefault("latencies", _health_latencies(servers["tts"], stop)))
    with _ws(servers, "tts") as ws:
        _send(ws, {"type": "session.config", "voice": "aiden"})
        _recv(ws)
        poller.start()
        time.sleep(0.2)
        started = time.perf_counter()
        for _ in range(1000):
            _send(ws, {"type": "input_text.delta", "delta": "a"})
            _send(ws, {"type": "input_text.delta", "delta": " "})
        _send(ws, {"type": "session.config", "voice": "eric", "event_id": "last"})  # refused: a request runs
        while (event := _recv(ws))["type"] == "audio.delta":
            pass
        elapsed = time.perf_counter() - started
        stop.set()
        poller.join(60)
    assert event["type"] == "error" and event["error"]["event_id"] == "last", event
    latencies = result["latencies"]
    print(f"burst taken in {elapsed:.2f} s in {len(checks)} batches; /health max {max(latencies) * 1e3:.0f} ms over "
          f"{len(latencies)} polls")
    assert max(latencies) < 1.0, max(latencies)
    assert len(checks) < 200, len(checks)  # the deltas came in far fewer batches than 2,000
    assert elapsed < 6.0, elapsed  # a few tokenizations of the text, not 2,000 of a growing one (9-13 s here)


def test_sessions_waiting_for_their_first_words_do_not_fill_the_queue():
    """--max-queue 1 and three sessions whose requests wait for their first words (whitespace has no ids yet): they
    hold nothing another request needs, so a fourth session and a plain request are still served, not 429."""
    import httpx
    from server_harness import running_server

    from omnimtp.families.qwen3_tts import Qwen3TTSFamily
    from omnimtp.server.app import create_app
    from omnimtp.server.scheduler import Engine

    engine = Engine(Qwen3TTSFamily.tiny(0), model_id="tts", max_frames=FRAMES, max_batch_size=1)
    with running_server(create_app(engine, max_queue=1)) as url:
        server = {"tts": url}
        idle = [_ws(server, "tts") for _ in range(3)]
        try:
            for ws in idle:
                _send(ws, {"type": "session.config", "voice": "aiden"})
                _recv(ws)
                _send(ws, {"type": "input_text.delta", "delta": " "})
            with _ws(server, "tts") as ws:
                audio, done = _stream_pcm(ws, ["Hi there"], {"voice": "aiden", "seed": 1})
                assert done["type"] == "done" and audio
            response = httpx.post(url + "/v1/audio/speech", timeout=60,
                                  json={"input": "Hi", "voice": "aiden", "response_format": "pcm"})
            assert response.status_code == 200, response.text
            assert engine._core.num_queued() == 0 and len(engine._core.waiting) == 3
        finally:
            for ws in idle:
                ws.close()
