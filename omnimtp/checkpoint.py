"""What a checkpoint directory holds, read without loading anything heavy: the command line refuses a bad
`--model` at once, before torch and transformers load."""

from __future__ import annotations

import json
import os

# config.json's model_type → the transformers class of the whole model
MODEL_TYPES = {
    "qwen3_omni_moe": "Qwen3OmniMoeForConditionalGeneration",
    "qwen2_5_omni": "Qwen2_5OmniForConditionalGeneration",
}
# served with the project's own modules (not in transformers)
OWN_MODEL_TYPES = ("qwen3_tts",)


def omni_model_type(path: str, param: str = "path") -> str:
    """config.json's model_type of the checkpoint at `path` (a key of MODEL_TYPES, or "qwen3_tts"); ValueError
    naming `param` for a path that is no checkpoint, an unsupported model type, a Qwen2.5-Omni without its
    speakers (spk_dict.pt) or a Qwen3-TTS without its speech tokenizer (speech_tokenizer/)."""
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        reason = "does not exist" if not os.path.exists(path) else "is not a checkpoint directory (no config.json)"
        raise ValueError(f"{param}: {path!r} {reason}")
    with open(config_path) as f:
        model_type = json.load(f).get("model_type")
    if model_type not in MODEL_TYPES and model_type not in OWN_MODEL_TYPES:
        supported = sorted([*MODEL_TYPES, *OWN_MODEL_TYPES])
        raise ValueError(f"{param}: {path!r} holds a {model_type!r} model; supported model types: {supported}")
    if model_type == "qwen2_5_omni" and not os.path.isfile(os.path.join(path, "spk_dict.pt")):
        raise ValueError(f"{param}: {path!r} has no spk_dict.pt (a Qwen2.5-Omni checkpoint keeps its speakers there)")
    if model_type == "qwen3_tts" and not os.path.isdir(os.path.join(path, "speech_tokenizer")):
        raise ValueError(f"{param}: {path!r} has no speech_tokenizer/ (a Qwen3-TTS checkpoint keeps its codec there)")
    return model_type
