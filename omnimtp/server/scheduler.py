"""Continuous batching behind the HTTP server: a thread that drives the engine core.

The server adds only what serving needs on top of `omnimtp.engine.core.EngineCore` (the same step
loop `OmniPipeline` runs): a bounded waiting queue (429 past it), one background thread that owns the
models and calls `step()`, per-request async event streams, cancellation at frame boundaries, and
metrics. The HTTP side only calls `Engine.submit` (from the event loop) and reads the returned handle's
events; `RequestHandle.cancel` (a dropped client) takes effect at the next frame boundary. Requests
submitted while a step runs join it at its admission, right before its talker step.

The server's scheduling defaults (`Engine`): max_batch_size 16, later chunks decoded within a budget
of 4·max_batch_size frames per step, and deferred for at most 2 steps in a row while requests queue
for a free slot (time to first audio of the newcomers). A seeded request gives the same text and PCM16
bytes as `OmniPipeline` and as alone, under any load (tested on audible audio).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import threading
import time
from collections.abc import Iterator

import torch

from omnimtp.engine.core import EngineConfig, EngineCore
from omnimtp.engine.request import Request, Status
from omnimtp.engine.warm_up import WARM_UP_REQUEST_ID, warm_up_request
from omnimtp.limits import DEFAULT_TIMEOUT_TEXT_IDLE_S, check_seconds
from omnimtp.media import MediaInputs, MediaLimits
from omnimtp.sampling import SamplingParams
from omnimtp.server.admission import (
    DEFAULT_HEADROOM,
    MIN_KEPT_SAMPLES,
    Admission,
    cached_step_costs,
    keep_step_costs,
)
from omnimtp.server.requests import (
    EngineEvent,
    EngineRequest,
    PromptTooLongError,
    QueueFullError,
    RequestHandle,
)
from omnimtp.server.served_model import ServedModel
from omnimtp.spec_decode.cost_cache import cost_fingerprint

logger = logging.getLogger("omnimtp.server")
_KEEP_STEP_COSTS_EVERY = 64  # steps that made frames between two writes of admission's step costs to disk
CALIBRATION_FRAMES = 12  # frames of each warm-up reply that measures a size above one at start (`_calibrate_capacity`)

class _Observer:
    """The core's observations: into the server's Prometheus metrics (when it has them), and the streams the
    step in flight made frames for (`num_streams`, what admission's step costs are measured at)."""

    def __init__(self, metrics):
        self.metrics = metrics
        self.num_streams = 0
        # the step's codec calls: (chunk frames, seconds, whether they were first chunks)
        self.decode_calls: list[tuple[list[int], float, bool]] = []

    def stage(self, stage: str, seconds: float) -> None:
        if self.metrics is not None:
            self.metrics.first_audio_stage.labels(stage=stage).observe(seconds)

    def phase(self, phase: str, seconds: float) -> None:
        if self.metrics is not None:
            self.metrics.engine_phase.labels(phase=phase).observe(seconds)

    def decoded(self, chunk_frames: list[int], seconds: float, is_first: bool) -> None:
        self.decode_calls.append((chunk_frames, seconds, is_first))

    def talker_batch(self, size: int) -> None:
        self.num_streams = size
        if self.metrics is not None:
            self.metrics.step_batch_size.observe(size)


class Engine(ServedModel):
    """Owns the engine core and the thread that steps it; what the HTTP side asks of the model before a request
    is queued (prompts, voices, limits) is its `ServedModel` part.

    family: the model side (`omnimtp.families.qwen3_omni.Qwen3OmniFamily`; its tokenizer needs a chat
    template). config: `EngineConfig` fields; the server's defaults are max_batch_size 16,
    max_decode_frames 4·max_batch_size (well above the max_batch_size frames a talker step makes, so a
    backlog drains fast) and max_defer_steps 8 (a chunk waits only while its listener holds two steps of audio
    more than its decoding takes, so the bound is a safety net). max_prompt_tokens: longer prompts are refused (400).
    warm_up: build a compiled predictor's graphs for every batch bucket in a background thread
    ("omnimtp-warm-up", one log line per bucket) while the engine already serves on the eager predictor;
    each bucket switches to its compiled graph once it is built (`is_warm` when all are). The compile runs
    first in a child process at the lowest priority, stopped whenever a request is in flight (`idle`), and
    each graph's build here starts only while the engine is idle and finds that compile in inductor's cache:
    requests served during warm-up do not wait for it. warm_up_reply: first run one short spoken reply through
    every stage (`omnimtp.engine.warm_up.warm_up_request`), so that the first user's request does not pay what a
    stage's first run costs (weights paged in, kernels' set-up); it is a background request of the engine itself,
    ended by the first user's request that comes meanwhile (`warm_up_reply_result` says how it went).
    media_limits: what a chat request's audio and images may hold (`omnimtp.media.MediaLimits`); the media pads
    count as prompt tokens.
    timeout_text_idle: seconds a `submit_speech_stream` request may wait for more text (queued with no text
    yet, or parked by the core with all its text spoken) before it ends with an error event whose error_code is
    "timeout_text_idle"; its memory is freed then (it holds no slot while it waits).
    admission: admit streams by measured real-time capacity (`omnimtp.server.admission`): a stream that would push
    the playing ones under real time waits in the queue, and streamed chunks are sized for a listener who plays
    from the first one (`EngineConfig.playout_rtf`, unless given); False: every slot is open to every request."""

    def __init__(self, family, *, model_id: str = "omnimtp-tiny", max_prompt_tokens: int = 8192,
                 warm_up: bool = False, warm_up_reply: bool = False, media_limits: MediaLimits = MediaLimits(),
                 timeout_text_idle: float = DEFAULT_TIMEOUT_TEXT_IDLE_S, admission: bool = False, **config):
        timeout_text_idle = check_seconds("timeout_text_idle", timeout_text_idle)
        batch_size = config.setdefault("max_batch_size", 16)
        if isinstance(batch_size, int) and not isinstance(batch_size, bool):
            config.setdefault("max_decode_frames", 4 * batch_size)
        config.setdefault("max_defer_steps", 8)
        if not isinstance(admission, bool):
            raise ValueError(f"admission must be a bool, got {admission!r}")
        if admission:  # chunks sized for a listener who plays from the first one, at the real time admission keeps
            config.setdefault("playout_rtf", DEFAULT_HEADROOM)
        super().__init__(family, EngineConfig(**config), model_id=model_id, max_prompt_tokens=max_prompt_tokens,
                         media_limits=media_limits)
        self.admission = Admission(max_streams=self.config.max_batch_size) if admission else None
        self._observer: _Observer | None = None
        self.timeout_text_idle = float(timeout_text_idle)
        self.warm_up = warm_up
        if not isinstance(warm_up_reply, bool):
            raise ValueError(f"warm_up_reply must be a bool, got {warm_up_reply!r}")
        self.warm_up_reply = warm_up_reply
        # {"ended": "finished" | "aborted", "frames": n, "s": seconds} once the warm-up reply is over
        self.warm_up_reply_result: dict | None = None
        self._warm_up_ids: set = set()  # the engine's own background replies in flight (a user's request ends them)
        self._calibrating = 0  # streams the warm-up replies speak at once while admission's costs are measured
        self.max_queue = 64
        self.metrics = None
        # adaptive speculation's measured thinker step costs, {"greedy" | "sampled": DraftCostTable}, set by
        # `start` (None: no adaptive speculation)
        self.draft_costs = None
        self.is_ready = False
        self.is_warm = False
        # torch's threads where this engine was built (after the model's thread rule): its engine and warm-up
        # threads run on as many, whatever the thread that starts them runs on (`build_in_passing_thread`)
        self.num_threads = torch.get_num_threads()
        self._step_fingerprints: dict[bool, dict] = {}  # admission's cost fingerprints, by predictor state
        self._steps_since_kept = 0
        self._warm_stop = threading.Event()
        self.idle = threading.Event()  # set while no request is in flight (submitted and not yet finished)
        self.idle.set()
        self._cond = threading.Condition()
        self._core: EngineCore | None = None
        self._handles: dict[int, RequestHandle] = {}
        self._cancelled: set[int] = set()
        self._closed_keys: set[str] = set()  # conversations ended since the step in flight began
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._accepting = False
        self._end_message: str | None = None  # set by `end_requests`

    # -- the HTTP side ----------------------------------------------------------------------------

    @property
    def is_running(self) -> bool:
        return self._accepting

    def start(self, *, metrics=None, max_queue: int = 64) -> None:
        if max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {max_queue}")
        if self._thread is not None:
            raise RuntimeError("the engine is already running")
        observer = self._observer = _Observer(metrics)
        calibrate = getattr(self.family, "calibrate_speculation", None)
        if calibrate is not None and self.draft_costs is None:  # before serving: no request waits for it
            started = time.perf_counter()
            self.draft_costs = calibrate(self.config.max_batch_size)
            if self.draft_costs is not None:
                sources = [source for table in self.draft_costs.values() for source in table.sources().values()]
                logger.info("speculation: thinker step costs for batches up to %d (%d buckets measured, %d cached) "
                            "in %.1f s: %s", self.config.max_batch_size, sources.count("measured"),
                            sources.count("cached"), time.perf_counter() - started,
                            {name: table.to_dict() for name, table in self.draft_costs.items()})
        if metrics is not None and self.draft_costs is not None:
            metrics.observe_draft_costs(self.draft_costs)
        self._core = EngineCore(
            self.family, self.config, lock=self._cond, observer=observer
        )  # model errors surface here
        if self.admission is not None:
            self._seed_step_costs()
            self._core.max_speaking = self.admission.capacity()
        self.metrics = metrics
        self.max_queue = max_queue
        self._stopping = False
        self._accepting = True
        self.is_ready = True  # the eager predictor serves at once; a compiled one warms up beside it
        self._thread = threading.Thread(target=self._run, name="omnimtp-engine", daemon=True)
        self._thread.start()
        if self.warm_up or self.warm_up_reply:
            self._warm_stop.clear()
            threading.Thread(target=self._warm_up_stages, name="omnimtp-warm-up", daemon=True).start()
        elif metrics is not None:
            metrics.warm.set(1)

    def shutdown(self, *, drain: bool = True, timeout: float | None = None) -> None:
        """Stop accepting; with drain, finish every admitted and waiting request first."""
        self._warm_stop.set()  # a graph being built finishes in its daemon thread; no further bucket starts
        with self._cond:
            self._accepting = False
            self._end_warm_up_replies()
            if not drain:
                self._cancelled.update(self._handles)
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def end_requests(self, message: str) -> None:
        """Stop accepting and end every waiting and running request with an error event saying `message`
        (at the next frame boundary): the server's shutdown deadline is near."""
        with self._cond:
            self._accepting = False
            if self._handles:
                logger.warning("ending %d unfinished request(s): %s", len(self._handles), message)
            self._end_message = message
            self._cancelled.update(self._handles)
            self._cond.notify_all()

    def submit(self, request: EngineRequest, *, loop: asyncio.AbstractEventLoop,
               prompt: tuple[list[int], MediaInputs | None] | None = None,
               segments: Iterator[list[int]] | None = None) -> RequestHandle:
        """Queue a request (called on the event loop). Raises QueueFullError at the bound (max_queue requests
        waiting for a slot; a streamed text's request waiting for its first words does not count) and
        PromptTooLongError for a prompt over max_prompt_tokens (before anything is queued). prompt: what
        `prompt_ids(request)` gives, when it was made beforehand (a request with media runs the processor:
        off the event loop); segments: what `speech_segments(request)` gives a speech request, likewise."""
        if request.messages is None:
            segments = self.speech_segments(request) if segments is None else segments
            prompt_ids, media = next(segments), None
        else:
            prompt_ids, media = self.prompt_ids(request) if prompt is None else prompt
        return self._queue(loop, prompt_ids, request.speaker, request.sampling, request.seed,
                           is_chat=request.messages is not None, max_new_tokens=request.max_new_tokens,
                           is_streamed=request.is_streamed, media=media, is_background=request.is_background,
                           segments=segments, cache_key=request.cache_key, logprobs=request.logprobs)

    def check_room(self) -> None:
        """QueueFullError (as `submit` raises it) while the queue is at its bound: a route asks before it reads,
        parses or tokenizes a request, so a full server refuses at the cost of a lookup. (An engine not started or
        stopping says nothing here: `submit` answers for it.)"""
        with self._cond:
            if self._core is not None and self._accepting:
                self._check_queue()

    def _check_queue(self) -> int:
        """The requests queued; QueueFullError, with admission's Retry-After, at max_queue of them (called holding
        `_cond`)."""
        num_queued = self._core.num_queued()
        if num_queued >= self.max_queue:
            if self.admission is None:
                raise QueueFullError(f"too many queued requests ({self.max_queue}); retry in 1 s")
            retry_after_ms = self.admission.retry_after_ms(num_queued)
            raise QueueFullError(f"too many queued requests ({self.max_queue}); retry in {retry_after_ms / 1000:g} s",
                                 self.admission.retry_after_s(num_queued), retry_after_ms)
        return num_queued

    def submit_speech_stream(self, speaker, sampling: SamplingParams, seed: int | None, *,
                             loop: asyncio.AbstractEventLoop) -> RequestHandle:
        """Queue a speech request whose text will come in pieces (`push_speech_ids`; called on the event loop):
        its talker waits for each text row it has not got, holding no slot while it waits (`EngineCore` parks
        it), for at most `timeout_text_idle` seconds at a time. Raises QueueFullError as `submit`."""
        return self._queue(loop, [], speaker, sampling, seed, is_chat=False, is_text_finished=False)

    def _queue(self, loop, prompt_ids: list[int], speaker, sampling: SamplingParams, seed: int | None, *, is_chat: bool,
               max_new_tokens: int = 1, is_streamed: bool = True, media: MediaInputs | None = None,
               is_text_finished: bool = True, is_background: bool = False,
               segments: Iterator[list[int]] | None = None, cache_key: str | None = None,
               logprobs: int | None = None) -> RequestHandle:
        with self._cond:
            if not self._accepting:
                raise QueueFullError("the server is shutting down")
            num_queued = self._check_queue()
            self._end_warm_up_replies()  # a user's request comes first
            handle = RequestHandle(next(self._ids), loop, self._cancel)
            handle.queue_position = self._queue_position(num_queued, has_speech=speaker is not None)
            sampling = None if sampling.is_greedy else sampling
            # A model with a thinker samples it as asked and its talker as the family does; a speech-only
            # model's sampling is its talker's; a model that only hears (Qwen3-ASR) samples its thinker.
            thinker_sampling, talker_sampling = (
                (sampling, self.family.sampled_talker(sampling)) if self.has_chat
                else (None, sampling) if self.family.speaks else (sampling, None))
            handle.request = Request(
                handle.request_id, prompt_ids, max_new_tokens=max(max_new_tokens, 1),
                max_frames=self.config.max_frames, speaker=speaker, thinker_sampling=thinker_sampling,
                talker_sampling=talker_sampling, seed=seed, is_chat=is_chat, is_streamed=is_streamed, media=media,
                is_text_finished=is_text_finished, is_background=is_background, segments=segments,
                cache_key=cache_key, logprobs=logprobs,
            )
            self._handles[handle.request_id] = handle
            self._core.add(handle.request)
            self._set_gauges()
            self._cond.notify_all()
        return handle

    def _queue_position(self, num_queued: int, has_speech: bool) -> int:
        """A new request's place in the queue (called holding `_cond`): the requests that start before it, less
        the room the next step has (0: it starts at the next step)."""
        return max(0, num_queued + 1 - self._core.num_startable(has_speech))

    def queue_position(self, handle: RequestHandle) -> int | None:
        """Where a request waits now (as `RequestHandle.queue_position` counts; 0: it starts at the next step), or
        None once it has started or ended: what a route that keeps its client waiting (a realtime response) can
        tell it while it waits."""
        with self._cond:
            ahead = self._core.num_queued_ahead(handle.request)
            return None if ahead is None else self._queue_position(ahead, handle.request.has_speech)

    def stream_limits(self, handle: RequestHandle) -> dict:
        """What a realtime response tells its client as it starts, in OpenAI's `rate_limits.updated` shape (the
        `requests` limit, for the requests this server runs at once): limit, the streams it keeps in real time
        now (admission's capacity; the slots for a request that does not speak or without admission); remaining,
        how many more could start at the next step; reset_seconds, how long this request is expected to wait
        before it starts (0: at the next step; else admission's Retry-After estimate for its place)."""
        with self._cond:
            core, has_speech = self._core, handle.request.has_speech
            limit = core.max_speaking if has_speech and core.max_speaking is not None else self.config.max_batch_size
            ahead = core.num_queued_ahead(handle.request)
            position = 0 if ahead is None else self._queue_position(ahead, has_speech)
            remaining = max(0, core.num_startable(has_speech) - len(core.waiting))
            wait_s = 0.0 if position == 0 else float(
                1 if self.admission is None else self.admission.retry_after_s(position - 1))
        return {"name": "requests", "limit": int(limit), "remaining": remaining, "reset_seconds": wait_s}

    def push_speech_text(self, handle: RequestHandle, pieces: list[tuple[list[int], bool]], is_finished: bool) -> None:
        """More text ids of a `submit_speech_stream` request, as `streamed_speech_segments` gives them (a no-op
        once it has ended)."""
        with self._cond:
            self._core.push_speech_text(handle.request_id, pieces, is_finished)
            self._cond.notify_all()

    def drop_conversation(self, cache_key: str) -> None:
        """Forget the prefixes kept warm for `cache_key` (its realtime session closed, its requests
        cancelled): now, and again after the step in flight, which may still be prefilling one of them."""
        with self._cond:
            if self._core is not None:
                self._core.prefix_cache.drop(cache_key)
                self._closed_keys.add(cache_key)
                self._set_gauges()

    def streamed_speech_segments(self, speaker):
        """A `submit_speech_stream` request's text → its ids, cut into segments as a whole text's are
        (`speech_segments`; `omnimtp.families.text.StreamedSpeechSegments`). PromptTooLongError when the
        talker's positions leave max_frames frames no room for text."""
        family, max_frames = self.family, self.config.max_frames
        try:
            return family.streamed_speech_segments(speaker, max_frames, self.config.max_segment_tokens)
        except ValueError:
            positions = family.talker_positions(family.speech_ids("x"), speaker, max_frames)
            raise PromptTooLongError("delta", positions, family.max_positions, unit=(
                f"talker positions (its prompt and {max_frames} frames, the server's --max-frames)")) from None

    def _cancel(self, handle: RequestHandle) -> None:
        with self._cond:
            self._cancelled.add(handle.request_id)
            self._cond.notify_all()

    def _set_gauges(self) -> None:
        """The queue gauges and the `idle` flag, after a request came or went and after each step (called holding
        `_cond`)."""
        if self._handles:
            self.idle.clear()
        else:
            self.idle.set()
        if self.metrics is not None and self._core is not None:
            num_parked = sum(request.is_parked for request in self._core.running.values())
            self.metrics.queue_depth.set(len(self._core.waiting))
            self.metrics.active_requests.set(len(self._core.running) - num_parked)
            self.metrics.parked_requests.set(num_parked)
            self.metrics.observe_session_cache(self._core.prefix_cache)

    # -- the engine thread ------------------------------------------------------------------------

    def _warm_up_stages(self) -> None:
        """The warm-up thread: the warm-up reply (`warm_up_reply`), the compiled predictor (`warm_up`), then with
        admission its costs by size (`_calibrate_capacity`)."""
        if self.warm_up_reply:
            self._run_warm_up_reply()
        if self.warm_up and not self._warm_stop.is_set():
            self._warm_up()
        if (self.admission is not None and not self.has_chat and not self._warm_stop.is_set()
                and (self.warm_up_reply_result or {}).get("ended") == Status.FINISHED.value):
            self._calibrate_capacity()  # (as the predictor runs from now on: compiled where it was)
        if self._observer is not None and self._observer.metrics is not None and not self._warm_stop.is_set():
            self._observer.metrics.warm.set(1)

    def _run_warm_up_reply(self) -> None:
        """Queue the warm-up reply (a background request with no handle: its events go nowhere) for the engine
        thread and wait until it has finished or been ended."""
        started = time.perf_counter()
        requests = self._speak_warm_up_replies(1)
        if requests is None:
            logger.info("warm-up: no warm-up reply (the model does not speak, or has no chat template)")
            return
        if not requests:
            return
        request = requests[0]
        self.warm_up_reply_result = {"ended": request.status.value, "frames": len(request.frames),
                                     "s": time.perf_counter() - started}
        logger.info("warm-up: a spoken reply through every stage %s after %d frames in %.1f s",
                    request.status.value, len(request.frames), self.warm_up_reply_result["s"])

    def _calibrate_capacity(self) -> None:
        """A speech-only model's step costs by size before a user asks (the proportional guess from one size alone
        errs high, and a size is otherwise measured only once admitted): the warm-up reply spoken by n streams at
        once for CALIBRATION_FRAMES frames, twice (the first run's steps left out: they hold what a size's first
        steps cost once), n = 1, 2, ... up to max_batch_size until a size does not fit a frame or a user's request
        ends them. What they measure is taken as kept costs are, its scale set by serving
        (`Admission.seed_measured`): no client reads a warm-up reply. A chat model's sizes are not measured so: a
        chat's steps cost what its prompt and thinking do, and its client's events (text deltas, base64 audio) take
        the machine too, none of which a warm-up reply shows (measured so, the demo Qwen3-Omni's start put 16 streams
        within a frame, and under 8 chats a second its listeners stalled for a fifth of their audio)."""
        try:
            self._measure_sizes()
        finally:
            with self._cond:  # the shape that serving's measurements scale
                self.admission.seed_measured()

    def _measure_sizes(self) -> None:
        budget = self.admission.headroom * self.admission.frame_s
        for n in range(1, self.config.max_batch_size + 1):
            for is_measured in (False, True):  # a size's first run holds what its first steps cost once
                if self._warm_stop.is_set():
                    return
                requests = self._speak_warm_up_replies(n, CALIBRATION_FRAMES, only_when_idle=True)
                if not requests or any(r.status != Status.FINISHED for r in requests):
                    return
                if not is_measured:
                    with self._cond:
                        for table in (self.admission.costs, self.admission.first_steps,
                                      self.admission.decode_costs):
                            table.clear(n)
            with self._cond:
                measured = self.admission.step_cost(n)
            logger.info("admission: %d stream%s at once: %.1f ms a step (as in their one-frame chunks)", n,
                        "s" if n > 1 else "", 1000 * measured)
            if measured > budget:
                return

    def _speak_warm_up_replies(self, num_streams: int, max_frames: int | None = None, *,
                               only_when_idle: bool = False) -> list[Request] | None:
        """num_streams warm-up replies at once (background requests with no handle: their events go nowhere),
        speaking together above admission's capacity; waits until every one has finished or been ended → them ([]:
        the server stopped accepting, or only_when_idle and a user's request is in flight), or None where the family
        makes no warm-up reply."""
        requests = [warm_up_request(self.family, self.config, is_background=True, max_frames=max_frames,
                                    request_id=WARM_UP_REQUEST_ID if i == 0 else f"{WARM_UP_REQUEST_ID}-{i}")
                    for i in range(num_streams)]
        if requests[0] is None:
            return None
        with self._cond:
            if not self._accepting or (only_when_idle and self._handles):
                return []
            self._calibrating = num_streams if num_streams > 1 else 0
            for request in requests:
                self._warm_up_ids.add(request.request_id)
                self._core.add(request)
            self._cond.notify_all()
        while (any(r.status not in (Status.FINISHED, Status.ABORTED) for r in requests)
               and self._thread.is_alive()):
            time.sleep(0.01)
        with self._cond:
            self._calibrating = 0
            self._warm_up_ids.clear()
        return requests

    def _end_warm_up_replies(self) -> None:
        """End the warm-up replies in flight (called holding `_cond`): no longer above capacity from the next step."""
        self._cancelled.update(self._warm_up_ids)
        self._calibrating = 0

    def _warm_up(self) -> None:
        """The compiled predictor's graphs, bucket by bucket, logged as they are built."""
        torch.set_num_threads(self.num_threads)  # the graphs are built for the engine thread's count
        started = time.perf_counter()
        logger.info("warm-up: compiling the code predictor for batches up to %d in the background; serving on "
                    "the eager predictor meanwhile", self.config.max_batch_size)

        smallest = 1

        def on_bucket(index: int, num_buckets: int, rows: int, seconds: float) -> None:
            nonlocal smallest
            sizes = f"batch size {rows}" if smallest == rows else f"batch sizes {smallest}-{rows}"
            logger.info("warm-up: code predictor compiled for %s (bucket %d/%d) in %.1f s, %.1f s in all", sizes,
                        index, num_buckets, seconds, time.perf_counter() - started)
            smallest = rows + 1

        try:
            self.is_warm = self.family.warm_up(self.config.max_batch_size, on_bucket, self._warm_stop, idle=self.idle,
                                               fill_cache_in_child=True)
        except Exception:  # serving goes on eagerly
            logger.exception("warm-up failed; the code predictor stays eager")
            return
        if self.is_warm:
            logger.info("warm-up: done in %.1f s, every batch size runs compiled", time.perf_counter() - started)
            if self.admission is not None:  # what the eager predictor's steps cost says nothing of the compiled
                with self._cond:
                    self._seed_step_costs()
            if self._observer is not None and self._observer.metrics is not None:
                self._observer.metrics.predictor_compiled.set(1)

    # -- admission's step costs, kept across starts ------------------------------------------------

    def _step_cost_fingerprint(self) -> dict:
        """What a speech step's cost depends on: the model, the machine and omnimtp's code (the cost cache's
        fingerprint), the predictor's state, the quantization, the codec's dtype and the engine's settings."""
        family, config = self.family, self.config
        key = {"measure": "speech_step", "family": type(family).__qualname__,
               "predictor_compiled": bool(self.is_warm), "quantize": getattr(family, "quantize", None),
               "codec_dtype": str(getattr(getattr(family, "codec", None), "conv_dtype", None)),
               **{name: getattr(config, name) for name in ("max_batch_size", "first_chunk_frames", "chunk_frames",
                                                         "playout_rtf", "max_decode_frames")}}
        compiled = key["predictor_compiled"]
        if compiled not in self._step_fingerprints:
            self._step_fingerprints[compiled] = cost_fingerprint(getattr(family, "model", None), None, key=key)
        return self._step_fingerprints[compiled]

    def _seed_step_costs(self) -> None:
        """Admission's step costs from an earlier start's (`cached_step_costs`), where one was kept."""
        cached = cached_step_costs(self._step_cost_fingerprint())
        if cached is not None:
            self.admission.costs.seed(cached["steps"])
            self.admission.first_steps.seed(cached["first_steps"])
            self.admission.decode_costs.seed(cached["decode"])
            logger.info("admission: step costs of an earlier start (%s predictor): %s",
                        "compiled" if self.is_warm else "eager",
                        {n: round(seconds, 4) for n, seconds in cached["steps"].items()})
        self._steps_since_kept = 0

    def _keep_step_costs(self) -> None:
        """Keep admission's step costs for a later start (`keep_step_costs`)."""
        with self._cond:
            fingerprint = self._step_cost_fingerprint()
            measured = self.admission.costs.measured(MIN_KEPT_SAMPLES)
            first_steps = self.admission.first_steps.measured(MIN_KEPT_SAMPLES)
            decode = self.admission.decode_costs.measured(MIN_KEPT_SAMPLES)
            self._steps_since_kept = 0
        keep_step_costs(fingerprint, measured, first_steps, decode)

    def _run(self) -> None:
        torch.set_num_threads(self.num_threads)
        try:
            self._loop()
            if self.admission is not None:
                self._keep_step_costs()
        except BaseException:  # the loop itself broke: nothing can be served any more
            logger.exception("engine loop stopped")
            with self._cond:
                self._accepting = False
                for handle in self._handles.values():
                    handle.is_done = True
                    handle.push(EngineEvent(error="the engine stopped"))
                self._handles.clear()
                self._core.waiting.clear()
                self._core.running.clear()
                self._set_gauges()

    def _loop(self) -> None:
        core = self._core
        while True:
            with self._cond:
                # a request waiting for its text is no work: the engine sleeps until text (or anything) comes, or
                # until the first such wait runs out
                while not (self._text_timed_out() or self._cancelled or core.has_ready_work()
                           or (self._stopping and not core.running)):
                    self._cond.wait(self._next_text_timeout())
                if self._stopping and not core.waiting and not core.running:
                    return
                cancelled, self._cancelled = self._cancelled, set()
            self._drop_cancelled(cancelled)
            self._end_text_waits()
            if self.admission is not None:
                with self._cond:  # (warm-up replies measuring a size above capacity may all speak)
                    core.max_speaking = max(self.admission.capacity(), self._calibrating)
                if self.metrics is not None:
                    self.metrics.realtime_capacity.set(core.max_speaking)
                self._observer.num_streams = 0
                self._observer.decode_calls = []
            started = time.perf_counter()
            try:
                self._deliver(core.step())  # each event goes out as soon as the step makes it
                if self.admission is not None:
                    seconds, calls = time.perf_counter() - started, self._observer.decode_calls
                    with self._cond:  # the HTTP side reads the costs for a Retry-After
                        for chunk_frames, call_s, is_first in calls:
                            self.admission.observe_decode(chunk_frames, call_s, is_first)
                        self.admission.observe_step(self._observer.num_streams, seconds,
                                                    sum(call_s for _, call_s, is_first in calls if not is_first))
                        self._steps_since_kept += self._observer.num_streams > 0
                    if self._steps_since_kept >= _KEEP_STEP_COSTS_EVERY:
                        self._keep_step_costs()
            except Exception as exc:  # a model error fails the requests in flight, never the server
                logger.exception("engine step failed")
                self._fail(core.fail_running(), f"generation failed: {type(exc).__name__}")
            with self._cond:
                for key in self._closed_keys:
                    core.prefix_cache.drop(key)
                self._closed_keys.clear()
                self._set_gauges()  # a step parks and resumes requests

    def _text_waits(self) -> list[tuple[float, int]]:
        """(when its wait runs out, id) of each request waiting for more text (called holding `_cond`)."""
        return [(r.waits_for_text_since + self.timeout_text_idle, r.request_id)
                for r in [*self._core.waiting, *self._core.running.values()] if r.waits_for_text_since is not None]

    def _text_timed_out(self) -> list[int]:
        now = time.perf_counter()
        return [request_id for deadline, request_id in self._text_waits() if deadline <= now]

    def _next_text_timeout(self) -> float | None:
        deadlines = [deadline for deadline, _ in self._text_waits()]
        return None if not deadlines else max(min(deadlines) - time.perf_counter(), 0.0)

    def _end_text_waits(self) -> None:
        """End requests that waited for text past timeout_text_idle, with an error event (between steps); their
        memory is freed. Under `_cond`, so text that comes meanwhile is either in time or too late."""
        with self._cond:
            for request_id in self._text_timed_out():
                handle = self._handles.pop(request_id, None)
                self._core.abort(request_id)
                self._forget_stream(request_id)
                if handle is None:
                    continue
                handle.is_done = True
                handle.push(EngineEvent(
                    error=f"timeout_text_idle: no more text came for {self.timeout_text_idle:g} s (the server's "
                    "--timeout-text-idle); the request is ended", error_code="timeout_text_idle"))
            self._set_gauges()

    def _drop_cancelled(self, cancelled: set[int]) -> None:
        """Free the slots of cancelled requests, waiting or admitted (at a frame boundary). Each one
        counts in the cancelled-requests metric."""
        for request_id in cancelled:
            handle = self._handles.pop(request_id, None)
            if handle is None:
                if request_id in self._warm_up_ids:
                    self._core.abort(request_id)
                continue
            self._forget_stream(request_id)
            if self._core.abort(request_id) is not None and self.metrics is not None:
                self.metrics.cancelled.inc()  # not counted: cancelled in the step that finished it
            handle.is_done = True
            handle.push(None if self._end_message is None else EngineEvent(error=self._end_message,
                                                                            error_code="server_shutting_down"))
        with self._cond:
            self._set_gauges()

    def _deliver(self, events) -> None:
        for event in events:
            request = event.request
            handle = self._handles.get(request.request_id)
            if handle is None or handle.is_cancelled:
                continue
            if event.audio is not None:
                if self.metrics is not None and len(request.audio) == 1:
                    self.metrics.time_to_first_audio.observe(request.first_audio_at - request.submitted_at)
                self._play(handle, event.audio.size / self.sample_rate)
                handle.push(EngineEvent(audio=event.audio, step=event.step, num_frames=len(request.frames)))
            elif event.text or event.logprobs:
                handle.push(EngineEvent(text=event.text, logprobs=event.logprobs))
            if event.is_finished:
                self._finish(handle, request)
        with self._cond:
            self._set_gauges()

    def _play(self, handle: RequestHandle, seconds: float) -> None:
        """A chunk on to its stream's playback clock: its underruns and its lead to the metrics."""
        now = time.perf_counter()
        stall = handle.playback.push(now, seconds)
        if self.metrics is not None:
            if stall > 0:
                self.metrics.stream_underruns.inc()
                self.metrics.stream_stalled_seconds.inc(stall)
            self.metrics.stream_lead.labels(stream=str(handle.request_id)).set(handle.playback.lead(now))

    def _forget_stream(self, request_id: int) -> None:
        """A stream that ended leaves the lead gauge."""
        if self.metrics is not None:
            with contextlib.suppress(KeyError):
                self.metrics.stream_lead.remove(str(request_id))

    def _finish(self, handle: RequestHandle, request: Request) -> None:
        del self._handles[request.request_id]
        self._forget_stream(request.request_id)
        if self.admission is not None and request.frames and request.audio:
            with self._cond:
                self.admission.observe_frame_seconds(sum(a.size for a in request.audio) / self.sample_rate
                                                     / len(request.frames))
                self.admission.observe_stream(request.finished_at - request.admitted_at)
        handle.is_done = True
        handle.push(EngineEvent(
            finish_reason=request.finish_reason, prompt_tokens=len(request.prompt_ids),
            completion_tokens=len(request.reply_ids), num_frames=len(request.frames),
        ))
        if self.metrics is not None and request.frames:
            elapsed = max(request.finished_at - request.admitted_at, 1e-9)
            self.metrics.frames_per_second.observe(len(request.frames) / elapsed)
        if self.metrics is not None:
            self.metrics.observe_spec(request.spec_stats)
            if request.audio_cut_by is not None:
                self.metrics.audio_cut.labels(cut_by=request.audio_cut_by).inc()

    def _fail(self, requests: list[Request], message: str) -> None:
        for request in requests:
            handle = self._handles.pop(request.request_id, None)
            self._forget_stream(request.request_id)
            if handle is not None:
                handle.is_done = True
                handle.push(EngineEvent(error=message))
        with self._cond:
            self._set_gauges()
