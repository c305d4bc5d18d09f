"""`/v1/audio/transcriptions`: the words spoken in an uploaded file (OpenAI's multipart route), heard by the
served model's thinker alone (no talker) answering its family's ASR prompt (`ChatText.transcription_messages`;
a Qwen3-ASR model's own prompt); it runs in the same engine step loop as every other request.

Form fields: `file` (required; any format libsndfile reads, within the server's audio limits), `model`,
`language` (an ISO-639-1 code or a language name: a hint to an omni model, the forced language of a Qwen3-ASR
model, which otherwise names the language it heard), `prompt` (context), `response_format` (`json`, `text` or
`verbose_json`), `temperature` (0, the default: greedy), `stream` (`true`: SSE `transcript.text.delta` events,
then `transcript.text.done`), `timestamp_granularities[]` (`segment`, and `word` where the server has a forced
aligner beside its model: `serve --aligner-model`; verbose_json only), `include[]` (`logprobs`, json only: the
transcript's tokens as `logprobs: [{token, logprob, bytes}]`, the log-softmax of the model's raw logits at each
step; streamed, each delta carries its tokens' and the done event all) and `seed` (an extension: seeded sampling
repeats). The model writes no timestamps: verbose_json has one segment, the whole text over the whole audio, and
with word timestamps `words: [{word, start, end}]` (seconds), the aligner's. A model that does not hear
(Qwen3-TTS) answers 400 naming `model`.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import UploadFile

from omnimtp.families.text import TranscriptTokens
from omnimtp.media import MediaError, decode_audio
from omnimtp.server.errors import APIError
from omnimtp.server.guard import read_form
from omnimtp.server.requests import EngineRequest
from omnimtp.server.routes.common import (
    ServingContext,
    collect,
    logprob_items,
    sampling_params,
    serving,
    sse,
    stream_error,
)
from omnimtp.server.schemas import INT64_MAX, INT64_MIN
from omnimtp.tokenizer import prompt_tokenizer

router = APIRouter()

RESPONSE_FORMATS = ("json", "text", "verbose_json")
_FIELDS = ("model", "language", "prompt", "response_format", "temperature", "stream", "timestamp_granularities[]",
           "include[]", "include", "seed")
_BOOLEANS = {"true": True, "false": False, "1": True, "0": False}
GRANULARITIES = ("segment", "word")
_REPEATED = ("timestamp_granularities[]", "include[]", "include")  # fields given once per value
INCLUDES = ("logprobs",)


@router.post("/v1/audio/transcriptions")
async def transcriptions(request: Request):
    context = serving(request)
    upload, fields = await _read_form(request, context.max_body_bytes)
    context = context.hearing(fields.get("model"))  # (the recognizer served beside the model, if it is named)
    engine = context.engine
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
    has_words = _has_word_timestamps(context, fields.get("timestamp_granularities[]", ["segment"]), response_format)
    has_logprobs = _has_logprobs([*fields.get("include[]", []), *fields.get("include", [])], response_format)
    language, prompt = fields.get("language"), fields.get("prompt")
    try:
        engine.family.transcription_messages(None, language, prompt)  # checks both before the audio is read
    except ValueError as exc:
        raise APIError(400, str(exc), param=str(exc).partition(":")[0], code="invalid_value") from None
    try:
        samples = await run_in_threadpool(decode_audio, upload, None, engine.audio_sampling_rate,
                                          engine.media_limits, "file")
    except MediaError as exc:
        raise APIError(400, str(exc), param=exc.param, code="invalid_value") from None
    try:
        handle = await context.submit(transcription_request(context, samples, language, prompt, temperature, seed,
                                                            is_streamed=is_streamed, has_logprobs=has_logprobs))
    except APIError as exc:
        if exc.param == "messages":  # the ASR instruction around the audio: too long is the file's, or the prompt's
            is_prompt = prompt is not None and await run_in_threadpool(_is_prompt_too_long, engine, language, prompt)
            exc.param = "prompt" if is_prompt else "file"
        raise
    if is_streamed:
        return StreamingResponse(_transcript_stream(handle, engine.family, language, has_logprobs),
                                 media_type="text/event-stream")
    logprobs = []
    reply, _, final = await collect(handle, request, logprobs=logprobs)
    heard, text = engine.family.parse_transcript(reply, language)
    if response_format == "text":
        return PlainTextResponse(text)
    if response_format == "json":
        body = {"text": text, "usage": _usage(final)}
        if has_logprobs:
            tokens = TranscriptTokens(engine.family.transcript_deltas(language).held_tag)
            body["logprobs"] = [*tokens.push(logprob_items(engine.family.tokenizer, logprobs)), *tokens.finish()]
        return body
    duration = samples.shape[0] / engine.audio_sampling_rate
    body = {
        "task": "transcribe", "language": None if heard is None else heard.lower(), "duration": duration, "text": text,
        "segments": [{"id": 0, "seek": 0, "start": 0.0, "end": duration, "text": text, "temperature": temperature}],
        "usage": _usage(final),
    }
    if has_words:
        words = await run_in_threadpool(_aligned_words, context.aligner, samples, engine.audio_sampling_rate, text,
                                        heard)
        body["words"] = [{"word": w.word, "start": w.start, "end": w.end} for w in words]
    return body


def _has_word_timestamps(context: ServingContext, granularities: list[str], response_format: str) -> bool:
    """Whether the client asked for word timestamps; 400 naming timestamp_granularities[] for an unknown
    granularity, for words without an aligner beside the model or outside verbose_json (as OpenAI's)."""
    for granularity in granularities:
        if granularity not in GRANULARITIES:
            raise APIError(400, f"timestamp_granularities[]: one of {', '.join(GRANULARITIES)}, got "
                           f"{granularity[:32]!r}", param="timestamp_granularities[]", code="invalid_value")
    if "word" not in granularities:
        return False
    if context.aligner is None:
        raise APIError(400, "timestamp_granularities[]: word timestamps need a forced aligner beside the model, and "
                       "this server has none (serve --aligner-model)", param="timestamp_granularities[]",
                       code="invalid_value")
    if response_format != "verbose_json":
        raise APIError(400, "timestamp_granularities[]: timestamps come with response_format verbose_json, got "
                       f"{response_format!r}", param="timestamp_granularities[]", code="invalid_value")
    return True


def _has_logprobs(includes: list[str], response_format: str) -> bool:
    """Whether the client asked for the transcript's logprobs (`include[]=logprobs`); 400 naming include for
    another value, or with a response_format other than json (as OpenAI's)."""
    for value in includes:
        if value not in INCLUDES:
            raise APIError(400, f"include: one of {', '.join(INCLUDES)}, got {value[:32]!r}", param="include",
                           code="invalid_value")
    if includes and response_format != "json":
        raise APIError(400, f"include: logprobs come with response_format json, got {response_format!r}",
                       param="include", code="invalid_value")
    return bool(includes)


def _aligned_words(aligner, samples, rate: int, text: str, language: str | None):
    """The aligner's words of the transcript (its language: the one forced or heard; None splits at spaces and
    CJK characters). A language the aligner cannot split is a 400 naming language."""
    try:
        return aligner.align((samples, rate), text, language)
    except ValueError as exc:
        param = str(exc).partition(":")[0]
        raise APIError(400, str(exc), param=param if param in ("language", "text") else "file",
                       code="invalid_value") from None


def _is_prompt_too_long(engine, language: str | None, prompt: str) -> bool:
    """Whether the ASR messages without their audio are already over the prompt-token limit: the prompt's fault
    (a model that only hears: whether the prompt's own tokens are)."""
    if not engine.family.has_chat:
        return len(prompt_tokenizer(engine.family.tokenizer).encode(prompt)) > engine.max_prompt_tokens
    messages = engine.family.transcription_messages(None, language, prompt)
    messages[-1] = {"role": "user", "content": messages[-1]["content"][1]["text"]}
    return len(engine.family.chat_ids(messages)) > engine.max_prompt_tokens


def transcription_request(context: ServingContext, samples, language: str | None, prompt: str | None,
                          temperature: float, seed: int | None, *, is_streamed: bool,
                          is_background: bool = False, has_logprobs: bool = False) -> EngineRequest:
    """The engine request that transcribes `samples` (float32 at the processor's rate): the family's ASR
    messages, text only (no speaker), with the model's reply cap (at most the server's limit) of tokens;
    has_logprobs: its tokens' logprobs come with its text events."""
    engine = context.engine
    messages = engine.family.transcription_messages(samples, language, prompt)
    turns = tuple((m["role"], m["content"] if isinstance(m["content"], str) else tuple(m["content"]))
                  for m in messages)
    return EngineRequest(messages=turns, speak_text=None, speaker=None,
                         sampling=sampling_params(temperature, 1.0, None), seed=seed,
                         max_new_tokens=min(engine.config.max_new_tokens, context.max_tokens_limit),
                         is_streamed=is_streamed, is_background=is_background,
                         logprobs=0 if has_logprobs else None)


async def _transcript_stream(handle, family, language: str | None, has_logprobs: bool):
    """The transcript's text deltas as the family gives them (`transcript_deltas`: a Qwen3-ASR reply's language
    tag held back), then the text `parse_transcript` reads from the whole reply; with logprobs, each delta with
    those of the transcript's tokens not sent yet (the last delta, possibly empty, with the rest), and the done
    event with all."""
    replies = []
    deltas = family.transcript_deltas(language)
    tokens = TranscriptTokens(deltas.held_tag)
    pending, sent = [], []  # the transcript's logprob items not sent yet, and those sent

    def delta_event(delta: str) -> str:
        body = {"type": "transcript.text.delta", "delta": delta}
        if has_logprobs:
            body["logprobs"] = pending[:]
            sent.extend(pending)
            pending.clear()
        return sse(body)

    try:
        async for event in handle.events():
            if event.error is not None:
                yield sse({"type": "error", "error": stream_error(event)})
                break
            if has_logprobs and event.logprobs:
                pending.extend(tokens.push(logprob_items(family.tokenizer, event.logprobs)))
            if event.text:
                replies.append(event.text)
                if delta := deltas.push(event.text):
                    yield delta_event(delta)
            if event.finish_reason is not None:
                pending.extend(tokens.finish())
                rest = deltas.finish()
                if rest or pending:  # (tokens whose text is none of the transcript's: with an empty delta)
                    yield delta_event(rest)
                _, text = family.parse_transcript("".join(replies), language)
                done = {"type": "transcript.text.done", "text": text, "usage": _usage(event)}
                if has_logprobs:
                    done["logprobs"] = [*sent, *pending]
                yield sse(done)
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
            if key in _REPEATED:
                fields.setdefault(key, []).append(value)
                continue
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
