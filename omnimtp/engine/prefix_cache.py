"""The conversations kept warm between turns: each cache key's latest thinker and talker prefixes, within a
byte budget.

A request with a `cache_key` (a realtime session's id) prefills its prompt in blocks and leaves its prompt's
whole blocks here (`omnimtp.thinker.PrefixRows`: KV, input rows, hidden rows), and its talker prefill's whole
blocks beside them (`omnimtp.talker.loop.TalkerPrefix`: KV, input rows); the key's next request starts each
from the longest run of those blocks it shares and prefills only the rest. A key holds one entry, its latest
prefixes. When the entries outgrow the budget the least recently used go first (that key's next turn prefills
everything again); an entry larger than the whole budget is not kept.

    cache = PrefixCache(max_bytes=256 << 20)
    prefix = cache.get("sess_1")          # None: a miss
    cache.put("sess_1", run.kept_prefixes[i], run.reused_rows[i])
    talker_prefix = cache.get_talker("sess_1")
    cache.put_talker("sess_1", talker_request.kept_prefix, talker_request.reused_rows)
    cache.drop("sess_1")                  # the session ended
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass

from omnimtp.talker.loop import TalkerPrefix
from omnimtp.thinker import PrefixRows


@dataclass
class PrefixCacheStats:
    """Totals since start: keyed requests that reused cached rows (hits) and that prefilled everything
    (misses), prompt rows taken from the cache instead of prefilled, talker prefill rows taken from it, entries
    evicted for room, entries dropped because their key ended."""

    hits: int = 0
    misses: int = 0
    reused_rows: int = 0
    talker_reused_rows: int = 0
    evictions: int = 0
    drops: int = 0


@dataclass(frozen=True)
class _Entry:
    thinker: PrefixRows | None
    talker: TalkerPrefix | None

    @property
    def num_bytes(self) -> int:
        return sum(part.num_bytes for part in (self.thinker, self.talker) if part is not None)


class PrefixCache:
    """cache key → its latest `PrefixRows` and `TalkerPrefix`, least recently used first out, at most max_bytes of
    tensors (0: nothing is kept). Thread-safe: the engine thread reads and writes, a server's sessions drop."""

    def __init__(self, max_bytes: int):
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
            raise ValueError(f"max_bytes must be an integer >= 0, got {max_bytes!r}")
        self.max_bytes = max_bytes
        self.stats = PrefixCacheStats()
        self._entries: OrderedDict[Hashable, _Entry] = OrderedDict()
        self._num_bytes = 0
        self._lock = threading.Lock()

    @property
    def num_bytes(self) -> int:
        return self._num_bytes

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: Hashable) -> PrefixRows | None:
        """The key's thinker prefix (the entry is now the most recently used), or None."""
        entry = self._get(key)
        return None if entry is None else entry.thinker

    def get_talker(self, key: Hashable) -> TalkerPrefix | None:
        """The key's talker prefix (the entry is now the most recently used), or None."""
        entry = self._get(key)
        return None if entry is None else entry.talker

    def put(self, key: Hashable, prefix: PrefixRows | None, reused_rows: int = 0) -> None:
        """The key's latest thinker prefix replaces its thinker part (None: the request kept no whole block); its
        talker part stays until the request's talker prefill replaces it. reused_rows: how many rows the request
        took from the prefix it was given (a hit when any)."""
        with self._lock:
            self.stats.reused_rows += reused_rows
            if reused_rows:
                self.stats.hits += 1
            else:
                self.stats.misses += 1
            entry = self._entries.get(key)
            self._store(key, _Entry(prefix, None if entry is None else entry.talker))

    def put_talker(self, key: Hashable, prefix: TalkerPrefix | None, reused_rows: int = 0) -> None:
        """The key's latest talker prefix replaces its talker part (None: the prefill kept no whole block);
        reused_rows: how many prefill rows the request took from the talker prefix it was given."""
        with self._lock:
            self.stats.talker_reused_rows += reused_rows
            entry = self._entries.get(key)
            self._store(key, _Entry(None if entry is None else entry.thinker, prefix))

    def _get(self, key: Hashable) -> _Entry | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
            return entry

    def _store(self, key: Hashable, entry: _Entry) -> None:
        """The key's entry is now `entry` (the most recently used), others evicted for room (call holding lock);
        an empty entry, or one larger than the whole budget, is not kept."""
        self._remove(key)
        if (entry.thinker is None and entry.talker is None) or self.max_bytes == 0 or entry.num_bytes > self.max_bytes:
            return
        while self._entries and self._num_bytes + entry.num_bytes > self.max_bytes:
            self._remove(next(iter(self._entries)))
            self.stats.evictions += 1
        self._entries[key] = entry
        self._num_bytes += entry.num_bytes

    def drop(self, key: Hashable) -> None:
        """Forget the key's entry (its conversation ended)."""
        with self._lock:
            if self._remove(key):
                self.stats.drops += 1

    def _remove(self, key: Hashable) -> bool:
        entry = self._entries.pop(key, None)
        if entry is None:
            return False
        self._num_bytes -= entry.num_bytes
        return True
