"""The model as the HTTP side sees it: its voices, its card, and the prompts and limits of the requests it takes.

`ServedModel` holds the model family (`omnimtp.engine.family.Family`) and the engine's settings and answers what a
route asks before a request is queued: a chat request's prompt ids and media, a speech request's segments, whether a
text fits, a voice, a sampling, the card /v1/models shows. `omnimtp.server.scheduler.Engine`, which owns the thread
that serves the requests, is one; nothing here touches the engine thread's state.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from dataclasses import replace

from omnimtp.engine.config import EngineConfig
from omnimtp.families.qwen3_tts import AUTO_LANGUAGE
from omnimtp.families.text import MAX_IDS_PER_CHARACTER
from omnimtp.limits import MAX_REF_AUDIO_SECONDS
from omnimtp.media import MediaError, MediaInputs, MediaLimits
from omnimtp.sampling import SamplingParams
from omnimtp.server.requests import EngineRequest, PromptTooLongError
from omnimtp.tokenizer import message_texts

# A Qwen3-TTS model's tts_model_type → the `task_type` it serves (vllm-omni's names).
TTS_TASK_TYPES = {"custom_voice": "CustomVoice", "voice_design": "VoiceDesign", "base": "Base"}


class ServedModel:
    """The model family and the settings requests are shaped by (see the module docstring).
    max_prompt_tokens: longer prompts are refused (400). media_limits: what a chat request's audio and images may
    hold (`omnimtp.media.MediaLimits`); the media pads count as prompt tokens."""

    def __init__(self, family, config: EngineConfig, *, model_id: str, max_prompt_tokens: int,
                 media_limits: MediaLimits):
        if isinstance(max_prompt_tokens, bool) or not isinstance(max_prompt_tokens, int) or max_prompt_tokens < 1:
            raise ValueError(f"max_prompt_tokens must be an integer >= 1, got {max_prompt_tokens!r}")
        if not isinstance(media_limits, MediaLimits):
            raise ValueError(f"media_limits must be a MediaLimits, got {type(media_limits).__name__}")
        if family.has_chat and family.speech_header_ids is None:
            raise ValueError("tokenizer must have a chat template")
        if not family.has_chat and family.tokenizer is None:
            raise ValueError("tokenizer: a speech-only model needs its text tokenizer to read the text to speak")
        self.family = family
        self.config = config
        self.model_id = model_id
        self.max_prompt_tokens = max_prompt_tokens
        self.media_limits = media_limits
        self.created = int(time.time())

    @property
    def sample_rate(self) -> int:
        return self.family.sample_rate

    @property
    def speakers(self) -> tuple[str, ...]:
        return self.family.speakers

    @property
    def has_chat(self) -> bool:
        """Whether the model answers chat (a thinker); False for a speech-only model (Qwen3-TTS)."""
        return self.family.has_chat

    @property
    def audio_sampling_rate(self) -> int | None:
        """The rate chat audio is decoded to (the processor's feature extractor's); None: no processor,
        so chat media is refused."""
        processor = self.family.processor
        return None if processor is None else processor.feature_extractor.sampling_rate

    def match_speaker(self, name: str) -> str | None:
        """The model's speaker called `name` (case-insensitive), or None: no fallback voice."""
        return self.family.match_speaker(name)

    @property
    def tts_model_type(self) -> str | None:
        """A Qwen3-TTS model's kind ("custom_voice", "voice_design" or "base"); None for a model with a thinker."""
        return getattr(self.family, "tts_model_type", None)

    def speech_voice(self, voice, language: str | None, instructions: str | None):
        """A speech-only model's voice object for `EngineRequest.speaker` (Qwen3-TTS: `family.voice`, a
        `TTSVoice`); ValueError naming voice, language or instructions. voice: a speaker name, or on a Base
        model an `omnimtp.voice.Voice`."""
        return self.family.voice(voice, language, instructions)

    def create_voice(self, ref_audio=None, ref_text: str | None = None, *, x_vector_only: bool = False,
                     speaker_embedding=None, max_seconds: float = MAX_REF_AUDIO_SECONDS):
        """A Base model's cloned `omnimtp.voice.Voice` (`Qwen3TTSFamily.create_voice`): from `ref_audio` (float32
        mono samples at `sample_rate`, at most max_seconds long, with its transcript `ref_text` for in-context
        cloning) or a precomputed `speaker_embedding`. Blocks for the speaker encoder: the server runs it in a
        worker thread. ValueError naming the argument, or `model` for a model that clones no voices."""
        if self.tts_model_type != "base":
            raise ValueError(f"model: the model {self.model_id!r} is not a Base (voice-clone) model")
        audio = None if ref_audio is None else (ref_audio, self.sample_rate)
        return self.family.create_voice(audio, ref_text, x_vector_only=x_vector_only,
                                        speaker_embedding=speaker_embedding, max_seconds=max_seconds)

    def speech_sampling(self, temperature: float | None, top_p: float | None, top_k: int | None) -> SamplingParams:
        """A speech request's sampling: the fields it gives (top_k 0: no limit) over the model's defaults (a
        speech-only model's `default_sampling`, the reference's; otherwise OpenAI's T 1, top-p 1, no top-k).
        Temperature 0 is greedy."""
        defaults = getattr(self.family, "default_sampling", None) or SamplingParams()
        given = {}
        if temperature is not None:
            given["temperature"] = float(temperature)
        if top_p is not None:
            given["top_p"] = float(top_p)
        if top_k is not None:
            given["top_k"] = top_k or None
        return replace(defaults, **given)

    def model_card(self) -> dict:
        """What /v1/models says about the model besides its name: the family (its config.json model_type), the
        APIs it serves (transcriptions where it has an audio processor to hear with) and its voices; a Qwen3-TTS
        model also its tts_model_type, the task_type it serves, its languages ("auto" first) and whether it takes
        instructions."""
        family = self.family
        hears_audio = self.audio_sampling_rate is not None
        card = {"family": getattr(family, "model_type", None),
                "endpoints": (["/v1/chat/completions"] if self.has_chat else [])
                + (["/v1/audio/speech", "/v1/audio/speech/batch", "/v1/audio/speech/stream"] if family.speaks else [])
                + (["/v1/audio/transcriptions"] if hears_audio else [])
                + (["/v1/realtime"] if self.has_chat or hears_audio else []),  # (transcription sessions)
                "voices": list(self.speakers)}
        if self.tts_model_type is not None:
            card["tts_model_type"] = self.tts_model_type
            card["task_type"] = TTS_TASK_TYPES[self.tts_model_type]
            card["languages"] = [AUTO_LANGUAGE, *family.languages]
            card["takes_instructions"] = family.takes_instructions
        return card

    def prompt_ids(self, request: EngineRequest) -> tuple[list[int], MediaInputs | None]:
        """(prompt ids, media tensors or None). Chat: the templated prompt, one pad per media encoder row.
        Speech: an opened assistant turn followed by the text to say. PromptTooLongError over max_prompt_tokens:
        a text too long for it by its length alone is refused before it is tokenized
        (`ChatText.min_prompt_tokens`). Tokenizing can take a while: call it off the event loop."""
        media = None
        name = "input" if request.messages is None else "messages"
        texts = [request.speak_text] if request.messages is None else list(message_texts(
            {"content": content if isinstance(content, str) else list(content)} for _, content in request.messages))
        min_tokens = self.family.min_prompt_tokens(texts)
        if min_tokens is not None and min_tokens > self.max_prompt_tokens:  # refused before it is tokenized
            raise PromptTooLongError(name, min_tokens, self.max_prompt_tokens, is_lower_bound=True)
        if request.messages is not None:
            messages = [
                {"role": "system" if role == "developer" else role, "content": content if isinstance(content, str)
                 else list(content)} for role, content in request.messages
            ]
            ids, media = self.family.chat_inputs(messages, self._media_limits(request))
            self._check_prompt_length(ids, name)
        else:
            ids = self.family.speech_ids(request.speak_text)
            self._check_prompt_length(ids, name)
        return ids, media

    def _media_limits(self, request: EngineRequest) -> MediaLimits:
        """A request's media limits. A conversation kept warm (a realtime session: `cache_key`) is one request of
        its whole history, so `max_parts` holds each of its turns instead (MediaError naming the turn), and the
        session's item and byte limits bound the whole."""
        if request.cache_key is None:
            return self.media_limits
        num_parts = [0 if isinstance(content, str) else sum(part["type"] != "text" for part in content)
                     for _, content in request.messages]
        for index, count in enumerate(num_parts):
            if count > self.media_limits.max_parts:
                raise MediaError(f"messages.{index}.content",
                                 f"{count} media parts, more than {self.media_limits.max_parts} in one turn")
        return replace(self.media_limits, max_parts=max(self.media_limits.max_parts, sum(num_parts)))

    def speech_segments(self, request: EngineRequest) -> Iterator[list[int]]:
        """A speech request's text as the segments its talker speaks one after another (the family's
        `speech_segments`: at most `max_segment_tokens` text tokens each, within the talker's positions beside
        max_frames frames), the first cut here and each later one as it starts. PromptTooLongError over
        max_prompt_tokens (the whole text, as `prompt_ids`), or when the talker's positions leave max_frames
        frames no room for text. Call it off the event loop."""
        ids, _ = self.prompt_ids(request)
        family, max_frames = self.family, self.config.max_frames
        window = family.speech_window(request.speaker, max_frames)
        if window is not None and window < family.num_speech_template_ids() + MAX_IDS_PER_CHARACTER:
            positions = family.talker_positions(ids, request.speaker, max_frames)
            raise PromptTooLongError("input", positions, family.max_positions, unit=(
                f"talker positions (its prompt and {max_frames} frames, the server's --max-frames)"))
        segments = family.speech_segments(request.speak_text, request.speaker, max_frames,
                                          self.config.max_segment_tokens)
        return itertools.chain([next(segments)], segments)

    def check_speech_text(self, text: str, name: str) -> None:
        """PromptTooLongError (naming `name`) unless `text` fits max_prompt_tokens: the limit of a whole speech
        request, which a streamed text is held to as it grows (the talker's positions hold each of its segments,
        as they hold a whole text's)."""
        self._check_prompt_length(self.family.speech_ids(text), name)

    def _check_prompt_length(self, ids: list[int], name: str, speaker=None) -> None:
        if len(ids) > self.max_prompt_tokens:
            raise PromptTooLongError(name, len(ids), self.max_prompt_tokens)
        talker_positions = getattr(self.family, "talker_positions", None)  # a speech-only model's talker
        if speaker is not None and talker_positions is not None:
            positions = talker_positions(ids, speaker, self.config.max_frames)
            if positions > self.family.max_positions:
                raise PromptTooLongError(name, positions, self.family.max_positions, unit=(
                    f"talker positions (its prompt and {self.config.max_frames} frames, the server's --max-frames)"))
