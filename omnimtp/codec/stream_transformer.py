"""code2wav's sliding-window transformer, streamed: every stream of a decode call in one forward of the shared
decoder runtime.

Qwen3-Omni's code2wav and Qwen3-TTS's 12 Hz decoder run the same transformer before their conv stacks
(transformers' `Qwen3OmniMoeCode2WavTransformerModel`: pre-norm layers with LayerScale, every layer attending in a
sliding window of 72 frames; Qwen3-TTS's between two projections). A streamed decode call brings a few new frames of
each of several streams. Here they run as one forward of `omnimtp.runtime.decoder` (`decoder_layers`, packed once
from the module): every frame of every stream is a row of one position, so each weight is read once for all of
them, on omnimtp's row kernel (which computes each row on its own), and each frame attends to its own stream's keys
where they lie (`KVCache.plan_positions`; the attention kernel leaves masked keys out): a stream's outputs are bit
for bit the same whichever streams share the call.

- one `KVCache` with a slot per stream (a stream takes a free slot when it is made and gives it back when it is
  collected), each slot at a fixed capacity: the window's last 71 frames and a piece of new ones (`KVCache.slide`
  before a piece that would not fit);
- a chunk of more than PIECE_FRAMES frames runs in pieces of that many, one forward a round of pieces;
- RoPE tables made in blocks of ROPE_BLOCK positions, so a position's values never depend on the call.

The outputs equal transformers' forward within fp32 rounding: the row kernel and the attention kernel sum in
another order than MKL and SDPA (`tests/test_codec_transformer.py` bounds it). Without the row kernel (no compiler,
or `streaming.ROW_KERNEL_MAX_ROWS` 0) the streams run one at a time on torch's matmuls.

    transformer = StreamedTransformer(code2wav.pre_transformer)
    transformer.attach(stream)                                     # a slot for a new stream
    hidden = transformer.run([stream_a, stream_b], embeds, [1, 4], max_rows=64)   # embeds [5, H] → [5, H]
"""

from __future__ import annotations

import weakref

import torch

from omnimtp.runtime.decoder import ROW_KERNEL, PackedDecoder, decoder_layers
from omnimtp.runtime.kernels import small_batch_linear
from omnimtp.runtime.kv_cache import KVCache
from omnimtp.runtime.ops import linear, rms_norm

# A stream's frames go through the transformer in pieces of at most this many: a slot holds the window's kept frames
# and one piece, whatever the chunk.
PIECE_FRAMES = 64
ROPE_BLOCK = 1024  # positions whose RoPE tables are made in one call


class StreamedTransformer:
    """code2wav's transformer (its `pre_transformer`; with `input_proj` / `output_proj` where it has them, as
    Qwen3-TTS's) over the new frames of several streams at once; see the module docstring. Packed on first use and
    again when its weights change (as `runtime.decoder.weights_fingerprint` sees them)."""

    def __init__(self, module: torch.nn.Module):
        self.module = module
        self.window = int(module.config.sliding_window)
        self.cache: KVCache | None = None
        self._free_slots: list[int] = []
        self._packed: tuple | None = None  # (fingerprint, PackedDecoder, input_proj pack, output_proj pack)
        self._params: list[torch.Tensor] | None = None
        self._plain: tuple | None = None  # (fingerprint, the PackedDecoder with float matrices) once needed
        self._rope: tuple[torch.Tensor, torch.Tensor] | None = None  # cos, signed_sin [P, D]

    @property
    def capacity(self) -> int:
        """Positions a stream's slot holds: the window's kept ones and a piece."""
        return self.window - 1 + PIECE_FRAMES

    def attach(self, stream) -> None:
        """Give `stream` (anything with a `slot` attribute that can be weakly referenced) a slot of its own, free
        again once the stream is collected."""
        decoder = self._decoder()[0]
        if self.cache is None:
            self.cache = KVCache(decoder, 1, self.capacity, is_growable=False)
            self._free_slots.append(0)
        if not self._free_slots:
            self._free_slots.extend(self.cache.add_slots(self.cache.max_batch_size))
        stream.slot = self._free_slots.pop(0)
        self.cache.reset(stream.slot)
        stream.slot_owner = self
        weakref.finalize(stream, self._free_slots.append, stream.slot)

    @torch.no_grad()
    def run(self, streams: list, x: torch.Tensor, counts: list[int], max_rows: int) -> torch.Tensor:
        """x [N, H_in]: counts[i] new frames of streams[i], stream by stream (N = Σ counts) → the transformer's
        output [N, H_out] (after its final norm and output projection), every stream's cache advanced. Pieces of
        up to max_rows frames a stream run on the row kernel, all streams in one forward; max_rows 0 (or no kernel):
        one stream at a time on torch's matmuls."""
        if any(getattr(stream, "slot_owner", None) is not self for stream in streams):
            raise ValueError("streams: each must come from this decoder's new_stream")
        decoder, input_pack, output_pack = self._decoder()
        if decoder.row_kernel is None or max_rows < 1:
            plain = self._plain_decoder()
            pieces = []
            for stream, rows in zip(streams, x.split(counts), strict=True):
                hidden = self._project(rows, "input_proj", None)
                hidden = self._pieces(plain, [stream.slot], hidden, [rows.shape[0]], PIECE_FRAMES)
                pieces.append(self._project(hidden, "output_proj", None))
            return torch.cat(pieces)
        hidden = self._project(x, "input_proj", input_pack)
        hidden = self._pieces(decoder, [stream.slot for stream in streams], hidden, counts, min(max_rows, PIECE_FRAMES))
        return self._project(hidden, "output_proj", output_pack)

    def _pieces(self, decoder: PackedDecoder, slots: list[int], x: torch.Tensor, counts: list[int],
                piece: int) -> torch.Tensor:
        """The layers and final norm over x [N, H], each slot's frames in rounds of up to `piece` (one forward a
        round) → [N, H]."""
        if max(counts) <= piece:
            return self._forward(decoder, slots, x, counts)
        starts = [0]
        for count in counts:
            starts.append(starts[-1] + count)
        out = torch.empty_like(x)
        for done in range(0, max(counts), piece):
            members = [i for i, count in enumerate(counts) if count > done]
            takes = [min(piece, counts[i] - done) for i in members]
            rows = torch.cat([x[starts[i] + done : starts[i] + done + take] for i, take in zip(members, takes,
                                                                                                 strict=True)])
            hidden = self._forward(decoder, [slots[i] for i in members], rows, takes)
            for i, part in zip(members, hidden.split(takes), strict=True):
                out[starts[i] + done : starts[i] + done + part.shape[0]] = part
        return out

    def _forward(self, decoder: PackedDecoder, slots: list[int], x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """One forward: counts[i] new positions of slot slots[i] in x [M, H] (each fits a slot's capacity) → the
        final norm's output [M, H]."""
        cache = self.cache
        for slot, count in zip(slots, counts, strict=True):
            if cache.lengths[slot] + count > cache.capacity:
                cache.slide(slot, self.window - 1)  # all a new position's window reaches back to
        positions = [cache.rope_offsets[s] + cache.lengths[s] + j
                     for s, count in zip(slots, counts, strict=True) for j in range(count)]
        where = cache.plan_positions(slots, counts)
        columns = where.positions  # [M, 1]
        keys = torch.arange(where.num_columns)
        mask = ((keys <= columns) & (keys > columns - self.window))[:, None, None]  # [M, 1, 1, S]: causal, windowed
        gemm = None if decoder.row_kernel is None else ROW_KERNEL
        out, _ = decoder_layers(decoder, x[:, None], self._rope_rows(decoder, positions), cache.layer_views, where,
                                mask, packed_layers=decoder.row_kernel, gemm=gemm)
        cache.commit_positions(slots, counts)
        return rms_norm(out[:, 0], decoder.final_norm, decoder.eps)

    def _rope_rows(self, decoder: PackedDecoder, positions: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, signed_sin) [M, 1, 1, D] of each row's position, from tables made ROPE_BLOCK positions a call."""
        top = max(positions)
        if self._rope is None or top >= self._rope[0].shape[0]:
            made = 0 if self._rope is None else self._rope[0].shape[0]
            blocks = [] if self._rope is None else [self._rope]
            while made <= top:
                cos, sin = decoder.rope.tables(torch.arange(made, made + ROPE_BLOCK)[None], decoder.dtype)
                blocks.append((cos.view(ROPE_BLOCK, -1), sin.view(ROPE_BLOCK, -1)))
                made += ROPE_BLOCK
            self._rope = (torch.cat([b[0] for b in blocks]), torch.cat([b[1] for b in blocks]))
        index = torch.tensor(positions)
        return self._rope[0].index_select(0, index)[:, None, None], self._rope[1].index_select(0, index)[:, None, None]

    def _project(self, x: torch.Tensor, name: str, pack: torch.Tensor | None) -> torch.Tensor:
        """The module's `name` projection (Qwen3-TTS's input_proj / output_proj; none: x) over x [M, K]: on the row
        kernel with `pack`, else the module's own forward on x as one request."""
        module = getattr(self.module, name, None)
        if module is None:
            return x
        if pack is None:
            return module(x[None])[0]
        out = linear(x, module.weight, packed=pack, gemm=ROW_KERNEL)
        return out if module.bias is None else out + module.bias

    def _decoder(self) -> tuple[PackedDecoder, torch.Tensor | None, torch.Tensor | None]:
        """(the packed transformer, the projections' row-kernel packs or None), packed again when a weight
        changed: on the row kernel alone where it applies (`PackedDecoder.row_kernel_only`: the packs, no fused
        float copies beside the module's own weights), else with its float matrices."""
        fingerprint = self._fingerprint()
        if self._packed is None or self._packed[0] != fingerprint:
            self._packed = self._plain = None  # the old packing freed before the new one is made
            plain = PackedDecoder.from_module(self.module, sliding_window=self.window)
            decoder = plain.row_kernel_only()
            if decoder is None:
                decoder, self._plain = plain, (fingerprint, plain)
            del plain
            packs = [None if decoder.row_kernel is None or getattr(self.module, name, None) is None
                     else small_batch_linear.pack_weight(getattr(self.module, name).weight.detach().contiguous())
                     for name in ("input_proj", "output_proj")]
            self._packed = (fingerprint, decoder, *packs)
            self._rope = None
        return self._packed[1:]

    def _plain_decoder(self) -> PackedDecoder:
        """The packed transformer with its float matrices, no row kernel (made when first needed: the streams run
        one at a time on torch's matmuls)."""
        fingerprint = self._fingerprint()
        if self._plain is None or self._plain[0] != fingerprint:
            self._plain = (fingerprint, PackedDecoder.from_module(self.module, sliding_window=self.window))
        return self._plain[1]

    def _fingerprint(self) -> tuple:
        """`runtime.decoder.weights_fingerprint` of the module's parameters, their list kept until one is replaced."""
        params = self._params
        if params is None or next(self.module.parameters()) is not params[0]:  # parameters replaced (a load)
            params = self._params = list(self.module.parameters())
        return tuple((p.data_ptr(), p._version) for p in params)

