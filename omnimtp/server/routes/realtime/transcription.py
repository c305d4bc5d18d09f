"""Input audio transcription: each committed audio item's transcript, streamed as it is made, by a `Recognizer`.

A recognizer is what hears a turn: an async generator of the transcript's text deltas as they are made (a str,
or a `TranscriptDelta` with its tokens' logprobs), then one `Recognized` (the usage). `thinker_recognizer`, the
served model's thinker answering its family's ASR prompt (routes/transcriptions.py's) as a low-priority request of
the engine — an omni model's, or a Qwen3-ASR model's, which serves transcription sessions only — is the one there
is; a dedicated
speech recognizer (a streaming ASR model) plugs in as another function of the same shape, set on the session
(`RealtimeSession.recognizer`; None: the thinker):

    async def recognizer(context, audio, language, prompt, logprobs=False):  # audio: float32, the processor's rate
        yield "Hello"; yield " there"                          # text deltas (with logprobs: TranscriptDelta)
        yield Recognized(input_tokens=..., output_tokens=...)  # the end; raise RecognitionError on failure

With the session's `include: ["item.input_audio_transcription.logprobs"]` the `.delta` events carry their tokens'
logprobs and `.completed` all of them (OpenAI's `{token, logprob, bytes}`, routes/transcriptions.py's).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import numpy as np

from omnimtp.families.text import TranscriptTokens
from omnimtp.server.errors import APIError
from omnimtp.server.routes.common import ServingContext, logprob_items
from omnimtp.server.routes.realtime.state import ConversationItem, RealtimeSession
from omnimtp.server.routes.transcriptions import transcription_request

INCLUDE_LOGPROBS = "item.input_audio_transcription.logprobs"


@dataclass(frozen=True)
class Recognized:
    """The end of a recognition: its usage in tokens."""

    input_tokens: int
    output_tokens: int


@dataclass(frozen=True)
class TranscriptDelta:
    """A text delta of a transcript with its tokens' logprobs ({token, logprob, bytes} each; possibly none, and
    the text possibly empty: tokens whose text is none of the transcript's)."""

    text: str
    logprobs: tuple[dict, ...] = ()


class RecognitionError(Exception):
    """A recognition that could not finish (its message goes to the client's `.failed` event)."""


Recognizer = Callable[..., AsyncIterator[str | TranscriptDelta | Recognized]]


async def thinker_recognizer(context: ServingContext, audio: np.ndarray, language: str | None,
                             prompt: str | None, logprobs: bool = False) -> AsyncIterator[TranscriptDelta | Recognized]:
    """The served model's thinker as the recognizer: greedy, as a background request of the engine (it never
    delays a response's first audio); logprobs: each delta with its tokens' (the last, possibly empty, with the
    rest)."""
    request = transcription_request(context, audio, language, prompt, 0.0, None, is_streamed=True,
                                    is_background=True, has_logprobs=logprobs)
    try:
        handle = await context.submit(request)
    except APIError as exc:
        raise RecognitionError(exc.message) from None
    family = context.engine.family
    deltas = family.transcript_deltas(language)  # (a Qwen3-ASR reply's language tag held back)
    tokens, pending = TranscriptTokens(deltas.held_tag), []
    try:
        async for event in handle.events():
            if event.error is not None:
                raise RecognitionError(event.error)
            if event.logprobs:
                pending += tokens.push(logprob_items(family.tokenizer, event.logprobs))
            if event.text and (delta := deltas.push(event.text)):
                yield TranscriptDelta(delta, tuple(pending))
                pending = []
            if event.finish_reason is not None:
                pending += tokens.finish()
                if (rest := deltas.finish()) or pending:
                    yield TranscriptDelta(rest, tuple(pending))
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
    has_logprobs = INCLUDE_LOGPROBS in state.settings.include
    texts, logprobs, final = [], [], None
    try:
        pieces = live.finish() if live is not None else recognizer(
            hearing, item.content[0]["audio"], transcription["language"], transcription["prompt"],
            logprobs=has_logprobs)
        async for piece in pieces:
            if isinstance(piece, Recognized):
                final = piece
                break
            delta = piece if isinstance(piece, TranscriptDelta) else TranscriptDelta(piece)
            texts.append(delta.text)
            event = {"type": "conversation.item.input_audio_transcription.delta", **where, "delta": delta.text}
            if has_logprobs:
                event["logprobs"] = list(delta.logprobs)
                logprobs += delta.logprobs
            await session.send(event)
        if final is None:
            raise RecognitionError("the recognizer ended without a result")
    except RecognitionError as exc:
        await session.send({"type": "conversation.item.input_audio_transcription.failed", **where,
                            "error": {"type": "transcription_error", "code": None, "message": str(exc),
                                      "param": None}})
        return
    item.parts[0]["transcript"] = transcript = "".join(texts).strip()
    completed = {"type": "conversation.item.input_audio_transcription.completed", **where,
                 "transcript": transcript, "usage": {
                     "type": "tokens", "input_tokens": final.input_tokens, "output_tokens": final.output_tokens,
                     "total_tokens": final.input_tokens + final.output_tokens}}
    if has_logprobs:
        completed["logprobs"] = logprobs
    await session.send(completed)
