"""Audio assertions that can fail: a comparison is only made after the signal is shown to be audible,
and closeness is measured relative to the signal's own level, never with an absolute tolerance that
very quiet audio passes trivially."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np

MIN_DBFS = -40.0  # quieter than this is treated as silence: comparing it proves nothing


def rms_dbfs(audio) -> float:
    """RMS level in dB relative to full scale (float audio in [-1, 1], or int16 PCM)."""
    samples = np.asarray(audio)
    if samples.dtype == np.int16:
        samples = samples.astype(np.float64) / 32768.0
    samples = samples.astype(np.float64).ravel()
    if samples.size == 0:
        return float("-inf")
    rms = float(np.sqrt(np.mean(samples**2)))
    return 20.0 * np.log10(rms) if rms > 0 else float("-inf")


def assert_audible(audio, min_dbfs: float = MIN_DBFS) -> None:
    """The signal is at least `min_dbfs` RMS: loud enough that a wrong sample shows."""
    level = rms_dbfs(audio)
    assert level >= min_dbfs, f"audio is silent ({level:.1f} dBFS < {min_dbfs} dBFS): a comparison would prove nothing"


def assert_audio_equal(actual, expected) -> None:
    """Bit for bit equal, on audible audio."""
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert_audible(expected)
    assert actual.shape == expected.shape, f"audio shapes differ: {actual.shape} vs {expected.shape}"
    mismatch = np.flatnonzero(actual.ravel() != expected.ravel())
    assert mismatch.size == 0, f"{mismatch.size} of {expected.size} samples differ (first at {mismatch[0]})"


def assert_audio_close(actual, expected, rel: float = 1e-4) -> None:
    """Equal up to float rounding: max |Δ| ≤ rel × the expected signal's peak, on audible audio."""
    actual = np.asarray(actual, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    assert_audible(expected)
    assert actual.shape == expected.shape, f"audio shapes differ: {actual.shape} vs {expected.shape}"
    peak = float(np.abs(expected).max())
    error = float(np.abs(actual - expected).max())
    assert error <= rel * peak, f"max |Δ| = {error:.3g} > {rel} × peak {peak:.3g}"


def spoken_wav(path, text: str, *espeak_args: str) -> Path:
    """Real speech for a test: espeak-ng saying `text`, written to `path` as its WAV (22.05 kHz mono) and shown
    to be audible. The test skips, saying why, where espeak-ng (a Debian package) is not installed."""
    import pytest
    import soundfile

    if shutil.which("espeak-ng") is None:
        pytest.skip("espeak-ng is not installed (apt-get install espeak-ng): it makes the test's speech")
    subprocess.run(["espeak-ng", *espeak_args, "-w", str(path), text], check=True, capture_output=True)
    samples, _ = soundfile.read(path, dtype="float32")
    assert_audible(samples)
    return Path(path)
