"""Prometheus metrics, one registry per app (so two apps in one process never share counters)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_FPS_BUCKETS = (1, 2.5, 5, 10, 12.5, 25, 50, 100, 250, 500, 1000, 2500)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)


class ServerMetrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "omnimtp_requests", "HTTP requests by route and status code", ["route", "status"], registry=r
        )
        self.queue_depth = Gauge("omnimtp_queue_depth", "Requests waiting for a batch slot", registry=r)
        self.active_requests = Gauge("omnimtp_active_requests", "Requests holding a batch slot", registry=r)
        self.cancelled = Counter(
            "omnimtp_cancelled_requests",
            "Requests cancelled before they finished, queued or running: the client disconnected, or the "
            "server's shutdown deadline passed", registry=r,
        )
        self.time_to_first_audio = Histogram(
            "omnimtp_time_to_first_audio_seconds", "Submission to first audio chunk", buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.frames_per_second = Histogram(
            "omnimtp_frames_per_second", "Audio frames per second of a finished request", buckets=_FPS_BUCKETS,
            registry=r,
        )
        self.first_audio_stage = Histogram(
            "omnimtp_first_audio_stage_seconds",
            "Time to first audio by stage: queue (submitted to admitted), thinker (to talker prefill), "
            "talker (to first frame), code2wav (to first audio chunk)", ["stage"], buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.engine_phase = Histogram(
            "omnimtp_engine_phase_seconds", "Engine iteration time by phase: think, talker_admit, talk, code2wav",
            ["phase"], buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.step_batch_size = Histogram(
            "omnimtp_talker_step_batch_size", "Requests in one talker step", buckets=_BATCH_BUCKETS, registry=r
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
