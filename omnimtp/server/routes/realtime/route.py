"""The `/v1/realtime` WebSocket: a session's event loop, each client event dispatched to what handles it."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, WebSocket

from omnimtp.server.errors import APIError
from omnimtp.server.routes.common import ServingContext
from omnimtp.server.routes.realtime.conversation import (
    client_item,
    commit_audio,
    delete_item,
    find_item,
    insert_item,
    send_added,
    truncate_item,
)
from omnimtp.server.routes.realtime.events import (
    AudioAppend,
    BufferEvent,
    ClientEvent,
    ItemCreate,
    ItemDelete,
    ItemRetrieve,
    ItemTruncate,
    OutputAudioClear,
    ResponseCreate,
    ResponseFields,
    SessionFields,
    SessionUpdate,
    event_error,
    parse_event,
)
from omnimtp.server.routes.realtime.live import take_live
from omnimtp.server.routes.realtime.responses import cancel_idle, cancel_response, start_response
from omnimtp.server.routes.realtime.settings import update_settings
from omnimtp.server.routes.realtime.state import RealtimeSession, Settings
from omnimtp.server.routes.realtime.turns import append_audio
from omnimtp.server.websocket import EventError, Session, new_id, websocket_sessions

ROUTE = "/v1/realtime"

router = APIRouter()


@router.websocket(ROUTE)
async def realtime(websocket: WebSocket):
    await websocket_sessions(websocket).serve(websocket, ROUTE, _run)


async def _run(session: Session) -> None:
    context: ServingContext = session.websocket.app.state.serving
    engine = context.engine
    model = session.websocket.query_params.get("model")
    is_transcription = session.websocket.query_params.get("intent") == "transcription"
    try:
        model_name = context.check_model(model)
        if not (is_transcription and engine.audio_sampling_rate is not None):  # (a model that only hears
            context.check_chat()  # serves transcription sessions)
    except APIError as exc:  # the session opens and says why it cannot serve, then closes
        await session.send_error(event_error(exc))
        await session.close(1008, exc.message[:120])
        return
    default_speaker = engine.family.default_speaker  # (None: a model that only hears)
    voice = None if default_speaker is None else engine.match_speaker(default_speaker)
    state = RealtimeSession(context, session, Settings(voice=voice), model_name)
    if is_transcription:  # a transcription session from the start
        try:
            update_settings(state, SessionFields(type="transcription"))
        except EventError as exc:
            await session.send_error(exc)
            await session.close(1008, exc.message[:120])
            return
    await session.send({"type": "session.created", "session": state.describe()})
    try:
        while (event := await session.receive()) is not None:
            try:
                await _handle(state, parse_event(event))
            except EventError as exc:
                await session.send_error(exc, event)
    finally:
        cancel_idle(state)
        state.drop_live()
        if state.response is not None:  # the client left mid-response: the engine request is cancelled
            state.response.cancel()
            await asyncio.gather(state.response, return_exceptions=True)
        for task in (*state.transcripts, *state.alignments):  # and so are its input transcripts and alignments
            task.cancel()
        await asyncio.gather(*state.transcripts, *state.alignments, return_exceptions=True)
        engine.drop_conversation(state.id)


async def _handle(state: RealtimeSession, event: ClientEvent) -> None:
    session = state.session
    if isinstance(event, SessionUpdate):
        update_settings(state, event.session)
        await session.send({"type": "session.updated", "session": state.describe()})
    elif isinstance(event, AudioAppend):
        await append_audio(state, event.audio)
    elif isinstance(event, BufferEvent) and event.type == "input_audio_buffer.clear":
        state.clear_buffer()
        await session.send({"type": "input_audio_buffer.cleared"})
    elif isinstance(event, BufferEvent):
        if not state.audio_buffer:
            raise EventError("input_audio_buffer: nothing to commit: the buffer is empty",
                             code="input_audio_buffer_commit_empty")
        await commit_audio(state, bytes(state.audio_buffer), new_id("item"), take_live(state))
        state.clear_buffer()
    elif isinstance(event, ItemCreate):
        item = await client_item(state, event.item)
        await send_added(state, item, insert_item(state, item, event.previous_item_id))
    elif isinstance(event, ItemDelete):
        delete_item(state, event.item_id)
        await session.send({"type": "conversation.item.deleted", "item_id": event.item_id})
    elif isinstance(event, ItemRetrieve):
        item = find_item(state, event.item_id)
        await session.send({"type": "conversation.item.retrieved", "item": item.event_item()})
    elif isinstance(event, ResponseCreate):
        await start_response(state, event.response or ResponseFields())
    elif isinstance(event, ItemTruncate):
        truncate_item(state, event)
        await session.send({"type": "conversation.item.truncated", "item_id": event.item_id,
                            "content_index": event.content_index, "audio_end_ms": event.audio_end_ms})
    elif isinstance(event, OutputAudioClear):
        response_id = state.response_id
        state.stop_response("client_cancelled")
        await session.send({"type": "output_audio_buffer.cleared", "response_id": response_id})
    else:
        await cancel_response(state, event)
