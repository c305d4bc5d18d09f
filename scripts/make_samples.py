"""Write the two sample inputs the README's examples use: a spoken-question stand-in and a photo stand-in.

    python scripts/make_samples.py                 # examples/question.wav, examples/photo.png
    python scripts/make_samples.py --out-dir DIR

question.wav: 1.5 s, 16 kHz mono PCM16, a rising tone with a little seeded noise (about 48 KB).
photo.png: 64 × 48 RGB, colour gradients with a disc (under 1 KB). Both are the same on every run.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import soundfile
from PIL import Image

SAMPLE_RATE = 16_000
SECONDS = 1.5
WIDTH, HEIGHT = 64, 48


def question_samples() -> np.ndarray:
    """[SAMPLE_RATE · SECONDS] float32 in [-1, 1]: a 220 → 660 Hz sweep under a fade, plus noise."""
    t = np.arange(round(SECONDS * SAMPLE_RATE)) / SAMPLE_RATE
    phase = 2 * np.pi * (220.0 * t + (660.0 - 220.0) * t**2 / (2 * SECONDS))
    envelope = np.minimum(1.0, np.minimum(t, SECONDS - t) / 0.05)
    noise = np.random.default_rng(0).standard_normal(t.shape)
    return (0.4 * envelope * np.sin(phase) + 0.02 * noise).astype(np.float32)


def photo_pixels() -> np.ndarray:
    """[HEIGHT, WIDTH, 3] uint8: red across, green down, a blue disc in the middle."""
    y, x = np.mgrid[0:HEIGHT, 0:WIDTH]
    disc = (x - WIDTH / 2) ** 2 + (y - HEIGHT / 2) ** 2 < (HEIGHT / 4) ** 2
    rgb = np.stack([x * 255 // (WIDTH - 1), y * 255 // (HEIGHT - 1), np.where(disc, 220, 40)], axis=-1)
    return rgb.astype(np.uint8)


def write_samples(out_dir: Path) -> tuple[Path, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    audio, image = out_dir / "question.wav", out_dir / "photo.png"
    soundfile.write(audio, question_samples(), SAMPLE_RATE, subtype="PCM_16")
    Image.fromarray(photo_pixels()).save(image)
    return audio, image


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out-dir", type=Path, default=Path("examples"), help="where to write them (default examples/)"
    )
    for path in write_samples(parser.parse_args().out_dir):
        print(f"{path} ({path.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
