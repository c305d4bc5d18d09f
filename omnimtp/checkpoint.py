"""What a checkpoint directory holds, read without loading anything heavy: the command line refuses a bad
`--model` at once, before torch and transformers load."""

from __future__ import annotations

import json
import os
from pathlib import Path

# config.json's model_type → the transformers class of the whole model
MODEL_TYPES = {
    "qwen3_omni_moe": "Qwen3OmniMoeForConditionalGeneration",
    "qwen2_5_omni": "Qwen2_5OmniForConditionalGeneration",
}
# served with the project's own modules (not in transformers)
OWN_MODEL_TYPES = ("qwen3_tts", "qwen3_asr")
# The built-in tiny models (seeded random weights, made in a second, noise-like speech) by the name `--model`
# and `OmniPipeline.from_pretrained` take: name → (config.json's model_type, `OmniPipeline.tiny`'s family,
# its tts_model_type). A name wins over a directory of the same name only where no such directory exists.
TINY_MODELS = {
    "tiny": ("qwen3_omni_moe", "qwen3", None),
    "tiny-qwen2.5-omni": ("qwen2_5_omni", "qwen2_5", None),
    "tiny-tts": ("qwen3_tts", "qwen3_tts", "custom_voice"),
    "tiny-tts-design": ("qwen3_tts", "qwen3_tts", "voice_design"),
    "tiny-tts-base": ("qwen3_tts", "qwen3_tts", "base"),
    "tiny-asr": ("qwen3_asr", "qwen3_asr", None),
}
# The built-in tiny Qwen3-ForcedAligner (what `serve --aligner-model` takes beside a model; no pipeline runs it).
TINY_ALIGNER = "tiny-aligner"
# what `save_pretrained` writes next to config.json: the pipeline's default caps (max_new_tokens, max_frames),
# which `from_pretrained` takes back, so a saved tiny model keeps its short caps
CAPS_FILE = "omnimtp_caps.json"


def tiny_model(path) -> tuple[str, str | None] | None:
    """(`OmniPipeline.tiny`'s family, tts_model_type) for a built-in tiny model's name that names no directory;
    None otherwise."""
    if not isinstance(path, str) or path not in TINY_MODELS or os.path.exists(path):
        return None
    return TINY_MODELS[path][1:]


def random_weights_note(model: str | None, *, transcribes: bool = False) -> str | None:
    """The line the command line prints once for a built-in tiny model (`model` None: the embedded one), so
    that its output is not taken for a fault; None for any other model. transcribes: for `transcribe`."""
    name = "tiny" if model is None else model
    if tiny_model(name) is None:
        return None
    if transcribes:
        what = "its transcripts are random bytes (control characters shown escaped), cut at the cap"
    elif TINY_MODELS[name][0] in OWN_MODEL_TYPES:
        what = "its speech sounds like noise and runs to the frame cap (finish=length)"
    else:
        what = ("its text is random bytes (control characters shown escaped), its speech sounds like noise, and "
                "every reply runs to its cap (finish=length)")
    return f"note: {name} is a built-in tiny model with random weights: {what}; --model takes a real checkpoint"


def check_aligner_path(path: str, param: str = "aligner_model") -> None:
    """ValueError naming `param` unless `path` is a Qwen3-ForcedAligner checkpoint directory (config.json with
    model_type "qwen3_asr" and a thinker of model_type "qwen3_forced_aligner") or the built-in TINY_ALIGNER."""
    if path == TINY_ALIGNER and not os.path.exists(path):
        return
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise ValueError(f"{param}: {path!r} is not a checkpoint directory (no config.json), nor {TINY_ALIGNER!r}")
    with open(config_path) as f:
        config = json.load(f)
    thinker_type = (config.get("thinker_config") or {}).get("model_type")
    if config.get("model_type") != "qwen3_asr" or thinker_type != "qwen3_forced_aligner":
        raise ValueError(f"{param}: {path!r} is not a Qwen3-ForcedAligner checkpoint (model_type "
                         f"{config.get('model_type')!r}, thinker {thinker_type!r})")


def is_shipped(path) -> bool:
    """Whether `path` is one of the checkpoints shipped in the package (`omnimtp.mtp.demo`): they load in a
    fraction of a second, without a "Loading weights" bar."""
    return Path(path).resolve().is_relative_to(Path(__file__).resolve().parent / "data")


def saved_caps(path: str) -> dict:
    """The caps a saved pipeline wrote (CAPS_FILE), or none."""
    caps_path = os.path.join(path, CAPS_FILE)
    if not os.path.isfile(caps_path):
        return {}
    with open(caps_path) as f:
        caps = json.load(f)
    return {name: int(caps[name]) for name in ("max_new_tokens", "max_frames") if caps.get(name) is not None}


def omni_model_type(path: str, param: str = "path") -> str:
    """config.json's model_type of the checkpoint at `path` (a key of MODEL_TYPES, or "qwen3_tts"); ValueError
    naming `param` for a path that is no checkpoint, an unsupported model type, a Qwen2.5-Omni without its
    speakers (spk_dict.pt) or a Qwen3-TTS without its speech tokenizer (speech_tokenizer/). A built-in tiny
    model's name (TINY_MODELS) is its model type."""
    if tiny_model(path) is not None:
        return TINY_MODELS[path][0]
    if path == TINY_ALIGNER and not os.path.exists(path):
        raise ValueError(f"{param}: {path!r} is a forced aligner, loaded beside a model (serve --aligner-model)")
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        reason = ("does not exist (nor is it a built-in model: " + ", ".join(TINY_MODELS) + ")"
                  if not os.path.exists(path) else "is not a checkpoint directory (no config.json)")
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
