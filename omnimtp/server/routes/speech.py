"""`/v1/audio/speech`: text spoken in a voice, as a whole file (wav, pcm, flac) or streamed (raw audio
chunks, or SSE `speech.audio.delta` events)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse

from omnimtp.server.audio import MEDIA_TYPES, encode_audio, streaming_wav_header, to_pcm16
from omnimtp.server.routes.common import b64_pcm16, collect, error_event, sampling_params, serving, sse
from omnimtp.server.scheduler import EngineRequest
from omnimtp.server.schemas import SpeechRequest

router = APIRouter()


@router.post("/v1/audio/speech")
async def speech(request: Request):
    context = serving(request)
    engine = context.engine
    body = await context.read_body(request, SpeechRequest)
    context.check_model(body.model)
    speaker = context.check_voice(body.voice, "voice")
    engine_request = EngineRequest(
        messages=None,
        speak_text=body.input,
        speaker=speaker,
        sampling=sampling_params(body.temperature, body.top_p, body.top_k),
        seed=body.seed,
        max_new_tokens=0,
    )  # streamed in every format, so that every format carries the same samples
    handle = await context.submit(engine_request)
    fmt = body.response_format
    if body.stream_format == "sse":
        return StreamingResponse(_speech_sse(handle), media_type="text/event-stream")
    if fmt in ("pcm", "wav"):
        return StreamingResponse(_speech_chunks(handle, fmt, engine.sample_rate), media_type=MEDIA_TYPES[fmt])
    # FLAC needs the whole signal for its header: the body is sent once the audio is complete.
    _, samples, _ = await collect(handle, request)
    return Response(encode_audio(samples, engine.sample_rate, fmt), media_type=MEDIA_TYPES[fmt])


async def _speech_sse(handle):
    try:
        async for event in handle.events():
            if event.error is not None:
                yield sse({"type": "error", "error": error_event(event.error)})
                break
            if event.audio is not None and event.audio.size:
                yield sse({"type": "speech.audio.delta", "audio": b64_pcm16(event.audio)})
            if event.finish_reason is not None:
                usage = {"input_tokens": event.prompt_tokens, "output_tokens": event.num_frames,
                         "total_tokens": event.prompt_tokens + event.num_frames}
                yield sse({"type": "speech.audio.done", "usage": usage})
                break
    finally:
        handle.cancel()


async def _speech_chunks(handle, fmt: str, sample_rate: int):
    try:
        if fmt == "wav":
            yield streaming_wav_header(sample_rate)
        async for event in handle.events():
            if event.error is not None:
                break  # headers are gone; a truncated body is the only signal left (logged by the engine)
            if event.audio is not None and event.audio.size:
                yield to_pcm16(event.audio).tobytes()
            if event.finish_reason is not None:
                break
    finally:
        handle.cancel()
