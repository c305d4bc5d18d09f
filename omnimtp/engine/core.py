"""The one step loop every driver runs: `OmniPipeline.generate/stream`, the HTTP server, a batch job.

    core = EngineCore(family, EngineConfig())
    core.add(request)                       # a `Request`: prompt ids, speaker, sampling, seed, limits
    while core.has_work():
        for event in core.step():           # StepEvent: text delta | audio chunk | finished
            ...

One `step()` is one audio frame boundary:

    admit    (first) while a request waits for its first audio, waiting requests are admitted before the
             running cohorts think (below), so one that came during the last step never waits for their steps
    think    one thinker step for every running cohort (requests admitted together share a run); while a
             request waits for its first audio, background cohorts and cohorts whose talkers hold unconsumed
             reply rows (ahead of their audio, as speculation gets) skip theirs, and the others' `auto`
             speculation takes plain steps (the shortest: a fixed k drafts as always); asked before each
             cohort, so a request that came while an earlier cohort thought counts for the later ones
    admit    parked requests whose text came, then waiting requests, up to max_batch_size holding a slot (a
             speech request with no text ids yet is not admitted) and, of those that speak, up to `max_speaking`
             unparked (a driver's real-time capacity, `omnimtp.server.admission`; later ones wait in order);
             chat requests form a new cohort that takes up to `max_start_steps` thinker steps at once (its
             first frame needs the talker prefill and one reply row), so a request that arrived while the
             engine was busy speaks in this step; speech requests get their talker inputs from the text to speak
    text     speech requests' text ids that came since the last step (`push_speech_ids`: a text still being
             written) on to their talker inputs (`omnimtp.handoff.SpeechTextStream`, one per segment of a long
             text); a talker row waits for a text row it has not got, and a driver waits for text while nothing
             else can move (`has_ready_work`)
    prefill  the talker prefill of every request whose talker inputs are ready, as one batch
    speak    one talker + code predictor step for every speaking request, as one batch: the code predictor
             completes the step's frames, then (where the codec looks at no later frame) the chunks they
             complete are decoded and go out (below), then the talker forward toward the next frame
    decode   code2wav of every chunk that is due (after the forward: those it made due, a talker's last chunk,
             and a codec's that looks ahead): first chunks at once, later ones oldest first within
             `max_decode_frames`, those of listeners holding less than two steps of audio (a newcomer's next
             ones) in a call before the others' (with the first chunks, when both are due: `_decode_due`); a
             later chunk whose listener is far enough ahead (`Request.playback`) that others' leads can outgrow
             its decoding meanwhile waits, up to `max_defer_steps` steps in a row (each request's own count),
             while a newcomer waits for its slot or its first audio, or another listener holds less than two
             steps and that decoding: so newcomers start, and started players play on, ahead of audio not yet due
    retire   finished requests
    park     running requests that can do nothing until more of their text comes give up their slot: their
             talker state leaves the talker batch (`TalkerBatch.park`) and comes back, bit for bit, when the
             text does and a slot is free; a parked request does not count against max_batch_size

The model family (`omnimtp.engine.family.Family`: `omnimtp.families.qwen3_omni`, `qwen2_5_omni`) supplies
everything model-specific; the core only moves each
request's state (`omnimtp.engine.request.Request`) through the stages. Each request has its own KV
slots and generators, so a seeded request gives the same tokens, codes and PCM alone or in any batch.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Generator, Hashable, Iterator
from dataclasses import dataclass

import numpy as np
import torch

from omnimtp.engine.config import EngineConfig
from omnimtp.engine.family import Family
from omnimtp.engine.playback import chunk_frames_after
from omnimtp.engine.prefix_cache import PrefixCache
from omnimtp.engine.request import OmniOutput, Request, Status, StepEvent
from omnimtp.handoff import ThinkerToTalkerStream, reply_has_speech
from omnimtp.talker.loop import TalkerFrame, TalkerRequest

# How fast a newcomer's listener is assumed to gain lead where chunks are not sized for one (playout_rtf None): as
# with admission's headroom, frames made at 0.9 of real time.
_PLAYOUT_RTF = 0.9


@dataclass
class _PendingTalker:
    """A request's talker prefill, waiting for the step's talker admission."""

    prefill_embeds: torch.Tensor  # [L, H]
    trailing_text: list[torch.Tensor]  # [n, H] blocks, in order
    tts_pad_embed: torch.Tensor  # [H]
    is_text_finished: bool


@dataclass
class _Cohort:
    """Chat requests admitted in the same step: one thinker run, one forward per step for all."""

    run: object  # the family's thinker run (`omnimtp.thinker.ThinkerRun`)
    requests: list[Request]

    @property
    def is_live(self) -> bool:
        return not self.run.is_finished and any(r.is_thinking for r in self.requests)

    @property
    def is_background(self) -> bool:
        return all(r.is_background for r in self.requests)


class EngineCore:
    """The step loop (see the module docstring). Not thread-safe except `add` and the waiting queue,
    which take `lock` (a driver that submits from another thread passes its own)."""

    def __init__(self, family: Family, config: EngineConfig | None = None, *, lock=None, observer=None,
                 clock=time.perf_counter):
        self.family = family
        self.clock = clock  # seconds on one monotonic clock: what the core times and stamps (a test may simulate one)
        self.config = config or EngineConfig()
        self.lock = lock if lock is not None else contextlib.nullcontext()
        # optional: .stage(name, s), .phase(name, s), .talker_batch(n), and, if it has one, .decoded(chunk frames, s,
        # is_first) after each code2wav call
        self.observer = observer
        self.waiting: deque[Request] = deque()
        self.running: dict[Hashable, Request] = {}
        self.cohorts: list[_Cohort] = []
        self.talker = family.new_talker_batch(self.config.max_batch_size)
        self.prefix_cache = PrefixCache(self.config.prefix_cache_bytes)
        self.num_steps = 0
        self.step_s = 0.0  # the last step's seconds
        self.decode_frame_s = 0.0  # code2wav's seconds a frame (a moving average over its calls)
        # the most requests that speak running at once (parked ones aside), set between steps by a driver that
        # admits by capacity (`omnimtp.server.admission`); None: only max_batch_size bounds them
        self.max_speaking: int | None = None

    # --- the driver's side ---

    def add(self, request: Request) -> None:
        if not isinstance(request, Request):
            raise ValueError(f"request must be a Request, got {type(request).__name__}")
        if request.speaker is not None:
            self.family.check_speaker(request.speaker)
        if request.is_chat:
            self.family.check_media(request.prompt_ids, request.media)
        request.place_generators(self.family.device)
        with self.lock:
            if request.request_id in self.running or any(r.request_id == request.request_id for r in self.waiting):
                raise ValueError(f"request_id {request.request_id!r} is already in the engine")
            request.status = Status.WAITING
            if not request.has_text:
                request.waits_for_text_since = request.submitted_at
            self.waiting.append(request)

    def num_queued(self) -> int:
        """Waiting requests that can take a slot once one is free (a streamed text's request still waiting for its
        first words is not one: it holds nothing another request needs)."""
        with self.lock:
            return sum(r.has_text for r in self.waiting)

    def num_queued_ahead(self, request: Request) -> int | None:
        """The queued requests (as `num_queued` counts them) ahead of a waiting one; None when it is not queued."""
        with self.lock:
            queued = [r for r in self.waiting if r.has_text]
            return next((i for i, r in enumerate(queued) if r is request), None)

    def has_work(self) -> bool:
        with self.lock:
            return bool(self.waiting or self.running)

    def has_ready_work(self) -> bool:
        """Whether a step would make progress: a request to admit or to resume with a slot free, or a running
        one that is not only waiting for more of its text (a driver waits for text instead of stepping when
        nothing else can move)."""
        with self.lock:
            if self._num_free_slots() > 0 and (
                self._admissible() or any(r.can_resume for r in self.running.values())
            ):
                return True
            return any(not r.is_parked and not self._waits_for_text(r) for r in self.running.values())

    def push_speech_ids(self, request_id: Hashable, ids: list[int], is_finished: bool,
                        ends_segment: bool = False) -> bool:
        """More ids of a speech request added with `is_text_finished=False` (any thread); is_finished: they end
        its text; ends_segment: they end a segment of it (`omnimtp.families.text.StreamedSpeechSegments`: the
        next ids start a fresh talker prefill, as a whole text's next segment does); no ids: more text came
        whose ids are not settled yet (its wait for text starts again). False when the request is no longer
        here (it finished, e.g. on codec EOS, or was aborted)."""
        ids = [int(token) for token in ids]
        with self.lock:
            request = self.running.get(request_id) or next(
                (r for r in self.waiting if r.request_id == request_id), None
            )
            if request is None:
                return False
            if request.is_text_finished:
                raise ValueError(f"request_id {request_id!r}: its text is already finished")
            request.prompt_ids.extend(ids)
            request.is_text_finished = bool(is_finished)
            if ends_segment and not is_finished:
                request.segment_ends.append(len(request.prompt_ids))
            if ids or is_finished:
                request.waits_for_text_since = None
            elif request.waits_for_text_since is not None:  # text came, though none of its ids is settled yet
                request.waits_for_text_since = self.clock()
        return True

    def push_speech_text(self, request_id: Hashable, pieces: list[tuple[list[int], bool]], is_finished: bool) -> bool:
        """`push_speech_ids` of each (ids, ends_segment) piece `omnimtp.families.text.StreamedSpeechSegments`
        gave, is_finished with the last (no pieces: text came whose ids are not settled yet)."""
        if not pieces:
            return self.push_speech_ids(request_id, [], is_finished)
        for i, (ids, ends_segment) in enumerate(pieces):
            if not self.push_speech_ids(request_id, ids, is_finished and i == len(pieces) - 1, ends_segment):
                return False
        return True

    def abort(self, request_id: Hashable) -> Request | None:
        """Drop a waiting or running request (call between steps); None if it is not here."""
        with self.lock:
            request = next((r for r in self.waiting if r.request_id == request_id), None)
            if request is not None:
                self.waiting.remove(request)
            else:
                request = self.running.pop(request_id, None)
        if request is None:
            return None
        if request.is_in_talker:
            self.talker.retire([request_id])
            request.is_in_talker = False
        request.is_parked, request.parked_talker = False, None
        request.status = Status.ABORTED
        return request

    def fail_running(self) -> list[Request]:
        """After a step raised: drop every running request (returned, for the driver to fail), parked ones
        included (their clients would otherwise wait for text that can no longer be spoken), and start a fresh
        talker batch. Waiting requests stay: nothing of theirs was in the step."""
        with self.lock:
            failed = list(self.running.values())
            self.running.clear()
        for request in failed:
            request.status = Status.ABORTED
            request.is_in_talker, request.is_parked, request.parked_talker = False, False, None
        self.cohorts.clear()
        self.talker = self.family.new_talker_batch(self.config.max_batch_size)
        return failed

    def output(self, request: Request) -> OmniOutput:
        """A finished request's result."""
        num_groups = self.family.num_code_groups
        codes = (
            torch.stack(request.frames, dim=1).cpu() if request.frames
            else torch.zeros((num_groups, 0), dtype=torch.long)
        )
        audio = np.concatenate(request.audio) if request.audio else np.zeros(0, dtype=np.float32)
        return OmniOutput(
            text=self.family.decode_text(request.reply_ids), text_ids=list(request.output_ids), codes=codes,
            audio=audio.astype(np.float32), sample_rate=self.family.sample_rate, finish_reason=request.finish_reason,
            thinker_finish_reason=request.thinker_finish_reason, talker_finish_reason=request.talker_finish_reason,
            spec_stats=request.spec_stats, segment_frames=list(request.segment_frames),
        )

    # --- one step ---

    def step(self) -> Iterator[StepEvent]:
        """One step; its events are yielded as they are made (a first audio chunk goes out before the
        step's later chunks are decoded), so iterate it to the end before the next step."""
        self.num_steps += 1
        started = step_started = self.clock()
        thinking = list(self.cohorts)
        if self._is_first_audio_due():  # a request that came during the last step starts before the others think
            yield from self._start(self._admit(admit_background=False))
        is_first_audio_due = False
        for cohort in thinking:  # asked before each cohort: a request that came during the step counts
            is_first_audio_due = self._is_first_audio_due()
            if not (is_first_audio_due and (cohort.is_background or self._is_ahead(cohort))):
                yield from self._think(cohort, plain=is_first_audio_due)
        is_first_audio_due = self._is_first_audio_due()
        yield from self._start(self._admit(admit_background=not is_first_audio_due))
        self.cohorts = [cohort for cohort in self.cohorts if cohort.is_live]
        started = self._phase("think", started)
        self._feed_text()
        self._prefill_talker()
        started = self._phase("talker_admit", started)
        early_decode_s = yield from self._speak()
        now = self.clock()
        self._phase("talk", started + early_decode_s)  # the first chunks decoded within count as code2wav
        yield from self._decode_due()
        self._phase("code2wav", now - early_decode_s)
        yield from self._retire()
        self._park()
        self.step_s = self.clock() - step_started

    # --- admit ---

    def _is_first_audio_due(self) -> bool:
        """Whether a request of normal priority that speaks still waits for its first audio (running, or waiting
        with a slot free), and not for its text: background requests neither start nor think meanwhile, so they
        never delay it. Only running ones count when every slot is taken, so background requests holding the
        slots still finish."""
        with self.lock:
            waiting = self._admissible() if self._num_free_slots() > 0 else []
            return any(not r.is_background and r.has_speech and r.first_audio_at is None and not r.is_parked
                       for r in [*self.running.values(), *waiting])

    def _is_ahead(self, cohort: _Cohort) -> bool:
        """Whether every request the cohort still thinks for speaks and its talker holds a reply row it has not
        consumed: this step's frames wait for none of the cohort's thinker steps, so while a first audio is
        due the cohort may skip one (a speculative cohort gets ahead by its accepted drafts)."""
        thinking = [r for r in cohort.requests if r.is_thinking]
        return bool(thinking) and all(
            r.has_speech and r.is_in_talker and self.talker.num_text_rows(r.request_id) > 0 for r in thinking
        )

    def num_startable(self, has_speech: bool) -> int:
        """How many more requests (that speak, or not) the next step could start (call holding `lock`)."""
        room = self._num_free_slots()
        if has_speech and self.max_speaking is not None:
            room = min(room, self.max_speaking - self._num_speaking())
        return max(room, 0)

    def _num_speaking(self) -> int:
        """Running requests whose talkers still make frames, or will, or whose streamed audio is not all decoded
        yet (call holding `lock`): a stream's last chunks are decoded after its talker ends, and a newcomer started
        in its place then would have them in its first steps. A parked one does not count (it makes none until its
        text comes, and then resumes within `max_speaking` like a newcomer)."""
        return sum(r.has_speech and not r.is_parked
                   and (r.talker_finish_reason is None or (r.is_streamed and r.num_decoded < len(r.frames)))
                   for r in self.running.values())

    def _num_free_slots(self) -> int:
        """Slots free for a request to run in (call holding `lock`): parked requests hold none."""
        return self.config.max_batch_size - sum(not r.is_parked for r in self.running.values())

    def _admissible(self) -> list[Request]:
        """Waiting requests that may start now, oldest first (call holding `lock`): those with text, and of those
        that speak only as many as `max_speaking` leaves room for, in arrival order (a later one never
        overtakes an earlier one that waits for room)."""
        waiting = [r for r in self.waiting if r.has_text]
        if self.max_speaking is None:
            return waiting
        room = self.max_speaking - self._num_speaking()
        admissible = []
        for request in waiting:
            if request.has_speech:
                if room <= 0:
                    continue
                room -= 1
            admissible.append(request)
        return admissible

    def _admit(self, admit_background: bool = True) -> list[Request]:
        """Parked requests whose text came, then waiting requests into free slots, oldest first: those of
        normal priority; background ones only in a step that admits no other (they form their own cohort) and
        when admit_background. A speech request with no text ids yet waits, so it holds no slot."""
        with self.lock:
            num_free = self._num_free_slots()
            room = num_free if self.max_speaking is None else min(num_free, self.max_speaking - self._num_speaking())
            resumed = [r for r in self.running.values() if r.can_resume][: max(room, 0)]
            for request in resumed:
                request.is_parked = False
            waiting = self._admissible()
            chosen = [r for r in waiting if not r.is_background]
            if not chosen and admit_background:
                chosen = waiting
            admitted = chosen[: max(num_free - len(resumed), 0)]
            for request in admitted:
                self.waiting.remove(request)
                self.running[request.request_id] = request
        for request in resumed:
            if request.parked_talker is not None:
                self.talker.resume(request.parked_talker)
                request.parked_talker, request.is_in_talker = None, True
        now = self.clock()
        for request in admitted:
            request.status = Status.RUNNING
            request.admitted_at, request.admitted_step = now, self.num_steps
            self._stage("queue", now - request.submitted_at)
            if not request.has_speech:
                continue
            request.codec_stream = self.family.new_codec_stream(request.speaker, request.codec_generator)
            if not request.is_chat:
                request.speech_stream = self.family.speech_stream(request.speaker)  # fed by _feed_text
                continue
            request.talker_builder = self.family.talker_builder(
                request.prompt_ids, request.speaker, request.media, self.config.prefill_block
            )
            if request.is_streamed:
                request.handoff = ThinkerToTalkerStream(request.talker_builder)
        return admitted

    def _start(self, admitted: list[Request]) -> list[StepEvent]:
        """A new cohort for the admitted chat requests, with up to max_start_steps thinker steps now."""
        chats = [request for request in admitted if request.is_chat]
        if not chats:
            return []
        run = self.family.new_thinker(
            [r.prompt_ids for r in chats], [r.thinker_sampling for r in chats], [r.thinker_generator for r in chats],
            max(r.max_new_tokens for r in chats), [r.media for r in chats],
            prefill_block=self.config.prefill_block,
            prefixes=[None if r.cache_key is None else self.prefix_cache.get(r.cache_key) for r in chats],
            keeps_prefix=[r.cache_key is not None and self.prefix_cache.max_bytes > 0 for r in chats],
            plain_start_steps=self.config.max_start_steps - 1,
            logprobs=[r.logprobs for r in chats],
        )
        cohort = _Cohort(run, chats)
        self.cohorts.append(cohort)
        spec_stats = getattr(run, "spec_stats", None)  # a speculative run's per-request counts, updated as it steps
        for index, request in enumerate(chats):
            request.spec_stats = None if spec_stats is None else spec_stats[index]
        events = self._think(cohort)  # the prefill
        for index, request in enumerate(chats):
            if request.cache_key is not None:
                request.num_reused_rows = run.reused_rows[index]
                self.prefix_cache.put(request.cache_key, run.kept_prefixes[index], run.reused_rows[index])
        for _ in range(self.config.max_start_steps - 1):
            if run.is_finished or all(_can_speak(request) for request in chats):
                break
            events += self._think(cohort)
        return events

    # --- think ---

    def _think(self, cohort: _Cohort, plain: bool = False) -> list[StepEvent]:
        """One thinker step of the cohort; plain: while a request waits for its first audio, `auto`
        speculation takes plain steps, the shortest, so that first audio comes sooner (`ThinkerRun.step`)."""
        events = []
        for event in cohort.run.step(plain=plain):
            request = cohort.requests[event.index]
            if event.token_id is not None and request.is_thinking:  # aborted rows ride along unread
                events += self._take_token(request, event)
        return events

    def _take_token(self, request: Request, event) -> list[StepEvent]:
        """One thinker token: a text delta, and the token's rows on to the talker when speaking."""
        request.output_ids.append(event.token_id)
        finish_reason = event.finish_reason
        if finish_reason is None and len(request.output_ids) >= request.max_new_tokens:
            finish_reason = "length"  # the cohort's run may allow more; this request's budget is spent
        request.thinker_finish_reason = finish_reason
        if event.logprob is not None:
            request.output_logprobs.append(event.logprob)
        delta = request.text_delta(self.family.decode_text, is_final=finish_reason is not None)
        logprobs = request.logprobs_delta() if request.logprobs is not None and (delta or finish_reason) else []
        events = [StepEvent(request, self.num_steps, text=delta, logprobs=logprobs)] if delta or logprobs else []
        if request.has_speech and request.talker_finish_reason is None:
            self._hand_off(request, event, finish_reason)
        return events

    def _hand_off(self, request: Request, event, finish_reason: str | None) -> None:
        if finish_reason is not None:
            num_prompt, num_output = len(request.prompt_ids), len(request.output_ids)
            if not reply_has_speech(num_prompt, num_output, finish_reason, request.talker_builder.num_prefill_rows):
                request.talker_finish_reason = "stop"  # the reply kept no row to speak (an immediate stop)
                return
        if not request.is_streamed:
            request.thinker_rows.append((event.embeds, event.hidden))
            if finish_reason is not None:
                embeds, hidden = (torch.cat(rows) for rows in zip(*request.thinker_rows, strict=True))
                inputs = self.family.reply_talker_inputs(
                    request.talker_builder, request.prompt_ids, request.output_ids, embeds, hidden, finish_reason
                )
                request.thinker_rows = []
                request.talker_inputs = _PendingTalker(
                    inputs.prefill_embeds, [inputs.trailing_text], inputs.tts_pad_embed, True
                )
            return
        chunks = request.handoff.push(event.embeds, event.hidden, [event.token_id])
        if finish_reason is not None:
            chunks += request.handoff.finish(finish_reason)
        self._take_chunks(request, chunks)

    def _take_chunks(self, request: Request, chunks) -> None:
        """Streamed talker inputs (`omnimtp.handoff.TalkerChunk`s): chunk 0 waits for the talker admission, later
        rows join it there or go to the talker row, which waits for each row it has not got."""
        for chunk in chunks:
            if chunk.index == 0:
                request.talker_inputs = _PendingTalker(
                    chunk.prefill_embeds, [chunk.trailing_text], chunk.tts_pad_embed, chunk.is_finished
                )
            elif request.talker_inputs is not None:  # not prefilled yet: the rows join its admission
                request.talker_inputs.trailing_text.append(chunk.trailing_text)
                request.talker_inputs.is_text_finished = chunk.is_finished
            else:
                self.talker.push_text(request.request_id, chunk.trailing_text, chunk.is_finished)

    # --- speech text ---

    def _feed_text(self) -> None:
        """The text ids of speech requests that came since the last step, on to their talker inputs (each
        segment's to its own speech stream)."""
        for request in self.running.values():
            stream = request.speech_stream
            if stream is None or stream.is_finished or request.talker_finish_reason is not None or request.is_parked:
                continue
            with self.lock:
                unfed = request.unfed_ids()
            if unfed is None:
                continue
            start, ids, is_finished = unfed
            if not ids and is_finished and request.segment_frames and not stream.ids:
                # the text ended where the segment whose talker ended early did: nothing more to speak
                request.talker_finish_reason = _talker_finish_reason(request)
                continue
            if ids or is_finished:
                request.num_fed_ids = start + len(ids)
                self._take_chunks(request, stream.push(ids, is_finished))

    def _waits_for_text(self, request: Request) -> bool:
        """Whether a running request can do nothing until more of its text comes."""
        if request.speech_stream is None or request.has_unfed_text:
            return False
        if request.talker_inputs is not None or request.talker_finish_reason is not None:
            return False
        if request.is_in_talker and self.talker.is_ready(request.request_id):
            return False
        pending = len(request.frames) - request.num_decoded
        target = self.config.first_chunk_frames if request.num_decoded == 0 else self._chunk_size(request)
        return not (request.is_streamed and pending >= target)

    # --- prefill + speak ---

    def _prefill_talker(self) -> None:
        """The talker prefill of every request whose talker inputs are ready, as one admission."""
        pending = [r for r in self.running.values() if r.talker_inputs is not None]
        if not pending:
            return
        talker_requests = []
        for request in pending:
            inputs, request.talker_inputs = request.talker_inputs, None
            builder = request.talker_builder
            is_kept = builder is not None and request.cache_key is not None and self.prefix_cache.max_bytes > 0
            talker_requests.append(TalkerRequest(
                request.request_id, inputs.prefill_embeds, torch.cat(inputs.trailing_text), inputs.tts_pad_embed,
                is_text_finished=inputs.is_text_finished, sampling=request.talker_sampling,
                generator=request.talker_generator, max_frames=request.max_frames,
                prefill_positions=None if builder is None else builder.prefill_positions,
                prefill_block=None if builder is None else self.config.prefill_block,
                prefix=self.prefix_cache.get_talker(request.cache_key) if is_kept else None,
                keeps_prefix=is_kept and builder.prefill_positions is None,
                runaway=self.talker.frames.runaway if self.config.cuts_runaway else None,
            ))
            request.is_in_talker = True
        ended = self.talker.admit(talker_requests)  # codec EOS straight after the prefill: no frames
        for request, talker_request in zip(pending, talker_requests, strict=True):
            if talker_request.keeps_prefix:
                request.num_talker_reused_rows = talker_request.reused_rows
                self.prefix_cache.put_talker(request.cache_key, talker_request.kept_prefix, talker_request.reused_rows)
        now = self.clock()
        for request in pending:
            if request.talker_admitted_at is None:  # a later segment's admission is not the request's
                request.talker_admitted_at = now
                self._stage("thinker", now - request.admitted_at)
        self._end_talkers(ended)

    def _speak(self) -> Generator[StepEvent, None, float]:
        """One talker step. Where the codec looks at no later frame, the chunks its frames complete are decoded
        (and go out) between the step's frames and its talker forward toward the next frame, so no audio waits
        for that forward (a talker's last chunk, known only once the forward has ended it, goes after). Returns
        the seconds that decoding took."""
        taken = self.talker.take_frames() if self.talker.rows else None
        if taken is None:
            return 0.0
        decode_s = 0.0
        now = self.clock()
        for request_id, codes in zip(taken.request_ids, taken.codes, strict=True):
            request = self.running[request_id]
            request.frames.append(codes)
            if request.first_frame_at is None:
                request.first_frame_at = now
                self._stage("talker", request.first_frame_at - request.talker_admitted_at)
        if not self.family.codec_looks_ahead:
            started = self.clock()
            yield from self._decode_due()
            decode_s = self.clock() - started
        frames = self.talker.advance(taken)
        if self.observer is not None:
            self.observer.talker_batch(len(frames))
        # a finished row leaves the talker batch now; its audio may still be decoding
        self._end_talkers([frame for frame in frames if frame.finish_reason is not None])
        return decode_s

    def _end_talkers(self, ended: list[TalkerFrame]) -> None:
        if not ended:
            return
        self.talker.retire([frame.request_id for frame in ended])
        for frame in ended:
            request = self.running[frame.request_id]
            request.is_in_talker = False
            request.segment_frames.append(len(request.frames) - sum(request.segment_frames))
            request.segment_finish_reasons.append(frame.finish_reason)
            request.audio_cut_by = request.audio_cut_by or frame.cut_by
            ids = None if request.segments is None else next(request.segments, None)
            if ids is not None or request.may_have_next_segment:
                self._next_segment(request, ids or [])
                continue
            request.talker_finish_reason = _talker_finish_reason(request)

    def _next_segment(self, request: Request, ids: list[int]) -> None:
        """The request's next segment on to a fresh speech stream: its ids (a whole text's next segment; a
        streamed text's come with `push_speech_ids`) join prompt_ids past those fed so far, so `_feed_text`
        hands them over and it is prefilled like a new text, while the request keeps its generators, frames and
        codec stream."""
        with self.lock:
            if ids:
                request.segment_ends.append(len(request.prompt_ids))
                request.prompt_ids.extend(int(token) for token in ids)
        request.speech_stream = self.family.speech_stream(request.speaker)

    # --- decode ---

    def _due_chunks(self) -> tuple[list[tuple[Request, int]], list[tuple[Request, int]]]:
        """The chunks code2wav decodes this step, first chunks and later ones (see the module docstring).

        Chunk boundaries are fixed per request (first_chunk_frames, then every chunk_frames, then the
        rest; a request that is not streamed: all its frames once its talker ends), whatever else runs;
        only the step a chunk is decoded in depends on the load. Later chunks go strictly oldest first
        (the step they became due, then admission order), so requests that finish together spread their
        long last chunks over several short steps instead of one long one every newcomer waits behind."""
        config = self.config
        first, later = [], []
        for order, request in enumerate(self.running.values()):
            pending = len(request.frames) - request.num_decoded
            if pending == 0:
                continue
            is_talker_done = request.talker_finish_reason is not None
            if not request.is_streamed:
                size = pending if is_talker_done else 0
            elif request.num_decoded == 0:
                if size := self._first_chunk_size(request):
                    first.append((request, size))
                continue
            else:
                target = self._chunk_size(request)
                size = min(pending, target) if pending >= target or is_talker_done else 0
            if size == 0:
                continue
            if request.chunk_ready_step is None:
                request.chunk_ready_step = self.num_steps
            later.append((order, request, size))
        later.sort(key=lambda item: (item[1].chunk_ready_step, item[0]))
        if later and config.max_defer_steps > 0:
            now = self.clock()
            with self.lock:
                has_newcomers = self._num_free_slots() > 0 and bool(self._admissible())
            due = []
            for item in later:
                request = item[1]
                # a step decodes twice (`_speak`): a chunk that waited at its first decoding waits the step out
                waited_now = request.deferred_step == self.num_steps
                if waited_now or (request.num_deferred < config.max_defer_steps
                                  and self._may_wait(request, item[2], now, has_newcomers)):
                    if not waited_now:  # its waits count once a step
                        request.num_deferred += 1
                        request.deferred_step = self.num_steps
                else:
                    due.append(item)
            later = due
        budget = config.max_decode_frames
        taken = []
        for i, (_, request, size) in enumerate(later):
            if budget is not None and i > 0 and size > budget:
                break  # strictly oldest first: a short chunk never overtakes a waiting long one
            taken.append((request, size))
            request.chunk_ready_step = None
            request.num_deferred = 0
            if budget is not None:
                budget -= size
        return first, taken  # first chunks go out first

    def _decode_due(self) -> Iterator[StepEvent]:
        """The chunks due now through code2wav (`_due_chunks`), in up to three calls: the first chunks; the later
        chunks of streamed requests whose listeners hold less than two steps of audio (a newcomer's, in its first
        steps, or a listener about to run dry); the other later chunks (a request not streamed has no listener
        until its whole audio is decoded: its one long decoding goes last). A newcomer's next chunks so come at
        the point of the step its first chunk came at: behind a call of the others' chunks each would come that
        much later, and its listener, who holds one frame at first, would lose that much lead at once; and a
        listener about to run dry waits for no audio that is not due yet. Where both are due, the first chunks
        and those listeners' chunks share one call: a newcomer who starts while another is in its first steps
        then sits in the same call in its first step as in its next ones (its first audio comes that call's
        other chunks later), where a call of its own first would put its next chunk a call's fixed cost and the
        other's chunk further from its first than in its first step."""
        first, later = self._due_chunks()
        now = self.clock()
        urgent, rest = [], []
        for request, size in later:
            is_urgent = request.is_streamed and (request.playback.lead(now) or 0.0) < 2 * self.step_s
            (urgent if is_urgent else rest).append((request, size))
        if first and urgent:  # one call: a newcomer's first chunk beside the chunks of listeners in their first steps
            first, urgent = [], first + urgent
        yield from self._decode_blocks(first, is_first=True)
        yield from self._decode_blocks(urgent)
        yield from self._decode_blocks(rest)

    def _may_wait(self, request: Request, size: int, now: float, has_newcomers: bool) -> bool:
        """Whether a due later chunk of `size` frames may wait a step (has_newcomers: a request queues for a free
        slot): while decoding it now would hold back someone who cannot wait — a newcomer (queued, or running
        without its first audio yet) or a listener who holds less than two steps and that decoding (it would stall
        behind audio not yet due) — and only when its own listener is so far ahead that it can wait until their
        lead has grown past the decoding: two steps and the decoding, plus the decoding ÷ (1 − the playout rate),
        how long a listener's lead takes to gain that much. Else the chunk goes now, and a newcomer's first audio
        comes that much later, where a started player would have stalled."""
        lead = request.playback.lead(now)
        decode_s = size * self.decode_frame_s
        growth = 1 - (self.config.playout_rtf or _PLAYOUT_RTF)
        if lead is None or lead < 2 * self.step_s + decode_s + decode_s / growth:
            return False
        if has_newcomers:
            return True
        for other in self.running.values():
            if other is request or other.is_parked or not other.has_speech:
                continue
            if other.talker_finish_reason is not None and other.num_decoded == len(other.frames):
                continue  # all its audio is out
            other_lead = other.playback.lead(now)
            if other_lead is None or other_lead < 2 * self.step_s + decode_s:
                return True
        return False

    def _chunk_size(self, request: Request) -> int:
        """The frames of a streamed request's next later chunk."""
        return chunk_frames_after(request.num_decoded, self.config.chunk_frames, self.config.playout_rtf)

    def _first_chunk_size(self, request: Request) -> int:
        """The frames of a streamed request's first chunk once it is due (first_chunk_frames, or fewer when its
        talker ended sooner), else 0."""
        pending = len(request.frames) - request.num_decoded
        if not request.is_streamed or request.num_decoded > 0 or pending == 0:
            return 0
        target = self.config.first_chunk_frames
        return min(pending, target) if pending >= target or request.talker_finish_reason is not None else 0

    def _decode_blocks(self, ready: list[tuple[Request, int]], is_first: bool = False) -> list[StepEvent]:
        """The next n frames of each request through code2wav in one batch (is_first: their first chunks)."""
        if not ready:
            return []
        blocks = [torch.stack(r.frames[r.num_decoded : r.num_decoded + n], dim=1) for r, n in ready]  # [G, n] each
        is_final = [r.talker_finish_reason is not None and r.num_decoded + n == len(r.frames) for r, n in ready]
        started = self.clock()
        chunks = self.family.decode_audio([r.codec_stream for r, _ in ready], blocks, is_final)
        now = self.clock()
        decoded = getattr(self.observer, "decoded", None)  # (an observer may leave it out)
        if decoded is not None:
            decoded([n for _, n in ready], now - started, is_first)
        frame_s = (now - started) / sum(n for _, n in ready)
        self.decode_frame_s = frame_s if self.decode_frame_s == 0 else 0.8 * self.decode_frame_s + 0.2 * frame_s
        events = []
        for (request, n), audio in zip(ready, chunks, strict=True):
            request.num_decoded += n
            if audio.size == 0:  # a codec that looks ahead holds this block's samples back
                continue
            request.audio.append(audio)
            request.playback.push(now, audio.size / self.family.sample_rate)
            if request.first_audio_at is None:
                request.first_audio_at = now
                self._stage("code2wav", now - request.first_frame_at)
            events.append(StepEvent(request, self.num_steps, audio=audio))
        return events

    # --- retire ---

    def _retire(self) -> list[StepEvent]:
        done = [request for request in self.running.values() if request.is_complete]
        if not done:
            return []
        now = self.clock()
        with self.lock:
            for request in done:
                del self.running[request.request_id]
        for request in done:
            request.status, request.finished_at = Status.FINISHED, now
        return [StepEvent(request, self.num_steps, is_finished=True) for request in done]

    # --- park ---

    def _park(self) -> None:
        """Running requests that can do nothing until more of their text comes give up their slot; their talker
        state (if their talker started) waits outside the talker batch until `_admit` resumes them."""
        now = self.clock()
        with self.lock:
            parked = [r for r in self.running.values() if not r.is_parked and self._waits_for_text(r)]
            for request in parked:
                request.is_parked, request.waits_for_text_since = True, now
        for request in parked:
            if request.is_in_talker:
                request.parked_talker = self.talker.park(request.request_id)
                request.is_in_talker = False

    # --- observation ---

    def _stage(self, stage: str, seconds: float) -> None:
        if self.observer is not None:
            self.observer.stage(stage, seconds)

    def _phase(self, phase: str, started: float) -> float:
        now = self.clock()
        if self.observer is not None:
            self.observer.phase(phase, now - started)
        return now


def _talker_finish_reason(request: Request) -> str:
    reasons = request.segment_finish_reasons
    return "length" if "length" in reasons else reasons[-1]


def _can_speak(request: Request) -> bool:
    """Whether a chat request waits for no more thinker rows before its first frame: its talker prefill
    and one reply row are here (or its reply is over, it has nothing to say, or it is not streamed)."""
    if not request.has_speech or not request.is_streamed or not request.is_thinking:
        return True
    if request.talker_finish_reason is not None:
        return True
    pending = request.talker_inputs
    if pending is None:
        return request.is_in_talker
    return pending.is_text_finished or sum(block.shape[0] for block in pending.trailing_text) > 0
