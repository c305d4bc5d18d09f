"""Responses: the conversation answered as one chat request of the engine, its events streamed as the engine
makes them, and the reply added to the conversation."""

from __future__ import annotations

import asyncio

import numpy as np
from starlette.concurrency import run_in_threadpool

from omnimtp.server.errors import APIError
from omnimtp.server.requests import EngineRequest
from omnimtp.server.routes.common import sampling_params
from omnimtp.server.routes.realtime.conversation import check_room, commit_audio, insert_item
from omnimtp.server.routes.realtime.events import PCM_RATE, ResponseCancel, ResponseFields
from omnimtp.server.routes.realtime.formats import OutputEncoder, describe_format, output_format
from omnimtp.server.routes.realtime.settings import max_output_tokens_setting, session_voice
from omnimtp.server.routes.realtime.state import ConversationItem, RealtimeSession
from omnimtp.server.websocket import EventError, new_id


def _engine_request(state: RealtimeSession, fields: ResponseFields) -> tuple[EngineRequest, dict]:
    """The chat request of a response: the conversation (the instructions as its system turn), and what the
    response reports (voice, modalities, max_output_tokens)."""
    context, settings = state.context, state.settings
    modalities = tuple(fields.output_modalities or settings.output_modalities)
    voice, out_format = settings.voice, settings.output_format
    audio = fields.audio.output if fields.audio is not None else None
    if audio is not None:
        if audio.format is not None:
            out_format = output_format(audio.format, "response.audio.output.format")
        if audio.voice is not None:
            voice = session_voice(context, audio.voice, "response.audio.output.voice")
    max_output_tokens = settings.max_output_tokens
    if fields.max_output_tokens is not None:
        max_output_tokens = max_output_tokens_setting(context, fields.max_output_tokens, "response.max_output_tokens")
    instructions = settings.instructions if fields.instructions is None else fields.instructions
    if not state.items and not instructions:  # (with instructions alone the model speaks first: a greeting)
        raise EventError("the conversation is empty and there are no instructions to answer: commit the input "
                         "audio buffer, create an item or give instructions first", code="conversation_empty")
    turns = ((("system", instructions),) if instructions else ()) + tuple(
        (item.role, item.content) for item in state.items)
    # "inf": no cap of the response's own; the reply ends at its end of turn, the server's --max-tokens-limit or
    # the model's context, whichever comes first
    max_new_tokens = context.max_tokens_limit if max_output_tokens == "inf" else max_output_tokens
    request = EngineRequest(
        messages=turns, speak_text=None, speaker=voice if modalities == ("audio",) else None,
        sampling=sampling_params(settings.temperature, settings.top_p, settings.top_k), seed=settings.seed,
        max_new_tokens=max_new_tokens, cache_key=state.id,
    )
    described = {"output_modalities": list(modalities), "max_output_tokens": max_output_tokens,
                 "audio": {"output": {"format": describe_format(out_format, PCM_RATE), "voice": voice}},
                 "metadata": fields.metadata}
    return request, described


async def start_response(state: RealtimeSession, fields: ResponseFields) -> None:
    """Submit the response's request and start streaming it. Its assistant item joins the conversation at once
    (after the items the request answers): a truncate or delete may cut it while it streams."""
    if state.settings.type == "transcription":
        raise EventError("a transcription session transcribes its input audio and makes no responses; open a "
                         "realtime session (session.type \"realtime\") for replies", param="type")
    if state.response is not None:
        raise EventError(f"the conversation already has an active response {state.response_id}; cancel it or wait "
                         "for its response.done", code="conversation_already_has_active_response")
    check_room(state, 1, 0)  # the reply's item
    request, described = _engine_request(state, fields)
    try:
        await state.context.check_room()  # a full server refuses before the prompt is tokenized
        handle = await state.context.submit(request)
    except APIError as exc:
        raise EventError(exc.message, param=exc.param, code=exc.code or "invalid_value",
                         type=exc.type) from None
    is_audio = described["output_modalities"] == ["audio"]
    part = {"type": "output_audio", "transcript": ""} if is_audio else {"type": "output_text", "text": ""}
    item = ConversationItem(new_id("item"), "assistant", "", [part], status="in_progress")
    previous = insert_item(state, item, None)
    cancel_idle(state)
    response_id = new_id("resp")
    state.response_id, state.handle = response_id, handle
    state.stopped.clear()
    state.response = asyncio.create_task(_respond(state, handle, response_id, described, item, previous))


async def cancel_response(state: RealtimeSession, event: ResponseCancel) -> None:
    if state.response is None:
        raise EventError("there is no active response to cancel", code="response_cancel_not_active")
    if event.response_id is not None and event.response_id != state.response_id:
        raise EventError(f"response_id: the active response is {state.response_id}, not {event.response_id!r}",
                         param="response_id", code="response_not_found")
    state.stop_response("client_cancelled")  # its event stream ends; `_respond` reports it cancelled


async def _respond(state: RealtimeSession, handle, response_id: str, described: dict, item: ConversationItem,
                   previous_item_id: str | None) -> None:
    """Stream one response's events into its assistant item (its transcript is the assistant turn). A cancelled
    request (response.cancel, barge-in, the item cut) ends with status "cancelled"; the client leaving cancels
    it."""
    session = state.session
    is_audio = described["output_modalities"] == ["audio"]
    text_key = "transcript" if is_audio else "text"
    response = {"id": response_id, "object": "realtime.response", "conversation_id": state.id, "output": [],
                "status": "in_progress", "status_details": None, "usage": None, **described}
    where = {"response_id": response_id, "item_id": item.id, "output_index": 0, "content_index": 0}
    texts: list[str] = []
    chunks: list | None = [] if is_audio and state.context.aligner is not None else None  # kept to align
    encoder = OutputEncoder(described["audio"]["output"]["format"]["type"])
    final = None
    try:
        await session.send({"type": "response.created", "response": response})
        # as OpenAI does at a response's start; here the streams the server plays at once, and this one's wait
        await session.send({"type": "rate_limits.updated", "rate_limits": [state.context.engine.stream_limits(handle)]})
        added = {**item.event_item(), "content": []}
        await session.send({"type": "response.output_item.added", "response_id": response_id, "output_index": 0,
                            "item": added})
        await session.send({"type": "conversation.item.added", "previous_item_id": previous_item_id,
                            "item": added})
        await session.send({"type": "response.content_part.added", **where,
                            "part": {"type": "audio" if is_audio else "text", text_key: ""}})
        delta_type = "response.output_audio_transcript.delta" if is_audio else "response.output_text.delta"
        async for event in handle.events():
            if item.is_cut:
                break
            if event.error is not None:
                final = event
                break
            if event.text:
                texts.append(event.text)
                item.text_deltas += (event.text,)
                await session.send({"type": delta_type, **where, "delta": event.text})
            if is_audio and event.audio is not None and event.audio.size:
                item.num_samples, item.num_frames = item.num_samples + event.audio.size, event.num_frames
                if chunks is not None:
                    chunks.append(event.audio)
                await session.send({"type": "response.output_audio.delta", **where,
                                    "delta": encoder.encode(event.audio)})
            if event.finish_reason is not None:
                final = event
                break
    finally:
        handle.cancel()
        text = "".join(texts)
        if final is None:
            status, details = "cancelled", {"type": "cancelled", "reason": state.cancel_reason}
        elif final.error is not None:
            status, details = "failed", {"type": "failed", "error": {"type": "server_error", "code": final.error_code,
                                                                      "message": final.error}}
        elif final.finish_reason == "length":
            status, details = "incomplete", {"type": "incomplete", "reason": "max_output_tokens"}
        else:
            status, details = "completed", None
        item.status = "completed" if status == "completed" else "incomplete"
        if not item.is_cut:
            item.content = "".join(item.text_deltas)
            item.parts = [{"type": item.parts[0]["type"], text_key: item.content}]
    if is_audio:
        if final is not None and final.error is None and (tail := encoder.encode(None)):
            await session.send({"type": "response.output_audio.delta", **where, "delta": tail})
        await session.send({"type": "response.output_audio.done", **where})
        done = {"type": "response.output_audio_transcript.done", **where, "transcript": text}
        if chunks and final is not None and final.error is None and not item.is_cut:
            words = await _aligned_words(state, item, text, chunks)
            if words is not None:
                done["words"] = [{"word": w.word, "start": w.start, "end": w.end} for w in words]
        await session.send(done)
    else:
        await session.send({"type": "response.output_text.done", **where, "text": text})
    await session.send({"type": "response.content_part.done", **where,
                        "part": {"type": "audio" if is_audio else "text", text_key: text}})
    await session.send({"type": "response.output_item.done", "response_id": response_id, "output_index": 0,
                        "item": item.event_item()})
    await session.send({"type": "conversation.item.done", "item": item.event_item()})
    response.update(status=status, status_details=details, output=[item.event_item()],
                    usage=_usage(final, is_audio))
    await session.send({"type": "response.done", "response": response})
    # only now may the next response start: its events never interleave with this one's last ones
    state.response, state.response_id, state.handle = None, None, None
    watch_idle(state, item.num_samples * 1000 / PCM_RATE)


async def _aligned_words(state: RealtimeSession, item: ConversationItem, text: str, chunks: list) -> tuple | None:
    """The reply's words and when each is spoken in its audio, by the server's forced aligner (words split at
    spaces and CJK characters), kept in the item for a truncation to cut at a heard word. None when the reply
    cannot be aligned (longer than the aligner's time bins reach), or when the response is stopped first (a
    barge-in does not wait for them: the item still gets its words once they are found, unless it was cut)."""
    num_samples = item.num_samples
    audio = np.concatenate(chunks).astype(np.float32)

    def align():
        try:
            return tuple(state.context.aligner.align((audio, state.context.engine.sample_rate), text, None))
        except ValueError:
            return None

    async def keep():
        words = await run_in_threadpool(align)
        if item.num_samples == num_samples and not item.is_cut:  # (a truncation before they came cut the item)
            item.words = words
        return words

    task = asyncio.ensure_future(keep())
    state.alignments.add(task)
    task.add_done_callback(state.alignments.discard)
    stopped = asyncio.ensure_future(state.stopped.wait())
    try:
        await asyncio.wait((task, stopped), return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopped.cancel()
    return task.result() if task.done() else None


def watch_idle(state: RealtimeSession, audio_ms: float) -> None:
    """With turn detection's idle_timeout_ms: once the reply's audio has played (`audio_ms` after its end) and
    idle_timeout_ms more have passed without the user speaking or another response, the buffered audio is
    committed as a turn (`input_audio_buffer.timeout_triggered`) and answered. Speech or a response cancels
    the wait (`cancel_idle`)."""
    cancel_idle(state)
    config = state.settings.turn_detection
    if config is None or config.idle_timeout_ms is None or state.settings.type != "realtime":
        return
    seconds = (audio_ms + config.idle_timeout_ms) / 1000
    state.turns.idle_timer = asyncio.get_running_loop().create_task(_idle(state, seconds))


def cancel_idle(state: RealtimeSession) -> None:
    timer, state.turns.idle_timer = state.turns.idle_timer, None
    if timer is not None and timer is not asyncio.current_task():
        timer.cancel()


async def _idle(state: RealtimeSession, seconds: float) -> None:
    await asyncio.sleep(seconds)
    state.turns.idle_timer = None
    config, turns = state.settings.turn_detection, state.turns
    if config is None or config.idle_timeout_ms is None or state.response is not None or turns.speech_start is not None:
        return
    rate, item_id, pcm = state.settings.input_rate, new_id("item"), bytes(state.audio_buffer)
    await state.session.send({"type": "input_audio_buffer.timeout_triggered", "item_id": item_id,
                              "audio_start_ms": turns.ms(turns.buffer_start, rate),
                              "audio_end_ms": turns.ms(turns.num_appended, rate)})
    try:
        if pcm:
            state.clear_buffer()
            await commit_audio(state, pcm, item_id)
        await start_response(state, ResponseFields())
    except EventError as exc:
        await state.session.send_error(exc)


def _usage(final, is_audio: bool) -> dict | None:
    if final is None or final.error is not None:
        return None
    audio_tokens = final.num_frames if is_audio else 0
    output_tokens = final.completion_tokens + audio_tokens
    return {"input_tokens": final.prompt_tokens, "output_tokens": output_tokens,
            "total_tokens": final.prompt_tokens + output_tokens,
            "output_token_details": {"text_tokens": final.completion_tokens, "audio_tokens": audio_tokens}}
