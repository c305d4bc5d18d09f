"""Audio encoding for responses and files: float32 samples → PCM16 raw, WAV, FLAC, MP3, Opus (Ogg) or AAC bytes.

Every format carries the same 16-bit samples (`to_pcm16`), so a WAV or FLAC response decodes to
exactly the raw PCM a `pcm` response (or the base64 deltas of a stream) carries; MP3, Opus and AAC decode to
those samples within their codec's error. No samples is still a file of its format: a WAV with an empty data
chunk, a FLAC stream with no frames; raw PCM, MP3, Opus and AAC: no bytes.

The lossy formats go through FFmpeg's encoders in PyAV (libmp3lame, libopus, its native AAC), one
`StreamEncoder` per response: it takes the audio chunk by chunk and hands back the container bytes complete so
far, so a streamed response starts with the first chunk. Opus runs at 48 kHz (the Ogg Opus rule: decoders
play at 48 kHz whatever the input was), so other rates are resampled by FFmpeg's resampler.
"""

from __future__ import annotations

import functools
import io
import os
import struct

import numpy as np
import soundfile as sf

# Formats as the two routes name them: chat says "pcm16", speech says "pcm".
_SUBTYPE_CONTAINERS = {"wav": "WAV", "flac": "FLAC"}
RAW_FORMATS = ("pcm", "pcm16")
# format → (PyAV container, encoder, bit rate)
_LOSSY = {"mp3": ("mp3", "libmp3lame", 128_000), "opus": ("ogg", "libopus", 64_000), "aac": ("adts", "aac", 128_000)}
FORMATS = ("wav", "flac", "pcm", "pcm16", *_LOSSY)
# the formats whose bytes can be sent as they are encoded (FLAC states its length in its header)
STREAMED_FORMATS = ("wav", "pcm", "pcm16", *_LOSSY)
MEDIA_TYPES = {"wav": "audio/wav", "flac": "audio/flac", "pcm": "audio/pcm", "pcm16": "audio/pcm",
               "mp3": "audio/mpeg", "opus": "audio/ogg", "aac": "audio/aac"}
# a file name's extension → its format (the CLI's -o)
EXTENSIONS = {".wav": "wav", ".flac": "flac", ".mp3": "mp3", ".opus": "opus", ".ogg": "opus", ".aac": "aac"}


def to_pcm16(samples: np.ndarray) -> np.ndarray:
    """float samples in [-1, 1] (clipped) → little-endian int16, rounding to nearest."""
    samples = np.asarray(samples, dtype=np.float32)
    if samples.ndim != 1:
        raise ValueError(f"samples must be 1-D mono audio, got shape {samples.shape}")
    scaled = np.rint(np.clip(samples, -1.0, 1.0) * 32767.0)
    return scaled.astype("<i2")


def encode_audio(samples: np.ndarray, sample_rate: int, fmt: str) -> bytes:
    """A whole response body in `fmt` (one of FORMATS)."""
    if fmt in _LOSSY:
        encoder = StreamEncoder(fmt, sample_rate)
        return encoder.push(samples) + encoder.finish()
    pcm = to_pcm16(samples)
    if fmt in RAW_FORMATS:
        return pcm.tobytes()
    container = _SUBTYPE_CONTAINERS.get(fmt)
    if container is None:
        raise ValueError(f"fmt must be one of {', '.join(FORMATS)}, got {fmt!r}")
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


def format_of_path(path: str, param: str = "path") -> str:
    """The format a file name asks for by its extension (EXTENSIONS); ValueError naming `param` otherwise."""
    extension = os.path.splitext(path)[1].lower()
    if extension not in EXTENSIONS:
        raise ValueError(f"{param} must end in {', '.join(EXTENSIONS)}, got {path!r}")
    return EXTENSIONS[extension]


def write_audio(path: str, samples: np.ndarray, sample_rate: int) -> None:
    """The audio written to `path` in the format its extension names (`format_of_path`)."""
    data = encode_audio(samples, sample_rate, format_of_path(path))
    with open(path, "wb") as f:
        f.write(data)


class StreamEncoder:
    """Incremental encoding into one of the streamed formats: `push` a chunk of float samples, get the bytes
    that are final so far; `finish` flushes the encoder and closes the container. The concatenated bytes are
    one valid file (for WAV: the streaming header of unknown length, then the samples)."""

    def __init__(self, fmt: str, sample_rate: int):
        if fmt not in STREAMED_FORMATS:
            raise ValueError(f"fmt must be one of {', '.join(STREAMED_FORMATS)}, got {fmt!r}")
        self.fmt, self.sample_rate = fmt, sample_rate
        self._header = streaming_wav_header(sample_rate) if fmt == "wav" else b""
        self._container = None
        if fmt in _LOSSY:
            import av

            container_format, codec, bit_rate = _LOSSY[fmt]
            self._sink = io.BytesIO()
            # no Xing header: the mp3 muxer would seek back to the start to write it, past bytes already sent
            # Ogg pages of 20 ms, not the muxer's 1 s: a stream's first audio leaves with its first chunk
            options = {"mp3": {"write_xing": "0"}, "ogg": {"page_duration": "20000"}}.get(container_format, {})
            self._container = av.open(self._sink, mode="w", format=container_format, options=options)
            rate = 48_000 if codec == "libopus" else sample_rate
            self._stream = self._container.add_stream(codec, rate=rate, layout="mono")
            self._stream.bit_rate = bit_rate
            self._resampler = av.AudioResampler(format=self._stream.format.name, layout="mono", rate=rate)
            self._num_samples = 0  # pushed so far: each frame's pts at the input rate

    def push(self, samples: np.ndarray) -> bytes:
        pcm = to_pcm16(samples)
        header, self._header = self._header, b""
        if self._container is None:
            return header + pcm.tobytes()
        if pcm.size:
            import av

            frame = av.AudioFrame.from_ndarray(pcm.reshape(1, -1), format="s16", layout="mono")
            frame.sample_rate, frame.pts = self.sample_rate, self._num_samples
            self._num_samples += pcm.size
            for resampled in self._resampler.resample(frame):
                self._container.mux(self._stream.encode(resampled))
        return self._drain()

    def finish(self) -> bytes:
        header, self._header = self._header, b""
        if self._container is None:
            return header
        for resampled in self._resampler.resample(None):
            self._container.mux(self._stream.encode(resampled))
        self._container.mux(self._stream.encode(None))
        self._container.close()
        return self._drain()

    def _drain(self) -> bytes:
        data = self._sink.getvalue()
        self._sink.seek(0)
        self._sink.truncate()
        return data


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
    """int16 samples at 8 kHz → G.711 bytes ("audio/pcmu" or "audio/pcma"), one per sample: the code words of
    ITU-T G.711's decision levels (`_g711_codes`)."""
    if fmt not in G711_CODECS:
        raise ValueError(f"fmt must be one of {', '.join(G711_CODECS)}, got {fmt!r}")
    pcm16 = np.asarray(pcm16, dtype=np.int16)
    return _g711_codes(fmt)[pcm16.astype(np.int32) + 32768].tobytes()


@functools.cache
def _g711_codes(fmt: str) -> np.ndarray:
    """[65536] uint8: the code word of each int16 sample (at index sample + 32768), as ITU-T G.191's reference
    encoder forms it: the sample's magnitude (its one's complement when negative) cut to μ-law's 14 or A-law's
    13 bits, its segment (the power of two it lies under) and the 4-bit step inside that segment; μ-law sends
    all bits inverted, A-law the even ones. (FFmpeg's encoders pick the nearest reconstruction value instead,
    which differs from the standard's decision levels at the top of each segment.)"""
    samples = np.arange(-32768, 32768, dtype=np.int32)
    magnitude = np.where(samples < 0, ~samples, samples)
    if fmt == "audio/pcmu":
        biased = np.minimum((magnitude >> 2) + 33, 0x1FFF)  # 14 bits with the bias of 33: 33..8191
        segment = np.frexp(biased >> 5)[1] - 1  # 0..7
        code = 0x7F - ((segment << 4) | ((biased >> (segment + 1)) & 0x0F))
    else:
        level = magnitude >> 4  # 12 bits of magnitude (13 with the sign)
        segment = np.where(level > 15, np.frexp(level >> 4)[1], 0)  # 0..7
        code = ((segment << 4) | np.where(segment == 0, level, (level >> np.maximum(segment - 1, 0)) - 16)) ^ 0x55
    return np.where(samples >= 0, code | 0x80, code).astype(np.uint8)
