"""The talker's code predictor: residual codebooks 1..G-1 of one audio frame.

Per frame the talker samples codebook 0; the code predictor (a small transformer) then fills codebooks
1..G-1 autoregressively, starting from two positions: the talker's last hidden state and the embedding
of code 0. Step j (0..G-2) predicts code j+1 with `lm_head[j]`; that code is embedded with
`codec_embedding[j]` and appended. Both tables cover only the residual codebooks: index 0 means CB1.

    seq = [h_talker, E0(cb0)]                       # [B, 2, H]
    for j in 0..G-2:
        code_j = argmax(lm_head[j](CP(seq)[:, -1]))  # [B]
        seq += codec_embedding[j](code_j)            # [B, 1, H]
    next_talker_input = E0(cb0) + sum_j codec_embedding[j](code_j) + text_step

Qwen3-TTS's code predictor keeps its codebook tables in the *talker's* width and maps every input row to
its own width with `small_to_mtp_projection` (a Linear when the widths differ): `CodePredictorRunner` then
projects [h_talker, E0(cb0)] and each code's embedding before the transformer, while the sum handed back
stays in the talker's width.

Three readings of that loop, all giving the same greedy codes as transformers' `cp.generate`:
- `predict_residual_codes`: re-prefill — the whole sequence every step, no cache.
- `predict_residual_codes_kv`: incremental with a transformers `DynamicCache` (2 positions, then 1).
- `CodePredictorRunner`: the serving path. Weights are packed once (fused QKV and gate/up matmuls,
  stacked per-step tables, RoPE tables for the G positions); the frame runs on a static KV buffer
  written by index; sampling noise is drawn from each row's generator before the loop, so the loop
  itself has no RNG and can be compiled whole. On a CPU in fp32, batches of 4 or more rows are padded
  to a power-of-two bucket and their matmuls run on MKL-packed weights; in bf16, batches of 2 or
  more rows run on oneDNN-reordered weights (`PackedMatrices`). The transformer is `omnimtp.runtime`'s
  decoder stack; its KV buffer is a fixed `KVCache` of G positions.
"""

from __future__ import annotations

import logging
import threading
import time
import types
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from omnimtp.runtime import tracing, w4a8_step
from omnimtp.runtime.decoder import PackedDecoder, decoder_layers
from omnimtp.runtime.kernels import small_batch_linear
from omnimtp.runtime.kv_cache import KVCache
from omnimtp.runtime.ops import (
    PACKED_GEMM_KINDS,
    PACKED_GEMM_MIN_ROWS,
    PackedGemm,
    cast,
    check_quantize,
    linear,
    packed_gemm_kinds,
    quantize_weight,
    rms_norm,
)
from omnimtp.sampling import (
    QWEN3_OMNI_CODE_PREDICTOR_SAMPLING,
    SamplingParams,
    exponential_noise,
    probs_from_logits,
    sample_from_probs,
)
from omnimtp.talker.compile_cache import meta_copy

logger = logging.getLogger(__name__)


class ResidualCodes(NamedTuple):
    """One frame's residual codes and their summed embedding (without code 0's)."""

    codes: torch.Tensor  # [B, G-1] long: column j is codebook j+1
    embed_sum: torch.Tensor  # [B, H] = sum_j codec_embedding[j](codes[:, j])


# ---------------------------------------------------------------------------------------------
# Input checks shared by every entry point.


def _check_hidden(name: str, x, hidden_size: int, batch_size: int | None = None) -> None:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor of shape [B, H], got {type(x).__name__}")
    if x.dim() != 2:
        raise ValueError(f"{name} must be [B, H] (rank 2), got shape {tuple(x.shape)}")
    if x.shape[1] != hidden_size:
        raise ValueError(f"{name} must have hidden size {hidden_size}, got shape {tuple(x.shape)}")
    if x.shape[0] < 1:
        raise ValueError(f"{name} must have at least one row, got shape {tuple(x.shape)}")
    if batch_size is not None and x.shape[0] != batch_size:
        raise ValueError(f"{name} has batch {x.shape[0]}, but last_talker_hidden has batch {batch_size}")
    if not x.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got {x.dtype}")


def _check_frame_inputs(
    last_talker_hidden: torch.Tensor, cb0_embed: torch.Tensor, hidden_size: int, dtype: torch.dtype
) -> None:
    _check_hidden("last_talker_hidden", last_talker_hidden, hidden_size)
    _check_hidden("cb0_embed", cb0_embed, hidden_size, batch_size=last_talker_hidden.shape[0])
    for name, x in (("last_talker_hidden", last_talker_hidden), ("cb0_embed", cb0_embed)):
        if x.dtype != dtype:
            raise ValueError(f"{name} must have dtype {dtype} (the code predictor's), got {x.dtype}")
    if cb0_embed.device != last_talker_hidden.device:
        raise ValueError(
            f"cb0_embed is on {cb0_embed.device}, but last_talker_hidden is on {last_talker_hidden.device}"
        )


def _param_dtype(module: torch.nn.Module) -> torch.dtype:
    return next(module.parameters()).dtype


# ---------------------------------------------------------------------------------------------
# Reference-shaped loops on the transformers module (greedy).


@torch.no_grad()
def predict_residual_codes(cp, last_talker_hidden: torch.Tensor, cb0_embed: torch.Tensor) -> torch.Tensor:
    """Greedy residual codes by re-prefill: the whole sequence goes through `cp.model` every step.

    cp: transformers' `Qwen3OmniMoeTalkerCodePredictorModelForConditionalGeneration`.
    last_talker_hidden, cb0_embed: [B, H]. Returns [B, G-1] long (column j = codebook j+1).

    Example (G=4, B=2): seq [2, 2, H] → code 1; seq [2, 3, H] → code 2; seq [2, 4, H] → code 3;
    stack → [[4, 5, 6], [7, 4, 9]]. The last code needs no further transformer pass."""
    _check_frame_inputs(last_talker_hidden, cb0_embed, cp.config.hidden_size, _param_dtype(cp))
    num_code_groups = cp.config.num_code_groups
    seq = torch.stack([last_talker_hidden, cb0_embed], dim=1)  # [B, 2, H]
    codes = []
    for j in range(num_code_groups - 1):
        last_hidden = cp.model(inputs_embeds=seq).last_hidden_state[:, -1]  # [B, H]
        code = cp.lm_head[j](last_hidden).argmax(dim=-1)  # [B]
        codes.append(code)
        if j < num_code_groups - 2:
            seq = torch.cat([seq, cp.model.codec_embedding[j](code)[:, None]], dim=1)  # [B, j+3, H]
    return torch.stack(codes, dim=1)  # [B, G-1]


@torch.no_grad()
def predict_residual_codes_kv(cp, last_talker_hidden: torch.Tensor, cb0_embed: torch.Tensor) -> torch.Tensor:
    """Greedy residual codes with a transformers `DynamicCache`: 2 positions first, then 1 per step,
    so the cache holds 2, 3, ..., G positions after the steps; RoPE positions follow the cache length.

    `lm_head` is applied to the step's whole `last_hidden_state` before slicing the last position, as
    `generate` does, which keeps the logits bit-identical to it. Same arguments and result as
    `predict_residual_codes`."""
    _check_frame_inputs(last_talker_hidden, cb0_embed, cp.config.hidden_size, _param_dtype(cp))
    num_code_groups = cp.config.num_code_groups
    cache = DynamicCache(config=cp.config)
    step_input = torch.stack([last_talker_hidden, cb0_embed], dim=1)  # [B, 2, H], then [B, 1, H]
    codes = []
    for j in range(num_code_groups - 1):
        hidden = cp.model(inputs_embeds=step_input, cache=cache, use_cache=True).last_hidden_state
        code = cp.lm_head[j](hidden)[:, -1].argmax(dim=-1)  # [B]
        codes.append(code)
        if j < num_code_groups - 2:
            step_input = cp.model.codec_embedding[j](code)[:, None]  # [B, 1, H]
    return torch.stack(codes, dim=1)  # [B, G-1]


@torch.no_grad()
def next_talker_input(
    cp, cb0_embed: torch.Tensor, residual_codes: torch.Tensor, text_step: torch.Tensor
) -> torch.Tensor:
    """The talker's next input embedding: the frame's G codec embeddings summed, plus the text row.

    cb0_embed: [B, H] (code 0 in the talker's own table); residual_codes: [B, G-1] long;
    text_step: [B, H] (the trailing text row for this step, or tts_pad). Returns a new [B, H]
    tensor; the inputs are not modified. The embeddings are summed as one reduction over the
    stacked [B, G, H] the way transformers' talker does, so the result is bit-identical to it."""
    hidden_size = cp.config.hidden_size
    num_code_groups = cp.config.num_code_groups
    _check_hidden("cb0_embed", cb0_embed, hidden_size)
    batch_size = cb0_embed.shape[0]
    _check_hidden("text_step", text_step, hidden_size)
    if text_step.shape[0] != batch_size:
        raise ValueError(f"text_step has batch {text_step.shape[0]}, but cb0_embed has batch {batch_size}")
    if not isinstance(residual_codes, torch.Tensor) or residual_codes.dim() != 2:
        raise ValueError(
            f"residual_codes must be a [B, G-1] tensor, got {getattr(residual_codes, 'shape', residual_codes)!r}"
        )
    if tuple(residual_codes.shape) != (batch_size, num_code_groups - 1):
        raise ValueError(
            f"residual_codes must have shape [{batch_size}, {num_code_groups - 1}], got {tuple(residual_codes.shape)}"
        )
    if residual_codes.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"residual_codes must be integer codes, got {residual_codes.dtype}")
    embeds = [cb0_embed[:, None]]  # G entries of [B, 1, H]
    for j in range(num_code_groups - 1):
        embeds.append(cp.model.codec_embedding[j](residual_codes[:, j])[:, None])
    return torch.cat(embeds, dim=1).sum(dim=1) + text_step  # [B, H]


# ---------------------------------------------------------------------------------------------
# The serving path: packed weights, a static KV buffer, one frame per call.


@dataclass(frozen=True)
class PredictorWeights:
    """The code predictor's transformer as a `PackedDecoder` (RMSNorm written op by op, fp32 manual
    attention: see the runtime's `rms_norm` and `attention`) plus its per-step tables."""

    decoder: PackedDecoder
    # G-1 of each, [V, H]: the module's own tensors where they are in the runner's dtype (no copy), else cast
    # copies; `quantized`'s lm_heads are zero-stride placeholders of their shapes (no data)
    lm_heads: tuple[torch.Tensor, ...]
    codec_embeddings: tuple[torch.Tensor, ...]
    cos: torch.Tensor  # [G, 1, D] (position, broadcast over heads)
    signed_sin: torch.Tensor  # [G, 1, D] = [-sin, sin] halves: rotate_half(x) * sin == roll(x) * signed_sin
    causal_mask: torch.Tensor  # [G, G] fp32 additive: row p is 0 up to column p, -inf after
    # Qwen3-TTS's `small_to_mtp_projection` (weight [H_cp, H_talker], bias [H_cp]); None: inputs in the
    # predictor's width
    input_projection: tuple[torch.Tensor, torch.Tensor | None] | None = None
    # `quantized`: the G-1 lm_heads in int8 (`ops.QuantizedWeight`), run in place of lm_heads; None: float
    quantized_lm_heads: tuple | None = None

    def quantized(self, quantize: str | None) -> PredictorWeights:
        """These weights with the transformer's linears quantized to `quantize` (`PackedDecoder.quantized`)
        and the G-1 lm_heads to int8 (weight-only) in every mode: with int4 layers, the residual
        codes' top-1 agreement with fp32 is 88.7% with int8 heads and 83.9% with int4 ones (0.6B widths, random
        weights, teacher forced: `benchmarks/quantized_quality.py`), and int8 heads read a quarter of the
        float heads' bytes. The float heads are not kept (zero-stride placeholders: `linear` reads only the
        quantized ones). None, or the mode these weights have: unchanged.
        ValueError naming `quantize` as `PackedDecoder.quantized` raises it."""
        decoder = self.decoder.quantized(quantize)
        if decoder is self.decoder and (quantize is None or self.quantized_lm_heads is not None):
            return self
        heads = tuple(quantize_weight(head.float(), "int8") for head in self.lm_heads)
        placeholders = tuple(torch.zeros((), dtype=head.dtype, device=head.device).expand(head.shape)
                             for head in self.lm_heads)
        return replace(self, decoder=decoder, lm_heads=placeholders, quantized_lm_heads=heads)


def input_projection(cp) -> torch.nn.Linear | None:
    """The code predictor's input projection (Qwen3-TTS's `small_to_mtp_projection` when it is a Linear), or None."""
    projection = getattr(cp, "small_to_mtp_projection", None)
    return projection if isinstance(projection, torch.nn.Linear) else None


def pack_predictor_weights(cp, dtype: torch.dtype, quantize: str | None = None,
                           stored: list[dict] | None = None) -> PredictorWeights:
    """cp's weights for the runner, in `dtype`. quantize, stored: the transformer's layers quantized as they are
    packed, or given as a quantized checkpoint stores them (`PackedDecoder.from_layers`); the lm_heads stay float
    until `PredictorWeights.quantized`."""
    config = cp.config
    num_code_groups = config.num_code_groups
    projection = input_projection(cp)
    decoder = PackedDecoder.from_module(cp.model, dtype=dtype, fused_norm=False, fp32_attention=True,
                                        quantize=quantize, stored=stored)
    if any(layer.router is not None or layer.qkv_bias is not None for layer in decoder.layers):
        raise ValueError("cp: only dense layers without attention biases are supported by CodePredictorRunner")
    positions = torch.arange(num_code_groups, device=decoder.device)[None]  # [1, G]
    cos, signed_sin = decoder.rope.tables(positions, dtype)  # [1, G, 1, D] each, as the module computes them
    return PredictorWeights(
        decoder=decoder,
        lm_heads=tuple(cast(head.weight, dtype) for head in cp.lm_head),
        codec_embeddings=tuple(cast(table.weight, dtype) for table in cp.model.codec_embedding),
        cos=cos[0].contiguous(),
        signed_sin=signed_sin[0].contiguous(),
        causal_mask=torch.full((num_code_groups, num_code_groups), float("-inf"), device=decoder.device).triu(1),
        input_projection=None if projection is None else (
            cast(projection.weight, dtype), None if projection.bias is None else cast(projection.bias, dtype)
        ),
    )


def _project(w: PredictorWeights, rows: torch.Tensor) -> torch.Tensor:
    """Input rows [B, T, H_in] in the predictor's width (the reference's one Linear call on them)."""
    if w.input_projection is None:
        return rows
    return F.linear(rows, *w.input_projection)


@dataclass(frozen=True)
class PackedMatrices:
    """Packed copies of the runner's matrices for one `PackedGemm` (see it for the kinds). MKL packs for
    `op.rows` rows: batches are padded to it, and the first step (2 positions per row) runs as two calls
    of `rows` rows (the second finds the matrix in cache). oneDNN and the row kernel take any row count."""

    op: PackedGemm
    layers: tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], ...]  # qkv, o, gate_up, down
    lm_heads: tuple[torch.Tensor, ...]  # [G-1] of this step's lm_head, packed

    @property
    def rows(self) -> int | None:
        return self.op.rows


def pack_matrices(w: PredictorWeights, kind: str, rows: int) -> PackedMatrices:
    """Pack every matrix of w; rows: the row count MKL packs for (oneDNN takes it as a hint)."""
    op = PackedGemm(kind, rows if kind == "mkl" else None)
    return PackedMatrices(
        op=op,
        layers=tuple(
            tuple(op.pack(m, rows) for m in (layer.qkv, layer.o, layer.gate_up, layer.mlp_down))
            for layer in w.decoder.layers
        ),
        lm_heads=tuple(op.pack(head, rows) for head in w.lm_heads),
    )


def _step(
    w: PredictorWeights,
    kv_cache: torch.Tensor,
    step_input: torch.Tensor,
    positions: torch.Tensor,
    lm_head: torch.Tensor,
    codec_embedding: torch.Tensor,
    embed_sum: torch.Tensor,
    sampling: SamplingParams | None,
    noise: torch.Tensor | None,
    gemm: PackedMatrices | None = None,
    packed_lm_head: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One predictor step: the transformer on the new positions, then one residual code.

    step_input [B, T, H] at positions [T] (long; T = 2 for the first step, then 1); the step's keys and
    values are written into kv_cache [L, 2, B_max, Nkv, G, D] (the runner's `KVCache` buffer) at those
    positions. lm_head: this step's [V, H], codec_embedding: its [V, H]. embed_sum [B, H]: the residual
    embeddings so far. noise [B, V] ~ Exp(1) when sampling. gemm: None, or the packed matrices (see
    `PackedMatrices`; MKL's are for B = gemm.rows rows); packed_lm_head: this step's lm_head, packed
    (or quantized: `PredictorWeights.quantized`).
    Returns code [B] (long), its embedding [B, H_in] (the codec table's width) and embed_sum + that
    embedding; step_input is already in the predictor's width (`_project`). Shapes never depend on
    the position, so one compiled graph serves every decode step."""
    batch_size = step_input.shape[0]
    decoder = w.decoder
    rope = (w.cos.index_select(0, positions), w.signed_sin.index_select(0, positions))  # [T, 1, D] each
    mask = w.causal_mask.index_select(0, positions)  # [T, G]
    if gemm is not None and gemm.rows is not None and batch_size != gemm.rows:
        raise ValueError(f"step_input has {batch_size} rows, the packed matrices are for {gemm.rows}")
    op = None if gemm is None else gemm.op
    native = None if gemm is not None or tracing.is_compiling() else w4a8_step.step_table(decoder)
    if native is not None:  # w4a8, eager: every layer in one native call (`omnimtp.runtime.w4a8_step`)
        x = w4a8_step.run_block(decoder, native, step_input, rope, kv_cache, positions)
    else:
        x, _ = decoder_layers(
            decoder, step_input, rope, kv_cache, positions, mask,
            packed_layers=None if gemm is None else gemm.layers, gemm=op,
        )
    hidden = rms_norm(x[:, -1], decoder.final_norm, decoder.eps, fused=False)  # [B, H]
    logits = linear(hidden, lm_head, packed=packed_lm_head, gemm=op)  # [B, V]
    if sampling is None:
        code = logits.argmax(dim=-1)
    else:
        code = sample_from_probs(probs_from_logits(logits, sampling), noise)
    embed = F.embedding(code, codec_embedding)  # [B, H]
    return code, embed, embed_sum + embed


def _frame_loop(
    step,
    w: PredictorWeights,
    kv_cache: torch.Tensor,
    step_input: torch.Tensor,
    positions: list[torch.Tensor],
    lm_heads: list[torch.Tensor],
    codec_embeddings: list[torch.Tensor],
    sampling: SamplingParams | None,
    noise: torch.Tensor | None,
    gemm: PackedMatrices | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The G-1 predictor steps of one frame. step_input [R, 2, H_in] = [h, E0(cb0)]; step: `_step` or
    its compiled form. Returns codes [R, G-1] and their summed embeddings [R, H_in]."""
    codes = []
    packed_lm_heads = gemm.lm_heads if gemm is not None else w.quantized_lm_heads or [None] * len(lm_heads)
    embed_sum = torch.zeros_like(step_input[:, 0])  # [R, H_in]
    step_input = _project(w, step_input)
    for j in range(len(lm_heads)):
        code, embed, embed_sum = step(
            w, kv_cache, step_input, positions[j], lm_heads[j], codec_embeddings[j], embed_sum, sampling,
            None if noise is None else noise[:, j], gemm, packed_lm_heads[j],
        )
        codes.append(code)
        step_input = _project(w, embed[:, None])  # [R, 1, H]
    return torch.stack(codes, dim=1), embed_sum


def _own_copy(fn):
    """A new function object with its own code object. torch.compile caches graphs per code object,
    with a limit of 8 per code object (`recompile_limit`): a copy per runner and bucket keeps one
    bucket's graphs from evicting or exhausting another's, however many buckets a runner has."""
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


def _compiled_pair(mode: str):
    """(step, frame) callables of one bucket's compiled graphs: "step" compiles `_step` (two graphs:
    the first step and every later one), "frame" the whole `_frame_loop` (one graph)."""
    if mode == "step":
        return torch.compile(_own_copy(_step), dynamic=False), _frame_loop
    return _step, torch.compile(_own_copy(_frame_loop), dynamic=False)


def _wait_until_set(event: threading.Event | None, stop: threading.Event) -> bool:
    """Wait until `event` is set (None: at once); False if `stop` is set first."""
    while event is not None and not event.wait(0.05):
        if stop.is_set():
            return False
    return not stop.is_set()


class CodePredictorRunner:
    """Runs the code predictor one frame per call on packed weights and a static KV buffer.

        runner = CodePredictorRunner(cp, max_batch_size=8)
        codes, embed_sum = runner.run(last_talker_hidden, cb0_embed)                     # greedy
        out = runner.run(h, e0, QWEN3_OMNI_CODE_PREDICTOR_SAMPLING, make_generators([1, 2]))

    cp: transformers' `Qwen3OmniMoeTalkerCodePredictorModelForConditionalGeneration`, or Qwen3-TTS's code
    predictor (`omnimtp.models.qwen3_tts`: inputs in the talker's width, `small_to_mtp_projection`). Its weights are
    copied (cast to `dtype`, default cp's own) and packed at construction; later changes to cp are
    not seen.

    compile: False (eager); "auto": "frame" unless the eager predictor runs omnimtp's native w4a8 step (a w4a8
    predictor on a CPU in fp32, `runtime.w4a8_step`), which is as fast as the compiled frame at real widths and
    builds nothing (then eager); "step" (or True) wraps one predictor step in `torch.compile`: two graphs
    (first step, and every later step) per batch size and sampling setting; "frame" compiles the
    whole frame, all G-1 steps, as one graph per batch size and sampling setting: no per-step
    dispatch at all, the fastest at small dims, but its first compile takes minutes on a CPU
    (inductor caches it on disk, so later processes take seconds). Each bucket (below) and sampling
    setting has compiled callables of its own, so every bucket is really compiled, never cut off by
    torch.compile's recompile limit. A graph compiles on first use, or ahead of it with `warm_up`, which a
    server runs in a background thread: meanwhile `run` serves each bucket eagerly (same padding, same
    packed weights, the same codes) and switches to its compiled graph once that is built.

    `packed_gemm`: None (default: the best available, see `packed_gemm_kinds`), False (plain kernels),
    True (the best available, an error if none), or a kind, "row", "mkl" or "onednn" (an error if it
    cannot run here). fp32 "row" — every matmul, of any batch size, runs omnimtp's small-batch
    kernel (its AVX-512 or AVX2 build) on one copy of the matrices in its panel layout (AVX-512, real
    dims, one core: 8 rows ~1.8x less time per matmul than MKL's packed SGEMM, ~3x less than `F.linear`,
    1 row as fast as `torch.mv`; AVX2, Qwen3-TTS 0.6B's predictor, 2 threads: a frame 2.0x faster than
    MKL / `F.linear` at 1 row, 2.6x at 8, 1.6x at 16),
    and since it computes each row on its own, a row's codes are bit for bit the same in any batch
    (eager; compiled, fewer than 4 rows of a matrix under 4 MB run `torch.mv` / `F.linear`);
    fp32 "mkl" — a batch of B >= 4 rows is padded with zero
    rows to the next power of two (at most max_batch_size) and its matmuls run on weights packed by MKL
    for that row count (packed lazily, once per bucket; each bucket holds a packed copy of the matrices;
    padding also keeps the set of compiled shapes small); bf16 "onednn" — every batch of 2 or more rows runs on
    one copy of the matrices reordered by oneDNN (~20% less time per matmul than `F.linear` at real
    dims). bf16: the same values as plain kernels; fp32: equal up to rounding.

    `quantize`: None, or a mode of `ops.QUANTIZE_MODES`: the transformer's linears quantized
    (`PackedDecoder.quantized`), on omnimtp's CPU kernel for every batch size (packed_gemm is then off);
    a row's codes still depend only on its own inputs. ValueError naming it where it cannot run.

    `weights`: cp's packed weights made before (`pack_predictor_weights`, quantized or not), to share one copy
    between the runners of several batch sizes; cp then gives only its config and shapes (its matrices may
    have been released, `Qwen3TTSModel.release_decoder_linears`).

    Greedy codes equal `predict_residual_codes` / transformers' `generate` in fp32. When sampling, row
    b draws all its noise from `generators[b]` before the loop, so a row's codes depend only on its
    own inputs and generator — not on the batch size, the other rows or their order.
    """

    def __init__(
        self, cp, max_batch_size: int, dtype: torch.dtype | None = None, compile: bool | str = False,
        packed_gemm: bool | None = None, quantize: str | None = None, weights: PredictorWeights | None = None,
    ):
        if isinstance(max_batch_size, bool) or not isinstance(max_batch_size, int) or max_batch_size < 1:
            raise ValueError(f"max_batch_size must be an integer >= 1, got {max_batch_size!r}")
        if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
            raise ValueError(f"dtype must be None or a floating-point torch.dtype, got {dtype!r}")
        if compile is True:
            compile = "step"
        if compile not in (False, "auto", "step", "frame"):
            raise ValueError(f'compile must be False, True, "auto", "step" or "frame", got {compile!r}')
        if packed_gemm is not None and not isinstance(packed_gemm, bool) and packed_gemm not in PACKED_GEMM_KINDS:
            raise ValueError(
                f"packed_gemm must be None, True, False or one of {PACKED_GEMM_KINDS}, got {packed_gemm!r}"
            )
        config = cp.config
        self.num_code_groups = config.num_code_groups
        # the width of its inputs: the talker's (the codec tables'), the predictor's own unless projected
        self.hidden_size = cp.model.codec_embedding[0].weight.shape[1]
        self.vocab_size = config.vocab_size
        self.max_batch_size = max_batch_size
        self.dtype = dtype if dtype is not None else _param_dtype(cp)
        self.device = next(cp.parameters()).device
        self.compile_mode = compile or None  # None, "step" or "frame"
        kinds = packed_gemm_kinds(self.device, self.dtype)
        if isinstance(packed_gemm, str) and packed_gemm not in kinds:
            raise ValueError(
                f"packed_gemm={packed_gemm!r} cannot run {self.dtype} on {self.device} here (available: {kinds})"
                + (f"; {small_batch_linear.unavailable_reason()}" if packed_gemm == "row" else "")
            )
        if packed_gemm is True and not kinds:
            raise ValueError(
                "packed_gemm=True needs float32 (omnimtp's row kernel or MKL) or bfloat16 (oneDNN with bf16 "
                f"support) on a CPU; the runner has {self.dtype} on {self.device}"
            )
        # "row", "mkl", "onednn" or None: what batches of several rows run on
        self.packed_gemm_kind = packed_gemm if isinstance(packed_gemm, str) else (kinds[0] if kinds else None)
        self.packed_gemm = self.packed_gemm_kind is not None and packed_gemm is not False
        self._gemms: dict[int, PackedMatrices] = {}  # bucket rows -> packed matrices, made on first use
        self._lock = threading.Lock()  # `_gemms` and `_compiled` are filled from the serving and warm-up threads
        # (bucket rows, is_sampled) -> its (step, frame) callables; `_warm`: the keys whose graphs are built
        self._compiled: dict[tuple[int, bool], tuple] = {}
        self._warm: set[tuple[int, bool]] = set()
        self._building: set[tuple[int, bool]] = set()  # keys whose graphs a thread is building now
        self._is_warming = False  # a `warm_up` is under way: `run` does not compile, it runs eagerly meanwhile
        # cp's modules without their data: what a child process builds a twin from (`compile_cache`)
        self.shape_model = meta_copy(cp)
        if weights is not None and weights.decoder.dtype != self.dtype:
            raise ValueError(f"weights: packed in {weights.decoder.dtype}, the runner runs {self.dtype}")
        with torch.no_grad():
            self.weights = weights if weights is not None else pack_predictor_weights(cp, self.dtype)
        if quantize is not None:
            check_quantize(quantize, self.device)
            self.weights = self.weights.quantized(quantize)
            self.packed_gemm_kind, self.packed_gemm = None, False  # the quantized kernel runs every row count
        self.quantize = quantize
        if compile == "auto":  # the native w4a8 step is the compiled frame's equal, and compiles nothing
            self.compile_mode = None if w4a8_step.step_table(self.weights.decoder) is not None else "frame"
        # [L, 2, B_max, Nkv, G, D], written at static positions (every frame starts at position 0)
        self.kv = KVCache(self.weights.decoder, max_batch_size, capacity=self.num_code_groups, is_growable=False)
        # Per-step views, made once: step j uses lm_head[j] and codec_embedding[j].
        self._lm_heads = list(self.weights.lm_heads)
        self._codec_embeddings = list(self.weights.codec_embeddings)
        # The first step writes positions 0 and 1 ([h, E0(cb0)]); step j >= 1 writes position j + 1.
        self._positions = [torch.arange(2, device=self.device)] + [
            torch.tensor([j + 1], device=self.device) for j in range(1, self.num_code_groups - 1)
        ]

    def _run_frame(
        self, last_talker_hidden: torch.Tensor, cb0_embed: torch.Tensor, sampling: SamplingParams | None,
        noise: torch.Tensor | None, kv: KVCache | None = None, is_warm_up: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, H] x2 → codes [B, G-1], embed_sum [B, H]; noise [B, G-1, V] when sampling. kv: the KV buffer
        (default the runner's; `warm_up` has its own). is_warm_up: build the bucket's graph now."""
        w = self.weights
        batch_size = last_talker_hidden.shape[0]
        num_rows = batch_size if self.compile_mode is None else self.bucket_rows(batch_size)
        gemm = self._packed_gemm_for(num_rows)
        if gemm is not None and gemm.rows is not None:
            num_rows = max(num_rows, gemm.rows)
        step_input = torch.stack([last_talker_hidden, cb0_embed], dim=1)  # [B, 2, H], then [B, 1, H]
        if num_rows > batch_size:  # zero rows up to the bucket; dropped at the end
            step_input = F.pad(step_input, (0, 0, 0, 0, 0, num_rows - batch_size))  # [R, 2, H]
            if noise is not None:
                # [R, G-1, V]; a valid Exp(1) value
                noise = F.pad(noise, (0, 0, 0, 0, 0, num_rows - batch_size), value=1.0)
        key = (num_rows, noise is not None)
        step, frame, is_building = self._callables(key, is_warm_up)
        try:
            codes, embed_sum = frame(
                step, w, (kv or self.kv).buffer, step_input, self._positions, self._lm_heads,
                self._codec_embeddings, sampling, noise, gemm,
            )  # [R, G-1], [R, H]
        finally:
            if is_building:
                with self._lock:
                    self._building.discard(key)
        if is_building:
            self._warm.add(key)
        return codes[:batch_size], embed_sum[:batch_size]

    def _callables(self, key: tuple[int, bool], is_warm_up: bool):
        """(step, frame, is_building) for a bucket: its compiled callables once its graphs are built;
        otherwise the caller builds them (is_building), unless another thread is building them or a
        warm-up is under way (not the caller): then eager, the same codes without waiting, and without
        touching torch.compile (whose first call imports dynamo and inductor: seconds)."""
        if self.compile_mode is None:
            return _step, _frame_loop, False
        with self._lock:
            if key in self._warm:
                return *self._compiled[key], False
            if key in self._building or (self._is_warming and not is_warm_up):
                return _step, _frame_loop, False
            if key not in self._compiled:
                self._compiled[key] = _compiled_pair(self.compile_mode)
            self._building.add(key)
            return *self._compiled[key], True

    def warm_up(self, on_bucket=None, stop: threading.Event | None = None, *,
                sampling: SamplingParams = QWEN3_OMNI_CODE_PREDICTOR_SAMPLING, idle: threading.Event | None = None,
                fill_cache_in_child: bool = False) -> bool:
        """Build every bucket's graphs (greedy, and sampled with `sampling`: the family's predictor settings)
        before they are needed, on zero inputs and a KV buffer of its own: safe to run in a background thread
        while another thread calls `run`, which serves a bucket eagerly until its graphs are built, then runs
        them. on_bucket(index, num_buckets, rows, seconds): called after each bucket. stop: checked before
        each graph (a graph being built cannot be interrupted). idle: a graph's build starts only while it is
        set (a server's "no request in flight"), so it does not compete with serving. fill_cache_in_child:
        first compile each graph in a child process at the lowest priority, stopped while `idle` is clear
        (`compile_cache.CacheFiller`); this thread's build of it is then a cache hit. Returns whether every
        bucket is warm (False: stopped, or an eager runner)."""
        if self.compile_mode is None:
            return False
        stop = stop if stop is not None else threading.Event()
        filler = None
        if fill_cache_in_child:
            from omnimtp.talker.compile_cache import CacheFiller

            try:
                filler = CacheFiller(self, sampling, idle=idle, stop=stop)
            except (OSError, RuntimeError, TypeError, AttributeError) as exc:  # e.g. a module that cannot be copied
                logger.warning("warm-up: no cache-filling process (%s); compiling in this process", exc)
        kv = KVCache(self.weights.decoder, self.max_batch_size, capacity=self.num_code_groups, is_growable=False)
        buckets = self.buckets
        self._is_warming = True
        try:
            started = time.perf_counter()
            for rows, graph_sampling in self.graph_settings(sampling):
                if filler is not None and not filler.wait_built(rows, graph_sampling is not None):
                    return False
                if not _wait_until_set(idle, stop):
                    return False
                self.build_graph(rows, graph_sampling, kv)
                if graph_sampling is not None:
                    if on_bucket is not None:
                        on_bucket(buckets.index(rows) + 1, len(buckets), rows, time.perf_counter() - started)
                    started = time.perf_counter()
            return True
        finally:
            self._is_warming = False
            if filler is not None:
                filler.close()

    @property
    def buckets(self) -> list[int]:
        """The row counts a compiled runner pads batches to, smallest first (`bucket_rows`)."""
        return sorted({self.bucket_rows(b) for b in range(1, self.max_batch_size + 1)})

    def graph_settings(self, sampling: SamplingParams) -> list[tuple[int, SamplingParams | None]]:
        """(rows, sampling or None for greedy) of every graph `warm_up` builds, in its order: smallest bucket first."""
        return [(rows, graph_sampling) for rows in self.buckets for graph_sampling in (None, sampling)]

    def build_graph(self, rows: int, sampling: SamplingParams | None, kv: KVCache | None = None) -> None:
        """Build one bucket's greedy (sampling None) or sampled graph by running it once on zero inputs
        (kv: the KV buffer to run on; default a new one)."""
        if kv is None:
            kv = KVCache(self.weights.decoder, self.max_batch_size, capacity=self.num_code_groups, is_growable=False)
        rows_in = torch.zeros((rows, self.hidden_size), dtype=self.dtype, device=self.device)
        with torch.inference_mode():
            noise = None
            if sampling is not None:
                # a valid Exp(1) draw
                noise = torch.ones((rows, self.num_code_groups - 1, self.vocab_size), device=self.device)
            self._run_frame(rows_in, rows_in, sampling, noise, kv, is_warm_up=True)

    @property
    def num_compiled_graphs(self) -> int:
        """Graphs torch.compile has built for this runner, over every bucket's callables."""
        from torch._dynamo.eval_frame import _debug_get_cache_entry_list

        count = 0
        for pair in self._compiled.values():
            for fn in pair:
                if fn is not _step and fn is not _frame_loop:
                    count += len(_debug_get_cache_entry_list(fn._torchdynamo_orig_callable.__code__))
        return count

    def bucket_rows(self, batch_size: int) -> int:
        """The rows a compiled runner runs a batch of `batch_size` on: the next power of two, at most
        max_batch_size. Padding to a few buckets keeps the compiled graphs few (a server warms them all
        up), and a row's codes do not depend on the zero rows beside it."""
        return min(1 << (batch_size - 1).bit_length(), self.max_batch_size)

    @property
    def num_graphs(self) -> int:
        """How many graphs a compiled runner builds: per bucket, greedy and sampled ("step": the first
        step and the later ones each)."""
        return len(self.buckets) * 2 * (2 if self.compile_mode == "step" else 1)

    def _packed_gemm_for(self, batch_size: int) -> PackedMatrices | None:
        """The packed matrices for a batch of `batch_size` rows, or None when packing is off or (MKL)
        the batch is small. MKL: one set per power-of-two bucket (at most max_batch_size), the batch is
        padded to it; oneDNN: one set for every row count, packed with max_batch_size as the hint."""
        if not self.packed_gemm:
            return None
        if self.packed_gemm_kind in ("onednn", "row"):
            rows = self.max_batch_size
        elif batch_size < PACKED_GEMM_MIN_ROWS:
            return None
        else:
            rows = self.bucket_rows(batch_size)
        with self._lock:
            if rows not in self._gemms:
                with torch.no_grad():
                    self._gemms[rows] = pack_matrices(self.weights, self.packed_gemm_kind, rows)
            return self._gemms[rows]

    def run(
        self,
        last_talker_hidden: torch.Tensor,
        cb0_embed: torch.Tensor,
        sampling: SamplingParams | None = None,
        generators: list[torch.Generator] | None = None,
    ) -> ResidualCodes:
        """One frame. last_talker_hidden, cb0_embed: [B, H] in the runner's dtype, B <= max_batch_size.
        sampling: None or greedy params → argmax; otherwise temperature / top-k / top-p as in
        transformers. generators: None (default RNG) or one `torch.Generator` per row.
        Returns ResidualCodes(codes [B, G-1] long, embed_sum [B, H] in the input dtype)."""
        _check_frame_inputs(last_talker_hidden, cb0_embed, self.hidden_size, self.dtype)
        batch_size = last_talker_hidden.shape[0]
        if batch_size > self.max_batch_size:
            raise ValueError(
                f"last_talker_hidden has batch {batch_size}, more than max_batch_size={self.max_batch_size}"
            )
        if last_talker_hidden.device != self.device:
            raise ValueError(f"last_talker_hidden is on {last_talker_hidden.device}, the runner on {self.device}")
        if sampling is not None and not isinstance(sampling, SamplingParams):
            raise ValueError(f"sampling must be None or a SamplingParams, got {type(sampling).__name__}")
        if generators is not None:
            if not isinstance(generators, (list, tuple)) or len(generators) != batch_size:
                count = len(generators) if isinstance(generators, (list, tuple)) else type(generators).__name__
                raise ValueError(
                    f"generators must be a list of {batch_size} torch.Generator (one per row), got {count}"
                )
            if not all(isinstance(g, torch.Generator) for g in generators):
                raise ValueError("generators must contain only torch.Generator objects")
        if sampling is not None and sampling.is_greedy:
            sampling = None
        noise = None
        # Every tensor the frame gets is made under inference mode, padded or not, as in `warm_up`: the
        # compiled graphs' guards see one kind of tensor, so a warm bucket never recompiles.
        with torch.inference_mode():
            if sampling is not None:
                noise_shape = (batch_size, self.num_code_groups - 1, self.vocab_size)
                noise = exponential_noise(noise_shape, None if generators is None else list(generators), self.device)
            codes, embed_sum = self._run_frame(last_talker_hidden, cb0_embed, sampling, noise)
        return ResidualCodes(codes=codes.clone(), embed_sum=embed_sum.clone())

