"""Qwen2.5-Omni token2wav (talker codes → 24 kHz audio), one-shot and streamed in chunks.

transformers' `Qwen2_5OmniToken2WavModel` is a DiT that turns T codes into T·repeats mel frames by flow
matching (an RK4 ODE from noise, `num_steps` time points with sway sampling, classifier-free guidance on
the codes and the speaker), then BigVGAN (240 samples per mel frame, so 480 per code). Its only source of
randomness is the initial noise, one `torch.randn([1, T·repeats, mel_dim])` from the global RNG.
`sample_mel` is that sampling loop with the noise passed in, on transformers' own modules; `one_shot`
draws the noise exactly as transformers does (or from a generator) and is bit for bit their output.

The DiT is not causal: every layer attends one block (`block_size` mel frames) back and/or ahead, and the
ODE steps spread that reach over the whole utterance, so no chunked decode equals the one-shot decode.
We stream it as the reference servers do, chunk by chunk (all sizes in codes, 1 code = repeats mel
frames = 480 samples):
- chunk k covers codes [k·C, (k+1)·C); its DiT window adds `look_back_frames` codes before it (rounded
  down to the DiT block grid, so the block mask matches the one-shot one) and `look_ahead_frames` after,
  so it runs once (k+1)·C + A codes are known, or at the final call;
- the window's initial noise is the stream's noise at the same mel positions. The stream draws noise
  lazily, in order, from its generator (or the global RNG); on CPU consecutive `randn` draws of whole
  mel frames (mel_dim·frames a multiple of 16) concatenate to one big draw, so a stream's noise is the
  one-shot noise whatever its block sizes, and the streamed-vs-one-shot gap measures chunking alone;
- the first `crossfade_frames` codes of chunk k are a linear crossfade from the previous window's
  look-ahead mel into this window's mel, which hides the seam;
- BigVGAN runs over the finalized mel with `vocoder_context_frames` codes of mel on each side of the
  samples it emits (a non-final call holds back the last context's samples until the mel after them
  exists), and drops the context's samples.
The final call decodes all remaining codes in one window and flushes everything, so the streamed audio
has the one-shot length, 480·T samples; a stream given all its codes in one final block is the one-shot
decode bit for bit.

    decoder = StreamingToken2Wav(model.token2wav)
    stream = decoder.new_stream(spk["cond"], spk["ref_mel"], generator)
    chunks = decoder.decode([stream], [codes[:, :60]], [False])   # [float32 numpy, maybe empty]
    chunks = decoder.decode([stream], [codes[:, 60:]], [True])    # the rest
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import RungeKutta4ODESolver


@torch.no_grad()
def sample_mel(
    dit,
    conditioning: torch.Tensor,  # [1, enc_emb_dim] speaker embedding
    reference_mel: torch.Tensor,  # [1, T_ref, mel_dim]
    codes: torch.Tensor,  # [1, T] long
    noise: torch.Tensor,  # [1, T·repeats, mel_dim] the ODE's initial state
    *,
    num_steps: int,
    guidance_scale: float,
    sway_coefficient: float | None,
) -> torch.Tensor:  # [1, T·repeats, mel_dim]
    """transformers' `Qwen2_5OmniToken2WavDiTModel.sample` with the initial noise as an argument."""
    num_mel_frames = noise.shape[1]
    speaker = conditioning.unsqueeze(1).repeat(1, num_mel_frames, 1)  # [1, F, enc_emb_dim]

    def velocity(time_point, hidden):
        if guidance_scale < 1e-5:
            return dit(
                hidden_states=hidden, speaker_embedding=speaker, condition_vector=reference_mel,
                quantized_code=codes, time_step=time_point, drop_audio_conditioning=False, drop_code=False,
                apply_cfg=False,
            )
        both = dit(
            hidden_states=hidden, speaker_embedding=speaker, condition_vector=reference_mel,
            quantized_code=codes, time_step=time_point, apply_cfg=True,
        )  # [2, F, mel_dim]: conditioned, then speaker and codes dropped
        guided, unconditioned = torch.chunk(both, 2, dim=0)
        return guided + (guided - unconditioned) * guidance_scale

    time_points = torch.linspace(0, 1, num_steps, device=codes.device, dtype=speaker.dtype)
    if sway_coefficient is not None:
        time_points += sway_coefficient * (torch.cos(torch.pi / 2 * time_points) - 1 + time_points)
    solver = RungeKutta4ODESolver(function=velocity, initial_value=noise)
    hidden = noise
    for time_start, time_end in zip(time_points[:-1], time_points[1:], strict=True):
        delta, _ = solver._compute_step(velocity, time_start, time_end - time_start, time_end, hidden)
        hidden = hidden + delta
    return hidden


@dataclass
class Token2WavStream:
    """One request's streaming state. Mel tensors are [1, frames, mel_dim], the DiT's layout.


    Only what later windows read is kept: `codes`, `noise` and `mel` hold the tail from `*_start` on.
    """

    conditioning: torch.Tensor  # [1, enc_emb_dim]
    reference_mel: torch.Tensor  # [1, T_ref, mel_dim]
    generator: torch.Generator | None
    codes: torch.Tensor  # [1, n'] codes codes_start.. of the stream
    noise: torch.Tensor  # [1, F', mel_dim] the noise drawn for mel frames noise_start..
    mel: torch.Tensor  # [1, F'', mel_dim] finalized mel frames mel_start..
    look_ahead_mel: torch.Tensor  # [1, F_ahead, mel_dim] the last window's mel after its chunk
    codes_start: int = 0
    noise_start: int = 0
    mel_start: int = 0
    num_chunks: int = 0  # chunks whose mel is final
    num_samples: int = 0  # audio samples returned so far
    is_finished: bool = False

    @property
    def num_codes(self) -> int:
        return self.codes_start + self.codes.shape[1]

    @property
    def num_mel_frames(self) -> int:
        return self.mel_start + self.mel.shape[1]


class StreamingToken2Wav:
    """Chunked Qwen2.5-Omni token2wav; see the module docstring. Chunk settings count codes (talker
    frames, 50 per second): `chunk_frames` per DiT window, `look_back_frames` / `look_ahead_frames` of
    context around it, `crossfade_frames` of overlap faded at each seam, `vocoder_context_frames` of mel
    on each side of the samples BigVGAN emits.

    A stream's audio does not depend on the other streams of a `decode` call when each has its own
    generator (streams are decoded one after another; with `generator=None` they draw from the global RNG
    in stream order)."""

    def __init__(
        self,
        token2wav,
        *,
        num_steps: int = 10,
        guidance_scale: float = 0.5,
        sway_coefficient: float | None = -1.0,
        chunk_frames: int = 50,
        look_back_frames: int = 24,
        look_ahead_frames: int = 12,
        crossfade_frames: int = 4,
        vocoder_context_frames: int = 16,
    ):
        if num_steps < 2:
            raise ValueError(f"num_steps: need at least 2 ODE time points, got {num_steps}")
        if chunk_frames < 1:
            raise ValueError(f"chunk_frames: must be >= 1, got {chunk_frames}")
        for name, value in [
            ("look_back_frames", look_back_frames),
            ("look_ahead_frames", look_ahead_frames),
            ("crossfade_frames", crossfade_frames),
            ("vocoder_context_frames", vocoder_context_frames),
        ]:
            if value < 0:
                raise ValueError(f"{name}: must be >= 0, got {value}")
        if crossfade_frames > min(look_ahead_frames, chunk_frames):
            raise ValueError(
                f"crossfade_frames: {crossfade_frames} exceeds look_ahead_frames ({look_ahead_frames}) or "
                f"chunk_frames ({chunk_frames}); the fade blends the previous window's look-ahead into a chunk"
            )
        self.token2wav = token2wav
        self.dit = token2wav.code2wav_dit_model
        self.vocoder = token2wav.code2wav_bigvgan_model
        self.num_steps = num_steps
        self.guidance_scale = guidance_scale
        self.sway_coefficient = sway_coefficient
        self.chunk_frames = chunk_frames
        self.look_back_frames = look_back_frames
        self.look_ahead_frames = look_ahead_frames
        self.crossfade_frames = crossfade_frames
        self.vocoder_context_frames = vocoder_context_frames
        self.repeats = int(self.dit.repeats)
        self.mel_dim = int(self.dit.mel_dim)
        self.samples_per_mel_frame = math.prod(self.vocoder.config.upsample_rates)
        self.samples_per_code = self.samples_per_mel_frame * self.repeats
        self.num_code_ids = self.dit.text_embed.codec_embed.num_embeddings
        self.window_grid = math.lcm(int(self.dit.block_size), self.repeats)  # mel frames

    def new_stream(
        self, conditioning: torch.Tensor, reference_mel: torch.Tensor, generator: torch.Generator | None = None
    ) -> Token2WavStream:
        """conditioning: spk_dict's "cond", [enc_emb_dim] or [1, enc_emb_dim]; reference_mel: its
        "ref_mel", [T_ref, mel_dim] or [1, T_ref, mel_dim]. generator None draws noise from the global RNG."""
        conditioning, reference_mel = self._speaker(conditioning, reference_mel)
        device = reference_mel.device
        empty_mel = reference_mel.new_zeros((1, 0, self.mel_dim))
        return Token2WavStream(
            conditioning=conditioning,
            reference_mel=reference_mel,
            generator=generator,
            codes=torch.zeros((1, 0), dtype=torch.long, device=device),
            noise=empty_mel,
            mel=empty_mel,
            look_ahead_mel=empty_mel,
        )

    @torch.no_grad()
    def one_shot(
        self,
        codes: torch.Tensor,
        conditioning: torch.Tensor,
        reference_mel: torch.Tensor,
        generator: torch.Generator | None = None,
    ) -> np.ndarray:
        """codes [T] or [1, T] → float32 audio [480·T], bit for bit transformers'
        `token2wav(codes, conditioning, reference_mel, num_steps, guidance_scale, sway_coefficient)` when the
        noise matches: generator None draws it from the global RNG as transformers does, a generator gives
        one `torch.randn` of the same shape from it."""
        if codes.dim() == 1:
            codes = codes[None]
        self._check_codes(codes, "codes")
        if codes.shape[1] == 0:
            raise ValueError("codes: need at least one code")
        conditioning, reference_mel = self._speaker(conditioning, reference_mel)
        noise = self._draw_noise(generator, codes.shape[1] * self.repeats, reference_mel)  # [1, F, mel_dim]
        mel = self._sample(conditioning, reference_mel, codes, noise)
        return self._vocode(mel)

    @torch.no_grad()
    def decode(
        self, streams: list[Token2WavStream], blocks: list[torch.Tensor], is_final: list[bool]
    ) -> list[np.ndarray]:
        """blocks[i]: [1, n_i] codes continuing streams[i] (n_i may be 0) → each stream's next float32
        audio. A non-final call returns what the look-ahead allows (maybe nothing); the final call
        flushes, after which the stream's audio is 480 samples per code."""
        if len(blocks) != len(streams):
            raise ValueError(f"blocks: {len(blocks)} blocks for {len(streams)} streams")
        if len(is_final) != len(streams):
            raise ValueError(f"is_final: {len(is_final)} flags for {len(streams)} streams")
        for stream, block in zip(streams, blocks, strict=True):
            if stream.is_finished:
                raise ValueError("streams: a stream was already given its final block")
            if block.dim() != 2 or block.shape[0] != 1:
                raise ValueError(f"blocks: each block must be [1, n], got {tuple(block.shape)}")
            self._check_codes(block, "blocks")
        audio = []
        for stream, block, final in zip(streams, blocks, is_final, strict=True):
            stream.codes = torch.cat([stream.codes, block.to(stream.codes.device)], dim=1)
            audio.append(self._advance(stream, final))
            stream.is_finished = final
        return audio

    def _advance(self, stream: Token2WavStream, is_final: bool) -> np.ndarray:
        """Finalize every chunk the known codes allow (at the final call: all the rest, in one window) and
        voice each as it is finalized, so the audio depends only on the codes and on how many were known
        before the final call, never on how the earlier ones were split into blocks."""
        num_codes = stream.num_codes
        chunk = self.chunk_frames
        pieces = []
        if is_final:
            if stream.num_chunks * chunk < num_codes:
                self._finalize_chunk(stream, num_codes)
            pieces.append(self._advance_vocoder(stream, is_final=True))
        else:
            while (stream.num_chunks + 1) * chunk + self.look_ahead_frames <= num_codes:
                self._finalize_chunk(stream, (stream.num_chunks + 1) * chunk)
                pieces.append(self._advance_vocoder(stream, is_final=False))
        if not pieces:
            return np.zeros(0, dtype=np.float32)
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)

    def _finalize_chunk(self, stream: Token2WavStream, chunk_end: int) -> None:
        """Run the DiT window of the next chunk, [k·C, chunk_end) codes, and append its mel."""
        r = self.repeats
        chunk_start = stream.num_chunks * self.chunk_frames
        window_end = min(chunk_end + self.look_ahead_frames, stream.num_codes)
        window_start_mel = self._window_start_mel(chunk_start)
        window_start = window_start_mel // r
        noise = self._stream_noise(stream, window_start_mel, window_end * r)  # [1, W·r, mel_dim]
        codes = stream.codes[:, window_start - stream.codes_start : window_end - stream.codes_start]  # [1, W]
        window_mel = self._sample(stream.conditioning, stream.reference_mel, codes, noise)  # [1, W·r, mel_dim]
        chunk_mel = window_mel[:, (chunk_start - window_start) * r : (chunk_end - window_start) * r]
        num_fade = min(self.crossfade_frames * r, stream.look_ahead_mel.shape[1], chunk_mel.shape[1])
        if num_fade > 0:
            weight = torch.arange(1, num_fade + 1, dtype=chunk_mel.dtype, device=chunk_mel.device) / (num_fade + 1)
            weight = weight[None, :, None]  # [1, fade, 1], rising towards the new window
            faded = stream.look_ahead_mel[:, :num_fade] * (1 - weight) + chunk_mel[:, :num_fade] * weight
            chunk_mel = torch.cat([faded, chunk_mel[:, num_fade:]], dim=1)
        stream.look_ahead_mel = window_mel[:, (chunk_end - window_start) * r :]
        stream.mel = chunk_mel if stream.mel.shape[1] == 0 else torch.cat([stream.mel, chunk_mel], dim=1)
        stream.num_chunks += 1
        next_window_start_mel = self._window_start_mel(stream.num_chunks * self.chunk_frames)
        stream.codes = stream.codes[:, next_window_start_mel // r - stream.codes_start :]
        stream.codes_start = next_window_start_mel // r
        stream.noise = stream.noise[:, next_window_start_mel - stream.noise_start :]
        stream.noise_start = next_window_start_mel

    def _window_start_mel(self, chunk_start: int) -> int:
        """First mel frame of the DiT window of the chunk starting at code `chunk_start`: look-back
        codes earlier, rounded down to the DiT block grid."""
        return max(chunk_start - self.look_back_frames, 0) * self.repeats // self.window_grid * self.window_grid

    def _advance_vocoder(self, stream: Token2WavStream, is_final: bool) -> np.ndarray:
        hop = self.samples_per_mel_frame
        context = self.vocoder_context_frames * self.repeats  # mel frames
        num_mel = stream.num_mel_frames
        start = stream.num_samples // hop  # first mel frame not yet voiced
        end = num_mel if is_final else max(num_mel - context, start)
        if end == start:
            return np.zeros(0, dtype=np.float32)
        input_start = max(start - context, 0)
        wav = self._vocode(stream.mel[:, input_start - stream.mel_start :])  # [(num_mel - input_start)·hop]
        stream.num_samples = end * hop
        keep_from = max(end - context, 0)
        stream.mel = stream.mel[:, keep_from - stream.mel_start :]
        stream.mel_start = keep_from
        return wav[(start - input_start) * hop : (end - input_start) * hop]

    def _stream_noise(self, stream: Token2WavStream, start: int, end: int) -> torch.Tensor:
        """The stream's noise for mel frames [start, end), drawing the frames not drawn yet."""
        num_missing = end - (stream.noise_start + stream.noise.shape[1])
        if num_missing > 0:
            fresh = self._draw_noise(stream.generator, num_missing, stream.reference_mel)
            stream.noise = fresh if stream.noise.shape[1] == 0 else torch.cat([stream.noise, fresh], dim=1)
        return stream.noise[:, start - stream.noise_start : end - stream.noise_start]

    def _draw_noise(self, generator, num_mel_frames: int, reference_mel: torch.Tensor) -> torch.Tensor:
        shape = [1, num_mel_frames, self.mel_dim]
        return torch.randn(shape, generator=generator, dtype=reference_mel.dtype, device=reference_mel.device)

    def _sample(self, conditioning, reference_mel, codes, noise) -> torch.Tensor:
        if noise.shape[1] > self.dit.config.max_position_embeddings:
            raise ValueError(
                f"codes: {codes.shape[1]} codes make {noise.shape[1]} mel frames, more than the DiT's "
                f"max_position_embeddings ({self.dit.config.max_position_embeddings})"
            )
        return sample_mel(
            self.dit, conditioning, reference_mel, codes, noise,
            num_steps=self.num_steps, guidance_scale=self.guidance_scale, sway_coefficient=self.sway_coefficient,
        )

    def _vocode(self, mel: torch.Tensor) -> np.ndarray:
        """[1, F, mel_dim] → float32 numpy [F·240]; BigVGAN takes the DiT's output permuted, as transformers."""
        wav = self.vocoder(mel.permute(0, 2, 1))
        return wav.reshape(-1).float().cpu().numpy()

    def _speaker(self, conditioning: torch.Tensor, reference_mel: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        enc_emb_dim = self.dit.config.enc_emb_dim
        if conditioning.dim() == 1:
            conditioning = conditioning[None]
        if conditioning.shape != (1, enc_emb_dim):
            raise ValueError(
                f"conditioning: must be [{enc_emb_dim}] or [1, {enc_emb_dim}], got {tuple(conditioning.shape)}"
            )
        if reference_mel.dim() == 2:
            reference_mel = reference_mel[None]
        if reference_mel.dim() != 3 or reference_mel.shape[0] != 1 or reference_mel.shape[2] != self.mel_dim:
            raise ValueError(
                f"reference_mel: must be [T_ref, {self.mel_dim}] or [1, T_ref, {self.mel_dim}], "
                f"got {tuple(reference_mel.shape)}"
            )
        if reference_mel.shape[1] == 0:
            raise ValueError("reference_mel: needs at least one frame")
        return conditioning, reference_mel

    def _check_codes(self, codes: torch.Tensor, name: str) -> None:
        if codes.dim() != 2 or codes.shape[0] != 1:
            raise ValueError(f"{name}: must be [T] or [1, T], got {tuple(codes.shape)}")
        if codes.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"{name}: must be integer codes, got {codes.dtype}")
        if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) >= self.num_code_ids):
            raise ValueError(
                f"{name}: codes must be in [0, {self.num_code_ids}) (the DiT's codec embedding), got "
                f"[{int(codes.min())}, {int(codes.max())}]; cut the talker output at its EOS first"
            )


def scale_token2wav_weights(
    token2wav, *, generator: torch.Generator, dit_gain: float = 1.0, vocoder_gain: float = 0.7
) -> None:
    """Redraws a randomly initialized token2wav's weights at gain/sqrt(fan_in) (embeddings at std 1), so
    the DiT moves its mel far from the noise and BigVGAN's output sits at speech level (about -23 dBFS
    on the tiny dims, peaks below the clamp). transformers' 0.02 init gives ~1e-8: silent."""
    for part, gain in [(token2wav.code2wav_dit_model, dit_gain), (token2wav.code2wav_bigvgan_model, vocoder_gain)]:
        for module in part.modules():
            if isinstance(module, nn.Embedding):
                module.weight.data.normal_(0.0, 1.0, generator=generator)
            elif isinstance(module, (nn.Linear, nn.Conv1d)):
                fan_in = module.weight[0].numel()
                module.weight.data.normal_(0.0, gain / math.sqrt(fan_in), generator=generator)
            elif isinstance(module, nn.ConvTranspose1d):
                in_channels, _, kernel = module.weight.shape
                fan_in = in_channels * kernel // module.stride[0]  # inputs that reach one output
                module.weight.data.normal_(0.0, gain / math.sqrt(fan_in), generator=generator)
