"""Shared by the Qwen3-ASR and aligner tests: speech-like noise at 16 kHz, and an engine core run to its end."""

from __future__ import annotations

import numpy as np

RATE = 16_000


def speechlike(seconds: float, seed: int) -> np.ndarray:
    """Noise shaped by a slow envelope: audio whose encoder rows differ from row to row."""
    rng = np.random.default_rng(seed)
    n = int(seconds * RATE)
    envelope = 0.5 + 0.5 * np.sin(np.linspace(0, 6 * np.pi, n) + seed)
    return (0.2 * envelope * rng.standard_normal(n)).astype(np.float32)


def run_requests(family, requests) -> list[list[int]]:
    """Each request's reply ids, the requests run together on one engine core until none has work."""
    from omnimtp.engine.core import EngineConfig, EngineCore

    core = EngineCore(family, EngineConfig(max_batch_size=max(4, len(requests))))
    for request in requests:
        core.add(request)
    outputs = {}
    while core.has_work():
        for event in core.step():
            if event.is_finished:
                outputs[event.request.request_id] = core.output(event.request).text_ids
    return [outputs[r.request_id] for r in requests]
