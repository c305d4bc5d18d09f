"""Server voice activity detection for realtime sessions: Silero VAD (the `silero-vad` package's bundled model,
on CPU, loaded once per process) run on one session's audio as it arrives.

A `SpeechDetector` belongs to one session: it resamples the session's audio to 16 kHz (a soxr stream), scores
each 32 ms window (512 samples) with the shared model through the model's pure step (the session keeps its
own recurrent state and context, so sessions never share state), and makes the same decisions as
`silero_vad.get_speech_timestamps(threshold=t, min_silence_duration_ms=s, speech_pad_ms=0,
min_speech_duration_ms=0)`: speech starts at the first window scoring >= threshold; inside speech a window
scoring below the exit threshold (threshold - 0.15, at least 0.01) marks a possible end, a window >= threshold
takes it back, and the speech stops once the possible end is `silence_duration_ms` old.

    detector = SpeechDetector(TurnDetection(), input_rate=24000)
    for event in detector.feed(samples_at_24k):   # float32 in [-1, 1]
        event.kind, event.sample                  # "speech_started" | "speech_stopped", at 16 kHz
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Literal

import numpy as np
import soxr
import torch

VAD_RATE = 16000
WINDOW_SAMPLES = 512  # silero's window at 16 kHz: 32 ms
_CONTEXT_SAMPLES = 64  # the samples of the previous window silero sees in front of each window
_STATE_SHAPE = (2, 1, 128)  # silero's recurrent state for a batch of one


# `semantic_vad`'s eagerness as the silence that ends a turn: the same detector, waiting longer for a speaker
# who pauses ("low") or answering sooner ("high"); "auto" is "medium", server_vad's default window.
EAGERNESS_SILENCE_MS = {"low": 1000, "medium": 500, "auto": 500, "high": 250}


@dataclass(frozen=True)
class TurnDetection:
    """`server_vad` as OpenAI's Realtime API names it (its defaults), or `semantic_vad` (`eagerness` set: the
    silence window is EAGERNESS_SILENCE_MS's, threshold and prefix padding server_vad's defaults).
    idle_timeout_ms: after a response, this long past the end of its audio without the user speaking, the
    session commits the silence as a turn and answers it (`input_audio_buffer.timeout_triggered`)."""

    threshold: float = 0.5
    prefix_padding_ms: int = 300
    silence_duration_ms: int = 500
    create_response: bool = True
    interrupt_response: bool = True
    idle_timeout_ms: int | None = None
    eagerness: Literal["low", "medium", "high", "auto"] | None = None

    @classmethod
    def semantic(cls, eagerness: str, *, create_response: bool = True, interrupt_response: bool = True,
                 idle_timeout_ms: int | None = None) -> TurnDetection:
        return cls(silence_duration_ms=EAGERNESS_SILENCE_MS[eagerness], create_response=create_response,
                   interrupt_response=interrupt_response, idle_timeout_ms=idle_timeout_ms, eagerness=eagerness)

    def describe(self) -> dict:
        if self.eagerness is not None:
            return {"type": "semantic_vad", "eagerness": self.eagerness, "create_response": self.create_response,
                    "interrupt_response": self.interrupt_response,
                    **({} if self.idle_timeout_ms is None else {"idle_timeout_ms": self.idle_timeout_ms})}
        return {"type": "server_vad", "threshold": self.threshold, "prefix_padding_ms": self.prefix_padding_ms,
                "silence_duration_ms": self.silence_duration_ms, "create_response": self.create_response,
                "interrupt_response": self.interrupt_response, "idle_timeout_ms": self.idle_timeout_ms}


@dataclass(frozen=True)
class SpeechEvent:
    """speech_started: `sample` is the first sample of the first speech window; speech_stopped: the first sample
    of the silence that ended it. Both at 16 kHz, counted from the detector's first sample."""

    kind: Literal["speech_started", "speech_stopped"]
    sample: int


@functools.cache
def silero_model():
    """The process's one Silero model (its bundled JIT weights; no download)."""
    import silero_vad

    model = silero_vad.load_silero_vad()
    model.eval()
    return model


class SpeechDetector:
    """Turn detection on one session's audio stream. Not thread-safe: one caller at a time (the session's)."""

    def __init__(self, config: TurnDetection, input_rate: int):
        self.config = config
        self.input_rate = input_rate
        self._resampler = self._new_resampler()
        self._pending = np.zeros(0, dtype=np.float32)  # [n < WINDOW_SAMPLES] at 16 kHz, not scored yet
        self._num_scored = 0  # samples at 16 kHz already scored, or dropped unscored by `restart`
        self._state = torch.zeros(_STATE_SHAPE)
        self._context = torch.zeros(1, _CONTEXT_SAMPLES)
        self.is_speaking = False
        self._possible_end = 0  # 0: none (as silero's temp_end)
        self._exit_threshold = max(config.threshold - 0.15, 0.01)
        self._silence_samples = VAD_RATE * config.silence_duration_ms / 1000

    def feed(self, samples: np.ndarray) -> list[SpeechEvent]:
        """Score the new audio (float32 at `input_rate`); the turn boundaries it crosses, in order."""
        samples = np.asarray(samples, dtype=np.float32)
        if self._resampler is not None:
            samples = self._resampler.resample_chunk(samples)
        self._pending = np.concatenate([self._pending, samples])
        events = []
        num_windows = len(self._pending) // WINDOW_SAMPLES
        for i in range(num_windows):
            window = self._pending[i * WINDOW_SAMPLES:(i + 1) * WINDOW_SAMPLES]
            event = self._decide(self._score(window), self._num_scored)
            self._num_scored += WINDOW_SAMPLES
            if event is not None:
                events.append(event)
        self._pending = self._pending[num_windows * WINDOW_SAMPLES:]
        return events

    def restart(self) -> None:
        """Forget the speech in progress (the buffer it was in was committed or cleared), and the audio fed so far
        that was not scored yet (a partial window, the resampler's delay): it was in that buffer, so it starts no
        turn after it. The model keeps its acoustic state, as the audio itself goes on."""
        self.is_speaking = False
        self._possible_end = 0
        if self._resampler is not None:
            tail = self._resampler.resample_chunk(np.zeros(0, dtype=np.float32), last=True)
            self._resampler = self._new_resampler()
            self._num_scored += len(tail)
        self._num_scored += len(self._pending)
        self._pending = self._pending[:0]

    def _new_resampler(self) -> soxr.ResampleStream | None:
        if self.input_rate == VAD_RATE:
            return None
        return soxr.ResampleStream(self.input_rate, VAD_RATE, 1, dtype="float32")

    @torch.inference_mode()
    def _score(self, window: np.ndarray) -> float:
        x = torch.cat([self._context, torch.from_numpy(window)[None]], dim=1)  # [1, 64 + 512]
        probs, self._state = silero_model()._model(x, self._state)  # the shared model's pure step
        self._context = x[:, -_CONTEXT_SAMPLES:]
        return float(probs.item())

    def _decide(self, prob: float, sample: int) -> SpeechEvent | None:
        threshold = self.config.threshold
        if prob >= threshold:
            self._possible_end = 0
            if not self.is_speaking:
                self.is_speaking = True
                return SpeechEvent("speech_started", sample)
            return None
        if self.is_speaking and prob < self._exit_threshold:
            if not self._possible_end:
                self._possible_end = sample
            if sample - self._possible_end >= self._silence_samples:
                end, self._possible_end, self.is_speaking = self._possible_end, 0, False
                return SpeechEvent("speech_stopped", end)
        return None
