"""What the HTTP side hands the engine (`EngineRequest`) and gets back (`RequestHandle`, its `EngineEvent`s), and
the refusals `Engine.submit` raises before a request joins (`QueueFullError`: 429; `PromptTooLongError`: 400).
`omnimtp.server.scheduler.Engine` takes and makes them."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import numpy as np

from omnimtp.engine.playback import PlaybackClock
from omnimtp.engine.request import Request
from omnimtp.sampling import SamplingParams


class QueueFullError(RuntimeError):
    """The waiting queue is at its bound; the HTTP layer answers 429 with `Retry-After: retry_after_s` (and
    `retry-after-ms: retry_after_ms` where it is known)."""

    def __init__(self, message: str, retry_after_s: int = 1, retry_after_ms: int | None = None):
        super().__init__(message)
        self.retry_after_s = retry_after_s
        self.retry_after_ms = retry_after_ms


class PromptTooLongError(ValueError):
    """A request's prompt has more tokens than the engine takes (or, for a speech-only model, more than its
    talker's positions leave beside the frames it may make); `param` names the request field that holds the
    prompt ("messages" or "input"). The HTTP layer answers 400."""

    def __init__(self, param: str, num_tokens: int, max_tokens: int, *, is_lower_bound: bool = False,
                 unit: str = "tokens"):
        at_least = "at least " if is_lower_bound else ""
        super().__init__(f"{param}: {at_least}{num_tokens} {unit} is over the limit of {max_tokens}")
        self.param = param
        self.num_tokens = num_tokens
        self.max_tokens = max_tokens


@dataclass(frozen=True)
class EngineRequest:
    """What to generate, as the HTTP layer parsed it.

    messages: chat turns (role, content) → the thinker writes a reply; None for speech requests. content
    is the turn's text, or a tuple of parts in transformers' chat format with the media decoded:
    `{"type": "text", "text": str}`, `{"type": "audio", "audio": float32 mono samples at the processor's
    rate}`, `{"type": "image", "image": RGB PIL image}`.
    speak_text: the text to speak directly (the thinker's text path is skipped); None for chat.
    speaker: a speaker name of the model (already matched), or None for a text-only reply; for a speech-only
    model, the family's voice object (Qwen3-TTS: `family.voice(...)`, a `TTSVoice`).
    sampling: the thinker's sampling (temperature 0 = greedy, and then the whole request is greedy;
    otherwise the talker samples as transformers does by default); the code predictor keeps its own. A
    speech-only model (no thinker) samples its talker with it (its code predictor the same way without the
    repetition penalty).
    max_new_tokens: thinker token budget (chat only). is_streamed: the client reads the reply as it
    is made; False (a non-streaming response) generates exactly as `OmniPipeline.generate` does.
    is_background: low priority (`omnimtp.engine.request.Request.is_background`: a realtime input transcript).
    cache_key: the conversation this chat request continues (a realtime session's id), whose thinker and talker
    prefixes the engine keeps warm between its turns (`omnimtp.engine.request.Request.cache_key`).
    logprobs: None, or the alternatives each reply token's logprob lists (`omnimtp.engine.request.Request.logprobs`;
    a chat request's text events then carry their tokens' `TokenLogprob`s).
    """

    messages: tuple[tuple[str, str | tuple[dict, ...]], ...] | None
    speak_text: str | None
    speaker: object | None
    sampling: SamplingParams
    seed: int | None
    max_new_tokens: int
    is_streamed: bool = True
    is_background: bool = False
    cache_key: str | None = None
    logprobs: int | None = None

    def __post_init__(self):
        if (self.messages is None) == (self.speak_text is None):
            raise ValueError("exactly one of messages and speak_text must be given")
        if self.speak_text is not None and self.speaker is None:
            raise ValueError("speaker is required to speak speak_text")
        if self.messages is not None and self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")

    @property
    def has_media(self) -> bool:
        return self.messages is not None and any(not isinstance(content, str) and any(
            part["type"] != "text" for part in content) for _, content in self.messages)


@dataclass
class EngineEvent:
    """One step of a request's output: a text delta, an audio chunk (float32), or the end.
    step: the engine step that decoded an audio chunk (see `RequestHandle.admitted_step`). num_frames: the
    request's audio frames so far (on an audio chunk) or in all (on the end). error_code:
    "server_shutting_down" when the server ended the request (`Engine.end_requests`), else None. logprobs: with
    a text delta of a request that asked for them, its tokens' `omnimtp.sampling.TokenLogprob`s."""

    text: str = ""
    audio: np.ndarray | None = None
    step: int | None = None
    finish_reason: str | None = None
    error: str | None = None
    error_code: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    num_frames: int = 0
    logprobs: list = field(default_factory=list)

    def usage(self, audio: bool = False) -> dict:
        """OpenAI's usage block; with audio, `completion_tokens_details.audio_tokens` = audio frames."""
        usage = {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }
        if audio:
            usage["completion_tokens_details"] = {"audio_tokens": self.num_frames}
        return usage


class RequestHandle:
    """The HTTP side's view of one request: an async event stream and a cancel switch."""

    def __init__(self, request_id: int, loop: asyncio.AbstractEventLoop, on_cancel):
        self.request_id = request_id
        self._loop = loop
        self._queue: asyncio.Queue[EngineEvent | None] = asyncio.Queue()
        self._on_cancel = on_cancel
        self.is_cancelled = False
        self.is_done = False
        self.request: Request | None = None  # the engine's state of it
        # requests that had to start before it when it came (0: it starts at the next step)
        self.queue_position = 0
        self.playback = PlaybackClock()  # its listener's clock, from its first audio chunk

    @property
    def admitted_step(self) -> int | None:
        """The engine step that gave it a slot."""
        return None if self.request is None else self.request.admitted_step

    def push(self, event: EngineEvent | None) -> None:
        """Called from the engine thread."""
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, event)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            self.is_cancelled = True

    async def events(self):
        while True:
            event = await self._queue.get()
            if event is None:
                return
            yield event
            if event.finish_reason is not None or event.error is not None:
                return

    def cancel(self) -> None:
        """Idempotent; a no-op once the request has finished."""
        if not self.is_cancelled and not self.is_done:
            self.is_cancelled = True
            self._on_cancel(self)
