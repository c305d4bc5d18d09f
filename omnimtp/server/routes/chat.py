"""`/v1/chat/completions`: a chat reply as text, or text and speech (`modalities: ["text", "audio"]`).

Chat media (input_audio and image_url parts of user turns) is decoded here, off the event loop, and
the processor runs before the request is queued: bad media is a 400 naming the part
(`messages.0.content.1.input_audio.data`), never a failed generation.
"""

from __future__ import annotations

import base64
import time
import uuid

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from starlette.concurrency import run_in_threadpool

from omnimtp.media import MediaError, MediaLimits, decode_audio, decode_base64, decode_image, decode_image_url
from omnimtp.server.audio import encode_audio
from omnimtp.server.errors import APIError
from omnimtp.server.requests import EngineRequest
from omnimtp.server.routes.common import (
    QUEUE_POSITION_HEADER,
    b64_pcm16,
    collect,
    logprob_items,
    sampling_params,
    serving,
    sse,
    stream_error,
)
from omnimtp.server.routes.voices import check_voice
from omnimtp.server.schemas import ChatCompletionRequest, ChatMessage, InputAudioPart, TextPart

# How long a returned audio id is said to live (we keep nothing; the field is part of the format).
_AUDIO_TTL_S = 3600

router = APIRouter()


@router.post("/v1/chat/completions")
async def chat_completions(request: Request):
    context = serving(request)
    engine, max_tokens_limit = context.engine, context.max_tokens_limit
    body = await context.read_body(request, ChatCompletionRequest)
    model_name = context.check_model(body.model)
    context.check_chat()
    param, max_tokens = "max_tokens", body.max_tokens
    if body.max_completion_tokens is not None:
        param, max_tokens = "max_completion_tokens", body.max_completion_tokens
    if max_tokens is not None and not 1 <= max_tokens <= max_tokens_limit:
        raise APIError(400, f"{param} must be in [1, {max_tokens_limit}], got {max_tokens}", param=param,
                       code="invalid_value")
    if "text" not in body.modalities or len(set(body.modalities)) != len(body.modalities):
        raise APIError(400, 'modalities must be ["text"] or ["text", "audio"]', param="modalities",
                       code="invalid_value")
    speaker, audio_format = None, None
    if body.wants_audio:
        if body.audio is None:
            raise APIError(400, 'audio is required when modalities include "audio"', param="audio",
                           code="missing_required_parameter")
        speaker = check_voice(context, body.audio.voice, "audio.voice")
        audio_format = body.audio.format
    elif body.audio is not None:
        raise APIError(400, 'audio is given but modalities do not include "audio": add it, or drop audio',
                       param="audio", code="invalid_value")
    if not any(message.role == "user" and (message.text() or message.has_media) for message in body.messages):
        raise APIError(400, "messages must contain a non-empty user message", param="messages",
                       code="invalid_value")
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs: needs logprobs: true", param="top_logprobs", code="invalid_value")
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    limits = engine.media_limits
    if any(message.has_media for message in body.messages):
        _check_media(body.messages, limits, has_processor=engine.audio_sampling_rate is not None)
        try:
            messages = await run_in_threadpool(_decoded_messages, body.messages, limits, engine.audio_sampling_rate)
        except MediaError as exc:
            raise APIError(400, str(exc), param=exc.param, code="invalid_value") from None
    else:
        messages = _decoded_messages(body.messages, limits, None)
    engine_request = EngineRequest(
        messages=messages,
        speak_text=None,
        speaker=speaker,
        sampling=sampling_params(body.temperature, body.top_p, body.top_k),
        seed=body.seed,
        # without max_tokens: the model's default cap, the one `OmniPipeline` applies (at most the limit)
        max_new_tokens=max_tokens or min(engine.config.max_new_tokens, max_tokens_limit),
        is_streamed=bool(body.stream),
        logprobs=logprobs,
    )
    handle = await context.submit(engine_request)
    completion_id = f"chatcmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    if body.stream:
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        return StreamingResponse(
            _chat_stream(handle, completion_id, created, model_name, speaker is not None, include_usage,
                         engine.family.tokenizer if logprobs is not None else None),
            media_type="text/event-stream", headers={QUEUE_POSITION_HEADER: str(handle.queue_position)},
        )
    token_logprobs = []
    text, samples, final = await collect(handle, request, logprobs=token_logprobs)
    message: dict = {"role": "assistant", "content": text, "refusal": None}
    if speaker is not None:
        audio_bytes = encode_audio(samples, engine.sample_rate, audio_format)
        message["audio"] = {
            "id": f"audio_{uuid.uuid4().hex}",
            "data": base64.b64encode(audio_bytes).decode("ascii"),
            "expires_at": created + _AUDIO_TTL_S,
            "transcript": text,
        }
    return {
        "id": completion_id,
        "object": "chat.completion",
        "created": created,
        "model": model_name,
        "choices": [{"index": 0, "message": message, "finish_reason": final.finish_reason,
                     "logprobs": None if logprobs is None else _choice_logprobs(engine.family.tokenizer,
                                                                                 token_logprobs)}],
        "usage": final.usage(audio=speaker is not None),
    }


def _check_media(messages: list[ChatMessage], limits: MediaLimits, has_processor: bool) -> None:
    """Refuse media a request cannot have before any of it is decoded: media outside user turns (the
    model reads media in user turns), media for a model without a processor, too many parts."""
    num_parts = 0
    for i, message in enumerate(messages):
        for j, part in enumerate(message.content):
            if isinstance(part, TextPart):
                continue
            param = f"messages.{i}.content.{j}"
            if message.role != "user":
                raise APIError(400, f"{param}: {part.type} parts are only read in user messages, not in "
                               f"{message.role} messages", param=param, code="invalid_value")
            if not has_processor:
                raise APIError(400, f"{param}: this model has no processor (preprocessor_config.json) to read "
                               f"{part.type} parts", param=param, code="invalid_value")
            num_parts += 1
    if num_parts > limits.max_parts:
        raise APIError(400, f"messages: {num_parts} media parts is over the limit of {limits.max_parts}",
                       param="messages", code="invalid_value")


def _decoded_messages(messages: list[ChatMessage], limits: MediaLimits, sampling_rate: int | None) -> tuple:
    """The engine's chat turns: (role, text) for a text turn, (role, parts) with the media decoded
    (`EngineRequest.messages`). Raises MediaError naming the part."""
    turns = []
    for i, message in enumerate(messages):
        if not message.has_media:
            turns.append((message.role, message.text()))
            continue
        parts = []
        for j, part in enumerate(message.content):
            param = f"messages.{i}.content.{j}"
            if isinstance(part, TextPart):
                parts.append({"type": "text", "text": part.text})
            elif isinstance(part, InputAudioPart):
                param += ".input_audio.data"
                data = decode_base64(part.input_audio.data, param)
                parts.append({"type": "audio", "audio": decode_audio(data, part.input_audio.format, sampling_rate,
                                                                     limits, param)})
            else:
                param += ".image_url.url"
                parts.append({"type": "image", "image": decode_image(decode_image_url(part.image_url.url, param),
                                                                     limits, param)})
        turns.append((message.role, tuple(parts)))
    return tuple(turns)


def _choice_logprobs(tokenizer, logprobs) -> dict:
    """A choice's `logprobs` (OpenAI's chat shape): each reply token's, with its `top_logprobs`."""
    return {"content": logprob_items(tokenizer, logprobs, with_top=True), "refusal": None}


async def _chat_stream(handle, completion_id, created, model_id, with_audio, include_usage, tokenizer=None):
    """The reply as chunks; tokenizer: given when the request asked for logprobs (each content chunk with its
    tokens')."""
    def chunk(delta: dict, finish_reason=None, usage=None, logprobs=None) -> bytes:
        choices = [{"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": logprobs}]
        payload = {"id": completion_id, "object": "chat.completion.chunk", "created": created, "model": model_id,
                   "choices": choices}
        if usage is not None:
            payload["choices"] = []
            payload["usage"] = usage
        return sse(payload)

    audio_id = f"audio_{uuid.uuid4().hex}"
    try:
        yield chunk({"role": "assistant", "content": ""})
        async for event in handle.events():
            if event.error is not None:
                yield sse({"error": stream_error(event)})
                break
            if event.text or (tokenizer is not None and event.logprobs):
                logprobs = None if tokenizer is None else _choice_logprobs(tokenizer, event.logprobs)
                yield chunk({"content": event.text}, logprobs=logprobs)
            if with_audio and (event.audio is not None or event.text):
                audio = {"id": audio_id, "transcript": event.text}
                if event.audio is not None:
                    audio["data"] = b64_pcm16(event.audio)
                yield chunk({"audio": audio})
            if event.finish_reason is not None:
                yield chunk({}, finish_reason=event.finish_reason)
                if include_usage:
                    yield chunk({}, usage=event.usage(audio=with_audio))
                break
        yield sse("[DONE]")
    finally:
        handle.cancel()
