"""Speech that keeps real time under load: the listener's playback clock, chunks sized for it, admission by measured
capacity (queued streams start when capacity frees, refused ones get 429 + Retry-After), and none of it changes a
seeded request's bytes."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import numpy as np
import pytest
import torch
from audio_checks import assert_audible
from server_harness import running_server
from test_server_realtime import _client

from omnimtp.engine.core import EngineConfig, EngineCore
from omnimtp.engine.playback import PlaybackClock, chunk_frames_after
from omnimtp.engine.request import Request
from omnimtp.families.qwen3_tts import Qwen3TTSFamily
from omnimtp.sampling import SamplingParams
from omnimtp.server.admission import Admission, StepCosts
from omnimtp.server.audio import to_pcm16
from omnimtp.server.requests import EngineRequest, QueueFullError
from omnimtp.server.scheduler import Engine
from omnimtp.server.simulated import (
    MachineCosts,
    SimulatedClock,
    StepObserver,
    calibrated_admission,
    simulate,
    speech_request,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

FRAME_S = 0.08  # Qwen3-TTS's 12 Hz codec: 1920 samples at 24 kHz
TEXTS = ["Hello there, how are you?", "Say a few words.", "Another one to speak", "Short.", "The fifth text",
         "Number six here", "Seven is a lucky number", "Eight and done"]


class LinearCosts(StepCosts):
    """A step cost model: fixed + per_stream · n seconds, whatever the engine measures."""

    def __init__(self, fixed: float, per_stream: float):
        super().__init__()
        self.fixed, self.per_stream = fixed, per_stream

    def observe(self, num_streams: int, seconds: float) -> None:
        pass

    def measured(self, min_samples: int = 1) -> dict[int, float]:
        return {1: self.predict(1)}

    def predict(self, num_streams: int) -> float:
        return self.fixed + self.per_stream * num_streams


@pytest.fixture(scope="module")
def family():
    return Qwen3TTSFamily.tiny(0)


# --- the pure pieces ---------------------------------------------------------------------------------------


def test_playback_clock_counts_stalls_from_the_first_audio():
    clock = PlaybackClock()
    assert clock.lead(5.0) is None and clock.continuity == 1.0
    assert clock.push(10.0, 0.08) == 0.0  # the player starts here, whenever that is
    assert clock.push(10.05, 0.08) == 0.0 and clock.lead(10.05) == pytest.approx(0.11)
    assert clock.push(10.30, 0.08) == pytest.approx(0.14)  # the audio ran out at 10.16
    assert (clock.num_underruns, clock.stalled_s) == (1, pytest.approx(0.14))
    assert clock.continuity == pytest.approx(0.24 / 0.38)
    assert clock.lead(10.40) == pytest.approx(-0.02)  # stalled again, 20 ms so far
    jitter = PlaybackClock(min_stall_s=0.005)
    jitter.push(0.0, 0.08)
    assert jitter.push(0.083, 0.08) == 0.0 and jitter.num_underruns == 0
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="seconds"):
            clock.push(11.0, bad)


def test_a_step_cost_counts_the_chunk_decoding_of_the_few_steps_that_decode():
    """One step in four decodes a chunk (chunks of four frames): the cost of a step is their mean, 60 ms, so two
    such streams (120 ms a step) would not keep real time; the typical step alone (30 ms) would say they do."""
    costs = StepCosts()
    for _ in range(4):
        for seconds in (0.030, 0.030, 0.030, 0.150):
            costs.observe(1, seconds)
    assert costs.measured()[1] == pytest.approx(0.060)
    assert Admission(costs, max_streams=4).capacity(frame_s=FRAME_S) == 1


def test_a_step_is_costed_as_measured_and_as_one_in_which_every_stream_decodes_a_one_frame_chunk():
    """Two streams' steps: their first eight each decode both streams' one-frame chunks in one codec call (50 ms of
    a 90 ms step), later ones mostly decode nothing (40 ms) and one in four a four-frame chunk each (100 ms). Their
    mean step, 64 ms, fits 0.9 of an 80 ms frame, yet the first eight ran over it and the listeners, who then hold
    one frame, stalled. Costed as a step of one-frame chunks (less its own later chunks' calls, plus the measured
    call of two one-frame chunks), every step costs 90 ms, and two streams do not fit. The other way round, steps
    whose later chunks cost more than one-frame ones (a chat's, with newcomers all the time) count as they came."""
    admission = Admission(max_streams=4)
    steps = [(0.090, [1, 1], 0.050)] * 8 + ([(0.040, None, 0.0)] * 3 + [(0.100, [4, 4], 0.060)]) * 6
    for seconds, chunk_frames, decode_s in steps:
        if chunk_frames is not None:
            admission.observe_decode(chunk_frames, decode_s)
        admission.observe_step(2, seconds, decode_s)
    assert admission.costs.measured()[2] == pytest.approx(0.06375)  # the mean fits: 0.9 · 0.080 = 0.072
    assert admission.decode_costs.measured() == {2: pytest.approx(0.050)}  # the four-frame calls are not one-frame
    assert admission.first_steps.measured()[2] == pytest.approx(0.090)
    assert admission.step_cost(2) == pytest.approx(0.090) and admission.capacity(frame_s=FRAME_S) == 1
    busy = Admission(max_streams=4)  # one-frame calls cheap, the steps' other calls dear: the mean rules
    busy.observe_decode([1, 1], 0.010)
    for _ in range(4):
        busy.observe_step(2, 0.080, 0.050)
    assert busy.first_steps.measured()[2] == pytest.approx(0.040) and busy.step_cost(2) == pytest.approx(0.080)
    assert busy.capacity(frame_s=FRAME_S) == 1
    fresh = Admission(max_streams=4)  # no one-frame call measured yet: the step as it was
    fresh.observe_decode([1, 1, 1], 0.020, is_first=True)  # newcomers' first chunks: a cost of their start
    fresh.observe_step(1, 0.030, 0.010)
    assert fresh.step_cost(1) == pytest.approx(0.030) and fresh.decode_costs.measured() == {}
    assert fresh.first_steps.measured() == {}


def test_sizes_measured_at_start_give_the_shape_and_serving_the_scale():
    """Start measures 1, 2, 3 streams at 20, 30, 40 ms a step (warm-up replies: nobody reads their audio); served,
    one stream costs 50 ms (its client's events share the machine): the sizes not served yet are taken at 2.5 times
    what start measured, not at start's figures, and the server keeps to one stream until it measures more."""
    admission = Admission(max_streams=8)
    for n, seconds in ((1, 0.020), (2, 0.030), (3, 0.040)):
        for _ in range(3):
            admission.costs.observe(n, seconds)
    admission.decode_costs.observe(1, 0.010)
    admission.seed_measured()
    assert admission.capacity(frame_s=FRAME_S) == 5  # 4: the trend's 50 ms; 5: 67 ms in proportion; 6: 80 ms
    assert admission.decode_costs.measured() == {1: pytest.approx(0.010)}
    admission.costs.observe(1, 0.050)
    assert admission.costs.measured() == pytest.approx({1: 0.050, 2: 0.075, 3: 0.100})
    assert admission.capacity(frame_s=FRAME_S) == 1


def test_capacity_is_what_measured_steps_keep_in_real_time():
    costs = StepCosts()
    admission = Admission(costs, max_streams=16)
    assert admission.capacity() == 1  # nothing measured: one stream at a time
    costs.observe(1, 0.030)
    assert costs.predict(2) == pytest.approx(0.060)  # in proportion: never kinder than measured
    assert admission.capacity() == 2
    for seconds in (0.050, 0.040, 0.045):
        costs.observe(2, seconds)
    assert costs.measured()[2] == pytest.approx(0.045)  # the mean
    assert admission.capacity() == 3  # 3 would cost 0.0675 ≤ 0.9 · 0.080, 4 0.090
    costs.observe(3, 0.080)  # measured: more than it was estimated
    assert admission.capacity() == 2
    assert admission.capacity(frame_s=0.04) == 1
    assert admission.retry_after_s(5) == 1  # before any stream ended
    admission.observe_stream(4.0)
    assert admission.retry_after_s(5) == 12  # 6 streams, 2 at a time, 4 s each
    with pytest.raises(ValueError, match="max_streams"):
        Admission(max_streams=0)
    with pytest.raises(ValueError, match="headroom"):
        Admission(max_streams=4, headroom=1.5)
    with pytest.raises(ValueError, match="playout_rtf"):
        EngineConfig(playout_rtf=1.5)


def _settled_capacity(step_s, max_streams: int = 8, costs: StepCosts | None = None, num_steps: int = 200) -> int:
    """A server with more streams to play than it can: each step runs as many streams as admission lets it, and its
    cost (step_s(n) seconds) is what the engine measures; the capacity it settles at."""
    admission = Admission(costs or StepCosts(), max_streams=max_streams)
    for _ in range(num_steps):
        num_streams = admission.capacity(frame_s=FRAME_S)
        admission.costs.observe(num_streams, step_s(num_streams))
    return admission.capacity(frame_s=FRAME_S)


def test_capacity_reaches_the_streams_a_steps_fixed_part_leaves_room_for():
    """Steps of 20 ms + 15 ms a stream (Qwen3-TTS 0.6B w4a8 with the bf16 decoder at batch 1 and 8 has about this
    shape): three streams cost 65 ms, within 0.9 of an 80 ms frame, four 80 ms. Estimated in proportion, three
    would cost 1.5 times two's 50 ms, 75 ms: the server would play two and never measure three. A cost that grows
    faster than its trend (30, 50, then 75 ms) is tried one stream past what fits, once, and given up."""
    assert _settled_capacity(lambda n: 0.020 + 0.015 * n) == 3
    costs = StepCosts()
    for n, seconds in ((1, 0.035), (2, 0.050)):
        costs.observe(n, seconds)
    assert costs.predict(3) == pytest.approx(0.065) and costs.predict(4) == pytest.approx(0.100)
    convex = {1: 0.030, 2: 0.050, 3: 0.075, 4: 0.110}
    tried = []
    assert _settled_capacity(lambda n: tried.append(n) or convex[n]) == 2
    assert tried.count(3) == 1 and 4 not in tried
    falling = StepCosts()  # a noisy trend that falls is no trend: in proportion
    for n, seconds in ((1, 0.040), (2, 0.038)):
        falling.observe(n, seconds)
    assert falling.predict(3) == pytest.approx(0.057)


def test_kept_step_costs_are_scaled_by_what_this_start_measures_again():
    """Costs kept by a start that ran during a slow spell (all twice what they are): once this start measures one
    stream at its real 35 ms, the kept sizes it has not run again are halved, and it opens up to the three streams
    the machine keeps in real time. Kept unscaled, two streams' kept 100 ms would hold it at one stream for good
    (it never runs two, so never measures them again). Kept from a quick spell, they are scaled up alike."""
    slow = {1: 0.070, 2: 0.100, 3: 0.130, 4: 0.160}
    costs = StepCosts()
    costs.seed(slow)
    assert costs.measured() == slow and Admission(costs, max_streams=8).capacity(frame_s=FRAME_S) == 1
    costs.observe(1, 0.035)
    assert costs.measured() == pytest.approx({1: 0.035, 2: 0.050, 3: 0.065, 4: 0.080})
    seeded = StepCosts()
    seeded.seed(slow)
    assert _settled_capacity(lambda n: 0.020 + 0.015 * n, costs=seeded) == 3
    quick = StepCosts()
    quick.seed({1: 0.020, 2: 0.030, 3: 0.040})
    assert _settled_capacity(lambda n: 0.030 + 0.025 * n, costs=quick) == 1  # 2 streams: 80 ms
    assert quick.measured(min_samples=3) == {1: pytest.approx(0.055)}  # only what this start measured is kept


@pytest.mark.parametrize("rtf", [0.5, 0.9, 0.97])
def test_chunks_sized_for_the_listener_never_let_it_run_dry(rtf):
    """Frames made at `rtf` of their audio each, every chunk sent the moment its last frame is made: with
    `chunk_frames_after`'s sizes a listener who plays from the first frame never waits; with fixed 25-frame
    chunks (or sizes one frame longer) it does."""

    def stalls(sizes) -> float:
        clock, made = PlaybackClock(min_stall_s=1e-9), 0
        for size in sizes:
            made += size
            clock.push(made * rtf, size)
        return clock.stalled_s

    def schedule(size_of, num_frames=1000):
        sizes, done = [1], 1
        while done < num_frames:
            sizes.append(min(size_of(done), num_frames - done))
            done += sizes[-1]
        return sizes

    playout = schedule(lambda done: chunk_frames_after(done, 25, rtf))
    assert max(playout) == 25 and stalls(playout) == 0
    assert stalls(schedule(lambda done: 25)) > 0
    assert stalls(schedule(lambda done: chunk_frames_after(done, 25, rtf) + 1)) > 0
    assert chunk_frames_after(3, 25, None) == 25


# --- the engine, on a simulated clock -----------------------------------------------------------------------


def _speech_request(family, index: int, max_frames: int) -> Request:
    return speech_request(family, index, TEXTS[index % len(TEXTS)], max_frames)


def _simulate(family, admission: Admission | None, costs: LinearCosts, num_streams: int = 6, max_frames: int = 30,
              playout_rtf: float | None = 0.9) -> tuple[dict, dict]:
    """`num_streams` speech requests arrive at once; each step takes costs.predict(streams it made frames for) on a
    simulated clock, and every audio chunk reaches its listener at the end of its step. Admission (when given) sets
    the streams that may speak before every step, as the server's loop does. → ({id: its clock}, {id: its PCM16})."""
    frames_made = StepObserver()
    core = EngineCore(family, EngineConfig(max_batch_size=8, max_frames=max_frames, chunk_frames=25,
                                           playout_rtf=playout_rtf, max_defer_steps=0), observer=frames_made)
    for index in range(num_streams):
        core.add(_speech_request(family, index, max_frames))
    clocks = {index: PlaybackClock() for index in range(num_streams)}
    pcm = {index: [] for index in range(num_streams)}
    now = 0.0
    while core.has_work():
        if admission is not None:
            core.max_speaking = admission.capacity(FRAME_S)
        frames_made.num_streams = 0
        events = list(core.step())
        if admission is not None:
            assert frames_made.num_streams <= core.max_speaking
        now += costs.predict(max(frames_made.num_streams, 1))
        for event in events:
            if event.audio is not None:
                clocks[event.request.request_id].push(now, event.audio.size / family.sample_rate)
                pcm[event.request.request_id].append(to_pcm16(event.audio).tobytes())
    return clocks, {index: b"".join(chunks) for index, chunks in pcm.items()}


def test_admitted_streams_never_run_dry_in_a_simulated_overload(family):
    """Six streams at once where a step of n streams costs 10 + 20·n ms (three keep real time at 80 ms a frame):
    admitted by capacity, each plays from its first chunk without a stall, the later ones after waiting; all six
    at once, every one stalls. Either way each stream's PCM is the one it gets alone."""
    costs = LinearCosts(0.010, 0.020)
    admission = Admission(costs, max_streams=8)
    assert admission.capacity(FRAME_S) == 3
    admitted, admitted_pcm = _simulate(family, admission, costs)
    crowded, crowded_pcm = _simulate(family, None, costs)
    for index, clock in admitted.items():
        assert clock.audio_s > 1.0, index
        assert clock.num_underruns == 0, f"stream {index} stalled {clock.stalled_s:.3f} s"
    assert all(clock.num_underruns > 0 for clock in crowded.values())
    waited = sorted(clock.started_at for clock in admitted.values())
    assert waited[3] > waited[2] + 1.0, "the fourth stream waited for capacity"
    for index in (0, 4):
        pcm = _alone_pcm(family, index)
        assert_audible(np.frombuffer(pcm, dtype=np.int16))
        assert admitted_pcm[index] == pcm == crowded_pcm[index]


# A simulated machine of the bf16 Qwen3-TTS 0.6B's shape: a talker step 20 ms + 2 ms a stream, a codec call 10 ms +
# 14 ms a chunk + 1 ms a frame.
ARRIVALS_MACHINE = MachineCosts(step_s=0.020, step_stream_s=0.002, decode_fixed_s=0.010, decode_chunk_s=0.014,
                                decode_frame_s=0.001)


def _simulate_arrivals(family, admission: Admission, arrivals: list[float], max_frames: int = 30):
    """Speech requests arriving at `arrivals` (simulated seconds) to a core configured as the server's (`Engine`:
    playout_rtf 0.9, chunks waiting up to 8 steps for a newcomer) on ARRIVALS_MACHINE. Admission learns the step
    and call costs as the server's loop does and sets the streams that may speak before every step. → ({id: its
    listener's clock}, the most streams a step made frames for)."""
    config = EngineConfig(max_batch_size=8, max_frames=max_frames, chunk_frames=25, playout_rtf=0.9,
                          max_defer_steps=8, max_decode_frames=32)
    result = simulate(family, config, ARRIVALS_MACHINE, lambda index: _speech_request(family, index, max_frames),
                      arrivals=arrivals, admission=admission)
    return {index: request.playback for index, request in result.requests.items()}, result.most_streams


def test_a_newcomers_next_chunks_keep_the_place_of_its_first_in_the_step(family):
    """Eight streams arriving 0.25 s apart on the simulated machine, admitted by capacity (two at a time). A
    newcomer's first chunk is decoded in a call of its own at the start of the step's decoding, and its listener
    then holds one frame (80 ms); its next chunks are decoded in a call before the other listeners' chunks, so
    they come at the same point of each step and the listener never runs dry. Decoded after the others' chunks
    (one call of every later chunk), each came that much later than its first, and one listener stalled."""
    admission = calibrated_admission(ARRIVALS_MACHINE, max_streams=8)  # as a server's start leaves it
    clocks, most = _simulate_arrivals(family, admission, [0.25 * i for i in range(8)])
    assert most == 2
    for index, clock in clocks.items():
        assert clock.audio_s > 0, index
        assert clock.num_underruns == 0, f"stream {index} stalled {clock.stalled_s:.3f} s"


# The Qwen3-TTS 0.6B w4a8 with its bf16 codec on a 2-core AVX512_BF16 host of ~900 GFLOP/s bf16: half the costs
# `benchmarks/admission_bound.py` measured on a host of ~420 (a talker and code predictor step 20 ms + 1.5 ms a
# stream, a codec call 5 ms + 11 ms a chunk + 8.75 ms a frame), within ~15 % of the faster host's own batch-1 figures
# (a step 24 ms, the decoder 11 ms a frame).
MEASURED_MACHINE = MachineCosts(step_s=0.020, step_stream_s=0.0015, decode_fixed_s=0.005, decode_chunk_s=0.011,
                                decode_frame_s=0.00875)


def test_a_second_newcomers_first_chunk_shares_the_call_of_the_firsts_next_chunk(family):
    """Two streams 30 ms apart on MEASURED_MACHINE: the second starts in the first's second step, and its first
    chunk is decoded in one call with the first's next chunk, so the call it sits in in each of its first steps is
    alike and its listener never runs dry. In a call of its own before that one (a call's fixed cost and the
    other's chunk later), its next chunk came 92 ms after its first, past the 80 ms it held."""
    config = EngineConfig(max_batch_size=4, max_frames=30, chunk_frames=25, playout_rtf=0.9, max_defer_steps=8,
                          max_decode_frames=16)
    result = simulate(family, config, MEASURED_MACHINE, lambda index: _speech_request(family, index, 30),
                      arrivals=[0.0, 0.03], max_speaking=2)
    assert result.most_streams == 2
    for index, request in result.requests.items():
        assert request.playback.audio_s > 0, index
        assert request.playback.num_underruns == 0, f"stream {index} stalled {request.playback.stalled_s:.3f} s"


def test_a_queued_stream_starts_once_the_last_chunks_before_it_are_decoded(family):
    """One stream at a time on a machine where one stream's first steps take 0.9 of a frame (a host of half
    MEASURED_MACHINE's compute, as `benchmarks/admission_bound.py` measured one), three streams sent at once: each
    queued one starts once the one before has had its last chunks decoded, not when its talker ends, so those
    chunks do not fall in its first steps and its listener never runs dry (started at the talker's end, the third
    stalled)."""
    machine = MachineCosts(step_s=0.0273, step_stream_s=0.0049, decode_fixed_s=0.011, decode_chunk_s=0.0094,
                           decode_frame_s=0.019)
    config = EngineConfig(max_batch_size=4, max_frames=60, chunk_frames=25, playout_rtf=0.9, max_defer_steps=8,
                          max_decode_frames=16)
    result = simulate(family, config, machine, lambda index: _speech_request(family, index, 60),
                      arrivals=[0.0, 0.0, 0.0], max_speaking=1)
    first_audio = [result.requests[index].playback.started_at for index in range(3)]
    assert first_audio[0] + 0.5 < first_audio[1] < first_audio[2] - 0.5, "each waited for the one before"
    for index, request in result.requests.items():
        assert request.playback.audio_s > 0, index
        assert request.playback.num_underruns == 0, f"stream {index} stalled {request.playback.stalled_s:.3f} s"


def test_admission_plays_as_much_audio_as_the_most_streams_that_keep_real_time(family):
    """Four closed-loop clients on MEASURED_MACHINE: admission by capacity delivers as much audio a second as the
    best fixed number of streams whose listeners never stall (two), with none stalling; three at a time stall."""
    max_frames = 60
    config = EngineConfig(max_batch_size=4, max_frames=max_frames, chunk_frames=25, playout_rtf=0.9,
                          max_defer_steps=8, max_decode_frames=16)

    def run(**kwargs):
        return simulate(family, config, MEASURED_MACHINE, lambda index: _speech_request(family, index, max_frames),
                        clients=4, duration_s=8.0, **kwargs)

    admitted = run(admission=calibrated_admission(MEASURED_MACHINE, max_streams=4))
    caps = {cap: run(max_speaking=cap) for cap in (2, 3)}
    assert caps[3].min_continuity < 0.99, "three streams keep real time on this machine: the bound is not two"
    assert caps[2].min_continuity >= 0.99 and caps[2].num_underruns == 0
    assert admitted.num_underruns == 0, f"admitted streams stalled {admitted.stalled_s:.3f} s"
    assert admitted.audio_per_s >= 0.95 * caps[2].audio_per_s, (admitted.audio_per_s, caps[2].audio_per_s)


def _alone_pcm(family, index: int) -> bytes:
    core = EngineCore(family, EngineConfig(max_batch_size=1, max_frames=30, chunk_frames=25, playout_rtf=0.9))
    core.add(_speech_request(family, index, 30))
    chunks = []
    while core.has_work():
        chunks += [to_pcm16(event.audio).tobytes() for event in core.step() if event.audio is not None]
    return b"".join(chunks)


# --- the server ------------------------------------------------------------------------------------------


def _engine(family, costs: StepCosts | None = None, **config) -> Engine:
    engine = Engine(family, model_id="tiny-tts", max_frames=config.pop("max_frames", 40), max_batch_size=4,
                    admission=True, **config)
    if costs is not None:
        engine.admission = Admission(costs, max_streams=4)
    return engine


def _speech(engine: Engine, index: int) -> EngineRequest:
    return EngineRequest(messages=None, speak_text=TEXTS[index], speaker=engine.speech_voice("aiden", "auto", None),
                         sampling=SamplingParams(temperature=0.9, top_k=50), seed=100 + index, max_new_tokens=0)


async def _pcm(handle) -> tuple[bytes, list[int]]:
    pcm, steps = [], []
    async for event in handle.events():
        assert event.error is None, event.error
        if event.audio is not None:
            pcm.append(to_pcm16(event.audio).tobytes())
            steps.append(event.step)
    return b"".join(pcm), steps


def test_a_queued_stream_starts_when_capacity_frees_and_a_full_queue_refuses(family):
    """Capacity 1 (a step of two streams would cost 96 ms of an 80 ms frame), --max-queue 2, three streams before
    the engine's next step: the first starts, the second waits (queue position 1) and starts once the first has
    finished speaking, the third is refused with a Retry-After; the queued one's PCM is the one it gets alone."""
    engine = _engine(family, LinearCosts(0.0, 0.048))

    async def scenario():
        engine.start(max_queue=2)
        try:
            loop = asyncio.get_running_loop()
            with engine._cond:  # all three come before the engine's next step
                first = engine.submit(_speech(engine, 0), loop=loop)
                second = engine.submit(_speech(engine, 1), loop=loop)
                with pytest.raises(QueueFullError) as refused:
                    engine.submit(_speech(engine, 2), loop=loop)
                assert (engine.queue_position(first), engine.queue_position(second)) == (0, 1)
            results = await asyncio.gather(_pcm(first), _pcm(second))
            assert engine.queue_position(second) is None  # it ran
            return first, second, refused.value, results
        finally:
            await asyncio.to_thread(engine.shutdown)

    first, second, refused, ((_, first_steps), (second_pcm, _)) = asyncio.run(scenario())
    assert (first.queue_position, second.queue_position) == (0, 1)
    assert refused.retry_after_s >= 1 and "retry" in str(refused)
    # the first's talker ends in the step of its last chunk, or up to max_defer_steps before it
    assert second.admitted_step >= first_steps[-1] - engine.config.max_defer_steps > first_steps[0], (
        "the second stream started while the first was speaking")
    alone = _engine(family)

    async def by_itself():
        alone.start()
        try:
            return await _pcm(alone.submit(_speech(alone, 1), loop=asyncio.get_running_loop()))
        finally:
            await asyncio.to_thread(alone.shutdown)

    alone_pcm, _ = asyncio.run(by_itself())
    assert_audible(np.frombuffer(alone_pcm, dtype=np.int16))
    assert second_pcm == alone_pcm


def test_a_refused_stream_gets_429_with_retry_after_and_metrics_show_the_streams(family):
    """Over HTTP: while one long stream plays and one waits (capacity 1, --max-queue 1), a third request gets 429
    `queue_full` with a Retry-After; the queued one's response says its queue position; /metrics has the capacity,
    the queue, the underruns counter and the lead of the stream that plays."""
    from omnimtp.server.app import create_app

    engine = _engine(family, LinearCosts(0.0, 0.048), max_frames=400)
    app = create_app(engine, max_queue=1)
    body = {"model": "tiny-tts", "voice": "aiden", "response_format": "pcm", "seed": 1}

    async def scenario(url: str):
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            async with client.stream("POST", "/v1/audio/speech", json={**body, "input": TEXTS[0]}) as playing:
                assert playing.status_code == 200 and playing.headers["x-queue-position"] == "0"
                reader = playing.aiter_bytes()
                await reader.__anext__()
                waiting = asyncio.ensure_future(client.post("/v1/audio/speech", json={**body, "input": TEXTS[1]}))
                while engine._core.num_queued() == 0:
                    await asyncio.sleep(0.005)
                refused = await client.post("/v1/audio/speech", json={**body, "input": TEXTS[2]})
                metrics = (await client.get("/metrics")).text
                async for _ in reader:
                    pass
            return refused, await waiting, metrics

    with running_server(app) as url:
        refused, waited, metrics = asyncio.run(scenario(url))
    assert refused.status_code == 429 and int(refused.headers["retry-after"]) >= 1
    assert refused.json()["error"]["code"] == "queue_full"
    assert waited.status_code == 200 and waited.headers["x-queue-position"] == "1" and waited.content
    assert "omnimtp_realtime_capacity_streams 1.0" in metrics
    assert "omnimtp_queue_depth 1.0" in metrics
    assert "omnimtp_stream_underruns_total" in metrics
    assert 'omnimtp_stream_lead_seconds{stream="0"}' in metrics


# --- a newcomer's first chunk ---------------------------------------------------------------------------------


def test_a_newcomers_first_chunk_goes_first_and_a_listener_about_to_run_dry_is_not_held(family):
    """A newcomer arrives during the step before the one whose frames complete a running stream's later chunk. It
    is admitted at that next step and its first chunk goes out first; the running stream's listener, about to run
    dry, gets its chunk in that step all the same (a chunk waits only for a listener far ahead: the simulated
    tests below)."""
    engine_config = EngineConfig(max_batch_size=4, max_frames=12, first_chunk_frames=1, chunk_frames=4,
                                 max_defer_steps=2)

    class Arrival(StepObserver):
        def talker_batch(self, size: int) -> None:  # mid-step, after the talker's frames
            running = core.running.get(0)
            if not arrived and running is not None and (
                    len(running.frames) - running.num_decoded >= engine_config.chunk_frames - 1):
                running.playback.ends_at = time.perf_counter()
                core.add(newcomer)
                arrived.append(core.num_steps)

    newcomer, arrived = _speech_request(family, 1, 12), []
    core = EngineCore(family, engine_config, observer=Arrival())
    core.add(_speech_request(family, 0, 12))
    audio = []  # (step, request id) of each chunk, in the order they went out
    while core.has_work():
        audio += [(event.step, event.request.request_id) for event in core.step() if event.audio is not None]
    due = arrived[0] + 1
    newcomer_first = next(item for item in audio if item[1] == 1)
    assert newcomer_first[0] == due, "the newcomer's first chunk came in the step after it arrived"
    assert audio.index(newcomer_first) < audio.index((due, 0))


def test_a_chat_newcomer_starts_before_the_running_cohorts_think():
    """A chat with audio that comes between steps while a text-only chat is thinking: in the next step its own
    thinker steps come before the running cohort's step, which it does not wait for; each request's tokens are
    the ones it gets alone."""
    from test_media_input import _user_turn

    from omnimtp.families.qwen3_omni import Qwen3OmniFamily

    omni = Qwen3OmniFamily.tiny(0)
    config = EngineConfig(max_batch_size=4, max_frames=6)
    thinker_steps = []  # (engine step, request id of the cohort's first request), in the order they ran
    new_thinker = omni.new_thinker

    def logged_thinker(prompts, *args, **kwargs):
        run = new_thinker(prompts, *args, **kwargs)
        step = run.step
        request_id = 0 if len(prompts[0]) == len(first_prompt) else 1

        def logged_step(*step_args, **step_kwargs):
            thinker_steps.append((core.num_steps, request_id))
            return step(*step_args, **step_kwargs)

        run.step = logged_step
        return run

    omni.new_thinker = logged_thinker
    first_prompt, second_prompt = _user_turn([], b"Tell me a long story"), _user_turn([], b"Hi")

    def requests():
        return (Request(0, list(first_prompt), max_new_tokens=12, max_frames=6, seed=1),
                Request(1, list(second_prompt), max_new_tokens=4, max_frames=6, seed=2, speaker=omni.default_speaker))

    def run_all(core, added_later=None):
        for _ in range(3 if added_later is not None else 0):
            list(core.step())
        if added_later is not None:
            core.add(added_later)
        while core.has_work():
            list(core.step())

    core = EngineCore(omni, config)
    together = requests()
    core.add(together[0])
    run_all(core, together[1])
    step = next(step for step, request_id in thinker_steps if request_id == 1)
    in_step = [request_id for s, request_id in thinker_steps if s == step]
    assert in_step[0] == 1 and 0 in in_step, f"the newcomer waited for the running cohort's step: {in_step}"
    for request in requests():
        core = EngineCore(omni, config)
        core.add(request)
        run_all(core)
        assert request.output_ids == together[request.request_id].output_ids, request.request_id


def test_serve_admits_by_capacity_unless_told_off():
    """`omnimtp serve` admits by capacity (chunks sized for the listener); `--admission off` turns both off."""
    from omnimtp.cli import build_parser
    from omnimtp.server.build import build_app

    parser = build_parser()
    engine, _ = build_app(parser.parse_args(["serve", "--eager", "--max-frames", "2"]))
    assert engine.admission is not None and engine.config.playout_rtf == 0.9
    engine, _ = build_app(parser.parse_args(["serve", "--eager", "--max-frames", "2", "--admission", "off"]))
    assert engine.admission is None and engine.config.playout_rtf is None
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--admission", "sometimes"])


def test_a_parked_stream_holds_no_capacity_and_resumes_within_it(family):
    """Capacity 1 (`max_speaking`): a streamed text's request that spoke all its text so far is parked and another
    stream runs meanwhile; text that comes while that one speaks waits until its talker has ended, then the
    parked one resumes and speaks the whole text as it would alone."""
    config = EngineConfig(max_batch_size=4, max_frames=28)
    voice = family.voice("aiden", "english")
    core = EngineCore(family, config)
    core.max_speaking = 1
    streamed = Request(0, [], max_new_tokens=1, max_frames=28, speaker=voice, is_chat=False, is_text_finished=False)
    core.add(streamed)
    text_ids = family.speech_text_ids()
    core.push_speech_ids(0, text_ids.push("Hello there "), is_finished=False)
    while core.has_ready_work():
        list(core.step())
    assert streamed.is_parked and streamed.frames
    other = Request(1, family.speech_ids("Another text"), max_new_tokens=1, max_frames=28, speaker=voice,
                    is_chat=False)
    core.add(other)
    list(core.step())
    assert other.is_in_talker, "the parked stream held the capacity"
    core.push_speech_ids(0, text_ids.finish(), is_finished=True)
    while other.talker_finish_reason is None:
        list(core.step())
        assert streamed.is_parked, "the parked stream resumed beyond the capacity"
    while core.has_work():
        list(core.step())
    alone = EngineCore(family, config)
    again = Request(0, family.speech_ids("Hello there "), max_new_tokens=1, max_frames=28, speaker=voice,
                    is_chat=False)
    alone.add(again)
    while alone.has_work():
        list(alone.step())
    assert torch.equal(core.output(streamed).codes, alone.output(again).codes)


def test_chunks_wait_for_newcomers_at_most_max_defer_steps_in_a_row(family):
    """A newcomer in every step while a listener far ahead has a chunk due: the chunk waits max_defer_steps (2)
    steps in a row, then goes out whatever still comes."""
    engine_config = EngineConfig(max_batch_size=8, max_frames=12, first_chunk_frames=1, chunk_frames=4,
                                 max_defer_steps=2)
    arrived = []

    class Arrivals(StepObserver):
        def talker_batch(self, size: int) -> None:
            running = core.running.get(0)
            if running is None or len(arrived) >= 4:
                return
            if arrived or len(running.frames) - running.num_decoded >= engine_config.chunk_frames - 1:
                running.playback.ends_at = time.perf_counter() + 1000.0
                core.add(_speech_request(family, len(arrived) + 1, 12))
                arrived.append(core.num_steps)

    core = EngineCore(family, engine_config, observer=Arrivals())
    core.add(_speech_request(family, 0, 12))
    steps = []
    while core.has_work():
        steps += [event.step for event in core.step() if event.audio is not None and event.request.request_id == 0]
    assert arrived == list(range(arrived[0], arrived[0] + 4)), "a newcomer came in each of four steps"
    due = arrived[0] + 1  # the step whose frames complete the chunk
    assert due + 2 in steps and not {due, due + 1} & set(steps)


def test_a_restarted_server_starts_from_the_step_costs_it_measured(family, tmp_path, monkeypatch):
    """The step costs measured while serving are kept on disk when the engine stops; the next engine on the same
    model and settings starts from them (its capacity known before its first step), one with other settings does
    not, and with the cost cache turned off nothing is kept."""
    monkeypatch.setenv("OMNIMTP_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("OMNIMTP_DRAFT_COST_CACHE", "1")

    def serve_three(engine: Engine) -> dict[int, float]:
        async def scenario():
            engine.start()
            try:
                loop = asyncio.get_running_loop()
                await asyncio.gather(*(_pcm(engine.submit(_speech(engine, i), loop=loop)) for i in range(3)))
                return engine.admission.costs.measured()
            finally:
                await asyncio.to_thread(engine.shutdown)
        return asyncio.run(scenario())

    first = _engine(family)
    measured = serve_three(first)
    assert measured, "nothing was measured"
    kept = {n: seconds for n, seconds in first.admission.costs.measured(3).items()}
    assert kept
    again = _engine(family)
    assert again.admission.costs.measured() == {}
    again.start()
    try:
        assert again.admission.costs.measured() == kept  # before any request
    finally:
        again.shutdown()
    other = _engine(family, chunk_frames=7)
    other.start()
    try:
        assert other.admission.costs.measured() == {}
    finally:
        other.shutdown()
    monkeypatch.setenv("OMNIMTP_DRAFT_COST_CACHE", "0")
    off = _engine(family)
    off.start()
    try:
        assert off.admission.costs.measured() == {}
    finally:
        off.shutdown()


def test_the_warm_up_reply_measures_each_size_that_fits_before_a_user_asks(family, caplog):
    """A server with a warm-up reply speaks it again by 1, 2, 3 streams at once (background requests above
    capacity), so its capacity is measured before the first user's request instead of grown one admitted stream at
    a time from a guess that errs high; sizes stop at the first that does not fit a frame."""
    engine = Engine(family, model_id="tiny-tts", max_frames=40, max_batch_size=3, admission=True, warm_up_reply=True)
    engine.admission.frame_s = 10.0  # every size fits: the tiny model's steps are not what is tested
    with caplog.at_level("INFO", logger="omnimtp.server"):
        engine.start()
        try:
            deadline = time.monotonic() + 60
            while not caplog_has(caplog, "admission: 3 streams at once") and time.monotonic() < deadline:
                time.sleep(0.05)
            assert set(engine.admission.costs.measured()) == {1, 2, 3}
            assert set(engine.admission.decode_costs.measured()) == {1, 2, 3}
            assert engine.admission.capacity() == 3
        finally:
            engine.shutdown()
    tight = Engine(family, model_id="tiny-tts", max_frames=40, max_batch_size=3, admission=True, warm_up_reply=True)
    tight.admission.frame_s = 1e-6  # no size fits: one is measured, and none above it
    with caplog.at_level("INFO", logger="omnimtp.server"):
        tight.start()
        try:
            deadline = time.monotonic() + 60
            while not caplog_has(caplog, "admission: 1 stream at once") and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(0.2)
            assert set(tight.admission.costs.measured()) == {1}
        finally:
            tight.shutdown()


def test_a_chat_server_measures_its_sizes_while_serving_only():
    """A chat model's warm-up reply is not spoken again by several streams: what a chat costs depends on its
    prompt, its thinking and its client's events, which a warm-up reply does not show."""
    from omnimtp.families.qwen3_omni import Qwen3OmniFamily

    engine = Engine(Qwen3OmniFamily.tiny(0), model_id="omnimtp-tiny", max_frames=40, max_batch_size=3,
                    admission=True, warm_up_reply=True)
    engine.admission.frame_s = 10.0  # every size would fit
    engine.start()
    try:
        deadline = time.monotonic() + 60
        while engine.warm_up_reply_result is None and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)
        assert engine.warm_up_reply_result is not None
        assert 2 not in engine.admission.costs.measured()
    finally:
        engine.shutdown()


def caplog_has(caplog, prefix: str) -> bool:
    return any(record.getMessage().startswith(prefix) for record in caplog.records)


def test_a_realtime_response_that_waits_for_capacity_says_so():
    """Capacity 1: while one realtime session's reply speaks, another session's response starts with
    `rate_limits.updated` saying none are left and how long it should wait, then is served once the first is done;
    the first was told it started at once."""

    from omnimtp.families.qwen3_omni import Qwen3OmniFamily
    from omnimtp.server.app import create_app

    engine = Engine(Qwen3OmniFamily.tiny(0), model_id="omnimtp-tiny", max_frames=300, max_batch_size=4,
                    admission=True)
    engine.admission = Admission(LinearCosts(0.0, 0.048), max_streams=4)
    app = create_app(engine)

    def connect(url):
        client = _client(url)
        connection = client.realtime.connect(model="omnimtp-tiny").__enter__()
        assert connection.recv().type == "session.created"
        connection.session.update(session={"type": "realtime", "seed": 3, "max_output_tokens": 4,
                                           "audio": {"input": {"turn_detection": None}}})
        assert connection.recv().type == "session.updated"
        connection.conversation.item.create(item={"type": "message", "role": "user",
                                                  "content": [{"type": "input_text", "text": "Hello"}]})
        assert [connection.recv().type for _ in range(2)] == ["conversation.item.added", "conversation.item.done"]
        return connection

    def limits_then_audio(connection):
        connection.response.create()
        limits = None
        while (event := connection.recv()).type != "response.output_audio.delta":
            assert event.type != "error", event
            if event.type == "rate_limits.updated":
                [limits] = event.rate_limits
        return limits

    def until_done(connection):
        while (event := connection.recv()).type != "response.done":
            assert event.type != "error", event
        return event.response.status

    with running_server(app) as url:
        first, second = connect(url), connect(url)
        try:
            first_limits = limits_then_audio(first)
            second.response.create()
            while (event := second.recv()).type != "rate_limits.updated":
                assert event.type != "error", event
            [second_limits] = event.rate_limits
            # (random weights end each reply at its max_output_tokens: "incomplete", not failed or cancelled)
            assert until_done(first) == until_done(second) == "incomplete"
        finally:
            first.close()
            second.close()
    assert (first_limits.name, first_limits.limit, first_limits.reset_seconds) == ("requests", 1, 0)
    assert (second_limits.limit, second_limits.remaining) == (1, 0)
    assert second_limits.reset_seconds >= 1


def test_the_engine_thread_runs_on_the_threads_its_engine_was_built_with(family):
    """`serve` builds its engine in a passing thread and leaves its own thread on one torch thread
    (`build_in_passing_thread`); the engine and warm-up threads still run on the count the engine was built
    with."""
    from omnimtp.runtime.device import build_in_passing_thread

    previous = torch.get_num_threads()
    seen = {}
    try:
        def build():
            torch.set_num_threads(2)
            builder.append(threading.current_thread())
            return Engine(family, model_id="tiny-tts", max_batch_size=2)

        builder = []
        engine = build_in_passing_thread(build)
        [thread] = builder  # a thread of its own, gone (its OpenMP pool with it)
        assert thread is not threading.current_thread() and not thread.is_alive()
        assert engine.num_threads == 2 and torch.get_num_threads() == 1
        engine._loop = lambda: seen.setdefault("engine", torch.get_num_threads())
        engine.start()
        engine._thread.join(10)
        engine.family = type("F", (), {"warm_up": lambda *a, **k: seen.setdefault("warm_up", torch.get_num_threads())})
        engine._warm_up()
        with pytest.raises(ValueError, match="bad"):
            build_in_passing_thread(lambda: (_ for _ in ()).throw(ValueError("bad")))
    finally:
        torch.set_num_threads(previous)
    assert seen == {"engine": 2, "warm_up": 2}


def _simulated(family, indexes: tuple[int, ...], max_speaking: int, late: tuple[int, int] | None = None,
               step_s: float = 0.040, **config) -> dict[int, PlaybackClock]:
    """The texts `indexes` (the tiny talker speaks each for all 40 frames) sent at once, `max_speaking` of them
    speaking at a time; a talker step costs step_s (40 ms) and code2wav 13 ms + 20 ms a frame on a simulated clock
    (one stream's frames made at 0.91 of real time with chunks of one frame), and each chunk reaches its listener
    when it is decoded.
    late (index, frames): that text comes once the first has made that many frames, and the engine then sees the
    first's listener 10 s ahead. → {index: its listener's clock}."""
    class Simulated(StepObserver):
        def talker_batch(self, size: int) -> None:
            clock.talker_step(size)
            first = core.running.get(indexes[0])
            if late is not None and late[0] not in listeners and first is not None and len(first.frames) >= late[1]:
                first.playback.ends_at += 10.0
                listeners[late[0]] = PlaybackClock(min_stall_s=0.001)
                core.add(_speech_request(family, late[0], 40))

    clock = SimulatedClock(family, MachineCosts(step_s=step_s, decode_fixed_s=0.013, decode_frame_s=0.020))
    core = EngineCore(clock.family, EngineConfig(max_batch_size=4, max_frames=40, playout_rtf=0.9, **config),
                      observer=Simulated(), clock=clock)
    core.max_speaking = max_speaking
    for index in indexes:
        core.add(_speech_request(family, index, 40))
    listeners = {index: PlaybackClock(min_stall_s=0.001) for index in indexes}
    while core.has_work() or (late is not None and late[0] not in listeners):
        for event in core.step():
            if event.audio is not None:
                listeners[event.request.request_id].push(clock.now, event.audio.size / family.sample_rate)
    return listeners


def test_a_stream_plays_from_its_first_chunk_without_a_stall_at_091_of_real_time(family):
    """Frames made at 0.91 of real time (a 40 ms step, 33 ms to decode a one-frame chunk): the listener who
    starts at the first chunk never runs dry, because each chunk is decoded between the step's frames and the
    talker's forward toward the next (decoded after it, the second chunk comes 113 ms after the first's 80 ms)."""
    clock = _simulated(family, (1,), max_speaking=1)[1]
    assert clock.audio_s >= 40 * FRAME_S - 1e-6
    assert clock.num_underruns == 0, f"stalled {clock.stalled_s:.3f} s"


def test_a_queued_stream_starts_after_the_last_chunk_of_the_one_before(family):
    """Capacity 1, two streams: the second starts once the first's talker has ended, and the first's last chunk
    is decoded before the second's first audio instead of in the middle of its start (where its player, 80 ms
    ahead, would run dry behind it): neither listener stalls."""
    listeners = _simulated(family, (1, 2), max_speaking=1, max_defer_steps=25)
    assert listeners[2].started_at > listeners[1].ends_at - 40 * FRAME_S + 2.0, "the second did not wait"
    for index, clock in listeners.items():
        assert clock.audio_s >= 40 * FRAME_S - 1e-6, index
        assert clock.num_underruns == 0, f"stream {index} stalled {clock.stalled_s:.3f} s"


def test_a_chunk_far_ahead_of_its_listener_waits_while_a_newcomers_player_builds_its_lead(family):
    """Capacity 2: a second stream comes once the first has made 30 frames and its listener is far ahead, while
    the first's chunks have grown to four frames (93 ms to decode, more than the newcomer's player holds in its
    first steps). The first's chunks wait until the newcomer's lead has grown: the newcomer plays without a
    stall; decoded as they come due, the newcomer's player runs dry behind them."""
    waited = _simulated(family, (1,), max_speaking=2, late=(2, 30), step_s=0.015, max_defer_steps=25)
    in_order = _simulated(family, (1,), max_speaking=2, late=(2, 30), step_s=0.015, max_defer_steps=0)
    for listeners in (waited, in_order):
        assert listeners[2].audio_s >= 40 * FRAME_S - 1e-6
    assert in_order[2].num_underruns > 0, "the newcomer did not stall without waiting: the test shows nothing"
    assert waited[2].num_underruns == 0, f"the newcomer stalled {waited[2].stalled_s:.3f} s"

