"""Quantized checkpoints on disk: `omnimtp quantize SRC DST --quantize MODE` writes one, and
`OmniPipeline.from_pretrained(DST)` loads it memory-mapped, with no float copy of what it quantized.

    quantize_checkpoint("Qwen3-Omni-30B-A3B-Instruct", "qwen3-omni-w4a8", "w4a8")
    pipe = OmniPipeline.from_pretrained("qwen3-omni-w4a8")        # the same greedy output as quantizing at load

What DST holds (format 1; docs/quantization.md has the same in prose):
- config.json: SRC's, plus `"omnimtp_quantization": {"format": 1, "mode": MODE, "decoders": {prefix: layers},
  "files": {name: bytes}}`: the decoders whose layers are quantized (the transformers module paths the family
  packs) and every safetensors file with its size (a truncated or missing file is refused, naming it);
- `model-NNNNN.safetensors`: every tensor the model keeps as it is (embeddings, heads, norms, routers, encoders,
  the code predictor, the codec), under the transformers model's own parameter names, in SRC's dtypes;
- `quantized-NNNNN.safetensors`: per decoder layer the packed decoder's quantized matrices
  (`omnimtp.runtime.decoder.quantized_matrices`) as `{prefix}.layers.{i}.{matrix}.packed` and `.scales`, in the
  kernel's layout, each weight's out_features, group size and int8-activation flag in the file's "omnimtp"
  metadata (JSON);
- every other file of SRC as it is (tokenizer, processor, chat template, generation config, speakers);
- an MTP family's checkpoint (a causal LM with its NextN layer, `MTP_DECODERS`): `mtp-NNNNN.safetensors`, the NextN
  layer's tensors as SRC stores them (float: the head drafts in float), which transformers' causal-LM class does
  not load and `MTPHead.from_pretrained` reads; `load_quantized_target_and_head` (what
  `omnimtp.mtp.load.load_target_and_head` calls for such a directory) gives the target whose packed decoder holds
  the stored matrices (`packed_target.stored_packed_target`) and its float head.

The converter reads SRC's safetensors memory-mapped and never builds the float model: it makes the model's
skeleton on the meta device, finds each of its parameters' source tensors by transformers' own checkpoint
renamings and converters (`conversion_mapping`: per-expert tensors merged into the fused expert matrices), loads one
decoder layer at a time, packs and quantizes it as `PackedDecoder.from_module(quantize=)` does, writes it and drops
it; the rest is copied tensor by tensor. Its peak memory is a constant plus about one layer (the largest tensors),
not the model. The loader builds the skeleton on the meta device too, assigns the memory-mapped float tensors to it,
recomputes the non-persistent buffers as transformers does, and hands the stored matrices to the packed decoders:
the quantized layers' float weights never exist.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import zlib
from dataclasses import dataclass, replace

import torch

from omnimtp.checkpoint import MODEL_TYPES, omni_model_type
from omnimtp.families import FAMILIES, family_class
from omnimtp.runtime.decoder import QUANTIZED_MATRICES, pack_layer, quantized_matrices
from omnimtp.runtime.device import return_free_memory
from omnimtp.runtime.ops import QUANTIZE_MODES, QuantizedWeight, check_quantize

FORMAT = 1
CONFIG_KEY = "omnimtp_quantization"
# a decoder layer's parameters that its quantized matrices replace (the rest of a layer stays float)
_QUANTIZED_PARAMETER = re.compile(
    r"\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj|mlp\.shared_experts?\.(gate|up|down)_proj)\.weight$"
    r"|\.mlp\.experts\.(gate_up_proj|down_proj)$"
)
SHARD_BYTES = 2 << 30  # a DST file holds up to this many bytes (one tensor larger than it gets a file of its own)

# the MTP families (speculative decoding's targets): their causal LM's decoder, as `packed_target` packs it
MTP_DECODERS = {"glm4_moe": ("model",)}
MTP_STEM = "mtp"  # DST's files of the NextN layer's float tensors


def is_quantized_checkpoint(path) -> bool:
    """Whether the directory at `path` is a quantized checkpoint (its config.json has CONFIG_KEY)."""
    config_path = os.path.join(os.fspath(path), "config.json")
    if not os.path.isfile(config_path):
        return False
    with open(config_path) as f:
        return CONFIG_KEY in json.load(f)


# --- reading SRC ----------------------------------------------------------------------------------------------


@dataclass
class _Source:
    file: str
    key: str
    pattern: str | None  # the transformers converter's source pattern this key matched, if any


class _SourceTensors:
    """SRC's tensors, memory-mapped, by the parameter name of the model they load into (`materialize`). The files
    stay mapped until `release` (a touched page of a mapping counts in the process's memory while it is mapped)."""

    def __init__(self, model, path: str):
        from safetensors import safe_open
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

        files = sorted(name for name in os.listdir(path) if name.endswith(".safetensors"))
        if not files:
            raise ValueError(f"src: {path!r} has no .safetensors files")
        # a transformers model's checkpoint keys go through its renamings and converters; omnimtp's own models
        # (Qwen3-TTS) store every tensor under its parameter name
        is_transformers = hasattr(model, "base_model_prefix")
        transforms = get_model_conversion_mapping(model) if is_transformers else []
        renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
        self.converters = [t for t in transforms if isinstance(t, WeightConverter)]
        meta_state = model.state_dict()
        self.path, self.handles = path, {}
        self.sources: dict[str, list[_Source]] = {}
        for name in files:
            with safe_open(os.path.join(path, name), "pt") as handle:
                keys = list(handle.keys())
            for key in keys:
                target, pattern = key, None
                if is_transformers:
                    target, pattern = rename_source_key(key, renamings, self.converters, model.base_model_prefix,
                                                        meta_state)
                self.sources.setdefault(target, []).append(_Source(name, key, pattern))
        missing = sorted(set(meta_state) - set(self.sources) - set(tied_aliases(model)))
        if missing:
            raise ValueError(f"src: {path!r} lacks {len(missing)} of the model's tensors, e.g. {missing[0]!r}")

    def materialize(self, name: str) -> torch.Tensor:
        """The model's parameter `name` from its source tensors: one tensor as stored, or a converter's merge of
        per-expert tensors (stacked over the expert index, concatenated over the converter's source patterns)."""
        sources = self.sources[name]
        if len(sources) == 1 and sources[0].pattern is None:
            return self._get(sources[0])
        num_experts = 1 + max(_expert_index(s) for s in sources)
        return torch.stack([self.expert(name, index) for index in range(num_experts)])

    def expert(self, name: str, index: int) -> torch.Tensor:
        """Expert `index`'s slice of the fused expert parameter `name` ([E, ...] → [...]), reading that expert's
        source tensors only."""
        from transformers.core_model_loading import Concatenate, MergeModulelist

        sources = self.sources[name]
        if len(sources) == 1 and sources[0].pattern is None:
            return self._get(sources[0])[index]
        converter = next(c for c in self.converters if sources[0].pattern in c.source_patterns)
        merge = [op for op in converter.operations if isinstance(op, MergeModulelist)]
        concat = [op for op in converter.operations if isinstance(op, Concatenate)]
        if (len(merge) != 1 or merge[0].dim != 0 or len(concat) > 1
                or len(merge) + len(concat) != len(converter.operations)):  # only a stack of experts (+ a concat)
            raise ValueError(f"src: {name!r} is converted by {converter.operations}, which omnimtp cannot apply")
        parts = [self._get(next(s for s in sources if s.pattern == pattern and _expert_index(s) == index))
                 for pattern in converter.source_patterns]
        return parts[0] if not concat else torch.cat(parts, dim=concat[0].dim - 1)  # the stack's axis is gone

    def _get(self, source: _Source) -> torch.Tensor:
        from safetensors import safe_open

        if source.file not in self.handles:
            self.handles[source.file] = safe_open(os.path.join(self.path, source.file), "pt")
        return self.handles[source.file].get_tensor(source.key)

    def release(self) -> None:
        """Closes the files: their mappings go once no tensor read from them is left."""
        self.handles = {}


class _ExpertStack:
    """A fused expert parameter [E, N, K] of SRC read one expert at a time, for `ops.quantize_experts` (which
    indexes experts one by one): the converter never holds a layer's float experts at once."""

    def __init__(self, source: _SourceTensors, name: str, shape: torch.Size):
        self.source, self.name, self.shape = source, name, shape

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.source.expert(self.name, index)


def _expert_index(source: _Source) -> int:
    match = re.search(r"\.experts\.(\d+)\.", source.key)
    return -1 if match is None else int(match.group(1))


# --- writing DST --------------------------------------------------------------------------------------------------


class _ShardWriter:
    """Tensors written to `{stem}-NNNNN.safetensors` files of up to SHARD_BYTES each, as they come."""

    def __init__(self, directory: str, stem: str, shard_bytes: int):
        self.directory, self.stem, self.shard_bytes = directory, stem, shard_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.metadata: dict[str, list] = {}
        self.pending_bytes = 0
        self.files: dict[str, int] = {}

    def add(self, name: str, tensor: torch.Tensor, metadata: list | None = None) -> None:
        size = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + size > self.shard_bytes:
            self.flush()
        self.pending[name] = tensor.detach().contiguous()
        self.pending_bytes += size
        if metadata is not None:
            self.metadata[name] = metadata

    def flush(self) -> None:
        from safetensors.torch import save_file

        if not self.pending:
            return
        name = f"{self.stem}-{len(self.files) + 1:05d}.safetensors"
        metadata = {"format": "pt"}
        if self.metadata:
            metadata["omnimtp"] = json.dumps(self.metadata)
        path = os.path.join(self.directory, name)
        save_file(self.pending, path, metadata=metadata)
        os.chmod(path, 0o666 & ~_umask())  # safetensors writes 0600: as readable as the directory's other files
        self.files[name] = os.path.getsize(path)
        self.pending, self.metadata, self.pending_bytes = {}, {}, 0


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _meta_model(path: str, model_type: str):
    """The model of the checkpoint at `path` (transformers', or omnimtp's own Qwen3-TTS model; an MTP family's causal
    LM), built on the meta device (no memory)."""
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    if model_type in MTP_DECODERS:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))

    own = _own_model_class(model_type)
    if own is not None:
        with open(os.path.join(path, "config.json")) as f:
            config = json.load(f)
        config.pop(CONFIG_KEY, None)
        with torch.device("meta"):
            return own(config)
    config = AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        return getattr(transformers, MODEL_TYPES[model_type])(config)


def _own_model_class(model_type: str):
    """omnimtp's own model class of a model type (built from config.json's dict, tensors under their parameter
    names, `restore_buffers` for what is not stored), or None for a transformers model."""
    if model_type == "qwen3_tts":
        from omnimtp.models.qwen3_tts import Qwen3TTSModel

        return Qwen3TTSModel
    if model_type == "qwen3_asr":
        from omnimtp.models.qwen3_asr import Qwen3ASRModel

        return Qwen3ASRModel
    return None


def tied_aliases(model) -> dict[str, str]:
    """Parameter names that are another name of an earlier parameter (a tied LM head) → that earlier name: stored
    once, under the first name, and tied again at load."""
    first, aliases = {}, {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        if id(parameter) in first:
            aliases[name] = first[id(parameter)]
        else:
            first[id(parameter)] = name
    return aliases


def _is_quantized_parameter(name: str, decoders: tuple[str, ...]) -> bool:
    return any(name.startswith(prefix + ".layers.") for prefix in decoders) and bool(_QUANTIZED_PARAMETER.search(name))


def _check_destination(quantize: str, dst: str) -> None:
    if quantize not in QUANTIZE_MODES:
        raise ValueError(f"quantize must be one of {QUANTIZE_MODES}, got {quantize!r}")
    check_quantize(quantize, "cpu")
    if os.path.exists(dst) and (not os.path.isdir(dst) or os.listdir(dst)):
        raise ValueError(f"dst: {dst!r} exists and is not an empty directory")


def quantize_checkpoint(src, dst, quantize: str, *, shard_bytes: int = SHARD_BYTES) -> dict:
    """Writes the quantized checkpoint of SRC (a Qwen3-Omni, Qwen2.5-Omni, Qwen3-TTS or Qwen3-ASR checkpoint) into
    DST (a new or empty directory) in mode `quantize` (module docstring). Returns what it wrote: {"mode",
    "decoders": {prefix: layers}, "files": {name: bytes}}. ValueError naming `quantize` for a mode not in
    QUANTIZE_MODES or without a kernel here, `src` for a checkpoint it cannot convert, `dst` for a directory that is
    not empty. An MTP family's checkpoint (`MTP_DECODERS`) is converted too, its NextN layer copied float."""
    src, dst = os.fspath(src), os.fspath(dst)
    _check_destination(quantize, dst)
    if _mtp_model_type(src) is not None:
        return _quantize_mtp_checkpoint(src, dst, quantize, shard_bytes)
    _check_convertible(src)
    model_type = omni_model_type(src, "src")
    if not os.path.isdir(src):  # a built-in tiny model's name: made in memory, not read from files
        raise ValueError(f"src: {src!r} is a built-in model, not a checkpoint directory: save it first "
                         "(OmniPipeline.from_pretrained(name).save_pretrained(DIR)), then quantize DIR")
    if model_type not in FAMILIES:
        raise ValueError(f"src: a {model_type!r} checkpoint; omnimtp quantize converts "
                         f"{sorted({**FAMILIES, **MTP_DECODERS})}")
    if is_quantized_checkpoint(src):
        raise ValueError(f"src: {src!r} is already quantized")
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    model = _meta_model(src, model_type)
    if getattr(model, "is_aligner", False):
        raise ValueError(f"src: {src!r} is a Qwen3-ForcedAligner, which omnimtp quantize does not convert (serve it "
                         "with --aligner-model and --quantize)")
    decoder_paths = family_class(model_type).decoder_paths
    summary = _write(model, _SourceTensors(model, src), dst, quantize, decoder_paths, config, shard_bytes)
    _copy_other_files(src, dst)
    return summary


def _copy_other_files(src: str, dst: str) -> None:
    """Every file of SRC but its weights, its index and config.json (tokenizer, processor, speakers, ...)."""
    for entry in os.listdir(src):
        if entry.endswith(".safetensors") or entry in ("config.json", "model.safetensors.index.json"):
            continue
        from_path, to_path = os.path.join(src, entry), os.path.join(dst, entry)
        if os.path.isdir(from_path):
            shutil.copytree(from_path, to_path)
        else:
            shutil.copy2(from_path, to_path)


def _check_convertible(src: str) -> None:
    """ValueError naming `src` for a checkpoint whose model type no family here converts (the MTP families' too)."""
    config_path = os.path.join(src, "config.json")
    if not os.path.isfile(config_path):
        return  # a built-in name or no checkpoint at all: `omni_model_type` says which
    with open(config_path) as f:
        model_type = json.load(f).get("model_type")
    if model_type not in FAMILIES and model_type not in MTP_DECODERS:
        raise ValueError(f"src: a {model_type!r} checkpoint; omnimtp quantize converts "
                         f"{sorted({**FAMILIES, **MTP_DECODERS})}")


def _mtp_model_type(path: str) -> str | None:
    """config.json's model_type of the checkpoint at `path` where it is an MTP family's (`MTP_DECODERS`), else None."""
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        return None
    with open(config_path) as f:
        model_type = json.load(f).get("model_type")
    return model_type if model_type in MTP_DECODERS else None


def _quantize_mtp_checkpoint(src: str, dst: str, quantize: str, shard_bytes: int) -> dict:
    """`quantize_checkpoint` of an MTP family's checkpoint: the causal LM as the omni families' models are written
    (its decoder layers quantized, the rest float), and the NextN layer's tensors copied as they are into
    `mtp-NNNNN.safetensors` (listed with the other files in config.json)."""
    from safetensors import safe_open

    from omnimtp.mtp.head import MTPHead

    if is_quantized_checkpoint(src):
        raise ValueError(f"src: {src!r} is already quantized")
    model_type = _mtp_model_type(src)
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    model = _meta_model(src, model_type)
    source = _SourceTensors(model, src)
    summary = _write(model, source, dst, quantize, MTP_DECODERS[model_type], config, shard_bytes)
    with torch.device("meta"):
        prefix = MTPHead(model).checkpoint_prefix  # where the NextN layer's tensors are stored
    mtp = _ShardWriter(dst, MTP_STEM, shard_bytes)
    for name in sorted(entry for entry in os.listdir(src) if entry.endswith(".safetensors")):
        with safe_open(os.path.join(src, name), "pt") as handle:
            for key in handle.keys():
                if key.startswith(prefix):
                    mtp.add(key, handle.get_tensor(key))
        mtp.flush()
    summary["files"].update(mtp.files)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump({**config, CONFIG_KEY: summary}, f, indent=2)
    _copy_other_files(src, dst)
    return summary


class _RandomTensors:
    """`_SourceTensors`' reads for a checkpoint that does not exist: seeded normal weights (std 0.02, as transformers
    initialises linears and embeddings; norms 1), each drawn when read, in `dtype` (float32 under the module
    prefixes `float32_prefixes`: parts that compute in float32 only). zero_rows_from: {name: row}: that tensor's
    rows from `row` on are zeros."""

    def __init__(self, model, seed: int, dtype: torch.dtype, float32_prefixes: tuple[str, ...] = (),
                 zero_rows_from: dict[str, int] | None = None):
        self.shapes = {name: tensor.shape for name, tensor in model.state_dict().items()}
        self.dtypes = {name: tensor.dtype for name, tensor in model.state_dict().items()}
        self.seed, self.dtype, self.float32_prefixes = seed, dtype, float32_prefixes
        self.zero_rows_from = zero_rows_from or {}

    def materialize(self, name: str) -> torch.Tensor:
        if not self.dtypes[name].is_floating_point:  # counters and indices of the codec's buffers
            return torch.zeros(self.shapes[name], dtype=self.dtypes[name])
        if re.search(r"norm[^.]*\.weight$|layernorm\.weight$", name):
            return torch.ones(self.shapes[name], dtype=self._dtype(name))
        tensor = self._draw(name, self.shapes[name])
        if name in self.zero_rows_from:
            tensor[self.zero_rows_from[name]:] = 0
        return tensor

    def expert(self, name: str, index: int) -> torch.Tensor:
        return self._draw(f"{name}.{index}", self.shapes[name][1:])

    def _dtype(self, name: str) -> torch.dtype:
        return torch.float32 if name.startswith(self.float32_prefixes) else self.dtype

    def _draw(self, name: str, shape) -> torch.Tensor:
        generator = torch.Generator().manual_seed(self.seed + zlib.crc32(name.encode()))
        return (torch.randn(shape, generator=generator) * 0.02).to(self._dtype(name))

    def release(self) -> None:
        """Nothing is mapped: `_SourceTensors.release`'s counterpart."""


def random_quantized_checkpoint(config, dst, quantize: str, *, seed: int = 0, dtype: torch.dtype = torch.bfloat16,
                                shard_bytes: int = SHARD_BYTES) -> dict:
    """A seeded random-weight checkpoint of a Qwen3-Omni or Qwen2.5-Omni `config` (a config.json's dict, e.g. a
    released one) written straight into DST in the quantized format, one layer and one tensor at a time: a model of
    any size is built without its float weights ever existing (what `benchmarks/omni_realsize.py` measures the
    released sizes with). Float tensors in `dtype` (Qwen2.5-Omni's token2wav in float32, the only dtype it computes
    in); a Qwen2.5-Omni gets its speakers (`random_speakers`, spk_dict.pt) and a generation_config.json with its
    thinker EOS, and its talker emits only codes token2wav reads. Returns `quantize_checkpoint`'s summary."""
    dst = os.fspath(dst)
    _check_destination(quantize, dst)
    model_type = config.get("model_type")
    if model_type not in FAMILIES:
        raise ValueError(f"config: model_type {model_type!r}; supported: {sorted(FAMILIES)}")
    os.makedirs(dst, exist_ok=True)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f)
    model = _meta_model(dst, model_type)
    os.remove(os.path.join(dst, "config.json"))
    decoder_paths = family_class(model_type).decoder_paths
    float32_prefixes, zero_rows_from = (), {}
    if model_type == "qwen2_5_omni":
        # token2wav computes in float32 only (transformers'): stored so, no cast copy at load. The talker's codec
        # head scores 8448 ids, of which token2wav reads the first `num_embeds + 1` (the rest are specials a trained
        # talker emits only as its EOS): random rows there would win now and then, zero rows never do
        float32_prefixes = ("token2wav.",)
        zero_rows_from = {"talker.codec_head.weight": model.config.token2wav_config.dit_config.num_embeds + 1}
    summary = _write(model, _RandomTensors(model, seed, dtype, float32_prefixes, zero_rows_from), dst, quantize,
                     decoder_paths, config, shard_bytes)
    if model_type == "qwen2_5_omni":  # its speakers and thinker EOS live beside the weights
        torch.save(random_speakers(model.config, seed), os.path.join(dst, "spk_dict.pt"))
        vocab = model.config.thinker_config.text_config.vocab_size
        with open(os.path.join(dst, "generation_config.json"), "w") as f:
            json.dump({"eos_token_id": min(QWEN_IM_END, vocab - 1)}, f)
    return summary


RANDOM_SPEAKERS = ("Chelsie", "Ethan")
# <|im_end|> in Qwen's tokenizers: a random Qwen2.5-Omni's thinker EOS (its vocabulary's last id if that is smaller)
QWEN_IM_END = 151645
RANDOM_REF_MEL_FRAMES = 300


def random_speakers(config, seed: int) -> dict:
    """Seeded speakers of a Qwen2.5-Omni `config` in spk_dict.pt's layout (`{name: {"bos_token", "cond",
    "ref_mel"}}`): per name a thinker id from the top of its vocabulary, a normal `cond` [enc_emb_dim] and a normal
    `ref_mel` [1, RANDOM_REF_MEL_FRAMES, mel_dim]."""
    dit = config.token2wav_config.dit_config
    vocab = config.thinker_config.text_config.vocab_size
    generator = torch.Generator().manual_seed(seed)
    return {name: {"bos_token": vocab - 1 - index, "cond": torch.randn(dit.enc_emb_dim, generator=generator),
                   "ref_mel": torch.randn(1, RANDOM_REF_MEL_FRAMES, dit.mel_dim, generator=generator)}
            for index, name in enumerate(RANDOM_SPEAKERS)}


def _write(model, source, dst: str, quantize: str, decoders: tuple[str, ...], config: dict, shard_bytes: int) -> dict:
    """The quantized checkpoint of `model` (on the meta device) with its tensors from `source`, into DST."""
    os.makedirs(dst, exist_ok=True)
    quantized = _ShardWriter(dst, "quantized", shard_bytes)
    with torch.no_grad():
        for prefix in decoders:
            decoder = model.get_submodule(prefix)
            # packed in the dtype `PackedDecoder.from_module` packs a loaded model in: its first parameter's
            first = next(name for name, _ in decoder.named_parameters())
            dtype = source.materialize(f"{prefix}.{first}").dtype  # (read lazily: nothing is touched)
            for index, layer in enumerate(decoder.layers):
                stem = f"{prefix}.layers.{index}."
                params = dict(layer.named_parameters())
                experts = {name: param for name, param in params.items() if name.startswith("mlp.experts.")}
                layer.load_state_dict(  # the routed experts stay on the meta device: read one by one below
                    {name: source.materialize(stem + name) for name in params if name not in experts}, strict=False,
                    assign=True,
                )
                packed = pack_layer(layer, decoder.config, dtype)
                if experts:
                    packed = replace(
                        packed, expert_gate_up=_ExpertStack(source, stem + "mlp.experts.gate_up_proj",
                                                            experts["mlp.experts.gate_up_proj"].shape),
                        expert_down=_ExpertStack(source, stem + "mlp.experts.down_proj",
                                                 experts["mlp.experts.down_proj"].shape),
                    )
                matrices = quantized_matrices(packed, quantize)
                for matrix, weight in matrices.items():
                    if weight is not None:
                        meta = [weight.out_features, weight.group_size, weight.int8_activations]
                        quantized.add(f"{stem}{matrix}.packed", weight.packed, meta)
                        quantized.add(f"{stem}{matrix}.scales", weight.scales)
                layer.to("meta")  # its float tensors go, and with the files closed their mapped pages
                del matrices
                source.release()
                return_free_memory()  # the temporaries of packing and quantizing, freed but held by the heap
    quantized.flush()
    floats = _ShardWriter(dst, "model", shard_bytes)
    aliases = tied_aliases(model)
    for name in model.state_dict():
        if not _is_quantized_parameter(name, decoders) and name not in aliases:
            written = len(floats.files)
            floats.add(name, source.materialize(name))
            if len(floats.files) != written:  # a file was written: the tensors it held are gone
                source.release()
    floats.flush()
    summary = {"format": FORMAT, "mode": quantize,
               "decoders": {prefix: len(model.get_submodule(prefix).layers) for prefix in decoders},
               "files": {**floats.files, **quantized.files}}
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump({**config, CONFIG_KEY: summary}, f, indent=2)
    return summary


# --- loading DST --------------------------------------------------------------------------------------------------


@dataclass
class QuantizedModel:
    """A quantized checkpoint loaded: the transformers model (the weights its quantized layers replace are
    zero-stride placeholders: shapes, no data), the mode, and per decoder prefix each layer's stored
    `quantized_matrices` (`PackedDecoder.from_module(stored=)`)."""

    model: torch.nn.Module
    mode: str
    stored: dict[str, list[dict[str, QuantizedWeight | None]]]


def load_quantized_model(path, quantize: str | None = None, dtype: torch.dtype | None = None) -> QuantizedModel:
    """The quantized checkpoint at `path` (`quantize_checkpoint`), memory-mapped. quantize: None or the checkpoint's
    own mode; another is a ValueError naming `quantize`. dtype: the float tensors as stored (None), or cast copies
    in `dtype` (the stored quantized matrices are what they are; the decoders then compute in `dtype`). A checkpoint
    of another format, a missing, truncated or foreign file is a ValueError naming the file."""
    from safetensors import SafetensorError, safe_open
    from transformers.modeling_utils import _load_parameter_into_model

    path = os.fspath(path)
    with open(os.path.join(path, "config.json")) as f:
        section = json.load(f)[CONFIG_KEY]
    if section.get("format") != FORMAT:
        raise ValueError(f"path: {path!r} is a quantized checkpoint of format {section.get('format')!r}; this "
                         f"omnimtp reads format {FORMAT}")
    mode = section["mode"]
    if quantize is not None and quantize != mode:
        raise ValueError(f"quantize={quantize!r}: {path!r} holds {mode!r} weights (quantize with "
                         f"`omnimtp quantize` again from the float checkpoint for another mode)")
    check_quantize(mode, "cpu")
    for name, size in section["files"].items():
        file = os.path.join(path, name)
        if not os.path.isfile(file) or os.path.getsize(file) != size:
            found = os.path.getsize(file) if os.path.isfile(file) else "missing"
            raise ValueError(f"{file}: expected {size} bytes, found {found} (a truncated or replaced file)")
    model_type = _mtp_model_type(path) or omni_model_type(path)
    decoders = tuple(section["decoders"])
    model = _meta_model(path, model_type)
    floats, stored_tensors, stored_meta = {}, {}, {}
    for name in section["files"]:
        if name.startswith(MTP_STEM + "-"):  # an MTP family's NextN layer: `MTPHead.from_pretrained` reads it
            continue
        file = os.path.join(path, name)
        try:
            with safe_open(file, "pt") as handle:
                target = stored_tensors if name.startswith("quantized-") else floats
                for key in handle.keys():
                    target[key] = handle.get_tensor(key)
                if name.startswith("quantized-"):
                    stored_meta.update(json.loads((handle.metadata() or {}).get("omnimtp", "{}")))
        except (SafetensorError, OSError, json.JSONDecodeError) as error:
            raise ValueError(f"{file}: not a readable safetensors file of a quantized checkpoint ({error})") from None
    if dtype is not None:
        floats = {name: tensor.to(dtype) if tensor.is_floating_point() else tensor for name, tensor in floats.items()}
    aliases = tied_aliases(model)
    missing, unexpected = model.load_state_dict(floats, strict=False, assign=True)
    for alias, name in aliases.items():  # tied again: the alias's module takes the loaded parameter
        _load_parameter_into_model(model, alias, model.get_parameter(name))
    left = [name for name in missing if not _is_quantized_parameter(name, decoders) and name not in aliases]
    if unexpected or left:
        raise ValueError(f"{path}: its model-*.safetensors files do not match the model (missing {left[:3]}, "
                         f"unexpected {unexpected[:3]})")
    if _own_model_class(model_type) is not None:  # omnimtp's own model computes what is not stored itself
        model.restore_buffers()
        model.has_released_linears = True  # (its `save_pretrained` refuses it)
    else:
        # non-persistent buffers (rotary tables, ...) are not stored: made on the CPU and computed by the model's
        # own initialisation, which leaves every loaded tensor as it is (and the meta ones: nothing to fill)
        for tensor in [*model.parameters(), *model.buffers()]:
            if tensor.device.type != "meta":
                tensor._is_hf_initialized = True
        for name, buffer in model.named_non_persistent_buffers():
            _load_parameter_into_model(model, name, torch.empty_like(buffer, device="cpu"))
        model.initialize_weights()
    # the weights the stored matrices replace: zero-stride CPU placeholders of their shapes, no data, in their
    # decoder's dtype (its first stored tensor's: what `.dtype` of the model's parts then says)
    dtypes = {prefix: next(p.dtype for p in model.get_submodule(prefix).parameters() if p.device.type != "meta")
              for prefix in decoders}
    for name, parameter in list(model.named_parameters()):
        if parameter.device.type == "meta":
            decoder_dtype = next(dtypes[prefix] for prefix in decoders if name.startswith(prefix + "."))
            placeholder = torch.zeros((), dtype=decoder_dtype).expand(parameter.shape)
            _load_parameter_into_model(model, name, torch.nn.Parameter(placeholder, requires_grad=False))
    model.omnimtp_quantized_checkpoint = path  # (`OmniPipeline.save_pretrained` refuses such a model)
    if hasattr(model, "generation_config") and os.path.isfile(os.path.join(path, "generation_config.json")):
        from transformers import GenerationConfig

        model.generation_config = GenerationConfig.from_pretrained(path)  # as transformers' from_pretrained reads it
    if hasattr(model, "load_speakers") and os.path.isfile(os.path.join(path, "spk_dict.pt")):
        model.load_speakers(os.path.join(path, "spk_dict.pt"))
    stored = {}
    for prefix, num_layers in section["decoders"].items():
        stored[prefix] = [
            {matrix: _stored_weight(stored_tensors, stored_meta, f"{prefix}.layers.{index}.{matrix}", path)
             for matrix in QUANTIZED_MATRICES}
            for index in range(num_layers)
        ]
    return QuantizedModel(model.eval(), mode, stored)


def _stored_weight(tensors: dict, meta: dict, stem: str, path: str) -> QuantizedWeight | None:
    if f"{stem}.packed" not in tensors:
        return None
    if stem + ".packed" not in meta or f"{stem}.scales" not in tensors:
        raise ValueError(f"{path}: the quantized files lack {stem}'s scales or metadata")
    out_features, group_size, int8_activations = meta[f"{stem}.packed"]
    return QuantizedWeight(tensors[f"{stem}.packed"], tensors[f"{stem}.scales"], out_features, group_size,
                           int8_activations)


def load_quantized_target_and_head(path, quantize: str | None = None, dtype: torch.dtype | None = None):
    """(target, head) of an MTP family's quantized checkpoint (`quantize_checkpoint` of a causal LM with its NextN
    layer), memory-mapped: the target's packed decoder is made from the stored matrices (its quantized layers' float
    weights are zero-stride placeholders, never materialized) and speculative decoding runs it in the checkpoint's
    mode (`packed_target.stored_packed_target`); the head is read as stored, in float. dtype: the float tensors'
    (None: the config's, as `load_target_and_head` loads a float checkpoint). quantize: None or the checkpoint's
    mode (another: ValueError naming `quantize`)."""
    from transformers import AutoConfig

    from omnimtp.mtp.head import MTPHead
    from omnimtp.spec_decode.packed_target import stored_packed_target

    path = os.fspath(path)
    if _mtp_model_type(path) is None:
        raise ValueError(f"path: {path!r} is not a quantized checkpoint of an MTP family ({sorted(MTP_DECODERS)})")
    if dtype is None:
        dtype = getattr(AutoConfig.from_pretrained(path), "dtype", None)
    loaded = load_quantized_model(path, quantize, dtype=dtype if isinstance(dtype, torch.dtype) else None)
    target = loaded.model
    (prefix,) = loaded.stored
    stored_packed_target(target, loaded.mode, loaded.stored[prefix])
    return target, MTPHead.from_pretrained(path, target).eval()
