"""Streamed code2wav whose chunks join into exactly the one-shot decode, each chunk costing its own frames only.

transformers' `Qwen3OmniMoeCode2Wav` is: code embedding → a sliding-window transformer (72 frames,
stacked, so its reach grows with depth) → a causal conv / transposed-conv stack up to 1920 samples per
frame. A one-shot decode of F frames gives 1920·F − 555 samples: the transposed convolutions look one
input step ahead, so the last 555 samples would need frames that do not exist yet. (Qwen3-TTS's 12 Hz
decoder, `omnimtp.codec.speech_tokenizer`, runs the same stack with transposed convolutions trimmed on the
right only: 1920·F samples, none held back.)

We stream it in two parts, both exact:
- the transformer runs incrementally with its own KV cache (the sliding-window cache keeps the last 71
  frames of every layer), so its output for a chunk equals the one-shot output (up to float rounding); the
  frames of every stream of a call run in one forward (`omnimtp.codec.stream_transformer`);
- the conv stack is stateful: every layer keeps, per stream, exactly the inputs its next chunk needs from
  before it, at its own rate, so a chunk of n frames runs n frames' worth of convolution, whatever n:
  - a causal convolution of effective kernel K (dilation included) keeps its last K − 1 inputs (zeros
    before the first: its causal pad);
  - a transposed convolution (kernel k, stride s) keeps its last ⌈k/s⌉ − 1 inputs (one, for the stack's
    k = 2s; none for k = s) and runs over them and the chunk's inputs, so each output it emits is the one
    sum a whole-signal run makes; it emits the n·s outputs no later input reaches (the rest come with the
    next chunk) and, in a stream's first chunk, drops the layer's left trim (Qwen3-Omni: s; Qwen3-TTS: none);
  - a ConvNeXt block's depthwise convolution and a residual unit's dilated convolution keep their tails as
    above; SnakeBeta, LayerNorm and pointwise convolutions work step by step and keep nothing.
  Chunk [a, b) then emits global samples [1920·a − 555, 1920·b − 555) (from 0 for the first chunk), and
  the concatenation of all chunks equals the one-shot decode of all frames up to float rounding (oneDNN
  blocks a convolution's sums by its input's length, and a short chunk runs on the row kernel, or, in a bf16
  stack, as bf16 matmuls: there a sum that rounds to the other bf16 neighbour is carried through the stack,
  and the two decodes differ by about as much as either differs from the fp32 one).

    decoder = StreamingCode2Wav(model.code2wav)
    stream = decoder.new_stream()
    audio = decoder.decode([stream], [codes])     # codes [G, n] → [float32 numpy of 1920·n (− 555 once)]

Streams decoded in one call whose chunks have the same length (and, for a stack that trims on the left,
the same is-first) run the stack batched, each with its own states.

The conv stack holds nearly all of the arithmetic. `conv_dtype=torch.bfloat16` runs it on the CPU's bf16
instructions where it has them (AVX512_BF16), on a bf16 copy of the stack: an opt-in (`codec_dtype`, one of
`CODEC_DTYPES`) that changes the audio (docs/speech.md and docs/tts.md state by how much).
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
    Qwen3OmniMoeCausalConvNet,
    Qwen3OmniMoeSnakeBeta,
)

from omnimtp.codec.stream_transformer import StreamedTransformer
from omnimtp.runtime import tracing
from omnimtp.runtime.decoder import ROW_KERNEL
from omnimtp.runtime.kernels import bf16_rows_linear, small_batch_linear
from omnimtp.runtime.ops import linear

# The conv stack's dtypes by `codec_dtype` name: float32 (the reference's numbers), or bfloat16, an opt-in that
# runs the stack on the CPU's bf16 instructions and changes the audio.
CODEC_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}

# One row's output-rate activations from this size on: its conv stack runs alone (`_conv_stack`). The real
# decoders (96 channels at 24 kHz) reach it at chunks of 3 frames (1- and 2-frame chunks run batched), the tiny
# test models' chunks never.
ROW_STACK_BYTES = 2 << 20


@dataclass
class CodecStream:
    """One request's decoder state: its slot of the transformer's KV cache (`StreamedTransformer.attach`) and its
    conv states."""

    # per stateful layer of the conv stack, in the order the signal meets them (`StreamingCode2Wav.state_layers`):
    # its last inputs [1, C_in, K − 1] (a causal conv of effective kernel K) or [1, C_in, ⌈k/s⌉ − 1] (a transposed
    # conv)
    conv_states: list[torch.Tensor]
    num_frames: int = 0  # frames decoded so far
    slot: int = -1  # its slot of slot_owner's KV cache
    slot_owner: StreamedTransformer | None = field(default=None, repr=False, compare=False)


def codec_dtype_of(codec_dtype: str | None) -> torch.dtype:
    """The conv stack's torch dtype for a `CODEC_DTYPES` name (None: float32), or a ValueError naming
    codec_dtype."""
    if codec_dtype is None:
        return torch.float32
    if not isinstance(codec_dtype, str) or codec_dtype not in CODEC_DTYPES:
        raise ValueError(f"codec_dtype must be one of {sorted(CODEC_DTYPES)} or None, got {codec_dtype!r}")
    return CODEC_DTYPES[codec_dtype]


class StreamingCode2Wav:
    """Exact chunked decoding; see the module docstring. A stream's audio is bit for bit the same whichever
    other streams `decode` is given with it. conv_dtype: the conv stack's dtype (None: as code2wav's is);
    another than code2wav's runs on a copy of the stack in that dtype, and code2wav's own stays as it is."""

    def __init__(self, code2wav, conv_dtype: torch.dtype | None = None):
        if conv_dtype is not None and conv_dtype != _conv_stack_dtype(code2wav):
            code2wav = _with_conv_stack_in(code2wav, conv_dtype)
        self.code2wav = code2wav
        use_inplace_snake(code2wav)
        use_unpadded_pointwise_convs(code2wav)
        use_row_kernel_layers(code2wav)
        self.samples_per_frame = int(code2wav.total_upsample)
        self.num_lost_samples = _num_lost_samples(code2wav)
        self._kinds = _stream_kinds(code2wav)
        # the layers that keep a state per stream, in the order the signal meets them
        self.state_layers = [m for m in _conv_stack_modules(code2wav) if self._kinds.get(m) in ("causal", "transposed")]
        self._state_slot = {module: slot for slot, module in enumerate(self.state_layers)}
        # channels of one row's output-rate activations (the last conv's input: the largest tensors)
        last_conv = [m for m in _conv_stack_modules(code2wav) if isinstance(m, torch.nn.Conv1d)][-1]
        self._output_rate_channels = last_conv.in_channels
        self.transformer = StreamedTransformer(code2wav.pre_transformer)

    @property
    def conv_dtype(self) -> torch.dtype:
        """The conv stack's dtype: its input is cast to it (the transformer before it may run in another,
        e.g. fp32 with a bf16 stack: `SpeechTokenizerDecoder.to_conv_dtype`)."""
        return _conv_stack_dtype(self.code2wav)

    @property
    def output_rate_bytes_per_frame(self) -> int:
        """Bytes a frame of one row's output-rate activations takes."""
        return self.samples_per_frame * self._output_rate_channels * self.conv_dtype.itemsize

    def new_stream(self) -> CodecStream:
        stream = CodecStream(conv_states=self.new_conv_states())
        self.transformer.attach(stream)
        return stream

    def new_conv_states(self) -> list[torch.Tensor]:
        """A new stream's conv states: zeros (a causal conv's pad; a transposed conv's zero input before the first
        adds nothing)."""
        param = next(self.code2wav.upsample.parameters())
        states = []
        for module in self.state_layers:
            conv = module.conv
            if self._kinds[module] == "causal":
                width = module.padding
            else:
                width = -(-conv.kernel_size[0] // conv.stride[0]) - 1
            states.append(param.new_zeros((1, conv.in_channels, width)))
        return states

    def num_samples(self, num_frames: int) -> int:
        """Samples of the one-shot decode of `num_frames` frames."""
        return max(self.samples_per_frame * num_frames - self.num_lost_samples, 0)

    @torch.no_grad()
    def decode(self, streams: list[CodecStream], codes: list[torch.Tensor]) -> list[np.ndarray]:
        """Decode the next frames of each stream (codes[i]: [G, n_i] long, n_i >= 1) → float32 numpy
        chunks; stream i's chunks so far, joined, are the one-shot decode of its frames so far, and do
        not depend on the other streams of the call."""
        if len(streams) != len(codes):
            raise ValueError(f"codes: {len(codes)} code blocks for {len(streams)} streams")
        for block in codes:
            if block.dim() != 2 or block.shape[0] != self.code2wav.config.num_quantizers or block.shape[1] == 0:
                raise ValueError(f"codes: each block must be [G={self.code2wav.config.num_quantizers}, n>=1], "
                                 f"got {tuple(block.shape)}")
        if not streams:
            return []
        hiddens = self._advance_transformer(streams, codes)
        # a stack that trims on the left does so in a stream's first chunk only: first chunks run apart
        groups: dict[tuple[int, bool], list[int]] = {}
        for i, (stream, hidden) in enumerate(zip(streams, hiddens, strict=True)):
            is_start = stream.num_frames == 0 and self.num_lost_samples > 0
            groups.setdefault((hidden.shape[0], is_start), []).append(i)
        audio: list[np.ndarray | None] = [None] * len(streams)
        for (_, is_start), members in groups.items():
            wavs = self._conv_stack(torch.stack([hiddens[i] for i in members]), [streams[i] for i in members],
                                    is_start)  # [m, S]
            for row, i in enumerate(members):
                streams[i].num_frames += codes[i].shape[1]
                audio[i] = wavs[row].float().cpu().numpy()
        return audio

    def _advance_transformer(self, streams: list[CodecStream], codes: list[torch.Tensor]) -> list[torch.Tensor]:
        """codes[i] [G, n_i] → the transformer's output for each stream's frames [n_i, Hc], all streams in one
        forward (`StreamedTransformer.run`), their KV caches advanced."""
        c2w = self.code2wav
        counts = [block.shape[1] for block in codes]
        embeds = c2w.code_embedding(torch.cat(codes, dim=1) + c2w.code_offset[0]).mean(0)  # [N, Hc]
        return list(self.transformer.run(streams, embeds, counts, ROW_KERNEL_MAX_ROWS).split(counts))

    def _conv_stack(self, hidden: torch.Tensor, streams: list[CodecStream], is_start: bool) -> torch.Tensor:
        """transformers' Code2Wav forward after its transformer, continuing each stream's conv states:
        hidden [m, n, Hc] (row i: streams[i]'s next n frames) → [m, S] the new samples (S = 1920·n, less
        the stack's left trims where is_start: the streams' first chunk). Row i's samples are bit for bit
        those of `_conv_stack(hidden[i:i+1], streams[i:i+1], is_start)`: rows whose output-rate activations
        take ROW_STACK_BYTES or more run the stack one at a time (a batch of them would not stay in the CPU's
        cache, and every activation and residual add would stream from memory: the 0.6B Qwen3-TTS decoder
        at 8 streams of 12 frames took 1.25x the time batched, 2 threads, 2-core AVX2), smaller ones batched,
        with `RowwiseMatmuls`."""
        rows, frames = hidden.shape[:2]
        if rows > 1 and frames * self.output_rate_bytes_per_frame >= ROW_STACK_BYTES:
            return torch.cat([self._conv_stack(hidden[i : i + 1], streams[i : i + 1], is_start) for i in range(rows)])
        hidden = hidden.permute(0, 2, 1).to(self.conv_dtype)
        with RowwiseMatmuls() if rows > 1 else contextlib.nullcontext():  # the mode costs per op
            for blocks in self.code2wav.upsample:
                for block in blocks:
                    hidden = self._layer(block, hidden, streams, is_start)
            wav = hidden
            for block in self.code2wav.decoder:
                wav = self._layer(block, wav, streams, is_start)
        return wav.clamp(min=-1, max=1)[:, 0]

    def _layer(self, module, x: torch.Tensor, streams: list[CodecStream], is_start: bool) -> torch.Tensor:
        """One module of the stack over x [m, C, L], its stateful convolutions continuing the streams' states;
        the same ops in the same order as the module's forward otherwise."""
        kind = self._kinds[module]
        if kind == "causal":
            return self._causal_conv(module, x, streams)
        if kind == "transposed":
            return self._transposed_conv(module, x, streams, is_start)
        if kind == "convnext":  # transformers' ConvNeXt block, its depthwise convolution stateful
            hidden = self._causal_conv(module.dwconv, x, streams).permute(0, 2, 1)
            hidden = _linear(module.pwconv2, module.act(_linear(module.pwconv1, module.norm(hidden))))
            return x + (module.gamma * hidden).permute(0, 2, 1)
        if kind == "residual":  # transformers' residual unit, its dilated convolution stateful
            hidden = self._causal_conv(module.conv1, module.act1(x), streams)
            return module.conv2(module.act2(hidden)) + x
        if kind == "block":
            for part in module.block:
                x = self._layer(part, x, streams, is_start)
            return x
        return module(x)  # "stepwise": SnakeBeta, a pointwise convolution

    def _causal_conv(self, module, x: torch.Tensor, streams: list[CodecStream]) -> torch.Tensor:
        slot = self._state_slot[module]
        tail = torch.cat([stream.conv_states[slot] for stream in streams])  # [m, C_in, K − 1]
        out, tail = causal_conv_step(module, x, tail)
        for row, stream in enumerate(streams):
            stream.conv_states[slot] = tail[row : row + 1].clone()  # not a view of the whole input
        return out

    def _transposed_conv(self, module, x: torch.Tensor, streams: list[CodecStream], is_start: bool) -> torch.Tensor:
        """[m, C_in, L] → [m, C_out, L·s] (less the left trim where is_start): the outputs of the L new inputs
        that no later input reaches, computed over the kept last ⌈k/s⌉ − 1 inputs too, so that each is the one
        sum a whole-signal run makes (the matmul form's in its order)."""
        conv = module.conv
        slot = self._state_slot[module]
        tail = torch.cat([stream.conv_states[slot] for stream in streams])  # [m, C_in, ⌈k/s⌉ − 1]
        extended = torch.cat([tail, x], dim=-1)
        for row, stream in enumerate(streams):
            stream.conv_states[slot] = extended[row : row + 1, :, x.shape[-1] :].clone()
        start = tail.shape[-1] * conv.stride[0] + (module.left_pad if is_start else 0)
        stop = extended.shape[-1] * conv.stride[0]
        out = transposed_conv_as_matmul(module, extended)  # [m, C_out, stop], no bias
        if out is None:
            return conv(extended)[..., start:stop].contiguous()
        out = out[..., start:]
        return out.contiguous() if conv.bias is None else out + conv.bias[:, None]


def causal_conv_step(module, x: torch.Tensor, tail: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' causal convolution of stride 1 over x [B, C_in, L] continuing the inputs whose last K − 1
    steps are tail [B, C_in, K − 1] (zeros before a signal's first step: the module's own pad) → (out
    [B, C_out, L], the next tail: the last K − 1 steps of tail ++ x, a view). The module's forward over the
    whole signal gives the same outputs, up to float rounding where one of the two runs on the row kernel."""
    extended = torch.cat([tail, x], dim=-1)  # [B, C_in, K − 1 + L]
    out = conv_on_row_kernel(module, extended)
    if out is None:
        out = module.conv(extended)
    return out, extended[..., x.shape[-1] :]


def _stream_kinds(code2wav) -> dict:
    """How `StreamingCode2Wav._layer` runs each module of the conv stack it meets; a ValueError for a
    stack it cannot stream exactly (a strided causal conv; a transposed conv with padding, or trimmed
    otherwise than its whole overlap, at most a stride of it on the left)."""
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
        Qwen3OmniMoeCausalConvNet,
        Qwen3OmniMoeCausalTransConvNet,
        Qwen3OmniMoeCode2WavDecoderBlock,
        Qwen3OmniMoeCode2WavDecoderResidualUnit,
        Qwen3OmniMoeConvNeXtBlock,
        Qwen3OmniMoeSnakeBeta,
    )

    kinds = {}
    for module in _conv_stack_modules(code2wav):
        if isinstance(module, Qwen3OmniMoeCausalConvNet):
            if module.stride != 1:
                raise ValueError(f"code2wav: a causal conv of stride {module.stride} cannot be streamed")
            kinds[module] = "causal" if module.padding > 0 else "stepwise"
        elif isinstance(module, Qwen3OmniMoeCausalTransConvNet):
            conv = module.conv
            (kernel,), (stride,) = conv.kernel_size, conv.stride
            if (conv.padding != (0,) or conv.output_padding != (0,) or conv.dilation != (1,)
                    or module.right_pad != kernel - stride or module.left_pad > stride):
                raise ValueError("code2wav: a transposed conv trimmed otherwise than its overlap cannot be streamed")
            kinds[module] = "transposed"
        elif isinstance(module, Qwen3OmniMoeConvNeXtBlock):
            kinds[module] = "convnext"
        elif isinstance(module, Qwen3OmniMoeCode2WavDecoderResidualUnit):
            kinds[module] = "residual"
        elif isinstance(module, Qwen3OmniMoeCode2WavDecoderBlock):
            kinds[module] = "block"
        elif isinstance(module, Qwen3OmniMoeSnakeBeta):
            kinds[module] = "stepwise"
    top_level = [m for blocks in code2wav.upsample for m in blocks] + list(code2wav.decoder)
    unknown = sorted({type(m).__name__ for m in top_level if m not in kinds})
    if unknown:
        raise ValueError(f"code2wav: its conv stack holds modules that cannot be streamed: {unknown}")
    return kinds


class InplaceSnakeBeta(Qwen3OmniMoeSnakeBeta):
    """transformers' SnakeBeta, x + 1/(exp(β) + ε) · sin²(x · exp(α)), computed in one buffer when no gradient
    is recorded: the same ops in the same order (x · α, sin, its square, · 1/β, + x), so the same values bit
    for bit, without the four full-size temporaries the module allocates. Its activations run over every
    sample at 24 kHz: in place, the 12 Hz decoder's conv stack took 0.80x the time at 8 streams."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled():
            return super().forward(hidden_states)
        alpha = torch.exp(self.alpha.unsqueeze(0).unsqueeze(-1))
        inv_beta = 1.0 / (torch.exp(self.beta.unsqueeze(0).unsqueeze(-1)) + self.no_div_by_zero)
        out = torch.mul(hidden_states, alpha).sin_()
        return out.mul_(out).mul_(inv_beta).add_(hidden_states)


class PointwiseCausalConv(Qwen3OmniMoeCausalConvNet):
    """transformers' causal convolution of kernel 1 and stride 1, without its zero-width `F.pad`: that pad still
    copies the whole input (about a millisecond a call for the 96-channel 24 kHz tensors of a 25-frame chunk),
    and the convolution then runs on the same values in the same layout, so the output is the same bit for bit
    (a short input of a large layer runs on the row kernel instead: `causal_conv_on_row_kernel`)."""

    def forward(self, hidden_state: torch.Tensor) -> torch.Tensor:
        out = causal_conv_on_row_kernel(self, hidden_state)  # a short input of a large layer
        return self.conv(hidden_state).contiguous() if out is None else out


def use_unpadded_pointwise_convs(module: torch.nn.Module) -> None:
    """Make every causal convolution of kernel 1 and stride 1 under module a `PointwiseCausalConv`."""
    for child in module.modules():
        if type(child) is Qwen3OmniMoeCausalConvNet and child.kernel_size == 1 and child.stride == 1:
            child.__class__ = PointwiseCausalConv


# Up to this many rows a request (a stream's chunk: its frames in the transformer, its steps in the conv stack),
# linear layers, causal convolutions of stride 1 and transposed convolutions of at least ROW_KERNEL_MIN_WEIGHTS
# weights run on omnimtp's row kernel (`row_kernel_weight`); smaller matrices (the tiny test models') gain nothing
# from it.
ROW_KERNEL_MAX_ROWS = 64
ROW_KERNEL_MIN_WEIGHTS = 1 << 16


def row_kernel_weight(owner: torch.nn.Module, matrix: torch.Tensor, x: torch.Tensor) -> torch.Tensor | None:
    """matrix [N, K] (a view of owner's weight) packed for omnimtp's row kernel, kept on owner and made again
    when the weight changes; None where the kernel does not apply: a matrix under ROW_KERNEL_MIN_WEIGHTS, more
    than ROW_KERNEL_MAX_ROWS rows a request in x (x.shape[-2]: the rows of one stream), gradients recorded, x or
    the weight not fp32 on a CPU, or no kernel here. The kernel reads the weights once for all rows and
    computes each row on its own, so a stream's bits do not depend on the others in its batch (no
    `RowwiseMatmuls` needed), and a few rows take a fraction of the time MKL's matmul takes."""
    if (
        matrix.numel() < ROW_KERNEL_MIN_WEIGHTS or x.dim() < 2 or x.shape[-2] > ROW_KERNEL_MAX_ROWS
        or torch.is_grad_enabled() or x.dtype != torch.float32
        or matrix.dtype != torch.float32 or x.device.type != "cpu" or not small_batch_linear.available()
    ):
        return None
    key = (matrix.data_ptr(), matrix._version, tuple(matrix.shape))
    cached = owner.__dict__.get("_row_kernel_weight")
    if cached is None or cached[0] != key:
        cached = (key, small_batch_linear.pack_weight(matrix.detach().contiguous()))
        owner.__dict__["_row_kernel_weight"] = cached
    return cached[1]


class RowKernelLinear(torch.nn.Linear):
    """nn.Linear whose short inputs run on omnimtp's row kernel (`row_kernel_weight`), the bias added after
    the matmul; others as the module does. Equal to it within float rounding."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        packed = row_kernel_weight(self, self.weight, x)
        if packed is None:
            return super().forward(x)
        out = linear(x, self.weight, packed=packed, gemm=ROW_KERNEL)
        return out if self.bias is None else out + self.bias


def causal_conv_on_row_kernel(module: Qwen3OmniMoeCausalConvNet, hidden_state: torch.Tensor) -> torch.Tensor | None:
    """transformers' causal convolution of stride 1 over hidden_state [B, C_in, L] (its causal left pad of zeros
    included) on omnimtp's row kernel: `conv_on_row_kernel`."""
    extended = hidden_state if module.padding == 0 else F.pad(hidden_state, (module.padding, 0))
    return conv_on_row_kernel(module, extended)


# Up to this many steps a request (a convolution's output steps, a transposed convolution's input steps), a conv
# stack in one of SHORT_MATMUL_DTYPES runs its causal convolutions of kernel > 1 and its transposed convolutions as
# one matmul in that dtype (`F.linear` on a view of the weight, no copy of it), not as oneDNN's convolution: oneDNN's
# bf16 convolutions of a few steps cost nearly what long ones do. One thread, the 0.6B Qwen3-TTS decoder's layers at
# one frame's steps (bf16, AVX512_BF16): its 1024 → 1536 kernel-7 conv at 4 steps 3.8 ms → 0.9, its 768-channel
# dilated convs at 32 steps 1.65 → 0.75 (128 steps 3.4 → 2.5), its 768 → 384 transposed conv at 33 input steps
# 1.3 → 0.5, its 1024-channel upsamplers 0.6 → 0.2; at 384 channels and 160 steps the two were even, at 192 and
# 640 the convolution won; pointwise convolutions stay convolutions (faster there at every length).
SHORT_MATMUL_MAX_STEPS = 128
SHORT_MATMUL_DTYPES = (torch.bfloat16,)


def _short_matmul(weight: torch.Tensor, x: torch.Tensor, steps: int) -> bool:
    """Whether a layer of `weight` runs its `steps` steps of x as a matmul in its own dtype
    (SHORT_MATMUL_MAX_STEPS)."""
    return (steps <= SHORT_MATMUL_MAX_STEPS and weight.dtype in SHORT_MATMUL_DTYPES and x.dtype == weight.dtype
            and x.device.type == "cpu" and not torch.is_grad_enabled())


# Up to this many rows a request (a convolution's output steps, a transposed convolution's input steps, a linear
# layer's positions), a bf16 stack's matmuls run on omnimtp's bf16 rows kernel (`bf16_rows_linear`: AVX512_BF16,
# the weight read once for all requests' rows in its own layout, each row's sums in an order that does not depend on
# the others, so no `RowwiseMatmuls`), not as torch's bf16 matmul one request at a time. One thread, one request,
# the 0.6B Qwen3-TTS decoder's layers (`benchmarks/codec_rows.py --layers`): its 1024 → 1536 kernel-7 conv at 4
# steps 1.15 ms → 0.79, its 1536 → 768 transposed conv at 4 input steps 2.27 → 1.42 (17: 3.26 → 2.53), its
# 768-channel dilated convs at 4 steps 0.27 → 0.16, even at 17 and slower at 32 (0.89 → 1.04: past a few rows a
# layer's time is its arithmetic, which torch's packed GEMM does faster); four requests at 4 steps take 1.67, 2.39
# and 0.53 ms in one call against 4.70, 9.39 and 1.12. 17: a 4-frame chunk's 1536 → 768 transposed conv (16 steps
# and the kept one).
BF16_ROWS_MAX_STEPS = 17


def _rows_kernel(weight: torch.Tensor, x: torch.Tensor, steps: int) -> bool:
    """Whether a layer of `weight` runs its `steps` steps a request of x on the bf16 rows kernel
    (BF16_ROWS_MAX_STEPS, `bf16_rows_linear.applies`); where the CPU lacks AVX512_BF16, never."""
    return (steps <= BF16_ROWS_MAX_STEPS and weight.dtype == x.dtype == torch.bfloat16 and x.device.type == "cpu"
            and 1 in weight.stride() and not torch.is_grad_enabled() and not tracing.is_compiling()
            and bf16_rows_linear.available())


def _linear(module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """module(x) (x [B, L, C_in]), on the bf16 rows kernel where it takes it (`_rows_kernel`)."""
    if _rows_kernel(module.weight, x, x.shape[-2]):
        return bf16_rows_linear.bf16_rows_linear(x, module.weight, module.bias)
    return module(x)


def conv_on_row_kernel(module: Qwen3OmniMoeCausalConvNet, extended: torch.Tensor) -> torch.Tensor | None:
    """transformers' causal convolution of stride 1 over an input that holds its K − 1 earlier steps (extended
    [B, C_in, K − 1 + L] → [B, C_out, L]) as one matmul (every output step's window of inputs, all kernel taps,
    by the weight [C_out, C_in·k]): on omnimtp's row kernel (fp32), on the bf16 rows kernel (a bf16 stack's
    inputs of up to BF16_ROWS_MAX_STEPS steps), or, a short input of a kernel > 1 in a SHORT_MATMUL_DTYPES stack,
    `F.linear` in its dtype (`RowwiseMatmuls` runs it one request at a time): the convolution's sums in another
    order; None where none applies (or a stride or groups other than 1)."""
    conv = module.conv
    if conv.stride != (1,) or conv.groups != 1:
        return None
    matrix = conv.weight.flatten(1)  # [C_out, C_in·k], input channel major, tap minor
    length = extended.shape[-1] - module.padding
    packed = row_kernel_weight(module, matrix, extended[..., module.padding :].transpose(1, 2))
    rows_kernel = packed is None and _rows_kernel(matrix, extended, length)
    if packed is None and not rows_kernel and (conv.kernel_size == (1,) or not _short_matmul(matrix, extended, length)):
        return None
    (kernel,), (dilation,) = conv.kernel_size, conv.dilation
    batch, channels = extended.shape[:2]
    if kernel == 1:
        rows = extended.transpose(1, 2)  # [B, L, C_in]
    else:  # each output step's k taps, `dilation` apart
        windows = extended.unfold(-1, module.kernel_size, 1)[..., ::dilation]
        rows = windows.permute(0, 2, 1, 3).reshape(batch, length, channels * kernel)  # [B, L, C_in·k]
    if rows_kernel:
        return bf16_rows_linear.bf16_rows_linear(rows, matrix, conv.bias).transpose(1, 2).contiguous()
    if packed is None:  # a short bf16 input
        return F.linear(rows, matrix, conv.bias).transpose(1, 2).contiguous()
    out = linear(rows, matrix, packed=packed, gemm=ROW_KERNEL)
    if conv.bias is not None:
        out = out + conv.bias
    return out.transpose(1, 2).contiguous()


# Transposed convolutions of at least this many weights run as a matmul (`transposed_conv_as_matmul`). Measured at
# 2 threads on a 2-core AVX2 EPYC, one request: the 0.6B Qwen3-TTS decoder's 1536 → 768 kernel-16 block (18.9 M
# weights) took 15–90 ms a call as a convolution for inputs of 2 to 48 steps (oneDNN, or torch's reference path for
# some lengths) and 6–21 ms as a matmul; its 2.9 M-weight 768 → 384 block was about even, the smaller ones faster
# as convolutions. Short inputs (up to ROW_KERNEL_MAX_ROWS input steps) run the matmul on omnimtp's row kernel
# (`row_kernel_weight`), whatever the layer's size above the kernel's minimum: the 1536 → 768 block, 4 input steps
# 4.0 ms against MKL's 22, 16 steps 10.7 against 18.9, 64 steps 46 against 57 (MKL's matmul wins from ~100); its
# 1024 → 1024 upsamplers at 2 steps ran torch's reference convolution, 6.8 ms.
TRANSPOSED_MATMUL_MIN_WEIGHTS = 8_000_000


def transposed_conv_as_matmul(module, hidden_state: torch.Tensor) -> torch.Tensor | None:
    """module's transposed convolution (`Qwen3OmniMoeCausalTransConvNet`: kernel k = m·stride, no padding,
    dilation or groups), its outputs that no later input reaches, before its trims and without its bias:
    [B, C_in, L] → [B, C_out, L·stride], as one matmul of every input step by all kernel taps, then the
    overlapping taps added (output block u sums tap block j of input u − j, j = 0, 1, … in that order): the
    convolution's sums in another order (within 2e-6 of its output's peak). None where this form does not pay or
    apply: a layer under TRANSPOSED_MATMUL_MIN_WEIGHTS whose input neither the row kernels take (`row_kernel_weight`,
    `_rows_kernel`) nor a short matmul in the stack's dtype (`SHORT_MATMUL_MAX_STEPS`), or another convolution."""
    conv = module.conv
    (stride,), (kernel,) = conv.stride, conv.kernel_size
    if (
        kernel % stride or conv.padding != (0,) or conv.dilation != (1,) or conv.groups != 1
        or conv.output_padding != (0,)
    ):
        return None
    taps_matrix = conv.weight.flatten(1).t()  # [C_out·K, C_in]
    packed = row_kernel_weight(module, taps_matrix, hidden_state.transpose(1, 2))
    rows_kernel = packed is None and _rows_kernel(taps_matrix, hidden_state, hidden_state.shape[-1])
    if (packed is None and not rows_kernel and conv.weight.numel() < TRANSPOSED_MATMUL_MIN_WEIGHTS
            and not _short_matmul(taps_matrix, hidden_state, hidden_state.shape[-1])):
        return None
    batch, _, length = hidden_state.shape
    out_channels, num_blocks = conv.weight.shape[1], kernel // stride
    rows = hidden_state.transpose(1, 2)  # [B, L, C_in]
    if packed is not None:  # every row on its own: no `RowwiseMatmuls` needed
        taps = linear(rows, taps_matrix, packed=packed, gemm=ROW_KERNEL)
    elif rows_kernel:  # likewise
        taps = bf16_rows_linear.bf16_rows_linear(rows, taps_matrix)
    else:  # [B, L, C_out·K]; F.linear so that `RowwiseMatmuls` runs it one request at a time
        taps = F.linear(rows, taps_matrix, None)
    taps = taps.view(batch, length, out_channels, num_blocks, stride)
    out = taps[:, :, :, 0].clone()  # [B, L, C_out, stride]
    for j in range(1, num_blocks):
        out[:, j:] += taps[:, : length - j, :, j]
    return out.permute(0, 2, 1, 3).reshape(batch, out_channels, length * stride)


class RowKernelCausalConv(Qwen3OmniMoeCausalConvNet):
    """transformers' causal convolution of stride 1, its short inputs on omnimtp's row kernel
    (`causal_conv_on_row_kernel`); equal to it within float rounding."""

    def forward(self, hidden_state: torch.Tensor) -> torch.Tensor:
        out = causal_conv_on_row_kernel(self, hidden_state)
        return super().forward(hidden_state) if out is None else out


def use_row_kernel_layers(module: torch.nn.Module) -> None:
    """Make every nn.Linear under module a `RowKernelLinear` and every causal convolution of stride 1 and one
    group a `RowKernelCausalConv` (the same parameters; one already made a `PointwiseCausalConv` stays one: it
    takes the row kernel itself)."""
    for child in module.modules():
        if type(child) is torch.nn.Linear:
            child.__class__ = RowKernelLinear
        elif type(child) is Qwen3OmniMoeCausalConvNet and child.stride == 1 and child.conv.groups == 1:
            child.__class__ = RowKernelCausalConv


def use_inplace_snake(module: torch.nn.Module) -> None:
    """Make every SnakeBeta under module an `InplaceSnakeBeta` (the same parameters and values)."""
    for child in module.modules():
        if type(child) is Qwen3OmniMoeSnakeBeta:
            child.__class__ = InplaceSnakeBeta


class RowwiseMatmuls(TorchFunctionMode):
    """Runs every convolution and linear layer of a batch one row at a time; all other ops stay batched.

    oneDNN picks its convolution algorithm by batch size, so a batched conv rounds differently from a
    batch of one (measured: 3 of code2wav's 34 convolutions, 1 LSB of PCM16 in ~0.1% of samples at speech
    level), and a request's audio would depend on who else is decoding. These are the only ops of the
    conv stack that reduce over a batch-dependent blocking; norms, activations, padding and slicing work
    per row already. Cost on the tiny model, 2 threads, 16 one-frame windows: 35 ms against 15 ms fully
    batched and 83 ms for 16 separate stacks (the per-row calls are cheap; the rest keeps its batching). Layers
    on omnimtp's row kernels (fp32: `row_kernel_weight`; bf16: `_rows_kernel`) compute each row on its own and
    run the whole batch in one call: they call none of these ops."""

    _ROWWISE = {F.conv1d, F.conv_transpose1d, F.linear}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self._ROWWISE and args[0].dim() >= 2 and args[0].shape[0] > 1:
            rows = args[0]
            return torch.cat([func(rows[i : i + 1], *args[1:], **kwargs) for i in range(rows.shape[0])])
        return func(*args, **kwargs)


def _conv_stack_dtype(code2wav) -> torch.dtype:
    """The dtype of the conv stack's first weight (its upsampling blocks come first)."""
    return next(code2wav.upsample.parameters()).dtype


def cast_conv_stack(code2wav, dtype: torch.dtype) -> None:
    """The conv stack (the upsampling and decoder blocks) in `dtype`, in place; the transformer before it stays
    as it is (`StreamingCode2Wav` casts the stack's input as it enters). In a SHORT_MATMUL_DTYPES stack, a
    transposed convolution that always runs as a matmul (TRANSPOSED_MATMUL_MIN_WEIGHTS) keeps its weight laid
    out as that matmul's [C_out·k, C_in] matrix (the same values and shape, other strides; the original layout is
    let go, not kept beside it): the bf16 GEMM reads a row-major [K, N] operand at a fraction of the speed of a
    transposed one (the 0.6B Qwen3-TTS decoder's 1536 → 768 layer, 5 input steps, one thread: 4.5 → 1.8 ms)."""
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeCausalTransConvNet

    for part in (code2wav.upsample, code2wav.decoder):
        part.to(dtype)
    if dtype not in SHORT_MATMUL_DTYPES:
        return
    for module in _conv_stack_modules(code2wav):
        if (isinstance(module, Qwen3OmniMoeCausalTransConvNet)
                and module.conv.weight.numel() >= TRANSPOSED_MATMUL_MIN_WEIGHTS):
            weight = module.conv.weight
            weight.data = weight.detach().flatten(1).t().contiguous().t().view(weight.shape)


def _with_conv_stack_in(code2wav, dtype: torch.dtype):
    """A code2wav that shares code2wav's embedding and transformer and holds a copy of its conv stack in
    `dtype`; code2wav is left as it is."""
    made = copy.copy(code2wav)
    made._modules = dict(code2wav._modules)
    for name in ("upsample", "decoder"):
        made._modules[name] = copy.deepcopy(code2wav._modules[name])
        for module in made._modules[name].modules():
            module.__dict__.pop("_row_kernel_weight", None)  # fp32 packings the copy never uses
    cast_conv_stack(made, dtype)
    return made


def _conv_stack_modules(code2wav) -> list:
    """The conv stack's modules in the order the signal runs through them."""
    return ([m for blocks in code2wav.upsample for m in blocks.modules()]
            + [m for block in code2wav.decoder for m in block.modules()])


def _num_lost_samples(code2wav) -> int:
    """Samples the causal transposed convolutions drop at the end: each one's left trim, at its own output
    rate (Qwen3-Omni: 555; a transposed conv that trims only on the right, as Qwen3-TTS's, drops none)."""
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeCausalTransConvNet

    lost = 0
    for module in _conv_stack_modules(code2wav):
        if isinstance(module, Qwen3OmniMoeCausalTransConvNet):
            lost = lost * module.conv.stride[0] + module.left_pad
    return lost
