"""Model families behind the engine's interface, one module per family. A family's module is imported the first
time a model of its type is loaded (`family_class`), so a command on one model imports that model's code and not
the other families' (a `speak` on a Qwen3-TTS CustomVoice model imports neither Qwen2.5-Omni's nor Qwen3-ASR's
code)."""

from __future__ import annotations

import importlib

# config.json's model_type → (module, class) of its family
FAMILIES = {
    "qwen3_omni_moe": ("omnimtp.families.qwen3_omni", "Qwen3OmniFamily"),
    "qwen2_5_omni": ("omnimtp.families.qwen2_5_omni", "Qwen2_5OmniFamily"),
    "qwen3_tts": ("omnimtp.families.qwen3_tts", "Qwen3TTSFamily"),
    "qwen3_asr": ("omnimtp.families.qwen3_asr", "Qwen3ASRFamily"),
}


def family_class(model_type: str) -> type:
    """The family class of config.json's `model_type` (a key of FAMILIES), its module imported on first use;
    ValueError for any other model type."""
    if model_type not in FAMILIES:
        raise ValueError(f"model_type: {model_type!r}; supported: {sorted(FAMILIES)}")
    module, name = FAMILIES[model_type]
    return getattr(importlib.import_module(module), name)
