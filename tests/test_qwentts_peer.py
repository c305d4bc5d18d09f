"""benchmarks/qwentts_peer.py, the converter to qwentts.cpp's GGUF files: every parameter of a checkpoint in the
released layout gets the name the peer's loader looks up (the templates below are the tensor names its
`libqwen.so` reads, from the wheel `realtimetts-qwen-native-cpu` 0.4.2), the right one for its role, and the
quantization its quantize tool gives it. Loading the converted files into the peer itself needs the peer's venv and
the speech tokenizer's released widths (the tiny talker runs there, the tiny decoder aborts it on a ggml shape
assertion), so it is left to `tts_realtime.py --peer-check`, outside the suite."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors import safe_open

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import qwentts_peer  # noqa: E402
from qwentts_peer import GGML_F16, GGML_F32, GGML_Q4_K, GGML_Q6_K, GGML_Q8_0  # noqa: E402

# the tensor names libqwen.so looks up (%d: a layer, codebook or block index); the speaker encoder's (Base
# checkpoints) and the codec encoder's (voice cloning) are not converted
PEER_TALKER_NAMES = [
    "talker.codec_embd.weight", "talker.text_embd.weight", "talker.text_proj.fc1.weight", "talker.text_proj.fc1.bias",
    "talker.text_proj.fc2.weight", "talker.text_proj.fc2.bias", "talker.codec_head.weight", "talker.output_norm.weight",
    *(f"{part}.blk.%d.{name}" for part in ("talker", "code_pred") for name in (
        "attn_norm.weight", "attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight",
        "attn_q_norm.weight", "attn_k_norm.weight", "ffn_norm.weight", "ffn_gate.weight", "ffn_up.weight",
        "ffn_down.weight")),
    "code_pred.codec_embd.%d.weight", "code_pred.lm_head.%d.weight", "code_pred.output_norm.weight",
    "code_pred.mtp_proj.weight", "code_pred.mtp_proj.bias",
]
PEER_CODEC_NAMES = [
    "tok_dec.pre_conv.weight", "tok_dec.pre_conv.bias", "tok_dec.pre_tfm.input_proj.weight",
    "tok_dec.pre_tfm.input_proj.bias", "tok_dec.pre_tfm.output_proj.weight", "tok_dec.pre_tfm.output_proj.bias",
    "tok_dec.pre_tfm.norm.weight",
    *(f"tok_dec.pre_tfm.blk.%d.{name}" for name in (
        "attn_norm.weight", "attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight", "attn_scale",
        "ffn_norm.weight", "ffn_gate.weight", "ffn_up.weight", "ffn_down.weight", "ffn_scale")),
    *(f"tok_dec.upsample.%d.{name}" for name in (
        "conv.weight", "conv.bias", "dwconv.weight", "dwconv.bias", "norm.weight", "norm.bias", "pwconv1.weight",
        "pwconv1.bias", "pwconv2.weight", "pwconv2.bias", "gamma")),
    "tok_dec.dec.%d.conv.weight", "tok_dec.dec.%d.conv.bias", "tok_dec.dec.%d.snake.alpha",
    "tok_dec.dec.%d.snake.beta", "tok_dec.dec.%d.conv_t.weight", "tok_dec.dec.%d.conv_t.bias",
    *(f"tok_dec.dec.%d.res.%d.{name}" for name in (
        "act1.alpha", "act1.beta", "act2.alpha", "act2.beta", "conv1.weight", "conv1.bias", "conv2.weight",
        "conv2.bias")),
    "tok_dec.vq_first.output_proj.weight", "tok_dec.vq_rest.output_proj.weight",
]


def _pattern(template: str) -> re.Pattern:
    return re.compile(re.escape(template).replace("%d", r"\d+"))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from tts_realtime import build_checkpoint

    return build_checkpoint("tiny", tmp_path_factory.mktemp("peer") / "qwen3-tts-tiny")


def _keys(path: Path) -> list[str]:
    with safe_open(str(path), framework="pt") as f:
        return list(f.keys())


def _assert_every_template_used(names: list[str], templates: list[str]) -> None:
    patterns = [_pattern(t) for t in templates]
    for name in names:
        assert sum(bool(p.fullmatch(name)) for p in patterns) == 1, name
    unused = [t for t, p in zip(templates, patterns, strict=True) if not any(p.fullmatch(n) for n in names)]
    assert not unused
    assert len(set(names)) == len(names)


def test_every_talker_parameter_gets_the_name_the_peer_reads(checkpoint):
    keys = _keys(checkpoint / "model.safetensors")
    names = [qwentts_peer.talker_name(k) for k in keys]
    _assert_every_template_used(names, PEER_TALKER_NAMES)  # the tiny predictor is narrower: mtp_proj is there
    # each role to its own name
    expected = {
        "talker.model.layers.1.self_attn.q_proj.weight": "talker.blk.1.attn_q.weight",
        "talker.model.layers.1.self_attn.k_proj.weight": "talker.blk.1.attn_k.weight",
        "talker.model.layers.1.self_attn.v_proj.weight": "talker.blk.1.attn_v.weight",
        "talker.model.layers.1.self_attn.o_proj.weight": "talker.blk.1.attn_output.weight",
        "talker.model.layers.1.self_attn.q_norm.weight": "talker.blk.1.attn_q_norm.weight",
        "talker.model.layers.1.input_layernorm.weight": "talker.blk.1.attn_norm.weight",
        "talker.model.layers.1.post_attention_layernorm.weight": "talker.blk.1.ffn_norm.weight",
        "talker.model.layers.0.mlp.gate_proj.weight": "talker.blk.0.ffn_gate.weight",
        "talker.model.layers.0.mlp.up_proj.weight": "talker.blk.0.ffn_up.weight",
        "talker.model.layers.0.mlp.down_proj.weight": "talker.blk.0.ffn_down.weight",
        "talker.code_predictor.model.layers.1.self_attn.k_proj.weight": "code_pred.blk.1.attn_k.weight",
        "talker.code_predictor.model.codec_embedding.3.weight": "code_pred.codec_embd.3.weight",
        "talker.code_predictor.lm_head.14.weight": "code_pred.lm_head.14.weight",
        "talker.model.codec_embedding.weight": "talker.codec_embd.weight",
        "talker.model.text_embedding.weight": "talker.text_embd.weight",
        "talker.text_projection.linear_fc2.bias": "talker.text_proj.fc2.bias",
    }
    assert {k: qwentts_peer.talker_name(k) for k in expected} == expected
    with pytest.raises(ValueError, match="speaker_encoder.fc.weight"):
        qwentts_peer.talker_name("speaker_encoder.fc.weight")


def test_every_codec_decoder_parameter_gets_the_name_the_peer_reads(checkpoint):
    keys = _keys(checkpoint / "speech_tokenizer" / "model.safetensors")
    names = [n for n in map(qwentts_peer.codec_name, keys) if n is not None]
    _assert_every_template_used(names, PEER_CODEC_NAMES)
    skipped = sorted(k for k in keys if qwentts_peer.codec_name(k) is None)
    # the RVQ codebooks (fused into one table each) and the decoder's unused input projections
    assert all("._codebook." in k or k.endswith(".input_proj.weight") for k in skipped)
    assert len(skipped) == 2 + 2 * 16
    expected = {
        "decoder.decoder.0.conv.weight": "tok_dec.dec.0.conv.weight",
        "decoder.decoder.6.conv.bias": "tok_dec.dec.6.conv.bias",
        "decoder.decoder.5.alpha": "tok_dec.dec.5.snake.alpha",
        "decoder.decoder.2.block.0.beta": "tok_dec.dec.2.snake.beta",
        "decoder.decoder.2.block.1.conv.weight": "tok_dec.dec.2.conv_t.weight",
        "decoder.decoder.3.block.4.conv1.conv.weight": "tok_dec.dec.3.res.2.conv1.weight",
        "decoder.decoder.1.block.2.act2.alpha": "tok_dec.dec.1.res.0.act2.alpha",
        "decoder.upsample.1.0.conv.weight": "tok_dec.upsample.1.conv.weight",
        "decoder.upsample.1.1.dwconv.conv.weight": "tok_dec.upsample.1.dwconv.weight",
        "decoder.upsample.0.1.pwconv2.bias": "tok_dec.upsample.0.pwconv2.bias",
        "decoder.pre_transformer.layers.1.self_attn_layer_scale.scale": "tok_dec.pre_tfm.blk.1.attn_scale",
        "decoder.pre_transformer.layers.1.mlp_layer_scale.scale": "tok_dec.pre_tfm.blk.1.ffn_scale",
        "decoder.quantizer.rvq_rest.output_proj.weight": "tok_dec.vq_rest.output_proj.weight",
    }
    assert {k: qwentts_peer.codec_name(k) for k in expected} == expected


def test_quantization_follows_the_peers_tool():
    target = qwentts_peer.target_type
    # Q4_K_M: rows a multiple of 256 in Q4_K, the embedding tables in Q6_K, conv kernels in F16
    assert target("talker.blk.3.attn_v.weight", (1024, 1024), "Q4_K_M") == GGML_Q4_K
    assert target("code_pred.lm_head.2.weight", (2048, 1024), "Q4_K_M") == GGML_Q4_K
    assert target("talker.codec_embd.weight", (3072, 1024), "Q4_K_M") == GGML_Q6_K
    assert target("talker.text_embd.weight", (320, 2048), "Q4_K_M") == GGML_Q6_K
    assert target("code_pred.codec_embd.4.weight", (2048, 1024), "Q4_K_M") == GGML_Q6_K
    assert target("tok_dec.pre_tfm.blk.0.attn_q.weight", (1024, 512), "Q4_K_M") == GGML_Q4_K
    assert target("tok_dec.dec.1.conv_t.weight", (1536, 768, 16), "Q4_K_M") == GGML_F16
    assert target("talker.blk.0.attn_q.weight", (64, 48), "Q4_K_M") == GGML_F16  # rows not a multiple of 256
    # Q8_0: rows a multiple of 32, the embeddings too
    assert target("talker.codec_embd.weight", (3072, 1024), "Q8_0") == GGML_Q8_0
    assert target("tok_dec.dec.0.conv.weight", (1536, 1024, 7), "Q8_0") == GGML_F16
    # never quantized: vectors, the RVQ codebooks and their projections
    for quant in ("Q4_K_M", "Q8_0", "F32"):
        assert target("talker.blk.0.attn_norm.weight", (1024,), quant) == GGML_F32
        assert target("tok_dec.vq_rest.3.codebook", (2048, 256), quant) == GGML_F32
        assert target("tok_dec.vq_first.output_proj.weight", (512, 256, 1), quant) == GGML_F32
    assert target("talker.blk.3.attn_v.weight", (1024, 1024), "F32") == GGML_F32


def test_the_peer_comparison_needs_the_peers_venv(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    process = subprocess.run([sys.executable, "benchmarks/tts_realtime.py", "--size", "tiny", "--peer", "--modes",
                              "--peer-python", str(tmp_path / "missing" / "python")], cwd=ROOT, env=env,
                             capture_output=True, text=True, timeout=120)
    assert process.returncode == 2 and "--peer-python" in process.stderr
    with pytest.raises(ValueError, match="quant"):
        qwentts_peer.convert(tmp_path, tmp_path / "out", "Q5_K")
