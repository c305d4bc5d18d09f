"""Audio formats of a session: audio/pcm (PCM16 at a rate) and G.711 (audio/pcmu, audio/pcma at 8 kHz), in
(base64 input decoded) and out (a response's deltas encoded)."""

from __future__ import annotations

import base64
import binascii

import numpy as np
import soxr

from omnimtp.server.audio import G711_CODECS, G711_RATE, g711_decode, g711_encode, to_pcm16
from omnimtp.server.routes.realtime.events import PCM_RATE, AudioFormat
from omnimtp.server.websocket import EventError


def input_format(audio_format: AudioFormat, param: str) -> tuple[str, int]:
    """An input format's type and sample rate: audio/pcm at its rate (24 kHz by default), G.711 at 8 kHz."""
    if audio_format.type in G711_CODECS:
        if audio_format.rate not in (None, G711_RATE):
            raise EventError(f"{param}.rate: {audio_format.type} is {G711_RATE} Hz, got {audio_format.rate}",
                             param=f"{param}.rate")
        return audio_format.type, G711_RATE
    return audio_format.type, audio_format.rate or PCM_RATE


def output_format(audio_format: AudioFormat, param: str) -> str:
    """An output format's type: audio/pcm at the model's 24 kHz, or G.711 (resampled to 8 kHz)."""
    if audio_format.type == "audio/pcm" and audio_format.rate not in (None, PCM_RATE):
        raise EventError(f"{param}.rate: output audio/pcm is {PCM_RATE} Hz, got {audio_format.rate}",
                         param=f"{param}.rate")
    return input_format(audio_format, param)[0]


def describe_format(fmt: str, rate: int) -> dict:
    return {"type": fmt} if fmt in G711_CODECS else {"type": fmt, "rate": rate}


def pcm_bytes(data: str, fmt: str, param: str) -> bytes:
    """Base64 input audio in `fmt` → PCM16 bytes (G.711 decoded, still at 8 kHz)."""
    try:
        pcm = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise EventError(f"{param}: is not valid base64", param=param) from None
    if fmt in G711_CODECS:
        return g711_decode(pcm, fmt).tobytes()
    if len(pcm) % 2:
        raise EventError(f"{param}: PCM16 audio has an even number of bytes, got {len(pcm)}", param=param)
    return pcm


class OutputEncoder:
    """A response's audio deltas in its output format: PCM16 at 24 kHz, or G.711 at 8 kHz (a soxr stream over
    the response, so chunk edges do not click)."""

    def __init__(self, fmt: str):
        self.fmt = fmt
        self._resampler = soxr.ResampleStream(PCM_RATE, G711_RATE, 1, dtype="float32") if fmt in G711_CODECS \
            else None

    def encode(self, samples: np.ndarray | None) -> str:
        """A delta's base64 text; None: the resampler's last samples at the response's end ("" when none)."""
        if self._resampler is None:
            return "" if samples is None else base64.b64encode(to_pcm16(samples).tobytes()).decode("ascii")
        is_last = samples is None
        samples = np.zeros(0, np.float32) if is_last else np.asarray(samples, dtype=np.float32)
        pcm = to_pcm16(self._resampler.resample_chunk(samples, last=is_last))
        return base64.b64encode(g711_encode(pcm, self.fmt)).decode("ascii")
