"""Qwen3-TTS's 12 Hz speech tokenizer decoder: codes [16, T] → 24 kHz audio, 1920 samples per frame.

The network is the reference's (`qwen_tts` `Qwen3TTSTokenizerV2Decoder`), built from transformers' modules:

    codes [B, 16, T]
      → split RVQ (transformers' Mimi quantizer: codebook 0 semantic, 1..15 acoustic; each codebook is its
        EMA statistics `embedding_sum / cluster_usage`, each half summed and projected by a 1×1 conv)
      → causal pre-conv (kernel 3) → [B, T, latent]
      → input_proj → Qwen3-Omni's code2wav transformer (8 layers, 72-frame sliding window) → output_proj
      → Qwen3-Omni's code2wav conv body (2× ConvNeXt upsampling, then 8·5·4·3 SnakeBeta decoder blocks)
      → [B, 1, 1920·T], clamped to ±1

One difference from Qwen3-Omni's body: Qwen3-TTS's transposed convolutions trim their whole overlap on the
right, so the decoder is causal to the sample — frame t's 1920 samples depend on frames ≤ t only — and T
frames give exactly 1920·T samples (Qwen3-Omni's give 1920·T − 555).

Streaming (`new_stream` / `decode_streams`) is `omnimtp.codec.streaming.StreamingCode2Wav` with this model's
front end. A stream keeps exactly what its next chunk needs, all of it sized from the modules:
- pre-conv: its last kernel − 1 = 2 frames of quantizer output (`causal_conv_step`);
- transformer: its KV cache (the sliding-window cache keeps each layer's last 71 frames, all a query sees);
- conv body: every convolution's last inputs at its own rate — 6 for the first and last convs and each
  ConvNeXt's depthwise conv, 6 / 18 / 54 for the residual units' dilations 1 / 3 / 9, one input for each
  decoder block's transposed conv (kernel 2r, stride r), none for the ×2 upsamplers (kernel = stride): 22
  tails, 134,208 values at the released widths.
So a chunk of n frames runs n frames of convolution whatever n (a 1-frame chunk recomputes no left context:
the first sample of frame a reaches back to frame a − 10 through the conv body, and those frames' work is
what the tails hold). A decoder that re-ran everything from codes (vLLM-Omni's 72 frames of left context)
would need 8 · 71 + 2 + 10 = 580 frames to be exact: each sliding-window layer reaches 71 frames further back.

The reference's `Qwen3TTSTokenizerV2Model.decode` runs `chunked_decode(chunk_size=300, left_context_size=25)`,
which is the full forward up to 300 frames (24 s) and an approximation beyond; `decode` here is the full
forward at every length.

    decoder = SpeechTokenizerDecoder.from_pretrained("Qwen3-TTS-12Hz-0.6B-CustomVoice/speech_tokenizer")
    audio = decoder.decode(codes)                                  # [16, T] → float32 [1920·T]
    stream = decoder.new_stream()
    chunks = [decoder.decode_streams([stream], [codes[:, a:b]], [b == T])[0] for a, b in bounds]
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn
from transformers import MimiConfig
from transformers.models.mimi.modeling_mimi import MimiSplitResidualVectorQuantizer
from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeCode2WavConfig
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
    Qwen3OmniMoeCausalConvNet,
    Qwen3OmniMoeCausalTransConvNet,
    Qwen3OmniMoeCode2WavDecoderBlock,
    Qwen3OmniMoeCode2WavTransformerModel,
    Qwen3OmniMoeConvNeXtBlock,
    Qwen3OmniMoeSnakeBeta,
)

from omnimtp.codec import streaming
from omnimtp.codec.streaming import (
    CodecStream,
    StreamingCode2Wav,
    cast_conv_stack,
    causal_conv_step,
    transposed_conv_as_matmul,
)
from omnimtp.models.tiny import TINY_SPEECH_RMS

SAMPLE_RATE = 24000
MODEL_TYPE = "qwen3_tts_tokenizer_12hz"

# The reference's `Qwen3TTSTokenizerV2DecoderConfig` defaults, for keys a config.json leaves out
# (`codebook_dim` has none there: a config must give it).
DECODER_DEFAULTS = dict(
    codebook_size=2048, hidden_size=1024, latent_dim=1024, max_position_embeddings=8000, rope_theta=10000,
    num_attention_heads=16, num_key_value_heads=16, attention_bias=False, sliding_window=72,
    intermediate_size=3072, hidden_act="silu", layer_scale_initial_scale=0.01, rms_norm_eps=1e-5,
    num_hidden_layers=8, num_quantizers=16, upsample_rates=(8, 5, 4, 3), upsampling_ratios=(2, 2),
    decoder_dim=1536, attention_dropout=0.0,
)

# The released Qwen3-TTS-12Hz speech tokenizer's decoder (0.6B and 1.7B share it).
RELEASED_DECODER_CONFIG = dict(
    DECODER_DEFAULTS, codebook_dim=512, hidden_size=512, head_dim=64, intermediate_size=1024,
)

TINY_DECODER_CONFIG = dict(
    DECODER_DEFAULTS, codebook_dim=16, hidden_size=32, head_dim=8, latent_dim=24, num_attention_heads=4,
    num_key_value_heads=2, intermediate_size=48, num_hidden_layers=2, decoder_dim=32, layer_scale_initial_scale=1.0,
)

# The reference's quantizer names (moshi's) ↔ transformers' Mimi quantizer names, in the decoder's state dict.
_REFERENCE_TO_MIMI = (
    ("quantizer.rvq_first.vq.layers.", "quantizer.semantic_residual_vector_quantizer.layers."),
    ("quantizer.rvq_rest.vq.layers.", "quantizer.acoustic_residual_vector_quantizer.layers."),
    ("quantizer.rvq_first.", "quantizer.semantic_residual_vector_quantizer."),
    ("quantizer.rvq_rest.", "quantizer.acoustic_residual_vector_quantizer."),
    ("._codebook.embedding_sum", ".codebook.embed_sum"),
    ("._codebook.cluster_usage", ".codebook.cluster_usage"),
)
_MIMI_ONLY_SUFFIX = ".codebook.initialized"  # Mimi's flag buffer; the reference has none


class CausalTransConv(Qwen3OmniMoeCausalTransConvNet):
    """Qwen3-Omni's causal transposed conv with the overlap (kernel − stride) trimmed on the right only:
    L inputs → L·stride outputs, output t depending on inputs ≤ t // stride."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, stride: int):
        super().__init__(in_channels, out_channels, kernel_size, stride)
        self.left_pad = 0
        self.right_pad = kernel_size - stride

    def forward(self, hidden_state: torch.Tensor) -> torch.Tensor:
        """[B, C_in, L] → [B, C_out, L·stride]. A large layer, or a short input of a layer the row kernel takes,
        runs as a matmul (`streaming.transposed_conv_as_matmul`: within 2e-6 of the convolution's peak)."""
        out = transposed_conv_as_matmul(self, hidden_state)
        if out is None:
            return super().forward(hidden_state)
        return out if self.conv.bias is None else out + self.conv.bias[:, None]


class DecoderTransformer(Qwen3OmniMoeCode2WavTransformerModel):
    """Qwen3-Omni's code2wav transformer between projections from and back to the latent width."""

    def __init__(self, config: Qwen3OmniMoeCode2WavConfig, latent_dim: int):
        super().__init__(config)
        self.input_proj = nn.Linear(latent_dim, config.hidden_size)
        self.output_proj = nn.Linear(config.hidden_size, latent_dim)

    def project(self, latent: torch.Tensor) -> torch.Tensor:
        """[B, n, latent] → [B, n, latent] (transformers' forward; streamed: `StreamedTransformer`)."""
        return self.output_proj(self(inputs_embeds=self.input_proj(latent)).last_hidden_state)


@dataclass
class SpeechTokenizerStream(CodecStream):
    """`CodecStream` plus the pre-conv's state: its last kernel − 1 input frames."""

    quantized_tail: torch.Tensor | None = None  # [1, codebook_dim, 2]


class SpeechTokenizerDecoder(nn.Module):
    """The 12 Hz decoder (state dict = the reference's `decoder.*` with Mimi's quantizer names). Float32 on
    CPU by default; `decode` and `decode_streams` take no gradients."""

    def __init__(self, tokenizer_config: dict):
        super().__init__()
        self.tokenizer_config = _tokenizer_config(tokenizer_config)
        decoder = self.tokenizer_config["decoder_config"]
        self.config = _code2wav_config(decoder)
        self.codebook_dim = int(decoder["codebook_dim"])
        self.latent_dim = int(decoder["latent_dim"])
        self.total_upsample = int(np.prod(list(self.config.upsample_rates) + list(self.config.upsampling_ratios)))

        self.quantizer = MimiSplitResidualVectorQuantizer(MimiConfig(
            codebook_size=self.config.codebook_size, codebook_dim=self.codebook_dim // 2,
            vector_quantization_hidden_dimension=self.codebook_dim // 2, hidden_size=self.codebook_dim,
            num_quantizers=self.config.num_quantizers, num_semantic_quantizers=1,
        ))
        self.pre_conv = Qwen3OmniMoeCausalConvNet(self.codebook_dim, self.latent_dim, kernel_size=3)
        self.pre_transformer = DecoderTransformer(self.config, self.latent_dim)
        self.upsample = nn.ModuleList(
            nn.ModuleList([CausalTransConv(self.latent_dim, self.latent_dim, factor, factor),
                           Qwen3OmniMoeConvNeXtBlock(self.latent_dim)])
            for factor in self.config.upsampling_ratios
        )
        blocks = []
        for i, rate in enumerate(self.config.upsample_rates):
            block = Qwen3OmniMoeCode2WavDecoderBlock(self.config, i)
            in_dim, out_dim = self.config.decoder_dim // 2**i, self.config.decoder_dim // 2 ** (i + 1)
            block.block[1] = CausalTransConv(in_dim, out_dim, 2 * rate, rate)
            blocks.append(block)
        output_dim = self.config.decoder_dim // 2 ** len(self.config.upsample_rates)
        self.decoder = nn.ModuleList([
            Qwen3OmniMoeCausalConvNet(self.latent_dim, self.config.decoder_dim, 7),
            *blocks,
            Qwen3OmniMoeSnakeBeta(output_dim),
            Qwen3OmniMoeCausalConvNet(output_dim, 1, 7),
        ])
        self.eval()
        self._streaming = _StreamingDecoder(self)

    # --- properties the engine reads ---

    sample_rate = SAMPLE_RATE

    @property
    def num_quantizers(self) -> int:
        return self.config.num_quantizers

    @property
    def codebook_size(self) -> int:
        return self.config.codebook_size

    @property
    def samples_per_frame(self) -> int:
        return self.total_upsample

    @property
    def conv_dtype(self) -> torch.dtype:
        """The conv stack's dtype (`to_conv_dtype`)."""
        return self._streaming.conv_dtype

    # --- loading and saving ---

    @classmethod
    def from_pretrained(cls, path, dtype: torch.dtype = torch.float32, device=None) -> SpeechTokenizerDecoder:
        """Load a `speech_tokenizer/` directory of the released layout (config.json + model.safetensors or a
        sharded index). Only the `decoder.*` weights are read: the encoder's may be there or not."""
        path = Path(path)
        config_path = path / "config.json"
        if not config_path.is_file():
            raise ValueError(f"path: {path} has no config.json (want a Qwen3-TTS speech_tokenizer directory)")
        tokenizer_config = json.loads(config_path.read_text())
        if tokenizer_config.get("model_type", MODEL_TYPE) != MODEL_TYPE:
            raise ValueError(f"path: {config_path} is a {tokenizer_config['model_type']!r} config, not {MODEL_TYPE!r}")
        with torch.device("meta"):
            model = cls(tokenizer_config)
        state = {}
        for file in weight_files(path):
            with safe_open(str(file), framework="pt") as f:
                for key in f.keys():
                    if key.startswith("decoder."):
                        state[_to_mimi_key(key.removeprefix("decoder."))] = f.get_tensor(key).to(dtype)
        model.load_decoder_state(state, assign=True, source=str(path))
        return model.to(device=device) if device is not None else model

    def load_decoder_state(self, state: dict[str, torch.Tensor], assign: bool = False, source: str = "state") -> None:
        """Load our own state dict (missing or unexpected decoder keys are an error naming them)."""
        expected = {k for k in self.state_dict() if not k.endswith(_MIMI_ONLY_SUFFIX)}
        missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
        if missing or unexpected:
            raise ValueError(f"path: {source} decoder weights do not match the config: "
                             f"missing {missing[:5]}{'…' if len(missing) > 5 else ''}, "
                             f"unexpected {unexpected[:5]}{'…' if len(unexpected) > 5 else ''}")
        flags = {k: torch.ones(1) for k in self.state_dict() if k.endswith(_MIMI_ONLY_SUFFIX)}
        self.load_state_dict({**state, **flags}, strict=True, assign=assign)
        self._rebuild_buffers()

    def save_pretrained(self, path) -> None:
        """config.json + model.safetensors in the reference's layout (`decoder.*`, moshi quantizer names),
        loadable by `Qwen3TTSTokenizerV2Model.from_pretrained` (its encoder left to its own init). A decoder
        whose conv stack was cast to another dtype (`to_conv_dtype`) holds rounded weights: a ValueError,
        rather than a checkpoint that would quietly sound different."""
        if self.conv_dtype != torch.float32:
            raise ValueError(f"path: this decoder's conv stack runs in {self.conv_dtype} (codec_dtype) and its float32 "
                             "weights are gone; save from a model loaded without codec_dtype")
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        tensors = {
            "decoder." + _to_reference_key(k): v.detach().contiguous().cpu()
            for k, v in self.state_dict().items() if not k.endswith(_MIMI_ONLY_SUFFIX)
        }
        save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
        (path / "config.json").write_text(json.dumps(self.tokenizer_config, indent=2, sort_keys=True) + "\n")

    @classmethod
    def tiny(cls, seed: int = 0, **decoder_overrides) -> SpeechTokenizerDecoder:
        """`tiny_speech_tokenizer`."""
        return tiny_speech_tokenizer(seed, **decoder_overrides)

    def to_conv_dtype(self, dtype: torch.dtype) -> SpeechTokenizerDecoder:
        """The conv stack (the upsampling and decoder blocks, nearly all of the decoder's arithmetic) in
        `dtype`, in place; the quantizer, pre-conv and transformer stay as they are, and the stack's input is
        cast as it enters. torch.bfloat16 runs the stack on the CPU's bf16 instructions where it has them
        (AVX512_BF16): an opt-in that changes the audio (`omnimtp.codec.streaming.CODEC_DTYPES`). →
        self."""
        cast_conv_stack(self, dtype)
        return self

    # --- decoding ---

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        """The reference decoder's forward: codes [B, G, T] → waveform [B, 1, samples_per_frame·T] in ±1."""
        return self.waveform(codes).clamp(min=-1, max=1)

    def waveform(self, codes: torch.Tensor) -> torch.Tensor:
        """`forward` before its ±1 clamp."""
        hidden = self.pre_conv(self.quantizer.decode(codes))  # [B, latent, T]
        hidden = self.pre_transformer.project(hidden.transpose(1, 2)).transpose(1, 2)
        hidden = hidden.to(self.conv_dtype)
        for blocks in self.upsample:
            for block in blocks:
                hidden = block(hidden)
        wav = hidden
        for block in self.decoder:
            wav = block(wav)
        return wav

    @torch.no_grad()
    def decode(self, codes) -> np.ndarray:
        """codes [G=16, T] (integer ids in [0, codebook_size)) → float32 audio [samples_per_frame·T]."""
        codes = self.check_codes(codes, "codes")
        return self(codes[None])[0, 0].float().cpu().numpy()

    def new_stream(self) -> SpeechTokenizerStream:
        """A request's decoder state (transformer KV cache, pre-conv and conv-body tails)."""
        return self._streaming.new_stream()

    @torch.no_grad()
    def decode_streams(self, streams: list, blocks: list, is_final: list[bool] | None = None) -> list[np.ndarray]:
        """The next audio of several streams: blocks[i] [G, n_i] continues streams[i] → float32 chunks of
        samples_per_frame·n_i samples. A stream's chunks, joined, are `decode` of its frames (up to float
        rounding: see the module docstring) and are bit for bit the same whichever streams share the call.
        The decoder never looks ahead, so `is_final` holds nothing back (it is checked, not needed)."""
        if len(blocks) != len(streams):
            raise ValueError(f"blocks: {len(blocks)} code blocks for {len(streams)} streams")
        if is_final is not None and len(is_final) != len(streams):
            raise ValueError(f"is_final: {len(is_final)} flags for {len(streams)} streams")
        checked = [self.check_codes(block, f"blocks[{i}]") for i, block in enumerate(blocks)]
        return self._streaming.decode(streams, checked)

    def check_codes(self, codes, name: str) -> torch.Tensor:
        """codes as a LongTensor [G, n>=1] on the model's device, or a ValueError naming `name`."""
        if not isinstance(codes, torch.Tensor):
            codes = torch.as_tensor(np.asarray(codes))
        if codes.dtype.is_floating_point or codes.dtype == torch.bool or codes.is_complex():
            raise ValueError(f"{name}: codes must be integer ids, got dtype {codes.dtype}")
        if codes.dim() != 2 or codes.shape[0] != self.num_quantizers or codes.shape[1] == 0:
            raise ValueError(f"{name}: must be [{self.num_quantizers}, T>=1] codes, got shape {tuple(codes.shape)}")
        low, high = int(codes.min()), int(codes.max())
        if low < 0 or high >= self.codebook_size:
            raise ValueError(f"{name}: code ids must be in [0, {self.codebook_size}), got [{low}, {high}]")
        return codes.to(device=self.pre_conv.conv.weight.device, dtype=torch.long)

    def _rebuild_buffers(self) -> None:
        """Recompute what is derived from the weights (Mimi's cached codebook; RoPE, which a meta-device
        build leaves empty)."""
        for module in self.quantizer.modules():
            if hasattr(module, "_embed"):
                module._embed = None
        rotary = self.pre_transformer.rotary_emb
        device = self.pre_conv.conv.weight.device
        inv_freq, rotary.attention_scaling = rotary.compute_default_rope_parameters(self.config)
        rotary.inv_freq = inv_freq.to(device)
        rotary.original_inv_freq = inv_freq.clone().to(device)


class _StreamingDecoder(StreamingCode2Wav):
    """`StreamingCode2Wav` whose transformer input comes through the split RVQ and the causal pre-conv (a stateful
    convolution too: `causal_conv_step`)."""

    def new_stream(self) -> SpeechTokenizerStream:
        decoder = self.code2wav
        stream = SpeechTokenizerStream(
            conv_states=self.new_conv_states(),
            quantized_tail=decoder.pre_conv.conv.weight.new_zeros((1, decoder.codebook_dim, decoder.pre_conv.padding)),
        )
        self.transformer.attach(stream)
        return stream

    def _advance_transformer(self, streams: list[SpeechTokenizerStream], codes: list[torch.Tensor]) -> list:
        """Each stream's quantizer and pre-conv on its own, then every stream's frames through the projected
        transformer in one forward → [n_i, latent] each."""
        decoder = self.code2wav
        latents = []
        for stream, block in zip(streams, codes, strict=True):
            quantized = decoder.quantizer.decode(block[None])  # [1, codebook_dim, n]
            latent, stream.quantized_tail = causal_conv_step(decoder.pre_conv, quantized, stream.quantized_tail)
            latents.append(latent[0].t())  # [n, latent]
        counts = [block.shape[1] for block in codes]
        hidden = self.transformer.run(streams, torch.cat(latents), counts, streaming.ROW_KERNEL_MAX_ROWS)  # [N, latent]
        return list(hidden.split(counts))


def tiny_speech_tokenizer(seed: int = 0, **decoder_overrides) -> SpeechTokenizerDecoder:
    """A seeded tiny decoder with the real upsampling (1920 samples per frame at 24 kHz, so it pairs with any
    talker) and small widths, audible on random codes (RMS `TINY_SPEECH_RMS` before the ±1 clamp).

    At the reference's init the decoder is silent twice over (zero EMA codebooks, and each conv block losing
    ~10×), so the codebooks are drawn, every conv and linear gets unit gain (std 1/√fan-in, zero bias), the
    layer scales and ConvNeXt gammas are 1, and the last conv is scaled to speech level. The global torch
    RNG is left as it was."""
    decoder_config = dict(TINY_DECODER_CONFIG, **decoder_overrides)
    model = SpeechTokenizerDecoder({"decoder_config": decoder_config})
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in model.state_dict(keep_vars=True).items():
            if name.endswith("embed_sum"):
                tensor.copy_(torch.randn(tensor.shape, generator=generator))
            elif name.endswith("cluster_usage"):
                tensor.copy_(torch.rand(tensor.shape, generator=generator) + 0.5)
            elif name.endswith((".scale", ".gamma")):
                tensor.fill_(1.0)
        for module in model.modules():
            if isinstance(module, (nn.Conv1d, nn.Linear)):
                fan_in = module.weight[0].numel()
                module.weight.copy_(torch.randn(module.weight.shape, generator=generator) / math.sqrt(fan_in))
            elif isinstance(module, nn.ConvTranspose1d):  # each output sums in_channels × kernel/stride taps
                fan_in = module.in_channels * module.kernel_size[0] // module.stride[0]
                module.weight.copy_(torch.randn(module.weight.shape, generator=generator) / math.sqrt(fan_in))
            else:
                continue
            if module.bias is not None:
                module.bias.zero_()
        model._rebuild_buffers()
        calibration = torch.randint(0, model.codebook_size, (1, model.num_quantizers, 25), generator=generator)
        rms = model.waveform(calibration).double().pow(2).mean().sqrt().item()
        model.decoder[-1].conv.weight.mul_(TINY_SPEECH_RMS / rms)
    return model


def real_size_config() -> dict:
    """The released speech tokenizer's config.json (decoder part; the encoder's left to its defaults)."""
    return _tokenizer_config({"decoder_config": dict(RELEASED_DECODER_CONFIG)})


def _tokenizer_config(config: dict) -> dict:
    """The full config.json of the reference's layout, with every decoder key filled in."""
    decoder = dict(DECODER_DEFAULTS, **config.get("decoder_config", {}))
    if "codebook_dim" not in decoder:
        raise ValueError("path: the speech tokenizer's decoder_config has no codebook_dim")
    decoder["upsample_rates"] = list(decoder["upsample_rates"])
    decoder["upsampling_ratios"] = list(decoder["upsampling_ratios"])
    upsample = int(np.prod(decoder["upsample_rates"] + decoder["upsampling_ratios"]))
    return {
        "model_type": MODEL_TYPE, "architectures": ["Qwen3TTSTokenizerV2Model"],
        "encoder_valid_num_quantizers": decoder["num_quantizers"], "input_sample_rate": SAMPLE_RATE,
        "output_sample_rate": SAMPLE_RATE, "decode_upsample_rate": upsample, "encode_downsample_rate": upsample,
        "encoder_config": {},
        **{k: v for k, v in config.items() if k != "decoder_config"},
        "decoder_config": decoder,
    }


def _code2wav_config(decoder: dict) -> Qwen3OmniMoeCode2WavConfig:
    names = ("codebook_size", "hidden_size", "max_position_embeddings", "num_attention_heads",
             "num_key_value_heads", "attention_bias", "sliding_window", "intermediate_size", "hidden_act",
             "layer_scale_initial_scale", "rms_norm_eps", "num_hidden_layers", "num_quantizers",
             "upsample_rates", "upsampling_ratios", "decoder_dim", "attention_dropout")
    config = Qwen3OmniMoeCode2WavConfig(
        **{name: decoder[name] for name in names},
        rope_parameters={"rope_type": "default", "rope_theta": float(decoder["rope_theta"])},
    )
    config.head_dim = int(decoder.get("head_dim") or decoder["hidden_size"] // decoder["num_attention_heads"])
    return config


def weight_files(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint directory (one file, or the shards its index names); ValueError
    naming `path` when there are none."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        return sorted({path / name for name in json.loads(index.read_text())["weight_map"].values()})
    single = path / "model.safetensors"
    if not single.is_file():
        raise ValueError(f"path: {path} has no model.safetensors")
    return [single]


def _to_mimi_key(key: str) -> str:
    for reference, mimi in _REFERENCE_TO_MIMI:
        key = key.replace(reference, mimi)
    return key


def _to_reference_key(key: str) -> str:
    for reference, mimi in _REFERENCE_TO_MIMI:
        key = key.replace(mimi, reference)
    return key
