"""Reading memory-mapped weights before their first use, in the background.

A checkpoint loaded memory-mapped (`omnimtp.quantized_checkpoint`) holds its weights in file mappings: a page
of them is read from storage (a major fault) or mapped from the page cache (a minor fault) the first time a
step touches it. A spoken reply's stages run for the first time in the first reply after loading, which would
pay those reads. `prefetch(tensors)` asks the kernel for the mapped pages of the given tensors at once, from a
background thread, as llama.cpp prefetches its mapping: `madvise(MADV_POPULATE_READ)` reads them and maps them
into the process (Linux 5.14 and later), in chunks, so the thread can stop between chunks; where the kernel
lacks it, `MADV_WILLNEED` starts the reads into the page cache. Only tensors whose bytes lie in a file mapping
are read (an anonymous tensor is resident already); nothing is copied, so the pages count once, as the file's.
Weights that only some tokens read (a MoE thinker's routed experts) are given as `if_room`: after the rest, they are
read into the page cache (`MADV_WILLNEED`, not mapped, not forced to stay) only when the memory the kernel says is
available (/proc/meminfo MemAvailable) holds them and ROOM_RESERVE of the total besides, so that a box with less
memory than the checkpoint does not evict the weights every reply reads to make room for them.

    handle = prefetch(family.per_request_tensors(), if_room=family.routed_expert_tensors())   # returns at once
    handle.wait()                                       # optional: the reads done
    handle.summary()                                    # {"bytes": ..., "files": {name: bytes}, "s": ..., ...}
"""

from __future__ import annotations

import atexit
import bisect
import ctypes
import dataclasses
import logging
import os
import threading
import time
import weakref
from collections.abc import Iterable, Iterator

import torch

logger = logging.getLogger("omnimtp")

MADV_WILLNEED = 3
MADV_POPULATE_READ = 22
CHUNK_BYTES = 64 << 20  # one madvise call at most: a stop waits for one chunk's reads at most
PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")
ROOM_RESERVE = 0.1  # of the total memory, left available after the `if_room` weights are read


def memory_bytes() -> tuple[int, int]:
    """(MemTotal, MemAvailable) of /proc/meminfo in bytes."""
    values = {}
    with open("/proc/meminfo") as f:
        for line in f:
            name, value = line.split(":", 1)
            if name in ("MemTotal", "MemAvailable"):
                values[name] = int(value.split()[0]) * 1024
    return values["MemTotal"], values["MemAvailable"]


def reachable_tensors(obj, skip: frozenset[str] = frozenset()) -> Iterator[torch.Tensor]:
    """Every tensor held by `obj`: itself, its items (tuples, lists, dicts' values) and its dataclass fields,
    recursively, leaving out fields named in `skip` (e.g. a decoder's routed experts)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (tuple, list)):
        for item in obj:
            yield from reachable_tensors(item, skip)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from reachable_tensors(item, skip)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for field in dataclasses.fields(obj):
            if field.name not in skip:
                yield from reachable_tensors(getattr(obj, field.name), skip)


def file_mappings() -> list[tuple[int, int, str]]:
    """This process's file-backed mappings as (start, end, path), by address."""
    mappings = []
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].startswith("/"):
                start, end = (int(address, 16) for address in fields[0].split("-"))
                mappings.append((start, end, fields[5].rstrip("\n")))
    mappings.sort()
    return mappings


def mapped_ranges(tensors: Iterable[torch.Tensor]) -> dict[str, list[tuple[int, int]]]:
    """The page-aligned address ranges of the tensors' bytes that lie in file mappings, merged, by file path.
    CPU tensors only; anonymous memory (a tensor made in the process) is left out."""
    mappings = file_mappings()
    starts = [start for start, _, _ in mappings]
    spans: dict[str, list[tuple[int, int]]] = {}
    for tensor in tensors:
        if tensor.device.type != "cpu" or tensor.numel() == 0 or 0 in tensor.stride():
            continue  # (a zero-stride placeholder holds no data)
        first = tensor.data_ptr()
        last = first + _extent_bytes(tensor)
        index = bisect.bisect_right(starts, first) - 1
        if index < 0 or first >= mappings[index][1]:
            continue
        start, end, path = mappings[index]
        page_start = max(start, first - first % PAGE_BYTES)
        page_end = min(end, -(-last // PAGE_BYTES) * PAGE_BYTES)
        spans.setdefault(path, []).append((page_start, page_end))
    return {path: _merged(ranges) for path, ranges in spans.items()}


def _extent_bytes(tensor: torch.Tensor) -> int:
    """Bytes from a tensor's first element to past its last (its strides' reach)."""
    return (1 + sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride(), strict=True))) \
        * tensor.element_size()


def _merged(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    merged: list[tuple[int, int]] = []
    for start, end in sorted(ranges):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


class Prefetch:
    """The background read of mapped ranges (`prefetch`). `wait` for it, `stop` it (the chunk being read
    finishes), `summary` of what it read. It holds the tensors it reads until it ends, so their mappings stay."""

    def __init__(self, ranges: dict[str, list[tuple[int, int]]], keep_alive: list[torch.Tensor],
                 room_ranges: dict[str, list[tuple[int, int]]] | None = None):
        self.ranges = ranges
        self.num_bytes = _num_bytes(ranges)
        self.room_ranges = room_ranges or {}
        self.num_room_bytes = _num_bytes(self.room_ranges)
        self.is_room_read: bool | None = None  # whether the `if_room` weights were read (None: not decided yet)
        self.memory_available: int | None = None  # MemAvailable when that was decided
        self.advice = None  # the madvise advice used: "populate_read" or "willneed"
        self.seconds = 0.0
        self.error: str | None = None
        self._keep_alive = keep_alive
        self._stop = threading.Event()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="omnimtp-prefetch", daemon=True)
        _RUNNING.add(self)
        self._thread.start()

    @property
    def is_done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the reads (at most `timeout` seconds); whether they are done."""
        return self._done.wait(timeout)

    def stop(self) -> None:
        self._stop.set()
        self._done.wait()

    def summary(self) -> dict:
        return {"bytes": self.num_bytes, "s": self.seconds, "is_done": self.is_done, "advice": self.advice,
                "error": self.error,
                "files": {os.path.basename(path): _num_bytes({path: spans}) for path, spans in self.ranges.items()},
                "if_room_bytes": self.num_room_bytes, "if_room_read": self.is_room_read,
                "memory_available": self.memory_available}

    def _run(self) -> None:
        started = time.perf_counter()
        try:
            libc = ctypes.CDLL(None, use_errno=True)  # (a foreign call drops the GIL: serving goes on meanwhile)
            libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
            advice = MADV_POPULATE_READ
            for chunk, length in self._chunks(self.ranges):
                if libc.madvise(chunk, length, advice) != 0:
                    errno = ctypes.get_errno()
                    if advice == MADV_POPULATE_READ and errno == 22:  # EINVAL: a kernel before 5.14
                        advice = MADV_WILLNEED
                        libc.madvise(chunk, length, advice)
                    else:
                        raise OSError(errno, os.strerror(errno))
                self.advice = "populate_read" if advice == MADV_POPULATE_READ else "willneed"
            if self.room_ranges and not self._stop.is_set():
                total, self.memory_available = memory_bytes()
                self.is_room_read = self.num_room_bytes <= self.memory_available - ROOM_RESERVE * total
                for chunk, length in self._chunks(self.room_ranges) if self.is_room_read else ():
                    libc.madvise(chunk, length, MADV_WILLNEED)  # (a hint: nothing to do if it is not taken)
        except OSError as error:  # the weights are read when first used instead
            self.error = str(error)
            logger.warning("prefetch of the mapped weights stopped: %s", error)
        finally:
            self.seconds = time.perf_counter() - started
            self._keep_alive = []
            _RUNNING.discard(self)
            self._done.set()

    def _chunks(self, ranges: dict[str, list[tuple[int, int]]]) -> Iterator[tuple[int, int]]:
        """(address, length) of CHUNK_BYTES at most, over the ranges, until `stop`."""
        for start, end in (span for spans in ranges.values() for span in spans):
            for chunk in range(start, end, CHUNK_BYTES):
                if self._stop.is_set():
                    return
                yield chunk, min(CHUNK_BYTES, end - chunk)


# Prefetches whose thread may still run: stopped before the interpreter finalizes, since a daemon thread coming back
# from its foreign call into a finalizing interpreter aborts the process ("terminate called without an active
# exception") where a one-shot command exits while its prefetch still reads.
_RUNNING: weakref.WeakSet[Prefetch] = weakref.WeakSet()


@atexit.register
def _stop_running() -> None:
    for handle in list(_RUNNING):
        handle.stop()


def _num_bytes(ranges: dict[str, list[tuple[int, int]]]) -> int:
    return sum(end - start for spans in ranges.values() for start, end in spans)


def prefetch(tensors: Iterable[torch.Tensor], if_room: Iterable[torch.Tensor] = ()) -> Prefetch:
    """Read the file-mapped pages of `tensors`, then those of `if_room` where memory allows (see the module
    docstring), in a background thread ("omnimtp-prefetch"); returns at once."""
    tensors, if_room = list(tensors), list(if_room)
    ranges = mapped_ranges(tensors)
    covered = {path: _merged(spans) for path, spans in ranges.items()}
    room = {path: _without(spans, covered.get(path, [])) for path, spans in mapped_ranges(if_room).items()}
    return Prefetch(ranges, tensors + if_room, {path: spans for path, spans in room.items() if spans})


def _without(spans: list[tuple[int, int]], taken: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The parts of `spans` outside every span of `taken` (both sorted and merged)."""
    left = []
    for start, end in spans:
        for taken_start, taken_end in taken:
            if taken_end <= start or taken_start >= end:
                continue
            if taken_start > start:
                left.append((start, taken_start))
            start = max(start, taken_end)
            if start >= end:
                break
        if start < end:
            left.append((start, end))
    return left


def start_prefetch(family) -> Prefetch | None:
    """`prefetch` of the weights every request of `family` reads (its `per_request_tensors`), and where memory
    allows those only some tokens read (its `routed_expert_tensors`, if it has them); None for a family that does
    not name them."""
    if not hasattr(family, "per_request_tensors"):
        return None
    routed = family.routed_expert_tensors() if hasattr(family, "routed_expert_tensors") else ()
    return prefetch(family.per_request_tensors(), if_room=routed)
