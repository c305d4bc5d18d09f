"""Qwen3-TTS Base's speaker encoder: a recording → its x-vector, the speaker row of a cloned voice.

The network is ECAPA-TDNN (Desplanques et al. 2020) as the reference builds it (`qwen_tts`'s
`Qwen3TTSSpeakerEncoder`), which is transformers' Qwen2.5-Omni `ECAPA_TimeDelayNet` module for module, under
the same parameter names (`blocks`, `mfa`, `asp`, `fc`), so a Base checkpoint's `speaker_encoder.*` weights
load unchanged. Its input is the reference's 128-bin log-mel of 24 kHz audio:

    samples [N] at 24 kHz
      → reflect-pad (n_fft - hop) / 2 on each side, |STFT| (Hann 1024, hop 256, no centering), sqrt(re² + im² + 1e-9)
      → slaney mel filters (0 … 12 kHz, librosa's `filters.mel`, here from transformers' `mel_filter_bank`)
      → log(max(mel, 1e-5))                                                     [T, 128]
      → ECAPA-TDNN → x-vector [enc_dim]  (enc_dim = the talker's hidden size)

    encoder = SpeakerEncoder(config["speaker_encoder_config"])
    x_vector = encoder.embed(samples)                              # float32 [enc_dim]
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import numpy as np
import torch
from transformers.audio_utils import mel_filter_bank
from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import ECAPA_TimeDelayNet

SAMPLE_RATE = 24_000
NUM_MELS = 128
N_FFT = 1024
HOP_LENGTH = 256
WIN_LENGTH = 1024
F_MIN = 0.0
F_MAX = 12_000.0
# the reference's `Qwen3TTSSpeakerEncoderConfig` defaults (the released Base models' values, enc_dim aside)
SPEAKER_ENCODER_DEFAULTS = {
    "mel_dim": NUM_MELS, "enc_dim": 1024, "enc_channels": [512, 512, 512, 512, 1536],
    "enc_kernel_sizes": [5, 3, 3, 3, 1], "enc_dilations": [1, 2, 3, 4, 1], "enc_attention_channels": 128,
    "enc_res2net_scale": 8, "enc_se_channels": 128, "sample_rate": SAMPLE_RATE,
}


@functools.lru_cache(maxsize=4)
def mel_filters(sample_rate: int = SAMPLE_RATE, n_fft: int = N_FFT, num_mels: int = NUM_MELS, f_min: float = F_MIN,
                f_max: float = F_MAX) -> torch.Tensor:
    """The slaney-scale, slaney-normalised triangular filters [num_mels, n_fft // 2 + 1] (float32), as
    librosa's `filters.mel(sr, n_fft, n_mels, fmin, fmax)` computes them."""
    filters = mel_filter_bank(num_frequency_bins=n_fft // 2 + 1, num_mel_filters=num_mels, min_frequency=f_min,
                              max_frequency=f_max, sampling_rate=sample_rate, norm="slaney", mel_scale="slaney")
    return torch.from_numpy(np.ascontiguousarray(filters.T, dtype=np.float32))


def log_mel(samples: torch.Tensor, *, f_max: float = F_MAX) -> torch.Tensor:
    """The reference's `mel_spectrogram(y, 1024, 128, 24000, 256, 1024, 0, 12000)`: samples [B, N] (float32 at
    24 kHz, N >= 385) → log-mel [B, 128, T], T = 1 + (N - 256) // 256."""
    window = torch.hann_window(WIN_LENGTH, device=samples.device)
    padding = (N_FFT - HOP_LENGTH) // 2
    padded = torch.nn.functional.pad(samples.unsqueeze(1), (padding, padding), mode="reflect").squeeze(1)
    spec = torch.stft(padded, N_FFT, hop_length=HOP_LENGTH, win_length=WIN_LENGTH, window=window, center=False,
                      normalized=False, onesided=True, return_complex=True)
    magnitude = torch.sqrt(torch.view_as_real(spec).pow(2).sum(-1) + 1e-9)  # [B, n_fft/2 + 1, T]
    mel = torch.matmul(mel_filters(f_max=f_max).to(samples.device), magnitude)
    return torch.log(torch.clamp(mel, min=1e-5))


class SpeakerEncoder(ECAPA_TimeDelayNet):
    """ECAPA-TDNN from a config.json `speaker_encoder_config` dict (missing keys take the reference's
    defaults). `forward(mels [B, T, mel_dim]) -> [B, enc_dim]`, as the reference's."""

    def __init__(self, config: dict):
        values = {**SPEAKER_ENCODER_DEFAULTS, **(config or {})}
        if values["mel_dim"] != NUM_MELS or values["sample_rate"] != SAMPLE_RATE:
            raise ValueError(f"config: speaker_encoder_config wants {NUM_MELS} mel bins at {SAMPLE_RATE} Hz, got "
                             f"{values['mel_dim']} at {values['sample_rate']}")
        super().__init__(SimpleNamespace(**values))
        self.enc_dim = int(values["enc_dim"])
        self.sample_rate = SAMPLE_RATE

    @property
    def min_samples(self) -> int:
        """The shortest input the log-mel's reflect padding accepts (a few frames)."""
        return N_FFT // 2 + 1

    @torch.no_grad()
    def embed(self, samples) -> torch.Tensor:
        """The x-vector of mono samples at 24 kHz (a float array [N]) → float32 [enc_dim] on the CPU."""
        weight = self.fc.weight
        samples = torch.as_tensor(np.asarray(samples, dtype=np.float32)).to(weight.device)
        mels = log_mel(samples[None]).transpose(1, 2)  # [1, T, 128]
        return self(mels.to(weight.dtype))[0].float().cpu()
