"""OpenAI's Realtime GA server events as the official `openai` package models them: `check_server_event` is
what every event `/v1/realtime` sends must pass (its type one of the GA server events, every field the model
requires present with its type, no top-level field the model lacks). The `checked_realtime_events` fixture
(conftest.py) applies it to every event of every realtime session the test suite opens."""

from __future__ import annotations

import copy
import functools
import typing

import pydantic
from openai.types.realtime import RealtimeServerEvent


@functools.cache
def server_event_models() -> dict[str, type[pydantic.BaseModel]]:
    """Each GA server event type → its model (the members of the package's `RealtimeServerEvent` union)."""
    union = typing.get_args(RealtimeServerEvent)[0]
    models = {}
    for model in typing.get_args(union):
        for name in typing.get_args(model.model_fields["type"].annotation):
            models[name] = model
    return models


def check_server_event(event: dict) -> None:
    """ValueError naming what is wrong when `event` is not a GA server event (strict: an unknown type fails)."""
    model = server_event_models().get(event.get("type"))
    if model is None:
        raise ValueError(f"{event.get('type')!r} is not a GA server event type")
    try:
        parsed = model.model_validate(_without_extensions(event))
    except pydantic.ValidationError as exc:
        raise ValueError(f"{event['type']!r} does not match the GA event: {exc}") from None
    extra = sorted(parsed.model_extra or ())
    if extra:
        raise ValueError(f"{event['type']!r} has fields the GA event lacks: {', '.join(extra)}")


def _without_extensions(event: dict) -> dict:
    """The event with omnimtp's documented extensions taken out: input audio/pcm at a rate other than 24 kHz
    (a session may name 8-48 kHz; GA's audio/pcm input is 24 kHz only), and a spoken reply's word timestamps
    (`words` of `response.output_audio_transcript.done`, each `{word, start, end}`)."""
    if event["type"] == "response.output_audio_transcript.done" and "words" in event:
        words = event["words"]
        if not (isinstance(words, list) and all(isinstance(w, dict) and sorted(w) == ["end", "start", "word"]
                                                and isinstance(w["word"], str) for w in words)):
            raise ValueError(f"'words' of {event['type']!r} is not a list of {{word, start, end}}: {words!r:.200}")
        return {key: value for key, value in event.items() if key != "words"}
    if event["type"] not in ("session.created", "session.updated"):
        return event
    event = copy.deepcopy(event)
    input_format = event["session"].get("audio", {}).get("input", {}).get("format") or {}
    if input_format.get("type") == "audio/pcm" and input_format.get("rate") is not None:
        input_format["rate"] = 24000
    return event
