"""The `qwen_tts` package (PyPI `qwen-tts-hf`, installed with --no-deps) as a test reference.

Its package `__init__` imports the 25 Hz tokenizer, whose module imports sox, onnxruntime and torchaudio at
the top; Qwen3-TTS's 12 Hz models never call them, so they are registered as empty modules when absent
(torchaudio's PyPI wheels would replace our torch). Import the reference through `load()` only.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import importlib
import importlib.machinery
import sys
import types
from typing import Any

import pytest
import torch

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
    qwen_tts = pytest.importorskip("qwen_tts")
    _keep_default_rope_private()
    _patch_models_for_transformers_5()
    return qwen_tts


_PATCHED: set[str] = set()


def _patch_models_for_transformers_5() -> None:
    """What the talker model needs on transformers 5.24 (once per process):

    - 5.24's `generate` hands the cache to `forward` as `cache=` and renames an output's `past_key_values` to
      `cache`: the two output dataclasses get a `cache` field and the two generating models take `cache` as
      their `past_key_values` (without this the reference would silently run every step uncached);
    - `save_pretrained` wants `_tied_weights_keys` as a dict (nothing is tied: `tie_word_embeddings` is False);
    """
    if "models" in _PATCHED:
        return
    from qwen_tts.core.models import modeling_qwen3_tts as modeling

    for name in ("Qwen3TTSTalkerOutputWithPast", "Qwen3TTSTalkerCodePredictorOutputWithPast"):
        original = getattr(modeling, name)
        patched = dataclasses.make_dataclass(name, [("cache", Any, dataclasses.field(default=None))], bases=(original,))
        patched.__module__ = modeling.__name__
        setattr(modeling, name, patched)
    for cls in (
        modeling.Qwen3TTSTalkerForConditionalGeneration,
        modeling.Qwen3TTSTalkerCodePredictorModelForConditionalGeneration,
    ):
        cls.forward = _cache_as_past_key_values(cls.forward)
    for cls in vars(modeling).values():
        if isinstance(cls, type) and isinstance(getattr(cls, "_tied_weights_keys", None), list):
            cls._tied_weights_keys = {}
    _PATCHED.add("models")


def load_speech_tokenizer(path):
    """The reference's 12 Hz `Qwen3TTSTokenizerV2Model` loaded from a `speech_tokenizer/` directory, decoder only.

    Its Mimi encoder does not build on transformers 5.24 (it assigns `upsample = None`, a read-only property
    of 5.24's `MimiModel`), and the decoder never calls it, so the model is built with an empty module in its
    place; encoder weights in the file are left unused."""
    load()
    from qwen_tts._transformers_compat import restore_rope_buffers
    from qwen_tts.core import Qwen3TTSTokenizerV2Model

    with _speech_tokenizer_without_encoder():
        model = Qwen3TTSTokenizerV2Model.from_pretrained(str(path))
    restore_rope_buffers(model)  # what the reference's own loader does: the meta-device load leaves RoPE empty
    return model.eval()


def new_speech_tokenizer(config: dict):
    """A reference `Qwen3TTSTokenizerV2Model` at its own init from a config.json dict, decoder only (see
    `load_speech_tokenizer`)."""
    load()
    from qwen_tts.core import Qwen3TTSTokenizerV2Config, Qwen3TTSTokenizerV2Model

    config = {k: v for k, v in config.items() if k not in ("model_type", "architectures")}
    with _speech_tokenizer_without_encoder():
        return Qwen3TTSTokenizerV2Model(Qwen3TTSTokenizerV2Config(**config)).eval()


@contextlib.contextmanager
def _speech_tokenizer_without_encoder():
    from qwen_tts.core.tokenizer_12hz import modeling_qwen3_tts_tokenizer_v2 as modeling

    original = modeling.Qwen3TTSTokenizerV2Encoder
    modeling.Qwen3TTSTokenizerV2Encoder = _NoEncoder
    try:
        yield
    finally:
        modeling.Qwen3TTSTokenizerV2Encoder = original


class _NoEncoder:
    @staticmethod
    def _from_config(config):
        return torch.nn.Module()


def _keep_default_rope_private() -> None:
    """`qwen_tts` registers a "default" RoPE initializer in transformers' global table (5.24 has none: each
    model computes its own) that reads `config.rope_theta`. transformers' `_init_weights` prefers the table's
    "default" to a model's own, so once `qwen_tts` is imported, building any 5.24 model with a default RoPE
    (Qwen3-Omni, Mimi) raises on its config, which keeps `rope_parameters`. So the reference's modules get
    the table with that "default" as a private copy (their RoPE modules look it up at construction), their
    RoPE classes get it as their own `compute_default_rope_parameters` (what `_init_weights` uses when the
    table has none), and the global table is left as transformers ships it. That private "default" reads
    `rope_theta` from `rope_parameters` where a 5.24 config keeps it."""
    from qwen_tts import _transformers_compat
    from qwen_tts.core.models import modeling_qwen3_tts
    from qwen_tts.core.tokenizer_12hz import modeling_qwen3_tts_tokenizer_v2
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    registered = ROPE_INIT_FUNCTIONS.get("default")
    if getattr(registered, "__module__", None) != _transformers_compat.__name__:
        return

    def default(config, *args, **kwargs):  # 5.24 configs keep rope_theta in rope_parameters
        if getattr(config, "rope_theta", None) is None:
            config = copy.copy(config)
            config.rope_theta = config.rope_parameters["rope_theta"]
        return registered(config, *args, **kwargs)

    private = dict(ROPE_INIT_FUNCTIONS, default=default)
    for module in (modeling_qwen3_tts, modeling_qwen3_tts_tokenizer_v2):
        module.ROPE_INIT_FUNCTIONS = private
        for cls in vars(module).values():
            if (isinstance(cls, type) and cls.__module__ == module.__name__  # not transformers' own, imported there
                    and cls.__name__.endswith(("RotaryEmbedding", "RotatoryEmbedding"))):
                cls.compute_default_rope_parameters = staticmethod(default)
    del ROPE_INIT_FUNCTIONS["default"]


def _cache_as_past_key_values(forward):
    @functools.wraps(forward)
    def wrapped(self, *args, **kwargs):
        if "cache" in kwargs:
            if kwargs.get("past_key_values") is not None:
                raise ValueError("both cache and past_key_values given")
            kwargs["past_key_values"] = kwargs.pop("cache")
        return forward(self, *args, **kwargs)

    return wrapped


def talker_model(path):
    """The reference `Qwen3TTSForConditionalGeneration` of a checkpoint directory in the released layout,
    through transformers' `from_pretrained` (what the reference's own `from_pretrained` does before it
    loads `speech_tokenizer/`), with the reference's RoPE buffers restored; eval mode."""
    load()
    from qwen_tts._transformers_compat import restore_rope_buffers
    from qwen_tts.core.models import Qwen3TTSForConditionalGeneration
    from transformers import PreTrainedModel

    model = PreTrainedModel.from_pretrained.__func__(Qwen3TTSForConditionalGeneration, path)
    restore_rope_buffers(model)
    return model.eval()
