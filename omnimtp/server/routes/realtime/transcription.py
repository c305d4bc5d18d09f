"""Input audio transcription: each committed audio item's transcript, streamed as it is made, by a `Recognizer`.

A recognizer is what hears a turn: an async generator of the transcript's text deltas as they are made, then
one `Recognized` (the usage). `thinker_recognizer`, the served model's thinker answering its family's ASR prompt
(routes/transcriptions.py's) as a low-priority request of the engine — an omni model's, or a Qwen3-ASR model's,
which serves transcription sessions only — is the one there is; a dedicated
speech recognizer (a streaming ASR model) plugs in as another function of the same shape, set on the session
(`RealtimeSession.recognizer`; None: the thinker):

    async def recognizer(context, audio, language, prompt):   # audio: float32 at the processor's rate
        yield "Hello"; yield " there"                          # text deltas
        yield Recognized(input_tokens=..., output_tokens=...)  # the end; raise RecognitionError on failure
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import numpy as np

from omnimtp.server.errors import APIError
from omnimtp.server.routes.common import ServingContext
from omnimtp.server.routes.realtime.state import ConversationItem, RealtimeSession
from omnimtp.server.routes.transcriptions import transcription_request


@dataclass(frozen=True)
class Recognized:
    """The end of a recognition: its usage in tokens."""

    input_tokens: int
    output_tokens: int


class RecognitionError(Exception):
    """A recognition that could not finish (its message goes to the client's `.failed` event)."""


Recognizer = Callable[[ServingContext, np.ndarray, str | None, str | None], AsyncIterator[str | Recognized]]


async def thinker_recognizer(context: ServingContext, audio: np.ndarray, language: str | None,
                             prompt: str | None) -> AsyncIterator[str | Recognized]:
    """The served model's thinker as the recognizer: greedy, as a background request of the engine (it never
    delays a response's first audio)."""
    request = transcription_request(context, audio, language, prompt, 0.0, None, is_streamed=True,
                                    is_background=True)
    try:
        handle = await context.submit(request)
    except APIError as exc:
        raise RecognitionError(exc.message) from None
    deltas = context.engine.family.transcript_deltas(language)  # (a Qwen3-ASR reply's language tag held back)
    try:
        async for event in handle.events():
            if event.error is not None:
                raise RecognitionError(event.error)
            if event.text and (delta := deltas.push(event.text)):
                yield delta
            if event.finish_reason is not None:
                if rest := deltas.finish():
                    yield rest
                yield Recognized(event.prompt_tokens, event.completion_tokens)
                return
    finally:
        handle.cancel()  # a no-op once finished
    raise RecognitionError("no result")


async def transcribe_item(state: RealtimeSession, item: ConversationItem, transcription: dict, live=None) -> None:
    """A committed audio item's transcript by the session's recognizer, or by the turn's live recognition
    (`live.LiveRecognition`, which heard it as it came): `conversation.item.input_audio_transcription.delta`
    events, then `.completed` (the transcript is stored on the item) or `.failed`."""
    session, where = state.session, {"item_id": item.id, "content_index": 0}
    recognizer = state.recognizer or thinker_recognizer
    hearing = state.context.hearing(transcription["model"])  # the model named (a recognizer beside: by default)
    texts, final = [], None
    try:
        pieces = live.finish() if live is not None else recognizer(
            hearing, item.content[0]["audio"], transcription["language"], transcription["prompt"])
        async for piece in pieces:
            if isinstance(piece, Recognized):
                final = piece
                break
            texts.append(piece)
            await session.send({"type": "conversation.item.input_audio_transcription.delta", **where,
                                "delta": piece})
        if final is None:
            raise RecognitionError("the recognizer ended without a result")
    except RecognitionError as exc:
        await session.send({"type": "conversation.item.input_audio_transcription.failed", **where,
                            "error": {"type": "transcription_error", "code": None, "message": str(exc),
                                      "param": None}})
        return
    item.parts[0]["transcript"] = transcript = "".join(texts).strip()
    await session.send({"type": "conversation.item.input_audio_transcription.completed", **where,
                        "transcript": transcript, "usage": {
                            "type": "tokens", "input_tokens": final.input_tokens,
                            "output_tokens": final.output_tokens,
                            "total_tokens": final.input_tokens + final.output_tokens}})
