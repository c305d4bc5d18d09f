"""What a realtime session holds: its settings, its conversation, its input audio buffer and turn detection,
and its active response."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from omnimtp.server.routes.common import ServingContext
from omnimtp.server.routes.realtime.events import PCM_RATE
from omnimtp.server.routes.realtime.formats import describe_format
from omnimtp.server.vad import VAD_RATE, SpeechDetector, TurnDetection
from omnimtp.server.websocket import Session, new_id

if TYPE_CHECKING:
    from omnimtp.families.qwen3_aligner import AlignedWord


@dataclass
class Settings:
    """A session's effective configuration (what `session.created` / `session.updated` report)."""

    voice: str
    output_modalities: tuple[str, ...] = ("audio",)
    instructions: str = ""
    max_output_tokens: int | str = "inf"
    input_rate: int = PCM_RATE
    input_format: str = "audio/pcm"
    output_format: str = "audio/pcm"
    tool_choice: str = "auto"
    seed: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    transcription: dict | None = None  # {"model", "language", "prompt"}: committed audio is transcribed
    turn_detection: TurnDetection | None = TurnDetection()  # None: manual turns
    type: str = "realtime"  # "transcription": committed turns are transcribed and never answered
    include: tuple[str, ...] = ()  # "item.input_audio_transcription.logprobs": input transcripts with logprobs
    noise_reduction: str | None = None  # the microphone kind a client names ("near_field"); no filter is applied


@dataclass
class ConversationItem:
    """One turn. content: the engine's chat content (the text, or parts with the audio decoded at the
    processor's rate); parts: the item's content as events show it."""

    id: str
    role: str
    content: str | tuple[dict, ...]
    parts: list[dict]
    status: str = "completed"
    # a spoken reply: its transcript's text deltas, its audio frames and samples (what a truncation cuts)
    text_deltas: tuple[str, ...] = ()
    num_frames: int = 0
    num_samples: int = 0
    # a spoken reply's words and when each is spoken in its audio (the server's forced aligner; None: unknown)
    words: tuple[AlignedWord, ...] | None = None
    is_cut: bool = False  # truncated or deleted while its response ran: what it streams after is not kept

    @property
    def num_bytes(self) -> int:
        """The memory its content holds: text as UTF-8, audio as its samples."""
        if isinstance(self.content, str):
            return len(self.content.encode())
        return sum(part["audio"].nbytes if part["type"] == "audio" else len(part["text"].encode())
                   for part in self.content)

    def event_item(self) -> dict:
        return {"id": self.id, "object": "realtime.item", "type": "message", "status": self.status,
                "role": self.role, "content": self.parts}


@dataclass
class TurnState:
    """Where the session's input audio stands for server VAD. Sample counts are at the input rate, over all audio
    appended since the detector started (`origin_*`: what was appended before it, in samples and ms)."""

    detector: SpeechDetector | None = None
    num_appended: int = 0  # samples appended since the session began (at the rates they came in)
    appended_ms: float = 0.0
    buffer_start: int = 0  # the sample the input audio buffer's first byte holds
    origin_sample: int = 0
    origin_ms: float = 0.0
    speech_start: int | None = None  # the first sample the turn in progress commits (prefix padding included)
    item_id: str | None = None  # the id the turn in progress's item gets
    idle_timer: asyncio.Task | None = None  # idle_timeout_ms's wait after a response (responses.watch_idle)

    def restart(self, detector: SpeechDetector | None) -> None:
        """A new detector from now on (None: manual turns); a turn in progress is forgotten."""
        self.detector = detector
        self.origin_sample, self.origin_ms = self.num_appended, self.appended_ms
        self.speech_start = self.item_id = None

    def sample(self, vad_sample: int, rate: int) -> int:
        return self.origin_sample + round(vad_sample * rate / VAD_RATE)

    def ms(self, sample: int, rate: int) -> int:
        return round(self.origin_ms + (sample - self.origin_sample) * 1000 / rate)


@dataclass
class RealtimeSession:
    context: ServingContext
    session: Session
    settings: Settings
    model_name: str
    id: str = field(default_factory=lambda: new_id("sess"))
    items: list[ConversationItem] = field(default_factory=list)
    audio_buffer: bytearray = field(default_factory=bytearray)
    response: asyncio.Task | None = None
    response_id: str | None = None
    handle: object | None = None
    transcripts: set[asyncio.Task] = field(default_factory=set)
    cancel_reason: str = "client_cancelled"  # what response.done says of a cancelled response
    turns: TurnState = field(default_factory=lambda: TurnState())
    alignments: set[asyncio.Task] = field(default_factory=set)  # replies' word timestamps being found
    stopped: asyncio.Event = field(default_factory=asyncio.Event)  # set when the active response is stopped
    recognizer: Callable | None = None  # what transcribes input audio (transcription.py); None: the thinker
    live: object | None = None  # the turn in progress's `live.LiveRecognition`, while one hears it

    def describe(self) -> dict:
        s = self.settings
        audio_input = {"format": describe_format(s.input_format, s.input_rate),
                       "turn_detection": s.turn_detection and s.turn_detection.describe(),
                       "transcription": s.transcription,
                       "noise_reduction": None if s.noise_reduction is None else {"type": s.noise_reduction}}
        if s.type == "transcription":
            return {"type": "transcription", "object": "realtime.transcription_session", "id": self.id,
                    "audio": {"input": audio_input}, "include": list(s.include) or None}
        return {
            "type": "realtime", "object": "realtime.session", "id": self.id, "model": self.model_name,
            "output_modalities": list(s.output_modalities), "instructions": s.instructions,
            "max_output_tokens": s.max_output_tokens, "tools": [], "tool_choice": s.tool_choice, "tracing": None,
            "include": list(s.include) or None,
            "audio": {
                "input": audio_input,
                "output": {"format": describe_format(s.output_format, PCM_RATE), "voice": s.voice,
                           "speed": 1.0},
            },
            "seed": s.seed, "temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k,
        }

    def stop_response(self, reason: str) -> None:
        """Cancel the active response at its next frame (response.done: cancelled, `reason`); a reply whose words
        are being aligned ends at once, without them."""
        if self.response is None:
            return
        self.cancel_reason = reason
        self.handle.cancel()
        self.stopped.set()

    def clear_buffer(self) -> None:
        """Empty the input audio buffer; a turn the server VAD had in progress ends with it."""
        turns = self.turns
        self.drop_live()
        self.audio_buffer.clear()
        turns.buffer_start, turns.speech_start, turns.item_id = turns.num_appended, None, None
        if turns.detector is not None:
            turns.detector.restart()

    def drop_live(self) -> None:
        """The turn in progress is not committed (cleared, or the settings changed): its live recognition stops."""
        if self.live is not None:
            self.live.cancel()
            self.live = None
