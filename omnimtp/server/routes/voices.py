"""`/v1/audio/voices`: the saved voices a Qwen3-TTS Base model speaks (vllm-omni's voice API).

    POST   /v1/audio/voices          save a voice: `name`, `consent` (required, recorded), and `audio_sample`
                                     (a file in a multipart form, or base64 / a data: URL in a JSON body) with
                                     an optional `ref_text`, or a precomputed `speaker_embedding`
    GET    /v1/audio/voices          {"voices": the model's own speakers, "uploaded_voices": [name, created_at,
                                     mode, seconds, model]}
    GET    /v1/audio/voices/{name}   one saved voice: the list entry, its transcript and consent record
    DELETE /v1/audio/voices/{name}

A saved voice is spoken with `/v1/audio/speech` `voice: "<name>"`. The voice is computed once, when it is
saved (`Engine.create_voice`: the speaker embedding, and with `ref_text` the recording's codes), and lives in
the `VoiceStore` under `--voices-dir`, shared by every process that opens that directory.

This is the one route that takes a multipart form besides JSON: a browser may send a form across sites
without asking, so a server reachable from browsers should run with `--api-key` (which every /v1/ route,
this one included, then requires).
"""

from __future__ import annotations

import io
import json

import soundfile
from fastapi import APIRouter, Request
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import UploadFile

from omnimtp.server.errors import APIError, validation_error
from omnimtp.server.guard import is_json, read_form
from omnimtp.server.routes.common import ServingContext, audio_bytes, serving
from omnimtp.server.schemas import VoiceCreateRequest
from omnimtp.server.voice_store import NewVoice, VoiceStoreError, check_name

router = APIRouter()

_FORM_BOOLEANS = {"true": True, "false": False, "1": True, "0": False}


@router.post("/v1/audio/voices")
async def create_voice(request: Request):
    context = serving(request)
    store = _store(context)
    body, upload = await _read_request(request, context)
    context.check_model(body.model)
    context.check_clone()
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
        samples = await context.reference_audio(raw, "audio_sample")
        seconds = samples.shape[0] / context.engine.sample_rate
        if store.keep_audio:
            raw_format = soundfile.info(io.BytesIO(raw)).format.lower()
        else:
            raw = None
    voice = await context.clone_voice(samples, body.ref_text, body.x_vector_only_mode, body.speaker_embedding,
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
    return {"voices": list(context.engine.speakers), "uploaded_voices": [voice.summary() for voice in saved]}


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
