"""Where a model runs: a device name checked once, before any weight moves.

    device = resolve_device("cuda:0")     # torch.device, or ValueError naming what is missing

Everything else follows the weights: the packed decoders take the device of the module they pack, the
requests' generators are made there (`Request.place_generators`), sampling draws its noise there, and the
CPU-only kernels (the AVX-512 matmul, MKL / oneDNN packing) are chosen only for CPU tensors.
"""

from __future__ import annotations

import contextlib
import logging
import os

import torch


def resolve_device(device, param: str = "device") -> torch.device:
    """`device` ("cpu", "cuda", "cuda:1", "mps", a torch.device) → torch.device, checked to exist here:
    ValueError naming `param` for an unknown name, a backend this torch build lacks, or an index past
    the visible devices."""
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as error:
        raise ValueError(f"{param}: {device!r} is not a device ({error})") from None
    if resolved.type == "cpu":
        return resolved
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"{param}: {device!r} asked for CUDA, but this torch build sees no CUDA device")
        if resolved.index is not None and resolved.index >= torch.cuda.device_count():
            raise ValueError(f"{param}: {device!r}, but only {torch.cuda.device_count()} CUDA devices are visible")
        return resolved
    if resolved.type == "mps":
        if not torch.backends.mps.is_available():
            raise ValueError(f"{param}: {device!r} asked for MPS, which is not available here")
        return resolved
    raise ValueError(f"{param}: {device!r}: only cpu, cuda and mps devices are supported")


# Below this many weights a model's ops are too small to split across threads: on a CPU more threads only
# contend (the built-in tiny models run 10-25x slower on every core of a busy box than on one, and take
# seconds instead of a fraction of one to build).
SMALL_MODEL_PARAMETERS = 50_000_000

logger = logging.getLogger(__name__)


def apply_thread_rule(model: torch.nn.Module, torch_threads: int | None = None) -> None:
    """The one thread rule of the Python API, the CLI and the server: `torch_threads` when given; else one
    thread for a small model (under SMALL_MODEL_PARAMETERS weights), and torch's own default (the cores) left
    as it is for a real one. torch's thread count is per process: the last model loaded sets it. Asking for
    more threads than the model can use (more than one for a small model, more than the cores for any) is
    done, with a warning: it only slows the model down."""
    num_parameters = sum(parameter.numel() for parameter in model.parameters())
    if torch_threads is not None:
        if isinstance(torch_threads, bool) or not isinstance(torch_threads, int) or torch_threads < 1:
            raise ValueError(f"torch_threads must be an integer >= 1, got {torch_threads!r}")
        warning = too_many_threads(torch_threads, num_parameters)
        if warning is not None:
            logger.warning(warning)
        torch.set_num_threads(torch_threads)
    elif num_parameters < SMALL_MODEL_PARAMETERS:
        torch.set_num_threads(1)


def too_many_threads(torch_threads: int, num_parameters: int) -> str | None:
    """The warning for `torch_threads` on a model of `num_parameters` weights, or None where it can use them."""
    if torch_threads > 1 and num_parameters < SMALL_MODEL_PARAMETERS:
        return (f"threads: {torch_threads} asked for a small model ({num_parameters / 1e6:.1f} M weights), whose "
                f"ops are too small to split: more than one thread only slows it down")
    cores = available_cores()
    if torch_threads > cores:
        return (f"threads: {torch_threads} asked for, but this process may run on {cores} cores: the extra "
                f"threads only contend")
    return None


def available_cores() -> int:
    """The cores this process may run on (its CPU affinity where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def build_in_passing_thread(build, name: str = "omnimtp-load"):
    """build() in a thread of its own that ends with it (its result returned, its exception raised here), and this
    thread's torch ops on one thread from then on: a serving process whose engine thread does the model's
    work. OpenMP keeps an intra-op thread pool for every thread that ran a parallel op, and once the pools'
    threads outnumber the cores its workers stop spinning between ops (libgomp's throttled wait), so every small
    op of the engine thread waits for its workers to wake (benchmarks/RESULTS.md has what it cost a Qwen3-TTS
    stream). Loading in a passing thread leaves no pool behind (the thread's goes with it); the engine thread sets its
    own thread count (`omnimtp.server.scheduler.Engine`)."""
    import threading

    outcome = {}

    def run():
        try:
            outcome["result"] = build()
        except BaseException as exc:  # raised again in the caller
            outcome["error"] = exc

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    torch.set_num_threads(1)
    return outcome["result"]


@contextlib.contextmanager
def one_thread():
    """torch on one thread inside, its thread count restored after: building a tiny model (its weights drawn,
    its codec calibrated, its decoders packed) runs on the thread count the rule gives it anyway, not on
    every core."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def return_free_memory() -> None:
    """Gives the heap's free pages back to the system (glibc's `malloc_trim`; elsewhere nothing). Packing and
    quantizing a model layer by layer frees many mid-sized temporaries, which glibc keeps in the heap: without
    this, a 0.6B Qwen3-TTS converted to w4a8 holds about 0.55 GB of freed memory by its last layer."""
    global _libc
    if _libc is None:
        import ctypes
        import ctypes.util

        try:
            _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            _libc.malloc_trim  # noqa: B018 (musl and others have none)
        except (OSError, AttributeError):
            _libc = False
    if _libc:
        _libc.malloc_trim(0)


_libc = None
