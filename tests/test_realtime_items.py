"""`/v1/realtime` items as OpenAI's GA API has them: `conversation.item.added` / `.done`, `previous_item_id`,
`.retrieve`, `.delete`, duplicate ids; a reply in the conversation from `response.output_item.added` on, so a
barge-in's truncate (or a delete) cuts it while it still streams; `response.metadata` echoed; `max_output_tokens:
"inf"`. Every event is also checked against the `openai` package's GA models (conftest.py's
`checked_realtime_events`); the check itself is tested here to fail on what is not a GA event."""

from __future__ import annotations

import asyncio
import base64
import threading

import pytest
from realtime_contract import check_server_event
from test_server_realtime import MAX_TOKENS, _client, _configured, _item_added, _next, _serve, _user_text

from omnimtp.families.qwen3_omni import Qwen3OmniFamily

pytestmark = pytest.mark.usefixtures("one_torch_thread")

RATE = 24000


@pytest.fixture(scope="module")
def served():
    engine, _, server = _serve(Qwen3OmniFamily.tiny(0))
    with server as url:
        yield engine, _client(url)


@pytest.fixture
def submitted(served, monkeypatch):
    """The engine requests the test's responses submit."""
    engine, requests = served[0], []
    submit = engine.submit
    monkeypatch.setattr(engine, "submit", lambda request, **kwargs: requests.append(request) or submit(request,
                                                                                                      **kwargs))
    return requests


class _GatedHandle:
    """A request handle whose events pause after the `num_audio`-th audio chunk until `gate` is set: the reply
    is still streaming while the test acts on it."""

    def __init__(self, handle, gate: threading.Event, num_audio: int):
        self.handle, self.gate, self.num_audio = handle, gate, num_audio

    def __getattr__(self, name):  # the request, its id, ...: the handle's
        return getattr(self.handle, name)

    def cancel(self):
        self.handle.cancel()

    async def events(self):
        num_audio = 0
        async for event in self.handle.events():
            yield event
            if event.audio is not None and event.audio.size:
                num_audio += 1
                while num_audio == self.num_audio and not self.gate.is_set():
                    await asyncio.sleep(0.005)


@pytest.fixture
def gate(served, monkeypatch):
    engine, gate = served[0], threading.Event()
    submit = engine.submit
    monkeypatch.setattr(engine, "submit", lambda request, **kwargs: _GatedHandle(submit(request, **kwargs), gate, 2))
    yield gate
    gate.set()


def _until(connection, kind: str) -> list:
    events = []
    while (event := _next(connection)).type != kind:
        events.append(event)
    return [*events, event]


def _streaming_reply(connection) -> tuple[str, list, list[bytes]]:
    """response.create on a user turn; the events until the reply's second audio delta (where the gate holds
    it): (item id, transcript deltas, audio deltas)."""
    _user_text(connection, "Tell me a long story")
    connection.response.create(response={"max_output_tokens": "inf"})
    events, audio = [], []
    while len(audio) < 2:
        events.append(event := _next(connection))
        if event.type == "response.output_audio.delta":
            audio.append(base64.b64decode(event.delta))
    added = next(event for event in events if event.type == "conversation.item.added")
    assert added.item.role == "assistant" and added.item.status == "in_progress"
    deltas = [event.delta for event in events if event.type == "response.output_audio_transcript.delta"]
    return added.item.id, deltas, audio


def test_a_reply_still_streaming_is_truncated_to_what_was_heard(served, gate, submitted):
    with served[1].realtime.connect(model="omnimtp-tiny") as connection:
        _configured(connection)
        item_id, deltas, audio = _streaming_reply(connection)
        audio_end_ms = sum(len(chunk) for chunk in audio) // 2 * 1000 // RATE  # all it has sent was heard
        connection.conversation.item.truncate(item_id=item_id, content_index=0, audio_end_ms=audio_end_ms)
        truncated = _until(connection, "conversation.item.truncated")
        gate.set()
        rest = _until(connection, "response.done")
        assert not [e for e in truncated + rest if e.type.endswith(".delta")], "the cut reply streamed on"
        done = rest[-1].response
        assert done.status == "cancelled" and done.status_details.reason == "client_cancelled"
        # the frames heard keep as many transcript deltas: the thinker is ahead of the talker
        heard = done.output[0].content[0].transcript
        assert done.output[0].id == item_id and heard and heard in ["".join(deltas[:n]) for n in range(len(deltas) + 1)]
        connection.conversation.item.retrieve(item_id=item_id)
        retrieved = _next(connection)
        assert retrieved.type == "conversation.item.retrieved" and retrieved.item.content[0].transcript == heard
        _user_text(connection, "Go on")
        connection.response.create()
        _until(connection, "response.done")
    assert [message for message in submitted[-1].messages[-3:]] == [
        ("user", "Tell me a long story"), ("assistant", heard), ("user", "Go on")]


def test_deleting_a_reply_still_streaming_cancels_it_and_takes_it_out(served, gate, submitted):
    with served[1].realtime.connect(model="omnimtp-tiny") as connection:
        _configured(connection)
        item_id, _, _ = _streaming_reply(connection)
        connection.conversation.item.delete(item_id=item_id)
        deleted = _until(connection, "conversation.item.deleted")[-1]
        gate.set()
        assert deleted.item_id == item_id
        assert _until(connection, "response.done")[-1].response.status == "cancelled"
        connection.conversation.item.retrieve(item_id=item_id)
        error = connection.recv()
        assert error.type == "error" and (error.error.code, error.error.param) == ("item_not_found", "item_id")
        _user_text(connection, "Go on")
        connection.response.create()
        _until(connection, "response.done")
    assert [role for role, _ in submitted[-1].messages] == ["user", "user"]


def test_items_go_after_previous_item_id_and_are_retrieved_and_deleted(served, submitted):
    def create(text: str, **fields):
        connection.conversation.item.create(item={"type": "message", "role": "user",
                                                  "content": [{"type": "input_text", "text": text}]}, **fields)

    with served[1].realtime.connect(model="omnimtp-tiny") as connection:
        _configured(connection, output_modalities=["text"])
        connection.conversation.item.create(item={"id": "first", "type": "message", "role": "user",
                                                  "content": [{"type": "input_text", "text": "one"}]})
        _item_added(connection)
        create("two")
        _item_added(connection)
        connection.conversation.item.create(item={"id": "middle", "type": "message", "role": "user",
                                                  "content": [{"type": "input_text", "text": "between"}]},
                                            previous_item_id="first")
        added = _next(connection)
        assert (added.type, added.previous_item_id, added.item.id) == ("conversation.item.added", "first", "middle")
        assert _next(connection).type == "conversation.item.done"
        connection.conversation.item.create(item={"id": "first", "type": "message", "role": "user",
                                                  "content": [{"type": "input_text", "text": "again"}]})
        error = connection.recv()
        assert error.type == "error" and error.error.code == "item_create_duplicate_item_id", error
        connection.conversation.item.retrieve(item_id="middle")
        retrieved = _next(connection)
        assert retrieved.type == "conversation.item.retrieved" and retrieved.item.content[0].text == "between"
        connection.conversation.item.delete(item_id="first")
        assert _next(connection).type == "conversation.item.deleted"
        connection.conversation.item.delete(item_id="first")  # the item is gone
        error = connection.recv()
        assert error.type == "error" and error.error.code == "item_not_found", error
        connection.response.create(response={"metadata": {"client_event_id": "evt_42"}})
        created = _next(connection)
        assert created.type == "response.created" and created.response.metadata == {"client_event_id": "evt_42"}
        done = _until(connection, "response.done")[-1]
        assert done.response.metadata == {"client_event_id": "evt_42"}
    assert submitted[-1].messages == (("user", "between"), ("user", "two"))
    assert submitted[-1].max_new_tokens == MAX_TOKENS


def test_max_output_tokens_inf_is_the_servers_limit_not_the_default_cap(served, submitted):
    with served[1].realtime.connect(model="omnimtp-tiny") as connection:
        _configured(connection, max_output_tokens="inf")
        _user_text(connection, "Hello")
        connection.response.create()
        assert _until(connection, "response.done")[-1].response.max_output_tokens == "inf"
    engine = served[0]
    assert submitted[-1].max_new_tokens == 2048 > engine.config.max_new_tokens


def test_the_contract_check_fails_on_what_is_not_a_ga_event():
    check_server_event({"type": "conversation.item.deleted", "event_id": "event_1", "item_id": "item_1"})
    for event, words in (({"type": "conversation.item.gone", "event_id": "e"}, "not a GA server event type"),
                         ({"type": "conversation.item.deleted", "item_id": "item_1"}, "event_id"),
                         ({"type": "response.output_audio.delta", "event_id": "e", "response_id": "r",
                           "item_id": "i", "content_index": 0, "delta": ""}, "output_index"),
                         ({"type": "conversation.item.deleted", "event_id": "e", "item_id": "i", "extra": 1},
                          "lacks: extra")):
        with pytest.raises(ValueError, match=words):
            check_server_event(event)
