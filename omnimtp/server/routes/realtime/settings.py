"""`session.update`: the session's settings, checked against the served model, all or nothing."""

from __future__ import annotations

from dataclasses import replace

from omnimtp.families.text import transcription_language
from omnimtp.server.errors import APIError
from omnimtp.server.routes.common import ServingContext
from omnimtp.server.routes.realtime.events import InputTranscription, ServerVad, SessionFields, event_error
from omnimtp.server.routes.realtime.formats import input_format, output_format
from omnimtp.server.routes.realtime.state import RealtimeSession
from omnimtp.server.routes.voices import check_voice
from omnimtp.server.vad import TurnDetection
from omnimtp.server.websocket import EventError


def update_settings(state: RealtimeSession, fields: SessionFields) -> None:
    """Apply a `session.update` (all or nothing: the settings change only when every field is valid)."""
    context = state.context
    given = fields.model_dump(exclude_unset=True)
    settings = state.settings
    if fields.model is not None and fields.model not in context.model_names:
        raise EventError(f"session.model: this server serves {', '.join(context.model_names)}, not "
                         f"{fields.model!r}", param="session.model", code="model_not_found")
    changes: dict = {}
    for name in ("instructions", "tool_choice", "seed", "temperature", "top_p", "top_k"):
        if name in given and given[name] is not None:
            changes[name] = given[name]
    if fields.output_modalities is not None:
        changes["output_modalities"] = tuple(fields.output_modalities)
    if "include" in given:
        changes["include"] = tuple(dict.fromkeys(fields.include or ()))
    if fields.max_output_tokens is not None:
        changes["max_output_tokens"] = max_output_tokens_setting(context, fields.max_output_tokens,
                                                                 "session.max_output_tokens")
    audio = fields.audio
    if audio is not None and audio.input is not None and audio.input.format is not None:
        changes["input_format"], changes["input_rate"] = input_format(audio.input.format,
                                                                      "session.audio.input.format")
    if audio is not None and audio.input is not None and "turn_detection" in audio.input.model_fields_set:
        changes["turn_detection"] = _turn_detection(audio.input.turn_detection)
    if audio is not None and audio.input is not None and "noise_reduction" in audio.input.model_fields_set:
        noise_reduction = audio.input.noise_reduction
        changes["noise_reduction"] = None if noise_reduction is None else noise_reduction.type
    if audio is not None and audio.input is not None and "transcription" in audio.input.model_fields_set:
        changes["transcription"] = transcription_settings(context, audio.input.transcription)
    if audio is not None and audio.output is not None:
        if audio.output.format is not None:
            changes["output_format"] = output_format(audio.output.format, "session.audio.output.format")
        if audio.output.voice is not None:
            changes["voice"] = session_voice(context, audio.output.voice, "session.audio.output.voice")
    if "type" in fields.model_fields_set:
        changes["type"] = fields.type
    new = replace(settings, **changes)
    if new.type == "realtime" and not context.engine.has_chat:
        raise EventError(f"session.type: the model {context.engine.model_id!r} hears and does not answer; it serves "
                         'sessions of type "transcription" (?intent=transcription)', param="session.type",
                         code="invalid_value")
    if new.type == "transcription" and new.transcription is None:  # what a transcription session is for
        new = replace(new, transcription=transcription_settings(context, InputTranscription()))
    state.settings = new
    if new != settings:
        state.drop_live()  # the turn in progress is heard again from its start with the new settings
    if (state.settings.input_format, state.settings.input_rate) != (settings.input_format, settings.input_rate):
        state.clear_buffer()  # its audio is in the old format: never heard at the new one
    if state.settings.turn_detection != settings.turn_detection or state.settings.input_rate != settings.input_rate:
        state.turns.restart(None)  # the next append starts a detector with the new settings


def _turn_detection(vad: ServerVad | None) -> TurnDetection | None:
    if vad is None:
        return None
    param = "session.audio.input.turn_detection"
    if vad.type == "semantic_vad":
        given = sorted(vad.model_fields_set & {"threshold", "prefix_padding_ms", "silence_duration_ms"})
        if given:
            raise EventError(f"{param}.{given[0]}: semantic_vad takes an eagerness, not server_vad's {given[0]}",
                             param=f"{param}.{given[0]}")
        return TurnDetection.semantic(vad.eagerness or "auto", create_response=vad.create_response,
                                      interrupt_response=vad.interrupt_response, idle_timeout_ms=vad.idle_timeout_ms)
    if vad.eagerness is not None:
        raise EventError("session.audio.input.turn_detection.eagerness: only semantic_vad has an eagerness",
                         param="session.audio.input.turn_detection.eagerness")
    return TurnDetection(threshold=vad.threshold, prefix_padding_ms=vad.prefix_padding_ms,
                         silence_duration_ms=vad.silence_duration_ms, create_response=vad.create_response,
                         interrupt_response=vad.interrupt_response, idle_timeout_ms=vad.idle_timeout_ms)


def max_output_tokens_setting(context: ServingContext, value, param: str):
    if value != "inf" and value > context.max_tokens_limit:
        raise EventError(f"{param}: must be at most {context.max_tokens_limit} (or \"inf\"), got {value}",
                         param=param)
    return value


def session_voice(context: ServingContext, voice: str, param: str) -> str:
    try:
        return check_voice(context, voice, param)
    except APIError as exc:
        raise event_error(exc) from None


def transcription_settings(context: ServingContext, fields: InputTranscription | None) -> dict | None:
    """`session.audio.input.transcription`, checked: the served model (the one that answers) and a language it
    hears."""
    if fields is None:
        return None
    param = "session.audio.input.transcription"
    names = [*(context.asr.model_names if context.asr is not None else ()), *context.model_names]
    if fields.model is not None and fields.model not in names:
        raise EventError(f"{param}.model: transcripts come from the served models ({', '.join(names)}), not "
                         f"{fields.model!r}", param=f"{param}.model", code="model_not_found")
    context = context.hearing(fields.model)  # (the recognizer served beside the model: by default)
    if context.engine.audio_sampling_rate is None:
        raise EventError(f"{param}: the model has no processor to hear audio", param=param,
                         code="model_not_supported")
    try:
        transcription_language(fields.language)
        context.engine.family.transcription_messages(None, fields.language, fields.prompt)
    except ValueError as exc:
        name = str(exc).partition(":")[0]
        raise EventError(f"{param}.{exc}", param=f"{param}.{name}", code="invalid_value") from None
    return {"model": fields.model or context.model_names[0], "language": fields.language, "prompt": fields.prompt}
