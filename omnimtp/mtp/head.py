"""The MTP (NextN) head: one extra decoder block of the target's own class that drafts the next tokens.

    h'     = block(eh_proj(cat([enorm(embed(x_{t+1})), hnorm(h_t)])))      # [B, T, H]
    logits = lm_head(shared_head_norm(h'))                                  # [B, T, V]

`h_t` is the target's last hidden row at position t after its final norm (what transformers'
`generate(use_mtp=True)` feeds: `hidden_states[-1]` is tied to `last_hidden_state`). The pair
(x_{t+1}, h_t) sits at position id t + 1 — the position of x_{t+1}, as transformers' MTP loop does.
`h'` (before `shared_head_norm`) is what a second draft step consumes as its `prev_hidden`, the way
DeepSeek-V3's reference code and vLLM chain MTP steps.

`embed_tokens`, `lm_head` and the rotary embedding belong to the target: the head references them and
does not register them, so `head.parameters()` / `head.state_dict()` hold only the head's own weights.

Checkpoint layout (what `save_pretrained` writes and `from_pretrained` reads):
- deepseek_v3 / glm4_moe: `model.layers.{N}.{enorm,hnorm,eh_proj,shared_head.norm}.weight` plus the block's
  own keys `model.layers.{N}.{self_attn,mlp,input_layernorm,post_attention_layernorm}.*`, with N =
  `num_hidden_layers` and routed experts stored one module per expert (`mlp.experts.{e}.gate_proj.weight`,
  ...), exactly as transformers writes the target's own layers;
- glm_moe_dsa (GLM-5): the layered layout; the block is a GLM-5 decoder layer with its own DSA indexer
  (`self_attn.indexer.{wq_b,wk,k_norm,weights_proj}`). `shared_head.head` / `embed_tokens` copies of the
  target's weights, which some exports carry at layer N, are read past (the head shares the target's).
  The head drafts with `omnimtp.mtp.dsa.dsa_layer` over its own cache (MLA latents + indexer keys); with
  `index_share_for_mtp_iteration: true` in the config, draft steps after the first reuse the first step's
  key selection (`MTPHeadOutput.selection`, passed back as `shared_selection`).
- qwen3_next, qwen3_5, qwen3_5_moe (the text configs `qwen3_5_text` / `qwen3_5_moe_text`):
  `mtp.{pre_fc_norm_embedding,pre_fc_norm_hidden,fc,norm}.weight` and `mtp.layers.0.*` (a full-attention
  layer; experts one module per expert, as their released checkpoints store them). transformers drops
  `mtp.*` when it loads these targets (`_keys_to_ignore_on_load_unexpected = [r"^mtp.*"]`), so a checkpoint
  holding both loads as the target alone. The released configs say `mtp_num_hidden_layers: 1`; every draft
  step runs layer 0. A config with more MTP layers is refused.
"""

from __future__ import annotations

import copy
import json
import os
import re
from dataclasses import dataclass, replace

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn
from transformers import DynamicCache
from transformers.masking_utils import create_causal_mask

from omnimtp.mtp.dsa import dsa_layer
from omnimtp.runtime.decoder import (
    ROW_KERNEL,
    ROW_KERNEL_MAX_ROWS,
    PackedDecoder,
    shared_length_forward,
    unsupported_layer_reason,
    weights_fingerprint,
)
from omnimtp.runtime.kernels import small_batch_linear
from omnimtp.runtime.kv_cache import KVCache
from omnimtp.runtime.ops import cast, linear, rms_norm

MTP_WEIGHTS_NAME = "model-mtp.safetensors"
MAIN_WEIGHTS_NAME = "model-main.safetensors"
SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_INDEX_NAME = "model.safetensors.index.json"
DRAFT_ROPE_BLOCK = 64  # positions per rotary-table miss of a draft step (`PackedDecoder.step_tables`)

# model_type -> layout of the NextN layer's keys in a checkpoint
# Families that ship a NextN layer at model.layers.{N}, plus dense/MoE Qwen3 targets that have none: a head trained
# for them (`omnimtp train-mtp`) is stored the same way (transformers' use_mtp covers only the first two).
_LAYERED_MODEL_TYPES = ("deepseek_v3", "glm4_moe", "glm_moe_dsa", "qwen3", "qwen3_moe", "qwen3_omni_moe_text")
# Qwen3-Omni's thinker: its head lives next to an omni checkpoint under the thinker's own layer names; the
# checkpoint's index is left alone (transformers' Qwen3-Omni loader would report the head's keys as unexpected).
_OMNI_THINKER_MODEL_TYPE = "qwen3_omni_moe_text"
_MTP_PREFIX_MODEL_TYPES = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")

# The head's own (non-block) modules, by checkpoint name for each layout.
_LAYERED_NAMES = {"enorm": "enorm", "hnorm": "hnorm", "eh_proj": "eh_proj", "shared_head_norm": "shared_head.norm"}
_MTP_PREFIX_NAMES = {
    "enorm": "pre_fc_norm_embedding",
    "hnorm": "pre_fc_norm_hidden",
    "eh_proj": "fc",
    "shared_head_norm": "norm",
}


@dataclass
class MTPHeadOutput:
    hidden: torch.Tensor  # [B, T, H] block output, before shared_head_norm: the next draft step's prev_hidden
    logits: torch.Tensor | None  # [B, T, V]; None when called with compute_logits=False (see `MTPHead.logits`)
    selection: torch.Tensor | None = None  # [B, T, S] bool: the keys each row attended to (DSA blocks only)


@dataclass(frozen=True)
class _SharedWithTarget:
    """The target's modules the head uses; kept out of the head's module tree on purpose."""

    embed_tokens: nn.Module
    lm_head: nn.Module
    rotary_emb: nn.Module


def _text_config(target_model):
    return target_model.config.get_text_config(decoder=True)


def _checkpoint_layout(config) -> str:
    if config.model_type in _LAYERED_MODEL_TYPES:
        return "layered"
    if config.model_type in _MTP_PREFIX_MODEL_TYPES:
        num_mtp_layers = getattr(config, "mtp_num_hidden_layers", 1)
        if num_mtp_layers != 1:
            raise ValueError(
                f"target_model: config.mtp_num_hidden_layers must be 1 (one MTP layer, reused by every draft "
                f"step), got {num_mtp_layers!r}"
            )
        return "mtp_prefix"
    raise ValueError(
        f"target_model: MTP heads are supported for model types {_LAYERED_MODEL_TYPES + _MTP_PREFIX_MODEL_TYPES}, "
        f"got {config.model_type!r}"
    )


def _block_config(config):
    """The config the NextN block is built from. Like transformers' `get_mtp_config`, the MTP block is always
    a MoE block (`first_k_dense_replace = 0`); index-based `layer_types` get an entry for layer N."""
    block_config = copy.deepcopy(config)
    if getattr(block_config, "first_k_dense_replace", None) is not None:
        block_config.first_k_dense_replace = 0
    num_layers = config.num_hidden_layers
    dense_layers = list(getattr(config, "mlp_only_layers", None) or [])
    if config.model_type == _OMNI_THINKER_MODEL_TYPE and set(range(num_layers)) <= set(dense_layers):
        block_config.mlp_only_layers = dense_layers + [num_layers]  # a dense thinker gets a dense head block
    mtp_entries = {"layer_types": "indexed_attention" if config.model_type == "glm_moe_dsa" else "full_attention",
                   "mlp_layer_types": "sparse", "indexer_types": "full"}
    for name, entry in mtp_entries.items():
        values = getattr(block_config, name, None)
        if values is not None and len(values) <= num_layers:
            setattr(block_config, name, list(values)[:num_layers] + [entry])
    return block_config


class MTPHead(nn.Module):
    """One NextN layer sharing the target's embedding and lm_head. See the module docstring for the math."""

    def __init__(self, target_model: nn.Module):
        super().__init__()
        config = _text_config(target_model)
        self.model_type = config.model_type
        self.layout = _checkpoint_layout(config)
        decoder = target_model.get_decoder()
        decoder_layer_cls = type(decoder.layers[-1])
        norm_cls = type(decoder.norm)
        hidden_size = config.hidden_size
        self.config = _block_config(config)
        self.layer_idx = config.num_hidden_layers
        self.hidden_size = hidden_size
        self.vocab_size = target_model.get_output_embeddings().weight.shape[0]
        self.is_dsa = config.model_type == "glm_moe_dsa"
        self.index_share = self.is_dsa and bool(getattr(config, "index_share_for_mtp_iteration", False))

        self.enorm = norm_cls(hidden_size, eps=config.rms_norm_eps)
        self.hnorm = norm_cls(hidden_size, eps=config.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * hidden_size, hidden_size, bias=False)
        self.block = decoder_layer_cls(self.config, self.layer_idx)
        self.shared_head_norm = norm_cls(hidden_size, eps=config.rms_norm_eps)
        self._shared = _SharedWithTarget(
            embed_tokens=target_model.get_input_embeddings(),
            lm_head=target_model.get_output_embeddings(),
            rotary_emb=decoder.rotary_emb,
        )
        self.to(device=target_model.device, dtype=target_model.dtype)
        self._packed: tuple | None = None  # (weights fingerprint, PackedHead), see `packed`

    # -- shared modules -------------------------------------------------------------------------------------

    @property
    def embed_tokens(self) -> nn.Module:
        return self._shared.embed_tokens

    @property
    def lm_head(self) -> nn.Module:
        return self._shared.lm_head

    @property
    def rotary_emb(self) -> nn.Module:
        return self._shared.rotary_emb

    # -- constructors ---------------------------------------------------------------------------------------

    @classmethod
    def from_config(cls, target_model: nn.Module) -> MTPHead:
        """A freshly initialised head (torch's current RNG; the target family's own init scheme)."""
        head = cls(target_model)
        init_weights = getattr(target_model, "_init_weights", None)
        if init_weights is not None:
            with torch.no_grad():
                for module in head.modules():
                    init_weights(module)
        return head

    @classmethod
    def from_pretrained(cls, checkpoint_dir: str | os.PathLike, target_model: nn.Module) -> MTPHead:
        """Read the NextN layer's weights from the safetensors files of `checkpoint_dir`.

        Raises ValueError naming the missing keys when the checkpoint has no (or an incomplete) MTP layer."""
        checkpoint_dir = os.fspath(checkpoint_dir)
        if not os.path.isdir(checkpoint_dir):
            raise ValueError(f"checkpoint_dir: {checkpoint_dir!r} is not a directory")
        head = cls(target_model)
        prefix = head.checkpoint_prefix
        tensors = {}
        for path in _safetensors_files(checkpoint_dir):
            with safe_open(path, framework="pt", device="cpu") as f:
                for key in f.keys():
                    if key.startswith(prefix):
                        tensors[key[len(prefix) :]] = f.get_tensor(key)
        expected = _checkpoint_keys(head)
        missing = sorted(prefix + key for key in expected - set(tensors))
        if missing:
            raise ValueError(
                f"checkpoint_dir: {checkpoint_dir!r} has no complete MTP layer for {head.model_type}; "
                f"missing {len(missing)} keys: {missing}"
            )
        state_dict = _from_checkpoint_names({key: tensors[key] for key in expected}, head.layout)
        head.load_state_dict(state_dict, strict=True)
        return head

    @property
    def checkpoint_prefix(self) -> str:
        if self.model_type == _OMNI_THINKER_MODEL_TYPE:
            return f"thinker.model.language_model.layers.{self.layer_idx}."
        return f"model.layers.{self.layer_idx}." if self.layout == "layered" else "mtp."

    def save_pretrained(self, save_directory: str | os.PathLike) -> str:
        """Write the head as `model-mtp.safetensors` in the checkpoint layout; returns the file's path.

        When the directory already holds the target's weights (save the target first), the checkpoint is
        made a sharded one so that transformers' `generate(use_mtp=True)` sees the head too: transformers
        reads a lone `model.safetensors` and ignores any index, so an unsharded `model.safetensors` is
        renamed to `model-main.safetensors` and `model.safetensors.index.json` lists both files (an
        existing index is extended instead). `MTPHead.from_pretrained` reads either layout."""
        save_directory = os.fspath(save_directory)
        os.makedirs(save_directory, exist_ok=True)
        prefix = self.checkpoint_prefix
        tensors = {
            prefix + key: value.detach().to("cpu").contiguous()
            for key, value in _to_checkpoint_names(self.state_dict(), self.layout).items()
        }
        path = os.path.join(save_directory, MTP_WEIGHTS_NAME)
        save_file(tensors, path, metadata={"format": "pt"})
        if self.model_type == _OMNI_THINKER_MODEL_TYPE:
            return path  # a file next to the omni checkpoint, outside its weight map

        index_path = os.path.join(save_directory, SAFE_INDEX_NAME)
        single_path = os.path.join(save_directory, SAFE_WEIGHTS_NAME)
        if os.path.exists(single_path):
            with safe_open(single_path, framework="pt", device="cpu") as f:
                index = {"metadata": {}, "weight_map": {key: MAIN_WEIGHTS_NAME for key in f.keys()}}
            os.replace(single_path, os.path.join(save_directory, MAIN_WEIGHTS_NAME))
        elif os.path.exists(index_path):
            with open(index_path) as f:
                index = json.load(f)
        else:
            return path
        weight_map = {k: v for k, v in index["weight_map"].items() if v != MTP_WEIGHTS_NAME}
        weight_map.update({key: MTP_WEIGHTS_NAME for key in tensors})
        index["weight_map"] = dict(sorted(weight_map.items()))
        with open(index_path, "w") as f:
            json.dump(index, f, indent=2)
        return path

    def make_cache(self) -> DynamicCache:
        """An empty KV cache for the head (its block writes layer index N = num_hidden_layers; a DSA block's
        layer also keeps its indexer keys)."""
        if not self.is_dsa:
            return DynamicCache()
        cache_config = copy.deepcopy(self.config)
        cache_config.num_hidden_layers = self.layer_idx + 1  # transformers makes one cache layer per layer
        return DynamicCache(config=cache_config)

    # -- forward --------------------------------------------------------------------------------------------

    def forward(
        self,
        input_ids: torch.LongTensor,
        prev_hidden: torch.Tensor,
        *,
        position_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        cache: DynamicCache | None = None,
        compute_logits: bool = True,
        shared_selection: torch.Tensor | None = None,
    ) -> MTPHeadOutput:
        """input_ids [B, T]: x_{t+1}; prev_hidden [B, T, H]: the target's post-norm hidden row h_t.

        position_ids [B, T] (default: cache length + 1 + arange(T), i.e. the position of x_{t+1});
        attention_mask [B, cache length + T] over cache slots then new slots (default None: every slot
        valid, which lets sdpa skip the mask for one new token);
        cache: the head's own DynamicCache (see `make_cache`), appended to in place;
        compute_logits=False skips the lm_head (logits None): a drafter that needs only some rows' logits
        applies `logits(hidden_rows)` to those rows.
        shared_selection [B, T, S'] (DSA blocks): the selected keys among the first S' cache slots, reused
        instead of the indexer's (IndexShare); the slots after them follow the causal mask."""
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [B, T], got shape {tuple(input_ids.shape)}")
        batch_size, num_tokens = input_ids.shape
        if prev_hidden.shape != (batch_size, num_tokens, self.hidden_size):
            raise ValueError(
                f"prev_hidden must be [B, T, H] = {(batch_size, num_tokens, self.hidden_size)}, "
                f"got {tuple(prev_hidden.shape)}"
            )
        num_past = cache.get_seq_length(self.layer_idx) if cache is not None else 0
        if position_ids is None:
            position_ids = torch.arange(num_tokens, device=input_ids.device) + num_past + 1
            position_ids = position_ids.unsqueeze(0).expand(batch_size, -1)
        if attention_mask is not None and attention_mask.shape != (batch_size, num_past + num_tokens):
            raise ValueError(
                f"attention_mask must be [B, cache length + T] = {(batch_size, num_past + num_tokens)}, "
                f"got {tuple(attention_mask.shape)}"
            )

        embeds = self.embed_tokens(input_ids)  # [B, T, H]
        hidden = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(prev_hidden)], dim=-1))  # [B, T, H]
        position_embeddings = self.rotary_emb(hidden, position_ids)
        if self.is_dsa:
            if cache is None:
                cache = self.make_cache()
            valid = torch.ones(batch_size, num_past + num_tokens, dtype=torch.bool, device=hidden.device)
            if attention_mask is not None:
                valid = attention_mask.bool()
            slots = torch.arange(num_past + num_tokens, device=hidden.device)
            causal = slots[None, :] <= (num_past + torch.arange(num_tokens, device=hidden.device))[:, None]  # [T, S]
            hidden, selection = dsa_layer(
                self.block, hidden, position_embeddings, cache, valid[:, None, :] & causal[None], shared_selection
            )
            return MTPHeadOutput(
                hidden=hidden, logits=self.logits(hidden) if compute_logits else None, selection=selection
            )
        causal_mask = create_causal_mask(
            config=self.config,
            inputs_embeds=hidden,
            attention_mask=attention_mask,
            cache=cache,
            position_ids=position_ids,
            layer_idx=self.layer_idx,
        )
        hidden = self.block(
            hidden,
            attention_mask=causal_mask,
            position_ids=position_ids,
            cache=cache,
            use_cache=cache is not None,
            position_embeddings=position_embeddings,
        )  # [B, T, H]
        return MTPHeadOutput(hidden=hidden, logits=self.logits(hidden) if compute_logits else None)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Block output rows [..., H] → draft logits [..., V] (shared_head norm, then the target's lm_head)."""
        return self.lm_head(self.shared_head_norm(hidden))

    # -- lean drafting step ---------------------------------------------------------------------------------

    @property
    def supports_draft_step(self) -> bool:
        """Whether `draft_step` applies: a glm4_moe block (attention + routed/shared MoE) or a Qwen3-Omni
        thinker block (attention + a dense MLP or Qwen3-MoE experts)."""
        block = self.block
        if self.model_type == _OMNI_THINKER_MODEL_TYPE:
            return unsupported_layer_reason(block) is None
        return (
            self.model_type == "glm4_moe"
            and hasattr(getattr(block.mlp, "experts", None), "gate_up_proj")
            and hasattr(block.mlp, "shared_experts")
            and unsupported_layer_reason(block) is None
        )

    def packed(self) -> PackedHead:
        """The head's weights packed for `draft_step` (made on first use, again after any weight edit)."""
        fingerprint = weights_fingerprint(self)
        if self._packed is None or self._packed[0] != fingerprint:
            dtype = self.eh_proj.weight.dtype
            decoder = PackedDecoder.from_layers(
                [self.block], self.config, self.rotary_emb, self.shared_head_norm, dtype
            )
            # every draft step is at a new position: rotary tables for 64 positions per miss; a router that
            # picks every expert: the experts as one MLP (drafts only feed verification, so their rounding
            # does not matter)
            decoder = replace(
                decoder.with_row_kernel().with_dense_experts(), step_rope={}, step_rope_block=DRAFT_ROPE_BLOCK
            )
            # enorm and hnorm folded into eh_proj's two halves of columns: the step then normalises
            # [embeds; prev_hidden] in one weightless RMSNorm and multiplies once (drafts only feed
            # verification, so the changed rounding does not matter)
            with torch.no_grad():
                norms = torch.cat([self.enorm.weight, self.hnorm.weight]).float()  # [2H]
                eh_proj = cast(self.eh_proj.weight.float() * norms, dtype)  # [H, 2H]
            lm_head = self.lm_head.weight.detach()
            rows = decoder.row_kernel is not None and lm_head.dtype == torch.float32
            packed = PackedHead(
                decoder=decoder, eh_proj=eh_proj, lm_head=lm_head,
                eh_proj_rows=small_batch_linear.pack_weight(eh_proj) if rows else None,
                lm_head_rows=small_batch_linear.pack_weight(lm_head) if rows else None,
            )
            self._packed = (fingerprint, packed)
        return self._packed[1]

    def make_draft_cache(self, batch_size: int = 1, capacity: int = 256) -> KVCache:
        """An empty KV cache for `draft_step`: `batch_size` slots sharing one length."""
        return KVCache(self.packed().decoder, batch_size, capacity=capacity)

    def draft_step(
        self,
        input_ids: torch.LongTensor,
        prev_hidden: torch.Tensor,
        position_ids: torch.LongTensor,
        cache: KVCache,
        kv_mask: torch.Tensor | None = None,
        last_index: torch.Tensor | None = None,
        packed: PackedHead | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward` on the head's packed weights (`omnimtp.runtime`'s decoder layer), appended to a
        `make_draft_cache` cache.

        input_ids [B, T], prev_hidden [B, T, H], position_ids [B, T] (or [3, B, T]: a Qwen3-Omni thinker
        prefill's M-RoPE ids); kv_mask [B, cache length + T] (1 = a
        real slot, None = all real); last_index [B]: the slot whose hidden row and logits are returned
        (default the last); packed: `self.packed()` (which checks the weights, ~45 us on the demo head; a
        drafting loop takes it once per run) → (hidden [B, 1, H], logits [B, V]) of that slot; the other
        slots only append their keys and values (their outputs would feed nothing: the head is one layer).
        The same math as `forward` (same router,
        experts, rotary, causal attention) without transformers' generic layer machinery, which costs more
        than the arithmetic here. Floating-point results differ from `forward` by rounding only (other
        matmul kernels, e.g. `torch.mv` for one token); drafts only feed verification, so outputs stay
        exact either way. Requires `supports_draft_step`."""
        if input_ids.dim() != 2 or prev_hidden.shape != (*input_ids.shape, self.hidden_size):
            raise ValueError(
                f"draft_step takes input_ids [B, T] and prev_hidden [B, T, {self.hidden_size}], got "
                f"{tuple(input_ids.shape)} and {tuple(prev_hidden.shape)}"
            )
        if position_ids.shape not in (input_ids.shape, (3, *input_ids.shape)):
            raise ValueError(
                f"position_ids must be [B, T] like input_ids (or [3, B, T] M-RoPE ids), got {tuple(position_ids.shape)}"
            )
        packed = packed or self.packed()
        decoder = packed.decoder
        # the row kernel (see `PackedDecoder.with_row_kernel`) for blocks of up to ROW_KERNEL_MAX_ROWS rows
        on_rows = packed.eh_proj_rows is not None and input_ids.numel() <= ROW_KERNEL_MAX_ROWS
        gemm = ROW_KERNEL if on_rows else None
        pair = torch.stack([self.embed_tokens(input_ids), prev_hidden], dim=-2)  # [B, T, 2, H]
        normed_pair = rms_norm(pair, None, decoder.eps).view(*input_ids.shape, 2 * self.hidden_size)  # [B, T, 2H]
        x = linear(normed_pair, packed.eh_proj, packed=packed.eh_proj_rows if on_rows else None, gemm=gemm)
        # one layer: the slots before last_index only add their keys and values
        if last_index is None and input_ids.shape[1] > 1:
            last_index = torch.full((input_ids.shape[0],), input_ids.shape[1] - 1, device=input_ids.device)
        hidden = shared_length_forward(decoder, cache, x, position_ids, kv_mask, output_index=last_index)  # [B, 1, H]
        normed = rms_norm(hidden[:, 0], decoder.final_norm, decoder.eps)  # shared_head_norm
        rows = packed.lm_head_rows is not None and normed.shape[0] <= ROW_KERNEL_MAX_ROWS
        return hidden, linear(
            normed, packed.lm_head, packed=packed.lm_head_rows if rows else None, gemm=ROW_KERNEL if rows else None
        )


@dataclass(frozen=True)
class PackedHead:
    """`MTPHead`'s weights for `draft_step`: its block as a one-layer `PackedDecoder` (final norm:
    shared_head_norm) and the input side: eh_proj with enorm's and hnorm's weights folded into its columns."""

    decoder: PackedDecoder
    eh_proj: torch.Tensor  # [H, 2H]: eh_proj.weight * [enorm.weight; hnorm.weight]
    lm_head: torch.Tensor  # [V, H] the target's (shared)
    eh_proj_rows: torch.Tensor | None = None  # eh_proj and lm_head packed for the row kernel, where it runs
    lm_head_rows: torch.Tensor | None = None


# -- checkpoint key layout ----------------------------------------------------------------------------------

_FUSED_GATE_UP = re.compile(r"^block\.mlp\.experts\.gate_up_proj$")
_FUSED_DOWN = re.compile(r"^block\.mlp\.experts\.down_proj$")
_PER_EXPERT = re.compile(r"^block\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def _own_names(layout: str) -> dict[str, str]:
    return _LAYERED_NAMES if layout == "layered" else _MTP_PREFIX_NAMES


def _to_checkpoint_names(state_dict: dict[str, torch.Tensor], layout: str) -> dict[str, torch.Tensor]:
    """Module state dict → checkpoint keys (without the `model.layers.N.` / `mtp.` prefix).

    Fused expert tensors `gate_up_proj [E, 2I, H]` / `down_proj [E, H, I]` are split into one module per
    expert, the layout transformers writes on save and the released checkpoints use."""
    names = _own_names(layout)
    block_prefix = "" if layout == "layered" else "layers.0."
    out = {}
    for key, value in state_dict.items():
        module, _, rest = key.partition(".")
        if module in names:
            out[f"{names[module]}.{rest}"] = value
        elif _FUSED_GATE_UP.match(key):
            gate, up = value.chunk(2, dim=1)  # [E, I, H] each
            for e in range(value.shape[0]):
                out[f"{block_prefix}mlp.experts.{e}.gate_proj.weight"] = gate[e]
                out[f"{block_prefix}mlp.experts.{e}.up_proj.weight"] = up[e]
        elif _FUSED_DOWN.match(key):
            for e in range(value.shape[0]):
                out[f"{block_prefix}mlp.experts.{e}.down_proj.weight"] = value[e]
        else:
            out[block_prefix + key[len("block.") :]] = value
    return out


def _from_checkpoint_names(tensors: dict[str, torch.Tensor], layout: str) -> dict[str, torch.Tensor]:
    """Inverse of `_to_checkpoint_names`: per-expert tensors are stacked back into the fused parameters."""
    names = {ckpt: module for module, ckpt in _own_names(layout).items()}
    block_prefix = "" if layout == "layered" else "layers.0."
    out = {}
    per_expert: dict[str, dict[int, torch.Tensor]] = {"gate_proj": {}, "up_proj": {}, "down_proj": {}}
    for key, value in tensors.items():
        own = next((name for name in names if key.startswith(name + ".")), None)
        if own is not None:
            out[names[own] + key[len(own) :]] = value
            continue
        block_key = "block." + key[len(block_prefix) :]
        match = _PER_EXPERT.match(block_key)
        if match:
            per_expert[match.group(2)][int(match.group(1))] = value
        else:
            out[block_key] = value
    if per_expert["down_proj"]:
        num_experts = len(per_expert["down_proj"])
        gate = torch.stack([per_expert["gate_proj"][e] for e in range(num_experts)])  # [E, I, H]
        up = torch.stack([per_expert["up_proj"][e] for e in range(num_experts)])  # [E, I, H]
        out["block.mlp.experts.gate_up_proj"] = torch.cat([gate, up], dim=1)  # [E, 2I, H]
        out["block.mlp.experts.down_proj"] = torch.stack([per_expert["down_proj"][e] for e in range(num_experts)])
    return out


def _checkpoint_keys(head: MTPHead) -> set[str]:
    return set(_to_checkpoint_names(head.state_dict(), head.layout))


def _safetensors_files(checkpoint_dir: str) -> list[str]:
    index_path = os.path.join(checkpoint_dir, SAFE_INDEX_NAME)
    names = set(f for f in os.listdir(checkpoint_dir) if f.endswith(".safetensors"))
    if os.path.exists(index_path):
        with open(index_path) as f:
            names |= set(json.load(f)["weight_map"].values())
    return [os.path.join(checkpoint_dir, name) for name in sorted(names)]


def enable_transformers_mtp(target_model: nn.Module) -> nn.Module:
    """Point transformers' `generate(use_mtp=True)` loader at this model's NextN layer and return the model.

    transformers finds the MTP keys through `_keys_to_ignore_on_load_unexpected`, which is hard-coded to the
    real sizes (glm4_moe: layers 46/92, deepseek_v3: 61); a checkpoint with another `num_hidden_layers` N
    needs `model.layers.N.*` added, on the instance, after `from_pretrained(checkpoint_dir)`."""
    config = _text_config(target_model)
    if _checkpoint_layout(config) == "layered":
        pattern = rf"model\.layers\.{config.num_hidden_layers}\..*"
        existing = list(getattr(target_model, "_keys_to_ignore_on_load_unexpected", None) or [])
        if pattern not in existing:
            target_model._keys_to_ignore_on_load_unexpected = [pattern] + existing
    return target_model
