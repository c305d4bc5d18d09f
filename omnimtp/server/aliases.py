"""OpenAI's model and voice names, taken as names of what this server serves (as other OpenAI-compatible
servers do), so that a client whose defaults name OpenAI's (pipecat's TTS sends only OpenAI's voices; LiveKit's
realtime model asks for voice "marin" and transcription model "gpt-4o-mini-transcribe"; both frameworks' chat LLM
services default to "gpt-4.1") works unchanged.

    model    each of OPENAI_MODELS names the served model (listed by /v1/models beside its own name)
    voice    each of OPENAI_VOICES the model has no speaker of its own by names its default speaker, unless
             `serve --voice-alias NAME=SPEAKER` says which speaker (listed by /v1/audio/voices as
             `voice_aliases`); a model's own speaker always wins over an alias

`serve --no-openai-aliases` turns the default aliases off (`--voice-alias` still adds its own)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

# OpenAI's realtime, transcription and speech models, and the chat models voice frameworks default to (late 2026).
OPENAI_MODELS = ("gpt-realtime", "gpt-realtime-mini", "gpt-realtime-1.5", "gpt-realtime-2", "gpt-realtime-2.1",
                 "gpt-4o-realtime-preview", "gpt-4o-mini-realtime-preview", "gpt-transcribe", "gpt-4o-transcribe",
                 "gpt-4o-mini-transcribe", "gpt-realtime-whisper", "gpt-live-transcribe", "whisper-1", "tts-1",
                 "tts-1-hd", "gpt-4o-mini-tts", "gpt-4.1", "gpt-4.1-mini", "gpt-4.1-nano", "gpt-4o", "gpt-4o-mini",
                 "gpt-5", "gpt-5-mini", "gpt-5-nano")
# OpenAI's built-in voices.
OPENAI_VOICES = ("alloy", "ash", "ballad", "cedar", "coral", "echo", "fable", "marin", "nova", "onyx", "sage",
                 "shimmer", "verse")


def speaker_aliases(speakers: Sequence[str], default_speaker: str | None, given: Mapping[str, str], *,
                  openai: bool) -> dict[str, str]:
    """Alias (lower case) → the model's speaker. `given` (alias → speaker, any case) comes on top of OpenAI's
    voices (`openai`), which name `default_speaker` (none when the model has none: a Base or VoiceDesign
    Qwen3-TTS model). ValueError naming `voice_aliases` for a speaker the model lacks or an alias that is one
    of its speakers."""
    by_name = {speaker.lower(): speaker for speaker in speakers}
    aliases = {}
    if openai and default_speaker is not None:
        aliases = {voice: by_name[default_speaker.lower()] for voice in OPENAI_VOICES if voice not in by_name}
    for alias, speaker in given.items():
        if not isinstance(alias, str) or not alias or alias.lower() in by_name:
            raise ValueError(f"voice_aliases: {alias!r} is not a new voice name (the model's speakers: "
                             f"{', '.join(speakers)})")
        if not isinstance(speaker, str) or speaker.lower() not in by_name:
            raise ValueError(f"voice_aliases: {alias!r} names {speaker!r}, which is not one of the model's speakers "
                             f"({', '.join(speakers) or 'none'})")
        aliases[alias.lower()] = by_name[speaker.lower()]
    return aliases
