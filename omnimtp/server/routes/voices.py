"""`/v1/audio/voices`: the saved voices a Qwen3-TTS Base model speaks (vllm-omni's voice API).

    POST   /v1/audio/voices          save a voice: `name`, `consent` (required, recorded), and `audio_sample`
                                     (a file in a multipart form, or base64 / a data: URL in a JSON body) with
                                     an optional `ref_text`, or a precomputed `speaker_embedding`
    GET    /v1/audio/voices          {"voices": the model's own speakers, "voice_aliases": {alias: speaker},
                                     "uploaded_voices": [name, created_at, mode, seconds, model]}
    GET    /v1/audio/voices/{name}   one saved voice: the list entry, its transcript and consent record
    DELETE /v1/audio/voices/{name}

A saved voice is spoken with `/v1/audio/speech` `voice: "<name>"`; how a request's voice becomes the engine's
speaker (a speaker name, a saved voice, a reference recording or a speaker embedding) is decided here too, for
every route that speaks (`speech_speaker`, `speech_voice`, `check_voice`). The voice is computed once, when it is
saved (`Engine.create_voice`: the speaker embedding, and with `ref_text` the recording's codes), and lives in
the `VoiceStore` under `--voices-dir`, shared by every process that opens that directory.

This is the one route that takes a multipart form besides JSON: a browser may send a form across sites
without asking, so a server reachable from browsers should run with `--api-key` (which every /v1/ route,
this one included, then requires).
"""

from __future__ import annotations

import io
import json

import numpy as np
import soundfile
from fastapi import APIRouter, Request
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import UploadFile

from omnimtp.limits import MediaLimits
from omnimtp.media import MediaError, decode_audio
from omnimtp.server.errors import APIError, validation_error
from omnimtp.server.guard import is_json, read_form
from omnimtp.server.routes.common import ServingContext, audio_bytes, serving
from omnimtp.server.schemas import SpeechRequest, VoiceCreateRequest
from omnimtp.server.served_model import TTS_TASK_TYPES
from omnimtp.server.voice_store import NewVoice, VoiceStoreError, check_name
from omnimtp.voice import Voice

router = APIRouter()

_FORM_BOOLEANS = {"true": True, "false": False, "1": True, "0": False}
# The speech request fields a Qwen3-TTS model's voice is made of (its ValueErrors start with the field's name).
_VOICE_FIELDS = {name: name for name in ("voice", "language", "instructions")}
# What a cloned voice is made from: the engine's argument names → the HTTP fields (`create_voice`'s ValueErrors
# start with the argument's name).
_CLONE_ARGUMENTS = {"ref_audio": "ref_audio", "ref_text": "ref_text", "x_vector_only": "x_vector_only_mode",
                    "speaker_embedding": "speaker_embedding"}


@router.post("/v1/audio/voices")
async def create_voice(request: Request):
    context = serving(request)
    store = _store(context)
    body, upload = await _read_request(request, context)
    context.check_model(body.model)
    check_clone(context)
    try:
        check_name(body.name)
    except VoiceStoreError as exc:
        raise _api_error(exc) from None
    if not body.consent.strip():
        raise APIError(400, "consent: required: a statement that the speaker agreed to be cloned, or a consent "
                       "record id", param="consent", code="missing_required_parameter")
    audio = upload if upload is not None else body.audio_sample
    if (audio is None) == (body.speaker_embedding is None):
        param = "audio_sample" if audio is None else "speaker_embedding"
        raise APIError(400, f"{param}: give one of audio_sample (a reference recording) or speaker_embedding",
                       param=param, code="missing_required_parameter" if audio is None else "invalid_value")
    if body.ref_text is not None and audio is None:
        raise APIError(400, "ref_text: the transcript of audio_sample, which the request does not give",
                       param="ref_text", code="invalid_value")
    samples, seconds, raw, raw_format = None, 0.0, None, None
    if audio is not None:
        raw = audio_bytes(audio, "audio_sample")
        samples = await reference_audio(context, raw, "audio_sample")
        seconds = samples.shape[0] / context.engine.sample_rate
        if store.keep_audio:
            raw_format = soundfile.info(io.BytesIO(raw)).format.lower()
        else:
            raw = None
    voice = await clone_voice(context, samples, body.ref_text, body.x_vector_only_mode, body.speaker_embedding,
                              audio_param="audio_sample")
    new = NewVoice(name=body.name, voice=voice.to_bytes(), mode=voice.mode, seconds=seconds, consent=body.consent,
                   model=context.engine.model_id, ref_text=voice.ref_text if voice.mode == "icl" else None,
                   consent_user=body.user, consent_client=request.client.host if request.client else None,
                   audio=raw, audio_format=raw_format)
    try:
        saved = await run_in_threadpool(store.add, new)
    except VoiceStoreError as exc:
        raise _api_error(exc) from None
    return {"success": True, "voice": saved.details()}


@router.get("/v1/audio/voices")
async def list_voices(request: Request):
    context = serving(request)
    saved = [] if context.voices is None else await run_in_threadpool(context.voices.list)
    return {"voices": list(context.engine.speakers), "voice_aliases": dict(context.voice_aliases),
            "uploaded_voices": [voice.summary() for voice in saved]}


@router.get("/v1/audio/voices/{name}")
async def get_voice(request: Request, name: str):
    store = _store(serving(request), missing=404)
    try:
        return (await run_in_threadpool(store.get, name)).details()
    except VoiceStoreError as exc:
        raise _api_error(exc) from None


@router.delete("/v1/audio/voices/{name}")
async def delete_voice(request: Request, name: str):
    store = _store(serving(request), missing=404)
    try:
        await run_in_threadpool(store.delete, name)
    except VoiceStoreError as exc:
        raise _api_error(exc) from None
    return {"success": True, "message": f"voice {name!r} deleted"}


def _store(context: ServingContext, missing: int = 400):
    if context.voices is None:
        raise APIError(missing, "this server saves no voices: start it with --voices-dir DIR",
                       type="not_found_error" if missing == 404 else "invalid_request_error", code="voices_disabled")
    return context.voices


async def _read_request(request: Request, context: ServingContext) -> tuple[VoiceCreateRequest, bytes | None]:
    """The POST's fields, validated, and the uploaded file's bytes (a multipart form) or None (JSON)."""
    if is_json(request.headers.get("content-type", "")):
        return await context.read_body(request, VoiceCreateRequest), None
    form = await read_form(request, context.max_body_bytes)  # 415 for a Content-Type that is neither
    fields, upload = {}, None
    for key, value in form.multi_items():
        if key in fields or (key == "audio_sample" and upload is not None):
            raise APIError(400, f"{key}: given twice", param=key, code="invalid_value")
        if isinstance(value, UploadFile):
            if key != "audio_sample":
                raise APIError(400, f"{key}: a file part; only audio_sample is a file", param=key, code="invalid_value")
            upload = await value.read()
            if not upload:
                raise APIError(400, "audio_sample: is empty", param="audio_sample", code="invalid_value")
            continue
        if key == "audio_sample":
            raise APIError(400, "audio_sample: in a multipart form, a file part (or send JSON with base64)",
                           param="audio_sample", code="invalid_value")
        fields[key] = _form_value(key, value)
    await form.close()
    try:
        return VoiceCreateRequest.model_validate(fields), upload
    except ValidationError as exc:
        raise validation_error(exc) from None


def _form_value(key: str, value: str):
    """A form field as the JSON body would carry it: x_vector_only_mode a boolean, speaker_embedding a JSON list."""
    if key == "x_vector_only_mode":
        if value.strip().lower() not in _FORM_BOOLEANS:
            raise APIError(400, f"x_vector_only_mode: expected true or false, got {value[:32]!r}",
                           param=key, code="invalid_value")
        return _FORM_BOOLEANS[value.strip().lower()]
    if key == "speaker_embedding":
        try:
            return json.loads(value)
        except ValueError:
            raise APIError(400, "speaker_embedding: expected a JSON list of numbers", param=key,
                           code="invalid_value") from None
    return value


def _api_error(exc: VoiceStoreError) -> APIError:
    kind = "not_found_error" if exc.status == 404 else "invalid_request_error"
    return APIError(exc.status, str(exc), type=kind, param=exc.param, code=exc.code)


# -- the voice of a request: a speaker name, a saved voice, or one cloned from a recording ---------------


def check_voice(context: ServingContext, voice: str, param: str) -> str:
    """The model's speaker `voice` names (or is an alias of); APIError 400 naming `param` (listing the speakers)
    when none."""
    speaker = context.engine.match_speaker(aliased_voice(context, voice))
    if speaker is None:
        names = ", ".join([*context.engine.speakers, *context.voice_aliases])
        raise APIError(400, f"unknown voice {voice!r}; this model has: {names}", param=param, code="invalid_value")
    return speaker


def speech_voice(context: ServingContext, voice, language: str | None, instructions: str | None, task_type: str | None):
    """The `EngineRequest.speaker` of a speech request: a speaker name of a model with a thinker (which
    takes no language, instructions or task_type), or a Qwen3-TTS model's voice object (voice: a speaker
    name, or on a Base model an `omnimtp.voice.Voice`). APIError 400 naming the field: an unknown voice
    (listing the voices) or language (listing them), instructions the model ignores or that a VoiceDesign
    model lacks, a task_type that is not the model's."""
    engine = context.engine
    if not engine.family.speaks:
        raise APIError(400, f"the model {engine.model_id!r} hears and does not speak (speech recognition); "
                       "transcribe audio with /v1/audio/transcriptions", param="model", code="model_not_supported")
    model_type = engine.tts_model_type
    if model_type is None:
        for name, value in (("language", language), ("instructions", instructions), ("task_type", task_type)):
            if value is not None:
                raise APIError(400, f"{name}: the model {engine.model_id!r} takes no {name} (only Qwen3-TTS "
                               "models do)", param=name, code="invalid_value")
        if voice is None:
            raise APIError(400, "voice: required", param="voice", code="missing_required_parameter")
        return check_voice(context, voice, "voice")
    served = TTS_TASK_TYPES[model_type]
    if task_type is not None and task_type != served:
        clone = " (voice cloning needs a Base model)" if task_type == "Base" else ""
        raise APIError(400, f"task_type: the model {engine.model_id!r} serves {served}, not {task_type}{clone}",
                       param="task_type", code="invalid_value")
    try:
        return engine.speech_voice(aliased_voice(context, voice), language, instructions)
    except ValueError as exc:
        raise _field_error(exc, _VOICE_FIELDS) from None


def aliased_voice(context: ServingContext, voice):
    """The speaker an alias names (`omnimtp.server.aliases`); any other voice as it is (a model's own speaker
    wins over an alias of the same name)."""
    if not isinstance(voice, str) or context.engine.match_speaker(voice) is not None:
        return voice
    return context.voice_aliases.get(voice.lower(), voice)


async def speech_speaker(context: ServingContext, body: SpeechRequest):
    """`speech_voice` of a whole speech request, with its voice-cloning fields: on a Base model the voice
    is a saved voice (`voice`), a reference recording (`ref_audio`, optional `ref_text`,
    `x_vector_only_mode`) or a `speaker_embedding`, at most one of them; none speaks without a speaker row,
    as `OmniPipeline.speech` and `omnimtp speak` do without a voice. Any other model refuses those fields
    by name."""
    clone = body.clone_fields
    if context.engine.tts_model_type != "base":
        if clone:
            name = next(iter(clone))
            raise APIError(400, f"{name}: only a Base (voice-clone) model takes {name}; {_serves(context)}",
                           param=name, code="invalid_value")
        return speech_voice(context, body.voice, body.language, body.instructions, body.task_type)
    if body.ref_text is not None and body.ref_audio is None:
        raise APIError(400, "ref_text: the transcript of ref_audio, which the request does not give",
                       param="ref_text", code="invalid_value")
    sources = [name for name, value in (("voice", body.voice), ("ref_audio", body.ref_audio),
                                        ("speaker_embedding", body.speaker_embedding)) if value is not None]
    if len(sources) > 1:
        raise APIError(400, f"{sources[-1]}: give one of voice, ref_audio or speaker_embedding, not "
                       f"{' and '.join(sources)}", param=sources[-1], code="invalid_value")
    if not sources:
        if body.x_vector_only_mode:
            raise APIError(400, "x_vector_only_mode: applies to a cloned voice (voice, ref_audio or "
                           "speaker_embedding), which the request does not give", param="x_vector_only_mode",
                           code="invalid_value")
        voice = None
    elif body.voice is not None:
        voice = await saved_voice(context, body.voice)
        if body.x_vector_only_mode:
            voice = voice.x_vector_only()
    else:
        ref_audio = None if body.ref_audio is None else await reference_audio(context, body.ref_audio, "ref_audio")
        voice = await clone_voice(context, ref_audio, body.ref_text, bool(body.x_vector_only_mode),
                                       body.speaker_embedding, audio_param="ref_audio")
    return speech_voice(context, voice, body.language, body.instructions, body.task_type)


def check_clone(context: ServingContext) -> None:
    """APIError 400 naming `model` unless the model clones voices (a Qwen3-TTS Base model)."""
    if context.engine.tts_model_type != "base":
        raise APIError(400, f"model: voice cloning needs a Qwen3-TTS Base model; {_serves(context)}",
                       param="model", code="model_not_supported")


def _serves(context: ServingContext) -> str:
    model_type = context.engine.tts_model_type
    served = "chat and speech" if model_type is None else TTS_TASK_TYPES[model_type]
    return f"the model {context.engine.model_id!r} serves {served}"


async def reference_audio(context: ServingContext, data: str | bytes, param: str) -> np.ndarray:
    """A voice-clone reference recording (base64, a data:audio/... URL, or an upload's bytes) as float32 mono
    samples at the model's rate, decoded and resampled in a worker thread; APIError 400 naming `param` for
    audio that cannot be decoded or is longer than `max_ref_seconds` (`Engine.create_voice` refuses one that
    is too short)."""
    try:
        samples = await run_in_threadpool(decode_audio, audio_bytes(data, param), None, context.engine.sample_rate,
                                          MediaLimits(max_audio_seconds=context.max_ref_seconds), param)
    except MediaError as exc:
        raise APIError(400, str(exc), param=param, code="invalid_value") from None
    return samples


async def clone_voice(context: ServingContext, ref_audio, ref_text, x_vector_only: bool, speaker_embedding, *,
                      audio_param: str):
    """`Engine.create_voice` in a worker thread (the speaker encoder blocks); its ValueErrors as 400s naming
    the field (the reference recording as `audio_param`)."""
    try:
        return await run_in_threadpool(context.engine.create_voice, ref_audio, ref_text, x_vector_only=x_vector_only,
                                       speaker_embedding=speaker_embedding, max_seconds=context.max_ref_seconds)
    except ValueError as exc:
        raise _field_error(exc, {**_CLONE_ARGUMENTS, "ref_audio": audio_param}) from None


async def saved_voice(context: ServingContext, name: str):
    """The `Voice` saved as `name`; APIError 400 naming `voice` when there is none (listing the saved ones)."""
    store = context.voices
    data = None if store is None else await run_in_threadpool(store.voice_bytes, name)
    if data is None:
        saved = [] if store is None else [v.name for v in await run_in_threadpool(store.list)]
        known = f"saved voices: {', '.join(saved)}" if saved else "no voices are saved (POST /v1/audio/voices)"
        raise APIError(400, f"voice: unknown voice {name!r}; {known}", param="voice", code="invalid_value")
    return Voice.from_bytes(data)


def _field_error(exc: ValueError, fields: dict[str, str]) -> APIError:
    """A ValueError that starts with an argument's name (`"language: unknown language ..."`, or a part of it:
    `"voice.speaker_embedding: ..."`) as a 400 naming its field (`fields`: argument → field)."""
    message = str(exc)
    name = message.partition(":")[0].partition(".")[0]
    param = fields.get(name)
    if param is not None:
        message = param + message[len(name):]  # the field the client sent, not the engine's argument
    return APIError(400, message, param=param, code="invalid_value")
