"""The demo checkpoint shipped as package data: a small Glm4Moe LM trained on the Python standard library's
sources, with a trained MTP layer (`scripts/train_demo_lm.py`, then `omnimtp train-mtp`; see the README)."""

from __future__ import annotations

import json
from pathlib import Path

DEMO_MODEL_DIR = Path(__file__).resolve().parent.parent / "data" / "demo_lm"


def demo_model_dir() -> Path:
    """Directory of the shipped demo checkpoint (config, safetensors incl. `model-mtp.safetensors`, tokenizer)."""
    if not (DEMO_MODEL_DIR / "config.json").exists():
        raise FileNotFoundError(f"the demo checkpoint is missing from the package: {DEMO_MODEL_DIR}")
    return DEMO_MODEL_DIR


def demo_heldout_prompts() -> list[str]:
    """Prompts cut from stdlib files that neither the LM, its tokenizer nor its MTP head saw in training."""
    return json.loads((demo_model_dir() / "heldout_prompts.json").read_text())


def load_demo_model():
    """(target, head, tokenizer) of the demo checkpoint, float32, eval mode, target ready for `use_mtp`."""
    from transformers import AutoTokenizer

    from omnimtp.mtp.head import load_target_and_head

    target, head = load_target_and_head(demo_model_dir())  # weights stored bf16, config dtype float32
    return target, head, AutoTokenizer.from_pretrained(demo_model_dir())
