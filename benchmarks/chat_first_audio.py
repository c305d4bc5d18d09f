"""Where `auto` speculation and a burst spend a chat request's time to first audio, in one process: the demo
Qwen3-Omni's `EngineCore` driven directly (no HTTP), a plain thinker and an `auto` one (its MTP head) alternated
round by round, so that a shared machine's drift falls on both alike.

    python benchmarks/chat_first_audio.py                  # bursts of 1 and 4, a newcomer into 3 running
    python benchmarks/chat_first_audio.py --burst 1 4 16 --rounds 9 --threads 2
    python benchmarks/chat_first_audio.py --quick --out out.json   # a check that it runs (seconds)

Three measurements, each a median over the rounds after the first:
- burst: N requests added to an idle core before its first step (the closed-loop clients' groups): wall and
  thread CPU time to each request's first audio chunk, and the core's phases (think, talker_admit, talk,
  code2wav) up to the step that gave the last one, and the steps it took;
- newcomer: one request added between two steps of a cohort of `--running` that started K steps before: its
  first audio, and the running cohort's step times (what an arrival in the middle of a step waits out: the mean
  residual sum(s²) / 2 sum(s) over those steps);
- start: a thinker cohort's start alone (`new_thinker`, the prefill and the plain start steps), thread CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections import defaultdict

os.environ.setdefault("OMNIMTP_DRAFT_COST_CACHE", "0")  # the step costs measured now, under this run's load

import torch  # noqa: E402

from omnimtp.engine.config import EngineConfig  # noqa: E402
from omnimtp.engine.core import EngineCore  # noqa: E402
from omnimtp.engine.request import Request  # noqa: E402
from omnimtp.mtp.demo import demo_omni_dir  # noqa: E402
from omnimtp.pipeline import OmniPipeline  # noqa: E402

MAX_TOKENS = 24  # serve_playback's chat replies
MAX_FRAMES = 60


class _Phases:
    """The core's observer: phase seconds summed while a measurement runs."""

    def __init__(self):
        self.seconds: dict[str, float] = defaultdict(float)

    def stage(self, stage: str, seconds: float) -> None:
        pass

    def phase(self, phase: str, seconds: float) -> None:
        self.seconds[phase] += seconds

    def talker_batch(self, size: int) -> None:
        pass


def _request(family, request_id: int, text: str) -> Request:
    ids = family.chat_ids([{"role": "user", "content": text}])
    return Request(request_id, ids, max_new_tokens=MAX_TOKENS, max_frames=MAX_FRAMES, speaker=family.default_speaker,
                   is_streamed=True)


def _drain(core: EngineCore) -> None:
    while core.has_work():
        for _ in core.step():
            pass


def burst(family, config, size: int, base: int) -> dict:
    observer = _Phases()
    core = EngineCore(family, config, observer=observer)
    for i in range(size):
        core.add(_request(family, i, f"def parse_{base + i}(text):"))
    wall, cpu, first, steps = time.perf_counter(), time.thread_time(), {}, 0
    while len(first) < size and core.has_work():
        steps += 1
        for event in core.step():
            if event.request.request_id not in first and event.request.first_audio_at is not None:
                first[event.request.request_id] = (time.perf_counter() - wall, time.thread_time() - cpu)
    phases = dict(observer.seconds)
    _drain(core)
    return {"median": statistics.median(w for w, _ in first.values()), "last": max(w for w, _ in first.values()),
            "cpu_last": max(c for _, c in first.values()), "steps": steps, **phases}


def newcomer(family, config, running: int, after_steps: int, base: int) -> dict:
    core = EngineCore(family, config)
    for i in range(running):
        core.add(_request(family, i, f"def parse_{base + i}(text):"))
    steps = []
    for _ in range(after_steps):
        started = time.perf_counter()
        for _ in core.step():
            pass
        steps.append(time.perf_counter() - started)
    core.add(_request(family, -1, f"def parse_{base + 50}(text):"))
    wall, cpu, first = time.perf_counter(), time.thread_time(), None
    while first is None:
        for event in core.step():
            if first is None and event.request.request_id == -1 and event.request.first_audio_at is not None:
                first = (time.perf_counter() - wall, time.thread_time() - cpu)
    _drain(core)
    later = steps[1:]  # the cohort's start step aside
    return {"first": first[0], "cpu_first": first[1], "step_mean": statistics.mean(later) if later else 0.0,
            "residual": sum(s * s for s in later) / (2 * sum(later)) if later else 0.0}


def start(family, size: int) -> dict:
    prompts = [family.chat_ids([{"role": "user", "content": f"def parse_{i}(text):"}]) for i in range(size)]
    cpu = time.thread_time()
    run = family.new_thinker(prompts, [None] * size, [None] * size, MAX_TOKENS, plain_start_steps=2)
    for _ in range(3):
        run.step()
    return {"cpu": time.thread_time() - cpu}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--burst", type=int, nargs="+", default=[1, 4], help="burst sizes")
    parser.add_argument("--running", type=int, default=3, help="the running cohort a newcomer joins (0: none)")
    parser.add_argument("--after", type=int, nargs="+", default=[2, 6, 12],
                        help="steps the running cohort took before the newcomer came")
    parser.add_argument("--rounds", type=int, default=7, help="rounds, each plain and auto once (the first dropped)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--quick", action="store_true", help="one burst of 1, a newcomer into 1, two rounds: a check")
    parser.add_argument("--out", help="also write the medians as JSON")
    args = parser.parse_args()
    if args.quick:
        args.burst, args.running, args.after, args.rounds = [1], 1, [2], 2
    torch.set_num_threads(args.threads)
    directory = str(demo_omni_dir())
    pipe = OmniPipeline.from_pretrained(directory, thinker_mtp=directory, num_draft_tokens="auto")
    family = pipe.family
    speculation = family.thinker_speculation
    config = EngineConfig(max_batch_size=2 if args.quick else max(8, *args.burst, args.running + 1),
                          max_new_tokens=MAX_TOKENS)
    family.calibrate_speculation(config.max_batch_size)  # as a server does at start-up

    def alternated(measure) -> dict[str, dict[str, float]]:
        results = {"plain": [], "auto": []}
        for round_index in range(args.rounds):
            for name in ("plain", "auto") if round_index % 2 == 0 else ("auto", "plain"):
                family.thinker_speculation = speculation if name == "auto" else None
                results[name].append(measure(round_index))
        return {name: {key: statistics.median(r.get(key, 0.0) for r in runs[1:]) for key in runs[0]}
                for name, runs in results.items()}

    report = {}

    def show(label: str, medians: dict[str, dict[str, float]], ratio_key: str) -> None:
        report[label] = medians
        for name, values in medians.items():
            print(f"{label}: {name:5s} " + " ".join(
                f"{key} {value:.0f}" if key == "steps" else f"{key} {1e3 * value:.2f}" for key, value in values.items()
            ))
        print(f"{label}: auto/plain {ratio_key}: {medians['auto'][ratio_key] / medians['plain'][ratio_key]:.3f}")

    for size in args.burst:
        show(f"burst {size}", alternated(lambda r, size=size: burst(family, config, size, 10 * r)), "median")
        show(f"start {size}", alternated(lambda r, size=size: start(family, size)), "cpu")
    if args.running:
        for after in args.after:
            show(f"newcomer after {after}", alternated(
                lambda r, after=after: newcomer(family, config, args.running, after, 10 * r)), "first")
    print("(ms, steps a count; medians of the rounds after the first, plain and auto alternated in this process)")
    if args.out:
        with open(args.out, "w") as file:
            json.dump(report, file, indent=1)


if __name__ == "__main__":
    main()
