"""The `qwen_asr` package (PyPI `qwen-asr-dgxspark`, the transformers-5 build of `qwen-asr`, installed with
--no-deps) as a test reference.

Its package `__init__` imports the forced aligner's module, which imports nagisa (Japanese words) and, when
asked, soynlp (Korean words) at the top: the test extra installs both (the `cjk` extra); where they are absent
they are registered as empty modules, so that the English and Chinese tests still run (the Japanese and Korean
ones need them). On transformers 5.24 its text config has no `pad_token_id` attribute
(5.24 configs do not default it), which its text model reads: the shim sets it to None, what the released
configs leave it. Import the reference through `load()` only.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import importlib
import importlib.machinery
import importlib.util
import sys
import types
from typing import Any

import pytest
import torch

_WORD_SPLITTERS = ("nagisa", "soynlp", "soynlp.tokenizer")


def _register_empty(name: str) -> None:
    try:
        importlib.import_module(name)
    except ImportError:
        module = types.ModuleType(name)
        module.__spec__ = importlib.machinery.ModuleSpec(name, None)
        sys.modules[name] = module


def need_word_splitters() -> None:
    """Skip the calling test unless nagisa and soynlp are installed (not the empty stand-ins `load` registers)."""
    for name in ("nagisa", "soynlp"):
        module = sys.modules.get(name)
        if (module is not None and getattr(module, "__file__", None) is None) or importlib.util.find_spec(name) is None:
            pytest.skip(f"{name} is not installed (the cjk extra)")


def load() -> types.ModuleType:
    """The `qwen_asr` package, or skip the calling test when it is not installed."""
    pytest.importorskip("librosa")
    for name in _WORD_SPLITTERS:
        _register_empty(name)
    qwen_asr = pytest.importorskip("qwen_asr")
    _patch_for_transformers_5_24()
    return qwen_asr


_PATCHED: set[str] = set()


def _patch_for_transformers_5_24() -> None:
    """5.24's `generate` hands the cache to `forward` as `cache=` and reads it back from the output's `cache`
    field: the thinker's forward takes `cache` as its `past_key_values` and its output dataclass gets a `cache`
    field (without this the reference would silently run every step uncached). Once per process."""
    if "models" in _PATCHED:
        return
    from qwen_asr.core.transformers_backend import modeling_qwen3_asr as modeling

    name = "Qwen3ASRThinkerCausalLMOutputWithPast"
    original = getattr(modeling, name)
    patched = dataclasses.make_dataclass(name, [("cache", Any, dataclasses.field(default=None))], bases=(original,))
    patched.__module__ = modeling.__name__
    setattr(modeling, name, patched)
    thinker = modeling.Qwen3ASRThinkerForConditionalGeneration
    forward = thinker.forward

    @functools.wraps(forward)
    def cached_forward(self, *args, **kwargs):
        if "cache" in kwargs:
            if kwargs.get("past_key_values") is not None:
                raise ValueError("both cache and past_key_values given")
            kwargs["past_key_values"] = kwargs.pop("cache")
        out = forward(self, *args, **kwargs)
        return patched(**{**out, "cache": out.past_key_values})

    thinker.forward = cached_forward
    _PATCHED.add("models")


def random_reference(config: dict):
    """The reference's `Qwen3ASRForConditionalGeneration` of a config.json dict, with its own random weights, fp32,
    eval."""
    load()
    from qwen_asr.core.transformers_backend import Qwen3ASRConfig, Qwen3ASRForConditionalGeneration

    reference_config = Qwen3ASRConfig(**{k: v for k, v in config.items() if k not in ("model_type", "architectures")})
    for key in ("timestamp_token_id", "timestamp_segment_time"):
        if key in config:
            setattr(reference_config, key, config[key])
    text_config = reference_config.thinker_config.text_config
    if "pad_token_id" not in vars(text_config):
        text_config.pad_token_id = None
    return Qwen3ASRForConditionalGeneration(reference_config).eval()


def reference_model(model):
    """The reference's `Qwen3ASRForConditionalGeneration` with the weights of our `Qwen3ASRModel` (its config dict
    and state dict: the same released layout), fp32, eval."""
    reference = random_reference(model.config)
    result = reference.load_state_dict(model.state_dict(), strict=False)
    missing = [name for name in result.missing_keys if name != "thinker.lm_head.weight"]
    if missing or result.unexpected_keys:
        raise AssertionError(f"reference layout differs: missing {missing}, unexpected {result.unexpected_keys}")
    if "thinker.lm_head.weight" in result.missing_keys:  # a tied head: the embedding
        reference.thinker.lm_head.weight = reference.thinker.model.embed_tokens.weight
    return reference


def reference_processor(family_processor):
    """The reference's `Qwen3ASRProcessor` over our feature extractor and a copy of our tokenizer (with a pad
    token, which the reference's batched calls ask for: `<|im_end|>`, never reached with one request)."""
    load()
    from qwen_asr.core.transformers_backend import Qwen3ASRProcessor

    tokenizer = copy.deepcopy(family_processor.tokenizer)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = "<|im_end|>"
    return Qwen3ASRProcessor(feature_extractor=family_processor.feature_extractor, tokenizer=tokenizer)


def reference_aligner(aligner):
    """The reference's `Qwen3ForcedAligner` (its own `align`: word splitting, processor, forward, repair) over the
    weights, feature extractor and tokenizer of our `Qwen3ForcedAligner`."""
    return aligner_of(reference_model(aligner.model), aligner.processor)


def aligner_of(reference, processor):
    """The reference's `Qwen3ForcedAligner` of a reference model and our `ASRProcessor` (feature extractor and
    tokenizer)."""
    qwen_asr = load()
    from qwen_asr.inference.qwen3_forced_aligner import Qwen3ForceAlignProcessor

    return qwen_asr.Qwen3ForcedAligner(reference, reference_processor(processor), Qwen3ForceAlignProcessor())


def greedy_ids(reference, input_ids: list[int], input_features: torch.Tensor, feature_attention_mask: torch.Tensor,
               eos_token_ids, max_new_tokens: int) -> list[int]:
    """The reference's greedy reply ids (its `generate`, EOS the given ids: its default ids are the released
    vocabulary's <|im_end|> and <|endoftext|>)."""
    ids = torch.tensor([input_ids])
    out = reference.generate(
        input_ids=ids, attention_mask=torch.ones_like(ids), input_features=input_features,
        feature_attention_mask=feature_attention_mask, max_new_tokens=max_new_tokens,
        eos_token_id=sorted(eos_token_ids), do_sample=False,
    )
    return out.sequences[0, ids.shape[1]:].tolist()


# The released chat template's rendering of the ASR messages (a system turn of the context, a user turn of one
# audio), the prompt the reference's `_build_text_prompt` renders with the real processor.
ASR_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for p in m['content'] %}{% if p['type'] == 'audio' %}<|audio_start|><|audio_pad|><|audio_end|>"
    "{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% endif %}"
)


class GreedyLLM:
    """What the reference's streaming mode calls (vLLM's `LLM.generate([{"prompt", "multi_modal_data"}], ...)`,
    its only backend for streaming) answered by the reference's transformers model, greedy: so the reference's
    own streaming code (prefix rollback, prompts, parsing) runs on the same weights as ours."""

    def __init__(self, reference, processor, eos_token_ids, max_new_tokens: int):
        self.reference, self.processor = reference, processor
        self.eos_token_ids, self.max_new_tokens = eos_token_ids, max_new_tokens
        self.prompt_ids: list[list[int]] = []  # every prompt it was given, as ids

    def generate(self, inputs, sampling_params=None, use_tqdm=False):
        outputs = []
        for item in inputs:
            audio = item["multi_modal_data"]["audio"][0]
            batch = self.processor(text=[item["prompt"]], audio=[audio], return_tensors="pt")
            self.prompt_ids.append(batch["input_ids"][0].tolist())
            ids = greedy_ids(self.reference, batch["input_ids"][0].tolist(), batch["input_features"],
                             batch["feature_attention_mask"], self.eos_token_ids, self.max_new_tokens)
            text = self.processor.tokenizer.decode(ids, skip_special_tokens=True)
            outputs.append(types.SimpleNamespace(outputs=[types.SimpleNamespace(text=text)]))
        return outputs


class ScriptedLLM(GreedyLLM):
    """`GreedyLLM` that answers with the given replies in turn (what a trained model might write) instead."""

    def __init__(self, processor, replies: list[str]):
        super().__init__(None, processor, (), 0)
        self.replies = list(replies)

    def generate(self, inputs, sampling_params=None, use_tqdm=False):
        outputs = []
        for item in inputs:
            batch = self.processor(text=[item["prompt"]], audio=[item["multi_modal_data"]["audio"][0]],
                                   return_tensors="pt")
            self.prompt_ids.append(batch["input_ids"][0].tolist())
            reply = self.replies.pop(0)
            outputs.append(types.SimpleNamespace(outputs=[types.SimpleNamespace(text=reply)]))
        return outputs


def reference_streaming(family, max_new_tokens: int, replies: list[str] | None = None):
    """The reference's `Qwen3ASRModel` in its streaming mode over our family's weights (`GreedyLLM`), or answering
    with scripted replies (`ScriptedLLM`)."""
    qwen_asr = load()
    processor = reference_processor(family.processor)
    processor.chat_template = ASR_CHAT_TEMPLATE
    if replies is not None:
        llm = ScriptedLLM(processor, replies)
    else:
        llm = GreedyLLM(reference_model(family.model), processor, family.eos_token_ids, max_new_tokens)
    return qwen_asr.Qwen3ASRModel(backend="vllm", model=llm, processor=processor, sampling_params=None)
