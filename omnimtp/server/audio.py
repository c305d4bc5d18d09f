"""Audio encoding for responses: float32 samples → PCM16 raw, WAV or FLAC bytes.

Every format carries the same 16-bit samples (`to_pcm16`), so a WAV or FLAC response decodes to
exactly the raw PCM a `pcm` response (or the base64 deltas of a stream) carries. No samples is still a
file of its format: a WAV with an empty data chunk, a FLAC stream with no frames, empty raw PCM.
"""

from __future__ import annotations

import io
import struct

import numpy as np
import soundfile as sf

# Formats as the two routes name them: chat says "pcm16", speech says "pcm".
_SUBTYPE_CONTAINERS = {"wav": "WAV", "flac": "FLAC"}
RAW_FORMATS = ("pcm", "pcm16")
MEDIA_TYPES = {"wav": "audio/wav", "flac": "audio/flac", "pcm": "audio/pcm", "pcm16": "audio/pcm"}


def to_pcm16(samples: np.ndarray) -> np.ndarray:
    """float samples in [-1, 1] (clipped) → little-endian int16, rounding to nearest."""
    samples = np.asarray(samples, dtype=np.float32)
    if samples.ndim != 1:
        raise ValueError(f"samples must be 1-D mono audio, got shape {samples.shape}")
    scaled = np.rint(np.clip(samples, -1.0, 1.0) * 32767.0)
    return scaled.astype("<i2")


def encode_audio(samples: np.ndarray, sample_rate: int, fmt: str) -> bytes:
    """A whole response body in `fmt` ("wav", "flac", "pcm" or "pcm16")."""
    pcm = to_pcm16(samples)
    if fmt in RAW_FORMATS:
        return pcm.tobytes()
    container = _SUBTYPE_CONTAINERS.get(fmt)
    if container is None:
        raise ValueError(f"fmt must be one of wav, flac, pcm, pcm16, got {fmt!r}")
    if container == "FLAC" and not pcm.size:
        return _empty_flac(sample_rate)  # libsndfile writes nothing for no samples
    buffer = io.BytesIO()
    sf.write(buffer, pcm, sample_rate, format=container, subtype="PCM_16")
    return buffer.getvalue()


def _empty_flac(sample_rate: int) -> bytes:
    """A FLAC stream of no audio frames (RFC 9639 §6): the `fLaC` marker and one STREAMINFO block (the last
    metadata block) for 16-bit mono at `sample_rate`: block sizes 4096, frame sizes and MD5 0 (unknown), total
    samples 0 (for FLAC: not stated; the stream ends before any frame).

    libsndfile (soundfile) opens it and reads its header, but `soundfile.read` of it fails, and no valid FLAC
    stream of no samples can avoid that: a frame holds at least one sample, and STREAMINFO's total samples 0
    means "unknown" (RFC 9639 §8.2), so libsndfile reports SF_COUNT_MAX frames; soundfile seeks after every
    read, libFLAC cannot seek in a stream with no frames, and libsndfile forgives a failed seek only to the
    known end of the stream. (libsndfile itself writes no bytes at all for no samples.) `sf_readf_short` on
    it reads 0 frames without error."""
    info = struct.pack(">HH", 4096, 4096) + bytes(6)
    info += ((sample_rate << 44) | (0 << 41) | (15 << 36)).to_bytes(8, "big") + bytes(16)  # 1 channel, 16 bits
    return b"fLaC" + bytes([0x80]) + len(info).to_bytes(3, "big") + info


def streaming_wav_header(sample_rate: int) -> bytes:
    """A 16-bit mono WAV header for a body whose length is not known yet (sizes = 0xFFFFFFFF, as
    OpenAI's streamed WAV does); readers take the data to the end of the stream."""
    unknown = 0xFFFFFFFF
    fmt_chunk = struct.pack("<4sIHHIIHH", b"fmt ", 16, 1, 1, sample_rate, sample_rate * 2, 2, 16)
    return struct.pack("<4sI4s", b"RIFF", unknown, b"WAVE") + fmt_chunk + struct.pack("<4sI", b"data", unknown)


# G.711 (ITU-T), the telephone formats of OpenAI's Realtime API: one byte per sample at 8 kHz. FFmpeg's
# codecs (through PyAV) do the companding.
G711_RATE = 8000
G711_CODECS = {"audio/pcmu": "pcm_mulaw", "audio/pcma": "pcm_alaw"}


def g711_decode(data: bytes, fmt: str) -> np.ndarray:
    """G.711 bytes ("audio/pcmu" μ-law or "audio/pcma" A-law) → int16 samples at 8 kHz, one per byte."""
    import av

    if not data:
        return np.zeros(0, dtype="<i2")
    decoder = av.CodecContext.create(G711_CODECS[fmt], "r")
    decoder.sample_rate, decoder.layout = G711_RATE, "mono"
    frames = decoder.decode(av.Packet(data))
    return np.concatenate([frame.to_ndarray().reshape(-1) for frame in frames]).astype("<i2")


def g711_encode(pcm16: np.ndarray, fmt: str) -> bytes:
    """int16 samples at 8 kHz → G.711 bytes ("audio/pcmu" or "audio/pcma"), one per sample."""
    import av

    pcm16 = np.ascontiguousarray(pcm16, dtype=np.int16)
    if not pcm16.size:
        return b""
    encoder = av.CodecContext.create(G711_CODECS[fmt], "w")
    encoder.sample_rate, encoder.layout, encoder.format = G711_RATE, "mono", "s16"
    frame = av.AudioFrame.from_ndarray(pcm16[None], format="s16", layout="mono")
    frame.sample_rate = G711_RATE
    return b"".join(bytes(packet) for packet in [*encoder.encode(frame), *encoder.encode(None)])
