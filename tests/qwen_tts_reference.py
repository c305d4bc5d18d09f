"""The `qwen_tts` package (PyPI `qwen-tts-hf`, installed with --no-deps) as a test reference.

Its package `__init__` imports the 25 Hz tokenizer, whose module imports sox, onnxruntime and torchaudio at
the top; Qwen3-TTS's 12 Hz models never call them, so they are registered as empty modules when absent
(torchaudio's PyPI wheels would replace our torch). Import the reference through `load()` only.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import sys
import types

import pytest

_UNUSED_BY_12HZ = ("sox", "onnxruntime", "torchaudio", "torchaudio.compliance", "torchaudio.compliance.kaldi")


def _register_empty(name: str) -> None:
    try:
        importlib.import_module(name)
    except ImportError:
        module = types.ModuleType(name)
        module.__spec__ = importlib.machinery.ModuleSpec(name, None)
        sys.modules[name] = module
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(sys.modules[parent], child, module)


def load() -> types.ModuleType:
    """The `qwen_tts` package, or skip the calling test when it is not installed."""
    pytest.importorskip("librosa")
    for name in _UNUSED_BY_12HZ:
        _register_empty(name)
    return pytest.importorskip("qwen_tts")
