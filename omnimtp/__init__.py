"""omnimtp: speech generation for thinker–talker omni models and MTP speculative decoding.

Public names are imported lazily, so `import omnimtp` (and the CLI's startup) stays cheap.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

# public name -> module that defines it, grouped by job
_EXPORTS = {
    # speech from Qwen3-Omni: the Python API
    "OmniPipeline": "omnimtp.pipeline",
    "OmniOutput": "omnimtp.engine.request",
    "OmniEvent": "omnimtp.pipeline",
    "SamplingParams": "omnimtp.sampling",
    "MediaInputs": "omnimtp.media",
    "MediaLimits": "omnimtp.media",
    "load_processor": "omnimtp.media",
    # the OpenAI-compatible server
    "create_app": "omnimtp.server.app",
    "Engine": "omnimtp.server.scheduler",
    "EngineRequest": "omnimtp.server.scheduler",
    # speculative decoding with an MTP head
    "speculative_generate": "omnimtp.spec_decode.generate",
    "plain_generate": "omnimtp.spec_decode.generate",
    "SpecConfig": "omnimtp.spec_decode.generate",
    "SpecStats": "omnimtp.spec_decode.generate",
    "SpecOutput": "omnimtp.spec_decode.generate",
    "load_target_and_head": "omnimtp.mtp.head",
    "demo_model_dir": "omnimtp.mtp.demo",
    "demo_omni_dir": "omnimtp.mtp.demo",
    "rejection_sample": "omnimtp.spec_decode.rejection",
    "Proposer": "omnimtp.spec_decode.proposer",
    "DraftInput": "omnimtp.spec_decode.proposer",
    "MTPProposer": "omnimtp.spec_decode.proposer",
    "TargetProposer": "omnimtp.spec_decode.proposer",
    "ThinkerSpeculation": "omnimtp.spec_decode.thinker_spec",
    # MTP heads and their training
    "MTPHead": "omnimtp.mtp.head",
    "MTPHeadOutput": "omnimtp.mtp.head",
    "enable_transformers_mtp": "omnimtp.mtp.head",
    "train_mtp_head": "omnimtp.mtp.train",
    "generate_distill_rows": "omnimtp.mtp.train",
    "MTPTrainConfig": "omnimtp.mtp.train",
    "MTPTrainResult": "omnimtp.mtp.train",
    # the engine core and the model families behind it
    "EngineCore": "omnimtp.engine.core",
    "EngineConfig": "omnimtp.engine.core",
    "Request": "omnimtp.engine.request",
    "StepEvent": "omnimtp.engine.request",
    "Qwen3OmniFamily": "omnimtp.families.qwen3_omni",
    "Qwen2_5OmniFamily": "omnimtp.families.qwen2_5_omni",
    # the stages, for study and for other engines: thinker, handoff, talker, code predictor, codec
    "ThinkerRun": "omnimtp.thinker",
    "trim_thinker_hidden": "omnimtp.handoff",
    "build_talker_prefill": "omnimtp.handoff",
    "talker_decode_input": "omnimtp.handoff",
    "num_kept_rows": "omnimtp.handoff",
    "TalkerInputs": "omnimtp.handoff",
    "TalkerChunk": "omnimtp.handoff",
    "TalkerInputBuilder": "omnimtp.handoff",
    "ThinkerToTalkerStream": "omnimtp.handoff",
    "assemble_talker_chunks": "omnimtp.handoff",
    "talker_inputs_from_rows": "omnimtp.handoff",
    "Qwen3TalkerInputBuilder": "omnimtp.talker.qwen3_inputs",
    "build_qwen3_talker_inputs": "omnimtp.talker.qwen3_inputs",
    "Qwen2_5TalkerInputBuilder": "omnimtp.talker.qwen2_5_inputs",
    "build_qwen2_5_talker_inputs": "omnimtp.talker.qwen2_5_inputs",
    "TalkerBatch": "omnimtp.talker.loop",
    "TalkerRequest": "omnimtp.talker.loop",
    "TalkerFrame": "omnimtp.talker.loop",
    "FrameMaker": "omnimtp.talker.loop",
    "Qwen3FrameMaker": "omnimtp.talker.loop",
    "Qwen2_5FrameMaker": "omnimtp.talker.loop",
    "QWEN2_5_OMNI_TALKER_GREEDY": "omnimtp.talker.loop",
    "QWEN2_5_OMNI_TALKER_SAMPLING": "omnimtp.talker.loop",
    "QWEN3_OMNI_TALKER_GREEDY": "omnimtp.talker.loop",
    "QWEN3_OMNI_TALKER_SAMPLING": "omnimtp.talker.loop",
    "QWEN3_OMNI_CODE_PREDICTOR_SAMPLING": "omnimtp.sampling",
    "predict_residual_codes": "omnimtp.talker.code_predictor",
    "predict_residual_codes_kv": "omnimtp.talker.code_predictor",
    "next_talker_input": "omnimtp.talker.code_predictor",
    "CodePredictorRunner": "omnimtp.talker.code_predictor",
    "ResidualCodes": "omnimtp.talker.code_predictor",
    "StreamingCode2Wav": "omnimtp.codec.streaming",
    "SpeechTokenizerDecoder": "omnimtp.codec.speech_tokenizer",
    "tiny_speech_tokenizer": "omnimtp.codec.speech_tokenizer",
    # the runtime: packed decoders on one KV cache type
    "PackedDecoder": "omnimtp.runtime.decoder",
    "KVCache": "omnimtp.runtime.kv_cache",
    "decoder_forward": "omnimtp.packed_decoder",
    "packed_target": "omnimtp.spec_decode.packed_target",
    "packed_forward": "omnimtp.spec_decode.packed_target",
    "packed_logits": "omnimtp.spec_decode.packed_target",
    # tiny seeded models and the byte tokenizer (tests, the embedded default)
    "tiny_qwen3_omni": "omnimtp.models.tiny",
    "tiny_qwen3_omni_config": "omnimtp.models.tiny",
    "tiny_code_predictor_config": "omnimtp.models.tiny",
    "tiny_qwen2_5_omni": "omnimtp.models.tiny_qwen2_5_omni",
    "tiny_qwen2_5_omni_config": "omnimtp.models.tiny_qwen2_5_omni",
    "save_tiny_qwen2_5_omni": "omnimtp.models.tiny_qwen2_5_omni",
    "tiny_lm": "omnimtp.models.tiny_lm",
    "tiny_lm_config": "omnimtp.models.tiny_lm",
    "byte_tokenizer": "omnimtp.tokenizer",
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
