"""`/v1/realtime` end to end: a real uvicorn server spoken to with the official `openai` client, unchanged
(`client.realtime.connect`, `websocket_base_url` at the local server). A seeded response's deltas joined are
the text and PCM16 bytes of `OmniPipeline.stream` on the same conversation (audio turns heard as audio)."""

from __future__ import annotations

import base64
import contextlib
import json
import threading
import time

import numpy as np
import openai
import pytest
from audio_checks import assert_audible
from media_samples import tone
from server_harness import running_server
from websockets.exceptions import ConnectionClosed, InvalidStatus

from omnimtp.families.qwen2_5_omni import Qwen2_5OmniFamily
from omnimtp.families.qwen3_omni import Qwen3OmniFamily
from omnimtp.media import MediaLimits
from omnimtp.pipeline import OmniPipeline
from omnimtp.sampling import SamplingParams
from omnimtp.server.app import create_app
from omnimtp.server.audio import to_pcm16
from omnimtp.server.scheduler import Engine
from omnimtp.server.websocket import WebSocketLimits

pytestmark = pytest.mark.usefixtures("one_torch_thread")

KEY = "sk-realtime"
MAX_FRAMES = 24
MAX_TOKENS = 6
MAX_SESSIONS = 3
MAX_AUDIO_SECONDS = 2.0
QWEN2_5_MAX_FRAMES = 8  # its token2wav is the slow part of a tiny model
SEED = 11
SAMPLES_PER_FRAME, TAIL = 1920, 555
# the default audio chunks (the first after one frame), as `OmniPipeline` makes them: a chunk boundary moves
# the codec's float rounding
ENGINE = dict(max_frames=MAX_FRAMES, max_batch_size=4)


def _serve(family, **config):
    engine = Engine(family, media_limits=MediaLimits(max_audio_seconds=MAX_AUDIO_SECONDS), **{**ENGINE, **config})
    app = create_app(engine, api_key=KEY, websocket_limits=WebSocketLimits(max_sessions=MAX_SESSIONS))
    return engine, app.state.websockets, running_server(app)


@pytest.fixture(scope="module")
def qwen3():
    engine, sessions, server = _serve(Qwen3OmniFamily.tiny(0))
    with server as url:
        yield engine, sessions, url


def _client(url: str, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", websocket_base_url=url.replace("http://", "ws://") + "/v1",
                         api_key=key, max_retries=0)


@pytest.fixture(scope="module")
def client(qwen3):
    return _client(qwen3[2])


@pytest.fixture(scope="module")
def pipe():
    return OmniPipeline(family=Qwen3OmniFamily.tiny(0), max_frames=MAX_FRAMES)


@contextlib.contextmanager
def _connect(client, **session):
    """A session with `session.update` applied (a seed, turn detection off) and its session.updated read."""
    with client.realtime.connect(model="omnimtp-tiny") as connection:
        yield _configured(connection, **session)


def _configured(connection, **session):
    assert connection.recv().type == "session.created"
    connection.session.update(session={"type": "realtime", "seed": SEED, "max_output_tokens": MAX_TOKENS,
                                       "audio": {"input": {"turn_detection": None}}, **session})
    assert _next(connection).type == "session.updated"
    return connection


def _next(connection):
    event = connection.recv()
    assert event.type != "error", event.error
    return event


def _response(connection, **response) -> dict:
    """response.create, then its events until response.done: text, PCM bytes, the done event, event order."""
    connection.response.create(**({"response": response} if response else {}))
    texts, pcm, types, limits = [], [], [], None
    while True:
        event = _next(connection)
        types.append(event.type)
        if event.type == "rate_limits.updated":
            limits = event.rate_limits
        elif event.type in ("response.output_audio_transcript.delta", "response.output_text.delta"):
            texts.append(event.delta)
        elif event.type == "response.output_audio.delta":
            pcm.append(base64.b64decode(event.delta))
        elif event.type == "response.done":
            return {"text": "".join(texts), "pcm": b"".join(pcm), "done": event.response, "types": types,
                    "rate_limits": limits}


def _item_added(connection):
    """The events of an item that joined the conversation complete: conversation.item.added, then .done; the
    item."""
    added, done = _next(connection), _next(connection)
    assert (added.type, done.type) == ("conversation.item.added", "conversation.item.done"), (added, done)
    assert added.item.id == done.item.id
    return done.item


def _user_text(connection, text: str) -> None:
    connection.conversation.item.create(item={"type": "message", "role": "user",
                                              "content": [{"type": "input_text", "text": text}]})
    _item_added(connection)


def _user_audio(connection, samples: np.ndarray) -> str:
    """The samples appended in two pieces as PCM16 and committed; the item's id."""
    pcm = to_pcm16(samples).tobytes()
    for piece in (pcm[: len(pcm) // 2 & ~1], pcm[len(pcm) // 2 & ~1:]):
        connection.input_audio_buffer.append(audio=base64.b64encode(piece).decode("ascii"))
    connection.input_audio_buffer.commit()
    committed = _next(connection)
    assert committed.type == "input_audio_buffer.committed"
    added, done = _next(connection), _next(connection)
    assert added.type == "conversation.item.added" and added.item.id == committed.item_id
    assert done.type == "conversation.item.done" and done.item.id == committed.item_id
    return committed.item_id


def _heard(samples: np.ndarray) -> np.ndarray:
    """What the server hears of `samples` sent as PCM16."""
    return to_pcm16(samples).astype(np.float32) / 32768.0


def _expected(pipe, messages, voice: str | None = None) -> tuple[str, bytes]:
    """The seeded pipeline's streamed reply (chat's default sampling: T 1): text and PCM16 bytes."""
    sampling = SamplingParams(temperature=1.0)
    family = pipe.family
    texts, chunks = [], []
    for event in pipe.stream(messages, speaker=voice or family.default_speaker, thinker_sampling=sampling,
                             talker_sampling=family.sampled_talker(sampling), max_new_tokens=MAX_TOKENS, seed=SEED):
        texts.append(event.text)
        if event.audio is not None:
            chunks.append(event.audio)
    return "".join(texts), to_pcm16(np.concatenate(chunks)).tobytes()


def _assert_reply(reply: dict, text: str, pcm: bytes, *, is_qwen3: bool = True) -> None:
    served = np.frombuffer(reply["pcm"], dtype="<i2")
    assert_audible(served)
    assert reply["text"] == text
    assert reply["pcm"] == pcm
    usage = reply["done"].usage
    assert reply["done"].status in ("completed", "incomplete")
    if is_qwen3:  # code2wav's samples per frame (Qwen2.5-Omni's token2wav has its own)
        assert len(served) == SAMPLES_PER_FRAME * usage.output_token_details.audio_tokens - TAIL
    assert usage.output_tokens == usage.output_token_details.text_tokens + usage.output_token_details.audio_tokens


# -- turns ------------------------------------------------------------------------------------------


def test_a_text_turn_is_the_pipelines_reply(client, pipe):
    with _connect(client) as connection:
        _user_text(connection, "Hello there")
        reply = _response(connection)
    _assert_reply(reply, *_expected(pipe, [{"role": "user", "content": "Hello there"}]))
    types = reply["types"]
    assert types[:5] == ["response.created", "rate_limits.updated", "response.output_item.added",
                         "conversation.item.added", "response.content_part.added"]
    # no admission here: the slots are the limit, and this response started at once
    [limits] = reply["rate_limits"]
    assert (limits.name, limits.limit, limits.reset_seconds) == ("requests", ENGINE["max_batch_size"], 0)
    assert 0 <= limits.remaining < ENGINE["max_batch_size"]
    # the talker speaks before the thinker has written its whole reply
    first_audio = types.index("response.output_audio.delta")
    last_text = max(i for i, kind in enumerate(types) if kind == "response.output_audio_transcript.delta")
    assert first_audio < last_text
    assert types[-6:] == ["response.output_audio.done", "response.output_audio_transcript.done",
                          "response.content_part.done", "response.output_item.done", "conversation.item.done",
                          "response.done"]


def test_a_response_to_instructions_alone_speaks_first(client, pipe):
    """response.create on an empty conversation with instructions (LiveKit's quick-start greets this way:
    `generate_reply(instructions=...)`): the reply to the instructions as the system turn alone, the pipeline's."""
    instructions = "Greet the user and offer your assistance."
    with _connect(client) as connection:
        reply = _response(connection, instructions=instructions)
    _assert_reply(reply, *_expected(pipe, [{"role": "system", "content": instructions}]))


def test_an_audio_turn_is_heard_as_audio(client, pipe):
    samples = tone(0.6, 24000, hz=330.0)
    with _connect(client, audio={"input": {"turn_detection": None}, "output": {"voice": "Chelsie"}}) as connection:
        _user_audio(connection, samples)
        reply = _response(connection)
    assert reply["done"].audio.output.voice.lower() == "chelsie"
    messages = [{"role": "user", "content": [{"type": "audio", "audio": (_heard(samples), 24000)}]}]
    _assert_reply(reply, *_expected(pipe, messages, voice="chelsie"))


def test_a_second_turn_sees_the_first(client, pipe):
    """Turn 1 is audio at 48 kHz (resampled); turn 2 text. The second reply answers the whole conversation,
    the first reply's transcript as the assistant turn, and differs from the answer to turn 2 alone."""
    samples = tone(0.5, 48000, hz=520.0)
    with _connect(client, audio={"input": {"format": {"type": "audio/pcm", "rate": 48000},
                                           "turn_detection": None}}) as connection:
        _user_audio(connection, samples)
        first = _response(connection)
        _user_text(connection, "And then?")
        second = _response(connection)
    turn1 = {"role": "user", "content": [{"type": "audio", "audio": (_heard(samples), 48000)}]}
    _assert_reply(first, *_expected(pipe, [turn1]))
    conversation = [turn1, {"role": "assistant", "content": first["text"]}, {"role": "user", "content": "And then?"}]
    expected = _expected(pipe, conversation)
    _assert_reply(second, *expected)
    assert expected != _expected(pipe, [{"role": "user", "content": "And then?"}])


def test_an_input_audio_item_is_heard_at_the_sessions_input_rate(client, pipe):
    samples = tone(0.5, 16000, hz=400.0)
    pcm = base64.b64encode(to_pcm16(samples).tobytes()).decode("ascii")
    with _connect(client, audio={"input": {"format": {"type": "audio/pcm", "rate": 16000},
                                           "turn_detection": None}}) as connection:
        connection.conversation.item.create(item={"type": "message", "role": "user",
                                                  "content": [{"type": "input_audio", "audio": pcm}]})
        _item_added(connection)
        reply = _response(connection)
    messages = [{"role": "user", "content": [{"type": "audio", "audio": (_heard(samples), 16000)}]}]
    _assert_reply(reply, *_expected(pipe, messages))


def test_text_output_modality(client, pipe):
    with _connect(client, output_modalities=["text"], instructions="Be brief.") as connection:
        _user_text(connection, "Hello there")
        reply = _response(connection)
    assert reply["pcm"] == b"" and "response.output_text.done" in reply["types"]
    assert "response.output_audio.delta" not in reply["types"]
    text, _ = _expected(pipe, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}])
    assert reply["text"] == text and reply["done"].usage.output_token_details.audio_tokens == 0


def test_response_cancel_stops_the_audio(client):
    with _connect(client) as connection:
        _user_text(connection, "Talk for a while")
        connection.response.create()
        assert _next(connection).type == "response.created"
        connection.response.cancel()
        num_bytes = 0
        while (event := _next(connection)).type != "response.done":
            if event.type == "response.output_audio.delta":
                num_bytes += len(base64.b64decode(event.delta))
        assert event.response.status == "cancelled"
        assert event.response.status_details.reason == "client_cancelled"
        assert num_bytes < 2 * (SAMPLES_PER_FRAME * MAX_FRAMES - TAIL)
        # nothing of it comes after response.done; the session goes on
        connection.session.update(session={"type": "realtime", "instructions": "Short answers."})
        assert _next(connection).type == "session.updated"


def test_response_cancel_naming_another_response_cancels_nothing(client, pipe):
    with _connect(client) as connection:
        _user_text(connection, "Hello there")
        connection.response.create()
        assert _next(connection).type == "response.created"
        connection.response.cancel(response_id="resp_not_this_one")
        error, events = None, []
        while (event := connection.recv()).type != "response.done":
            if event.type == "error":
                error = event.error
            else:
                events.append(event)
        assert error is not None and error.code == "response_not_found" and error.param == "response_id"
        assert event.response.status != "cancelled"
    pcm = b"".join(base64.b64decode(e.delta) for e in events if e.type == "response.output_audio.delta")
    assert pcm == _expected(pipe, [{"role": "user", "content": "Hello there"}])[1]


def test_sessions_batch_with_each_other_and_give_their_replies_alone(client, pipe, qwen3):
    """Two sessions answered at once share the engine's talker steps, and each reply is the pipeline's."""
    engine = qwen3[0]
    registry = engine.metrics.registry

    def batched_steps() -> float:  # talker steps of more than one request
        total = registry.get_sample_value("omnimtp_talker_step_batch_size_count")
        return total - registry.get_sample_value("omnimtp_talker_step_batch_size_bucket", {"le": "1.0"})

    before = batched_steps()
    texts = ["Hello there", "Good morning"]
    replies: dict[str, dict] = {}
    barrier = threading.Barrier(len(texts))

    def converse(text: str) -> None:
        with _connect(client) as connection:
            _user_text(connection, text)
            barrier.wait(timeout=60)
            replies[text] = _response(connection)

    threads = [threading.Thread(target=converse, args=(text,)) for text in texts]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert batched_steps() > before
    for text in texts:
        _assert_reply(replies[text], *_expected(pipe, [{"role": "user", "content": text}]))


# -- bad events, limits -----------------------------------------------------------------------------

BAD_EVENTS = [
    ({"type": "response.create"}, None, "conversation_empty"),
    ({"type": "session.update", "session": {"type": "realtime", "audio": {"input": {"noise_reduction": {
        "type": "studio"}}}}}, "session.audio.input.noise_reduction.type", "invalid_value"),
    ({"type": "nonsense.event"}, "type", "invalid_value"),
    ({"type": "session.update", "session": {"type": "realtime", "audio": {"output": {"voice": "alloy"}}}},
     "session.audio.output.voice", "invalid_value"),
    ({"type": "session.update", "session": {"type": "realtime", "audio": {"input": {"turn_detection": {
        "type": "semantic_vad", "silence_duration_ms": 300}}}}},
     "session.audio.input.turn_detection.silence_duration_ms", "invalid_value"),
    ({"type": "session.update", "session": {"type": "realtime", "audio": {"input": {"format": {
        "type": "audio/opus"}}}}}, "session.audio.input.format.type", "invalid_value"),
    ({"type": "session.update", "session": {"type": "realtime", "audio": {"input": {"format": {
        "type": "audio/pcmu", "rate": 16000}}}}}, "session.audio.input.format.rate", "invalid_value"),
    ({"type": "session.update", "session": {"type": "realtime", "audio": {"output": {"format": {
        "type": "audio/pcm", "rate": 16000}}}}}, "session.audio.output.format.rate", "invalid_value"),
    ({"type": "session.update", "session": {"type": "realtime", "tools": [{"type": "function", "name": "f"}]}},
     "session.tools", "invalid_value"),
    ({"type": "session.update", "session": {"type": "realtime", "max_output_tokens": 10**6}},
     "session.max_output_tokens", "invalid_value"),
    ({"type": "session.update", "session": {"type": "realtime", "max_output_tokens": 0}},
     "session.max_output_tokens", "invalid_value"),  # no union member tag ("constrained-int") in the name
    ({"type": "session.update", "session": {"type": "realtime", "colour": "blue"}}, "session.colour",
     "unknown_parameter"),
    ({"type": "input_audio_buffer.append", "audio": "not base64!"}, "audio", "invalid_value"),
    ({"type": "input_audio_buffer.append", "audio": base64.b64encode(b"\x01").decode()}, "audio",
     "invalid_value"),  # PCM16 has an even number of bytes
    ({"type": "input_audio_buffer.commit"}, None, "input_audio_buffer_commit_empty"),
    ({"type": "input_audio_buffer.append", "audio": base64.b64encode(
        bytes(2 * int(24000 * (MAX_AUDIO_SECONDS + 0.1)))).decode()}, "audio", "input_audio_buffer_full"),
    ({"type": "conversation.item.create", "item": {"type": "message", "role": "user", "content": [
        {"type": "output_text", "text": "x"}]}}, "item.content.0.type", "invalid_value"),
    ({"type": "conversation.item.create", "item": {"type": "message", "role": "user", "content": [
        {"type": "input_text"}]}}, "item.content.0.text", "missing_required_parameter"),
    ({"type": "conversation.item.create", "previous_item_id": "item_nope", "item": {
        "type": "message", "role": "user", "content": [{"type": "input_text", "text": "x"}]}},
     "previous_item_id", "item_not_found"),
    ({"type": "response.cancel"}, None, "response_cancel_not_active"),
]


def test_noise_reduction_is_taken_and_echoed(client):
    """`noise_reduction` (pipecat's realtime quick-start asks near_field): taken and echoed, null turns it off; no
    filter runs (the audio is heard as it comes)."""
    with _connect(client) as connection:
        for value in ({"type": "near_field"}, {"type": "far_field"}, None):
            connection.session.update(session={"type": "realtime", "audio": {"input": {"noise_reduction": value}}})
            updated = _next(connection).session
            reduction = updated.audio.input.noise_reduction
            assert (reduction and reduction.model_dump(exclude_none=True)) == value


def test_bad_events_get_error_events_naming_the_field(client, pipe):
    with _connect(client) as connection:
        for number, (event, param, code) in enumerate(BAD_EVENTS):
            connection.send({**event, "event_id": f"evt_{number}"})
            error = connection.recv()
            assert error.type == "error", event
            assert (error.error.param, error.error.code) == (param, code), (event, error.error)
            assert error.error.event_id == f"evt_{number}"
            assert error.error.message
        connection.send({"type": "x" * 1_000_000, "event_id": "evt_long"})  # the echo of a value is cut
        error = connection.recv().error
        assert (error.param, error.event_id) == ("type", "evt_long") and len(error.message) < 1000
        # the session is intact, and none of the bad events changed it
        connection.session.update(session={"type": "realtime"})
        updated = _next(connection).session
        assert updated.audio.output.voice.lower() == "ethan" and updated.audio.input.turn_detection is None
        _user_text(connection, "Hello there")
        reply = _response(connection)
    _assert_reply(reply, *_expected(pipe, [{"role": "user", "content": "Hello there"}]))


def test_the_api_key_is_checked_on_the_upgrade(qwen3):
    with pytest.raises(InvalidStatus) as refused:
        _client(qwen3[2], key="sk-wrong").realtime.connect(model="omnimtp-tiny").enter()
    assert refused.value.response.status_code == 401
    assert json.loads(refused.value.response.body)["error"]["code"] == "invalid_api_key"


def test_an_unknown_model_is_an_error_event_then_a_close(client):
    with client.realtime.connect(model="gpt-realtime") as connection:
        error = connection.recv()
        assert error.type == "error" and (error.error.param, error.error.code) == ("model", "model_not_found")
        with pytest.raises(ConnectionClosed):
            connection.recv()


def _wait(predicate, what: str) -> None:
    deadline = time.monotonic() + 20
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def test_max_sessions_then_a_clean_refusal(client, qwen3):
    engine, sessions, _ = qwen3
    _wait(lambda: sessions.num_open("/v1/realtime") == 0, "sessions left open")
    connections = [client.realtime.connect(model="omnimtp-tiny").enter() for _ in range(MAX_SESSIONS)]
    try:
        with pytest.raises(InvalidStatus) as refused:
            client.realtime.connect(model="omnimtp-tiny").enter()
        assert refused.value.response.status_code == 429
        assert json.loads(refused.value.response.body)["error"]["code"] == "too_many_sessions"
        connections.pop().close()
        _wait(lambda: sessions.num_open("/v1/realtime") == MAX_SESSIONS - 1, "the closed session kept its slot")
        connections.append(client.realtime.connect(model="omnimtp-tiny").enter())
        assert connections[-1].recv().type == "session.created"
    finally:
        for connection in connections:
            connection.close()


def test_a_disconnect_mid_response_cancels_it_and_frees_the_slot(client, qwen3, monkeypatch):
    engine, sessions, _ = qwen3
    _wait(lambda: sessions.num_open("/v1/realtime") == 0, "sessions left open")
    # no engine step until the server has heard of the close: the tiny model's whole response (MAX_FRAMES
    # frames) could otherwise end first on a busy host, and there would be nothing left to cancel
    step = engine._core.step

    def step_after_the_close():
        _wait(lambda: any(handle.is_cancelled for handle in list(engine._handles.values())), "no close heard")
        return step()

    monkeypatch.setattr(engine._core, "step", step_after_the_close)
    cancelled = engine.metrics.registry.get_sample_value("omnimtp_cancelled_requests_total")
    connection = _configured(client.realtime.connect(model="omnimtp-tiny").enter())
    _user_text(connection, "Talk for a while")
    connection.response.create()
    assert _next(connection).type == "response.created"
    connection.close()
    _wait(lambda: engine.metrics.registry.get_sample_value("omnimtp_cancelled_requests_total") == cancelled + 1,
          "the engine request was not cancelled")
    _wait(lambda: not engine._handles and not engine._core.running, "the engine request was not freed")
    _wait(lambda: sessions.num_open("/v1/realtime") == 0, "the session slot was not freed")


# -- Qwen2.5-Omni -----------------------------------------------------------------------------------


def test_qwen2_5_omni_audio_turn():
    family = Qwen2_5OmniFamily.tiny(0)
    pipe = OmniPipeline(family=Qwen2_5OmniFamily.tiny(0), max_frames=QWEN2_5_MAX_FRAMES)
    samples = tone(0.5, 24000, hz=440.0)
    _, _, server = _serve(family, max_frames=QWEN2_5_MAX_FRAMES)
    with server as url, _connect(_client(url)) as connection:
        _user_audio(connection, samples)
        reply = _response(connection)
    messages = [{"role": "user", "content": [{"type": "audio", "audio": (_heard(samples), 24000)}]}]
    _assert_reply(reply, *_expected(pipe, messages), is_qwen3=False)


def test_a_conversation_answers_after_more_audio_turns_than_max_media_parts(client):
    """--max-media-parts (8) holds each turn of a realtime conversation, not its whole history: a ninth audio
    turn is answered; a single turn of nine audio parts is refused, naming it."""
    pcm = base64.b64encode(to_pcm16(tone(0.1, 24000, hz=300.0)).tobytes()).decode("ascii")
    with _connect(client, output_modalities=["text"]) as connection:
        for _ in range(9):
            connection.conversation.item.create(item={"type": "message", "role": "user",
                                                      "content": [{"type": "input_audio", "audio": pcm}]})
            _item_added(connection)
        reply = _response(connection)
        assert reply["done"].status in ("completed", "incomplete") and reply["text"]
        connection.conversation.item.create(item={"type": "message", "role": "user",
                                                  "content": [{"type": "input_audio", "audio": pcm}] * 9})
        _item_added(connection)
        connection.response.create()
        error = connection.recv()
    assert error.type == "error" and "more than 8" in error.error.message, error
    assert error.error.param == "messages.10.content", error.error  # nine turns, the reply, this turn


def test_a_g711_append_over_the_limit_is_refused_before_it_is_decoded(client, monkeypatch):
    import omnimtp.server.routes.realtime.formats as realtime_route

    decoded, g711_decode = [], realtime_route.g711_decode

    def spy(data, fmt):
        decoded.append(len(data))
        return g711_decode(data, fmt)

    monkeypatch.setattr(realtime_route, "g711_decode", spy)
    over = base64.b64encode(bytes(int(8000 * MAX_AUDIO_SECONDS) + 1)).decode()
    within = base64.b64encode(bytes(4000)).decode()
    with _connect(client, audio={"input": {"format": {"type": "audio/pcmu"}, "turn_detection": None}}) as connection:
        connection.input_audio_buffer.append(audio=over)
        error = connection.recv()
        assert error.type == "error" and error.error.code == "input_audio_buffer_full", error
        connection.input_audio_buffer.append(audio=within)
        connection.input_audio_buffer.commit()
        assert _next(connection).type == "input_audio_buffer.committed"
    assert decoded == [4000]


def test_a_new_input_format_empties_the_buffer_of_the_old_ones_audio(client):
    """Audio appended at 24 kHz is never committed as 16 kHz audio: the format change empties the buffer."""
    pcm = base64.b64encode(to_pcm16(tone(0.5, 24000, hz=300.0)).tobytes()).decode("ascii")
    with _connect(client) as connection:
        connection.input_audio_buffer.append(audio=pcm)
        connection.session.update(session={"type": "realtime", "audio": {"input": {
            "format": {"type": "audio/pcm", "rate": 16000}}}})
        assert _next(connection).type == "session.updated"
        connection.input_audio_buffer.commit()
        error = connection.recv()
    assert error.type == "error" and error.error.code == "input_audio_buffer_commit_empty", error
