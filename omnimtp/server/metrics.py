"""Prometheus metrics, one registry per app (so two apps in one process never share counters)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_FPS_BUCKETS = (1, 2.5, 5, 10, 12.5, 25, 50, 100, 250, 500, 1000, 2500)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
_ACCEPTANCE_LENGTH_BUCKETS = (1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 8.0)
_ACCEPTANCE_RATE_BUCKETS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)


class ServerMetrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "omnimtp_requests", "HTTP requests by route and status code", ["route", "status"], registry=r
        )
        self.websocket_sessions = Counter(
            "omnimtp_websocket_sessions", "WebSocket upgrades by route and outcome: accepted, unauthorized, "
            "too_many_sessions", ["route", "status"], registry=r
        )
        self.websocket_active_sessions = Gauge(
            "omnimtp_websocket_active_sessions", "Open WebSocket sessions by route", ["route"], registry=r
        )
        self.websocket_error_events = Counter(
            "omnimtp_websocket_error_events", "error events sent for bad client events, by route and code",
            ["route", "code"], registry=r
        )
        self.queue_depth = Gauge("omnimtp_queue_depth", "Requests waiting for a batch slot", registry=r)
        self.active_requests = Gauge("omnimtp_active_requests", "Requests holding a batch slot", registry=r)
        self.parked_requests = Gauge(
            "omnimtp_parked_requests", "Admitted requests waiting for more of their streamed text, holding no slot",
            registry=r,
        )
        self.cancelled = Counter(
            "omnimtp_cancelled_requests",
            "Requests cancelled before they finished, queued or running: the client disconnected, or the "
            "server's shutdown deadline passed", registry=r,
        )
        self.audio_cut = Counter(
            "omnimtp_audio_cut_requests", "Requests whose audio was cut (finish_reason \"length\") by what cut it: "
            "max_frames (--max-frames), text_length (its text's bound: frames per text token, with a floor), "
            "repetition (code 0 repeating a short pattern)", ["cut_by"], registry=r,
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
        self.stream_underruns = Counter(
            "omnimtp_stream_underruns", "Times a stream's listener ran out of audio (a chunk came after the audio "
            "before it would have finished playing in real time from the stream's first chunk)", registry=r,
        )
        self.stream_stalled_seconds = Counter(
            "omnimtp_stream_stalled_seconds", "Seconds listeners waited for audio after their stream's first chunk",
            registry=r,
        )
        self.stream_lead = Gauge(
            "omnimtp_stream_lead_seconds", "Each playing stream's lead over its listener at its last chunk: audio "
            "sent and not yet played in real time (by engine request id; a stream leaves when it ends)", ["stream"],
            registry=r,
        )
        self.predictor_compiled = Gauge(
            "omnimtp_predictor_compiled", "1 once the code predictor runs compiled for every batch size, else 0",
            registry=r)
        self.warm = Gauge(
            "omnimtp_warm", "1 once the server's warm-up is over (its warm-up reply, and the code predictor's "
            "compiling where it has graphs to build) or it has none, else 0", registry=r)
        self.realtime_capacity = Gauge(
            "omnimtp_realtime_capacity_streams", "Streams the engine can keep in real time, from its measured step "
            "costs (admission by capacity; absent with --admission off)", registry=r,
        )
        self.step_batch_size = Histogram(
            "omnimtp_talker_step_batch_size", "Requests in one talker step", buckets=_BATCH_BUCKETS, registry=r
        )

        # speculative thinker steps (`serve --thinker-mtp`): per finished request, and totals for the mean τ
        self.thinker_acceptance_length = Histogram(
            "omnimtp_thinker_mean_acceptance_length",
            "Mean accepted thinker tokens per speculative step of a finished request (τ, the bonus token included)",
            buckets=_ACCEPTANCE_LENGTH_BUCKETS, registry=r,
        )
        self.thinker_acceptance_rate = Histogram(
            "omnimtp_thinker_acceptance_rate", "Accepted / drafted thinker tokens of a finished request",
            buckets=_ACCEPTANCE_RATE_BUCKETS, registry=r,
        )
        self.thinker_spec_steps = Counter(
            "omnimtp_thinker_spec_steps", "Speculative thinker steps, one per request and verify forward", registry=r
        )
        self.thinker_draft_tokens = Counter("omnimtp_thinker_draft_tokens", "Drafted thinker tokens", registry=r)
        self.thinker_draft_step_cost = Gauge(
            "omnimtp_thinker_draft_step_cost",
            "Adaptive speculation (-k auto): the measured cost of a thinker step drafting k tokens, relative to "
            "a plain step, by sampling (greedy, sampled) and batch-size bucket", ["sampling", "batch_size", "k"],
            registry=r,
        )
        self.thinker_draft_costs_cached = Gauge(
            "omnimtp_thinker_draft_costs_cached",
            "Adaptive speculation (-k auto): 1 where a bucket's step costs were read back from an earlier start's "
            "measurement on disk, 0 where measured at this start", ["sampling", "batch_size"], registry=r,
        )
        self.thinker_accepted_tokens = Counter(
            "omnimtp_thinker_accepted_tokens", "Accepted drafted thinker tokens (τ = 1 + accepted / spec steps)",
            registry=r,
        )

        # the realtime conversations kept warm (`serve --session-cache-mb`)
        self.session_cache_hits = Counter(
            "omnimtp_session_cache_hits", "Realtime turns that reused their session's cached thinker prefix",
            registry=r,
        )
        self.session_cache_misses = Counter(
            "omnimtp_session_cache_misses", "Realtime turns that prefilled their whole conversation (a session's "
            "first turn, an evicted session, a conversation changed before the first cached block)", registry=r,
        )
        self.session_cache_reused_rows = Counter(
            "omnimtp_session_cache_reused_rows", "Prompt positions taken from the cache instead of prefilled",
            registry=r,
        )
        self.session_cache_talker_reused_rows = Counter(
            "omnimtp_session_cache_talker_reused_rows",
            "Talker prefill positions taken from the cache instead of prefilled", registry=r,
        )
        self.session_cache_evictions = Counter(
            "omnimtp_session_cache_evictions", "Sessions' cached prefixes evicted, least recently used first, to "
            "stay within --session-cache-mb", registry=r,
        )
        self.session_cache_bytes = Gauge(
            "omnimtp_session_cache_bytes", "Bytes of cached thinker and talker prefixes held", registry=r
        )
        self.session_cache_sessions = Gauge(
            "omnimtp_session_cache_sessions", "Sessions with a cached prefix", registry=r
        )
        self._session_cache_seen = (0, 0, 0, 0, 0)

    def observe_session_cache(self, cache) -> None:
        """The engine's `PrefixCache`: its totals since the last call onto the counters, its size onto the gauges."""
        stats = cache.stats
        totals = (stats.hits, stats.misses, stats.reused_rows, stats.evictions, stats.talker_reused_rows)
        counters = (self.session_cache_hits, self.session_cache_misses, self.session_cache_reused_rows,
                    self.session_cache_evictions, self.session_cache_talker_reused_rows)
        for counter, total, seen in zip(counters, totals, self._session_cache_seen, strict=True):
            if total > seen:
                counter.inc(total - seen)
        self._session_cache_seen = totals
        self.session_cache_bytes.set(cache.num_bytes)
        self.session_cache_sessions.set(len(cache))

    def observe_draft_costs(self, tables) -> None:
        """Adaptive speculation's measured costs ({"greedy" | "sampled": `DraftCostTable`}) as the gauge
        omnimtp_thinker_draft_step_cost{sampling, batch_size, k}: a thinker step drafting k tokens relative
        to a plain step of that many requests; omnimtp_thinker_draft_costs_cached{sampling, batch_size}: 1 where
        they were read back from an earlier start's measurement on disk, 0 where measured at this start."""
        for sampling, table in tables.items():
            for rows, costs in table.to_dict().items():
                for k, cost in enumerate(costs):
                    self.thinker_draft_step_cost.labels(sampling, str(rows), str(k)).set(cost)
            for rows, source in table.sources().items():
                self.thinker_draft_costs_cached.labels(sampling, str(rows)).set(1 if source == "cached" else 0)

    def observe_spec(self, stats) -> None:
        """A finished request's `SpecStats` (nothing when it took no speculative step)."""
        if stats is None or stats.num_row_steps == 0:
            return
        self.thinker_acceptance_length.observe(stats.mean_acceptance_length)
        self.thinker_acceptance_rate.observe(stats.acceptance_rate)
        self.thinker_spec_steps.inc(stats.num_row_steps)
        self.thinker_draft_tokens.inc(stats.num_drafted)
        self.thinker_accepted_tokens.inc(stats.num_accepted)

    def render(self) -> bytes:
        return generate_latest(self.registry)
