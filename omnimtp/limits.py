"""The default caps and limits every driver shares (Python API, server, CLI), importable without torch or
the server stack, so that the command line can show them in `--help` before anything heavy loads.

`MediaLimits` (what one request's audio and images may hold) lives here for the same reason;
`omnimtp.media` is where it is used and exported.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

# A request's default thinker token and audio frame caps (`omnimtp.engine.core.EngineConfig`).
DEFAULT_MAX_NEW_TOKENS = 256
DEFAULT_MAX_FRAMES = 1500  # 2 minutes of speech at 12.5 frames/s, per segment of a spoken text
# The text tokens of one segment of a spoken text (`omnimtp.text_segments`): a longer text is spoken as several
# segments of one request. About 100 English words or 150 Chinese characters, half a minute of speech: the
# speech models drift (pace, voice, skipped words) on much longer single prompts.
DEFAULT_MAX_SEGMENT_TOKENS = 150
# The embedded tiny model's caps: its random talker rarely emits codec EOS, so replies stay short.
TINY_MAX_NEW_TOKENS = 32
TINY_MAX_FRAMES = 100

# A voice-clone reference recording (`create_voice`): at least a second for a stable x-vector; at most a
# minute, measured before resampling (the released models are cloned from a few seconds).
MIN_REF_AUDIO_SECONDS = 1.0
MAX_REF_AUDIO_SECONDS = 60.0
# The largest sample magnitude of any audio input (full scale is 1; a float recording may overshoot a little).
# Far larger values overflow the float32 spectrograms: the speaker encoder's embedding becomes infinities, and a
# transcript or reply heard from them is garbage (NUL characters).
MAX_AUDIO_MAGNITUDE = 16.0
# The highest sample rate an audio input may declare (resampling from a header's 2^31 − 1 Hz takes seconds).
MAX_AUDIO_SAMPLE_RATE = 384_000

# The server's timeouts (`omnimtp.server.serving`) and request limits (`omnimtp.server.app.create_app`).
DEFAULT_HEADERS_TIMEOUT_S = 10.0
DEFAULT_BODY_TIMEOUT_S = 30.0  # enforced by the app (`create_app(body_timeout_s=...)`)
DEFAULT_KEEP_ALIVE_TIMEOUT_S = 5.0
DEFAULT_GRACEFUL_SHUTDOWN_TIMEOUT_S = 30.0
DEFAULT_MAX_QUEUE = 64  # waiting requests before 429
DEFAULT_MAX_BODY_BYTES = 16 << 20  # a base64 input_audio of about 6 minutes of 16 kHz 16-bit WAV
DEFAULT_MAX_TOKENS_LIMIT = 2048  # the largest max_tokens a request may ask
# WebSocket routes (`omnimtp.server.websocket.WebSocketLimits`; a message may be as large as a request body).
DEFAULT_MAX_WEBSOCKET_SESSIONS = 64  # open sessions per route before the upgrade is refused (429)
DEFAULT_WEBSOCKET_IDLE_TIMEOUT_S = 600.0  # a session with no message either way this long is closed
# A streamed-text speech request (`/v1/audio/speech/stream`) that has waited this long for more text is ended
# (`omnimtp.server.scheduler.Engine`): it holds no batch slot meanwhile, but its talker state stays in memory.
DEFAULT_TIMEOUT_TEXT_IDLE_S = 60.0
DEFAULT_MAX_SESSION_ITEMS = 512  # conversation items a realtime session holds
DEFAULT_MAX_SESSION_BYTES = 64 << 20  # their content in memory (audio as the processor's float32 samples)
# the realtime conversations kept warm (thinker KV of each session's last prompt): Qwen3-Omni-30B-A3B's thinker
# holds ~96 KiB per position in bf16, so 1 GiB keeps about 10,000 positions of conversation
DEFAULT_SESSION_CACHE_MB = 1024


def check_seconds(name: str, value) -> float:
    """`value` as float seconds; ValueError naming `name` unless it is a finite number > 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number of seconds > 0, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class MediaLimits:
    """What one request's media may hold; larger media is refused, never cut or shrunk.

    max_audio_seconds: per audio, measured before resampling. max_image_pixels: width × height per image,
    read from the header before the image is decoded (Qwen's processor allows 12,845,056 = 3584²).
    max_parts: audio and image parts per request."""

    max_audio_seconds: float = 300.0
    max_image_pixels: int = 12_845_056
    max_parts: int = 8

    def __post_init__(self):
        seconds = self.max_audio_seconds
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not math.isfinite(seconds) \
                or seconds <= 0:
            raise ValueError(f"max_audio_seconds must be a finite number > 0, got {seconds!r}")
        for name in ("max_image_pixels", "max_parts"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


# Clients send the key in an HTTP header, which they encode as ASCII: any other key locks everyone out.
_API_KEY = re.compile(r"[\x21-\x7e]+")


def check_api_key(api_key: str | None) -> None:
    """Raise ValueError unless `api_key` is None (no auth) or a key every client can send: printable
    ASCII without spaces (clients encode headers as ASCII; any other key would lock everyone out).
    The message never shows the key."""
    if api_key is None:
        return
    if not isinstance(api_key, str):
        raise ValueError(f"api_key must be a string or None, got {type(api_key).__name__}")
    if not api_key:
        raise ValueError("api_key must not be empty (None serves without a key)")
    if not _API_KEY.fullmatch(api_key):
        raise ValueError("api_key must be printable ASCII without spaces: clients send it in an ASCII HTTP header")
