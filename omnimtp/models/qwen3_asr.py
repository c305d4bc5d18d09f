"""Qwen3-ASR and Qwen3-ForcedAligner as the project's own modules, read from the released layout.

A Qwen3-ASR checkpoint (`config.json` with model_type "qwen3_asr", `model.safetensors`, the text tokenizer files)
holds one thinker: Qwen3-Omni's audio encoder (`thinker.audio_tower`, transformers'
`Qwen3OmniMoeAudioEncoder`: the same convolutions, windowed attention and projections) and a dense Qwen3 decoder
with q/k norm (`thinker.model`) whose M-RoPE rows are all equal for text and audio (so it is the 1-D rotary
embedding), and `thinker.lm_head`. Qwen3-ForcedAligner is the same thinker (its config's thinker model_type
"qwen3_forced_aligner") whose head classifies every position into `classify_num` time bins of
`timestamp_segment_time` ms instead of predicting a token.

The parameter names are the reference's (`qwen_asr`'s `Qwen3ASRForConditionalGeneration`), so
`model.safetensors` loads with no renaming and `save_pretrained` writes a checkpoint the reference loads; the
engine runs the decoder on packed weights (`omnimtp.runtime`), never through a module forward. The config is
read from config.json as a dict; `qwen_asr` is not imported.

    model = Qwen3ASRModel.from_pretrained(path)          # or tiny_qwen3_asr(seed), tiny_qwen3_asr(seed, aligner=True)
    rows = model.thinker.get_audio_features(features, feature_attention_mask).last_hidden_state
    fast = EncoderThinker(model.thinker, fast_audio_encoder(model.thinker.audio_tower))  # bf16 encoder
"""

from __future__ import annotations

import copy
import json
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from tokenizers import AddedToken
from torch import nn
from transformers import Qwen3Config
from transformers.activations import ACT2FN
from transformers.modeling_outputs import BaseModelOutput
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding
from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeAudioEncoderConfig
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
    Qwen3OmniMoeAudioEncoder,
    chunk_and_pad_features,
    get_audio_cu_seqlens,
    get_valid_indices,
)

from omnimtp.models.qwen3_tts import Decoder, decoder_config, release_matrices
from omnimtp.models.tiny import THINKER_SPECIAL_TOKENS, THINKER_VOCAB_SIZE
from omnimtp.runtime.kernels import bf16_attention
from omnimtp.runtime.ops import (
    PackedGemm,
    QuantizedRows,
    QuantizedWeight,
    check_many_row_mode,
    conv2d,
    linear,
    packed_gemm_kind,
    quantize_conv_weight,
    quantize_weight,
    w8a8_linear_epilogue,
    w8a8_linear_quantized_out,
)

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
ALIGNER_THINKER_TYPE = "qwen3_forced_aligner"  # thinker_config.model_type of a forced aligner
AUDIO_ENCODER_FIELDS = (
    "num_mel_bins", "encoder_layers", "encoder_attention_heads", "encoder_ffn_dim", "d_model", "activation_function",
    "scale_embedding", "max_source_positions", "n_window", "output_dim", "n_window_infer", "conv_chunksize",
    "downsample_hidden_size", "initializer_range",
)
# The languages of the released Qwen3-ASR (`qwen_asr`'s SUPPORTED_LANGUAGES), what `language` forces.
ASR_LANGUAGES = (
    "Chinese", "English", "Cantonese", "Arabic", "German", "French", "Spanish", "Portuguese", "Indonesian", "Italian",
    "Korean", "Russian", "Thai", "Vietnamese", "Japanese", "Turkish", "Hindi", "Malay", "Dutch", "Swedish", "Danish",
    "Finnish", "Polish", "Czech", "Filipino", "Persian", "Greek", "Romanian", "Hungarian", "Macedonian",
)


@dataclass(frozen=True)
class ThinkerConfig:
    """What the engine's thinker run (`omnimtp.thinker.ThinkerRun`, `multimodal_prefill`) reads of a thinker's
    config: the text decoder's config and the audio placeholder ids (no images or video: their ids are None).
    classify_num: the aligner's number of time bins (None for the ASR)."""

    text_config: Qwen3Config
    audio_config: Qwen3OmniMoeAudioEncoderConfig
    audio_token_id: int
    audio_start_token_id: int
    audio_end_token_id: int
    classify_num: int | None = None
    image_token_id: int | None = None
    video_token_id: int | None = None


class TextModel(Decoder):
    """The thinker's text decoder: the token embedding, decoder layers, final norm and rotary embedding."""

    def __init__(self, config: Qwen3Config):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)


class Qwen3ASRThinker(nn.Module):
    """`thinker.*` of the released layout: audio_tower, model (the text decoder), lm_head (the vocabulary, or
    the aligner's classify_num time bins)."""

    def __init__(self, config: dict):
        super().__init__()
        audio = config.get("audio_config") or {}
        audio_config = Qwen3OmniMoeAudioEncoderConfig(**{k: v for k, v in audio.items() if k in AUDIO_ENCODER_FIELDS})
        text_config = decoder_config(config["text_config"])
        classify_num = config.get("classify_num") if config.get("model_type") == ALIGNER_THINKER_TYPE else None
        self.config = ThinkerConfig(
            text_config=text_config, audio_config=audio_config, audio_token_id=int(config["audio_token_id"]),
            audio_start_token_id=int(config["audio_start_token_id"]),
            audio_end_token_id=int(config["audio_end_token_id"]),
            classify_num=None if classify_num is None else int(classify_num),
        )
        self.audio_tower = Qwen3OmniMoeAudioEncoder(audio_config)
        self.model = TextModel(text_config)
        num_outputs = text_config.vocab_size if classify_num is None else int(classify_num)
        self.lm_head = nn.Linear(text_config.hidden_size, num_outputs, bias=False)
        self.ties_lm_head = classify_num is None and bool(config["text_config"].get("tie_word_embeddings", False))
        if self.ties_lm_head:
            self.lm_head.weight = self.model.embed_tokens.weight

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    def get_audio_features(self, input_features: torch.Tensor, feature_attention_mask: torch.Tensor,
                           return_dict: bool = True) -> BaseModelOutput:
        """input_features [A, mel, T] and feature_attention_mask [A, T] → the encoder rows of every audio, one
        audio at a time as the reference encodes them, concatenated: last_hidden_state [rows, D]."""
        return encode_audio(self.audio_tower, input_features, feature_attention_mask)


def encode_audio(tower: nn.Module, input_features: torch.Tensor, feature_attention_mask: torch.Tensor
                 ) -> BaseModelOutput:
    """`Qwen3ASRThinker.get_audio_features` with the audio encoder `tower` (the thinker's own, or its
    `fast_audio_encoder`)."""
    lengths = feature_attention_mask.sum(-1)  # [A]
    rows = [
        tower(features[:, :length], feature_lens=length[None]).last_hidden_state
        for features, length in zip(input_features, lengths, strict=True)
    ]
    return BaseModelOutput(last_hidden_state=torch.cat(rows))


# --- the audio encoder of the quantized modes ----------------------------------------------------------------


ENCODER_ROWS_HINT = 1024  # the row count oneDNN tunes the encoder's packed bf16 weights for (~80 s of audio)


class EncoderLinear(nn.Module):
    """An nn.Linear of a fast audio encoder (`fast_audio_encoder`). linears "bf16": computed in bf16 on bf16
    copies of the weight and bias, packed for oneDNN where it runs bf16 (the runtime's "onednn" `PackedGemm`: the
    CPU's bf16 instructions), the input rounded to bf16 as it enters, the output back in float32; a quantized mode
    ("int8", "int4", "w4a8", or "w8a8": oneDNN's int8 GEMM): the runtime's quantized kernel (`QuantizedWeight`
    of `quantize_weight`), the bias float. Either way through `omnimtp.runtime.ops.linear`, except "w8a8": its
    rows' scales, bias and (gelu) the exact GELU after it in one pass over the GEMM's output
    (`ops.w8a8_linear_epilogue`); quantize_out: its output rows quantized in that pass for the next "w8a8" linear,
    which takes them as they are (`ops.QuantizedRows`: fc1 → GELU → fc2 without fp32 rows between them). bf16_out
    (linears "bf16"): the output stays bf16 (a linear whose output an activation takes to the next linear, which
    rounds its input to bf16 anyway: GELU on the bf16 rows gives those same bits, without casting the widest rows
    to float32 and back)."""

    def __init__(self, module: nn.Linear, linears: str, bf16_out: bool = False, gelu: bool = False,
                 quantize_out: bool = False):
        super().__init__()
        if (gelu or quantize_out) and linears != "w8a8":
            raise ValueError(f"gelu, quantize_out: only a \"w8a8\" linear applies GELU and quantizes its output "
                             f"itself, not {linears!r}")
        self.in_features, self.out_features = module.in_features, module.out_features
        self.bf16_out = bf16_out and linears == "bf16"
        self.gelu, self.quantize_out = gelu, quantize_out
        self.quantized: QuantizedWeight | None = None
        self.packed, self.gemm = None, None
        if linears == "bf16":
            weight = module.weight.detach().to(torch.bfloat16).contiguous()
            self.weight = nn.Parameter(weight, requires_grad=False)
            self.bias = None if module.bias is None else nn.Parameter(module.bias.detach().to(torch.bfloat16),
                                                                      requires_grad=False)
            if packed_gemm_kind(weight.device, torch.bfloat16) == "onednn":
                self.gemm = PackedGemm("onednn", None)
                self.packed = self.gemm.pack(weight, ENCODER_ROWS_HINT)
        else:
            self.quantized = quantize_weight(module.weight.detach().float(), linears)
            self.bias = module.bias

    def forward(self, x: torch.Tensor | QuantizedRows) -> torch.Tensor | QuantizedRows:
        """x [..., in] (or a "w8a8" linear's `QuantizedRows` [M, in]) → [..., out] (`QuantizedRows` with
        quantize_out)."""
        if self.quantized is None:
            out = linear(x.to(torch.bfloat16), self.weight, self.bias, packed=self.packed, gemm=self.gemm)
            return out if self.bf16_out else out.float()
        if self.quantized.mode != "w8a8":
            return linear(x.float(), None, self.bias, packed=self.quantized)
        bias = None if self.bias is None else self.bias.detach().float()
        rows = x if isinstance(x, QuantizedRows) else x.reshape(-1, self.in_features).float()
        if self.quantize_out:
            return w8a8_linear_quantized_out(rows, self.quantized, bias, gelu=self.gelu)
        out = w8a8_linear_epilogue(rows, self.quantized, bias, gelu=self.gelu)
        return out if isinstance(x, QuantizedRows) else out.view(*x.shape[:-1], self.out_features)


class Bf16Conv2d(nn.Module):
    """An nn.Conv2d computed in bf16 (oneDNN's kernels, the CPU's bf16 instructions where it has them) on a bf16
    copy of its weights, its input rounded to bf16 as it enters, its output bf16: the encoder's GELUs between the
    convolutions then run in bf16 too, and the stack's large activations are never cast (the first linear after
    it, `conv_out`, takes bf16 rows). channels_last: the output in channels-last memory (what `W8A8Conv2d` reads
    without reordering); oneDNN picks that layout from its operands', and an operand of one input channel is as
    much channels first as last, so such a convolution gets a second input channel of zeros (weights and input:
    the same sums). gelu: the exact (erf) GELU of the output applied by oneDNN as it writes it (its "gelu" post-op,
    `torch.ops.mkldnn._convolution_pointwise`: on the fp32 sums, rounded to bf16 once), where this torch has it;
    else `F.gelu` after."""

    def __init__(self, module: nn.Conv2d, channels_last: bool = False, gelu: bool = False):
        super().__init__()
        weight = module.weight.detach().to(torch.bfloat16)
        self.channels_last, self.gelu = channels_last, gelu
        if channels_last:
            if weight.shape[1] == 1:
                weight = torch.cat([weight, torch.zeros_like(weight)], dim=1)
            weight = weight.contiguous(memory_format=torch.channels_last)
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if module.bias is None else nn.Parameter(module.bias.detach().to(torch.bfloat16),
                                                                  requires_grad=False)
        self.stride, self.padding = module.stride, module.padding

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(torch.bfloat16)
        if self.channels_last and x.shape[1] != self.weight.shape[1]:  # one channel and its zeros, channels last
            padded = x.new_zeros(x.shape[0], x.shape[2], x.shape[3], 2)
            padded[..., 0] = x[:, 0]
            x = padded.permute(0, 3, 1, 2)
        elif self.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        if self.gelu and hasattr(torch.ops.mkldnn, "_convolution_pointwise"):
            return torch.ops.mkldnn._convolution_pointwise(
                x, self.weight, self.bias, list(self.padding), list(self.stride), [1, 1], 1, "gelu", [], "none")
        out = F.conv2d(x, self.weight, self.bias, self.stride, self.padding)
        return F.gelu(out) if self.gelu else out


class W8A8Conv2d(nn.Module):
    """An nn.Conv2d on oneDNN's int8 GEMM (`omnimtp.runtime.ops.conv2d`: each output position's patch a row
    quantized to int8 on its own, the weight int8 per output channel, `quantize_conv_weight`), its input rounded to
    bf16 as it enters and its output bf16 as `Bf16Conv2d`'s. It takes and gives [B, C, H, W] in channels-last
    memory (the rows the GEMM reads and writes), so a stack of them never reorders. gelu: the exact (erf) GELU of
    the output in the same pass that applies the scales and the bias (`ops.conv2d`'s), rounded to bf16 once."""

    def __init__(self, module: nn.Conv2d, gelu: bool = False):
        super().__init__()
        self.quantized = quantize_conv_weight(module.weight, "w8a8")
        self.bias = None if module.bias is None else nn.Parameter(module.bias.detach().float(), requires_grad=False)
        self.kernel_size, self.stride, self.padding = module.kernel_size, module.stride, module.padding
        self.gelu = gelu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.to(torch.bfloat16).permute(0, 2, 3, 1)  # [B, H, W, C]: no copy for a channels-last input
        out = conv2d(rows, self.quantized, self.bias, self.kernel_size, self.stride, self.padding, gelu=self.gelu)
        return out.permute(0, 3, 1, 2)


class W8A8ConvOut(nn.Module):
    """The audio encoder's conv_out (an nn.Linear of each time step's [channels x frequencies] rows, flattened
    channel by channel) in "w8a8", read as a convolution whose kernel spans all F frequencies: it takes the last
    convolution's channels-last bf16 rows [B, C, F, T] as they are (`ops.conv2d`: each time step's patch, frequency
    by frequency, is the linear's row with its inputs in (f, c) order; the weight's columns are permuted to match)
    and gives [B, T, out] fp32. The same bits as the "w8a8" linear of the flattened fp32 rows (the same values in
    each row and weight row, reordered: the same scales, exact integer sums), without the transposed copy and its
    cast to fp32."""

    def __init__(self, module: nn.Linear, channels: int):
        super().__init__()
        self.frequencies = module.in_features // channels
        weight = module.weight.detach().float().view(module.out_features, channels, self.frequencies, 1)
        self.quantized = quantize_conv_weight(weight, "w8a8")
        self.bias = None if module.bias is None else nn.Parameter(module.bias.detach().float(), requires_grad=False)
        self.in_features, self.out_features = module.in_features, module.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.to(torch.bfloat16).permute(0, 2, 3, 1)  # [B, F, T, C]: no copy for a channels-last input
        out = conv2d(rows, self.quantized, self.bias, (self.frequencies, 1), (1, 1), (0, 0), out_dtype=torch.float32)
        return out[:, 0]  # [B, T, out]


class RoundedNorm(nn.Module):
    """A LayerNorm of a fast audio encoder in bf16 whose only readers are bf16 linears (`EncoderLinear`, which
    round their input to bf16): its float32 output rounded to bf16 once, not once per reader (q, k and v read
    the same rows). bf16_out False: the float32 output as it is."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.norm = module
        self.bf16_out = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.norm(x)
        return out.to(torch.bfloat16) if self.bf16_out else out


class EncoderAttention(nn.Module):
    """An audio encoder layer's self-attention (transformers' `Qwen3OmniMoeAudioAttention`) in int8_compute: q, k and
    v as one "w8a8" linear of the three matrices stacked (each row quantized once for the three: the same values as
    three linears), then each window of `cu_seqlens` attends to itself alone (full, non-causal), then out_proj.

    The windows run as the rows of the bf16 attention kernel (`bf16_attention`: bf16 products, fp32 sums, within
    bf16 rounding of fp32 SDPA) in one call: q, k and v are written window by window into a buffer of equal windows
    of the longest one's length (for one audio, windows of equal length then a shorter last one: its rows as they
    are, then padding rows), and a shorter window's queries see only its own keys (its key counts). A window's
    output depends only on its own rows. Where the kernel does not run (no AVX512_BF16, a head width it does not
    take): SDPA window by window, as the reference runs it."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.num_heads, self.head_dim, self.scaling = module.num_heads, module.head_dim, module.scaling
        projections = (module.q_proj, module.k_proj, module.v_proj)
        self.qkv = quantize_weight(torch.cat([p.weight.detach().float() for p in projections]), "w8a8")
        self.qkv_bias = nn.Parameter(torch.cat([p.bias.detach().float() for p in projections]), requires_grad=False)
        self.out_proj = EncoderLinear(module.out_proj, "w8a8")

    def on_kernel(self) -> bool:
        """Whether the windows run on the bf16 attention kernel here."""
        return (self.head_dim % 16 == 0 and self.head_dim <= bf16_attention.MAX_HEAD_DIM
                and bf16_attention.available())

    def forward(self, hidden_states: torch.Tensor, cu_seqlens: torch.Tensor, **kwargs) -> torch.Tensor:
        """hidden_states [N, E] fp32, cu_seqlens [W + 1] (the windows' bounds) → [N, E]."""
        num_rows, width = hidden_states.shape
        lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
        if not self.on_kernel():
            qkv = w8a8_linear_epilogue(hidden_states.float(), self.qkv, self.qkv_bias)  # [N, 3E]
            q, k, v = (part.view(num_rows, self.num_heads, self.head_dim).transpose(0, 1)
                       for part in qkv.split(width, dim=1))
            windows = [F.scaled_dot_product_attention(*parts, scale=self.scaling)  # [H, n, D] each
                       for parts in zip(*(t.split(lengths, dim=1) for t in (q, k, v)), strict=True)]
            return self.out_proj(torch.cat(windows, dim=1).transpose(0, 1).reshape(num_rows, width))
        window = max(lengths)
        starts = torch.arange(len(lengths)) * window
        # buffer row of each input row: window w's rows from w * window (the same rows when only the last is short)
        at = None if all(n == window for n in lengths[:-1]) else torch.cat(
            [torch.arange(n) + start for n, start in zip(lengths, starts.tolist(), strict=True)])
        buffer = hidden_states.new_empty(len(lengths) * window, 3 * width, dtype=torch.float32)
        if at is None:
            buffer[num_rows:].zero_()
            w8a8_linear_epilogue(hidden_states.float(), self.qkv, self.qkv_bias, out=buffer[:num_rows])
        else:
            buffer.zero_()
            buffer[at] = w8a8_linear_epilogue(hidden_states.float(), self.qkv, self.qkv_bias)
        qkv = buffer.view(len(lengths), window, 3, self.num_heads, self.head_dim)
        key_counts = torch.tensor(lengths, dtype=torch.int64)[:, None].expand(-1, window)  # [W, window]
        out = bf16_attention.bf16_attention(qkv[:, :, 0], qkv[:, :, 1].transpose(1, 2), qkv[:, :, 2].transpose(1, 2),
                                            key_counts, self.scaling).view(-1, width)  # [W * window, E]
        return self.out_proj(out[:num_rows] if at is None else out[at])


class W8A8EncoderLayer(nn.Module):
    """An audio encoder layer (transformers' `Qwen3OmniMoeAudioEncoderLayer`) in int8_compute: its attention an
    `EncoderAttention`, fc1 and fc2 "w8a8" `EncoderLinear`s, fc1's the GELU in its output pass and its rows handed
    to fc2 quantized (where the model's activation is "gelu", the exact one; another activation runs after fc1 as
    the model's module), the norms the layer's own."""

    def __init__(self, layer: nn.Module, activation_function: str):
        super().__init__()
        fused = activation_function == "gelu"
        self.self_attn_layer_norm, self.final_layer_norm = layer.self_attn_layer_norm, layer.final_layer_norm
        self.self_attn = EncoderAttention(layer.self_attn)
        self.fc1 = EncoderLinear(layer.fc1, "w8a8", gelu=fused, quantize_out=fused)
        self.activation_fn = None if fused else ACT2FN[activation_function]
        self.fc2 = EncoderLinear(layer.fc2, "w8a8")

    def forward(self, hidden_states: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        """[N, E] → [N, E], as the reference's layer: x + attention(norm(x)), then x + fc2(act(fc1(norm(x))))."""
        hidden_states = self.self_attn(self.self_attn_layer_norm(hidden_states), cu_seqlens).add_(hidden_states)
        rows = self.fc1(self.final_layer_norm(hidden_states))
        if self.activation_fn is not None:
            rows = self.activation_fn(rows)
        return self.fc2(rows).add_(hidden_states)


class W8A8AudioEncoder(nn.Module):
    """The audio encoder of int8_compute (`fast_audio_encoder(tower, "w8a8")`): transformers' `Qwen3OmniMoeAudioEncoder`
    with every linear a "w8a8" `EncoderLinear` (conv_out a `W8A8ConvOut`), the convolutions of more than one input
    channel `W8A8Conv2d`s (the first `Bf16Conv2d`, its rows channels last for them), its layers `W8A8EncoderLayer`s,
    and the GELUs in the output passes of the convolutions and linears before them (the linears' rows handed to the
    next linear quantized). Its forward is the reference's, step for step (the same chunks, windows and valid rows,
    from transformers' own helpers); the norms, sinusoids and float biases are the tower's tensors, shared; the tower
    is not modified."""

    def __init__(self, tower: nn.Module):
        super().__init__()
        config = tower.config
        self.config = config
        self.n_window, self.n_window_infer = tower.n_window, tower.n_window_infer
        self.conv_chunksize = tower.conv_chunksize
        fused = config.activation_function == "gelu"
        self.conv2d1 = Bf16Conv2d(tower.conv2d1, channels_last=True, gelu=True)
        self.conv2d2, self.conv2d3 = W8A8Conv2d(tower.conv2d2, gelu=True), W8A8Conv2d(tower.conv2d3, gelu=True)
        self.conv_out = W8A8ConvOut(tower.conv_out, tower.conv2d3.out_channels)
        self.positional_embedding = tower.positional_embedding
        self.layers = nn.ModuleList(W8A8EncoderLayer(layer, config.activation_function) for layer in tower.layers)
        self.ln_post = tower.ln_post
        self.proj1 = EncoderLinear(tower.proj1, "w8a8", gelu=fused, quantize_out=fused)
        self.act = None if fused else ACT2FN[config.activation_function]
        self.proj2 = EncoderLinear(tower.proj2, "w8a8")

    @property
    def dtype(self) -> torch.dtype:
        """The dtype its input features come in (the tower's: float32)."""
        return self.ln_post.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.ln_post.weight.device

    def forward(self, input_features: torch.Tensor, feature_lens: torch.Tensor) -> BaseModelOutput:
        """input_features [mel, T] of one or more audios concatenated, feature_lens [A] → last_hidden_state [rows,
        output_dim] (the reference forward's arguments and rows)."""
        padded_feature, chunk_lengths = chunk_and_pad_features(input_features, feature_lens, self.n_window)
        valid_indices = get_valid_indices(chunk_lengths, self.n_window)
        cu_seqlens = get_audio_cu_seqlens(chunk_lengths, feature_lens, self.n_window_infer, self.n_window)
        embeds = [self.conv2d3(self.conv2d2(self.conv2d1(chunk)))  # each with its GELU
                  for chunk in padded_feature.unsqueeze(1).split(self.conv_chunksize, dim=0)]
        embeds = self.conv_out(embeds[0] if len(embeds) == 1 else torch.cat(embeds, dim=0))  # [B, t, E] fp32
        t = embeds.shape[1]
        embeds = embeds + self.positional_embedding.positional_embedding[:t].unsqueeze(0).to(embeds.dtype)
        hidden_states = torch.index_select(embeds.reshape(-1, embeds.shape[-1]), 0, valid_indices)
        for layer in self.layers:
            hidden_states = layer(hidden_states, cu_seqlens)
        hidden_states = self.proj1(self.ln_post(hidden_states))
        if self.act is not None:
            hidden_states = self.act(hidden_states)
        return BaseModelOutput(last_hidden_state=self.proj2(hidden_states))


# each bf16 linear an activation leads to another linear from (→ GELU → fc2, → proj2), and each norm whose
# only readers are linears (q/k/v, fc1, proj1): their output stays bf16, the bits the readers see unchanged
BF16_OUT_LINEARS = ("fc1", "proj1")
ROUNDED_NORMS = ("self_attn_layer_norm", "final_layer_norm", "ln_post")


def fast_audio_encoder(tower: nn.Module, linears: str = "bf16") -> nn.Module:
    """A copy of the audio encoder `tower` (transformers' `Qwen3OmniMoeAudioEncoder`) for the fast modes. linears
    "w8a8": a `W8A8AudioEncoder` (int8 GEMMs for the linears and the wide convolutions, the windows' attention on
    the bf16 kernel, the GELUs fused). Else every linear (the layers' q/k/v/out and fc1/fc2, conv_out, proj1/proj2)
    an `EncoderLinear` of `linears` ("bf16", or a quantized mode; in bf16, fc1's and proj1's rows stay bf16 through
    their GELU, and the norms before q/k/v, fc1 and proj1 round their rows once, `RoundedNorm`), the three
    convolutions in bf16 (`Bf16Conv2d`); norms, activations, attention and the sinusoids as they are, in float32.
    The copy shares the tower's other tensors; the tower is not modified. Each audio is encoded alone, so an
    audio's rows do not depend on the other requests."""
    if linears == "w8a8":
        return W8A8AudioEncoder(tower).eval()
    linear_names = {name for name, module in tower.named_modules() if isinstance(module, nn.Linear)}
    bf16_out = {name for name in linear_names if name.rpartition(".")[2] in BF16_OUT_LINEARS}
    norms = {name for name, _ in tower.named_modules() if name.rpartition(".")[2] in ROUNDED_NORMS}
    convs = {name for name, module in tower.named_modules() if isinstance(module, nn.Conv2d)}
    memo = {id(tensor): tensor for tensor in [*tower.parameters(), *tower.buffers()]}
    encoder = copy.deepcopy(tower, memo)
    for name in sorted(linear_names | convs):
        parent_name, _, child = name.rpartition(".")
        parent = encoder.get_submodule(parent_name) if parent_name else encoder
        module = getattr(parent, child)
        if name in linear_names:
            setattr(parent, child, EncoderLinear(module, linears, name in bf16_out))
        else:
            setattr(parent, child, Bf16Conv2d(module))
    if linears == "bf16":
        for name in sorted(norms):
            parent_name, _, child = name.rpartition(".")
            parent = encoder.get_submodule(parent_name) if parent_name else encoder
            setattr(parent, child, RoundedNorm(getattr(parent, child)))
    return encoder.eval()


def encoder_thinker(thinker: Qwen3ASRThinker, quantize: str | None, int8_compute: bool = False):
    """The thinker a family runs in `quantize`: float (None), the thinker itself (the reference's encoder); a
    quantized mode, an `EncoderThinker` of its bf16 copy (`fast_audio_encoder`) where oneDNN runs bf16 on the
    thinker's device (the runtime's "onednn" packed GEMM; elsewhere bf16 would be emulated, slower than float: the
    thinker itself). int8_compute (any `quantize`): a `W8A8AudioEncoder` (its linears "w8a8", `ops.MANY_ROW_MODES`:
    oneDNN's int8 GEMM, each row quantized to int8 on its own, and so are its convolutions but the first,
    `W8A8Conv2d`: each output position's patch a row; GELUs fused, the windows' attention in bf16); ValueError
    naming int8_compute where that does not run."""
    if int8_compute:
        check_many_row_mode("w8a8", thinker.device, "int8_compute")
        return EncoderThinker(thinker, fast_audio_encoder(thinker.audio_tower, "w8a8"))
    if quantize is None or packed_gemm_kind(thinker.device, torch.bfloat16) != "onednn":
        return thinker
    return EncoderThinker(thinker, fast_audio_encoder(thinker.audio_tower))


class EncoderThinker:
    """A thinker seen with another audio encoder (`fast_audio_encoder`): `audio_tower` and
    `get_audio_features` are the encoder's, everything else the thinker's own (what `multimodal_prefill` and
    `omnimtp.thinker.ThinkerRun` read)."""

    def __init__(self, thinker: Qwen3ASRThinker, encoder: nn.Module):
        self.thinker = thinker
        self.audio_tower = encoder

    def __getattr__(self, name: str):
        if name == "thinker":  # not set yet (a copy being made): no recursion
            raise AttributeError(name)
        return getattr(self.thinker, name)

    def get_audio_features(self, input_features: torch.Tensor, feature_attention_mask: torch.Tensor,
                           return_dict: bool = True) -> BaseModelOutput:
        return encode_audio(self.audio_tower, input_features, feature_attention_mask)


class Qwen3ASRModel(nn.Module):
    """A Qwen3-ASR or Qwen3-ForcedAligner checkpoint: `thinker` and the config dict (`is_aligner`: a forced
    aligner's, with `timestamp_token_id` and `timestamp_segment_time`)."""

    def __init__(self, config: dict):
        super().__init__()
        if config.get("model_type") != "qwen3_asr":
            raise ValueError(f"config: model_type {config.get('model_type')!r} is not 'qwen3_asr'")
        self.config = config
        self.thinker = Qwen3ASRThinker(config["thinker_config"])
        self.has_released_linears = False  # see `release_decoder_linears`

    @property
    def is_aligner(self) -> bool:
        return self.thinker.config.classify_num is not None

    @property
    def timestamp_token_id(self) -> int:
        return int(self.config["timestamp_token_id"])

    @property
    def timestamp_segment_time(self) -> float:
        """ms per time bin."""
        return float(self.config["timestamp_segment_time"])

    @property
    def support_languages(self) -> tuple[str, ...]:
        return tuple(self.config.get("support_languages") or ASR_LANGUAGES)

    @classmethod
    def from_pretrained(cls, path, dtype: torch.dtype | None = None) -> Qwen3ASRModel:
        """config.json and model.safetensors of a checkpoint directory (every thinker weight required)."""
        path = os.fspath(path)
        with open(os.path.join(path, CONFIG_NAME)) as f:
            config = json.load(f)
        with torch.device("meta"):
            model = cls(config)
        weights = load_file(os.path.join(path, WEIGHTS_NAME))
        state = {name: tensor for name, tensor in weights.items() if name.startswith("thinker.")}
        expected = set(model.state_dict())
        if model.thinker.ties_lm_head:
            expected.discard("thinker.lm_head.weight")
            state.pop("thinker.lm_head.weight", None)
        missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
        if missing or unexpected:
            raise ValueError(f"path: {path!r}: model.safetensors does not match config.json (missing {missing[:4]}, "
                             f"unexpected {unexpected[:4]})")
        model.load_state_dict(state, assign=True, strict=False)
        if model.thinker.ties_lm_head:
            model.thinker.lm_head.weight = model.thinker.model.embed_tokens.weight
        model.restore_buffers()
        if dtype is not None:
            model = model.to(dtype)
        return model.eval()

    def restore_buffers(self) -> None:
        """The tables that are not in the file (the rotary frequencies, the encoder's sinusoids), computed again
        on the weights' device."""
        thinker = self.thinker
        with torch.device(thinker.device):
            thinker.model.rotary_emb = Qwen3RotaryEmbedding(thinker.model.config)
            tower = thinker.audio_tower
            tower.positional_embedding = type(tower.positional_embedding)(
                tower.config.max_source_positions, tower.config.d_model
            )

    def decoder_linears(self) -> list[nn.Linear]:
        """The linears of the text decoder's layers (q/k/v/o, gate/up/down)."""
        names = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
                 "mlp.up_proj", "mlp.down_proj")
        return [layer.get_submodule(name) for layer in self.thinker.model.layers for name in names]

    def release_decoder_linears(self) -> None:
        """Frees the decoder layers' matrices for a runtime that holds its own quantized copies
        (`omnimtp.models.qwen3_tts.release_matrices`); the model can then no longer be saved nor packed again."""
        release_matrices(self.decoder_linears())
        self.has_released_linears = True

    def release_audio_encoder(self) -> None:
        """Frees the audio encoder's linear and convolution matrices for a runtime that encodes with its own copy
        (`fast_audio_encoder`); the model's own encoder then no longer runs, nor can the model be saved."""
        release_matrices([module for module in self.thinker.audio_tower.modules()
                          if isinstance(module, (nn.Linear, nn.Conv2d))])
        self.has_released_linears = True

    def save_pretrained(self, path) -> None:
        """config.json and model.safetensors in the released layout."""
        if self.has_released_linears:
            raise ValueError("model: its decoder matrices were released for quantized weights; save the "
                             "checkpoint it was loaded from instead")
        path = os.fspath(path)
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, CONFIG_NAME), "w") as f:
            json.dump(self.config, f, indent=2)
        tensors = {name: tensor.detach().contiguous() for name, tensor in self.state_dict().items()
                   if not (self.thinker.ties_lm_head and name == "thinker.lm_head.weight")}
        save_file(tensors, os.path.join(path, WEIGHTS_NAME), metadata={"format": "pt"})


# --- the tiny seeded models -----------------------------------------------------------------------------

# The byte tokenizer's ids of the two tokens Qwen3-ASR adds: the tag between the detected language and the
# text, and the aligner's time slot (both ordinary added tokens: decoding keeps them).
ASR_TEXT_TOKEN = "<asr_text>"
TIMESTAMP_TOKEN = "<timestamp>"
TINY_ASR_TOKENS = {ASR_TEXT_TOKEN: 271, TIMESTAMP_TOKEN: 272}

# The released Qwen3-ASR-0.6B's and Qwen3-ForcedAligner-0.6B's widths (their config.json).
QWEN3_ASR_0_6B_AUDIO = dict(num_mel_bins=128, d_model=896, encoder_layers=18, encoder_attention_heads=14,
                            encoder_ffn_dim=3584, output_dim=1024, downsample_hidden_size=480)
QWEN3_ALIGNER_0_6B_AUDIO = dict(num_mel_bins=128, d_model=1024, encoder_layers=24, encoder_attention_heads=16,
                                encoder_ffn_dim=4096, output_dim=1024, downsample_hidden_size=480)
QWEN3_ASR_0_6B_TEXT = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                           num_attention_heads=16, num_key_value_heads=8, head_dim=128)
QWEN3_ALIGNER_0_6B_TEXT = {**QWEN3_ASR_0_6B_TEXT, "vocab_size": 152064}
RELEASED_CLASSIFY_NUM = 5000
RELEASED_SEGMENT_MS = 80


def tiny_config(aligner: bool = False, *, audio: dict | None = None, text: dict | None = None,
                initializer_range: float = 0.2) -> dict:
    """A config.json of the released structure with tiny widths (the byte tokenizer's specials as the ids, the
    released audio windows n_window 50 / n_window_infer 800), a forced aligner's with aligner=True (the released
    5000 bins of 80 ms). audio, text: overrides (e.g. `QWEN3_ASR_0_6B_AUDIO`, `QWEN3_ASR_0_6B_TEXT` for the
    released 0.6B widths)."""
    ids = THINKER_SPECIAL_TOKENS
    audio_config = {
        "num_mel_bins": 16, "d_model": 32, "encoder_layers": 2, "encoder_attention_heads": 4, "encoder_ffn_dim": 64,
        "output_dim": 64, "downsample_hidden_size": 16, "n_window": 50, "n_window_infer": 800, "conv_chunksize": 500,
        "max_source_positions": 1500, "activation_function": "gelu", "scale_embedding": False,
        "initializer_range": initializer_range, **(audio or {}),
    }
    text_config = {
        "vocab_size": THINKER_VOCAB_SIZE, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "hidden_act": "silu",
        "max_position_embeddings": 65536, "rms_norm_eps": 1e-6, "rope_theta": 1_000_000.0,
        "rope_scaling": {"rope_type": "default", "interleaved": True, "mrope_interleaved": True},
        "tie_word_embeddings": not aligner, "initializer_range": initializer_range, **(text or {}),
    }
    # the M-RoPE sections span head_dim / 2 (all rows equal for text and audio: only the reference reads them)
    half = text_config["head_dim"] // 2
    text_config["rope_scaling"]["mrope_section"] = [half - 2 * (5 * half // 16), 5 * half // 16, 5 * half // 16]
    audio_config["output_dim"] = text_config["hidden_size"]
    thinker = {
        "model_type": ALIGNER_THINKER_TYPE if aligner else "qwen3_asr_thinker",
        "audio_config": audio_config, "text_config": text_config,
        "audio_token_id": ids["<|audio_pad|>"], "audio_start_token_id": ids["<|audio_start|>"],
        "audio_end_token_id": ids["<|audio_end|>"], "user_token_id": ids["user"],
        "initializer_range": initializer_range,
    }
    config = {"model_type": "qwen3_asr", "architectures": ["Qwen3ASRForConditionalGeneration"],
              "support_languages": list(ASR_LANGUAGES), "thinker_config": thinker}
    if aligner:
        thinker["classify_num"] = RELEASED_CLASSIFY_NUM
        config.update(timestamp_token_id=TINY_ASR_TOKENS[TIMESTAMP_TOKEN], timestamp_segment_time=RELEASED_SEGMENT_MS)
    return config


def tiny_qwen3_asr(seed: int = 0, aligner: bool = False, **config_options) -> Qwen3ASRModel:
    """A seeded tiny Qwen3-ASR (a Qwen3-ForcedAligner with aligner=True; `tiny_config`): matrices, convolutions and
    tables drawn N(0, initializer_range²) so that the greedy argmax stays away from ties and the encoder rows
    depend on the audio, biases zero and norms one (as the reference initializes them)."""
    config = tiny_config(aligner, **config_options)
    std = config["thinker_config"]["initializer_range"]
    generator = torch.Generator().manual_seed(seed)
    model = Qwen3ASRModel(config)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, (nn.Linear, nn.Embedding, nn.Conv2d)):
                if module is model.thinker.lm_head and model.thinker.ties_lm_head:
                    continue
                module.weight.copy_(torch.randn(module.weight.shape, generator=generator) * std)
                if getattr(module, "bias", None) is not None:
                    module.bias.zero_()
            elif isinstance(module, nn.LayerNorm):
                module.weight.fill_(1.0)
                module.bias.zero_()
    return model.eval()


def asr_byte_tokenizer():
    """The byte tokenizer (`omnimtp.tokenizer.byte_tokenizer`) with Qwen3-ASR's `<asr_text>` and `<timestamp>`
    at `TINY_ASR_TOKENS`' ids, ordinary added tokens as in the released tokenizer (decoding keeps them)."""
    from omnimtp.tokenizer import byte_tokenizer

    tokenizer = byte_tokenizer()
    for name, token_id in sorted(TINY_ASR_TOKENS.items(), key=lambda item: item[1]):
        tokenizer.add_tokens([AddedToken(name, special=False, normalized=False)])
        if tokenizer.convert_tokens_to_ids(name) != token_id:
            raise RuntimeError(f"token {name!r} got id {tokenizer.convert_tokens_to_ids(name)}, expected {token_id}")
    return tokenizer
