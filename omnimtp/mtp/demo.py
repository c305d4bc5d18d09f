"""The demo checkpoints shipped as package data, small LMs trained on the Python standard library's sources
with a trained MTP layer: "lm", a Glm4Moe (`scripts/train_demo_lm.py`, then `omnimtp train-mtp`; see the
README), and "glm5", a GLM-5 `glm_moe_dsa` (MLA, DSA indexer choosing fewer keys than the context, MoE,
IndexShare; `scripts/train_demo_glm5.py`, then `benchmarks/mtp_ablation.py --install`)."""

from __future__ import annotations

import json
from pathlib import Path

DATA_DIR = Path(__file__).resolve().parent.parent / "data"
DEMO_MODEL_DIR = DATA_DIR / "demo_lm"
DEMO_GLM5_DIR = DATA_DIR / "demo_glm5"
DEMO_LM_DIRS = {"lm": DEMO_MODEL_DIR, "glm5": DEMO_GLM5_DIR}
DEMO_OMNI_DIR = DATA_DIR / "demo_omni"


def demo_model_dir(name: str = "lm") -> Path:
    """Directory of a shipped demo checkpoint, "lm" (Glm4Moe) or "glm5" (GLM-5): config, safetensors incl.
    `model-mtp.safetensors`, tokenizer, `heldout_prompts.json`; `load_target_and_head` loads it."""
    if name not in DEMO_LM_DIRS:
        raise ValueError(f"name must be one of {sorted(DEMO_LM_DIRS)}, got {name!r}")
    directory = DEMO_LM_DIRS[name]
    if not (directory / "config.json").exists():
        raise FileNotFoundError(f"the demo checkpoint is missing from the package: {directory}")
    return directory


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


def demo_heldout_prompts(name: str = "lm") -> list[str]:
    """Prompts cut from stdlib files that neither the LM, its tokenizer nor its MTP head saw in training."""
    return json.loads((demo_model_dir(name) / "heldout_prompts.json").read_text())


def load_demo_model(name: str = "lm"):
    """(target, head, tokenizer) of a demo checkpoint (see `demo_model_dir`), float32, eval mode, target ready
    for `use_mtp`."""
    from transformers import AutoTokenizer

    from omnimtp.mtp.load import load_target_and_head

    target, head = load_target_and_head(demo_model_dir(name))  # weights stored bf16, config dtype float32
    return target, head, AutoTokenizer.from_pretrained(demo_model_dir(name))
