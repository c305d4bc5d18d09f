"""The conversations kept warm between turns: each cache key's latest thinker prefix, within a byte budget.

A request with a `cache_key` (a realtime session's id) prefills its prompt in blocks and leaves its prompt's
whole blocks here (`omnimtp.thinker.PrefixRows`: KV, input rows, hidden rows); the key's next request starts
from the longest run of those blocks its prompt shares and prefills only the rest. A key holds one entry, its
latest. When the entries outgrow the budget the least recently used go first (that key's next turn prefills
everything again); an entry larger than the whole budget is not kept.

    cache = PrefixCache(max_bytes=256 << 20)
    prefix = cache.get("sess_1")          # None: a miss
    cache.put("sess_1", run.kept_prefixes[i], run.reused_rows[i])
    cache.drop("sess_1")                  # the session ended
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass

from omnimtp.thinker import PrefixRows


@dataclass
class PrefixCacheStats:
    """Totals since start: keyed requests that reused cached rows (hits) and that prefilled everything
    (misses), prompt rows taken from the cache instead of prefilled, entries evicted for room, entries dropped
    because their key ended."""

    hits: int = 0
    misses: int = 0
    reused_rows: int = 0
    evictions: int = 0
    drops: int = 0


class PrefixCache:
    """cache key → its latest `PrefixRows`, least recently used first out, at most max_bytes of tensors
    (0: nothing is kept). Thread-safe: the engine thread reads and writes, a server's sessions drop."""

    def __init__(self, max_bytes: int):
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
            raise ValueError(f"max_bytes must be an integer >= 0, got {max_bytes!r}")
        self.max_bytes = max_bytes
        self.stats = PrefixCacheStats()
        self._entries: OrderedDict[Hashable, PrefixRows] = OrderedDict()
        self._num_bytes = 0
        self._lock = threading.Lock()

    @property
    def num_bytes(self) -> int:
        return self._num_bytes

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: Hashable) -> PrefixRows | None:
        """The key's entry (now the most recently used), or None."""
        with self._lock:
            prefix = self._entries.get(key)
            if prefix is not None:
                self._entries.move_to_end(key)
            return prefix

    def put(self, key: Hashable, prefix: PrefixRows | None, reused_rows: int = 0) -> None:
        """The key's latest prefix replaces its entry (None: the request kept no whole block, the entry goes);
        reused_rows: how many rows the request took from the entry it was given (a hit when any)."""
        with self._lock:
            self.stats.reused_rows += reused_rows
            if reused_rows:
                self.stats.hits += 1
            else:
                self.stats.misses += 1
            self._remove(key)
            if prefix is None or self.max_bytes == 0 or prefix.num_bytes > self.max_bytes:
                return
            while self._entries and self._num_bytes + prefix.num_bytes > self.max_bytes:
                self._remove(next(iter(self._entries)))
                self.stats.evictions += 1
            self._entries[key] = prefix
            self._num_bytes += prefix.num_bytes

    def drop(self, key: Hashable) -> None:
        """Forget the key's entry (its conversation ended)."""
        with self._lock:
            if self._remove(key):
                self.stats.drops += 1

    def _remove(self, key: Hashable) -> bool:
        prefix = self._entries.pop(key, None)
        if prefix is None:
            return False
        self._num_bytes -= prefix.num_bytes
        return True
