"""The demo checkpoint shipped as package data: a small Glm4Moe LM trained on the Python standard library's
sources, with a trained MTP layer (`scripts/train_demo_lm.py`, then `omnimtp train-mtp`; see the README)."""

from __future__ import annotations

import json
from pathlib import Path

DEMO_MODEL_DIR = Path(__file__).resolve().parent.parent / "data" / "demo_lm"
DEMO_OMNI_DIR = Path(__file__).resolve().parent.parent / "data" / "demo_omni"


def demo_model_dir() -> Path:
    """Directory of the shipped demo checkpoint (config, safetensors incl. `model-mtp.safetensors`, tokenizer)."""
    if not (DEMO_MODEL_DIR / "config.json").exists():
        raise FileNotFoundError(f"the demo checkpoint is missing from the package: {DEMO_MODEL_DIR}")
    return DEMO_MODEL_DIR


def demo_omni_dir() -> Path:
    """Directory of the shipped demo Qwen3-Omni (`scripts/train_demo_omni.py`): a tiny Qwen3-Omni whose thinker
    is a small byte-level LM trained on the standard library's sources, with its trained MTP head
    (`model-mtp.safetensors`); encoders, talker and code2wav are the seeded random tiny ones."""
    if not (DEMO_OMNI_DIR / "config.json").exists():
        raise FileNotFoundError(f"the demo Qwen3-Omni is missing from the package: {DEMO_OMNI_DIR}")
    return DEMO_OMNI_DIR


def demo_omni_prompts() -> list[str]:
    """User turns (code lines) cut from stdlib files the demo thinker and its head never saw."""
    return json.loads((demo_omni_dir() / "heldout_prompts.json").read_text())


def demo_heldout_prompts() -> list[str]:
    """Prompts cut from stdlib files that neither the LM, its tokenizer nor its MTP head saw in training."""
    return json.loads((demo_model_dir() / "heldout_prompts.json").read_text())


def load_demo_model():
    """(target, head, tokenizer) of the demo checkpoint, float32, eval mode, target ready for `use_mtp`."""
    from transformers import AutoTokenizer

    from omnimtp.mtp.head import load_target_and_head

    target, head = load_target_and_head(demo_model_dir())  # weights stored bf16, config dtype float32
    return target, head, AutoTokenizer.from_pretrained(demo_model_dir())
