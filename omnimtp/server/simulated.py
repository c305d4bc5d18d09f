"""The engine core on a simulated machine: a talker step and a codec call cost given seconds on a simulated clock
(`MachineCosts`), everything else nothing, and admission set before every step as the server's loop sets it.

What it is for: scheduling and admission questions that a real machine answers only noisily and slowly — whether
a listener runs dry, how much audio a second a policy delivers, which fixed number of streams keeps real time —
asked of the real `EngineCore` (its chunking, its decode order, its waits) and the real `Admission`, with a
model family whose calls are fast (the tiny test models) standing in for the arithmetic. Tests use it, and
`benchmarks/admission_bound.py` with costs measured on the machine it runs on.

    costs = MachineCosts(step_s=0.020, step_stream_s=0.0015, decode_fixed_s=0.005, decode_chunk_s=0.011,
                         decode_frame_s=0.00875)
    result = simulate(family, config, costs, make_request, clients=4, duration_s=30.0, admission=Admission(...))
    result.audio_per_s, result.stalled_s, result.min_continuity
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from omnimtp.engine.config import EngineConfig
from omnimtp.engine.core import EngineCore
from omnimtp.engine.request import Request
from omnimtp.sampling import SamplingParams
from omnimtp.server.admission import DEFAULT_FRAME_S, Admission


@dataclass(frozen=True)
class MachineCosts:
    """Seconds a talker step costs (step_s + step_stream_s a stream it makes a frame for: the talker and its code
    predictor) and a codec call (decode_fixed_s + decode_chunk_s a chunk + decode_frame_s a frame of them)."""

    step_s: float
    step_stream_s: float = 0.0
    decode_fixed_s: float = 0.0
    decode_chunk_s: float = 0.0
    decode_frame_s: float = 0.0

    def __post_init__(self):
        for name, value in vars(self).items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0 \
                    or math.isinf(value):
                raise ValueError(f"{name} must be a finite number of seconds >= 0, got {value!r}")

    def step(self, num_streams: int) -> float:
        return self.step_s + self.step_stream_s * num_streams

    def decode(self, chunk_frames: list[int]) -> float:
        return self.decode_fixed_s + self.decode_chunk_s * len(chunk_frames) + self.decode_frame_s * sum(chunk_frames)

    def scaled(self, factor: float) -> MachineCosts:
        """Every cost times factor (a machine that much slower)."""
        return MachineCosts(*(factor * value for value in vars(self).values()))


class SimulatedClock:
    """The engine core's clock (`EngineCore(clock=...)`) in simulated seconds: `talker_step` (from the core's
    observer, `StepObserver`) adds a step's cost, and a codec call of `family` (a view of the family whose
    decode_audio adds the call's cost) its own."""

    def __init__(self, family, costs: MachineCosts):
        self.now = 0.0
        self.costs = costs
        clock = self

        class Costed:
            def __getattr__(self, name):
                return getattr(family, name)

            def decode_audio(self, streams, blocks, is_final):
                clock.now += costs.decode([block.shape[-1] for block in blocks])
                return family.decode_audio(streams, blocks, is_final)

        self.family = Costed()

    def __call__(self) -> float:
        return self.now

    def talker_step(self, num_streams: int) -> None:
        self.now += self.costs.step(num_streams)


class StepObserver:
    """The core's observer: the streams the last step made frames for (`num_streams`; their talker step takes the
    clock's time where a clock is given) and its codec calls (`calls`: their chunks' frames, seconds, whether
    first chunks), what the server's loop feeds admission."""

    def __init__(self, clock: SimulatedClock | None = None):
        self.clock = clock
        self.num_streams = 0
        self.calls: list[tuple[list[int], float, bool]] = []

    def stage(self, stage: str, seconds: float) -> None:
        pass

    def phase(self, phase: str, seconds: float) -> None:
        pass

    def talker_batch(self, size: int) -> None:
        self.num_streams = size
        if self.clock is not None:
            self.clock.talker_step(size)

    def decoded(self, chunk_frames: list[int], seconds: float, is_first: bool) -> None:
        self.calls.append((chunk_frames, seconds, is_first))


def speech_request(family, index: int, text: str, max_frames: int) -> Request:
    """A streamed speech request of `text` in the family's voice "aiden" (seeded by its index, sampled at temperature
    0.9, top-k 50), up to max_frames frames: what the simulations send (`simulate`'s make_request)."""
    voice = family.voice("aiden", "auto", None)
    segments = family.speech_segments(text, voice, max_frames, 64)
    return Request(index, next(segments), max_new_tokens=1, max_frames=max_frames, speaker=voice,
                   thinker_sampling=None, talker_sampling=SamplingParams(temperature=0.9, top_k=50), seed=100 + index,
                   is_chat=False, segments=segments)


def calibrated_admission(costs: MachineCosts, max_streams: int, **kwargs) -> Admission:
    """An `Admission` as a server's start leaves it (`Engine._calibrate_capacity`): every size measured with all its
    streams in their first steps (a one-frame chunk each, every step), taken as the shape later steps scale."""
    admission = Admission(max_streams=max_streams, **kwargs)
    for n in range(1, max_streams + 1):
        one_frame = costs.decode([1] * n)
        for table in (admission.costs, admission.first_steps):
            table.observe(n, costs.step(n) + one_frame)
        admission.decode_costs.observe(n, one_frame)
    admission.seed_measured()
    return admission


@dataclass
class SimulationResult:
    """Each request's listener (its `Request.playback`), when it was sent, and the simulated seconds run."""

    requests: dict[int, Request]
    sent_at: dict[int, float]
    duration_s: float
    most_streams: int = 0
    first_audio_s: list[float] = field(default_factory=list)

    @property
    def audio_s(self) -> float:
        return sum(request.playback.audio_s for request in self.requests.values())

    @property
    def audio_per_s(self) -> float:
        """Audio seconds delivered a second."""
        return self.audio_s / self.duration_s if self.duration_s > 0 else 0.0

    @property
    def stalled_s(self) -> float:
        return sum(request.playback.stalled_s for request in self.requests.values())

    @property
    def num_underruns(self) -> int:
        return sum(request.playback.num_underruns for request in self.requests.values())

    @property
    def min_continuity(self) -> float:
        return min((r.playback.continuity for r in self.requests.values() if r.playback.audio_s > 0), default=1.0)


def simulate(family, config: EngineConfig, costs: MachineCosts, make_request: Callable[[int], Request], *,
             arrivals: list[float] | None = None, clients: int = 0, duration_s: float | None = None,
             admission: Admission | None = None, max_speaking: int | None = None,
             frame_s: float = DEFAULT_FRAME_S) -> SimulationResult:
    """Requests (`make_request(index)`) to a core of `config` on a machine of `costs`: sent at `arrivals`
    (simulated seconds), and/or by `clients` closed-loop clients (each sends its next request when its last one
    has finished); until every request has finished, or past duration_s (closed-loop clients need one). Before
    every step the streams that may speak are set by `admission` (which learns each step's and codec call's
    costs as the server's loop feeds it), else max_speaking (None: every slot)."""
    if clients and duration_s is None:
        raise ValueError("duration_s is needed with closed-loop clients (they never stop)")
    clock = SimulatedClock(family, costs)
    observer = StepObserver(clock)
    core = EngineCore(clock.family, config, observer=observer, clock=clock)
    pending = sorted(arrivals or [])
    result = SimulationResult({}, {}, 0.0)

    def send() -> None:
        index = len(result.requests)
        result.requests[index] = request = make_request(index)
        result.sent_at[index] = clock.now
        core.add(request)

    for _ in range(clients):
        send()
    finished = set()
    while (pending or core.has_work()) and (duration_s is None or clock.now < duration_s):
        while pending and pending[0] <= clock.now:
            pending.pop(0)
            send()
        if not core.has_work():
            clock.now = pending[0]
            continue
        core.max_speaking = admission.capacity(frame_s) if admission is not None else max_speaking
        observer.num_streams, observer.calls, started = 0, [], clock.now
        for event in core.step():
            if event.is_finished and clients and event.request.request_id not in finished:
                finished.add(event.request.request_id)
                send()
        if admission is not None:
            for chunk_frames, call_s, is_first in observer.calls:
                admission.observe_decode(chunk_frames, call_s, is_first)
            admission.observe_step(observer.num_streams, clock.now - started,
                                   sum(call_s for _, call_s, is_first in observer.calls if not is_first))
        result.most_streams = max(result.most_streams, observer.num_streams)
    result.duration_s = clock.now
    result.first_audio_s = sorted(request.playback.started_at - result.sent_at[index]
                                  for index, request in result.requests.items()
                                  if request.playback.started_at is not None)
    return result
