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
from transformers.modeling_outputs import BaseModelOutput
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding
from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeAudioEncoderConfig
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeAudioEncoder

from omnimtp.models.qwen3_tts import Decoder, decoder_config, release_matrices
from omnimtp.models.tiny import THINKER_SPECIAL_TOKENS, THINKER_VOCAB_SIZE
from omnimtp.runtime.ops import (
    MANY_ROW_MODES,
    PackedGemm,
    QuantizedWeight,
    check_many_row_mode,
    conv2d,
    linear,
    packed_gemm_kind,
    quantize_conv_weight,
    quantize_weight,
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
    of `quantize_weight`), the bias float. Either way through `omnimtp.runtime.ops.linear`. bf16_out (linears
    "bf16"): the output stays bf16 (a linear whose output an activation takes to the next linear, which rounds its
    input to bf16 anyway: GELU on the bf16 rows gives those same bits, without casting the widest rows to float32
    and back)."""

    def __init__(self, module: nn.Linear, linears: str, bf16_out: bool = False):
        super().__init__()
        self.in_features, self.out_features = module.in_features, module.out_features
        self.bf16_out = bf16_out and linears == "bf16"
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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quantized is None:
            out = linear(x.to(torch.bfloat16), self.weight, self.bias, packed=self.packed, gemm=self.gemm)
            return out if self.bf16_out else out.float()
        return linear(x.float(), None, self.bias, packed=self.quantized)


class Bf16Conv2d(nn.Module):
    """An nn.Conv2d computed in bf16 (oneDNN's kernels, the CPU's bf16 instructions where it has them) on a bf16
    copy of its weights, its input rounded to bf16 as it enters, its output bf16: the encoder's GELUs between the
    convolutions then run in bf16 too, and the stack's large activations are never cast (the first linear after
    it, `conv_out`, takes bf16 rows). channels_last: the output in channels-last memory (what `W8A8Conv2d` reads
    without reordering); oneDNN picks that layout from its operands', and an operand of one input channel is as
    much channels first as last, so such a convolution gets a second input channel of zeros (weights and input:
    the same sums)."""

    def __init__(self, module: nn.Conv2d, channels_last: bool = False):
        super().__init__()
        weight = module.weight.detach().to(torch.bfloat16)
        self.channels_last = channels_last
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
        return F.conv2d(x, self.weight, self.bias, self.stride, self.padding)


class W8A8Conv2d(nn.Module):
    """An nn.Conv2d on oneDNN's int8 GEMM (`omnimtp.runtime.ops.conv2d`: each output position's patch a row
    quantized to int8 on its own, the weight int8 per output channel, `quantize_conv_weight`), its input rounded to
    bf16 as it enters and its output bf16 as `Bf16Conv2d`'s. It takes and gives [B, C, H, W] in channels-last
    memory (the rows the GEMM reads and writes), so a stack of them and the GELUs between them never reorder."""

    def __init__(self, module: nn.Conv2d):
        super().__init__()
        self.quantized = quantize_conv_weight(module.weight, "w8a8")
        self.bias = None if module.bias is None else nn.Parameter(module.bias.detach().float(), requires_grad=False)
        self.kernel_size, self.stride, self.padding = module.kernel_size, module.stride, module.padding

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.to(torch.bfloat16).permute(0, 2, 3, 1)  # [B, H, W, C]: no copy for a channels-last input
        out = conv2d(rows, self.quantized, self.bias, self.kernel_size, self.stride, self.padding)
        return out.permute(0, 3, 1, 2)


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


# each bf16 linear an activation leads to another linear from (→ GELU → fc2, → proj2), and each norm whose
# only readers are linears (q/k/v, fc1, proj1): their output stays bf16, the bits the readers see unchanged
BF16_OUT_LINEARS = ("fc1", "proj1")
ROUNDED_NORMS = ("self_attn_layer_norm", "final_layer_norm", "ln_post")


def fast_audio_encoder(tower: nn.Module, linears: str = "bf16") -> nn.Module:
    """A copy of the audio encoder `tower` (transformers' `Qwen3OmniMoeAudioEncoder`) for the fast modes: every
    linear (the layers' q/k/v/out and fc1/fc2, conv_out, proj1/proj2) an `EncoderLinear` of `linears` ("bf16",
    or a quantized mode; in bf16, fc1's and proj1's rows stay bf16 through their GELU, and the norms before q/k/v,
    fc1 and proj1 round their rows once, `RoundedNorm`), the
    three convolutions in bf16 (`Bf16Conv2d`), except with linears "w8a8": the convolutions of more than one input
    channel then on the int8 GEMM too (`W8A8Conv2d`), the first one's rows channels last for them; norms,
    activations, attention and the sinusoids as they are, in float32. The copy shares the tower's other tensors;
    the tower is not modified. Each audio is encoded alone, so an audio's rows do not depend on the other
    requests."""
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
        elif linears in MANY_ROW_MODES and module.in_channels > 1:
            setattr(parent, child, W8A8Conv2d(module))
        else:  # before a W8A8Conv2d: its rows channels last
            setattr(parent, child, Bf16Conv2d(module, channels_last=linears in MANY_ROW_MODES))
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
    thinker itself). int8_compute (any `quantize`): a copy whose linears are "w8a8" (`ops.MANY_ROW_MODES`: oneDNN's
    int8 GEMM, each row quantized to int8 on its own), and so are its convolutions but the first (`W8A8Conv2d`: each
    output position's patch a row); ValueError naming int8_compute
    where that does not run."""
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
