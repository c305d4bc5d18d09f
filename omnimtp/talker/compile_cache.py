"""torch.compile's on-disk caches filled by a child process, so that a server's own compile is a cache hit.

Compiling the code predictor's graphs is minutes of Python (dynamo, inductor: the GIL) and C++ compiler
runs on a CPU. Done in the serving process it starves the requests served beside it. `CacheFiller` runs
that compile in a child process instead, on a twin of the runner (the same modules and dtypes, random
weights: the weights are graph inputs, so the graphs and their cache keys are the same), at the lowest
CPU priority, and stops it (SIGSTOP to its process group, the compiler runs with it) whenever the
server has a request in flight. The runner's own build of each graph then finds inductor's FX graph and
AOT autograd caches filled and takes seconds; it runs the same generated code a cold compile would.

The child is the warm-up's: it is killed when the warm-up ends or is stopped, and dies with the thread
that started it (`PR_SET_PDEATHSIG`).
"""

from __future__ import annotations

import copy
import io
import itertools
import logging
import os
import signal
import subprocess
import sys
import threading
import time

import torch

logger = logging.getLogger(__name__)

POLL_S = 0.05  # how often the child's pause / resume follows the server's idle flag


def meta_copy(module: torch.nn.Module) -> torch.nn.Module:
    """A copy of `module` whose parameters and buffers are on the meta device (no data): what a twin is
    built from, at no cost in memory."""
    memo = {}
    for tensor in itertools.chain(module.parameters(), module.buffers()):
        empty = torch.empty_like(tensor, device="meta")
        memo[id(tensor)] = (torch.nn.Parameter(empty, requires_grad=tensor.requires_grad)
                            if isinstance(tensor, torch.nn.Parameter) else empty)
    return copy.deepcopy(module, memo)


def materialize(module: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """A `meta_copy` given storage on `device` and seeded random values (small, finite)."""
    module.to_empty(device=device)
    generator = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for tensor in itertools.chain(module.parameters(), module.buffers()):
            if tensor.is_floating_point():
                tensor.uniform_(-0.1, 0.1, generator=generator)
            else:
                tensor.zero_()
    return module


class CacheFiller:
    """A child process building every graph of `runner`'s twin, paused while `idle` is clear.

        filler = CacheFiller(runner, sampling, idle=engine_idle, stop=stop)
        filler.wait_built(rows, is_sampled)   # True: built (the runner's build is a cache hit) or the child is gone
        filler.close()

    runner: a compiled `CodePredictorRunner` (its `shape_model`, dtype, device, bucket and packing settings
    and torch's thread count are the twin's). sampling: the sampled graphs' settings. idle: a
    `threading.Event` set while the server has no request in flight (None: never paused). stop: set to kill
    the child at once."""

    def __init__(self, runner, sampling, *, idle: threading.Event | None = None,
                 stop: threading.Event | None = None):
        payload = io.BytesIO()
        torch.save({  # the runner's class travels by reference: this module never imports its parent
            "runner_class": type(runner),
            "predictor": runner.shape_model, "max_batch_size": runner.max_batch_size, "dtype": runner.dtype,
            "device": str(runner.device), "compile": runner.compile_mode, "packed_gemm": runner.packed_gemm_kind
            if runner.packed_gemm else False, "sampling": sampling, "num_threads": torch.get_num_threads(),
        }, payload)
        self._idle = idle
        self._stop = stop if stop is not None else threading.Event()
        self._built: set[tuple[int, bool]] = set()
        self._cond = threading.Condition()
        self.error: str | None = None
        # One compile thread: no worker pool, so every compiler run is the child's own subprocess, in its group.
        env = {**os.environ, "TORCHINDUCTOR_COMPILE_THREADS": "1"}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "omnimtp.talker.compile_cache", str(os.getpid())], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, start_new_session=True,
        )
        self.is_paused = False
        self.process.stdin.write(payload.getvalue())
        self.process.stdin.close()
        self._reader = threading.Thread(target=self._read, name="omnimtp-cache-filler", daemon=True)
        self._reader.start()
        self._pacer = threading.Thread(target=self._pace, name="omnimtp-cache-filler-pace", daemon=True)
        self._pacer.start()

    def _read(self) -> None:
        for line in self.process.stdout:
            word, *rest = line.decode().split(" ", 1)
            with self._cond:
                if word == "built":
                    rows, is_sampled = rest[0].split()
                    self._built.add((int(rows), is_sampled == "1"))
                elif word == "failed":
                    self.error = rest[0].strip() if rest else "unknown error"
                self._cond.notify_all()
        self.process.wait()
        with self._cond:
            self._cond.notify_all()

    def _pace(self) -> None:
        """Stop the child's process group while a request is in flight, continue it when idle; kill it on stop."""
        while self.process.poll() is None:
            if self._stop.is_set():
                self._kill()
                return
            if self._idle is not None:
                self._signal(signal.SIGCONT if self._idle.is_set() else signal.SIGSTOP)
            time.sleep(POLL_S)

    def _signal(self, signum: int) -> None:
        is_paused = signum == signal.SIGSTOP
        if is_paused == self.is_paused:
            return
        try:
            os.killpg(self.process.pid, signum)
        except ProcessLookupError:
            return
        self.is_paused = is_paused

    def _kill(self) -> None:
        try:
            os.killpg(self.process.pid, signal.SIGKILL)  # the compiler runs too; a stopped process dies as well
        except ProcessLookupError:
            pass

    @property
    def is_running(self) -> bool:
        return self.process.poll() is None

    def wait_built(self, rows: int, is_sampled: bool) -> bool:
        """Wait until the child has built the graph of (rows, is_sampled) or has ended (failed, killed: the
        runner then compiles it itself). False if stopped first."""
        with self._cond:
            while (rows, is_sampled) not in self._built and self.process.poll() is None:
                if self._stop.is_set():
                    return False
                self._cond.wait(POLL_S * 4)
        if self.error is not None:
            logger.warning("warm-up: the cache-filling process failed (%s); compiling in the server", self.error)
            self.error = None
        return not self._stop.is_set()

    def close(self) -> None:
        """Kill the child (and its compiler runs) if it is still running."""
        self._kill()
        self.process.wait()
        self._reader.join(5)


def _die_with_parent(parent: int) -> None:
    """SIGKILL this process when the thread that started it ends (Linux); exit if that already happened."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:
        sys.exit(0)


def main() -> None:
    """The child: read the twin's description from stdin, build each graph, print "built ROWS IS_SAMPLED"."""
    _die_with_parent(int(sys.argv[1]))
    os.nice(19)
    try:
        spec = torch.load(io.BytesIO(sys.stdin.buffer.read()), weights_only=False)
        torch.set_num_threads(spec["num_threads"])
        device = torch.device(spec["device"])
        runner = spec["runner_class"](materialize(spec["predictor"], device), spec["max_batch_size"],
                                      spec["dtype"], compile=spec["compile"], packed_gemm=spec["packed_gemm"])
        for rows, sampling in runner.graph_settings(spec["sampling"]):
            runner.build_graph(rows, sampling)
            print(f"built {rows} {int(sampling is not None)}", flush=True)
    except Exception as exc:  # the server compiles what is left itself
        print(f"failed {type(exc).__name__}: {exc}".replace("\n", " "), flush=True)


if __name__ == "__main__":
    main()
