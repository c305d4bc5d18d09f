"""A tiny, seeded Qwen2.5-Omni built from the real transformers config classes.

Thinker, talker and token2wav (DiT + BigVGAN) at tiny widths; BigVGAN keeps `upsample_initial_channel` = 64
so its channels survive its six halvings. The thinker vocab mirrors `omnimtp.models.tiny`: 0..255 are
bytes, then the chat and TTS specials of `QWEN2_5_THINKER_SPECIAL_TOKENS`; `qwen2_5_byte_tokenizer` is its
tokenizer with a chat template. transformers' init makes token2wav silent (about −150 dBFS) with a DiT that
hardly reads its codes, so the builder redraws token2wav's weights at speech level
(`omnimtp.codec.token2wav.scale_token2wav_weights`): audio comparisons then compare real signals that depend
on the codes.

Two things the real checkpoint carries outside the config must be supplied here:
- speakers live in `spk_dict.pt` (`{name: {"bos_token", "cond", "ref_mel"}}`), loaded into
  `model.speaker_map` by `from_pretrained`; we fill `speaker_map` with one entry per name in
  `TINY_QWEN2_5_SPEAKERS` (its `bos_token` is a thinker id), and `save_tiny_qwen2_5_omni` writes it;
- `generate` defaults the talker EOS to the hard-coded ids `[8292, 8294]`, outside a tiny codec vocab:
  callers pass `talker_eos_token_id=[TINY_QWEN2_5_CODEC["eos"], TINY_QWEN2_5_CODEC["pad"]]` (the config's
  codec end and pad ids, what those hard-coded ids are in the real vocab).
"""

from __future__ import annotations

import os

import torch
from transformers import Qwen2_5OmniConfig, Qwen2_5OmniForConditionalGeneration

from omnimtp.codec.token2wav import scale_token2wav_weights
from omnimtp.media import tiny_processor

QWEN2_5_THINKER_SPECIAL_TOKENS = {
    "<|im_start|>": 256,
    "<|im_end|>": 257,
    "<|tts_text_pad|>": 258,
    "<|tts_text_bos|>": 259,
    "<|tts_text_eos|>": 260,
    "system": 261,
    "user": 262,
    "assistant": 263,
    "<|audio_pad|>": 264,
    "<|image_pad|>": 265,
    "<|video_pad|>": 266,
    "<|audio_start|>": 267,
    "<|audio_end|>": 268,
    "<|vision_start|>": 269,
    "<|vision_end|>": 270,
    "<|chelsie_bos|>": 271,
    "<|ethan_bos|>": 272,
}
QWEN2_5_THINKER_VOCAB_SIZE = 320
TINY_QWEN2_5_CODEC_VOCAB = 64
# codec specials sit at the top of the tiny codec vocab, like 8292..8296 in the real 8448-entry vocab
TINY_QWEN2_5_CODEC = {"pad": 58, "bos": 59, "eos": 60, "mask": 62}
TINY_QWEN2_5_SPEAKERS = {"Chelsie": "<|chelsie_bos|>", "Ethan": "<|ethan_bos|>"}
TINY_QWEN2_5_REF_MEL_FRAMES = 8


# The real Qwen2.5-Omni-3B widths (its published config.json), for benchmarks at real per-layer cost.
QWEN2_5_OMNI_3B_THINKER = dict(hidden_size=2048, intermediate_size=11008, num_attention_heads=16, num_key_value_heads=2)
QWEN2_5_OMNI_3B_TALKER = dict(
    hidden_size=896, intermediate_size=4864, num_attention_heads=14, num_key_value_heads=2, head_dim=64,
)


def _rope(head_dim: int) -> dict:
    """M-RoPE sections over head_dim / 2 channel pairs in the real proportions (128 → [16, 24, 24])."""
    half = head_dim // 2
    spatial = 3 * half // 8
    return {"rope_type": "default", "rope_theta": 1_000_000.0, "mrope_section": [half - 2 * spatial, spatial, spatial]}


def tiny_qwen2_5_omni_config(
    *, hidden_size: int = 64, num_thinker_layers: int = 2, num_talker_layers: int = 2, initializer_range: float = 0.2,
    thinker_widths: dict | None = None, talker_widths: dict | None = None,
) -> Qwen2_5OmniConfig:
    """A complete thinker + talker + token2wav config of the real classes, at tiny widths. thinker_widths,
    talker_widths: text-model fields that replace the tiny ones (e.g. `QWEN2_5_OMNI_3B_THINKER`,
    `QWEN2_5_OMNI_3B_TALKER`); the talker's embedding_size follows the thinker's width. The vocabularies
    and token2wav stay tiny."""
    thinker_widths = dict(
        dict(hidden_size=hidden_size, intermediate_size=2 * hidden_size, num_attention_heads=4, num_key_value_heads=2),
        **(thinker_widths or {}),
    )
    h = thinker_widths["hidden_size"]
    talker_widths = dict(
        dict(hidden_size=h, intermediate_size=2 * h, num_attention_heads=4, num_key_value_heads=2, head_dim=16),
        **(talker_widths or {}),
    )
    ids = QWEN2_5_THINKER_SPECIAL_TOKENS
    text_config = dict(
        vocab_size=QWEN2_5_THINKER_VOCAB_SIZE, num_hidden_layers=num_thinker_layers,
        max_position_embeddings=4096, initializer_range=initializer_range,
        rope_parameters=_rope(h // thinker_widths["num_attention_heads"]), pad_token_id=0, **thinker_widths,
    )
    thinker_config = dict(
        text_config=text_config,
        audio_config=dict(
            d_model=32, encoder_attention_heads=4, encoder_ffn_dim=32, encoder_layers=1, num_mel_bins=16,
            output_dim=h, n_window=50,
        ),
        vision_config=dict(
            depth=1, hidden_size=32, out_hidden_size=h, intermediate_size=32, num_heads=4, patch_size=16,
            spatial_merge_size=1, temporal_patch_size=2, fullatt_block_indexes=[0],
        ),
        audio_token_index=ids["<|audio_pad|>"], image_token_index=ids["<|image_pad|>"],
        video_token_index=ids["<|video_pad|>"], audio_start_token_id=ids["<|audio_start|>"],
        audio_end_token_id=ids["<|audio_end|>"], user_token_id=ids["user"], initializer_range=initializer_range,
        vision_start_token_id=ids["<|vision_start|>"],  # read by get_rope_index, not declared by the config class
    )
    talker_config = dict(
        vocab_size=TINY_QWEN2_5_CODEC_VOCAB, embedding_size=h, num_hidden_layers=num_talker_layers,
        max_position_embeddings=4096, rope_parameters=_rope(talker_widths["head_dim"]),
        initializer_range=initializer_range, **talker_widths,
        tts_text_start_token_id=ids["<|tts_text_bos|>"], tts_text_end_token_id=ids["<|tts_text_eos|>"],
        tts_text_pad_token_id=ids["<|tts_text_pad|>"], tts_codec_start_token_id=TINY_QWEN2_5_CODEC["bos"],
        tts_codec_end_token_id=TINY_QWEN2_5_CODEC["eos"], tts_codec_pad_token_id=TINY_QWEN2_5_CODEC["pad"],
        tts_codec_mask_token_id=TINY_QWEN2_5_CODEC["mask"], audio_token_index=ids["<|audio_pad|>"],
        image_token_index=ids["<|image_pad|>"], video_token_index=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        audio_start_token_id=ids["<|audio_start|>"], audio_end_token_id=ids["<|audio_end|>"],
        spatial_merge_size=1,
    )
    token2wav_config = dict(
        dit_config=dict(
            hidden_size=32, num_hidden_layers=1, num_attention_heads=2, head_dim=16, emb_dim=16,
            num_embeds=TINY_QWEN2_5_CODEC_VOCAB + 1, enc_emb_dim=16, enc_dim=16, enc_channels=[16, 16, 16, 16, 48],
            enc_attention_channels=8, enc_se_channels=8, look_ahead_layers=[0], look_backward_layers=[0],
        ),
        bigvgan_config=dict(upsample_initial_channel=64),
    )
    return Qwen2_5OmniConfig(
        thinker_config=thinker_config, talker_config=talker_config, token2wav_config=token2wav_config
    )


def tiny_qwen2_5_omni(seed: int = 0, **config_kwargs) -> Qwen2_5OmniForConditionalGeneration:
    """A seeded tiny `Qwen2_5OmniForConditionalGeneration` in eval mode (fp32, CPU), with `speaker_map`
    filled (`bos_token` a thinker id, `cond` [enc_emb_dim], `ref_mel` [1, frames, mel_dim], as in the real
    spk_dict.pt) and token2wav at speech level.

    The global torch RNG is saved and restored, so building a model never disturbs the caller's seed."""
    config = tiny_qwen2_5_omni_config(**config_kwargs)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2_5OmniForConditionalGeneration(config)
        mel_dim = config.token2wav_config.dit_config.mel_dim
        enc_emb_dim = config.token2wav_config.dit_config.enc_emb_dim
        for name, token in TINY_QWEN2_5_SPEAKERS.items():
            model.speaker_map[name] = {
                "bos_token": QWEN2_5_THINKER_SPECIAL_TOKENS[token],
                "cond": torch.randn(enc_emb_dim),
                "ref_mel": torch.randn(1, TINY_QWEN2_5_REF_MEL_FRAMES, mel_dim),
            }
        # transformers' 0.02 init decodes to silence and a DiT that ignores its codes: speech-level weights
        scale_token2wav_weights(model.token2wav, generator=torch.Generator().manual_seed(seed))
    return model.eval()


def qwen2_5_byte_tokenizer():
    """The tiny Qwen2.5-Omni's tokenizer: bytes + `QWEN2_5_THINKER_SPECIAL_TOKENS`, Qwen's chat template."""
    from omnimtp.tokenizer import byte_tokenizer

    return byte_tokenizer(QWEN2_5_THINKER_SPECIAL_TOKENS)


def save_tiny_qwen2_5_omni(path, seed: int = 0, **config_kwargs) -> Qwen2_5OmniForConditionalGeneration:
    """Write a tiny Qwen2.5-Omni checkpoint to `path` as the real one is laid out: `save_pretrained` weights
    and config, `spk_dict.pt` (the speakers, read back by `from_pretrained` with weights_only=True) and the
    processor (`omnimtp.media.tiny_processor`) with its tokenizer and chat template. Returns the model written."""
    model = tiny_qwen2_5_omni(seed, **config_kwargs)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    torch.save(model.speaker_map, os.path.join(path, "spk_dict.pt"))
    # its tokenizer too
    tiny_processor(qwen2_5_byte_tokenizer(), model.config.thinker_config, "qwen2_5_omni").save_pretrained(path)
    return model
