"""`/v1/audio/speech`: text spoken in a voice, as a file (wav, pcm, mp3, opus (Ogg) and aac sent as they are
encoded; flac once complete) or as SSE `speech.audio.delta` events (`stream_format: "sse"`: each delta the next
bytes of the response_format's stream, so the deltas joined are one file; flac, which needs the whole signal,
is a 400).

On a Qwen3-Omni / Qwen2.5-Omni model `voice` is one of its speakers. On a Qwen3-TTS model the request also
takes `language` (a language of the model, or "auto"), `instructions` (the voice described in words: required
by VoiceDesign, refused by a model that ignores it) and `task_type` (checked against the model: "CustomVoice"
or "VoiceDesign"); `voice` is a CustomVoice speaker (default: the model's) and sampling fields left out are
the reference's defaults (T 0.9, top-k 50, repetition penalty 1.05; temperature 0: greedy). On a Base model
(`task_type` "Base") the voice is cloned: `voice` names a saved voice (routes/voices.py), or the request
sends a reference recording (`ref_audio`, `ref_text`, `x_vector_only_mode`) or a `speaker_embedding`
(`voices.speech_speaker`); a model of another kind refuses those fields by name. It runs in the same
engine step loop as every other request.

`timestamp_granularities: ["word"]` (an extension, with `stream_format: "sse"`, where the server loads a forced
aligner: `serve --aligner-model`) adds the spoken words' timestamps to `speech.audio.done` as
`words: [{word, start, end}]` (seconds in the audio sent): the aligner's words of `input` on the request's whole
audio, so an agent can cut a reply at the last word its listener heard.

A request whose talker ends before its first frame is still a 200 with a valid file of no audio (a WAV with
an empty data chunk, a FLAC stream without frames, empty PCM, mp3 / opus / aac: no bytes; SSE: the format's
empty stream, then `speech.audio.done`) and says
`X-Finish-Reason: no_audio`."""

from __future__ import annotations

import base64
import re

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from omnimtp.families.qwen3_asr import asr_language
from omnimtp.server.audio import MEDIA_TYPES, STREAMED_FORMATS, StreamEncoder, encode_audio
from omnimtp.server.errors import APIError
from omnimtp.server.requests import EngineRequest
from omnimtp.server.routes.common import (
    QUEUE_POSITION_HEADER,
    collect,
    first_event,
    prepended,
    serving,
    sse,
    stream_error,
)
from omnimtp.server.routes.voices import speech_speaker
from omnimtp.server.schemas import SpeechBatchRequest, SpeechRequest

# How the speech ended ("stop", "length", or "no_audio": the talker ended before its first frame), where it is
# known before the body starts: a whole-file response (flac, or any format without audio) and a stream whose
# request made no audio. A streamed response with audio says it in its last SSE event.
FINISH_REASON_HEADER = "X-Finish-Reason"
_ITEM_PATH = re.compile(r"items\.(\d+)")  # a batch body's schema error at an item: items.2.speed

router = APIRouter()


@router.post("/v1/audio/speech")
async def speech(request: Request):
    context = serving(request)
    engine = context.engine
    body = await context.read_body(request, SpeechRequest)
    context.check_model(body.model)
    if not body.input.strip():
        raise APIError(400, "input: empty text (nothing to speak)", param="input", code="invalid_value")
    fmt, sample_rate = body.response_format, engine.sample_rate
    if body.stream_format == "sse" and fmt not in STREAMED_FORMATS:
        raise APIError(400, f"response_format: SSE deltas stream {', '.join(STREAMED_FORMATS)}, not {fmt} (it needs "
                       "the whole signal)", param="response_format", code="invalid_value")
    speaker = await speech_speaker(context, body)
    words_language = _word_timestamps_language(context, body)
    handle = await context.submit(_engine_request(context, body, speaker))
    # Wait for the first chunk before the headers: a request that ends without audio says so in them, and
    # an engine error before any audio is an error body.
    events = handle.events()
    first = await first_event(handle, request, events)
    events = prepended(first, events)
    headers = {QUEUE_POSITION_HEADER: str(handle.queue_position)}
    if first.finish_reason is not None:
        headers[FINISH_REASON_HEADER] = first.finish_reason
    if body.stream_format == "sse":
        aligned = None if words_language is False else (context.aligner, body.input, words_language, sample_rate)
        return StreamingResponse(_speech_sse(handle, events, fmt, sample_rate, aligned),
                                 media_type="text/event-stream",
                                 headers=headers)
    if fmt in STREAMED_FORMATS and first.finish_reason is None:
        return StreamingResponse(_speech_chunks(handle, events, fmt, sample_rate), media_type=MEDIA_TYPES[fmt],
                                 headers=headers)
    # FLAC needs the whole signal for its header: the body is sent once the audio is complete (as is an empty
    # file of any format, whose length is then known).
    _, samples, final = await collect(handle, request, events)
    headers[FINISH_REASON_HEADER] = final.finish_reason
    return Response(await run_in_threadpool(encode_audio, samples, sample_rate, fmt), media_type=MEDIA_TYPES[fmt],
                    headers=headers)


def _word_timestamps_language(context, body: SpeechRequest):
    """False when the request asks for no word timestamps, else the language the aligner splits `input` in (None:
    by the text's script). 400 naming timestamp_granularities without an aligner or outside SSE, naming language
    for a language the aligner does not know or cannot split here (Japanese, Korean without `omnimtp[cjk]`)."""
    if body.timestamp_granularities is None:
        return False
    if context.aligner is None:
        raise APIError(400, "timestamp_granularities: word timestamps need a forced aligner beside the model, and "
                       "this server has none (serve --aligner-model)", param="timestamp_granularities",
                       code="invalid_value")
    if body.stream_format != "sse":
        raise APIError(400, "timestamp_granularities: word timestamps come in the speech.audio.done event of "
                       'stream_format "sse"', param="timestamp_granularities", code="invalid_value")
    try:
        language = asr_language(body.language, context.aligner.languages)
    except ValueError:  # "auto", a dialect: split by the text's script
        language = None
    try:
        context.aligner.words(body.input, language)
    except ValueError as exc:
        raise APIError(400, str(exc), param="language", code="invalid_value") from None
    return language


def _engine_request(context, body: SpeechRequest, speaker) -> EngineRequest:
    # streamed in every format, so that every format carries the same samples
    return EngineRequest(messages=None, speak_text=body.input, speaker=speaker, sampling=context.speech_sampling(body),
                         seed=body.seed, max_new_tokens=0)


@router.post("/v1/audio/speech/batch")
async def speech_batch(request: Request):
    """Every item a speech request (`stream_format` ignored: each item is a whole file), all queued before any
    is awaited, so the engine steps them as one batch; seeded, each item's audio is the one it gets alone.
    The response lists each item's base64 audio or its error, in order; a bad item does not fail the others."""
    context = serving(request)
    try:
        body = await context.read_body(request, SpeechBatchRequest)
    except APIError as error:  # an item's field spelled as in an item's own error: items[2].speed
        if error.param is not None and (item := _ITEM_PATH.match(error.param)):
            named = f"items[{item.group(1)}]{error.param[item.end():]}"
            error.message = error.message.replace(error.param, named, 1)
            error.param = named
        raise
    handles: list = []
    for index, item in enumerate(body.items):
        try:
            context.check_model(item.model)
            if item.timestamp_granularities is not None:
                raise APIError(400, "timestamp_granularities: word timestamps come with a single SSE speech "
                               "request, not in a batch", param="timestamp_granularities", code="invalid_value")
            if not item.input.strip():
                raise APIError(400, "input: empty text (nothing to speak)", param="input", code="invalid_value")
            speaker = await speech_speaker(context, item)
            handles.append(await context.submit(_engine_request(context, item, speaker)))
        except APIError as error:
            handles.append(_item_error(index, error))
    data = []
    for index, (item, handle) in enumerate(zip(body.items, handles, strict=True)):
        if isinstance(handle, dict):
            data.append(handle)
            continue
        try:
            _, samples, final = await collect(handle, request)
        except APIError as error:
            data.append(_item_error(index, error))
            continue
        # encoded on a worker thread (an mp3 of minutes takes seconds), and only the encoded file is kept
        audio = await run_in_threadpool(_base64_audio, samples, context.engine.sample_rate, item.response_format)
        del samples
        data.append({"index": index, "response_format": item.response_format, "finish_reason": final.finish_reason,
                     "audio": audio})
    return {"object": "list", "data": data}


def _base64_audio(samples, sample_rate: int, fmt: str) -> str:
    return base64.b64encode(encode_audio(samples, sample_rate, fmt)).decode("ascii")


def _item_error(index: int, error: APIError) -> dict:
    return {"index": index, "error": {"status": error.status, "message": error.message, "type": error.type,
                                      "param": None if error.param is None else f"items[{index}].{error.param}",
                                      "code": error.code}}


async def _speech_sse(handle, events, fmt: str, sample_rate: int, aligned=None):
    """OpenAI's speech SSE: `speech.audio.delta` events whose `audio` is the next bytes of the response_format
    stream (PCM16, or the encoder's output: the deltas joined are one file), then `speech.audio.done`; aligned:
    (aligner, text, language, sample_rate) of a request that asked for word timestamps (its audio is kept until
    the end to align it whole)."""
    encoder = StreamEncoder(fmt, sample_rate)
    chunks = []
    try:
        async for event in events:
            if event.error is not None:
                yield sse({"type": "error", "error": stream_error(event)})
                break
            if event.audio is not None and event.audio.size:
                if aligned is not None:
                    chunks.append(event.audio)
                if data := encoder.push(event.audio):
                    yield sse({"type": "speech.audio.delta", "audio": base64.b64encode(data).decode("ascii")})
            if event.finish_reason is not None:
                if data := encoder.finish():
                    yield sse({"type": "speech.audio.delta", "audio": base64.b64encode(data).decode("ascii")})
                usage = {"input_tokens": event.prompt_tokens, "output_tokens": event.num_frames,
                         "total_tokens": event.prompt_tokens + event.num_frames}
                done = {"type": "speech.audio.done", "usage": usage, "finish_reason": event.finish_reason}
                if aligned is not None:
                    done["words"] = await run_in_threadpool(_spoken_words, chunks, *aligned)
                yield sse(done)
                break
    finally:
        handle.cancel()


async def _speech_chunks(handle, events, fmt: str, sample_rate: int):
    encoder = StreamEncoder(fmt, sample_rate)
    try:
        async for event in events:
            if event.error is not None:
                return  # headers are gone; a truncated body is the only signal left (logged by the engine)
            if event.audio is not None and event.audio.size:
                data = encoder.push(event.audio)
                if data:
                    yield data
            if event.finish_reason is not None:
                break
        yield encoder.finish()
    finally:
        handle.cancel()


def _spoken_words(chunks: list, aligner, text: str, language: str | None, sample_rate: int) -> list[dict]:
    """The aligner's words of `text` on the request's whole audio (none without audio)."""
    if not chunks:
        return []
    audio = np.concatenate(chunks).astype(np.float32)
    return [{"word": w.word, "start": w.start, "end": w.end}
            for w in aligner.align((audio, sample_rate), text, language)]
