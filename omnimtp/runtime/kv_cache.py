"""The one KV cache of every packed decoder: a static buffer written by index, one slot per sequence.

    cache = KVCache(decoder, max_batch_size=4)              # buffer [L, 2, B_max, Nkv, S_cap, D], zeros
    where = cache.plan(slots=[0, 2], num_new=1)              # reserve room; where each row's keys go
    keys, values = append_kv(cache.buffer, i, new_keys, new_values, where)   # per layer
    cache.commit([0, 2], 1)                                  # the slots' lengths grow

Slot s holds its sequence's positions 0..lengths[s]-1 with no padding, so a sequence never attends to
another's keys. Its RoPE position is its cache index plus the slot's `rope_offsets[s]` (0 unless a
prefill gave M-RoPE positions: then decoding continues from their maximum + 1, transformers' rope_deltas).
The buffer grows (doubling) when a sequence outgrows it, unless it was made fixed
(`is_growable=False`: the code predictor's G-slot buffer, written at static positions by a compiled
step). Columns at or past a slot's length are never attended to (masked or not read), and the buffer
starts as zeros, so stale columns stay finite.

Uses:
- thinker / talker: ragged slots (`plan(slots, T)`, `keep` compaction, `reset` for a new request);
- the speculative target and the MTP head: every slot shares one length (`length`, `crop`), which slots
  a row may attend to is the caller's kv_mask (left padding, rejected drafts of ragged rows); finished
  rows leave (`keep(slots, shrink=True)`, `keep_cache_rows`);
- the code predictor: a fixed buffer of G columns written at positions [T] shared by the rows
  (`append_kv` with a positions tensor: compile-friendly writes);
- a streamed codec's sliding-window transformer: a slot per stream (`add_slots` as streams come), each forward's
  rows one position each, several of a slot's (`plan_positions`), attending to their slot in place; a slot keeps
  the window's last positions only (`slide`), at a fixed capacity.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from omnimtp.runtime import tracing


@dataclass(frozen=True)
class KVWrite:
    """Where one forward's T new positions go, the same for every layer.

    rows: the forward's slots as one slice of the buffer (consecutive slots), else None (gathered by
    slot_index); start: every row writes columns start..start+T-1 (equal lengths), else None;
    positions [R, T]: each row's new columns, or None when the write is one slice (rows and start);
    num_columns: columns attention reads (the longest slot after the write); in_place: the rows attend to their
    slots where they lie (`append_kv` returns every slot, `ops.attention` reads row r's at slot_index[r]), not to a
    gathered copy (`KVCache.plan_positions`)."""

    rows: slice | None
    slot_index: torch.Tensor | None  # [R]
    start: int | None
    positions: torch.Tensor | None  # [R, T]
    num_columns: int
    in_place: bool = False


@dataclass(frozen=True)
class SavedSlot:
    """One slot's sequence out of the buffer (`KVCache.save`): kv [L, 2, Nkv, length, D]."""

    kv: torch.Tensor
    length: int
    rope_offset: int

    def head(self, length: int) -> SavedSlot:
        """Its first `length` positions (a view, no copy)."""
        if isinstance(length, bool) or not isinstance(length, int) or not 0 <= length <= self.length:
            raise ValueError(f"length must be an integer in [0, {self.length}], got {length!r}")
        return SavedSlot(self.kv[:, :, :, :length], length, self.rope_offset)


class KVCache:
    """The KV buffer [L, 2, B_max, Nkv, S_cap, D] of a packed decoder and each slot's length.

    decoder: anything with `num_layers`, `num_kv_heads`, `head_dim`, `dtype`, `device` (a `PackedDecoder`); the
    buffer takes its `kv_dtype` where it has one that is not None, else its `dtype`.
    `reset` empties a slot for a new sequence; `keep` compacts (slot i takes the old slot keep[i]); `crop`
    shortens every slot; `snapshot` / `restore` roll the lengths back (columns past them are dead); `save` copies
    one slot's sequence out and `load` puts it back into any free slot, bit for bit.
    rope_offsets[s]: the RoPE position of slot s's cache index i is i + rope_offsets[s]."""

    def __init__(self, decoder, max_batch_size: int, capacity: int = 256, *, is_growable: bool = True):
        if isinstance(max_batch_size, bool) or not isinstance(max_batch_size, int) or max_batch_size < 1:
            raise ValueError(f"max_batch_size must be an integer >= 1, got {max_batch_size!r}")
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"capacity must be an integer >= 1, got {capacity!r}")
        self.max_batch_size = max_batch_size
        self.is_growable = is_growable
        self.lengths = [0] * max_batch_size
        self.rope_offsets = [0] * max_batch_size
        self.buffer = torch.zeros(
            decoder.num_layers, 2, max_batch_size, decoder.num_kv_heads, capacity, decoder.head_dim,
            dtype=getattr(decoder, "kv_dtype", None) or decoder.dtype, device=decoder.device,
        )  # [L, 2, B_max, Nkv, S_cap, D]
        self.layer_views = layer_views(self.buffer)

    @property
    def capacity(self) -> int:
        return self.buffer.shape[4]

    @property
    def length(self) -> int:
        """The one length every slot shares (the speculative loops' cache)."""
        if min(self.lengths) != max(self.lengths):
            raise ValueError(f"the slots have different lengths {self.lengths}; use `lengths`")
        return self.lengths[0]

    def get_seq_length(self, layer_idx: int | None = None) -> int:
        """`length`, under transformers' `Cache` name (every layer holds the same positions)."""
        return self.length

    def check_slots(self, slots: list[int]) -> None:
        if len(set(slots)) != len(slots) or any(
            isinstance(s, bool) or not isinstance(s, int) or not 0 <= s < self.max_batch_size for s in slots
        ):
            raise ValueError(f"slots must be distinct integers in [0, {self.max_batch_size}), got {slots!r}")

    def reset(self, slot: int) -> None:
        self.check_slots([slot])
        self.lengths[slot] = 0
        self.rope_offsets[slot] = 0

    def keep(self, slots: list[int], *, shrink: bool = False) -> None:
        """Compact: slot i becomes the old slot slots[i] for i < len(slots); the rest are emptied, or with
        shrink dropped (max_batch_size becomes len(slots): a shared-length cache whose finished rows leave)."""
        self.check_slots(slots)
        if shrink:
            if not slots:
                raise ValueError("slots: a cache keeps at least one slot")
            if slots != list(range(self.max_batch_size)):
                self.buffer = self.buffer.index_select(2, torch.tensor(slots, device=self.buffer.device))
                self.layer_views = layer_views(self.buffer)
            self.max_batch_size = len(slots)
            self.lengths = [self.lengths[s] for s in slots]
            self.rope_offsets = [self.rope_offsets[s] for s in slots]
            return
        if slots != list(range(len(slots))):
            index = torch.tensor(slots, device=self.buffer.device)
            self.buffer[:, :, : len(slots)] = self.buffer.index_select(2, index)
        emptied = [0] * (self.max_batch_size - len(slots))
        self.lengths = [self.lengths[s] for s in slots] + emptied
        self.rope_offsets = [self.rope_offsets[s] for s in slots] + emptied

    def crop(self, n: int) -> None:
        """Every slot keeps its first n positions (n < 0: drops its last -n, as `DynamicCache.crop`)."""
        if isinstance(n, bool) or not isinstance(n, int):
            raise ValueError(f"n must be an integer, got {n!r}")
        self.lengths = [max(0, length + n) if n < 0 else min(n, length) for length in self.lengths]

    def snapshot(self) -> tuple[int, ...]:
        """The slots' lengths, for `restore` (valid while no `keep` runs in between)."""
        return tuple(self.lengths)

    def restore(self, snapshot: tuple[int, ...]) -> None:
        """Roll every slot back to its snapshot length; what was appended since is never read again."""
        if len(snapshot) != self.max_batch_size or any(
            new > old for new, old in zip(snapshot, self.lengths, strict=True)
        ):
            raise ValueError(f"snapshot {snapshot!r} does not roll back lengths {self.lengths}")
        self.lengths = list(snapshot)

    def save(self, slot: int, length: int | None = None) -> SavedSlot:
        """A copy of slot's sequence, or of its first `length` positions (the slot itself is left as it is)."""
        self.check_slots([slot])
        if length is None:
            length = self.lengths[slot]
        elif isinstance(length, bool) or not isinstance(length, int) or not 0 <= length <= self.lengths[slot]:
            raise ValueError(f"length must be an integer in [0, {self.lengths[slot]}], got {length!r}")
        return SavedSlot(self.buffer[:, :, slot, :, :length].clone(), length, self.rope_offsets[slot])

    def load(self, slot: int, saved: SavedSlot) -> None:
        """Slot holds `saved`'s sequence (what was in it is dropped)."""
        self.check_slots([slot])
        self.reserve(saved.length)
        self.buffer[:, :, slot, :, : saved.length] = saved.kv
        self.lengths[slot] = saved.length
        self.rope_offsets[slot] = saved.rope_offset

    def reserve(self, length: int) -> None:
        """Make room for `length` positions per slot (the buffer at least doubles)."""
        if length <= self.capacity:
            return
        if not self.is_growable:
            raise ValueError(f"the KV buffer holds {self.capacity} positions, {length} were asked for")
        used = max(self.lengths)
        grown = self.buffer.new_zeros((*self.buffer.shape[:4], max(length, 2 * self.capacity), self.buffer.shape[5]))
        grown[:, :, :, :, :used] = self.buffer[:, :, :, :, :used]
        self.buffer = grown
        self.layer_views = layer_views(grown)

    def plan(self, slots: list[int], num_new: int) -> KVWrite:
        """Reserve room for `num_new` positions after each slot's length and say where they go (checked slots)."""
        starts = [self.lengths[s] for s in slots]
        num_columns = max(starts) + num_new
        self.reserve(num_columns)
        num_rows = len(slots)
        rows = slice(slots[0], slots[0] + num_rows) if slots == list(range(slots[0], slots[0] + num_rows)) else None
        start = starts[0] if min(starts) == max(starts) else None
        if rows is not None and start is not None:
            return KVWrite(rows, None, start, None, num_columns)
        device = self.buffer.device
        positions = torch.tensor(starts, device=device)[:, None] + torch.arange(num_new, device=device)  # [R, T]
        return KVWrite(rows, torch.tensor(slots, device=device), start, positions, num_columns)

    def commit(self, slots: list[int], num_new: int) -> None:
        """The slots now hold `num_new` more positions (after every layer wrote them)."""
        for slot in slots:
            self.lengths[slot] += num_new

    def plan_positions(self, slots: list[int], counts: list[int]) -> KVWrite:
        """A forward whose rows are one new position each: slot slots[i] takes counts[i] new positions (rows in
        that order, a slot's in position order), each row attending to its own slot in place (`KVWrite.in_place`).
        The slots must have room (`capacity`; see `slide`); `commit_positions` afterwards."""
        starts = [self.lengths[s] for s in slots]
        num_columns = max(start + count for start, count in zip(starts, counts, strict=True))
        if num_columns > self.capacity:
            raise ValueError(f"the KV buffer holds {self.capacity} positions a slot, {num_columns} were asked for")
        slot_index = torch.tensor([s for s, count in zip(slots, counts, strict=True) for _ in range(count)])
        columns = torch.tensor([start + j for start, count in zip(starts, counts, strict=True) for j in range(count)])
        return KVWrite(None, slot_index.to(self.buffer.device), None, columns.to(self.buffer.device)[:, None],
                       num_columns, in_place=True)

    def commit_positions(self, slots: list[int], counts: list[int]) -> None:
        """Slot slots[i] now holds counts[i] more positions (after a `plan_positions` forward)."""
        for slot, count in zip(slots, counts, strict=True):
            self.lengths[slot] += count

    def slide(self, slot: int, keep: int) -> None:
        """Slot keeps its last `keep` positions, moved to columns 0..keep-1; its RoPE offset grows by the positions
        it drops, so each kept one keeps its RoPE position (a sliding-window layer's cache: a query sees only its
        window's last positions)."""
        length = self.lengths[slot]
        if keep < length:
            self.buffer[:, :, slot, :, :keep] = self.buffer[:, :, slot, :, length - keep : length].clone()
            self.rope_offsets[slot] += length - keep
            self.lengths[slot] = keep

    def add_slots(self, count: int) -> list[int]:
        """`count` more slots, empty (the buffer copied into a larger one) → their indexes."""
        first = self.max_batch_size
        grown = self.buffer.new_zeros((*self.buffer.shape[:2], first + count, *self.buffer.shape[3:]))
        grown[:, :, :first] = self.buffer
        self.buffer = grown
        self.layer_views = layer_views(grown)
        self.max_batch_size += count
        self.lengths += [0] * count
        self.rope_offsets += [0] * count
        return list(range(first, first + count))


def keep_cache_rows(cache, rows: list[int]) -> None:
    """Keep only the batch rows `rows` of a speculative loop's cache, in that order: a `KVCache` whose slots
    share one length (`keep(rows, shrink=True)`), or a transformers `Cache` (`reorder_cache`, which selects
    every layer's rows: keys and values, linear-attention states, DSA indexer keys)."""
    if isinstance(cache, KVCache):
        cache.keep(rows, shrink=True)
        return
    if not rows:
        raise ValueError("rows: a cache keeps at least one row")
    cache.reorder_cache(torch.tensor(rows))


def layer_views(buffer: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (keys, values) views [B_max, Nkv, S_cap, D] of a buffer, made once per buffer (a decode
    step then indexes a list instead of slicing the buffer twice per layer)."""
    return [(buffer[i, 0], buffer[i, 1]) for i in range(buffer.shape[0])]


def append_kv(
    buffer: torch.Tensor | list[tuple[torch.Tensor, torch.Tensor]],
    layer: int,
    new_keys: torch.Tensor,
    new_values: torch.Tensor,
    where: KVWrite | torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Write one layer's new keys / values [R, T, Nkv, D] (one row at one position: [Nkv, D]) into buffer
    [L, 2, B_max, Nkv, S, D] and return the keys and values the new queries attend to, [R, Nkv, S', D].
    With a `KVWrite`, buffer may be the cache's `layer_views` instead.

    where: a `KVWrite` (from `KVCache.plan`); or positions [T] long, the same columns for rows 0..R-1 of a
    fixed buffer, all of whose S columns are returned (the caller masks what is not written yet). Eager:
    two `index_copy_` into views of the buffer (the cheapest per call). Compiled: one `index_put_` on
    the whole buffer, which inductor writes in place; an `index_copy_` into a view of the graph's input
    makes it copy the layer's whole block in and out around the write."""
    if isinstance(where, torch.Tensor):
        positions, num_rows, num_kv_heads = where, new_keys.shape[0], new_keys.shape[2]
        new_keys, new_values = new_keys.transpose(1, 2), new_values.transpose(1, 2)  # [R, Nkv, T, D]
        if not tracing.is_compiling():
            buffer[layer, 0, :num_rows].index_copy_(2, positions, new_keys)
            buffer[layer, 1, :num_rows].index_copy_(2, positions, new_values)
        else:
            device = buffer.device
            index = (
                torch.tensor(layer, device=device),
                torch.arange(2, device=device)[:, None, None, None],  # keys, values
                torch.arange(num_rows, device=device)[:, None, None],
                torch.arange(num_kv_heads, device=device)[:, None],
                positions,
            )  # broadcast to [2, R, Nkv, T]
            buffer.index_put_(index, torch.stack([new_keys, new_values]))
        return buffer[layer, 0, :num_rows], buffer[layer, 1, :num_rows]
    keys, values = (
        buffer[layer] if isinstance(buffer, list) else (buffer[layer, 0], buffer[layer, 1])
    )  # [B_max, Nkv, S_cap, D]
    if keys.dtype != new_keys.dtype:  # a cache in another dtype (`PackedDecoder.kv_dtype`): rounded to it
        new_keys, new_values = new_keys.to(keys.dtype), new_values.to(keys.dtype)
    if new_keys.dim() == 2:  # one row at one position: [Nkv, D]
        keys[where.rows.start, :, where.start] = new_keys
        values[where.rows.start, :, where.start] = new_values
    elif where.positions is None:
        stop = where.start + new_keys.shape[1]
        keys[where.rows, :, where.start : stop] = new_keys.transpose(1, 2)
        values[where.rows, :, where.start : stop] = new_values.transpose(1, 2)
    else:
        keys[where.slot_index[:, None], :, where.positions] = new_keys
        values[where.slot_index[:, None], :, where.positions] = new_values
    if where.in_place:  # every slot; row r reads slot_index[r]'s
        return keys[:, :, : where.num_columns], values[:, :, : where.num_columns]
    if where.rows is not None:
        return keys[where.rows, :, : where.num_columns], values[where.rows, :, : where.num_columns]
    return (
        keys.index_select(0, where.slot_index)[:, :, : where.num_columns],
        values.index_select(0, where.slot_index)[:, :, : where.num_columns],
    )
