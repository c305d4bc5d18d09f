"""The warm-up reply: one short spoken reply through every stage a request runs (thinker prefill and steps,
talker prefill and steps, code predictor, the codec's first chunk and a later one), made before the first
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
WARM_UP_TOKENS = 8  # the reply's thinker tokens: rows for the talker to speak


def warm_up_request(family, config: EngineConfig, prompt_ids: list[int] | None = None,
                    *, is_background: bool = False) -> Request | None:
    """A greedy chat request of `prompt_ids` (None: WARM_UP_TEXT in the tokenizer's chat template) that speaks
    up to the codec's first chunk and one later chunk (`first_chunk_frames + chunk_frames` frames) in the
    family's default voice. None for a family that has no thinker or does not speak, or without prompt_ids for one
    whose tokenizer has no chat template (a checkpoint without a tokenizer)."""
    if not (family.has_chat and family.speaks):
        return None
    if prompt_ids is None:
        if family.speech_header_ids is None:  # (set from the tokenizer's chat template)
            return None
        prompt_ids = family.chat_ids([{"role": "user", "content": WARM_UP_TEXT}])
    return Request(WARM_UP_REQUEST_ID, list(prompt_ids), max_new_tokens=min(WARM_UP_TOKENS, config.max_new_tokens),
                   max_frames=min(config.first_chunk_frames + config.chunk_frames, config.max_frames),
                   speaker=family.default_speaker, is_background=is_background)
