"""Continuous batching of speech requests: the engine loop behind the HTTP server.

One background thread owns the models. Each iteration of its loop is one frame boundary:

    retire   cancelled requests (their slots free up now)
    think    one thinker step per running cohort (chat requests admitted together share one
             `ThinkerRun`); new reply rows go to the talker through the streamed handoff
    admit    waiting requests, up to max_batch_size holding a slot: speech requests get their talker
             inputs, chat requests form a new cohort that takes up to `max_start_steps` thinker steps
             at once, until each has its talker prefill and the reply row its first frame needs.
             Admission comes after the running cohorts' step, right before the talker step, so a
             request that arrived while the engine was thinking or decoding makes this frame
    speak    the talker prefill of every request whose inputs are ready, then one talker + code
             predictor step for every speaking request, as one batch
    decode   code2wav: every request's first chunk at once (first audio in the iteration that
             admitted it), then later chunks oldest first within a frame budget, skipped while
             requests queue for a slot (see `_decode_ready`)
    retire   finished requests

The HTTP side only calls `Engine.submit` (from the event loop) and reads the returned handle's
events; `RequestHandle.cancel` (a dropped client) takes effect at the next frame boundary.
Per-request generators make a seeded request's text and audio independent of who else is running;
the batched thinker and talker forwards change a row's floats only in the last bits, which the tests
check leaves tokens and codes alone, and code2wav decodes each request's window on its own, so a
seeded request's PCM16 bytes are the same alone or under any load (tested on audible audio).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch

from omnimtp.codec.streaming import StreamingCode2Wav
from omnimtp.handoff import num_kept_rows
from omnimtp.packed_decoder import PackedDecoder
from omnimtp.sampling import SamplingParams, make_generators, request_seeds

logger = logging.getLogger("omnimtp.server")


class QueueFullError(RuntimeError):
    """The waiting queue is at its bound; the HTTP layer answers 429."""


class PromptTooLongError(ValueError):
    """A request's prompt has more tokens than the backend takes; `param` names the request field
    that holds the prompt ("messages" or "input"). The HTTP layer answers 400."""

    def __init__(self, param: str, num_tokens: int, max_tokens: int):
        super().__init__(f"{param}: {num_tokens} tokens is over the limit of {max_tokens}")
        self.param = param
        self.num_tokens = num_tokens
        self.max_tokens = max_tokens


@dataclass(frozen=True)
class EngineRequest:
    """What to generate.

    messages: chat turns (role, text) → the thinker writes a reply; None for speech requests.
    speak_text: the text to speak directly (the thinker's text path is skipped); None for chat.
    speaker: a speaker name of the model (already matched), or None for a text-only reply.
    sampling: thinker and talker sampling (temperature 0 = greedy); the code predictor keeps its own.
    max_new_tokens: thinker token budget (chat only).
    """

    messages: tuple[tuple[str, str], ...] | None
    speak_text: str | None
    speaker: str | None
    sampling: SamplingParams
    seed: int | None
    max_new_tokens: int

    def __post_init__(self):
        if (self.messages is None) == (self.speak_text is None):
            raise ValueError("exactly one of messages and speak_text must be given")
        if self.speak_text is not None and self.speaker is None:
            raise ValueError("speaker is required to speak speak_text")
        if self.messages is not None and self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")


@dataclass
class EngineEvent:
    """One step of a request's output: a text delta, an audio chunk (float32), or the end.
    step: the engine iteration that decoded an audio chunk (see `RequestHandle.admitted_step`)."""

    text: str = ""
    audio: np.ndarray | None = None
    step: int | None = None
    finish_reason: str | None = None
    error: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    num_frames: int = 0

    def usage(self, audio: bool = False) -> dict:
        """OpenAI's usage block; with audio, `completion_tokens_details.audio_tokens` = audio frames."""
        usage = {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }
        if audio:
            usage["completion_tokens_details"] = {"audio_tokens": self.num_frames}
        return usage


class RequestHandle:
    """The HTTP side's view of one request: an async event stream and a cancel switch."""

    def __init__(self, request_id: int, loop: asyncio.AbstractEventLoop, on_cancel):
        self.request_id = request_id
        self._loop = loop
        self._queue: asyncio.Queue[EngineEvent | None] = asyncio.Queue()
        self._on_cancel = on_cancel
        self.is_cancelled = False
        self.is_done = False
        self.admitted_step: int | None = None  # the engine iteration that gave it a slot

    def _push(self, event: EngineEvent | None) -> None:
        """Called from the engine thread."""
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, event)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            self.is_cancelled = True

    async def events(self):
        while True:
            event = await self._queue.get()
            if event is None:
                return
            yield event
            if event.finish_reason is not None or event.error is not None:
                return

    def cancel(self) -> None:
        """Idempotent; a no-op once the request has finished."""
        if not self.is_cancelled and not self.is_done:
            self.is_cancelled = True
            self._on_cancel(self)


@dataclass
class _Slot:
    """A request waiting for, or holding, a batch slot."""

    handle: RequestHandle
    request: EngineRequest
    submitted_at: float
    prompt_ids: list[int]
    thinker_generator: torch.Generator
    talker_generator: torch.Generator
    text_ids: list[int] = field(default_factory=list)  # the reply so far, stop token excluded
    text_emitted: str = ""
    num_sampled: int = 0  # thinker tokens sampled, stop token included
    handoff: object | None = None  # omnimtp.handoff.ThinkerToTalkerStream (chat with audio)
    finish_reason: str | None = None  # the thinker's
    pending_talker: "_PendingTalker | None" = None  # talker inputs waiting for this iteration's admission
    talker_id: int | None = None
    talker_finish: str | None = None
    frames: list[torch.Tensor] = field(default_factory=list)  # each [G]
    num_decoded: int = 0  # frames already turned into audio
    chunk_ready_step: int | None = None  # the iteration its next (not first) chunk became ready
    codec_stream: object | None = None  # omnimtp.codec.streaming.CodecStream
    speak_started_at: float = 0.0  # admitted
    talker_admitted_at: float | None = None
    first_frame_at: float | None = None
    first_audio_at: float | None = None

    @property
    def is_thinking(self) -> bool:
        """Still owed thinker tokens (a cancelled or failed request's cohort row rides along unread)."""
        return self.request.messages is not None and self.finish_reason is None and not self.handle.is_done \
            and not self.handle.is_cancelled


@dataclass
class _PendingTalker:
    prefill_embeds: torch.Tensor  # [L, H]
    trailing_text: list[torch.Tensor]  # [n, H] blocks, in order
    tts_pad_embed: torch.Tensor  # [H]
    is_text_finished: bool


@dataclass
class _Cohort:
    """Chat requests admitted in the same iteration: one `ThinkerRun`, one forward per step for all."""

    run: object  # omnimtp.thinker.ThinkerRun
    slots: list[_Slot]


class Engine:
    """Owns the models and the batching loop thread.

    backend: the model side (`SpeechBackend`); it turns requests into thinker runs and talker
    inputs, owns the batched talker state and decodes code2wav windows.
    max_batch_size: requests holding a slot at once (thinking or speaking).
    max_start_steps: thinker steps a newly admitted cohort may take in its first iteration (its
    prefill counts as one); 3 give a reply its talker prefill and its first frame's text row.
    max_decode_frames: frames of later (not first) chunks decoded per iteration, though always at
    least the oldest chunk (default 4·max_batch_size: well above the max_batch_size frames a talker
    step makes, so a backlog drains fast and requests finish on time).
    max_defer_iterations: how many iterations in a row later chunks may wait while requests are queued
    for a free slot (they are admitted first: time to first audio)."""

    def __init__(
        self,
        backend: "SpeechBackend",
        *,
        max_batch_size: int = 16,
        model_id: str = "omnimtp-tiny",
        max_start_steps: int = 3,
        max_decode_frames: int | None = None,
        max_defer_iterations: int = 2,
    ):
        for name, value in (("max_batch_size", max_batch_size), ("max_start_steps", max_start_steps)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if isinstance(max_defer_iterations, bool) or not isinstance(max_defer_iterations, int) or max_defer_iterations < 0:
            raise ValueError(f"max_defer_iterations must be an integer >= 0, got {max_defer_iterations!r}")
        if max_decode_frames is None:
            max_decode_frames = 4 * max_batch_size
        if isinstance(max_decode_frames, bool) or not isinstance(max_decode_frames, int) or max_decode_frames < 1:
            raise ValueError(f"max_decode_frames must be an integer >= 1 or None, got {max_decode_frames!r}")
        self.backend = backend
        self.max_batch_size = max_batch_size
        self.max_start_steps = max_start_steps
        self.max_decode_frames = max_decode_frames
        self.max_defer_iterations = max_defer_iterations
        self._step_index = 0  # engine iterations so far (orders the later chunks waiting for code2wav)
        self._num_deferred = 0  # iterations in a row whose later chunks waited for queued requests
        self.model_id = model_id
        self.created = int(time.time())
        self.max_queue = 64
        self.metrics = None
        self._cond = threading.Condition()
        self._waiting: deque[_Slot] = deque()
        self._cancelled: set[int] = set()
        self._active: dict[int, _Slot] = {}
        self._cohorts: list[_Cohort] = []
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._accepting = False

    # -- the HTTP side ----------------------------------------------------------------------------

    @property
    def sample_rate(self) -> int:
        return self.backend.sample_rate

    @property
    def speakers(self) -> tuple[str, ...]:
        return self.backend.speakers

    @property
    def is_running(self) -> bool:
        return self._accepting

    def match_speaker(self, name: str) -> str | None:
        """The model's speaker called `name` (case-insensitive), or None: no fallback voice."""
        lowered = name.strip().lower()
        for speaker in self.backend.speakers:
            if speaker.lower() == lowered:
                return speaker
        return None

    def start(self, *, metrics=None, max_queue: int = 64) -> None:
        if max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {max_queue}")
        if self._thread is not None:
            raise RuntimeError("the engine is already running")
        talker = self.backend.new_talker_batch(self.max_batch_size)  # model errors surface at startup
        self.metrics = metrics
        self.max_queue = max_queue
        self._stopping = False
        self._accepting = True
        self._thread = threading.Thread(target=self._run, args=(talker,), name="omnimtp-engine", daemon=True)
        self._thread.start()

    def shutdown(self, *, drain: bool = True, timeout: float | None = None) -> None:
        """Stop accepting; with drain, finish every admitted and waiting request first."""
        with self._cond:
            self._accepting = False
            if not drain:
                for slot in list(self._waiting) + list(self._active.values()):
                    self._cancelled.add(slot.handle.request_id)
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def submit(self, request: EngineRequest, *, loop: asyncio.AbstractEventLoop) -> RequestHandle:
        """Queue a request (called on the event loop). Raises QueueFullError at the bound and
        PromptTooLongError for a prompt over the backend's token limit (before anything is queued)."""
        prompt_ids = self.backend.request_ids(request)
        with self._cond:
            if not self._accepting:
                raise QueueFullError("the server is shutting down")
            if len(self._waiting) >= self.max_queue:
                raise QueueFullError(f"too many queued requests ({self.max_queue}); retry later")
            handle = RequestHandle(next(self._ids), loop, self._cancel)
            thinker_generator, talker_generator = _request_generators(request.seed)
            slot = _Slot(handle, request, time.perf_counter(), prompt_ids, thinker_generator, talker_generator)
            self._waiting.append(slot)
            self._set_gauges()
            self._cond.notify_all()
        return handle

    def _cancel(self, handle: RequestHandle) -> None:
        with self._cond:
            self._cancelled.add(handle.request_id)
            self._cond.notify_all()

    def _set_gauges(self) -> None:
        if self.metrics is not None:
            self.metrics.queue_depth.set(len(self._waiting))
            self.metrics.active_requests.set(len(self._active))

    # -- the engine thread ------------------------------------------------------------------------

    def _run(self, talker) -> None:
        try:
            self._loop(talker)
        except BaseException:  # the loop itself broke: nothing can be served any more
            logger.exception("engine loop stopped")
            with self._cond:
                self._accepting = False
                for slot in list(self._waiting) + list(self._active.values()):
                    slot.handle.is_done = True
                    slot.handle._push(EngineEvent(error="the engine stopped"))
                self._waiting.clear()
                self._active.clear()
                self._set_gauges()

    def _loop(self, talker) -> None:
        while True:
            with self._cond:
                while not (self._waiting or self._active or self._stopping):
                    self._cond.wait()
                if self._stopping and not self._waiting and not self._active:
                    return
                cancelled, self._cancelled = self._cancelled, set()
                self._drop_cancelled(cancelled, talker)
                self._set_gauges()
            try:
                self._iterate(talker)
            except Exception as exc:  # a model error fails the requests in flight, never the server
                logger.exception("engine step failed")
                self._fail_all(f"generation failed: {type(exc).__name__}")
                talker = self.backend.new_talker_batch(self.max_batch_size)

    def _drop_cancelled(self, cancelled: set[int], talker) -> None:
        """Free the slots of cancelled requests, waiting or admitted (called with the lock held, at a
        frame boundary). Each one counts in the cancelled-requests metric."""
        if not cancelled:
            return
        dropped = [slot for slot in self._waiting if slot.handle.request_id in cancelled]
        self._waiting = deque(slot for slot in self._waiting if slot.handle.request_id not in cancelled)
        retire = []
        for request_id in cancelled:
            slot = self._active.pop(request_id, None)
            if slot is None:
                continue
            if slot.talker_id is not None and slot.talker_id in talker.request_ids:
                retire.append(slot.talker_id)
            dropped.append(slot)
        for slot in dropped:
            if self.metrics is not None:
                self.metrics.cancelled.inc()
            slot.handle.is_done = True
            slot.handle._push(None)
        if retire:
            talker.retire(retire)

    def _iterate(self, talker) -> None:
        self._step_index += 1
        started = time.perf_counter()
        for cohort in self._cohorts:
            self._step_cohort(cohort, talker)
        self._admit_waiting(talker)  # after the running cohorts: requests that came meanwhile make this frame
        self._cohorts = [c for c in self._cohorts if not c.run.is_finished and any(s.is_thinking for s in c.slots)]
        started = self._observe_phase("think", started)
        self._admit_pending(talker)
        started = self._observe_phase("talker_admit", started)
        if any(slot.talker_id is not None and slot.talker_finish is None for slot in self._active.values()):
            frames = talker.step()
            if self.metrics is not None and frames:
                self.metrics.step_batch_size.observe(len(frames))
            self._take_frames(frames)
            finished = [frame.request_id for frame in frames if frame.finish_reason is not None]
            if finished:  # a finished row leaves the talker batch now; its audio may still be decoding
                talker.retire(finished)
        started = self._observe_phase("talk", started)
        self._decode_ready()
        started = self._observe_phase("code2wav", started)
        self._retire_finished(talker)

    def _admit_waiting(self, talker) -> None:
        """Give free slots to waiting requests and start them: speech requests get their talker inputs,
        chat requests one new cohort that takes up to `max_start_steps` thinker steps now (its first
        frame needs the prefill and two reply rows), so they speak in this iteration's talker step."""
        with self._cond:
            admitted = []
            while self._waiting and len(self._active) < self.max_batch_size:
                slot = self._waiting.popleft()
                self._active[slot.handle.request_id] = slot
                admitted.append(slot)
            self._set_gauges()
        now = time.perf_counter()
        chats = []
        for slot in admitted:
            slot.speak_started_at = now
            slot.handle.admitted_step = self._step_index
            self._observe_stage("queue", slot.speak_started_at - slot.submitted_at)
            if slot.request.speaker is not None:
                slot.codec_stream = self.backend.new_codec_stream()
            if slot.request.messages is not None:
                chats.append(slot)
            else:
                inputs = self.backend.speech_inputs(slot.prompt_ids, slot.request.speaker)
                slot.pending_talker = _PendingTalker(
                    inputs.prefill_embeds, [inputs.trailing_text], inputs.tts_pad_embed, is_text_finished=True
                )
        if not chats:
            return
        newcomers = _Cohort(self.backend.new_thinker(chats), chats)  # one thinker forward per step for all
        self._cohorts.append(newcomers)
        for _ in range(self.max_start_steps):
            self._step_cohort(newcomers, talker)
            if newcomers.run.is_finished or all(self._can_speak(slot) for slot in chats):
                break

    def _step_cohort(self, cohort: _Cohort, talker) -> None:
        for event in cohort.run.step():
            slot = cohort.slots[event.index]
            if event.token_id is not None and slot.is_thinking:
                self._take_token(slot, event, talker)

    @staticmethod
    def _can_speak(slot: _Slot) -> bool:
        """Whether a chat request waits for no more thinker rows before its first frame: its talker
        prefill and one reply row are here (or its reply is over, or it has nothing to say)."""
        if slot.request.speaker is None or not slot.is_thinking or slot.talker_finish is not None:
            return True
        pending = slot.pending_talker
        if pending is None:
            return slot.talker_id is not None
        return pending.is_text_finished or sum(block.shape[0] for block in pending.trailing_text) > 0

    def _observe_phase(self, phase: str, started: float) -> float:
        now = time.perf_counter()
        if self.metrics is not None:
            self.metrics.engine_phase.labels(phase=phase).observe(now - started)
        return now

    def _observe_stage(self, stage: str, seconds: float) -> None:
        if self.metrics is not None:
            self.metrics.first_audio_stage.labels(stage=stage).observe(seconds)

    def _admit_pending(self, talker) -> None:
        """Prefill every request whose talker inputs became ready this iteration, as one batch."""
        pending = [slot for slot in self._active.values() if slot.pending_talker is not None]
        if not pending:
            return
        requests = []
        for slot in pending:
            inputs, slot.pending_talker = slot.pending_talker, None
            requests.append(self.backend.talker_request(
                slot.handle.request_id, inputs.prefill_embeds, torch.cat(inputs.trailing_text),
                inputs.tts_pad_embed, inputs.is_text_finished, slot.request, slot.talker_generator,
            ))
            slot.talker_id = slot.handle.request_id
        ended = talker.admit(requests)
        now = time.perf_counter()
        for slot in pending:
            slot.talker_admitted_at = now
            self._observe_stage("thinker", now - slot.speak_started_at)  # codec EOS straight after the prefill: no frames
        for frame in ended:
            self._active[frame.request_id].talker_finish = frame.finish_reason
        if ended:
            talker.retire([frame.request_id for frame in ended])

    def _take_token(self, slot: _Slot, event, talker) -> None:
        """One thinker token of `slot`: a text delta, and its rows on to the talker when speaking."""
        token_id = event.token_id
        slot.num_sampled += 1
        finish_reason = event.finish_reason
        if finish_reason is None and slot.num_sampled >= slot.request.max_new_tokens:
            finish_reason = "length"  # the cohort's run may allow more; this request's budget is spent
        if finish_reason != "stop":
            slot.text_ids.append(token_id)
            delta = self._text_delta(slot)
            if delta:
                slot.handle._push(EngineEvent(text=delta))
        if finish_reason is not None:
            slot.finish_reason = finish_reason
            tail = self._text_delta(slot, final=True)
            if tail:
                slot.handle._push(EngineEvent(text=tail))
        if slot.handoff is None or slot.talker_finish is not None:
            return
        chunks = slot.handoff.push(event.embeds, event.hidden, [token_id])
        if finish_reason is not None:
            if not _has_speech(slot.handoff, len(slot.prompt_ids), finish_reason):
                slot.talker_finish = "stop"  # the reply kept no row to speak (an immediate stop): no audio
                return
            chunks += slot.handoff.finish(finish_reason)
        for chunk in chunks:
            if chunk.index == 0:
                slot.pending_talker = _PendingTalker(
                    chunk.prefill_embeds, [chunk.trailing_text], chunk.tts_pad_embed, chunk.is_finished
                )
            elif slot.pending_talker is not None:  # not prefilled yet: the rows join its admission
                slot.pending_talker.trailing_text.append(chunk.trailing_text)
                slot.pending_talker.is_text_finished = chunk.is_finished
            else:
                talker.push_text(slot.talker_id, chunk.trailing_text, chunk.is_finished)

    def _text_delta(self, slot: _Slot, final: bool = False) -> str:
        """New text since the last delta; a trailing partial UTF-8 sequence waits for its next bytes."""
        text = self.backend.decode(slot.text_ids)
        if not final and text.endswith("\ufffd"):
            return ""
        delta = text[len(slot.text_emitted):]
        slot.text_emitted = text
        return delta

    def _take_frames(self, frames) -> None:
        by_talker_id = {slot.talker_id: slot for slot in self._active.values() if slot.talker_id is not None}
        for frame in frames:
            slot = by_talker_id[frame.request_id]
            if frame.codes is not None:
                slot.frames.append(frame.codes)
                if slot.first_frame_at is None:
                    slot.first_frame_at = time.perf_counter()
                    self._observe_stage("talker", slot.first_frame_at - slot.talker_admitted_at)
            if frame.finish_reason is not None:
                slot.talker_finish = frame.finish_reason

    def _decode_ready(self) -> None:
        """code2wav for the requests with a chunk ready: first chunks in one batch, then later ones.

        Chunk boundaries are fixed per request (first_chunk_frames, then every chunk_frames, then the
        rest), whatever else runs; only the iteration a chunk is decoded in depends on the load. Every
        ready first chunk is decoded at once (time to first audio). Later chunks go oldest first (the
        iteration they became ready, then request id): the oldest always, the next ones while their
        frames fit in `max_decode_frames`. So requests that finish together spread their long last
        chunks over several short iterations instead of one long one that every newcomer waits behind.
        While requests are queued for a free slot, later chunks wait for the next iteration (at most
        `max_defer_iterations` iterations in a row), so the newcomers are admitted sooner."""
        first, later = [], []
        for slot in self._active.values():
            pending = len(slot.frames) - slot.num_decoded
            target = self.backend.first_chunk_frames if slot.num_decoded == 0 else self.backend.chunk_frames
            if pending >= target or (pending > 0 and slot.talker_finish is not None):
                if slot.num_decoded == 0:
                    first.append((slot, min(pending, target)))
                    continue
                if slot.chunk_ready_step is None:
                    slot.chunk_ready_step = self._step_index
                later.append((slot, min(pending, target)))
        later.sort(key=lambda item: (item[0].chunk_ready_step, item[0].handle.request_id))
        if later and self._num_deferred < self.max_defer_iterations:
            with self._cond:
                has_newcomers = bool(self._waiting) and len(self._active) < self.max_batch_size
            if has_newcomers:  # end the iteration: admitting them now beats decoding audio not yet due
                self._num_deferred += 1
                later = []
        if later:
            self._num_deferred = 0
        budget = self.max_decode_frames
        taken = []
        for i, (slot, n) in enumerate(later):
            if i > 0 and n > budget:
                break  # strictly oldest first: a short chunk never overtakes a waiting long one
            taken.append((slot, n))
            slot.chunk_ready_step = None
            budget -= n
        self._decode(first)  # on their way before the later chunks' (longer) code2wav starts
        self._decode(taken)

    def _decode(self, ready: list[tuple[_Slot, int]]) -> None:
        """The next n frames of each slot through code2wav in one batch; the audio goes out at once."""
        if not ready:
            return
        blocks = [torch.stack(slot.frames[slot.num_decoded : slot.num_decoded + n], dim=1) for slot, n in ready]
        chunks = self.backend.decode_chunks([slot.codec_stream for slot, _ in ready], blocks)  # [G, n] blocks
        now = time.perf_counter()
        for (slot, n), samples in zip(ready, chunks):
            slot.num_decoded += n
            if slot.first_audio_at is None:
                slot.first_audio_at = now
                self._observe_stage("code2wav", now - slot.first_frame_at)
                if self.metrics is not None:
                    self.metrics.time_to_first_audio.observe(now - slot.submitted_at)
            slot.handle._push(EngineEvent(audio=samples, step=self._step_index))

    def _is_complete(self, slot: _Slot) -> bool:
        if slot.request.messages is not None and slot.finish_reason is None:
            return False
        if slot.request.speaker is None:
            return True
        return slot.talker_finish is not None and slot.num_decoded == len(slot.frames)

    def _retire_finished(self, talker) -> None:
        done = [slot for slot in self._active.values() if self._is_complete(slot)]
        if not done:
            return
        in_batch = set(talker.request_ids)
        retire = [slot.talker_id for slot in done if slot.talker_id in in_batch]
        if retire:
            talker.retire(retire)
        now = time.perf_counter()
        with self._cond:
            for slot in done:
                self._active.pop(slot.handle.request_id, None)
                if slot.handle.is_cancelled:
                    continue
                slot.handle.is_done = True
                finish_reason = slot.finish_reason if slot.request.messages is not None else slot.talker_finish
                slot.handle._push(EngineEvent(
                    finish_reason=finish_reason, prompt_tokens=len(slot.prompt_ids),
                    completion_tokens=len(slot.text_ids), num_frames=len(slot.frames),
                ))
                if self.metrics is not None and slot.frames:
                    elapsed = max(now - slot.speak_started_at, 1e-9)
                    self.metrics.frames_per_second.observe(len(slot.frames) / elapsed)
            self._set_gauges()

    def _fail_all(self, message: str) -> None:
        with self._cond:
            for slot in self._active.values():
                slot.handle.is_done = True
                slot.handle._push(EngineEvent(error=message))
            self._active.clear()
            self._cohorts.clear()
            self._set_gauges()


def _has_speech(handoff, num_prompt: int, finish_reason: str) -> bool:
    """Whether the trimmed reply keeps the rows the talker prefill needs. The thinker never forwards
    its last token, so at most P + N − 1 rows exist."""
    num_output = len(handoff.output_ids)
    kept = min(num_kept_rows(num_prompt, num_output, finish_reason), num_prompt + num_output - 1)
    return kept >= handoff.builder.num_prefill_rows


def _request_generators(seed: int | None) -> tuple[torch.Generator, torch.Generator]:
    """The thinker's and the talker's generators of one request, seeded as `OmniPipeline` seeds them
    (`request_seeds`), so a served request equals `pipe.generate(..., seed=seed)`. An unseeded
    request still gets its own, so it never draws from the global RNG other requests share."""
    return make_generators(list(request_seeds(seed)))


class SpeechBackend:
    """The Qwen3-Omni side of the engine: tokenizer, thinker runs, talker inputs, the batched talker
    state and batched code2wav.

    model: transformers' `Qwen3OmniMoeForConditionalGeneration`; tokenizer: its text tokenizer (a chat
    template is required). max_frames caps a request's audio (finish_reason "length").
    Audio chunks: the first after `first_chunk_frames` frames (fast first audio), then every
    `chunk_frames`, decoded by `StreamingCode2Wav` (exact: a request's chunks join into the one-shot
    decode of its frames, 1920·F − 555 samples), its conv stack batched across requests.
    """

    def __init__(
        self,
        model,
        tokenizer,
        *,
        max_frames: int = 1500,
        max_prompt_tokens: int = 8192,
        first_chunk_frames: int = 1,
        chunk_frames: int = 25,
    ):
        for name, value in (
            ("max_frames", max_frames), ("max_prompt_tokens", max_prompt_tokens),
            ("first_chunk_frames", first_chunk_frames), ("chunk_frames", chunk_frames),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if tokenizer is None or getattr(tokenizer, "chat_template", None) is None:
            raise ValueError("tokenizer must have a chat template")
        self.model = model
        self.tokenizer = tokenizer
        self.max_frames = max_frames
        self.max_prompt_tokens = max_prompt_tokens
        self.first_chunk_frames = first_chunk_frames
        self.chunk_frames = chunk_frames
        config = model.config
        self.speakers = tuple(config.talker_config.speaker_id)
        self.sample_rate = 24000
        self.accept_hidden_layer = config.talker_config.accept_hidden_layer
        self.eos_token_ids = {config.im_end_token_id}
        if tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(int(tokenizer.eos_token_id))
        self.codec = StreamingCode2Wav(model.code2wav)
        # the thinker's and the talker's packed weights, made once and shared by every run and batch
        self.thinker_decoder = PackedDecoder.from_module(model.thinker.model.language_model)
        self.talker_decoder = PackedDecoder.from_module(model.talker.model)
        # what the template adds to open the assistant turn ("<|im_start|>assistant\n")
        probe = [{"role": "user", "content": "x"}]
        opened = list(tokenizer.apply_chat_template(probe, add_generation_prompt=True, tokenize=True, return_dict=False))
        closed = list(tokenizer.apply_chat_template(probe, add_generation_prompt=False, tokenize=True, return_dict=False))
        if opened[: len(closed)] != closed or len(opened) == len(closed):
            raise ValueError("tokenizer: its chat template does not open an assistant turn after the prompt")
        self.speech_header_ids = opened[len(closed):]

    @classmethod
    def tiny(cls, seed: int = 0, **kwargs) -> "SpeechBackend":
        """The embedded default: a seeded tiny Qwen3-Omni and its byte tokenizer (noise-like speech)."""
        from omnimtp.models.tiny import tiny_qwen3_omni
        from omnimtp.tokenizer import byte_tokenizer

        return cls(tiny_qwen3_omni(seed), byte_tokenizer(), **kwargs)

    # -- requests → ids ---------------------------------------------------------------------------

    def request_ids(self, request: EngineRequest) -> list[int]:
        """Chat: the templated prompt. Speech: an opened assistant turn followed by the text to say."""
        if request.messages is not None:
            messages = [
                {"role": "system" if role == "developer" else role, "content": text} for role, text in request.messages
            ]
            ids = list(self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))
            name = "messages"
        else:
            ids = self.speech_header_ids + list(self.tokenizer.encode(request.speak_text, add_special_tokens=False))
            name = "input"
        if len(ids) > self.max_prompt_tokens:
            raise PromptTooLongError(name, len(ids), self.max_prompt_tokens)
        return ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    # -- thinker and talker -----------------------------------------------------------------------

    def new_thinker(self, slots: list[_Slot]):
        """One thinker run over the slots' prompts (left-padded), each row with its own sampling and
        generator; the run's token cap is the largest budget (the engine enforces each request's own)."""
        from omnimtp.thinker import ThinkerRun

        for slot in slots:
            if slot.request.speaker is not None:
                slot.handoff = self.new_handoff(slot.prompt_ids, slot.request.speaker)
        return ThinkerRun(
            self.model.thinker, [slot.prompt_ids for slot in slots], accept_hidden_layer=self.accept_hidden_layer,
            eos_token_ids=self.eos_token_ids, max_new_tokens=max(slot.request.max_new_tokens for slot in slots),
            sampling=[slot.request.sampling for slot in slots], generators=[slot.thinker_generator for slot in slots],
            decoder=self.thinker_decoder,
        )

    def new_handoff(self, prompt_ids: list[int], speaker: str):
        from omnimtp.handoff import ThinkerToTalkerStream
        from omnimtp.talker.qwen3_inputs import Qwen3TalkerInputBuilder

        return ThinkerToTalkerStream(Qwen3TalkerInputBuilder(self.model, prompt_ids, speaker))

    def speech_inputs(self, ids: list[int], speaker: str):
        """Talker inputs that speak ids[len(header):] as if the thinker had replied with them: the
        rows are the thinker's input embeddings of the tokens (a text row's only thinker input)."""
        from omnimtp.talker.qwen3_inputs import Qwen3TalkerInputBuilder

        builder = Qwen3TalkerInputBuilder(self.model, self.speech_header_ids, speaker)
        with torch.no_grad():
            embeds = self.model.thinker.get_input_embeddings()(torch.tensor(ids))  # [P + N, D]
        return builder.build(embeds, embeds, projection="per_row")

    def new_talker_batch(self, max_batch_size: int):
        from omnimtp.talker.loop import TalkerBatch

        return TalkerBatch(self.model.talker, max_batch_size, decoder=self.talker_decoder)

    def talker_request(self, request_id, prefill_embeds, trailing_text, tts_pad_embed, is_text_finished, request,
                       generator):
        from omnimtp.talker.loop import QWEN3_OMNI_TALKER_SAMPLING, TalkerRequest

        # temperature 0 makes the whole request greedy; otherwise the talker samples as transformers does
        sampling = None if request.sampling.is_greedy else QWEN3_OMNI_TALKER_SAMPLING
        return TalkerRequest(
            request_id, prefill_embeds, trailing_text, tts_pad_embed, is_text_finished=is_text_finished,
            sampling=sampling, generator=generator, max_frames=self.max_frames,
        )

    # -- code2wav ---------------------------------------------------------------------------------

    def new_codec_stream(self):
        return self.codec.new_stream()

    def decode_chunks(self, streams: list, blocks: list[torch.Tensor]) -> list[np.ndarray]:
        """The next audio of several requests in one code2wav call: blocks[i] [G, n_i] continues
        streams[i]; chunk [a, b) holds samples [1920·a − 555, 1920·b − 555) of the one-shot decode."""
        return [np.asarray(chunk, dtype=np.float32) for chunk in self.codec.decode(streams, blocks)]
