"""`/v1/audio/transcriptions`: the words spoken in an uploaded file (OpenAI's multipart route), heard by the
served model's thinker alone (no talker) answering its family's ASR prompt (`ChatText.transcription_messages`);
it runs in the same engine step loop as every other request.

Form fields: `file` (required; any format libsndfile reads, within the server's audio limits), `model`,
`language` (a hint: an ISO-639-1 code), `prompt` (context), `response_format` (`json`, `text` or
`verbose_json`), `temperature` (0, the default: greedy), `stream` (`true`: SSE `transcript.text.delta` events,
then `transcript.text.done`), `timestamp_granularities[]` (`segment` only) and `seed` (an extension: seeded
sampling repeats). The model writes no timestamps: verbose_json has one segment, the whole text over the whole
audio. A model without a thinker (Qwen3-TTS) answers 400 naming `model`.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import UploadFile

from omnimtp.families.text import transcription_language
from omnimtp.media import MediaError, decode_audio
from omnimtp.server.errors import APIError
from omnimtp.server.guard import read_form
from omnimtp.server.routes.common import ServingContext, collect, sampling_params, serving, sse, stream_error
from omnimtp.server.scheduler import EngineRequest
from omnimtp.server.schemas import INT64_MAX, INT64_MIN

router = APIRouter()

RESPONSE_FORMATS = ("json", "text", "verbose_json")
_FIELDS = ("model", "language", "prompt", "response_format", "temperature", "stream", "timestamp_granularities[]",
           "seed")
_BOOLEANS = {"true": True, "false": False, "1": True, "0": False}


@router.post("/v1/audio/transcriptions")
async def transcriptions(request: Request):
    context = serving(request)
    engine = context.engine
    upload, fields = await _read_form(request, context.max_body_bytes)
    context.check_model(fields.get("model"))
    context.check_chat()
    if engine.audio_sampling_rate is None:
        raise APIError(400, f"the model {engine.model_id!r} has no audio processor to hear audio", param="model",
                       code="model_not_supported")
    response_format = fields.get("response_format", "json")
    if response_format not in RESPONSE_FORMATS:
        raise APIError(400, f"response_format must be one of {', '.join(RESPONSE_FORMATS)}, got "
                       f"{response_format[:32]!r}", param="response_format", code="invalid_value")
    temperature = _number(fields, "temperature", 0.0, 0.0, 2.0, float)
    seed = _number(fields, "seed", None, INT64_MIN, INT64_MAX, int)  # any int64, as every route takes
    is_streamed = _boolean(fields, "stream")
    granularity = fields.get("timestamp_granularities[]", "segment")
    if granularity != "segment":
        raise APIError(400, f"timestamp_granularities[]: only 'segment' (the model writes no word timestamps), got "
                       f"{granularity[:32]!r}", param="timestamp_granularities[]", code="invalid_value")
    language, prompt = fields.get("language"), fields.get("prompt")
    try:
        language_name = transcription_language(language)
        engine.family.transcription_messages(None, language, prompt)  # checks prompt before the audio is read
    except ValueError as exc:
        raise APIError(400, str(exc), param=str(exc).partition(":")[0], code="invalid_value") from None
    try:
        samples = await run_in_threadpool(decode_audio, upload, None, engine.audio_sampling_rate,
                                          engine.media_limits, "file")
    except MediaError as exc:
        raise APIError(400, str(exc), param=exc.param, code="invalid_value") from None
    try:
        handle = await context.submit(transcription_request(context, samples, language, prompt, temperature, seed,
                                                            is_streamed=is_streamed))
    except APIError as exc:
        if exc.param == "messages":  # the ASR instruction around the audio: too long is the file's, or the prompt's
            is_prompt = prompt is not None and await run_in_threadpool(_is_prompt_too_long, engine, language, prompt)
            exc.param = "prompt" if is_prompt else "file"
        raise
    if is_streamed:
        return StreamingResponse(_transcript_stream(handle), media_type="text/event-stream")
    text, _, final = await collect(handle, request)
    text = text.strip()
    if response_format == "text":
        return PlainTextResponse(text)
    if response_format == "json":
        return {"text": text, "usage": _usage(final)}
    duration = samples.shape[0] / engine.audio_sampling_rate
    return {
        "task": "transcribe", "language": None if language_name is None else language_name.lower(),
        "duration": duration, "text": text,
        "segments": [{"id": 0, "seek": 0, "start": 0.0, "end": duration, "text": text, "temperature": temperature}],
        "usage": _usage(final),
    }


def _is_prompt_too_long(engine, language: str | None, prompt: str) -> bool:
    """Whether the ASR messages without their audio are already over the prompt-token limit: the prompt's fault."""
    messages = engine.family.transcription_messages(None, language, prompt)
    messages[-1] = {"role": "user", "content": messages[-1]["content"][1]["text"]}
    return len(engine.family.chat_ids(messages)) > engine.max_prompt_tokens


def transcription_request(context: ServingContext, samples, language: str | None, prompt: str | None,
                          temperature: float, seed: int | None, *, is_streamed: bool,
                          is_background: bool = False) -> EngineRequest:
    """The engine request that transcribes `samples` (float32 at the processor's rate): the family's ASR
    messages, text only (no speaker), with the model's reply cap (at most the server's limit) of tokens."""
    engine = context.engine
    messages = engine.family.transcription_messages(samples, language, prompt)
    turns = tuple((m["role"], m["content"] if isinstance(m["content"], str) else tuple(m["content"]))
                  for m in messages)
    return EngineRequest(messages=turns, speak_text=None, speaker=None,
                         sampling=sampling_params(temperature, 1.0, None), seed=seed,
                         max_new_tokens=min(engine.config.max_new_tokens, context.max_tokens_limit),
                         is_streamed=is_streamed,
                         is_background=is_background)


async def _transcript_stream(handle):
    texts = []
    try:
        async for event in handle.events():
            if event.error is not None:
                yield sse({"type": "error", "error": stream_error(event)})
                break
            if event.text:
                texts.append(event.text)
                yield sse({"type": "transcript.text.delta", "delta": event.text})
            if event.finish_reason is not None:
                yield sse({"type": "transcript.text.done", "text": "".join(texts).strip(), "usage": _usage(event)})
                break
    finally:
        handle.cancel()  # a no-op once finished; frees the engine row when the client leaves mid-stream


def _usage(event) -> dict:
    """OpenAI's token usage of a transcription: the prompt (audio rows included) in, the transcript out."""
    return {"type": "tokens", "input_tokens": event.prompt_tokens, "output_tokens": event.completion_tokens,
            "total_tokens": event.prompt_tokens + event.completion_tokens}


async def _read_form(request: Request, max_body_bytes: int) -> tuple[bytes, dict[str, str]]:
    """The uploaded file's bytes and the other fields. 400 naming the field: no file, an empty one, a field that
    is not OpenAI's (or given twice)."""
    form = await read_form(request, max_body_bytes)  # 415 for a Content-Type that is not a multipart form
    fields, upload = {}, None
    try:
        for key, value in form.multi_items():
            if isinstance(value, UploadFile):
                if key != "file" or upload is not None:
                    raise APIError(400, f"{key}: one file part, named file", param=key, code="invalid_value")
                upload = await value.read()
                continue
            if key == "file":
                raise APIError(400, "file: must be a file part of the form", param="file", code="invalid_value")
            if key not in _FIELDS:
                raise APIError(400, f"{key}: not a field of this route; fields: file, {', '.join(_FIELDS)}",
                               param=key, code="invalid_value")
            if key in fields:
                raise APIError(400, f"{key}: given twice", param=key, code="invalid_value")
            fields[key] = value
    finally:
        await form.close()
    if upload is None:
        raise APIError(400, "file: required: the audio to transcribe", param="file",
                       code="missing_required_parameter")
    if not upload:
        raise APIError(400, "file: is empty", param="file", code="invalid_value")
    return upload, fields


def _number(fields: dict, name: str, default, low, high, kind):
    if name not in fields:
        return default
    try:
        value = kind(fields[name])
    except ValueError:
        value = None
    if value is None or not low <= value <= high:
        raise APIError(400, f"{name} must be a number in [{low}, {high}], got {fields[name][:32]!r}", param=name,
                       code="invalid_value")
    return value


def _boolean(fields: dict, name: str) -> bool:
    value = fields.get(name, "false").strip().lower()
    if value not in _BOOLEANS:
        raise APIError(400, f"{name}: expected true or false, got {fields[name][:32]!r}", param=name,
                       code="invalid_value")
    return _BOOLEANS[value]
