"""The conversation: items made from committed audio or `conversation.item.create`, placed by
`previous_item_id` within the session's limits, cut by `conversation.item.truncate`, taken out by
`conversation.item.delete` and shown by `conversation.item.retrieve`. A new item is announced by
`conversation.item.added` and, once complete, `conversation.item.done` (a reply's item: when its response
ends)."""

from __future__ import annotations

import asyncio

import numpy as np
from starlette.concurrency import run_in_threadpool

from omnimtp.media import MediaError, load_audio
from omnimtp.server.routes.realtime.events import PCM_RATE, Item, ItemTruncate
from omnimtp.server.routes.realtime.formats import pcm_bytes
from omnimtp.server.routes.realtime.state import ConversationItem, RealtimeSession
from omnimtp.server.routes.realtime.transcription import transcribe_item
from omnimtp.server.websocket import EventError, new_id


async def heard_audio(state: RealtimeSession, pcm: bytes, rate: int, param: str) -> np.ndarray:
    """PCM16 bytes at `rate` → float32 samples at the processor's rate (soxr), off the event loop."""
    sampling_rate = state.context.engine.audio_sampling_rate
    if sampling_rate is None:
        raise EventError(f"{param}: the model {state.model_name!r} has no processor to hear audio",
                         param=param, code="model_not_supported")
    samples = np.frombuffer(pcm, dtype="<i2").astype(np.float32) / 32768.0
    try:
        return await run_in_threadpool(load_audio, (samples, rate), sampling_rate,
                                       state.context.engine.media_limits, param)
    except MediaError as exc:
        raise EventError(str(exc), param=exc.param) from None


async def commit_audio(state: RealtimeSession, pcm: bytes, item_id: str, live=None) -> None:
    """The committed audio as a user item at the end of the conversation, and its events. live: the turn's
    `live.LiveRecognition`, which then writes its transcript."""
    audio = await heard_audio(state, pcm, state.settings.input_rate, "input_audio_buffer")
    item = ConversationItem(item_id, "user", ({"type": "audio", "audio": audio},),
                            [{"type": "input_audio", "transcript": None}])
    previous = insert_item(state, item, None)
    await state.session.send({"type": "input_audio_buffer.committed", "previous_item_id": previous,
                              "item_id": item.id})
    await send_added(state, item, previous)
    if state.settings.transcription is not None:
        task = asyncio.ensure_future(transcribe_item(state, item, state.settings.transcription, live))
        state.transcripts.add(task)
        task.add_done_callback(state.transcripts.discard)


async def send_added(state: RealtimeSession, item: ConversationItem, previous_item_id: str | None) -> None:
    """The events of a complete item that joined the conversation after `previous_item_id`."""
    await state.session.send({"type": "conversation.item.added", "previous_item_id": previous_item_id,
                              "item": item.event_item()})
    await state.session.send({"type": "conversation.item.done", "previous_item_id": previous_item_id,
                              "item": item.event_item()})


async def client_item(state: RealtimeSession, item: Item) -> ConversationItem:
    """A `conversation.item.create` item as a turn. User parts: input_text, input_audio (base64 PCM16 at the
    session's input rate); assistant parts: output_text, output_audio (its transcript is the turn's text);
    system parts: input_text."""
    allowed = {"user": ("input_text", "input_audio"), "assistant": ("output_text", "output_audio", "text"),
               "system": ("input_text",)}[item.role]
    engine_parts, parts = [], []
    for i, part in enumerate(item.content):
        param = f"item.content.{i}"
        if part.type not in allowed:
            raise EventError(f"{param}.type: a {item.role} item takes {', '.join(allowed)} parts, not {part.type}",
                             param=f"{param}.type")
        if part.type == "input_audio":
            if part.audio is None:
                raise EventError(f"{param}.audio: required", param=f"{param}.audio",
                                 code="missing_required_parameter")
            pcm = pcm_bytes(part.audio, state.settings.input_format, f"{param}.audio")
            audio = await heard_audio(state, pcm, state.settings.input_rate, f"{param}.audio")
            engine_parts.append({"type": "audio", "audio": audio})
            parts.append({"type": "input_audio", "transcript": part.transcript})
            continue
        text = part.transcript if part.type == "output_audio" else part.text
        name = "transcript" if part.type == "output_audio" else "text"
        if text is None:
            raise EventError(f"{param}.{name}: required", param=f"{param}.{name}", code="missing_required_parameter")
        engine_parts.append({"type": "text", "text": text})
        parts.append({"type": part.type, name: text})
    if any(part["type"] == "audio" for part in engine_parts):
        content: str | tuple = tuple(engine_parts)
    else:
        content = "".join(part["text"] for part in engine_parts)
    if item.id is not None and any(existing.id == item.id for existing in state.items):
        raise EventError(f"item.id: the conversation already has an item {item.id!r}", param="item.id",
                         code="item_create_duplicate_item_id")
    return ConversationItem(item.id or new_id("item"), item.role, content, parts)


def insert_item(state: RealtimeSession, item: ConversationItem, previous_item_id: str | None) -> str | None:
    """Put `item` after `previous_item_id` ("root": first; None: last); the id of the item before it."""
    check_room(state, 1, item.num_bytes)
    items = state.items
    if previous_item_id is None:
        index = len(items)
    elif previous_item_id == "root":
        index = 0
    else:
        ids = [existing.id for existing in items]
        if previous_item_id not in ids:
            raise EventError(f"previous_item_id: the conversation has no item {previous_item_id!r}",
                             param="previous_item_id", code="item_not_found")
        index = ids.index(previous_item_id) + 1
    items.insert(index, item)
    return items[index - 1].id if index > 0 else None


def check_room(state: RealtimeSession, num_items: int, num_bytes: int) -> None:
    """EventError when the conversation would hold more items or bytes than the session limits allow."""
    limits = state.session.limits
    if len(state.items) + num_items > limits.max_session_items:
        raise EventError(f"the conversation holds the limit of {limits.max_session_items} items "
                         "(--max-session-items); start a new session", param="max_session_items",
                         code="conversation_full")
    held = sum(item.num_bytes for item in state.items)
    if held + num_bytes > limits.max_session_bytes:
        raise EventError(f"the conversation would hold {held + num_bytes} bytes, over the limit of "
                         f"{limits.max_session_bytes} (--max-session-bytes); start a new session",
                         param="max_session_bytes", code="conversation_full")


def find_item(state: RealtimeSession, item_id: str) -> ConversationItem:
    """The conversation's item `item_id`; EventError item_not_found naming `item_id` when there is none."""
    item = next((item for item in state.items if item.id == item_id), None)
    if item is None:
        raise EventError(f"item_id: the conversation has no item {item_id!r}", param="item_id",
                         code="item_not_found")
    return item


def truncate_item(state: RealtimeSession, event: ItemTruncate) -> None:
    """Cut a spoken assistant item to the audio the user heard (`audio_end_ms`), and its transcript with it, so
    that later turns hold only what was heard. The talker reads one reply token per audio frame, so the frames
    heard keep that many of the transcript's deltas (one delta per token). A reply still streaming is cut at
    what it has sent, and its response is cancelled: what it would say next was not heard."""
    item = find_item(state, event.item_id)
    is_streaming = item.status == "in_progress"
    if item.role != "assistant" or item.parts[0]["type"] != "output_audio" or not (item.num_frames or is_streaming):
        raise EventError(f"item_id: {event.item_id!r} is not an assistant item with audio", param="item_id")
    duration_ms = item.num_samples * 1000 // PCM_RATE
    if event.audio_end_ms > duration_ms:
        raise EventError(f"audio_end_ms: the item's audio is {duration_ms} ms long, got {event.audio_end_ms}",
                         param="audio_end_ms")
    heard_samples = event.audio_end_ms * PCM_RATE // 1000
    heard_frames = heard_samples * item.num_frames // item.num_samples if item.num_samples else 0
    if item.words is not None:  # cut after the last word spoken whole before audio_end_ms
        item.content, item.words = heard_words(item.content, item.words, event.audio_end_ms)
        item.text_deltas = (item.content,)
    else:
        item.text_deltas = item.text_deltas[:heard_frames]
        item.content = "".join(item.text_deltas)
    item.num_frames, item.num_samples = heard_frames, heard_samples
    item.parts = [{"type": "output_audio", "transcript": item.content}]
    if is_streaming:
        _stop_reply(state, item)


def heard_words(text: str, words: tuple, audio_end_ms: int) -> tuple[str, tuple]:
    """`text` cut after the last of its aligned `words` that ends by `audio_end_ms`, and the words kept (all of
    them: the whole text). A word's letters are found in the text in order (the aligner keeps a word's letters,
    digits and apostrophes as the text writes them), so the cut falls right after the last one heard.

        >>> heard_words("Hi, you there.", (AlignedWord("Hi", 0, 0.2), AlignedWord("you", 0.3, 0.5),
        ...                                AlignedWord("there", 0.6, 0.9)), 700)[0]
        'Hi, you'"""
    kept = tuple(word for word in words if round(word.end * 1000) <= audio_end_ms)
    if len(kept) == len(words):
        return text, words
    end = 0
    for word in kept:
        for char in word.word:
            end = text.index(char, end) + 1
    return text[:end], kept


def delete_item(state: RealtimeSession, item_id: str) -> None:
    """Take item `item_id` out of the conversation; a reply still streaming into it is cancelled."""
    item = find_item(state, item_id)
    state.items.remove(item)
    if item.status == "in_progress":
        _stop_reply(state, item)


def _stop_reply(state: RealtimeSession, item: ConversationItem) -> None:
    """The active response streaming into `item` is cancelled, and nothing more it streams joins the item."""
    item.is_cut = True
    state.stop_response("client_cancelled")
