"""The warm-up reply: one short spoken reply through every stage a request runs (thinker prefill and steps,
talker prefill and steps, code predictor, the codec's first chunk and a later one; for a model without a
thinker, Qwen3-TTS, a short text spoken in its default voice), made before the first
user's request so that it does not pay what a stage's first run costs (its weights paged in, its kernels'
first-call set-up, the allocator's growth). `OmniPipeline.warm_up` runs it; the server's engine runs it at
start as a background request that a user's request ends (`omnimtp.server.scheduler.Engine`). Its output is
dropped.

    request = warm_up_request(family, config)         # None: the family cannot make one
"""

from __future__ import annotations

from omnimtp.engine.config import EngineConfig
from omnimtp.engine.request import Request

WARM_UP_REQUEST_ID = "warm-up"
WARM_UP_TEXT = "Hello! How are you today?"
WARM_UP_VOICE = "A calm, clear voice."  # what a model that is told each voice is told
WARM_UP_TOKENS = 8  # the reply's thinker tokens: rows for the talker to speak


def warm_up_request(family, config: EngineConfig, prompt_ids: list[int] | None = None,
                    *, is_background: bool = False, request_id=WARM_UP_REQUEST_ID,
                    max_frames: int | None = None) -> Request | None:
    """A greedy chat request of `prompt_ids` (None: WARM_UP_TEXT in the tokenizer's chat template) that speaks
    up to the codec's first chunk and one later chunk (`first_chunk_frames + chunk_frames` frames) in the
    family's default voice; for a family that speaks text without a thinker (Qwen3-TTS), WARM_UP_TEXT spoken as a
    speech request in the voice a request without one gets (WARM_UP_VOICE described, where a voice must be; prompt_ids:
    None only). None for a family that does not
    speak, or without prompt_ids for one whose tokenizer has no chat template (a checkpoint without a tokenizer).
    request_id: its id (several at once need their own); max_frames: fewer frames (at most config.max_frames)."""
    if not family.speaks:
        return None
    max_frames = min(max_frames or config.first_chunk_frames + config.chunk_frames, config.max_frames)
    if not family.has_chat:
        if prompt_ids is not None or not hasattr(family, "voice"):
            return None
        try:
            voice = family.voice()
        except ValueError:  # a model whose every voice is described (VoiceDesign)
            voice = family.voice(instructions=WARM_UP_VOICE)
        segments = family.speech_segments(WARM_UP_TEXT, voice, max_frames, config.max_segment_tokens)
        return Request(request_id, next(segments), max_new_tokens=1, max_frames=max_frames, speaker=voice,
                       is_chat=False, is_streamed=True, segments=segments, is_background=is_background)
    if prompt_ids is None:
        if family.speech_header_ids is None:  # (set from the tokenizer's chat template)
            return None
        prompt_ids = family.chat_ids([{"role": "user", "content": WARM_UP_TEXT}])
    return Request(request_id, list(prompt_ids), max_new_tokens=min(WARM_UP_TOKENS, config.max_new_tokens),
                   max_frames=max_frames,
                   speaker=family.default_speaker, is_background=is_background)
