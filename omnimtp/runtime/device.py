"""Where a model runs: a device name checked once, before any weight moves.

    device = resolve_device("cuda:0")     # torch.device, or ValueError naming what is missing

Everything else follows the weights: the packed decoders take the device of the module they pack, the
requests' generators are made there (`Request.place_generators`), sampling draws its noise there, and the
CPU-only kernels (the AVX-512 matmul, MKL / oneDNN packing) are chosen only for CPU tensors.
"""

from __future__ import annotations

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
# contend (the built-in tiny models run 10-25x slower on every core of a busy box than on one).
SMALL_MODEL_PARAMETERS = 50_000_000


def apply_thread_rule(model: torch.nn.Module, torch_threads: int | None = None) -> None:
    """The one thread rule of the Python API, the CLI and the server: `torch_threads` when given; else one
    thread for a small model (under SMALL_MODEL_PARAMETERS weights), and torch's own default (the cores) left
    as it is for a real one. torch's thread count is per process: the last model loaded sets it."""
    if torch_threads is not None:
        if isinstance(torch_threads, bool) or not isinstance(torch_threads, int) or torch_threads < 1:
            raise ValueError(f"torch_threads must be an integer >= 1, got {torch_threads!r}")
        torch.set_num_threads(torch_threads)
    elif sum(parameter.numel() for parameter in model.parameters()) < SMALL_MODEL_PARAMETERS:
        torch.set_num_threads(1)
