"""Input audio transcription: each committed audio item's transcript, streamed as it is made."""

from __future__ import annotations

from omnimtp.server.errors import APIError
from omnimtp.server.routes.realtime.state import ConversationItem, RealtimeSession
from omnimtp.server.routes.transcriptions import transcription_request


async def transcribe_item(state: RealtimeSession, item: ConversationItem, transcription: dict) -> None:
    """A committed audio item's transcript, as a background request of the engine (it never delays a
    response's first audio): `conversation.item.input_audio_transcription.delta` events, then `.completed`
    (the transcript is stored on the item) or `.failed`."""
    session, where = state.session, {"item_id": item.id, "content_index": 0}
    request = transcription_request(state.context, item.content[0]["audio"], transcription["language"],
                                    transcription["prompt"], 0.0, None, is_streamed=True, is_background=True)
    texts, final = [], None
    try:
        handle = await state.context.submit(request)
    except APIError as exc:
        final = exc
    else:
        try:
            async for event in handle.events():
                if event.error is not None or event.finish_reason is not None:
                    final = event
                    break
                if event.text:
                    texts.append(event.text)
                    await session.send({"type": "conversation.item.input_audio_transcription.delta", **where,
                                        "delta": event.text})
        finally:
            handle.cancel()  # a no-op once finished
    if final is None or isinstance(final, APIError) or final.error is not None:
        message = final.message if isinstance(final, APIError) else getattr(final, "error", None) or "no result"
        await session.send({"type": "conversation.item.input_audio_transcription.failed", **where,
                            "error": {"type": "transcription_error", "code": None, "message": message,
                                      "param": None}})
        return
    item.parts[0]["transcript"] = transcript = "".join(texts).strip()
    await session.send({"type": "conversation.item.input_audio_transcription.completed", **where,
                        "transcript": transcript, "usage": {
                            "type": "tokens", "input_tokens": final.prompt_tokens,
                            "output_tokens": final.completion_tokens,
                            "total_tokens": final.prompt_tokens + final.completion_tokens}})
