"""The packed decoder stack and its one layer function, shared by every decoder omnimtp runs.

transformers' forward spends a large share of a small-batch step in framework code (mask building,
cache objects, output recording, module calls). Here a forward is a short loop of tensor ops over
weights packed once (`PackedDecoder.from_module`), and every decoder runs the same `decoder_layer`:

    x = decoder_layer(decoder, layer, x, (cos, signed_sin), cache.buffer, i, where, mask)   # [R, T, H]

- per layer: fused QKV (+ bias), the q/k norm weights stacked per head (one RMSNorm for queries and
  keys) when the model has them, RoPE on queries and keys at once (partial rotary as transformers'
  `apply_rotary_pos_emb`), grouped-query attention over a `KVCache`, the output projection (+ bias);
- the MLP: dense (fused gate/up); Qwen3-MoE (one matrix [router rows; shared-expert gate row], softmax
  top-k router, the shared expert's projections used as transformers stores them: at batch 1 it is most
  of the talker's bytes, and fusing its gate/up would only duplicate them); glm4_moe (group-limited
  sigmoid router in fp32 + fused shared experts). Routed experts are transformers' own tensors;
- RMSNorm statistics in fp32 and the weight applied after casting back, as transformers does;
- LayerScale (code2wav's transformer: the attention and MLP outputs times a learnt [H] before their residual adds);
  a sliding window is the caller's mask and cache (`sliding_window`, `KVCache.slide`).

What differs between the decoders is a parameter, not a copy: the cache semantics (`where`: ragged
slots, one shared length, or a fixed buffer at static positions), the mask (bool causal, additive from a
kv_mask, or the code predictor's [T, G]), packed GEMM matrices (`packed`, `gemm`), and the numeric
variants fixed at construction (`fused_norm`, `fp32_attention`, the code predictor's choices; a "w8a8"
decoder's forwards of several positions a row take their attention in bf16: `attention(bf16_many_rows=...)`). One row
and one position runs the same ops, which the linears and the expert dispatch turn into `torch.mv`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from omnimtp.runtime import tracing, w4a8_step
from omnimtp.runtime.device import return_free_memory
from omnimtp.runtime.kernels import small_batch_linear, w8a8_epilogues
from omnimtp.runtime.kv_cache import KVCache, KVWrite, append_kv
from omnimtp.runtime.moe import (
    GroupLimitedSigmoid,
    Router,
    SoftmaxTopK,
    every_expert,
    routed_experts,
    routes_every_expert,
)
from omnimtp.runtime.ops import (
    MANY_ROW_MODES,
    PackedGemm,
    QuantizedRows,
    QuantizedWeight,
    Rope,
    apply_rope,
    attention,
    cast,
    causal_mask,
    check_many_row_mode,
    check_quantize,
    gated_mlp,
    linear,
    quantize_experts,
    quantize_weight,
    rms_norm,
    w8a8_sums,
)
from omnimtp.runtime.prefetch import reachable_tensors
from omnimtp.runtime.screened_head import ScreenedHead

ROW_KERNEL = PackedGemm("row", None)  # omnimtp's small-batch kernel (its AVX-512 or AVX2 build)
# `LayerWeights`' fields that hold routed experts, in any of their forms
ROUTED_EXPERT_FIELDS = frozenset({"expert_gate_up", "expert_down", "expert_gate_up_views", "expert_down_views",
                                  "dense_experts", "quantized_experts"})
ROW_KERNEL_MAX_ROWS = 16  # longer blocks (prefills) run on MKL's GEMM, faster there (compute-bound)


@dataclass(frozen=True)
class LayerWeights:
    """One decoder layer's packed weights. Matrices are nn.Linear-shaped [out, in]."""

    input_norm: torch.Tensor  # [H]
    # qkv, o, gate_up, mlp_down: None in a quantized decoder's dense layers (`PackedDecoder.quantized`)
    qkv: torch.Tensor | None  # [(Nq + 2 Nkv) * D, H]
    qkv_bias: torch.Tensor | None  # [(Nq + 2 Nkv) * D]
    qk_norm: torch.Tensor | None  # [Nq + Nkv, D]: q_norm for the query heads, k_norm for the key heads
    o: torch.Tensor | None  # [H, Nq * D]
    o_bias: torch.Tensor | None  # [H]
    post_norm: torch.Tensor  # [H]
    gate_up: torch.Tensor | None  # [2I, H]: the dense MLP, or glm4_moe's shared experts
    mlp_down: torch.Tensor | None  # [H, I] of gate_up's MLP or of the Qwen3-MoE shared expert
    router_in: torch.Tensor | None = None  # Qwen3-MoE [E (+ 1), H]: router rows (+ shared-expert gate row)
    shared_gate_proj: torch.Tensor | None = None  # [Is, H] Qwen3-MoE shared expert (transformers' own tensor)
    shared_up_proj: torch.Tensor | None = None  # [Is, H]
    router: Router | None = None  # None: dense MLP
    expert_gate_up: torch.Tensor | None = None  # [E, 2 Ie, H] (transformers' own tensor)
    expert_down: torch.Tensor | None = None  # [E, H, Ie]
    # per-expert views of expert_gate_up / expert_down (no copy), so a decode step indexes a tuple
    expert_gate_up_views: tuple[torch.Tensor, ...] = ()
    expert_down_views: tuple[torch.Tensor, ...] = ()
    # `PackedDecoder.with_dense_experts`: (gate_up [E * 2Ie, H], down [H, E * Ie]) of every expert, or None
    dense_experts: tuple[torch.Tensor, torch.Tensor] | None = None
    # `quantize_layer`: every routed expert's (gate_up, down) quantized and stacked (`ops.quantize_experts`), in
    # place of expert_gate_up / expert_down (then None)
    quantized_experts: tuple[QuantizedWeight, QuantizedWeight] | None = None
    # `quantize_layer`: the router's fp32 rows (router_in, or glm4_moe's router weight) packed for omnimtp's fp32
    # kernel, so a token's routing, like the rest of a quantized layer, does not depend on the other rows
    router_row_kernel: torch.Tensor | None = None
    # LayerScale (code2wav's transformer): the attention block's and the MLP's outputs times these [H] before their
    # residual adds, as transformers' `self_attn_layer_scale` / `mlp_layer_scale`; None: no scale
    attn_scale: torch.Tensor | None = None
    mlp_scale: torch.Tensor | None = None

    @property
    def num_experts(self) -> int:
        return 0 if self.router is None else self.router.num_experts


@dataclass(frozen=True)
class PackedDecoder:
    """The packed weights of one decoder stack (see the module docstring). Immutable; share it between
    runs. Later changes to the module's weights are not seen (except the experts, the module's own tensors).

    embed, lm_head: a causal LM's token embedding and output matrices (`from_causal_lm`), else None."""

    layers: tuple[LayerWeights, ...]
    final_norm: torch.Tensor  # [H]
    rope: Rope
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scaling: float  # the attention modules' softmax scale
    hidden_size: int
    eps: float
    dtype: torch.dtype
    device: torch.device
    embed: torch.Tensor | None = None  # [V, H] (the module's own tensor)
    lm_head: torch.Tensor | None = None  # [V, H] (the module's own tensor)
    fused_norm: bool = True  # see `rms_norm`
    fp32_attention: bool = False  # see `attention(fp32_manual=...)`
    # a "w8a8" decoder's layers of several positions a row: the elementwise work between their GEMMs as C passes
    # (`kernels.w8a8_epilogues`); False: as torch ops (the same values up to the order of a row's sums)
    fused_w8a8: bool = True
    # the KV cache's dtype when it is not `dtype` (`with_kv_dtype`: an fp32 decoder's cache in bf16), else None
    kv_dtype: torch.dtype | None = None
    # position → (cos, signed_sin) [D] of a one-row, one-position step (see `step_tables`)
    step_rope: dict = field(default_factory=dict, compare=False, repr=False)
    step_rope_block: int = 1  # positions `step_tables` computes per miss (1: each on its own, see there)
    # "w4a8" → (layers, quantized_layers, `w4a8_step.StepTable` or None): the native decode step's table
    native_step: dict = field(default_factory=dict, compare=False, repr=False)
    # `with_row_kernel`: per layer (qkv, o, gate_up, down) and the lm_head packed for omnimtp's kernel
    row_kernel: tuple | None = field(default=None, compare=False, repr=False)
    row_kernel_lm_head: torch.Tensor | None = field(default=None, compare=False, repr=False)
    # `quantized`: per layer (qkv, o, gate_up, down) quantized (`ops.QuantizedWeight`), used for
    # every row count, in place of the layers' float matrices; quantize: the mode (`ops.QUANTIZE_MODES`) or None
    quantize: str | None = None
    quantized_layers: tuple | None = field(default=None, compare=False, repr=False)
    # `with_quantized_lm_head`: the model's output matrix in int8, what a quantized thinker's logits come from
    quantized_lm_head: QuantizedWeight | None = field(default=None, compare=False, repr=False)
    # `with_quantized_lm_head(screen=True)`: that head with an int4 copy for greedy steps (`ScreenedHead`)
    screened_lm_head: ScreenedHead | None = field(default=None, compare=False, repr=False)
    # every layer's sliding window (a query sees its last `sliding_window` positions, itself included), or None: the
    # caller's mask applies it and its cache keeps that many (`KVCache.slide`); packed only when asked for by value
    sliding_window: int | None = None

    def quantized(self, quantize: str | None) -> PackedDecoder:
        """This decoder with every layer's linears (qkv, o, gate/up, down; in a MoE layer its shared experts'
        and its routed experts', `quantize_layer`) quantized (`ops.quantize_weight`; activations stay in the
        decoder's dtype, rounded to int8 inside each "w4a8" matmul), run on omnimtp's CPU kernel for any row
        count. Routers and norms stay as they are. The quantized decoder does not hold the float matrices it
        replaces (None in its layers), so they are freed once nothing else holds them. None, or this
        decoder's own mode: this decoder unchanged. ValueError naming `quantize` for an unknown mode, a device
        without a kernel, or a decoder quantized to another mode."""
        if quantize is None or quantize == self.quantize:
            return self
        check_decoder_quantize(quantize, self.device)
        if self.quantize is not None:
            raise ValueError(f"quantize={quantize!r}: this decoder is already quantized ({self.quantize!r})")
        layers, quantized_layers = zip(*(quantize_layer(layer, quantize) for layer in self.layers), strict=True)
        return replace(self, layers=layers, quantize=quantize, quantized_layers=quantized_layers,
                       row_kernel=None, row_kernel_lm_head=None, native_step={})

    def with_kv_dtype(self, kv_dtype: torch.dtype | None) -> PackedDecoder:
        """This decoder with its KV cache (`KVCache`) in kv_dtype: None or its own dtype (the cache in the
        decoder's dtype), or torch.bfloat16 for an fp32 decoder: each key and value rounded to bf16 as it is
        written, widened to fp32 where attention reads it (half the bytes a decode step reads from its cache;
        the values change by that rounding). ValueError naming kv_dtype otherwise."""
        if kv_dtype is None or kv_dtype == self.dtype:
            return replace(self, kv_dtype=None)
        if kv_dtype != torch.bfloat16 or self.dtype != torch.float32:
            raise ValueError(f"kv_dtype must be None, the decoder's dtype or torch.bfloat16 for an fp32 decoder, "
                             f"got {kv_dtype!r} for a {self.dtype} decoder")
        return replace(self, kv_dtype=kv_dtype)

    def with_quantized_lm_head(self, lm_head: torch.Tensor, *, screen: bool = False) -> PackedDecoder:
        """This decoder with its model's output matrix lm_head [V, H] quantized to int8 per output channel
        (`quantized_lm_head`, whatever the layers' mode, as the code predictor's heads: the largest single read of
        a thinker's step, 0.62 GB in bf16 at Qwen3-Omni's vocabulary, and int8 moves no greedy token on the
        demo thinker: docs/quantization.md); its rows are computed each on its own, as the layers' are.
        screen: also an int4 copy of it (`screened_lm_head`, half the int8 head's bytes more), from which a greedy
        step takes the int8 head's token at about half its read (`omnimtp.runtime.screened_head`)."""
        quantized = quantize_weight(lm_head, "int8")
        screened = ScreenedHead.from_weight(lm_head, exact=quantized) if screen else None
        return replace(self, quantized_lm_head=quantized, screened_lm_head=screened)

    def with_row_kernel(self) -> PackedDecoder:
        """This decoder with every linear layer of up to ROW_KERNEL_MAX_ROWS rows (a decode step, a
        speculative verify) on omnimtp's small-batch kernel (`omnimtp.runtime.kernels.small_batch_linear`:
        AVX-512F or AVX2), which reads the weights once for all rows — as fast for 4 rows as `torch.mv`
        for one on a CPU, where a small-M GEMM takes twice as long — and computes each row on its own, so
        a row's values do not depend on how many rows run with it. fp32 CPU decoders where the kernel
        builds and that are not quantized; any other decoder is returned as it is. The packed copies double the
        matrices' memory."""
        if (self.dtype != torch.float32 or self.device.type != "cpu" or self.quantize is not None
                or not small_batch_linear.available()):
            return self
        pack = small_batch_linear.pack_weight
        layers = tuple(
            (
                pack(layer.qkv), pack(layer.o),
                *((pack(layer.gate_up), pack(layer.mlp_down)) if layer.router is None else (None, None)),
            )
            for layer in self.layers
        )
        lm_head = None if self.lm_head is None else pack(self.lm_head.float())
        return replace(self, row_kernel=layers, row_kernel_lm_head=lm_head, step_rope={})

    def row_kernel_only(self) -> PackedDecoder:
        """This decoder, packed for the row kernel (`with_row_kernel`), holding its packs alone: its layers' float
        matrices become meta tensors of their shapes (all `linear` reads of a matrix it has a pack of), so the
        fused copies packing made (qkv, gate/up) are let go. Its forwards must run on the packs
        (`decoder_layers(packed_layers=row_kernel)`, any row count: a streamed codec's transformer, whose every row
        takes the kernel); dense layers without biases only. None where the kernel does not apply."""
        packed = self.with_row_kernel()
        if packed.row_kernel is None or any(
            layer.router is not None or layer.qkv_bias is not None or layer.o_bias is not None for layer in self.layers
        ):
            return None
        names = ("qkv", "o", "gate_up", "mlp_down")
        layers = tuple(
            replace(layer, **{name: torch.empty(getattr(layer, name).shape, device="meta") for name in names})
            for layer in packed.layers
        )
        return replace(packed, layers=layers)

    def with_dense_experts(self) -> PackedDecoder:
        """This decoder with every MoE layer whose router always picks every expert (`moe.routes_every_expert`)
        running its experts as one MLP (`moe.every_expert`: one matmul for every gate/up, one for every down,
        instead of a dispatch per expert). Rounding differs from transformers' rank-order sum: for drafters,
        whose tokens only feed verification. Other layers (quantized ones too) are kept as they are; the down
        matrices are copied."""
        layers = tuple(
            replace(layer, dense_experts=(
                layer.expert_gate_up.reshape(-1, layer.expert_gate_up.shape[-1]),  # [E * 2Ie, H], a view
                layer.expert_down.permute(1, 0, 2).reshape(layer.expert_down.shape[1], -1),  # [H, E * Ie]
            )) if routes_every_expert(layer.router) and layer.quantized_experts is None else layer
            for layer in self.layers
        )
        return replace(self, layers=layers)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def tensors(self, *, routed_experts: bool = True) -> list[torch.Tensor]:
        """Every tensor this decoder holds (`prefetch.reachable_tensors`): its layers' (float and quantized), its
        norms and heads; without its routed experts unless `routed_experts` (a token reads its top-k of them), and
        never its embedding table (a step reads its tokens' rows only)."""
        skip = {"embed", "step_rope", "native_step"}
        if not routed_experts:
            skip |= ROUTED_EXPERT_FIELDS
        return list(reachable_tensors(self, frozenset(skip)))

    def step_tables(self, position: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, signed_sin) [D] at one position, for a one-row step on 1-D vectors: the `Rope.tables` call
        on [[position]] (so the same values), made on first use and kept. With step_rope_block = n > 1 a miss
        makes the tables of the n positions from there in one call (a drafter's, whose every step is at a
        new position: one call instead of n, at values that may differ from the one-position call's by
        float rounding, as vectorised and scalar cos/sin may)."""
        if position not in self.step_rope:
            positions = torch.arange(position, position + self.step_rope_block, device=self.device)[None]  # [1, n]
            cos, signed_sin = self.rope.tables(positions, self.dtype)  # [1, n, 1, D]
            rows = zip(
                cos.view(-1, cos.shape[-1]).unbind(0), signed_sin.view(-1, cos.shape[-1]).unbind(0), strict=True
            )  # n × [D]
            for offset, tables in enumerate(rows):
                self.step_rope[position + offset] = tables
        return self.step_rope[position]

    @classmethod
    def from_module(
        cls, model, dtype: torch.dtype | None = None, num_layers: int | None = None, **options
    ) -> PackedDecoder:
        """model: a transformers decoder (`layers`, `norm`, `rotary_emb`): Qwen3-Omni's thinker text model
        or talker model, its code predictor's model, a supported causal LM's `get_decoder()`, or code2wav's
        transformer (`sliding_window`). dtype: default the module's own. num_layers: the first layers only (default
        all). options: `fused_norm`, `fp32_attention`, `quantize` (see `from_layers`), `sliding_window`. ValueError
        when a layer is not supported."""
        if not hasattr(model, "layers") or not hasattr(model, "rotary_emb") or not hasattr(model, "norm"):
            raise ValueError(
                f"model must be a transformers decoder model (layers, norm, rotary_emb), got {type(model).__name__}"
            )
        if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
            raise ValueError(f"dtype must be None or a floating-point torch.dtype, got {dtype!r}")
        config = model.config
        rope_type = (getattr(config, "rope_parameters", None) or {}).get("rope_type", "default")
        if rope_type != "default":
            raise ValueError(f"model: rope_type {rope_type!r} is not supported (only 'default')")
        if config.hidden_act != "silu":
            raise ValueError(f"model: hidden_act {config.hidden_act!r} is not supported (only 'silu')")
        dtype = dtype or next(model.parameters()).dtype
        layers = model.layers[: num_layers or len(model.layers)]
        return cls.from_layers(layers, config, model.rotary_emb, model.norm, dtype, **options)

    @classmethod
    def from_layers(
        cls, layers, config, rotary, final_norm, dtype: torch.dtype, quantize: str | None = None,
        stored: list[dict] | None = None, **options
    ) -> PackedDecoder:
        """Transformers decoder layers (see `pack_layer`), their config, rotary module and final norm. quantize:
        as `quantized(quantize)`, each layer quantized as soon as it is packed, so the float copies packing
        makes (fused q/k/v, gate/up) never exist for more than one layer at a time. stored: each layer's
        `quantized_matrices` in mode `quantize`, as a quantized checkpoint holds them (`omnimtp.quantized_checkpoint`):
        used as they are, and the layers' matrices they replace may be on the meta device (only shapes are read)."""
        if quantize is not None:
            check_decoder_quantize(quantize, rotary.inv_freq.device)
        if stored is not None and (quantize is None or len(stored) != len(layers)):
            raise ValueError(f"stored: {len(stored)} layers' matrices in mode {quantize!r} for {len(layers)} layers")
        quantized_layers = None
        window = options.get("sliding_window")
        with torch.no_grad():
            if quantize is None:
                packed_layers = tuple(pack_layer(layer, config, dtype, window) for layer in layers)
            elif stored is not None:
                packed_layers, quantized_layers = zip(*(
                    with_quantized_matrices(pack_layer(layer, config, dtype, window), matrices)
                    for layer, matrices in zip(layers, stored, strict=True)
                ), strict=True)
            else:
                pairs = []
                for layer in layers:
                    pairs.append(quantize_layer(pack_layer(layer, config, dtype, window), quantize))
                    return_free_memory()  # the float temporaries of packing and quantizing, held by the heap
                packed_layers, quantized_layers = zip(*pairs, strict=True)
        attn = layers[0].self_attn
        return cls(
            layers=packed_layers,
            quantize=quantize,
            quantized_layers=quantized_layers,
            final_norm=cast(final_norm.weight, dtype),
            rope=Rope.from_module(rotary, attn.head_dim),
            num_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads,
            head_dim=attn.head_dim,
            scaling=float(attn.scaling),
            hidden_size=config.hidden_size,
            eps=config.rms_norm_eps,
            dtype=dtype,
            device=rotary.inv_freq.device,
            **options,
        )

    @classmethod
    def from_causal_lm(cls, target, **options) -> PackedDecoder:
        """A transformers causal LM: its decoder's first `num_hidden_layers` layers, embedding and lm_head.
        options: as `from_module`'s (`quantize`, `stored`, ...)."""
        decoder = target.get_decoder()
        packed = cls.from_module(
            decoder, dtype=decoder.embed_tokens.weight.dtype, num_layers=decoder.config.num_hidden_layers, **options
        )
        return replace(
            packed, embed=decoder.embed_tokens.weight.detach(), lm_head=target.get_output_embeddings().weight.detach(),
            device=decoder.embed_tokens.weight.device,
        )


def unsupported_layer_reason(layer, sliding_window: int | None = None) -> str | None:
    """None if `pack_layer` can pack this transformers decoder layer, else why not (one phrase). sliding_window:
    the window its attention may have (a decoder packed with `sliding_window`); any other is not supported."""
    attn, mlp = layer.self_attn, layer.mlp
    window = getattr(attn, "sliding_window", None)
    if window != sliding_window:
        return (f"a sliding window of {window} (pack with sliding_window={window}: the caller masks and slides its "
                "cache by it)")
    biases = [getattr(attn, name).bias is None for name in ("q_proj", "k_proj", "v_proj")]
    if len(set(biases)) != 1:
        return "q/k/v projections must all have biases or none"
    if not hasattr(mlp, "experts"):
        return "MLP biases are not supported" if mlp.gate_proj.bias is not None else None
    experts = mlp.experts
    if getattr(experts, "has_bias", False) or getattr(experts, "is_transposed", False) or not getattr(
        experts, "is_concatenated", True
    ):
        return "only concatenated [gate; up] experts without bias are supported"
    if hasattr(mlp.gate, "e_score_correction_bias"):
        if mlp.gate.num_experts // mlp.gate.num_group < 2:
            return "group-limited routing needs >= 2 experts per group"
    elif not hasattr(mlp.gate, "norm_topk_prob"):
        return f"router {type(mlp.gate).__name__} is not supported"
    return None


QUANTIZED_MATRICES = ("qkv", "o", "gate_up", "down", "experts.gate_up", "experts.down")


def check_decoder_quantize(quantize: str, device) -> None:
    """ValueError naming `quantize` unless a decoder's layers can be quantized to it on `device`: a mode of
    `ops.QUANTIZE_MODES`, or "w8a8" (`ops.MANY_ROW_MODES`: dense layers, for a decoder that runs many rows at a
    time: a prefill, the forced aligner's forward; a decode step on it reads int8 weights)."""
    if quantize in MANY_ROW_MODES:
        check_many_row_mode(quantize, device, "quantize")
    else:
        check_quantize(quantize, device)


def quantize_layer(layer: LayerWeights, quantize: str) -> tuple[LayerWeights, tuple]:
    """A packed layer → (the layer without the float matrices it no longer runs, its (qkv, o, gate_up, down)
    quantized to `quantize`): `with_quantized_matrices(layer, quantized_matrices(layer, quantize))`."""
    return with_quantized_matrices(layer, quantized_matrices(layer, quantize))


def quantized_matrices(layer: LayerWeights, quantize: str) -> dict[str, QuantizedWeight | None]:
    """A packed layer's matrices quantized to `quantize`, by QUANTIZED_MATRICES name: qkv, o, and the MLP's gate_up
    and down; in a MoE layer gate_up and down are its shared experts' (glm4_moe's fused ones; Qwen3-MoE's shared
    expert, its gate and up fused here; None without one), and "experts.gate_up" / "experts.down" every routed
    expert's, stacked (`ops.quantize_experts`; None in a dense layer). What a quantized checkpoint stores."""
    if layer.router is None:
        names = ("qkv", "o", "gate_up", "down")
        matrices = (layer.qkv, layer.o, layer.gate_up, layer.mlp_down)
        return {**dict.fromkeys(QUANTIZED_MATRICES),
                **{name: quantize_weight(matrix, quantize) for name, matrix in zip(names, matrices, strict=True)}}
    if quantize in MANY_ROW_MODES:
        raise ValueError(f"quantize={quantize!r} quantizes dense layers only (routed experts have no such kernel)")
    shared_gate_up = layer.gate_up
    if layer.shared_gate_proj is not None:
        shared_gate_up = torch.cat([layer.shared_gate_proj, layer.shared_up_proj])
    return {
        "qkv": quantize_weight(layer.qkv, quantize), "o": quantize_weight(layer.o, quantize),
        "gate_up": None if shared_gate_up is None else quantize_weight(shared_gate_up, quantize),
        "down": None if layer.mlp_down is None else quantize_weight(layer.mlp_down, quantize),
        "experts.gate_up": quantize_experts(layer.expert_gate_up, quantize),
        "experts.down": quantize_experts(layer.expert_down, quantize),
    }


def with_quantized_matrices(
    layer: LayerWeights, matrices: dict[str, QuantizedWeight | None]
) -> tuple[LayerWeights, tuple]:
    """A packed layer and its `quantized_matrices` (made here, or read from a quantized checkpoint) → (the layer
    without the float matrices they replace, its (qkv, o, gate_up, down) quantized): a MoE layer's routed experts
    in its `quantized_experts`, its router on omnimtp's fp32 kernel (`router_row_kernel`), its router rows and
    norms as they are."""
    quantized = tuple(matrices[name] for name in ("qkv", "o", "gate_up", "down"))
    if layer.router is None:
        return replace(layer, qkv=None, o=None, gate_up=None, mlp_down=None), quantized
    router_rows = layer.router.weight if isinstance(layer.router, GroupLimitedSigmoid) else layer.router_in
    return replace(
        layer, qkv=None, o=None, gate_up=None, mlp_down=None, shared_gate_proj=None, shared_up_proj=None,
        expert_gate_up=None, expert_down=None, expert_gate_up_views=(), expert_down_views=(),
        quantized_experts=(matrices["experts.gate_up"], matrices["experts.down"]),
        router_row_kernel=small_batch_linear.pack_weight(router_rows.float()),
    ), quantized


def pack_layer(layer, config, dtype: torch.dtype, sliding_window: int | None = None) -> LayerWeights:
    """One transformers decoder layer → LayerWeights: attention (+ biases, + qk norm), and a dense MLP, a
    Qwen3-MoE block (softmax top-k router, optional gated shared expert) or a glm4_moe block
    (group-limited sigmoid router, shared experts); LayerScale where the layer has it (code2wav's)."""
    reason = unsupported_layer_reason(layer, sliding_window)
    if reason is not None:
        raise ValueError(f"model: {reason}")
    attn, mlp = layer.self_attn, layer.mlp
    qk_norm = None
    if getattr(attn, "q_norm", None) is not None and not isinstance(attn.q_norm, torch.nn.Identity):
        qk_norm = cast(torch.cat([
            attn.q_norm.weight.expand(config.num_attention_heads, attn.head_dim),
            attn.k_norm.weight.expand(config.num_key_value_heads, attn.head_dim),
        ]), dtype)
    qkv_bias = None
    if attn.q_proj.bias is not None:
        qkv_bias = cast(torch.cat([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias]), dtype)
    common = dict(
        input_norm=cast(layer.input_layernorm.weight, dtype),
        qkv=cast(torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]), dtype),
        qkv_bias=qkv_bias,
        qk_norm=qk_norm,
        o=cast(attn.o_proj.weight, dtype),
        o_bias=None if attn.o_proj.bias is None else cast(attn.o_proj.bias, dtype),
        post_norm=cast(layer.post_attention_layernorm.weight, dtype),
        **{name: cast(getattr(layer, scale).scale, dtype) for name, scale in (
            ("attn_scale", "self_attn_layer_scale"), ("mlp_scale", "mlp_layer_scale")) if hasattr(layer, scale)},
    )
    if not hasattr(mlp, "experts"):  # dense MLP
        return LayerWeights(
            **common, gate_up=cast(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]), dtype),
            mlp_down=cast(mlp.down_proj.weight, dtype),
        )
    gate = mlp.gate
    expert_gate_up, expert_down = cast(mlp.experts.gate_up_proj, dtype), cast(mlp.experts.down_proj, dtype)
    experts = dict(
        expert_gate_up=expert_gate_up, expert_down=expert_down,
        expert_gate_up_views=tuple(expert_gate_up.unbind(0)), expert_down_views=tuple(expert_down.unbind(0)),
    )
    if hasattr(gate, "e_score_correction_bias"):  # glm4_moe
        shared = mlp.shared_experts
        router = GroupLimitedSigmoid(
            weight=gate.weight.detach().float(), correction_bias=gate.e_score_correction_bias.detach().float(),
            num_groups=gate.num_group, top_k_groups=gate.topk_group, top_k=gate.top_k,
            norm_topk_prob=bool(gate.norm_topk_prob), routed_scaling_factor=float(gate.routed_scaling_factor),
        )
        return LayerWeights(
            **common, gate_up=cast(torch.cat([shared.gate_proj.weight, shared.up_proj.weight]), dtype),
            mlp_down=cast(shared.down_proj.weight, dtype), router=router, **experts,
        )
    shared = getattr(mlp, "shared_expert", None)  # Qwen3-MoE
    rows = [gate.weight] if shared is None else [gate.weight, mlp.shared_expert_gate.weight]
    return LayerWeights(
        **common,
        gate_up=None,
        mlp_down=None if shared is None else cast(shared.down_proj.weight, dtype),
        router_in=cast(torch.cat(rows), dtype),
        shared_gate_proj=None if shared is None else cast(shared.gate_proj.weight, dtype),
        shared_up_proj=None if shared is None else cast(shared.up_proj.weight, dtype),
        router=SoftmaxTopK(num_experts=gate.num_experts, top_k=gate.top_k, norm_topk_prob=bool(gate.norm_topk_prob)),
        **experts,
    )


def mlp_block(
    layer: LayerWeights,
    x: torch.Tensor,
    packed: tuple[torch.Tensor, torch.Tensor] | None = None,
    gemm: PackedGemm | None = None,
) -> torch.Tensor:
    """The layer's MLP on tokens x [N, H] (or one token [H]) → [N, H]. packed: (gate_up, down) packed by
    `gemm` (a dense layer), or quantized (`quantize_layer`: a MoE layer's shared experts), or None."""
    router = layer.router
    if router is None:
        return gated_mlp(x, layer.gate_up, layer.mlp_down, packed=packed, gemm=gemm)
    experts = (layer.expert_gate_up, layer.expert_down)
    options = dict(gate_up_views=layer.expert_gate_up_views, down_views=layer.expert_down_views,
                   quantized=layer.quantized_experts)
    if isinstance(router, GroupLimitedSigmoid):
        if layer.dense_experts is not None:
            routed = every_expert(router, x, *layer.dense_experts)
        else:
            logits = None if layer.router_row_kernel is None else _row_kernel_logits(layer, x, router.num_experts)
            routed = routed_experts(router, x, *experts, logits, **options)
        return routed + gated_mlp(x, layer.gate_up, layer.mlp_down, packed=packed, gemm=gemm)
    num_experts = router.num_experts
    if layer.router_row_kernel is None:
        projected = linear(x, layer.router_in)  # [N, E (+ 1)]
    else:
        projected = _row_kernel_logits(layer, x, layer.router_in.shape[0]).to(x.dtype)
    out = routed_experts(router, x, *experts, projected[..., :num_experts], **options)
    if layer.router_in.shape[0] > num_experts:  # a gated shared expert: its gate and up fused once quantized
        shared = gated_mlp(x, None, layer.mlp_down, gate=layer.shared_gate_proj, up=layer.shared_up_proj,
                           packed=packed, gemm=gemm)
        out = out + torch.sigmoid(projected[..., num_experts:]) * shared
    return out


def _row_kernel_logits(layer: LayerWeights, x: torch.Tensor, num_rows: int) -> torch.Tensor:
    """x [..., H] @ the router's rows (`router_row_kernel`) in fp32 on omnimtp's kernel → [..., num_rows] fp32."""
    flat = x.reshape(-1, x.shape[-1]).float()
    out = small_batch_linear.small_batch_linear_unchecked(flat, layer.router_row_kernel, num_rows)
    return out.view(*x.shape[:-1], num_rows)


def decoder_layer(
    decoder: PackedDecoder,
    layer: LayerWeights,
    x: torch.Tensor,
    rope: tuple[torch.Tensor, torch.Tensor],
    kv_buffer: torch.Tensor | list | None,
    layer_index: int,
    where: KVWrite | torch.Tensor | None,
    mask: torch.Tensor | None,
    packed: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    gemm: PackedGemm | None = None,
    output_index: torch.Tensor | None = None,
    rows: QuantizedRows | None = None,
    next_norm: torch.Tensor | None = None,
) -> tuple[torch.Tensor, QuantizedRows | None]:
    """One decoder layer on x [R, T, H] → ([R, T, H], None): attention block, then MLP block, each pre-norm with
    a residual. One row at one position may come as x [H] with rope tables [D] (a decode step): the same
    kernels on the same values, without the [R, T] reshapes.

    rope: (cos, signed_sin) broadcastable to [R, T, 1, D]; kv_buffer, layer_index, where: the layer's
    keys and values are appended by `append_kv`; kv_buffer None: no cache, the T positions attend to their own
    keys and values only (a forward whose keys are never read again: the aligner's); mask: for `attention` (None:
    every column visible); packed: this layer's (qkv, o, gate_up, down) packed by `gemm` (a dense layer), or None.
    output_index [R] (or [R, K]): only that slot (those K slots) of each row is wanted (→ [R, 1 or K, H]): every slot
    still appends its keys and values, but queries, output projection and MLP run on the wanted slots alone.

    A dense "w8a8" layer of several positions a row (`fuses_w8a8`) runs the elementwise work between its int8 GEMMs
    as C passes (`kernels.w8a8_epilogues`), the same values up to the order of a row's sums: rows are x's rows after
    this layer's input norm, already quantized (the previous layer's last pass made them), or None; with next_norm
    (the next layer's input norm weight) the layer returns the rows that layer reads in place of None."""
    lead = x.shape[:-1]  # (R, T), or () for one row at one position
    num_heads, num_kv_heads, head_dim = decoder.num_heads, decoder.num_kv_heads, decoder.head_dim
    num_qk = num_heads + num_kv_heads
    p_qkv, p_o, p_gate_up, p_down = (None, None, None, None) if packed is None else packed
    fused = decoder.fused_norm
    on_epilogues = fuses_w8a8(decoder, layer, x, packed)
    residual = x
    if on_epilogues:
        if rows is None:
            rows = _input_rows(x, layer.input_norm, decoder.eps)
        sums = w8a8_sums(rows[0], p_qkv).view(*lead, num_qk + num_kv_heads, head_dim)  # [R, T, Nq+2Nkv, D]
        qkv = w8a8_epilogues.attention_inputs(
            sums, rows[1], layer.qkv_bias, layer.qk_norm, decoder.eps, *rope, _rope_partner(decoder.rope),
            num_heads, num_kv_heads,
        )  # queries and keys normed and rotated
        qk = qkv[..., :num_qk, :]
    else:
        qkv = linear(rms_norm(x, layer.input_norm, decoder.eps, fused=fused), layer.qkv, layer.qkv_bias, p_qkv, gemm)
        qkv = qkv.view(*lead, num_qk + num_kv_heads, head_dim)  # [R, T, Nq+2Nkv, D]
        qk = qkv[..., :num_qk, :]
        if layer.qk_norm is not None:
            qk = rms_norm(qk, layer.qk_norm, decoder.eps, fused=fused)
        qk = apply_rope(qk, rope[0], rope[1], decoder.rope.source)  # queries and keys at once
    if kv_buffer is None:  # [R, Nkv, T, D] views of this forward's own keys and values
        keys, values = qk[..., num_heads:, :].transpose(1, 2), qkv[..., num_qk:, :].transpose(1, 2)
    else:
        keys, values = append_kv(kv_buffer, layer_index, qk[..., num_heads:, :], qkv[..., num_qk:, :], where)
    queries = qk[..., :num_heads, :]  # [R, T, Nq, D]
    if keys.dtype != queries.dtype:  # a bf16 cache of an fp32 decoder (`kv_dtype`): attention in fp32
        keys, values = keys.to(queries.dtype), values.to(queries.dtype)
    if output_index is not None:
        wanted = output_index if output_index.dim() == 2 else output_index[:, None]  # [R, K]
        index = torch.arange(lead[0], device=x.device)[:, None]
        queries = queries[index, wanted]  # [R, K, Nq, D]
        residual = residual[index, wanted]  # [R, K, H]
        if isinstance(mask, str):  # CAUSAL
            mask = causal_mask(lead[1], x.device)
        if mask is not None:
            mask = mask.expand(lead[0], -1, -1, -1)[:, 0][index, wanted][:, None]  # [R, 1, K, S]
        lead = torch.Size(wanted.shape)
    attn = attention(queries, keys, values, mask, decoder.scaling, fp32_manual=decoder.fp32_attention,
                     bf16_many_rows=decoder.quantize in MANY_ROW_MODES,
                     kv_rows=where.slot_index if isinstance(where, KVWrite) and where.in_place else None)
    if on_epilogues:  # attn [R, T, Nq*D]
        count = lead.numel()
        attn_rows = small_batch_linear.quantize_rows_u8(attn.view(count, -1))
        x, rows = w8a8_epilogues.residual_norm(
            w8a8_sums(attn_rows[0], p_o), attn_rows[1], layer.o_bias, residual.reshape(count, -1), layer.post_norm,
            decoder.eps,
        )
        hidden_rows = w8a8_epilogues.gated(w8a8_sums(rows[0], p_gate_up), rows[1])
        x, rows = w8a8_epilogues.residual_norm(w8a8_sums(hidden_rows[0], p_down), hidden_rows[1], None, x, next_norm,
                                               decoder.eps)
        return x.view(*lead, -1), rows
    out = linear(attn, layer.o, layer.o_bias, p_o, gemm)  # attn [R, T, Nq*D]
    x = residual + (out if layer.attn_scale is None else layer.attn_scale * out)
    residual = x
    normed = rms_norm(x, layer.post_norm, decoder.eps, fused=fused)
    mlp_packed = None if packed is None else (p_gate_up, p_down)
    if not lead:
        out = mlp_block(layer, normed, mlp_packed, gemm)
    else:
        out = mlp_block(layer, normed.view(lead.numel(), -1), mlp_packed, gemm).view(*lead, -1)  # [R, T, H]
    return residual + (out if layer.mlp_scale is None else layer.mlp_scale * out), None


def fuses_w8a8(decoder: PackedDecoder, layer: LayerWeights, x: torch.Tensor, packed) -> bool:
    """Whether `decoder_layer` runs this layer's elementwise work as `kernels.w8a8_epilogues` passes: a dense layer of a
    "w8a8" decoder (`fused_w8a8`) on x [R, T, H] fp32 of several positions a row (a prompt's forward; decode steps stay
    on the torch ops), no gradient, not under torch.compile, where the passes run."""
    return (
        decoder.fused_w8a8 and decoder.quantize in MANY_ROW_MODES and layer.router is None and packed is not None
        and layer.attn_scale is None and layer.mlp_scale is None
        and x.dim() == 3 and x.shape[1] > 1 and x.dtype == torch.float32
        and decoder.head_dim <= w8a8_epilogues.MAX_HEAD_DIM
        and not (torch.is_grad_enabled() and x.requires_grad) and not tracing.is_compiling()
        and w8a8_epilogues.available()
    )


def _input_rows(x: torch.Tensor, weight: torch.Tensor, eps: float) -> QuantizedRows:
    """x [R, T, H]'s rows after RMSNorm (times weight), quantized for a "w8a8" GEMM (x is not modified)."""
    return w8a8_epilogues.residual_norm(x.reshape(-1, x.shape[-1]).contiguous(), None, None, None, weight, eps)[1]


def _rope_partner(rope: Rope) -> torch.Tensor:
    """The channel each channel's rotate_half partner comes from, int64 [D] (`apply_rope`'s roll or gather)."""
    if rope.source is not None:
        return rope.source
    return torch.arange(rope.head_dim).roll(rope.head_dim // 2)


def decoder_layers(
    decoder: PackedDecoder,
    x: torch.Tensor,
    rope: tuple[torch.Tensor, torch.Tensor],
    kv_buffer: torch.Tensor | list | None,
    where: KVWrite | torch.Tensor | None,
    mask: torch.Tensor | None,
    capture_layer: int | None = None,
    packed_layers: tuple | None = None,
    gemm: PackedGemm | None = None,
    layer_adds: tuple[torch.Tensor, ...] = (),
    output_index: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Every layer of `decoder` on x [R, T, H] → (output of the last layer [R, T, H] before the final
    norm, the hidden state `capture_layer` as transformers' `hidden_states` numbers them: 0 = x, k < L =
    output of layer k-1; None when capture_layer is None or L, which the caller takes after its norm).

    layer_adds[i] [R, T, H] is added to the output of layer i before layer i+1 reads it (Qwen3-Omni's
    deepstack visual features, zero off the visual rows); the captured state is the layer's own output,
    as transformers records it. output_index [R] or [R, K]: the slots per row whose output is wanted (→ [R, 1 or K, H]);
    the last layer skips the rest (`decoder_layer`). A decode step of a dense "w4a8" decoder (one new position a
    row, on a `KVCache`'s layer views) runs every layer in one native call instead (`w4a8_step`)."""
    if (
        decoder.quantize == "w4a8" and packed_layers is None and output_index is None and not layer_adds
        and capture_layer in (None, decoder.num_layers) and w4a8_step.applies(x, kv_buffer, where, mask)
    ):  # a decode step of a dense w4a8 decoder: every layer in one native call
        table = w4a8_step.step_table(decoder)
        if table is not None:
            return w4a8_step.run(decoder, table, x, rope, kv_buffer, where, mask), None
    captured = x if capture_layer == 0 else None
    if packed_layers is None and decoder.quantized_layers is not None:
        packed_layers = decoder.quantized_layers
    elif packed_layers is None and decoder.row_kernel is not None and x.shape[:-1].numel() <= ROW_KERNEL_MAX_ROWS:
        packed_layers, gemm = decoder.row_kernel, ROW_KERNEL
    rows = None  # x's rows after the next layer's input norm, quantized by a fused "w8a8" layer (`decoder_layer`)
    for i, layer in enumerate(decoder.layers):
        packed = None if packed_layers is None else packed_layers[i]
        is_last = i == decoder.num_layers - 1
        wanted = output_index if is_last else None
        next_norm = None if is_last or i < len(layer_adds) else decoder.layers[i + 1].input_norm
        x, rows = decoder_layer(decoder, layer, x, rope, kv_buffer, i, where, mask, packed, gemm, wanted, rows,
                                next_norm)
        if capture_layer == i + 1 and capture_layer < decoder.num_layers:
            captured = x
        if i < len(layer_adds):
            x = x + layer_adds[i]
    return x, captured


def shared_length_forward(
    decoder: PackedDecoder,
    cache: KVCache,
    x: torch.Tensor,
    position_ids: torch.Tensor,
    kv_mask: torch.Tensor | None = None,
    output_index: torch.Tensor | None = None,
) -> torch.Tensor:
    """The stack on input embeddings x [B, T, H] appended to slots 0..B-1 of a `cache` whose slots share
    one length (the speculative loops' cache: the target and the MTP head), RoPE at position_ids [B, T],
    attention limited by kv_mask [B, length + T] (1 = a real position; None = all real) and causal by
    slot; position_ids may be [3, B, T] M-RoPE ids. → the last layer's output [B, T, H] before the final norm,
    or [B, 1, H] of slot output_index [B] of each row only (a drafter that reads one slot per row)."""
    batch_size, num_new, _ = x.shape
    slots = list(range(batch_size))
    start = cache.length
    if kv_mask is not None and tuple(kv_mask.shape) != (batch_size, start + num_new):
        raise ValueError(f"kv_mask must be [B, {start + num_new}] (cache length + T), got {tuple(kv_mask.shape)}")
    where = cache.plan(slots, num_new)
    mask = kv_mask_attention_mask(kv_mask, start, num_new, decoder.dtype, x.device)  # [B, 1, T, S] or None
    if (
        batch_size == 1 and num_new == 1 and position_ids.dim() == 2 and position_ids.device.type == "cpu"
    ):  # one token on 1-D vectors
        rope = decoder.step_tables(int(position_ids))
        out, _ = decoder_layers(decoder, x.view(-1), rope, cache.layer_views, where, mask)
        out = out.view(1, 1, -1)
    else:
        rope = decoder.rope.tables(position_ids, decoder.dtype)  # [B, T, 1, D]
        out, _ = decoder_layers(decoder, x, rope, cache.layer_views, where, mask, output_index=output_index)
    cache.commit(slots, num_new)
    return out


def kv_mask_attention_mask(
    kv_mask: torch.Tensor | None, start: int, num_new: int, dtype: torch.dtype, device
) -> torch.Tensor | None:
    """Additive SDPA mask [B, 1, T, start + T] (0 = attend, -inf = not): valid slots up to the query's own
    slot. SDPA turns a boolean mask into exactly this on every call; building it once per forward saves
    that per layer. None when every slot is valid and T == 1. A query always sees its own slot, so rows
    of padding tokens (no valid key at all) stay finite instead of NaN; real tokens never attend to them."""
    num_columns = start + num_new
    if kv_mask is not None and bool(kv_mask.all()):
        kv_mask = None
    if kv_mask is None and num_new == 1:
        return None
    columns = torch.arange(num_columns, device=device)
    slots = start + torch.arange(num_new, device=device)
    mask = columns[None, :] <= slots[:, None]  # [T, S] causal by slot
    if kv_mask is None:
        mask = mask[None]  # [1, T, S] broadcast over rows
    else:
        mask = mask[None] & kv_mask.bool()[:, None, :]  # [B, T, S]
        mask = mask | (columns[None, :] == slots[:, None])[None]
    return torch.zeros(mask.shape, dtype=dtype, device=device).masked_fill_(~mask, float("-inf"))[:, None]


def weights_fingerprint(model) -> tuple:
    """Identity and in-place version of every parameter: changes when a weight is replaced or edited
    (what packed copies are checked against). Inference tensors (made under `torch.inference_mode`) keep
    no version counter: for them only a replaced weight shows."""
    return tuple(
        (p.data_ptr(), None if p.is_inference() else p._version, p.dtype, p.device) for p in model.parameters()
    )
