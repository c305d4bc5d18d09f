"""Qwen3-TTS's talker and code predictor as the project's own modules, read from the released layout.

A Qwen3-TTS checkpoint (`config.json` with model_type "qwen3_tts", `model.safetensors`, the text tokenizer
files, `speech_tokenizer/`) holds one talker: a dense Qwen3 decoder with q/k norm whose M-RoPE rows are all
equal for text (so it is the 1-D rotary embedding), its own `text_embedding` + `text_projection` (a
two-layer MLP) in place of a thinker, a codec embedding and `codec_head`, and a code predictor whose
codebook tables are in the talker's width and whose `small_to_mtp_projection` maps them to its own.

The modules here are transformers' Qwen3 decoder layers, norms and rotary embedding under the parameter
names of the reference (`qwen_tts`'s `Qwen3TTSForConditionalGeneration`), so `model.safetensors` loads
with no renaming and `save_pretrained` writes a checkpoint the reference loads; the engine runs them on
packed weights (`omnimtp.runtime`), never through a module forward. The config is read from config.json
as a dict; `qwen_tts` is not imported.

    model = Qwen3TTSModel.from_pretrained(path)       # or tiny_qwen3_tts(seed)
    model.talker.text_projection(model.talker.model.text_embedding(ids))
"""

from __future__ import annotations

import copy
import json
import os

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer, Qwen3RMSNorm, Qwen3RotaryEmbedding

from omnimtp.models.tiny import THINKER_SPECIAL_TOKENS, THINKER_VOCAB_SIZE

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
GENERATION_CONFIG_NAME = "generation_config.json"
TTS_MODEL_TYPES = ("custom_voice", "voice_design", "base")
# what the released checkpoints' generation_config.json holds (the reference's `generate` defaults)
GENERATION_DEFAULTS = {
    "do_sample": True, "top_k": 50, "top_p": 1.0, "temperature": 0.9, "repetition_penalty": 1.05,
    "subtalker_dosample": True, "subtalker_top_k": 50, "subtalker_top_p": 1.0, "subtalker_temperature": 0.9,
    "max_new_tokens": 8192,
}


def decoder_config(config: dict) -> Qwen3Config:
    """A talker or code predictor config dict → the transformers `Qwen3Config` of its decoder layers.
    ValueError for what the packed runtime does not run (sliding windows, scaled RoPE, attention biases)."""
    if config.get("use_sliding_window"):
        raise ValueError("config: sliding-window attention is not supported")
    rope = dict(config.get("rope_scaling") or config.get("rope_parameters") or {})
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise ValueError(f"config: rope_type {rope.get('rope_type')!r} is not supported (only 'default')")
    rope_theta = config.get("rope_theta", rope.get("rope_theta", 10000.0))
    hidden_size, num_heads = config["hidden_size"], config["num_attention_heads"]
    return Qwen3Config(
        vocab_size=config["vocab_size"], hidden_size=hidden_size, intermediate_size=config["intermediate_size"],
        num_hidden_layers=config["num_hidden_layers"], num_attention_heads=num_heads,
        num_key_value_heads=config.get("num_key_value_heads", num_heads),
        head_dim=config.get("head_dim", hidden_size // num_heads), hidden_act=config.get("hidden_act", "silu"),
        max_position_embeddings=config.get("max_position_embeddings", 32768),
        rms_norm_eps=config.get("rms_norm_eps", 1e-6), attention_bias=config.get("attention_bias", False),
        rope_parameters={"rope_type": "default", "rope_theta": float(rope_theta)},
    )


class Decoder(nn.Module):
    """The decoder layers, final norm and rotary embedding (what `PackedDecoder.from_module` packs)."""

    def __init__(self, config: Qwen3Config):
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList(Qwen3DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(config)


class ResizeMLP(nn.Module):
    """The talker's `text_projection`: text width → talker width through one SiLU layer (with biases)."""

    def __init__(self, input_size: int, intermediate_size: int, output_size: int):
        super().__init__()
        self.linear_fc1 = nn.Linear(input_size, intermediate_size, bias=True)
        self.linear_fc2 = nn.Linear(intermediate_size, output_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(nn.functional.silu(self.linear_fc1(x)))


class CodePredictor(nn.Module):
    """Codebooks 1..G-1 of a frame: `model` (decoder + `codec_embedding`, G-1 tables [V, H_talker]),
    `lm_head` (G-1 heads) and `small_to_mtp_projection` (H_talker → H, Identity when they are equal)."""

    def __init__(self, config: dict, talker_hidden_size: int):
        super().__init__()
        self.config = decoder_config(config)
        self.config.num_code_groups = config["num_code_groups"]
        num_tables = self.config.num_code_groups - 1
        vocab_size, hidden_size = self.config.vocab_size, self.config.hidden_size
        self.model = Decoder(self.config)
        self.model.codec_embedding = nn.ModuleList(
            nn.Embedding(vocab_size, talker_hidden_size) for _ in range(num_tables)
        )
        self.lm_head = nn.ModuleList(nn.Linear(hidden_size, vocab_size, bias=False) for _ in range(num_tables))
        if hidden_size != talker_hidden_size:
            self.small_to_mtp_projection = nn.Linear(talker_hidden_size, hidden_size, bias=True)
        else:
            self.small_to_mtp_projection = nn.Identity()


class Talker(nn.Module):
    """The talker: `model` (decoder + `codec_embedding` [V, H] + `text_embedding` [V_text, D_text]),
    `text_projection` (D_text → H), `codec_head` (H → V) and `code_predictor`. `config`: its decoder's
    `Qwen3Config` with the codec fields of config.json's talker_config as attributes."""

    def __init__(self, config: dict):
        super().__init__()
        self.config = decoder_config(config)
        for name in ("num_code_groups", "codec_eos_token_id", "codec_think_id", "codec_nothink_id",
                     "codec_think_bos_id", "codec_think_eos_id", "codec_pad_id", "codec_bos_id"):
            setattr(self.config, name, config[name])
        hidden_size, text_hidden_size = self.config.hidden_size, config["text_hidden_size"]
        self.model = Decoder(self.config)
        self.model.codec_embedding = nn.Embedding(self.config.vocab_size, hidden_size)
        self.model.text_embedding = nn.Embedding(config["text_vocab_size"], text_hidden_size)
        self.text_projection = ResizeMLP(text_hidden_size, text_hidden_size, hidden_size)
        self.codec_head = nn.Linear(hidden_size, self.config.vocab_size, bias=False)
        self.code_predictor = CodePredictor(config["code_predictor_config"], hidden_size)

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.codec_embedding

    @property
    def device(self) -> torch.device:
        return self.codec_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.codec_head.weight.dtype


class Qwen3TTSModel(nn.Module):
    """A Qwen3-TTS checkpoint's talker (`talker`), a Base (voice-clone) checkpoint's ECAPA-TDNN
    `speaker_encoder` (`omnimtp.models.speaker_encoder.SpeakerEncoder`; None for the other kinds) and its
    config.json as a dict (`config`)."""

    def __init__(self, config: dict):
        super().__init__()
        if config.get("model_type") != "qwen3_tts":
            raise ValueError(f"config: model_type {config.get('model_type')!r}, expected 'qwen3_tts'")
        if config.get("tts_model_type") not in TTS_MODEL_TYPES:
            raise ValueError(
                f"config: tts_model_type {config.get('tts_model_type')!r}, expected one of {TTS_MODEL_TYPES}"
            )
        self.config = copy.deepcopy(config)
        self.talker = Talker(self.config["talker_config"])
        self.speaker_encoder = None
        self.has_released_linears = False  # see `release_decoder_linears`
        if self.config["tts_model_type"] == "base":
            # only a Base model has one: the others never import its blocks (Qwen2.5-Omni's ECAPA-TDNN)
            from omnimtp.models.speaker_encoder import SpeakerEncoder

            self.speaker_encoder = SpeakerEncoder(self.config.get("speaker_encoder_config") or {})
            if self.speaker_encoder.enc_dim != self.talker.config.hidden_size:
                raise ValueError(f"config: speaker_encoder_config.enc_dim {self.speaker_encoder.enc_dim} is not the "
                                 f"talker's hidden_size {self.talker.config.hidden_size}")

    @classmethod
    def from_pretrained(cls, path, dtype: torch.dtype | None = None) -> Qwen3TTSModel:
        """config.json and model.safetensors of a checkpoint directory (every talker weight required, and a
        Base checkpoint's speaker encoder weights)."""
        path = os.fspath(path)
        with open(os.path.join(path, CONFIG_NAME)) as f:
            config = json.load(f)
        with torch.device("meta"):
            model = cls(config)
        weights = load_file(os.path.join(path, WEIGHTS_NAME))
        prefixes = ("talker.", "speaker_encoder.") if model.speaker_encoder is not None else ("talker.",)
        state = {name: tensor for name, tensor in weights.items() if name.startswith(prefixes)}
        missing = sorted(set(model.state_dict()) - set(state))
        unexpected = sorted(set(state) - set(model.state_dict()))
        if missing or unexpected:
            raise ValueError(f"path: {path!r}: model.safetensors does not match config.json (missing {missing[:4]}, "
                             f"unexpected {unexpected[:4]})")
        model.load_state_dict(state, assign=True)
        model._restore_rope()
        if dtype is not None:
            model = model.to(dtype)
        return model.eval()

    def restore_buffers(self) -> None:
        """What is not stored in the checkpoint, computed again on the weights' device (the rotary tables)."""
        self._restore_rope()

    def _restore_rope(self) -> None:
        """The rotary tables (buffers that are not in the file), computed again on the weights' device."""
        for decoder in (self.talker.model, self.talker.code_predictor.model):
            with torch.device(self.talker.device):
                decoder.rotary_emb = Qwen3RotaryEmbedding(decoder.config)

    def decoder_linears(self) -> list[nn.Linear]:
        """The linears a quantized runtime holds its own copies of: the talker's and code predictor's decoder
        layers' (q/k/v/o, gate/up/down) and the code predictor's G-1 lm_heads."""
        names = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
                 "mlp.up_proj", "mlp.down_proj")
        return [layer.get_submodule(name) for decoder in (self.talker.model, self.talker.code_predictor.model)
                for layer in decoder.layers for name in names] + list(self.talker.code_predictor.lm_head)

    def copy_other_weights(self) -> None:
        """Every parameter and buffer but the decoder linears' gets memory of its own (a copy). `from_pretrained`
        reads views of the mapped weights file, and one live view keeps every page of it that was read resident:
        with the others copied before the runtime packs them, releasing the linears (`release_decoder_linears`)
        unmaps the file."""
        linear_weights = {id(linear.weight) for linear in self.decoder_linears()}
        with torch.no_grad():
            for tensor in [*self.parameters(), *self.buffers()]:
                if id(tensor) not in linear_weights:
                    tensor.data = tensor.data.clone()

    def release_decoder_linears(self) -> None:
        """Frees the decoder linears' matrices (`decoder_linears`) for a runtime that holds its own (quantized)
        copies: each becomes a zero-stride placeholder, its shape, dtype and device kept, no data (every element
        reads 0). Embeddings, heads, norms and projections stay. The model can no longer be saved
        (`save_pretrained` raises ValueError) nor packed again."""
        release_matrices(self.decoder_linears())
        self.has_released_linears = True

    def save_pretrained(self, path) -> None:
        """config.json, generation_config.json and model.safetensors in the released layout."""
        if self.has_released_linears:
            raise ValueError("model: its decoder matrices were released for quantized weights; save the "
                             "checkpoint it was loaded from instead")
        path = os.fspath(path)
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, CONFIG_NAME), "w") as f:
            json.dump(self.config, f, indent=2)
        with open(os.path.join(path, GENERATION_CONFIG_NAME), "w") as f:
            json.dump(GENERATION_DEFAULTS, f, indent=2)
        tensors = {name: tensor.detach().contiguous() for name, tensor in self.state_dict().items()}
        save_file(tensors, os.path.join(path, WEIGHTS_NAME), metadata={"format": "pt"})


def release_matrices(linears) -> None:
    """Each linear's matrix becomes a zero-stride placeholder (its shape, dtype and device kept, no data: every
    element reads 0), for a runtime that holds its own (quantized) copies."""
    for linear in linears:
        weight = linear.weight
        placeholder = torch.zeros((), dtype=weight.dtype, device=weight.device).expand(weight.shape)
        linear.weight = nn.Parameter(placeholder, requires_grad=False)


# --- the tiny seeded model ------------------------------------------------------------------------------

# The released Qwen3-TTS-12Hz-0.6B's widths (its predictor has the talker's width: no input projection).
QWEN3_TTS_0_6B_TALKER = dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                             num_key_value_heads=8, head_dim=128, text_hidden_size=2048)
QWEN3_TTS_0_6B_PREDICTOR = dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=5, num_attention_heads=16,
                                num_key_value_heads=8, head_dim=128)

TINY_CODEBOOK_SIZE = 128
# codec specials sit in the suppressed top 1024 ids, as in the released vocab (codebook 2048 + 1024)
TINY_CODEC_IDS = {
    "codec_pad_id": TINY_CODEBOOK_SIZE + 100, "codec_bos_id": TINY_CODEBOOK_SIZE + 101,
    "codec_eos_token_id": TINY_CODEBOOK_SIZE + 102, "codec_think_id": TINY_CODEBOOK_SIZE + 106,
    "codec_nothink_id": TINY_CODEBOOK_SIZE + 107, "codec_think_bos_id": TINY_CODEBOOK_SIZE + 108,
    "codec_think_eos_id": TINY_CODEBOOK_SIZE + 109,
}
# CustomVoice: two speakers and a dialect speaker (spoken in its dialect for Chinese or auto), as released
TINY_SPEAKERS = {
    "aiden": TINY_CODEBOOK_SIZE + 200, "vivian": TINY_CODEBOOK_SIZE + 201, "eric": TINY_CODEBOOK_SIZE + 202
}
TINY_DIALECTS = {"aiden": False, "vivian": False, "eric": "sichuan_dialect"}
TINY_LANGUAGES = {"english": TINY_CODEBOOK_SIZE + 150, "chinese": TINY_CODEBOOK_SIZE + 151,
                  "sichuan_dialect": TINY_CODEBOOK_SIZE + 152}


# a narrow ECAPA-TDNN (Res2Net scale 8 splits its 32 channels into 4s) with the released kernels and dilations
TINY_SPEAKER_ENCODER = {"mel_dim": 128, "enc_channels": [32, 32, 32, 32, 96], "enc_kernel_sizes": [5, 3, 3, 3, 1],
                        "enc_dilations": [1, 2, 3, 4, 1], "enc_attention_channels": 16, "enc_res2net_scale": 8,
                        "enc_se_channels": 16, "sample_rate": 24_000}


def tiny_config(tts_model_type: str = "custom_voice", *, talker_hidden_size: int = 64, predictor_hidden_size: int = 32,
                num_layers: int = 2, initializer_range: float = 0.2, talker: dict | None = None,
                predictor: dict | None = None) -> dict:
    """A tiny config.json of the released structure (16 codebooks, codec vocab = codebook + 1024, the byte
    tokenizer's specials as the text ids). custom_voice: tts_model_size "0b6" (takes no instructions);
    voice_design: "1b7", no speakers; base: "0b6", no speakers, a tiny ECAPA-TDNN speaker encoder whose
    x-vector has the talker's width (`TINY_SPEAKER_ENCODER`). The predictor is narrower than the talker, so its
    input projection is a Linear, as in the released 1.7B models. talker, predictor: overrides of their config
    entries (e.g. `QWEN3_TTS_0_6B_TALKER`, `QWEN3_TTS_0_6B_PREDICTOR` for the released 0.6B widths)."""
    if tts_model_type not in TTS_MODEL_TYPES:
        raise ValueError(f"tts_model_type must be one of {TTS_MODEL_TYPES}, got {tts_model_type!r}")
    is_custom = tts_model_type == "custom_voice"
    common = {"initializer_range": initializer_range, "rms_norm_eps": 1e-6, "rope_theta": 1_000_000.0,
              "hidden_act": "silu", "max_position_embeddings": 4096}
    predictor = {**common, "vocab_size": TINY_CODEBOOK_SIZE, "hidden_size": predictor_hidden_size,
                 "intermediate_size": 2 * predictor_hidden_size, "num_hidden_layers": num_layers,
                 "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "num_code_groups": 16,
                 **(predictor or {})}
    talker_overrides = talker or {}
    talker = {
        **common, "vocab_size": TINY_CODEBOOK_SIZE + 1024, "hidden_size": talker_hidden_size,
        "intermediate_size": 2 * talker_hidden_size, "num_hidden_layers": num_layers, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "num_code_groups": 16, "text_hidden_size": 48,
        "text_vocab_size": THINKER_VOCAB_SIZE,
        "rope_scaling": {"rope_type": "default", "mrope_section": [2, 3, 3], "interleaved": True},
        **TINY_CODEC_IDS,
        "spk_id": dict(TINY_SPEAKERS) if is_custom else {},
        "spk_is_dialect": dict(TINY_DIALECTS) if is_custom else {},
        "codec_language_id": dict(TINY_LANGUAGES),
        "code_predictor_config": predictor,
        **talker_overrides,
    }
    config = {
        "model_type": "qwen3_tts", "architectures": ["Qwen3TTSForConditionalGeneration"],
        "tts_model_type": tts_model_type, "tts_model_size": "1b7" if tts_model_type == "voice_design" else "0b6",
        "tokenizer_type": "qwen3_tts_tokenizer_12hz",
        "im_start_token_id": THINKER_SPECIAL_TOKENS["<|im_start|>"],
        "im_end_token_id": THINKER_SPECIAL_TOKENS["<|im_end|>"],
        "tts_pad_token_id": THINKER_SPECIAL_TOKENS["<|tts_pad|>"],
        "tts_bos_token_id": THINKER_SPECIAL_TOKENS["<|tts_bos|>"],
        "tts_eos_token_id": THINKER_SPECIAL_TOKENS["<|tts_eos|>"],
        "talker_config": talker,
    }
    if tts_model_type == "base":
        config["speaker_encoder_config"] = {**TINY_SPEAKER_ENCODER, "enc_dim": talker["hidden_size"]}
    return config


def tiny_qwen3_tts(seed: int = 0, tts_model_type: str = "custom_voice", **config_options) -> Qwen3TTSModel:
    """A seeded tiny Qwen3-TTS (`tiny_config`): matrices and tables drawn N(0, initializer_range²) so greedy
    argmax stays away from ties, biases and norms as the reference initializes them (zeros, ones). A Base
    model's speaker encoder convolutions get unit gain (std 1/√fan-in, zero bias), so different recordings
    give different x-vectors, its last one scaled to the codec embeddings' level."""
    config = tiny_config(tts_model_type, **config_options)
    std = config["talker_config"]["initializer_range"]
    generator = torch.Generator().manual_seed(seed)
    model = Qwen3TTSModel(config)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                module.weight.copy_(torch.randn(module.weight.shape, generator=generator) * std)
                if getattr(module, "bias", None) is not None:
                    module.bias.zero_()
        if model.speaker_encoder is not None:
            for module in model.speaker_encoder.modules():
                if isinstance(module, nn.Conv1d):
                    module.weight.copy_(
                        torch.randn(module.weight.shape, generator=generator) / module.weight[0].numel() ** 0.5
                    )
                    module.bias.zero_()
            model.speaker_encoder.fc.weight.mul_(std)
    return model.eval()
