"""omnimtp: speech generation for thinker–talker omni models (Qwen3-Omni, Qwen2.5-Omni) and MTP speculative
decoding for causal LMs, on PyTorch + transformers.

Start here:

    from omnimtp import OmniPipeline
    pipe = OmniPipeline.tiny()            # the embedded tiny model; or OmniPipeline.from_pretrained(checkpoint_dir)
    out = pipe.generate("Hello")          # OmniOutput: out.text, out.audio (float32, 24 kHz), out.codes
    for event in pipe.stream("Hello"):    # OmniEvent: event.text, event.audio chunks, then event.output
        ...

    import torch
    from omnimtp import demo_model_dir, load_target_and_head, speculative_generate
    target, head = load_target_and_head(demo_model_dir())   # the shipped demo LM and its MTP head
    spec = speculative_generate(target, head, torch.tensor([[10, 20, 30]]), max_new_tokens=64, num_draft_tokens=3)
    spec.sequences, spec.stats.mean_acceptance_length       # greedy: exactly plain decoding's tokens

The names exported here (`omnimtp.__all__`) are what a user calls: the speech pipeline and its outputs, sampling,
media limits, speculative decoding with an MTP head, training a head, and the shipped demo checkpoints. Everything else
(the engine core, model families, talker and codec stages, the runtime, the server, tiny test models)
is imported from its own module: `omnimtp.engine`, `omnimtp.families`, `omnimtp.talker`, `omnimtp.codec`,
`omnimtp.runtime`, `omnimtp.server`, `omnimtp.models`. The command line is `omnimtp --help`.

Public names are imported lazily, so `import omnimtp` (and the CLI's startup) stays cheap.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

# public name -> module that defines it, grouped by job
_EXPORTS = {
    # speech from Qwen3-Omni and Qwen2.5-Omni
    "OmniPipeline": "omnimtp.pipeline",
    "OmniOutput": "omnimtp.engine.request",
    "OmniEvent": "omnimtp.pipeline",
    "SamplingParams": "omnimtp.sampling",
    "MediaLimits": "omnimtp.media",
    "Voice": "omnimtp.voice",  # a cloned Qwen3-TTS Base voice (OmniPipeline.create_voice)
    # speculative decoding with an MTP head (or any Proposer)
    "speculative_generate": "omnimtp.spec_decode.generate",
    "plain_generate": "omnimtp.spec_decode.generate",
    "SpecOutput": "omnimtp.spec_decode.generate",
    "SpecStats": "omnimtp.spec_decode.generate",
    "load_target_and_head": "omnimtp.mtp.load",
    "MTPHead": "omnimtp.mtp.head",
    "Proposer": "omnimtp.spec_decode.proposer",
    "DraftInput": "omnimtp.spec_decode.proposer",
    # training an MTP head by self-distillation
    "train_mtp_head": "omnimtp.mtp.train",
    "generate_distill_rows": "omnimtp.mtp.train",
    "MTPTrainConfig": "omnimtp.mtp.train",
    "MTPTrainResult": "omnimtp.mtp.train",
    # the shipped demo checkpoints
    "demo_model_dir": "omnimtp.mtp.demo",
    "demo_omni_dir": "omnimtp.mtp.demo",
}


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'omnimtp' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(list(globals()) + list(_EXPORTS))


__all__ = sorted(_EXPORTS)
