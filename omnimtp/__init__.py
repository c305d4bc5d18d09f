"""omnimtp: speech generation for thinker–talker omni models and MTP speculative decoding.

Public names are imported lazily, so `import omnimtp` (and the CLI's startup) stays cheap.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS = {
    # sampling
    "SamplingParams": "omnimtp.sampling",
    "QWEN3_OMNI_CODE_PREDICTOR_SAMPLING": "omnimtp.sampling",
    # tiny seeded models
    "tiny_qwen3_omni": "omnimtp.models.tiny",
    "tiny_qwen3_omni_config": "omnimtp.models.tiny",
    "tiny_code_predictor_config": "omnimtp.models.tiny",
    # issue 2: code predictor
    # issue 3: thinker -> talker handoff
    # issue 4: MTP speculative decoding
    # issue 5: end-to-end pipeline
    # issue 6: server
    # issue 7: MTP head training
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
