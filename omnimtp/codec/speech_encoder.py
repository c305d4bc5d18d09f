"""Qwen3-TTS's 12 Hz speech tokenizer encoder: 24 kHz audio → codes [16, T], the reference codes of an
in-context (ICL) voice clone.

The reference's encoder (`qwen_tts`'s `Qwen3TTSTokenizerV2Encoder`) is a transformers `MimiModel` without its
decoder half, stored in `speech_tokenizer/model.safetensors` under `encoder.` in the flat layout of Mimi
checkpoints (`encoder.layers` for the SEANet stack, `encoder_transformer`, `downsample`, `quantizer`). That
class does not build on transformers 5.24, whose `MimiModel` is split into halves, so the encoder here is
5.24's `MimiModel` with its decoder dropped (`MimiConfig.decoder_config = None`) and the weights renamed as
transformers' own Mimi checkpoint conversion renames them. Its codes are the first
`encoder_valid_num_quantizers` of Mimi's, one frame per started 1920 samples (the reference's trim).

    encoder = SpeechTokenizerEncoder.from_pretrained("Qwen3-TTS-12Hz-0.6B-Base/speech_tokenizer")
    codes = encoder.encode(samples)                       # float32 [N] at 24 kHz → int64 [16, ceil(N / 1920)]
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import MimiConfig, MimiModel

from omnimtp.codec.speech_tokenizer import weight_files

SAMPLE_RATE = 24_000
# the flat Mimi layout of the file (after its `encoder.` prefix) → 5.24's MimiModel, as transformers'
# conversion mapping for "MimiModel" renames it
_FLAT_TO_MIMI = (
    ("encoder.layers.", "encoder.encoder_seanet.layers."),
    ("encoder_transformer.", "encoder.encoder_transformer."),
    ("downsample.", "encoder.downsample."),
    ("quantizer.", "quantizer."),
)
_INITIALIZED_SUFFIX = ".codebook.initialized"

# A tiny Mimi encoder with the released strides (960 · 2 = 1920 samples per frame at 24 kHz) and a codebook
# the tiny talker's tables index (its 128 entries).
TINY_ENCODER_CONFIG = dict(
    hidden_size=32, num_filters=4, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, head_dim=16,
    intermediate_size=64, codebook_size=128, codebook_dim=32, vector_quantization_hidden_dimension=32,
    num_quantizers=16, num_semantic_quantizers=1, frame_rate=12.5, sampling_rate=SAMPLE_RATE,
    upsampling_ratios=[8, 6, 5, 4], sliding_window=250, upsample_groups=32,
)


class SpeechTokenizerEncoder(nn.Module):
    """`mimi`: transformers' `MimiModel` (encoder half and quantizer); `num_quantizers`: the codebooks kept
    (the tokenizer's `encoder_valid_num_quantizers`)."""

    def __init__(self, encoder_config: dict, num_quantizers: int = 16):
        super().__init__()
        config = MimiConfig(**{k: v for k, v in encoder_config.items() if k not in ("model_type", "architectures")})
        config.decoder_config = None
        if config.sampling_rate != SAMPLE_RATE or config.frame_size <= 0:
            raise ValueError(f"config: the speech tokenizer's encoder_config must be {SAMPLE_RATE} Hz, got "
                             f"{config.sampling_rate}")
        if not 1 <= num_quantizers <= config.num_quantizers:
            raise ValueError(f"config: encoder_valid_num_quantizers {num_quantizers} is outside [1, "
                             f"{config.num_quantizers}]")
        self.mimi = MimiModel(config).eval()
        self.num_quantizers = int(num_quantizers)
        self.samples_per_frame = int(config.frame_size)
        self.sample_rate = SAMPLE_RATE

    @property
    def codebook_size(self) -> int:
        return self.mimi.config.codebook_size

    @classmethod
    def from_pretrained(cls, path, device=None) -> SpeechTokenizerEncoder | None:
        """The encoder of a `speech_tokenizer/` directory, or None when its weights hold no encoder (a
        tokenizer kept for decoding only)."""
        path = Path(path)
        config = json.loads((path / "config.json").read_text())
        state = {}
        for file in weight_files(path):
            with safe_open(str(file), framework="pt") as f:
                for key in f.keys():
                    if key.startswith("encoder."):
                        state[_to_mimi_key(key.removeprefix("encoder."))] = f.get_tensor(key)
        if not state:
            return None
        encoder = cls(config.get("encoder_config") or {}, config.get("encoder_valid_num_quantizers", 16))
        encoder.load_mimi_state(state, source=str(path))
        return encoder if device is None else encoder.to(device)

    def load_mimi_state(self, state: dict[str, torch.Tensor], source: str = "state") -> None:
        """MimiModel's state dict (a missing codebook `initialized` flag is set: the file's codebooks are trained)."""
        expected = set(self.mimi.state_dict())
        flags = {k: torch.ones(1) for k in expected if k.endswith(_INITIALIZED_SUFFIX) and k not in state}
        missing, unexpected = sorted(expected - set(state) - set(flags)), sorted(set(state) - expected)
        if missing or unexpected:
            raise ValueError(f"path: {source} encoder weights do not match its encoder_config: missing {missing[:4]}, "
                             f"unexpected {unexpected[:4]}")
        self.mimi.load_state_dict({**state, **flags}, strict=True)
        for module in self.mimi.quantizer.modules():
            if hasattr(module, "_embed"):
                module._embed = None  # Mimi caches embed_sum / cluster_usage at first use

    def save_pretrained(self, path) -> None:
        """Add the encoder to a `speech_tokenizer/` directory a `SpeechTokenizerDecoder` saved: its weights
        under `encoder.` in the flat Mimi layout, its config as `encoder_config`."""
        path = Path(path)
        config = json.loads((path / "config.json").read_text())
        config["encoder_config"] = {k: v for k, v in self.mimi.config.to_dict().items()
                                    if k not in ("decoder_config", "encoder_config", "transformers_version")}
        config["encoder_valid_num_quantizers"] = self.num_quantizers
        tensors = load_file(str(path / "model.safetensors"))
        tensors.update({"encoder." + _to_flat_key(k): v.detach().contiguous().cpu()
                        for k, v in self.mimi.state_dict().items()})
        save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
        (path / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")

    @torch.no_grad()
    def encode(self, samples, sample_rate: int = SAMPLE_RATE) -> torch.Tensor:
        """Mono float samples [N] at `sample_rate` (resampled to 24 kHz by `omnimtp.media.load_audio`) → int64
        codes [num_quantizers, ceil(N₂₄ / 1920)] on the CPU."""
        if sample_rate != SAMPLE_RATE:
            from omnimtp.media import load_audio

            samples = load_audio((np.asarray(samples), sample_rate), SAMPLE_RATE, param="samples")
        weight = next(self.mimi.parameters())
        audio = torch.as_tensor(np.asarray(samples, dtype=np.float32)).to(weight.device, weight.dtype)
        codes = self.mimi.encode(audio[None, None]).audio_codes[0, : self.num_quantizers]  # [Q, frames]
        return codes[:, : math.ceil(audio.shape[0] / self.samples_per_frame)].to("cpu", torch.int64)


def tiny_speech_tokenizer_encoder(seed: int = 0) -> SpeechTokenizerEncoder:
    """A seeded tiny encoder (`TINY_ENCODER_CONFIG`): transformers' init with drawn codebooks (Mimi's start
    at zero, which maps every frame to code 0), scaled to the latents' level so the codes vary with the audio."""
    encoder = SpeechTokenizerEncoder(TINY_ENCODER_CONFIG)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in encoder.mimi.modules():
            if isinstance(module, (nn.Conv1d, nn.Linear)):
                fan_in = module.weight[0].numel()
                module.weight.copy_(torch.randn(module.weight.shape, generator=generator) / math.sqrt(fan_in))
                if module.bias is not None:  # (torch's own init of a bias draws from the global generator)
                    module.bias.zero_()
        for name, tensor in encoder.mimi.quantizer.state_dict(keep_vars=True).items():
            if name.endswith("embed_sum"):
                tensor.copy_(torch.randn(tensor.shape, generator=generator))
            elif name.endswith("cluster_usage"):
                tensor.fill_(1.0)
            elif name.endswith("initialized"):
                tensor.fill_(1.0)
        encoder.load_mimi_state(encoder.mimi.state_dict())
    return encoder


def _to_mimi_key(key: str) -> str:
    for flat, mimi in _FLAT_TO_MIMI:
        if key.startswith(flat):
            return mimi + key[len(flat):]
    return key


def _to_flat_key(key: str) -> str:
    for flat, mimi in _FLAT_TO_MIMI:
        if key.startswith(mimi):
            return flat + key[len(mimi):]
    return key
