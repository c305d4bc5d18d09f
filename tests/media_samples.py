"""Media for the tests: tones, encoded audio, encoded images and crafted image headers."""

from __future__ import annotations

import base64
import io
import struct
import zlib

import numpy as np
import soundfile
from PIL import Image

SUBTYPES = {"WAV": "FLOAT", "FLAC": "PCM_24", "MP3": "MPEG_LAYER_III", "OGG": "VORBIS"}


def tone(seconds: float, rate: int, hz: float = 440.0, level: float = 0.5) -> np.ndarray:
    t = np.arange(round(seconds * rate)) / rate
    return (level * np.sin(2 * np.pi * hz * t)).astype(np.float32)


def encode(samples: np.ndarray, rate: int, fmt: str = "WAV", subtype: str | None = None) -> bytes:
    buffer = io.BytesIO()
    soundfile.write(buffer, samples, rate, format=fmt, subtype=subtype or SUBTYPES[fmt])
    return buffer.getvalue()


def image_bytes(image: Image.Image, fmt: str = "PNG", **kwargs) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt, **kwargs)
    return buffer.getvalue()


def png_header(width: int, height: int) -> bytes:
    """A PNG that says width × height and holds ten bytes of pixels (what a decompression bomb looks like)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\x00" * 10))


def animated_gif(num_frames: int = 3) -> bytes:
    frames = [Image.new("RGB", (8, 8), (40 * i, 0, 0)) for i in range(num_frames)]
    buffer = io.BytesIO()
    frames[0].save(buffer, "GIF", save_all=True, append_images=frames[1:])
    return buffer.getvalue()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")
