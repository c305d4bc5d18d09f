"""Tiny, seeded Qwen3-Omni configs built from the real transformers config classes.

They keep every structural property of the real model that our code depends on — 16 code groups,
a talker vocab of codebook size + 1024 with the codec specials in the suppressed top range, the
code2wav upsampling of 1920 samples per frame at 24 kHz, the 72-frame sliding window — and shrink
only widths and depths, so a full thinker → talker → code2wav run takes well under a second on CPU.

Token ids of the thinker vocab (320 entries): 0..255 are bytes, the specials follow (see
`THINKER_SPECIAL_TOKENS`). `initializer_range=0.2` keeps argmax away from near-ties, so greedy
comparisons against the reference are stable. Random code2wav weights speak at about −140 dBFS, so the
builder rescales code2wav's output layer to speech level (`TINY_SPEECH_RMS`): audio comparisons on the
tiny model then compare real signals, where a wrong sample shows.
"""

from __future__ import annotations

import torch
from transformers import Qwen3OmniMoeConfig, Qwen3OmniMoeForConditionalGeneration
from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import (
    Qwen3OmniMoeTalkerCodePredictorConfig,
)

THINKER_SPECIAL_TOKENS = {
    "<|im_start|>": 256,
    "<|im_end|>": 257,
    "<|tts_pad|>": 258,
    "<|tts_bos|>": 259,
    "<|tts_eos|>": 260,
    "system": 261,
    "user": 262,
    "assistant": 263,
    "<|audio_pad|>": 264,
    "<|image_pad|>": 265,
    "<|video_pad|>": 266,
    "<|audio_start|>": 267,
    "<|vision_start|>": 268,
    "<|audio_end|>": 269,
    "<|vision_end|>": 270,
}
THINKER_VOCAB_SIZE = 320
TINY_CODEBOOK_SIZE = 128
TINY_SPEECH_RMS = 0.1  # RMS of the tiny code2wav's output on random codes (−20 dBFS); peaks stay < 1
TINY_SPEAKERS = {"chelsie": TINY_CODEBOOK_SIZE + 20, "ethan": TINY_CODEBOOK_SIZE + 21, "aiden": TINY_CODEBOOK_SIZE + 22}


def _rope(mrope: bool) -> dict:
    rope = {"rope_type": "default", "rope_theta": 1_000_000.0}
    if mrope:
        rope.update(mrope_section=[2, 3, 3], interleaved=True)
    return rope


def tiny_code_predictor_config(
    *,
    hidden_size: int = 64,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    head_dim: int = 16,
    intermediate_size: int = 128,
    vocab_size: int = TINY_CODEBOOK_SIZE,
    num_code_groups: int = 16,
    initializer_range: float = 0.2,
    attn_implementation: str | None = None,
) -> Qwen3OmniMoeTalkerCodePredictorConfig:
    """A code predictor config; the defaults are tiny, Qwen3-Omni's real sizes are
    hidden 1024, 5 layers, 16 heads / 8 KV heads, head_dim 128, intermediate 3072, vocab 2048."""
    config = Qwen3OmniMoeTalkerCodePredictorConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        head_dim=head_dim,
        num_code_groups=num_code_groups,
        initializer_range=initializer_range,
        max_position_embeddings=max(64, num_code_groups + 1),
        rope_parameters=_rope(mrope=False),
    )
    if attn_implementation is not None:
        config._attn_implementation = attn_implementation
    return config


def tiny_qwen3_omni_config(
    *,
    hidden_size: int = 64,
    num_thinker_layers: int = 2,
    num_talker_layers: int = 2,
    num_code_groups: int = 16,
    accept_hidden_layer: int = 1,
    initializer_range: float = 0.2,
    thinker_text: dict | None = None,
) -> Qwen3OmniMoeConfig:
    """A complete thinker + talker + code predictor + code2wav config of the real classes. thinker_text:
    overrides of the thinker's text config (its own hidden_size, depth, ...: the trained demo's thinker);
    the encoders' outputs and the talker's thinker_hidden_size follow its hidden_size."""
    h = hidden_size
    c = TINY_CODEBOOK_SIZE
    ids = THINKER_SPECIAL_TOKENS
    moe = dict(moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, shared_expert_intermediate_size=2 * h)
    attn = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    text_config = dict(
        vocab_size=THINKER_VOCAB_SIZE, hidden_size=h, intermediate_size=2 * h, num_hidden_layers=num_thinker_layers,
        rope_parameters=_rope(mrope=True), max_position_embeddings=4096, initializer_range=initializer_range,
        pad_token_id=0, **attn, **moe,
    )
    text_config.update(thinker_text or {})
    thinker_h = text_config["hidden_size"]
    multimodal_ids = dict(
        audio_token_id=ids["<|audio_pad|>"], image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        audio_start_token_id=ids["<|audio_start|>"], vision_start_token_id=ids["<|vision_start|>"],
    )
    thinker_config = dict(
        text_config=text_config,
        audio_config=dict(
            d_model=32, encoder_attention_heads=4, encoder_ffn_dim=32, encoder_layers=1, num_mel_bins=16,
            output_dim=thinker_h, downsample_hidden_size=16, n_window=50, n_window_infer=100,
            initializer_range=initializer_range,  # at the default 0.02 the tiny tower's rows barely see the audio
        ),
        vision_config=dict(
            depth=2, hidden_size=32, out_hidden_size=thinker_h, intermediate_size=32, num_heads=4, patch_size=16,
            spatial_merge_size=1, temporal_patch_size=2, deepstack_visual_indexes=[0, 1],  # two deepstack levels
            initializer_range=initializer_range,
        ),
        user_token_id=ids["user"], initializer_range=initializer_range, **multimodal_ids,
    )
    talker_text_config = dict(
        vocab_size=c + 1024, hidden_size=h, intermediate_size=2 * h, num_hidden_layers=num_talker_layers,
        rope_parameters=_rope(mrope=True), max_position_embeddings=8192, initializer_range=initializer_range,
        **attn, **moe,
    )
    code_predictor_config = tiny_code_predictor_config(
        hidden_size=h, num_code_groups=num_code_groups, initializer_range=initializer_range
    ).to_dict()
    talker_config = dict(
        text_config=talker_text_config, code_predictor_config=code_predictor_config,
        num_code_groups=num_code_groups, thinker_hidden_size=thinker_h, accept_hidden_layer=accept_hidden_layer,
        codec_pad_id=c + 2, codec_bos_id=c + 3, codec_eos_token_id=c + 4,
        codec_nothink_id=c + 7, codec_think_bos_id=c + 8, codec_think_eos_id=c + 9,
        speaker_id=dict(TINY_SPEAKERS), spatial_merge_size=1, initializer_range=initializer_range,
        **multimodal_ids,
    )
    code2wav_config = dict(
        codebook_size=c, hidden_size=32, num_attention_heads=4, num_key_value_heads=4, intermediate_size=64,
        num_hidden_layers=1, num_quantizers=num_code_groups, decoder_dim=64, sliding_window=72,
        max_position_embeddings=8000,
    )
    return Qwen3OmniMoeConfig(
        thinker_config=thinker_config, talker_config=talker_config, code2wav_config=code2wav_config,
        im_start_token_id=ids["<|im_start|>"], im_end_token_id=ids["<|im_end|>"],
        tts_pad_token_id=ids["<|tts_pad|>"], tts_bos_token_id=ids["<|tts_bos|>"], tts_eos_token_id=ids["<|tts_eos|>"],
        system_token_id=ids["system"], user_token_id=ids["user"], assistant_token_id=ids["assistant"],
    )


def tiny_qwen3_omni(seed: int = 0, **config_kwargs) -> Qwen3OmniMoeForConditionalGeneration:
    """A seeded tiny `Qwen3OmniMoeForConditionalGeneration` in eval mode (fp32, CPU).

    The global torch RNG is saved and restored, so building a model never disturbs the caller's seed.
    The vision tower's blocks after the first (and their deepstack mergers) are drawn after everything
    else, from their own seed: every other weight is what a one-block tower gives, whatever the depth."""
    config = tiny_qwen3_omni_config(**config_kwargs)
    vision = config.thinker_config.vision_config
    depth, levels = vision.depth, list(vision.deepstack_visual_indexes)
    vision.depth, vision.deepstack_visual_indexes = 1, [i for i in levels if i < 1]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3OmniMoeForConditionalGeneration(config)
        _init_talker_experts(model)
        torch.manual_seed(seed + 1)
        _deepen_vision_tower(model.thinker.model.visual, depth, levels)
    model.eval()
    scale_code2wav_to_speech_level(model.code2wav)
    return model


def _deepen_vision_tower(visual, depth: int, levels: list[int]) -> None:
    """Give a one-block vision tower `depth` blocks and the deepstack `levels` (block indexes), the new
    blocks and mergers initialized as transformers initializes the tower's own, from the global RNG."""
    config = visual.config
    block_type, merger_type = type(visual.blocks[0]), type(visual.merger)
    new_modules = [block_type(config) for _ in range(1, depth)]
    new_modules += [merger_type(config=config, use_postshuffle_norm=True) for i in levels if i >= 1]
    for module in new_modules:
        for part in module.modules():
            visual._init_weights(part)
    visual.blocks.extend(new_modules[: depth - 1])
    visual.merger_list.extend(new_modules[depth - 1 :])
    config.depth, config.deepstack_visual_indexes = depth, list(levels)
    visual.deepstack_visual_indexes = config.deepstack_visual_indexes


def _init_talker_experts(model: Qwen3OmniMoeForConditionalGeneration) -> None:
    """transformers' `_init_weights` skips the talker's routed experts (`Qwen3OmniMoeTalkerTextExperts`
    holds them as `torch.empty` parameters), so they would be whatever memory they got: different
    build to build, now and then NaN. Draw them from the (seeded) global RNG like every other weight."""
    std = model.config.talker_config.text_config.initializer_range
    with torch.no_grad():
        for layer in model.talker.model.layers:
            experts = getattr(layer.mlp, "experts", None)
            for name in ("gate_up_proj", "down_proj"):
                param = getattr(experts, name, None)
                if isinstance(param, torch.nn.Parameter):
                    param.normal_(0.0, std)


@torch.no_grad()
def scale_code2wav_to_speech_level(code2wav, target_rms: float = TINY_SPEECH_RMS) -> None:
    """Scale code2wav's last convolution (weight and bias, so the waveform before the ±1 clamp scales
    by the same factor) so that decoding random codes gives RMS `target_rms`. A deterministic function of
    the weights: the calibration codes come from their own generator, not the global RNG."""
    config = code2wav.config
    generator = torch.Generator().manual_seed(0)
    codes = torch.randint(0, config.codebook_size, (1, config.num_quantizers, 25), generator=generator)
    rms = code2wav(codes).double().pow(2).mean().sqrt().item()
    if rms == 0.0:
        raise ValueError("code2wav: random weights decode to exact silence; cannot scale to speech level")
    output = code2wav.decoder[-1].conv
    output.weight.mul_(target_rms / rms)
    output.bias.mul_(target_rms / rms)
