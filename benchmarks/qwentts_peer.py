"""qwentts.cpp, the ggml port of Qwen3-TTS, beside omnimtp on the same checkpoint: a converter and a timing server.

The peer is PyPI's `realtimetts-qwen-native-cpu` (import `qwentts_cpp_cpu`: ggml's CPU backend in a wheel, no
converter inside). It reads two GGUF files: a talker (`general.architecture` `qwen3-tts`: the talker, the code
predictor, a byte-level BPE vocabulary and the speaker/language tables) and a codec (`qwen3-tts-tokenizer`: the
12 Hz decoder; its encoder is loaded only to clone a voice). `convert` writes both from a checkpoint in the
released layout (a CustomVoice talker; the random-weight ones `tts_realtime.py` builds included), in the layout and
key names of the upstream qwentts.cpp converter, quantized as its quantize tool does, with the wheel's own
`ggml_quantize_chunk`:

- `Q4_K_M`: every matrix whose rows are a multiple of 256 in Q4_K, the embedding tables (`*.codec_embd*`,
  `*.text_embd`) in Q6_K (the tool's "important tensor" bump matches Hugging Face names, which the GGUF names are
  not, so it never applies);
- `Q8_0`: every matrix whose rows are a multiple of 32 in Q8_0;
- in both, conv kernels (rows of 1–16 taps) in F16, vectors and the RVQ codebooks with their projections in F32;
- `F32`: everything as stored.

The peer's own venv keeps it away from this project's torch/transformers:

    python -m venv qwentts-venv
    qwentts-venv/bin/pip install realtimetts-qwen-native-cpu==0.4.2 gguf safetensors

and this file runs with that venv's python (it imports neither torch nor omnimtp):

    qwentts-venv/bin/python benchmarks/qwentts_peer.py convert CHECKPOINT OUT_DIR [--quant Q4_K_M|Q8_0|F32]
    qwentts-venv/bin/python benchmarks/qwentts_peer.py serve TALKER.gguf CODEC.gguf [--threads 2]
        [--stream-frames 0|1|2|4]

`serve` loads the model, prints one JSON line (load time, peak RSS), then answers each JSON request line on stdin
(`{"text", "speaker", "frames"}`: one streamed greedy synthesis of at most `frames` frames) with one JSON line:
wall, first audio, audio seconds, chunks, the process's RSS and peak RSS (with `"codes": true`: one greedy
synthesis's codes and audio, for `tts_realtime.py --peer-check`). `tts_realtime.py --peer` drives it
(`PeerServer`), alternating with omnimtp in one run.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

QUANTS = ("Q4_K_M", "Q8_0", "F32")
RVQ_EPSILON = 1e-5  # the speech tokenizer's codebook: embedding_sum / clamp(cluster_usage, min=1e-5)
SAMPLE_RATE = 24_000

# ggml's type numbers (ggml.h), the same in gguf's GGMLQuantizationType
GGML_F32, GGML_F16, GGML_Q8_0, GGML_Q4_K, GGML_Q6_K = 0, 1, 8, 12, 14


# --- names --------------------------------------------------------------------------------------------------

# a Qwen3 decoder layer's parameters, for the talker and the code predictor alike
_LAYER = {
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_TALKER = {
    "talker.model.codec_embedding.weight": "talker.codec_embd.weight",
    "talker.model.text_embedding.weight": "talker.text_embd.weight",
    "talker.model.norm.weight": "talker.output_norm.weight",
    "talker.codec_head.weight": "talker.codec_head.weight",
    "talker.code_predictor.model.norm.weight": "code_pred.output_norm.weight",
    "talker.code_predictor.small_to_mtp_projection.weight": "code_pred.mtp_proj.weight",
    "talker.code_predictor.small_to_mtp_projection.bias": "code_pred.mtp_proj.bias",
}
# the codec decoder's transformer layer (LayerScale after attention and MLP)
_CODEC_LAYER = {
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn_layer_scale.scale": "attn_scale", "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
    "mlp_layer_scale.scale": "ffn_scale",
}


def talker_name(name: str) -> str:
    """The peer's name of a talker checkpoint parameter (ValueError naming it when it has none: a Base
    checkpoint's speaker encoder is not converted)."""
    if name in _TALKER:
        return _TALKER[name]
    if m := re.fullmatch(r"talker\.text_projection\.linear_fc([12])\.(weight|bias)", name):
        return f"talker.text_proj.fc{m[1]}.{m[2]}"
    if m := re.fullmatch(r"talker\.(model|code_predictor\.model)\.layers\.(\d+)\.(.+)", name):
        if m[3] in _LAYER:
            return f"{'talker' if m[1] == 'model' else 'code_pred'}.blk.{m[2]}.{_LAYER[m[3]]}"
    if m := re.fullmatch(r"talker\.code_predictor\.model\.codec_embedding\.(\d+)\.weight", name):
        return f"code_pred.codec_embd.{m[1]}.weight"
    if m := re.fullmatch(r"talker\.code_predictor\.lm_head\.(\d+)\.weight", name):
        return f"code_pred.lm_head.{m[1]}.weight"
    raise ValueError(f"checkpoint: no qwentts.cpp name for the talker parameter {name!r}")


def codec_name(name: str) -> str | None:
    """The peer's name of a speech tokenizer decoder parameter; None for what it does not read (the decoder's
    copy of the RVQ input projection, and the codebooks, which `convert_codec` fuses)."""
    if m := re.fullmatch(r"decoder\.pre_conv\.conv\.(weight|bias)", name):
        return f"tok_dec.pre_conv.{m[1]}"
    if m := re.fullmatch(r"decoder\.pre_transformer\.(input_proj|output_proj|norm)\.(weight|bias)", name):
        return f"tok_dec.pre_tfm.{m[1]}.{m[2]}"
    if m := re.fullmatch(r"decoder\.pre_transformer\.layers\.(\d+)\.(.+)", name):
        if m[2] in _CODEC_LAYER:
            return f"tok_dec.pre_tfm.blk.{m[1]}.{_CODEC_LAYER[m[2]]}"
    if m := re.fullmatch(r"decoder\.upsample\.(\d+)\.0\.conv\.(weight|bias)", name):
        return f"tok_dec.upsample.{m[1]}.conv.{m[2]}"
    if m := re.fullmatch(r"decoder\.upsample\.(\d+)\.1\.(dwconv\.conv|norm|pwconv1|pwconv2)\.(weight|bias)", name):
        return f"tok_dec.upsample.{m[1]}.{m[2].split('.')[0]}.{m[3]}"
    if m := re.fullmatch(r"decoder\.upsample\.(\d+)\.1\.gamma", name):
        return f"tok_dec.upsample.{m[1]}.gamma"
    # the DAC chain: 0 the input conv, 1-4 the upsampling blocks (snake, transposed conv, three residual units),
    # 5 the last snake, 6 the output conv
    if m := re.fullmatch(r"decoder\.decoder\.([06])\.conv\.(weight|bias)", name):
        return f"tok_dec.dec.{m[1]}.conv.{m[2]}"
    if m := re.fullmatch(r"decoder\.decoder\.(5|[1-4]\.block\.0)\.(alpha|beta)", name):
        return f"tok_dec.dec.{m[1][0]}.snake.{m[2]}"
    if m := re.fullmatch(r"decoder\.decoder\.([1-4])\.block\.1\.conv\.(weight|bias)", name):
        return f"tok_dec.dec.{m[1]}.conv_t.{m[2]}"
    if m := re.fullmatch(r"decoder\.decoder\.([1-4])\.block\.([2-4])\.(act[12])\.(alpha|beta)", name):
        return f"tok_dec.dec.{m[1]}.res.{int(m[2]) - 2}.{m[3]}.{m[4]}"
    if m := re.fullmatch(r"decoder\.decoder\.([1-4])\.block\.([2-4])\.(conv[12])\.conv\.(weight|bias)", name):
        return f"tok_dec.dec.{m[1]}.res.{int(m[2]) - 2}.{m[3]}.{m[4]}"
    if m := re.fullmatch(r"decoder\.quantizer\.r(vq_first|vq_rest)\.output_proj\.weight", name):
        return f"tok_dec.{m[1]}.output_proj.weight"
    if re.fullmatch(r"decoder\.quantizer\.rvq_(first|rest)\.(input_proj\.weight|vq\.layers\.\d+\._codebook\.\w+)",
                    name):
        return None
    raise ValueError(f"checkpoint: no qwentts.cpp name for the speech tokenizer parameter {name!r}")


# --- quantization -------------------------------------------------------------------------------------------


def target_type(name: str, shape: tuple[int, ...], quant: str) -> int:
    """The ggml type `name` is stored in at `quant` (the module docstring's policy)."""
    if quant == "F32" or len(shape) < 2 or name.startswith("tok_dec.vq_") or ".snake." in name or ".act" in name:
        return GGML_F32
    if quant == "Q8_0":
        return GGML_Q8_0 if shape[-1] % 32 == 0 else GGML_F16
    if shape[-1] % 256:
        return GGML_F16
    return GGML_Q6_K if (".codec_embd" in name or ".text_embd" in name) else GGML_Q4_K


class Quantizer:
    """ggml's own `ggml_quantize_chunk`, from the peer's wheel (the library its quantize tool links)."""

    def __init__(self):
        import ctypes

        import qwentts_cpp_cpu

        lib_dir = Path(qwentts_cpp_cpu.__file__).parent / "lib"
        self.lib = ctypes.CDLL(str(lib_dir / "libggml-base.so.0"))
        self.lib.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                                 ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
        self.lib.ggml_quantize_chunk.restype = ctypes.c_size_t
        self.lib.ggml_row_size.argtypes = [ctypes.c_int, ctypes.c_int64]
        self.lib.ggml_row_size.restype = ctypes.c_size_t

    def __call__(self, array, ggml_type: int):
        """`array` (float32, [..., K]) as `ggml_type`: float arrays for F32/F16, else [rows..., bytes a row]
        uint8 (what gguf's writer takes with `raw_dtype`)."""
        import numpy as np

        if ggml_type == GGML_F32:
            return np.ascontiguousarray(array, dtype=np.float32)
        if ggml_type == GGML_F16:
            return np.ascontiguousarray(array, dtype=np.float16)
        src = np.ascontiguousarray(array, dtype=np.float32)
        per_row = src.shape[-1]
        rows = src.size // per_row
        row_bytes = self.lib.ggml_row_size(ggml_type, per_row)
        out = np.empty((*src.shape[:-1], row_bytes), dtype=np.uint8)
        written = self.lib.ggml_quantize_chunk(ggml_type, src.ctypes.data, out.ctypes.data, 0, rows, per_row, None)
        if written != out.nbytes:
            raise RuntimeError(f"ggml_quantize_chunk wrote {written} bytes, expected {out.nbytes}")
        return out


# --- conversion ---------------------------------------------------------------------------------------------


def _add(writer, quantizer, name: str, array, quant: str) -> int:
    """Add one tensor at its target type; its stored bytes."""
    from gguf import GGMLQuantizationType

    ggml_type = target_type(name, tuple(array.shape), quant)
    data = quantizer(array, ggml_type)
    raw = None if ggml_type in (GGML_F32, GGML_F16) else GGMLQuantizationType(ggml_type)
    writer.add_tensor(name, data, raw_dtype=raw)
    return data.nbytes


def _bpe_vocabulary(checkpoint: Path) -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges) of the checkpoint's byte-level BPE `tokenizer.json`, ids as it numbers them
    (added tokens typed user-defined, gaps filled with unused placeholders).

    The peer matches only the five TTS special tokens verbatim; an added word (a byte tokenizer's `assistant`, one
    id where the released vocabulary reaches it by merges) gets a chain of merges building it left to right, so
    the template's `assistant` is one id there too. A text word the chain merges only part of comes out as bytes
    again (the peer spells a piece its vocabulary lacks byte by byte), as in the checkpoint's tokenizer."""
    spec = json.loads((checkpoint / "tokenizer.json").read_text())
    model = spec["model"]
    if model.get("type") != "BPE":
        raise ValueError(f"checkpoint: tokenizer.json holds a {model.get('type')} model; the peer reads a "
                         "byte-level BPE")
    by_id = {int(i): (token, 1) for token, i in model["vocab"].items()}
    by_id.update({int(t["id"]): (t["content"], 4) for t in spec.get("added_tokens", [])})
    size = max(by_id) + 1
    tokens = [by_id.get(i, (f"<|unused-{i}|>", 5))[0] for i in range(size)]
    types = [by_id.get(i, ("", 5))[1] for i in range(size)]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    for t in spec.get("added_tokens", []):
        word = t["content"]
        if not t.get("special") and re.fullmatch(r"[A-Za-z]{2,}", word):
            merges += [f"{word[:i]} {word[i]}" for i in range(1, len(word)) if f"{word[:i]} {word[i]}" not in merges]
    return tokens, types, merges


def convert_talker(checkpoint: Path, out: Path, quant: str, quantizer: Quantizer) -> dict:
    """The talker GGUF (the talker, the code predictor, the text vocabulary, the speaker and language tables)."""
    import gguf
    from safetensors import safe_open

    config = json.loads((checkpoint / "config.json").read_text())
    talker, predictor = config["talker_config"], config["talker_config"]["code_predictor_config"]
    if config.get("speaker_encoder_config") is not None or config.get("tts_model_type") == "base":
        raise ValueError("checkpoint: a Base checkpoint (speaker encoder) is not converted; use a CustomVoice one")
    generation_path = checkpoint / "generation_config.json"
    generation = json.loads(generation_path.read_text()) if generation_path.is_file() else {}
    writer = gguf.GGUFWriter(str(out), "qwen3-tts")
    writer.add_string("general.name", f"qwen3-tts {config.get('tts_model_size', '')} {config['tts_model_type']}")
    writer.add_string("qwen3-tts.tokenizer_type", config["tokenizer_type"])
    writer.add_string("qwen3-tts.model_size", config.get("tts_model_size", ""))
    writer.add_string("qwen3-tts.model_type", config["tts_model_type"])
    writer.add_uint32("qwen3-tts.num_code_groups", talker["num_code_groups"])
    for prefix, part in (("talker", talker), ("code_pred", predictor)):
        key = f"qwen3-tts.{prefix}."
        writer.add_uint32(key + "embedding_length", part["hidden_size"])
        writer.add_uint32(key + "feed_forward_length", part["intermediate_size"])
        writer.add_uint32(key + "block_count", part["num_hidden_layers"])
        writer.add_uint32(key + "attention.head_count", part["num_attention_heads"])
        writer.add_uint32(key + "attention.head_count_kv", part["num_key_value_heads"])
        writer.add_uint32(key + "attention.key_length", part["head_dim"])
        writer.add_uint32(key + "vocab_size", part["vocab_size"])
        writer.add_uint32(key + "context_length", part["max_position_embeddings"])
        writer.add_float32(key + "rope.freq_base", float(part["rope_theta"]))
        writer.add_float32(key + "attention.layer_norm_rms_epsilon", float(part["rms_norm_eps"]))
    writer.add_uint32("qwen3-tts.talker.text_vocab_size", talker["text_vocab_size"])
    writer.add_uint32("qwen3-tts.talker.text_hidden_size", talker["text_hidden_size"])
    rope = talker.get("rope_scaling") or {}
    if "mrope_section" in rope:
        writer.add_array("qwen3-tts.talker.rope.mrope_section", list(rope["mrope_section"]))
        writer.add_bool("qwen3-tts.talker.rope.mrope_interleaved", bool(rope.get("interleaved", False)))
    for key, field in (("pad_id", "codec_pad_id"), ("bos_id", "codec_bos_id"), ("eos_id", "codec_eos_token_id"),
                       ("think_id", "codec_think_id"), ("nothink_id", "codec_nothink_id"),
                       ("think_bos_id", "codec_think_bos_id"), ("think_eos_id", "codec_think_eos_id")):
        writer.add_uint32(f"qwen3-tts.codec.{key}", talker[field])
    languages = talker.get("codec_language_id") or {}
    writer.add_array("qwen3-tts.codec.language_names", list(languages))
    writer.add_array("qwen3-tts.codec.language_ids", [int(v) for v in languages.values()])
    speakers = talker.get("spk_id") or {}
    if speakers:
        dialects = talker.get("spk_is_dialect") or {}
        writer.add_array("qwen3-tts.codec.speaker_names", list(speakers))
        writer.add_array("qwen3-tts.codec.speaker_ids", [int(v) for v in speakers.values()])
        writer.add_array("qwen3-tts.codec.speaker_dialects",
                         [d if isinstance(d := dialects.get(s), str) else "" for s in speakers])
    for key in ("im_start", "im_end", "tts_pad", "tts_bos", "tts_eos"):
        writer.add_uint32(f"qwen3-tts.text.{key}_id", config[f"{key}_token_id"])
    for key, kind in (("do_sample", bool), ("top_k", int), ("top_p", float), ("temperature", float),
                      ("repetition_penalty", float), ("subtalker_dosample", bool), ("subtalker_top_k", int),
                      ("subtalker_top_p", float), ("subtalker_temperature", float), ("max_new_tokens", int)):
        if key in generation:
            add = {bool: writer.add_bool, int: writer.add_uint32, float: writer.add_float32}[kind]
            add("generation." + key.replace("dosample", "do_sample"), kind(generation[key]))
    tokens, types, merges = _bpe_vocabulary(checkpoint)
    if not merges:  # gguf writes no empty array: one merge of two bytes no text holds (NUL)
        merges = ["Ā Ā"]
    writer.add_string("tokenizer.ggml.model", "gpt2")
    writer.add_array("tokenizer.ggml.tokens", tokens)
    writer.add_array("tokenizer.ggml.token_type", types)
    writer.add_array("tokenizer.ggml.merges", merges)
    stored = 0
    with safe_open(str(checkpoint / "model.safetensors"), framework="numpy") as f:
        for key in sorted(f.keys()):
            stored += _add(writer, quantizer, talker_name(key), f.get_tensor(key), quant)
    _write(writer)
    return {"path": str(out), "tensor_bytes": stored}


def convert_codec(checkpoint: Path, out: Path, quant: str, quantizer: Quantizer) -> dict:
    """The codec GGUF: the speech tokenizer's decoder (the peer loads an encoder only to clone a voice)."""
    import gguf
    import numpy as np
    from safetensors import safe_open

    directory = checkpoint / "speech_tokenizer"
    config = json.loads((directory / "config.json").read_text())
    decoder = config["decoder_config"]
    writer = gguf.GGUFWriter(str(out), "qwen3-tts-tokenizer")
    writer.add_string("general.name", "qwen3-tts-tokenizer-12hz")
    key = "qwen3-tts-tokenizer."
    for field in ("input_sample_rate", "output_sample_rate", "decode_upsample_rate", "encode_downsample_rate",
                  "encoder_valid_num_quantizers"):
        writer.add_uint32(key + field, config[field])
    codebooks: dict[tuple[str, int], dict[str, np.ndarray]] = {}
    stored = 0
    with safe_open(str(directory / "model.safetensors"), framework="numpy") as f:
        names = sorted(f.keys())
        first_proj = f.get_tensor("decoder.quantizer.rvq_first.output_proj.weight")  # [hidden, codebook dim, 1]
        for name in names:
            if m := re.fullmatch(r"decoder\.quantizer\.rvq_(first|rest)\.vq\.layers\.(\d+)\._codebook\.(\w+)", name):
                codebooks.setdefault((m[1], int(m[2])), {})[m[3]] = f.get_tensor(name)
            elif (target := codec_name(name)) is not None:
                stored += _add(writer, quantizer, target, f.get_tensor(name), quant)
    for field in ("latent_dim", "codebook_dim", "codebook_size", "decoder_dim", "hidden_size", "intermediate_size",
                  "head_dim", "num_attention_heads", "num_key_value_heads", "num_hidden_layers", "num_quantizers",
                  "sliding_window"):
        writer.add_uint32(key + "decoder." + field, decoder[field])
    writer.add_uint32(key + "decoder.num_semantic_quantizers", decoder.get("num_semantic_quantizers", 1))
    writer.add_uint32(key + "decoder.vector_quantization_hidden_dim", first_proj.shape[0])
    writer.add_uint32(key + "decoder.codebook_dim_internal", first_proj.shape[1])
    writer.add_float32(key + "decoder.rms_norm_eps", float(decoder["rms_norm_eps"]))
    writer.add_float32(key + "decoder.rope_theta", float(decoder["rope_theta"]))
    writer.add_float32(key + "decoder.layer_scale_initial_scale", float(decoder["layer_scale_initial_scale"]))
    writer.add_array(key + "decoder.upsample_rates", list(decoder["upsample_rates"]))
    writer.add_array(key + "decoder.upsampling_ratios", list(decoder["upsampling_ratios"]))
    for (side, index), parts in sorted(codebooks.items()):
        usage = np.clip(parts["cluster_usage"].astype(np.float32), RVQ_EPSILON, None)
        table = parts["embedding_sum"].astype(np.float32) / usage[:, None]
        stored += _add(writer, quantizer, f"tok_dec.vq_{side}.{index}.codebook", table, quant)
    _write(writer)
    return {"path": str(out), "tensor_bytes": stored}


def _write(writer) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def convert(checkpoint: str | Path, out_dir: str | Path, quant: str = "Q4_K_M") -> dict:
    """Both GGUF files of `checkpoint` at `quant` in `out_dir` (kept: a file already there and newer than this
    converter and the checkpoint is not rewritten; each is written under a temporary name, renamed when complete).
    Returns their paths, seconds and peak RSS."""
    if quant not in QUANTS:
        raise ValueError(f"quant: expected one of {', '.join(QUANTS)}, got {quant!r}")
    checkpoint, out_dir = Path(checkpoint), Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    quantizer = Quantizer()
    result = {"quant": quant}
    sources = (Path(__file__), checkpoint / "model.safetensors", checkpoint / "speech_tokenizer" / "model.safetensors")
    newest_source = max(source.stat().st_mtime for source in sources)
    for part, converter in (("talker", convert_talker), ("codec", convert_codec)):
        path = out_dir / f"{part}-{quant}.gguf"
        if not path.is_file() or path.stat().st_mtime < newest_source:
            staging = path.with_suffix(".partial")
            converter(checkpoint, staging, quant, quantizer)
            staging.rename(path)
        result[part] = str(path)
        result[f"{part}_bytes"] = path.stat().st_size
    result["seconds"] = time.perf_counter() - started
    result["peak_rss_mb"] = _peak_rss_mb()
    return result


# --- timing server (in the peer's venv) ---------------------------------------------------------------------


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _peak_rss_mb() -> float:
    """This process's peak RSS: VmHWM, its own memory's high-water mark (ru_maxrss would carry the peak of the
    process that forked it across exec), or the current RSS where that has not caught up yet."""
    with open("/proc/self/status") as f:
        hwm = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
    return max(hwm / 1024, _rss_mb())


def serve(talker: str, codec: str, threads: int, stream_frames: int = 0) -> None:
    """Load the peer on `threads` threads (`stream_frames`: its streamed chunk cadence, 0 its default), then time
    each request line on stdin (the module docstring)."""
    from qwentts_cpp_cpu import QwenTTS

    started = time.perf_counter()
    tts = QwenTTS(talker, codec, cpu_threads=threads, cpu_stream_frames=stream_frames)
    print(json.dumps({"ready": True, "load_s": time.perf_counter() - started, "load_peak_rss_mb": _peak_rss_mb(),
                      "rss_loaded_mb": _rss_mb()}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        if request.get("codes"):
            print(json.dumps(greedy_codes(tts, request)), flush=True)
            continue
        first = None
        samples = chunks = 0
        started = time.perf_counter()
        for audio, _ in tts.stream(text=request["text"], speaker=request.get("speaker"),
                                   lang=request.get("language", "english"), max_new_tokens=request["frames"],
                                   do_sample=False, subtalker_do_sample=False, repetition_penalty=1.0):
            if first is None:
                first = time.perf_counter() - started
            samples += len(audio)
            chunks += 1
        wall = time.perf_counter() - started
        audio_s = samples / SAMPLE_RATE
        print(json.dumps({"wall_s": wall, "first_audio_s": first, "audio_s": audio_s, "chunks": chunks,
                          "frames": round(audio_s * SAMPLE_RATE / 1920), "rtf": wall / audio_s if audio_s else None,
                          "rss_mb": _rss_mb(), "peak_rss_mb": _peak_rss_mb()}), flush=True)


def greedy_codes(tts, request: dict) -> dict:
    """One greedy synthesis, not streamed: its codes ([frames][16], read from the peer's debug dump, whose
    tensors are an int32 rank and shape, then float32 values) and its audio."""
    import tempfile

    import numpy as np

    with tempfile.TemporaryDirectory() as dump:
        audio, _ = tts.synthesize(text=request["text"], speaker=request.get("speaker"),
                                  lang=request.get("language", "english"), max_new_tokens=request["frames"],
                                  do_sample=False, subtalker_do_sample=False, repetition_penalty=1.0, dump_dir=dump)
        raw = np.fromfile(os.path.join(dump, "codes-full.bin"), dtype=np.int32)
    rank = int(raw[0])
    shape = [int(n) for n in raw[1:1 + rank]]
    codes = raw[1 + rank:].view(np.float32).astype(np.int64).reshape(shape)
    return {"codes": codes.tolist(), "audio": audio.tolist()}


class PeerServer:
    """`serve` in the peer's venv as a child process (stdlib only on this side): `ready` is its load line,
    `speak(text, speaker, frames)` one timed request's line. Its log goes to `log_path`."""

    def __init__(self, python: str, talker: str, codec: str, threads: int, log_path: str, stream_frames: int = 0):
        self.log = open(log_path, "w")
        env = dict(os.environ, OMP_NUM_THREADS=str(threads))
        self.process = subprocess.Popen([python, __file__, "serve", talker, codec, "--threads", str(threads),
                                         "--stream-frames", str(stream_frames)],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True,
                                        env=env)
        self.ready = self._reply()

    def _reply(self) -> dict:
        line = self.process.stdout.readline()
        if not line:
            self.close()
            raise RuntimeError(f"the qwentts.cpp server exited; its log: {self.log.name}")
        return json.loads(line)

    def speak(self, text: str, speaker: str | None, frames: int, codes: bool = False) -> dict:
        """One timed streamed request; with `codes`, one greedy request's codes and audio instead."""
        request = {"text": text, "speaker": speaker, "frames": frames, "codes": codes}
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        return self._reply()

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.close()
            self.process.wait(timeout=60)
        self.log.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    converting = commands.add_parser("convert", help="a checkpoint's two GGUF files")
    converting.add_argument("checkpoint")
    converting.add_argument("out_dir")
    converting.add_argument("--quant", default="Q4_K_M", choices=QUANTS)
    serving = commands.add_parser("serve", help="time requests from stdin")
    serving.add_argument("talker")
    serving.add_argument("codec")
    serving.add_argument("--threads", type=int, default=2)
    serving.add_argument("--stream-frames", type=int, default=0, choices=(0, 1, 2, 4),
                         help="the peer's streamed chunk cadence in frames (0: its default)")
    args = parser.parse_args()
    if args.command == "convert":
        print(json.dumps(convert(args.checkpoint, args.out_dir, args.quant)))
    else:
        serve(args.talker, args.codec, args.threads, args.stream_frames)


if __name__ == "__main__":
    main()
