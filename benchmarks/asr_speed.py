"""Qwen3-ASR-0.6B and Qwen3-ForcedAligner-0.6B at their released widths (random weights) on this CPU: a recording
transcribed, a streamed session's first partial transcript, and the recording's words aligned, each next to its
floor, with the reference (`qwen_asr`'s transformers model, fp32) side by side.

Each side runs in a fresh process, one after another, so at most one model is in memory at a time and each
process's peak RSS is its own:

- ours, per `--modes` (w4a8 by default; fp32 and the other quantized modes; a mode with "+w8a8", e.g. "w4a8+w8a8":
  that mode with `int8_compute`, the audio encoder, the prefill and the aligner's forward on int8 GEMMs; "+bf16kv",
  e.g. "w4a8+w8a8+bf16kv": the ASR's KV cache in bf16, `kv_dtype="bfloat16"`): the
  transcription of `--seconds` of audio as `OmniPipeline.transcribe` runs it (one engine core, greedy, `--tokens`
  reply tokens: random weights rarely end on their own), each engine step timed: the features and prompt, the first
  step (the audio encoder, the prefill and a token; the encoder alone too) and the decode steps; the real-time
  factor; the first partial transcript of a streamed session (`stream_recognition`, 1 s chunks) after its first
  second of audio; the aligner's `align` of the recording and a transcript of `--words` words, its tokens as many as
  the released tokenizer would make (`train_bpe`: a BPE trained here; "aligner") and a byte each (the tiny
  checkpoints' tokenizer; "aligner_bytes");
- the reference: its `generate` of exactly `--tokens` tokens on the same prompt (its own random weights: the same
  work) and its aligner's forward.

Each stage is timed next to its floor (JSON and a summary printed last): the features and prompt; the audio
encoder (its FLOPs by torch's FLOP counter, its linears' and convolutions' alike, ÷ the matmul peak of its dtype
measured here: bf16 in the quantized modes, fp32 in fp32; with "+w8a8" the int8 GEMM's rate measured here on a
512-row linear: its linears and its two 480-channel convolutions, nearly all its FLOPs, run on that GEMM, the
first convolution's one input channel in bf16); the prefill (the first
engine step less the encoder; floor: 2 × the layers' matrices × the prompt's tokens ÷ the mode's GEMM rate
measured here on a 512-row linear, "w8a8"'s with "+w8a8", plus the causal attention's FLOPs ÷ the fp32 matmul
peak, or with "+w8a8" (attention on the bf16 kernel, `bf16_attention`, where it runs) ÷ the bf16 matmul peak
measured here); the decode steps (the bytes each reads: the layers' and the head's weights as a greedy step reads
them, and the keys and values of the prompt and half the reply, ÷ the read bandwidth measured here); the first
partial's request by stage; the aligner's features, encoder and one
thinker forward with the same floors. Writes JSON.

    python benchmarks/asr_speed.py [--modes w4a8 w4a8+w8a8 fp32] [--seconds 60] [--tokens 128] [--threads 2]
                                   [--out r.json]

A full run (w4a8 and the reference, 60 s, 128 tokens) is sized to finish within 5 minutes on an idle 2-core box;
each process's peak RSS is one model's (about 7 GB for the fp32 0.6B weights and their packed copy).
    python benchmarks/asr_speed.py --quick           # tiny widths, 3 s of audio: a check that it runs (seconds)
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))  # this checkout, not an installed copy
sys.path.insert(0, os.path.dirname(__file__))

from tts_realtime import _peak_rss_mb, decoder_read, machine_floors  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RATE = 16_000


def _config(aligner: bool, quick: bool) -> dict:
    """The config.json of the measured model: the tiny one, or the released 0.6B widths."""
    from omnimtp.models.qwen3_asr import tiny_config

    return tiny_config(aligner) if quick else tiny_config(aligner, **_released(aligner))


def _model(aligner: bool, quick: bool):
    """Our model of `_config`: seeded random weights."""
    from omnimtp.models.qwen3_asr import tiny_qwen3_asr

    return tiny_qwen3_asr(0, aligner=aligner) if quick else tiny_qwen3_asr(0, aligner=aligner, **_released(aligner))


def _released(aligner: bool) -> dict:
    from omnimtp.models.qwen3_asr import (
        QWEN3_ALIGNER_0_6B_AUDIO,
        QWEN3_ALIGNER_0_6B_TEXT,
        QWEN3_ASR_0_6B_AUDIO,
        QWEN3_ASR_0_6B_TEXT,
    )

    audio, text = ((QWEN3_ALIGNER_0_6B_AUDIO, QWEN3_ALIGNER_0_6B_TEXT) if aligner
                   else (QWEN3_ASR_0_6B_AUDIO, QWEN3_ASR_0_6B_TEXT))
    return {"audio": audio, "text": text, "initializer_range": 0.02}


def _processor(config: dict, tokenizer=None):
    """Our `ASRProcessor` for a config (its mel bins) with `tokenizer` (default: the ASR byte tokenizer)."""
    from transformers import WhisperFeatureExtractor

    from omnimtp.families.qwen3_asr import ASRProcessor
    from omnimtp.models.qwen3_asr import asr_byte_tokenizer

    mel_bins = config["thinker_config"]["audio_config"]["num_mel_bins"]
    extractor = WhisperFeatureExtractor(feature_size=mel_bins, sampling_rate=RATE, return_attention_mask=True)
    return ASRProcessor(extractor, tokenizer or asr_byte_tokenizer())


MODES = ("fp32", "int8", "int4", "w4a8", "fp32+w8a8", "int8+w8a8", "int4+w8a8", "w4a8+w8a8", "w4a8+bf16kv",
         "w4a8+w8a8+bf16kv")
BPE_VOCAB_SIZE = 32768


def train_bpe(quick: bool) -> str:
    """The ASR byte tokenizer with byte-level BPE merges (its JSON), so that a transcript takes about as many
    aligner positions as with the released ~151k-token tokenizer (the byte tokenizer spends a position on every
    byte: ~5 a word; English takes ~1.3 tokens a word in Qwen's). The merges are trained with `tokenizers` on the
    docstrings of this Python's standard library modules (its top level, English prose; the first 20 modules
    with `quick`; up to `BPE_VOCAB_SIZE` tokens) with Qwen2's pre-tokenizer; the bytes and the special tokens
    keep their ids, the merged tokens come after them. The benchmark's words then take `tokens_per_word` tokens
    each (about 1.5: 'brown' is 'bro'+'wn'), a little over the released tokenizer's. The ids only change the
    text's length: the weights are random either way."""
    import ast
    import glob
    import sysconfig

    from tokenizers import Tokenizer, trainers

    from omnimtp.models.qwen3_asr import asr_byte_tokenizer

    docs = []
    paths = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))
    for path in paths[:20] if quick else paths:
        try:
            tree = ast.parse(Path(path).read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError):
            continue
        docs += [doc for node in ast.walk(tree) if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef))
                 and (doc := ast.get_docstring(node))]
    spec = json.loads(asr_byte_tokenizer().backend_tokenizer.to_str())
    trained = Tokenizer.from_str(json.dumps({**spec, "added_tokens": []}))
    first = 1 + max(token["id"] for token in spec["added_tokens"])  # the merged tokens' first id
    # (the tiny aligner's vocabulary holds a few dozen merges)
    size = min(BPE_VOCAB_SIZE, _config(True, quick)["thinker_config"]["text_config"]["vocab_size"] - first + 256)
    trained.train_from_iterator(docs, trainers.BpeTrainer(vocab_size=size, show_progress=False,
                                                          initial_alphabet=list(spec["model"]["vocab"])))
    trained_spec = json.loads(trained.to_str())
    vocab = dict(spec["model"]["vocab"])  # the bytes at their ids
    merged = sorted((token_id, token) for token, token_id in trained_spec["model"]["vocab"].items()
                    if token not in vocab)
    vocab.update({token: first + i for i, (_, token) in enumerate(merged)})
    # the special tokens in the model's vocabulary too, at their ids (an added token not in it gets a new id)
    vocab.update({token["content"]: token["id"] for token in spec["added_tokens"]})
    spec["model"] = {**spec["model"], "vocab": vocab, "merges": trained_spec["model"]["merges"]}
    return json.dumps(spec)


def bpe_tokenizer(path: str):
    """`train_bpe`'s tokenizer (its JSON at `path`), its special tokens at the byte tokenizer's ids."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    from omnimtp.models.qwen3_asr import asr_byte_tokenizer

    byte_tokenizer = asr_byte_tokenizer()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_file(path))
    for name in ("eos_token", "audio_token", "audio_bos_token", "audio_eos_token"):
        if getattr(byte_tokenizer, name, None) is not None:
            setattr(tokenizer, name, getattr(byte_tokenizer, name))
    for name in byte_tokenizer.get_added_vocab():
        if tokenizer.convert_tokens_to_ids(name) != byte_tokenizer.convert_tokens_to_ids(name):
            raise RuntimeError(f"{name!r} moved in the BPE tokenizer")
    return tokenizer


def tokens_per_word(tokenizer, text: str) -> float:
    """The tokens a word of `text` takes as the aligner writes it (each word alone, between time slots)."""
    words = text.split()
    return sum(len(tokenizer.encode(word, add_special_tokens=False)) for word in words) / len(words)


def _audio(seconds: float) -> np.ndarray:
    rng = np.random.default_rng(0)
    n = int(seconds * RATE)
    envelope = 0.5 + 0.5 * np.sin(np.linspace(0, seconds * np.pi, n))
    return (0.1 * envelope * rng.standard_normal(n)).astype(np.float32)


def _transcript(num_words: int) -> str:
    words = ("the quick brown fox jumps over a lazy dog while seven bright stars shine above quiet hills").split()
    return " ".join(words[i % len(words)] for i in range(num_words))


def _flops(fn) -> float:
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        fn()
    return float(counter.get_total_flops())


# --- our side: one mode in one process ----------------------------------------------------------------------


def run_ours(mode: str, seconds: float, tokens: int, words: int, threads: int, quick: bool, machine: dict,
             bpe: str) -> dict:
    """One mode: the ASR measured and released (`_measure_asr`), then the aligner built and measured."""
    from omnimtp.families.qwen3_aligner import Qwen3ForcedAligner
    from omnimtp.media import MediaLimits
    from omnimtp.models.qwen3_asr import asr_byte_tokenizer

    torch.set_num_threads(threads)
    quantize, int8_compute, kv_dtype = mode_options(mode)
    entry = _measure_asr(mode, quantize, int8_compute, seconds, tokens, quick, machine, kv_dtype)
    gc.collect()  # the ASR's weights are gone before the aligner's are made: one model at a time
    limits = MediaLimits(max_audio_seconds=max(seconds, 1.0) + 1)
    samples = _audio(seconds)
    aligner = Qwen3ForcedAligner(_model(True, quick), asr_byte_tokenizer(), quantize=quantize,
                                 int8_compute=int8_compute)
    text = _transcript(words)
    aligner.align(samples[: RATE // 2], "warm up", "en", limits)
    # the transcript's tokens as the released tokenizer would have them ("aligner"), and a byte each
    for key, tokenizer in (("aligner", bpe_tokenizer(bpe)), ("aligner_bytes", aligner.tokenizer)):
        aligner.tokenizer = tokenizer
        started = time.perf_counter()
        aligned = aligner.align(samples, text, "en", limits)
        align_s = time.perf_counter() - started
        started = time.perf_counter()  # again: the first call at this size also makes its buffers and kernels
        aligner.align(samples, text, "en", limits)
        entry[key] = {"words": len(aligned), "align_s": align_s, "align_again_s": time.perf_counter() - started,
                      "tokens_per_word": tokens_per_word(tokenizer, text),
                      **_aligner_stages(aligner, samples, text, quantize, int8_compute, machine)}
    entry["peak_rss_mb"] = _peak_rss_mb()
    return entry


def mode_options(mode: str) -> tuple[str | None, bool, str | None]:
    """A `--modes` value → (quantize, int8_compute, kv_dtype): "fp32" → (None, False, None), "w4a8" → ("w4a8",
    False, None), "w4a8+w8a8" → ("w4a8", True, None), "w4a8+w8a8+bf16kv" → ("w4a8", True, "bfloat16")."""
    base, *extras = mode.split("+")
    return (None if base == "fp32" else base), "w8a8" in extras, "bfloat16" if "bf16kv" in extras else None


def _aligner_stages(aligner, samples: np.ndarray, text: str, quantize: str | None, int8_compute: bool,
                    machine: dict) -> dict:
    """The aligner's `align` again, stage by stage (the features and prompt, the audio encoder, the thinker's
    one forward with the head on the time slots), each next to its floor: the encoder's FLOPs at the matmul peak
    of its dtype (bf16 in the quantized modes), the forward's linear FLOPs at the mode's GEMM rate and its
    causal attention's FLOPs at its matmul peak (`_attention_peak`)."""
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import _get_feat_extract_output_lengths

    from omnimtp.thinker import multimodal_prefill

    thinker, device = aligner.model.thinker, aligner.decoder.device
    started = time.perf_counter()
    media = aligner.processor.features(samples)
    num_rows = int(_get_feat_extract_output_lengths(media.audio_lengths, thinker.config.audio_config.n_window)[0])
    ids = aligner.prompt_ids(aligner.words(text, "en"), num_rows)
    inputs_s = time.perf_counter() - started
    with torch.no_grad():
        encoder_flops = _flops(lambda: multimodal_prefill(thinker, ids, media, device))  # the float tower's FLOPs
        started = time.perf_counter()
        prefill = multimodal_prefill(aligner.thinker, ids, media, device)
        encoder_s = time.perf_counter() - started
        started = time.perf_counter()
        aligner.timestamp_rows(ids, prefill.embeds)
        forward_s = time.perf_counter() - started
    linear_flops, attention_flops = _decoder_flops(thinker, len(ids))
    return {
        "positions": len(ids), "inputs_s": inputs_s, "encoder_s": encoder_s, "forward_s": forward_s,
        "floor": {"encoder_s": encoder_flops / (_encoder_peak(quantize, int8_compute, machine) * 1e9),
                  "forward_s": linear_flops / (_gemm_rate("w8a8" if int8_compute else quantize, machine) * 1e9)
                  + attention_flops / (_attention_peak(int8_compute, machine) * 1e9)},
    }


def _decoder_flops(thinker, positions: int) -> tuple[float, float]:
    """(the decoder layers' linear FLOPs, their causal attention's FLOPs) of one forward over `positions`."""
    config = thinker.config.text_config
    linear_flops = 2 * sum(p.numel() for p in thinker.model.layers.parameters() if p.dim() == 2) * positions
    attention_flops = (2 * 2 * config.num_attention_heads * config.head_dim * positions * positions / 2
                       * config.num_hidden_layers)
    return float(linear_flops), float(attention_flops)


def _attention_peak(int8_compute: bool, machine: dict) -> float:
    """GFLOP/s a prompt's attention can reach: bf16 products on the bf16 kernel (int8_compute's prompts, where the
    kernel runs: `omnimtp.runtime.kernels.bf16_attention`), else fp32 (SDPA)."""
    from omnimtp.runtime.kernels import bf16_attention

    if int8_compute and bf16_attention.available():
        return machine["bf16_matmul_gflop_s"]
    return machine["fp32_matmul_gflop_s"]


def _encoder_peak(quantize: str | None, int8_compute: bool, machine: dict) -> float:
    """The matmul rate (GFLOP/s) of the audio encoder's linears and convolutions: the int8 GEMM's with int8_compute
    (the wide convolutions are patch rows on it too), else the peak of its dtype: bf16 in the quantized modes, fp32
    in fp32."""
    if int8_compute:
        return _gemm_rate("w8a8", machine)
    return machine["bf16_matmul_gflop_s" if quantize is not None else "fp32_matmul_gflop_s"]


def _gemm_rate(quantize: str | None, machine: dict) -> float:
    """GFLOP/s of a prefill-sized linear (512 rows, 1024 → 3072) in `quantize`'s kernel ("w8a8": oneDNN's int8
    GEMM with its row quantization; fp32: the fp32 matmul peak), measured here once per process."""
    if quantize is None:
        return machine["fp32_matmul_gflop_s"]
    if quantize not in _GEMM_RATES:
        from omnimtp.runtime.ops import linear, quantize_weight

        x, weight = torch.randn(512, 1024), torch.randn(3072, 1024) * 0.02
        packed = quantize_weight(weight, quantize)
        linear(x, None, packed=packed)
        times = []
        for _ in range(3):
            started = time.perf_counter()
            linear(x, None, packed=packed)
            times.append(time.perf_counter() - started)
        _GEMM_RATES[quantize] = 2 * 512 * 1024 * 3072 / min(times) / 1e9
    return _GEMM_RATES[quantize]


_GEMM_RATES: dict[str, float] = {}


def _measure_asr(mode: str, quantize: str | None, int8_compute: bool, seconds: float, tokens: int, quick: bool,
                 machine: dict, kv_dtype: str | None = None) -> dict:
    from omnimtp.engine.core import EngineCore
    from omnimtp.engine.request import Request
    from omnimtp.families.qwen3_asr import Qwen3ASRFamily
    from omnimtp.media import MediaLimits
    from omnimtp.models.qwen3_asr import asr_byte_tokenizer
    from omnimtp.pipeline import OmniPipeline
    from omnimtp.thinker import multimodal_prefill

    started = time.perf_counter()
    family = Qwen3ASRFamily(_model(False, quick), asr_byte_tokenizer(), quantize=quantize, int8_compute=int8_compute,
                            kv_dtype=kv_dtype)
    load_s = time.perf_counter() - started
    limits = MediaLimits(max_audio_seconds=max(seconds, 1.0) + 1)
    pipe = OmniPipeline(family=family, max_new_tokens=tokens, media_limits=limits)
    samples = _audio(seconds)
    started = time.perf_counter()
    ids, media = family.transcription_inputs(samples, "en", None, limits)  # the features and the prompt
    inputs_s = time.perf_counter() - started
    thinker, device = family.model.thinker, family.device
    with torch.no_grad():
        encoder_flops = _flops(lambda: multimodal_prefill(thinker, ids, media, device))  # the float tower's FLOPs
        multimodal_prefill(family.thinker, ids, media, device)  # a warm-up of the mode's encoder
        started = time.perf_counter()
        multimodal_prefill(family.thinker, ids, media, device)  # the embeddings and the audio encoder
        encoder_s = time.perf_counter() - started
    # the transcription as `transcribe` runs it (one engine core, stepped until done), each step timed: the first
    # is the encoder, the prefill and the first token, each later one a token
    core = EngineCore(family, pipe.config)
    core.add(Request(0, ids, max_new_tokens=tokens, max_frames=1, speaker=None, media=media))
    step_s, reply_ids = [], []
    while core.has_work():
        started = time.perf_counter()
        for event in core.step():
            if event.is_finished:
                reply_ids = core.output(event.request).text_ids
        step_s.append(time.perf_counter() - started)
    first_step_s, decode_s = step_s[0], sum(step_s[1:])
    transcribe_s = inputs_s + first_step_s + decode_s
    # the first partial transcript of a streamed session: after its first second of audio (1 s chunks)
    first_partial_s, first_partial_stages = None, None
    if seconds >= 1.0:
        stream = pipe.stream_recognition([samples[:RATE]], "en", chunk_seconds=1.0, max_new_tokens=min(tokens, 16))
        started = time.perf_counter()
        next(stream)
        first_partial_s = time.perf_counter() - started
        stream.close()
        first_partial_stages = _first_partial_stages(family, pipe, samples[:RATE], min(tokens, 16), limits)
    weight_bytes, _ = decoder_read(family.thinker_decoder)
    # the head as a greedy step reads it: the int4 screen where the decoder has one (its candidates' int8 rows are
    # a few KB), else the int8 head, else the float one
    screened = family.thinker_decoder.screened_lm_head
    head = family.thinker_decoder.quantized_lm_head if screened is None else screened.screen
    head_bytes = (thinker.lm_head.weight.numel() * 4 if head is None
                  else sum(t.numel() * t.element_size() for t in (head.packed, head.scales)))
    # and the keys and values each step reads: the prompt's and half the reply's positions on average
    decoder = family.thinker_decoder
    kv_bytes = (2 * decoder.num_layers * decoder.num_kv_heads * decoder.head_dim
                * (decoder.kv_dtype or decoder.dtype).itemsize * (len(ids) + tokens / 2))
    step_floor_s = (weight_bytes + head_bytes + kv_bytes) / (machine["read_gb_s"] * 1e9)
    linear_flops, attention_flops = _decoder_flops(thinker, len(ids))
    encoder_floor_s = encoder_flops / (_encoder_peak(quantize, int8_compute, machine) * 1e9)
    prefill_rate = _gemm_rate("w8a8" if int8_compute else quantize, machine)
    prefill_floor_s = (linear_flops / (prefill_rate * 1e9)
                       + attention_flops / (_attention_peak(int8_compute, machine) * 1e9))
    entry = {
        "mode": mode, "load_s": load_s, "prompt_tokens": len(ids), "reply_tokens": len(reply_ids),
        "inputs_s": inputs_s, "encoder_s": encoder_s, "first_step_s": first_step_s,
        "prefill_s": max(first_step_s - encoder_s, 0.0),  # the first step less the encoder: the prefill + a token
        "decode_ms_per_token": 1e3 * decode_s / max(len(step_s) - 1, 1),
        "transcribe_s": transcribe_s, "rtf": transcribe_s / seconds, "first_partial_s": first_partial_s,
        "first_partial_stages": first_partial_stages,
        "gemm_gflop_s": prefill_rate,
        "floor": {
            "encoder_s": encoder_floor_s, "prefill_s": prefill_floor_s,
            "first_step_s": encoder_floor_s + prefill_floor_s,
            "decode_ms_per_token": 1e3 * step_floor_s,
            "decode_kv_ms_per_token": 1e3 * kv_bytes / (machine["read_gb_s"] * 1e9),  # its KV part
        },
    }
    floor = entry["floor"]
    floor["transcribe_s"] = floor["first_step_s"] + (tokens - 1) * step_floor_s
    entry["asr_peak_rss_mb"] = _peak_rss_mb()
    return entry


def _first_partial_stages(family, pipe, samples: np.ndarray, tokens: int, limits) -> dict:
    """The first partial's request (1 s of audio, at most `tokens` reply tokens) as its stages: the features and
    prompt, the audio encoder, the first engine step (encoder, prefill, a token) and the decode steps."""
    from omnimtp.engine.core import EngineCore
    from omnimtp.engine.request import Request
    from omnimtp.thinker import multimodal_prefill

    started = time.perf_counter()
    ids, media = family.transcription_inputs(samples, "en", None, limits)
    inputs_s = time.perf_counter() - started
    with torch.no_grad():
        started = time.perf_counter()
        multimodal_prefill(family.thinker, ids, media, family.device)
        encoder_s = time.perf_counter() - started
    core = EngineCore(family, pipe.config)
    core.add(Request(0, ids, max_new_tokens=tokens, max_frames=1, speaker=None, media=media))
    step_s = []
    while core.has_work():
        started = time.perf_counter()
        for event in core.step():
            if event.is_finished:
                core.output(event.request)
        step_s.append(time.perf_counter() - started)
    return {"prompt_tokens": len(ids), "inputs_s": inputs_s, "encoder_s": encoder_s, "first_step_s": step_s[0],
            "decode_steps": len(step_s) - 1, "decode_s": sum(step_s[1:])}


# --- the reference, in its own process ----------------------------------------------------------------------


def run_reference(seconds: float, tokens: int, words: int, threads: int, quick: bool, bpe: str) -> dict:
    """The reference's transcription (exactly `tokens` tokens, greedy) and alignment of the same workload, each
    model built from the config with its own random weights (the same work), one at a time."""
    sys.path.insert(0, str(ROOT / "tests"))
    import qwen_asr_reference as reference

    torch.set_num_threads(threads)
    samples = _audio(seconds)
    config = _config(False, quick)
    processor = reference.reference_processor(_processor(config))
    prompt = ("<|im_start|>system\n<|im_end|>\n<|im_start|>user\n<|audio_start|><|audio_pad|><|audio_end|><|im_end|>"
              "\n<|im_start|>assistant\nlanguage English<asr_text>")
    batch = processor(text=[prompt], audio=[samples], return_tensors="pt")
    model = reference.random_reference(config)
    ids = batch["input_ids"]
    started = time.perf_counter()
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), input_features=batch["input_features"],
                             feature_attention_mask=batch["feature_attention_mask"], max_new_tokens=tokens,
                             min_new_tokens=tokens, do_sample=False)
    transcribe_s = time.perf_counter() - started
    entry = {"reply_tokens": out.sequences.shape[1] - ids.shape[1], "transcribe_s": transcribe_s,
             "rtf": transcribe_s / seconds}
    del model, out
    gc.collect()
    config = _config(True, quick)
    model = reference.random_reference(config)
    text = _transcript(words)
    for key, tokenizer in (("aligner", bpe_tokenizer(bpe)), ("aligner_bytes", None)):
        aligner = reference.aligner_of(model, _processor(config, tokenizer))
        aligner.align(audio=(samples[: RATE // 2], RATE), text="warm up", language="English")
        started = time.perf_counter()
        aligned = aligner.align(audio=(samples, RATE), text=text, language="English")[0]
        entry[key] = {"words": len(aligned), "align_s": time.perf_counter() - started}
    entry["peak_rss_mb"] = _peak_rss_mb()
    return entry


def in_subprocess(worker: dict, threads: int) -> dict:
    """A worker (`--worker JSON`) in a fresh process, so its peak RSS is its own and one model lives at a time."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONPATH=os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        process = subprocess.run([sys.executable, __file__, "--worker", json.dumps(worker), "--out", out.name],
                                 cwd=ROOT, env=env, capture_output=True, text=True)
        if process.returncode != 0:
            return {"mode": worker.get("mode", "reference"), "failed": process.stderr.strip()[-2000:]}
        return json.loads(Path(out.name).read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", nargs="+", default=["w4a8"], choices=MODES,
                        help="our modes, each in its own process (default w4a8; fp32 adds ~1.5 min; '+w8a8': with "
                             "int8_compute, the encoder, prefill and aligner forward on int8 GEMMs)")
    parser.add_argument("--seconds", type=float, default=60.0, help="the recording's length (default 60)")
    parser.add_argument("--tokens", type=int, default=128, help="reply tokens of the transcription (default 128)")
    parser.add_argument("--words", type=int, default=150, help="the aligned transcript's words (default 150)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="tiny widths, 3 s, 8 tokens, 8 words: a check")
    parser.add_argument("--no-reference", action="store_true", help="skip the reference (qwen_asr)")
    parser.add_argument("--out", default=None, help="write the JSON here")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        worker = json.loads(args.worker)
        kind = worker.pop("kind")
        result = run_reference(**worker) if kind == "reference" else run_ours(**worker)
        Path(args.out).write_text(json.dumps(result))
        return
    if args.quick:
        args.seconds, args.tokens, args.words = 3.0, 8, 8
    machine = machine_floors(args.threads, args.quick)
    with tempfile.TemporaryDirectory() as scratch:
        common = {"seconds": args.seconds, "tokens": args.tokens, "words": args.words, "threads": args.threads,
                  "quick": args.quick}
        results = {"machine": {**machine, "cpu": platform.processor() or platform.machine()},
                   "workload": {**common, "size": "tiny" if args.quick else "0.6B"}, "modes": []}
        bpe = Path(scratch) / "bpe.json"  # trained once, read by each process
        bpe.write_text(train_bpe(args.quick))
        common["bpe"] = str(bpe)
        for mode in args.modes:
            entry = in_subprocess({"kind": "ours", "mode": mode, "machine": machine, **common}, args.threads)
            results["modes"].append(entry)
            print(json.dumps(entry), flush=True)
        if not args.no_reference:
            results["reference"] = in_subprocess({"kind": "reference", **common}, args.threads)
            print(json.dumps(results["reference"]), flush=True)
            reference = results["reference"]
            if "failed" not in reference:
                for entry in results["modes"]:
                    if "failed" not in entry:
                        entry["speedup_vs_reference"] = reference["transcribe_s"] / entry["transcribe_s"]
                        for key in ("aligner", "aligner_bytes"):
                            entry[key]["speedup_vs_reference"] = reference[key]["align_s"] / entry[key]["align_s"]
    text = json.dumps(results, indent=2)
    if args.out:
        Path(args.out).write_text(text)
    print(text)
    print(summary(results))


def summary(results: dict) -> str:
    """Each mode's stages next to their floors, one line each (seconds; decode in ms per token)."""
    lines = []
    for entry in results["modes"]:
        if "failed" in entry:
            lines.append(f"{entry['mode']}: failed")
            continue
        floor, aligner = entry["floor"], entry["aligner"]
        lines.append(
            f"{entry['mode']}: transcribe {entry['transcribe_s']:.2f} s (RTF {entry['rtf']:.3f}; floor "
            f"{floor['transcribe_s']:.2f}) = inputs {entry['inputs_s']:.2f} + encoder {entry['encoder_s']:.2f} "
            f"(floor {floor['encoder_s']:.2f}) + prefill {entry['prefill_s']:.2f} (floor {floor['prefill_s']:.2f}) "
            f"+ decode {entry['decode_ms_per_token']:.1f} ms/token (floor {floor['decode_ms_per_token']:.1f})")
        if entry["first_partial_s"] is not None:
            stages = entry["first_partial_stages"]
            lines.append(f"  first partial {entry['first_partial_s']:.3f} s: inputs {stages['inputs_s']:.3f}, encoder "
                         f"{stages['encoder_s']:.3f}, first step {stages['first_step_s']:.3f}, "
                         f"{stages['decode_steps']} decode steps {stages['decode_s']:.3f}")
        for name, stages in (("aligner", aligner), ("aligner, a byte a token", entry["aligner_bytes"])):
            lines.append(
                f"  {name} {stages['words']} words {stages['align_s']:.2f} s (again {stages['align_again_s']:.2f}): "
                f"inputs {stages['inputs_s']:.2f} + "
                f"encoder {stages['encoder_s']:.2f} (floor {stages['floor']['encoder_s']:.2f}) + forward "
                f"{stages['forward_s']:.2f} (floor {stages['floor']['forward_s']:.2f}), {stages['positions']} "
                f"positions ({stages['tokens_per_word']:.2f} tokens a word)")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
