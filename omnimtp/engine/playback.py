"""What a listener hears of a streamed reply: a real-time playback clock that starts at the first audio.

A player starts playing at the first chunk's arrival and plays every later chunk right after the one before; a
chunk that arrives after the audio before it ran out is an underrun: the player stalls from the moment the audio
ran out until the chunk came, then plays on (its clock shifts by the stall). A stream's lead at a time is the
audio it holds that is not yet played; continuity is the share of its playing time that was audio:
audio ÷ (audio + stalled seconds), 1.0 for a stream that never stalled.

    clock = PlaybackClock()
    clock.push(0.00, 0.08)     # first audio at t = 0: 80 ms to play, lead 0.08
    clock.push(0.05, 0.08)     # in time: lead 0.16 − 0.05 = 0.11
    clock.push(0.30, 0.08)     # the audio ran out at 0.16: a 0.14 s underrun, then 0.08 s to play
    clock.num_underruns, round(clock.stalled_s, 2), round(clock.continuity, 3)   # 1, 0.14, 0.632

The engine keeps one per request (`Request.playback`: which later chunks may wait for a newcomer), the server one
per stream (its lead and underruns go to /metrics), `benchmarks/serve_playback.py` one per response it reads.
`chunk_frames_after` sizes streamed chunks so that such a listener never runs dry while frames are made faster than
real time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class PlaybackClock:
    """One stream's playback (see the module docstring); times in seconds on any one monotonic clock.
    min_stall_s: a gap shorter than this is not counted as an underrun (a player's jitter)."""

    min_stall_s: float = 0.0
    started_at: float | None = None  # the first audio's arrival
    ends_at: float | None = None  # when the audio received so far has all been played
    audio_s: float = 0.0
    stalled_s: float = 0.0
    num_underruns: int = 0

    def push(self, now: float, seconds: float) -> float:
        """A chunk of `seconds` of audio arrived at `now` → the seconds the player stalled waiting for it."""
        if not seconds >= 0 or math.isinf(seconds):
            raise ValueError(f"seconds must be a finite number >= 0, got {seconds!r}")
        if seconds == 0:
            return 0.0
        stall = 0.0
        if self.started_at is None:
            self.started_at = self.ends_at = now
        elif now > self.ends_at:
            stall = now - self.ends_at
            self.ends_at = now
            if stall > self.min_stall_s:
                self.num_underruns += 1
                self.stalled_s += stall
            else:
                stall = 0.0
        self.ends_at += seconds
        self.audio_s += seconds
        return stall

    def lead(self, now: float) -> float | None:
        """Seconds of received audio not yet played at `now` (negative: the player is stalled that long
        already); None before the first audio."""
        return None if self.ends_at is None else self.ends_at - now

    @property
    def continuity(self) -> float:
        """audio ÷ (audio + stalled seconds); 1.0 before any audio."""
        total = self.audio_s + self.stalled_s
        return 1.0 if total == 0 else self.audio_s / total


def chunk_frames_after(num_decoded: int, chunk_frames: int, playout_rtf: float | None) -> int:
    """The frames of a streamed request's later chunk once num_decoded frames are out (`EngineConfig.playout_rtf`).

    Frames made in r (playout_rtf) of a frame's audio each, each chunk sent when its last frame is made: a listener
    who started at a first chunk of one frame holds L = 1 + (D − 1)·(1 − r) frames of audio when D frames are out
    (a chunk of s frames takes s·r to make and adds s), and the next chunk of n frames, made in n·r, comes before
    that runs out while n·r ≤ L, i.e. n ≤ 1 + D·(1 − r) / r. At 0.9: 1 frame each until 9 are out, then 2 until
    18, ..., chunk_frames (25) from 216 out (17 s of audio)."""
    if playout_rtf is None:
        return chunk_frames
    return max(1, min(chunk_frames, int(1 + num_decoded * (1 - playout_rtf) / playout_rtf + 1e-9)))
