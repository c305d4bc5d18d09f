"""Admission by measured real-time capacity: streams already playing keep real time.

One engine step makes one audio frame for every stream in the talker batch, so n streams play in real time while a
step of n costs no more than a frame's audio (80 ms at 12.5 Hz). A streamed request's chunks start at one frame and
grow as its listener's lead does (`omnimtp.engine.playback.chunk_frames_after`): every step of its first frames
decodes a chunk, and a later chunk of n frames is decoded once in n steps. A codec call has a large fixed part, so a
stream's first steps are its dearest: a step in which every stream decodes a one-frame chunk is the costliest that
must keep real time (a later, longer chunk's call is spread over the steps whose frames it holds, as its listener's
lead has grown meanwhile). Admitting by the mean step alone let two streams in whose first steps ran over the frame
while the mean fitted, and they stalled; admitting by their first steps alone let a chat server take streams whose
later chunks, a newcomer's prefill and first chunk in nearly every step, cost more. So `Admission` measures, on this
machine as the engine runs, both at each n: the mean of its recent steps (`costs`: all the work as it came) and the
same steps costed as a stream's first steps (`first_steps`, from `Admission.observe_step`: each step less its calls of
later chunks, plus what the codec costs for n one-frame chunks in one call, `decode_costs`, measured from the calls
that decode only one-frame later chunks, `observe_decode`); the capacity is the largest n whose larger cost
(`step_cost`) stays within `headroom` of a frame. A size not measured yet is estimated from the sizes below it: one
stream more than the largest measured by the trend of the two largest (a step's cost is a fixed part plus a part per
stream, so the next stream adds what the last one added; a cost that grows faster than that only shows in the trend,
which then errs high), any further size in proportion to the largest measured (the fixed part left out, so it errs
high). Capacity so grows one measured stream at a time and never rests on a guess that is too kind by more than one
stream's increment; the proportional guess alone would never try a stream whose step fits only thanks to the fixed
part, and so never measure it.
A stream that would push the playing ones under real time waits in the queue (`EngineCore.max_speaking`);
past `--max-queue` a request is refused with 429 and a `Retry-After` estimated from how long streams last
(`retry_after_s`).

What was measured outlives the process: the engine keeps the step costs on disk (`keep_step_costs`, beside adaptive
speculation's calibrated costs in `omnimtp.spec_decode.cost_cache`, under a fingerprint of the model, the machine,
omnimtp's code and the engine's settings) and a later start on the same fingerprint begins from them
(`cached_step_costs`, `StepCosts.seed`), so a restarted server admits what it measured before instead of one stream
at a time; a server with a warm-up reply also measures the sizes at start, before a user asks
(`omnimtp.server.scheduler.Engine`: the warm-up reply spoken by 1, 2, 3, ... streams at once while each size
fits). A kept cost is wall time, and a slow spell of the machine (other work on it) may be in it: once this
process has measured a size again, the sizes it has not are taken at their kept cost scaled by what that size
measures now against its kept cost, so the kept costs give the shape and the machine of today the scale. The
sizes measured at start are taken the same way (`Admission.seed_measured`): no client reads a warm-up reply, and a
served stream's client costs the machine too (a chat's events and their encoding), so serving sets their scale.

    costs = StepCosts()
    costs.observe(1, 0.030); costs.observe(2, 0.050)
    costs.predict(3)                     # 0.070: 2 streams' 0.050 and the 0.020 the second stream added
    costs.predict(4)                     # 0.100: 2 streams' 0.050, in proportion
    Admission(costs, max_streams=16).capacity(frame_s=0.08)   # 3: 4 would cost 0.100 > 0.9 · 0.080
"""

from __future__ import annotations

import math
import statistics
from collections import deque

from omnimtp.spec_decode.cost_cache import read_entry, write_entry

# The share of a frame's audio a step may cost: the rest absorbs a step's jitter and a newcomer's prefill.
DEFAULT_HEADROOM = 0.9
# A frame's audio before any stream has told: Qwen3-Omni's and Qwen3-TTS's 12.5 Hz codecs (1920 samples at 24 kHz).
DEFAULT_FRAME_S = 0.08
_NUM_SAMPLES = 64  # recent steps kept per size (their mean is the size's cost: a few chunks' decoding among them)
_MAX_RETRY_AFTER_S = 120
_MIN_RETRY_AFTER_MS = 100
_KIND = "speech_step_costs"  # the cost cache's directory for them
MIN_KEPT_SAMPLES = 3  # a size measured fewer times is not kept on disk (`keep_step_costs`)


class StepCosts:
    """Seconds per engine step by the number of streams it made frames for (see the module docstring)."""

    def __init__(self, num_samples: int = _NUM_SAMPLES):
        self._samples: dict[int, deque[float]] = {}
        self._seeded: dict[int, float] = {}  # {streams: seconds} an earlier start measured (`seed`)
        self.num_samples = num_samples

    def observe(self, num_streams: int, seconds: float) -> None:
        if num_streams < 1 or not seconds >= 0:
            return
        self._samples.setdefault(num_streams, deque(maxlen=self.num_samples)).append(float(seconds))

    def measured(self, min_samples: int = 1) -> dict[int, float]:
        """{streams: mean step seconds} of every size measured at least min_samples times in this process, and of
        every size only an earlier start measured (`seed`; with min_samples 1 only), scaled to this machine's
        pace now: by the ratio of the largest size measured both now and then."""
        means = {n: statistics.fmean(samples) for n, samples in self._samples.items() if len(samples) >= min_samples}
        if min_samples <= 1 and self._seeded:
            both = [n for n in self._seeded if n in means and self._seeded[n] > 0]
            scale = means[max(both)] / self._seeded[max(both)] if both else 1.0
            means = {**{n: seconds * scale for n, seconds in self._seeded.items()}, **means}
        return dict(sorted(means.items()))

    def clear(self, num_streams: int | None = None) -> None:
        """Forget what this process measured, at num_streams or (None) at every size; what an earlier start
        measured (`seed`) stays."""
        if num_streams is None:
            self._samples = {}
        else:
            self._samples.pop(num_streams, None)

    def seed(self, measured: dict[int, float]) -> None:
        """Start over from {streams: seconds} an earlier start measured: each such size is taken at that cost
        until this process measures it, scaled as the sizes it measures again say (`measured`)."""
        self._samples = {}
        self._seeded = {n: float(seconds) for n, seconds in measured.items() if n >= 1 and seconds >= 0}

    def predict(self, num_streams: int) -> float | None:
        """A step's seconds at num_streams: measured; else, one stream more than the largest smaller size
        measured, that size's cost plus what its last stream added (the trend of the two largest measured below,
        where it rises); else in proportion to the largest smaller size measured; else the smallest larger
        size's; None while nothing is measured."""
        measured = self.measured()
        if not measured:
            return None
        if num_streams in measured:
            return measured[num_streams]
        below = [n for n in measured if n < num_streams]
        if not below:
            return measured[min(measured)]
        n = max(below)
        smaller = [m for m in below if m < n]
        if num_streams == n + 1 and smaller:
            m = max(smaller)
            per_stream = (measured[n] - measured[m]) / (n - m)
            if per_stream > 0:
                return measured[n] + per_stream
        return measured[n] * num_streams / n


class Admission:
    """How many streams may play at once (`capacity`) and how long a refused client should wait (`retry_after_s`).
    max_streams: the engine's slots; headroom: the share of a frame's audio a step may cost.

    costs: a step's seconds by streams, as measured; first_steps: the same steps costed as if every stream decoded
    a one-frame chunk in them (`observe_step`); decode_costs: the codec's seconds a call by the number of one-frame
    later chunks it decodes (`observe_decode`). A size fits when both its costs do (`step_cost`)."""

    def __init__(self, costs: StepCosts | None = None, *, max_streams: int, headroom: float = DEFAULT_HEADROOM,
                 first_steps: StepCosts | None = None, decode_costs: StepCosts | None = None):
        if isinstance(max_streams, bool) or not isinstance(max_streams, int) or max_streams < 1:
            raise ValueError(f"max_streams must be an integer >= 1, got {max_streams!r}")
        if not 0 < headroom <= 1:
            raise ValueError(f"headroom must be in (0, 1], got {headroom!r}")
        self.costs = costs or StepCosts()
        self.first_steps = first_steps or StepCosts()
        self.decode_costs = decode_costs or StepCosts()
        self.max_streams = max_streams
        self.headroom = headroom
        self.frame_s = DEFAULT_FRAME_S
        self._stream_s: float | None = None  # a stream's mean time from admission to its end (moving average)

    def capacity(self, frame_s: float | None = None) -> int:
        """The most streams whose steps keep real time (at least 1: the server always serves one)."""
        budget = self.headroom * (frame_s or self.frame_s)
        if not self.costs.measured():
            return 1
        capacity = 1
        for n in range(2, self.max_streams + 1):
            if self.step_cost(n) > budget:
                break
            capacity = n
        return capacity

    def step_cost(self, num_streams: int) -> float | None:
        """A step's seconds at num_streams as admission counts it: the larger of its measured mean (every stream's
        work as it came, spread over the steps) and the same steps costed as a stream's first steps are (each
        decoding a one-frame chunk); None while nothing is measured."""
        costs = [c for c in (self.costs.predict(num_streams), self.first_steps.predict(num_streams)) if c is not None]
        return max(costs) if costs else None

    def observe_step(self, num_streams: int, seconds: float, decode_s: float = 0.0) -> None:
        """A step that made a frame for num_streams streams took `seconds`, decode_s of them in the codec's calls of
        later (not first) chunks: into `costs` as it was, and into `first_steps` as the step in which every one of
        those streams decodes a one-frame chunk would cost (the step without those calls, plus `decode_costs`' one
        call of num_streams one-frame chunks; once one is measured). A newcomer's first chunk is decoded in a call
        of its own, a cost of its start as its prefill is: it stays in the step as it was."""
        if num_streams < 1 or not seconds >= 0:
            return
        self.costs.observe(num_streams, seconds)
        one_frame = self.decode_costs.predict(num_streams)
        if one_frame is not None:
            self.first_steps.observe(num_streams, seconds - min(max(decode_s, 0.0), seconds) + one_frame)

    def observe_decode(self, chunk_frames: list[int], seconds: float, is_first: bool = False) -> None:
        """A codec call decoded chunks of chunk_frames frames (one per stream; is_first: their first chunks) in
        `seconds`: into `decode_costs` where every chunk was a later chunk of one frame (the calls of streams' first
        steps, `chunk_frames_after`)."""
        if chunk_frames and not is_first and all(n == 1 for n in chunk_frames):
            self.decode_costs.observe(len(chunk_frames), seconds)

    def seed_measured(self) -> None:
        """What `costs`, `first_steps` and `decode_costs` measured so far becomes the shape later measurements scale
        (`StepCosts.seed`): costs measured apart from serving (the warm-up replies at start: no client reads their
        audio) are taken as they are only until serving measures a size, and then scaled by what that size costs
        while serving (its clients' events and their encoding share the machine)."""
        for table in (self.costs, self.first_steps, self.decode_costs):
            table.seed(table.measured())

    def observe_frame_seconds(self, seconds: float) -> None:
        """A finished stream's audio seconds per frame (what real time means for this model's codec)."""
        if seconds > 0 and math.isfinite(seconds):
            self.frame_s = seconds

    def observe_stream(self, seconds: float) -> None:
        """A finished stream's seconds from admission to its end."""
        if seconds >= 0 and math.isfinite(seconds):
            self._stream_s = seconds if self._stream_s is None else 0.8 * self._stream_s + 0.2 * seconds

    def retry_after_s(self, num_queued: int) -> int:
        """Whole seconds a refused client should wait (`Retry-After`): `retry_after_ms` rounded up, at least 1."""
        return max(1, math.ceil(self.retry_after_ms(num_queued) / 1000))

    def retry_after_ms(self, num_queued: int) -> int:
        """Milliseconds a refused client should wait (`retry-after-ms`, which the openai client prefers): the streams
        queued (and it) served `capacity` at a time, each taking a stream's mean time, at least 100 ms (1 s before
        any stream has ended). Streams of a fraction of a second are so retried in a fraction of a second, not the
        whole second `Retry-After` rounds to."""
        if self._stream_s is None:
            return 1000
        rounds = math.ceil((num_queued + 1) / self.capacity())
        return max(_MIN_RETRY_AFTER_MS, min(1000 * _MAX_RETRY_AFTER_S, math.ceil(1000 * rounds * self._stream_s)))


def cached_step_costs(fingerprint: dict) -> dict[str, dict[int, float]] | None:
    """The costs kept for exactly this fingerprint, one read: {kind: {streams: seconds}} ("steps":
    `Admission.costs`, "first_steps": `Admission.first_steps`, "decode": `Admission.decode_costs`; a kind not kept
    is {}), or None (no "steps" kept, unreadable, not valid, or the cost cache turned off:
    OMNIMTP_DRAFT_COST_CACHE=0)."""
    entry = read_entry(fingerprint, _KIND)
    if entry is None:
        return None
    kept = {kind: _kept_sizes(entry.get(kind)) for kind in ("steps", "first_steps", "decode")}
    return None if not kept["steps"] else {kind: costs or {} for kind, costs in kept.items()}


def _kept_sizes(kept) -> dict[int, float] | None:
    """{streams: seconds} of a kept table, or None (absent, empty or not valid)."""
    if not isinstance(kept, dict) or not kept:
        return None
    costs = {}
    for size, seconds in kept.items():
        if not (isinstance(size, str) and size.isdigit() and int(size) >= 1) or isinstance(seconds, bool) or \
                not isinstance(seconds, (int, float)) or not (math.isfinite(seconds) and seconds >= 0):
            return None
        costs[int(size)] = float(seconds)
    return costs


def keep_step_costs(fingerprint: dict, measured: dict[int, float], first_steps: dict[int, float] | None = None,
                    decode: dict[int, float] | None = None) -> bool:
    """Keep {streams: seconds} (`StepCosts.measured(MIN_KEPT_SAMPLES)`: the sizes measured often enough) for a
    later start, and the same of `Admission.first_steps` and `Admission.decode_costs` beside them; False when there
    are none or the cache cannot be written."""
    if not measured:
        return False
    entry = {"steps": {str(n): float(seconds) for n, seconds in measured.items()}}
    for kind, costs in (("first_steps", first_steps), ("decode", decode)):
        if costs:
            entry[kind] = {str(n): float(seconds) for n, seconds in costs.items()}
    return write_entry(fingerprint, entry, _KIND)
