"""GLM-5 (`glm_moe_dsa`) decoder layers with the DSA key selection made explicit.

transformers' `GlmMoeDsaAttention` runs its indexer and attends to the top-k keys it picks. A speculative
verify and the MTP head need other selections than a plain forward makes:

- verify of k+1 tokens: each row must pick its top-k among the keys at or before it *exactly as one-token
  decoding does*. The indexer's ReLU makes many scores exactly 0, so top-k breaks ties, and which tied keys
  it keeps depends on the length and order of the array it sorts: row t of a block forward (keys after t
  masked to -inf) can keep other keys than decoding token t, and its output then differs. `decode_selection`
  sorts, per row, the array `generate` would sort: the prompt's slots (its left padding at -inf), then that
  row's real slots up to the query — the holes of rejected drafts are left out.
- IndexShare (`index_share_for_mtp_iteration`): MTP draft steps 1..k-1 attend to draft step 0's selection
  plus the draft chain's own newer keys, instead of running the indexer again (its keys are still written).

`dsa_layer` is the decoder layer with the selection given (or made by the indexer): the layer's own
modules, transformers' attention function and cache (`update` for the MLA latents, `update_indexer` for
the indexer keys), so with transformers' selection it equals the layer's forward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import (
    apply_rotary_pos_emb_interleave,
    eager_attention_forward,
)


def _rotate(x: torch.Tensor, rope_dim: int, cos, sin) -> torch.Tensor:
    """Interleaved RoPE on the first `rope_dim` features of x [B, T, heads, D]."""
    x_rot, x_pass = torch.split(x, [rope_dim, x.shape[-1] - rope_dim], dim=-1)
    x_rot, _ = apply_rotary_pos_emb_interleave(x_rot, x_rot, cos, sin, unsqueeze_dim=2)
    return torch.cat([x_rot, x_pass], dim=-1)


def indexer_logits(indexer, hidden, q_resid, position_embeddings, keys: torch.Tensor | None = None) -> torch.Tensor:
    """The indexer's scores, as `GlmMoeDsaIndexer.forward` computes them before its mask and top-k, of the
    cached `keys` [B, S, D] (None: the T new tokens' own keys) → [B, T, S] float32. Differentiable (the
    indexer's training loss uses it; decoding goes through `indexer_scores`)."""
    batch_size, num_tokens, _ = hidden.shape
    cos, sin = position_embeddings
    q = indexer.wq_b(q_resid).view(batch_size, num_tokens, indexer.n_heads, indexer.head_dim)  # [B, T, h, D]
    q = _rotate(q, indexer.qk_rope_head_dim, cos, sin)
    if keys is None:
        keys = indexer_keys(indexer, hidden, position_embeddings)
    scores = F.relu(torch.matmul(q.float(), keys.transpose(-1, -2).float().unsqueeze(1)) * indexer.softmax_scale)
    weights = indexer.weights_proj(hidden.to(indexer.weights_proj.weight.dtype)).float() * indexer.n_heads**-0.5
    return torch.matmul(weights.unsqueeze(-2), scores).squeeze(-2)  # [B, T, S]


def indexer_keys(indexer, hidden, position_embeddings) -> torch.Tensor:
    """The indexer keys of hidden [B, T, H] → [B, T, D]."""
    cos, sin = position_embeddings
    return _rotate(indexer.k_norm(indexer.wk(hidden)).unsqueeze(2), indexer.qk_rope_head_dim, cos, sin).squeeze(2)


@torch.no_grad()
def indexer_scores(indexer, hidden, q_resid, position_embeddings, cache, layer_idx: int) -> torch.Tensor:
    """The indexer's scores of every cached key (the new keys written to `cache` first): → [B, T, S] float32."""
    keys = cache.update_indexer(indexer_keys(indexer, hidden, position_embeddings), layer_idx)  # [B, S, D]
    return indexer_logits(indexer, hidden, q_resid, position_embeddings, keys)


def topk_selection(scores: torch.Tensor, allowed: torch.Tensor, index_topk: int) -> torch.Tensor:
    """The top `index_topk` allowed keys of each row: scores, allowed [B, T, S] → selected [B, T, S] bool."""
    masked = scores.masked_fill(~allowed, float("-inf"))
    top = masked.topk(min(index_topk, scores.shape[-1]), dim=-1).indices
    return torch.zeros_like(allowed).scatter(-1, top, True) & allowed


def decode_selection(
    scores: torch.Tensor, allowed: torch.Tensor, index_topk: int, num_prompt_slots: int
) -> torch.Tensor:
    """`topk_selection` row by row on the array one-token decoding sorts (see the module docstring): the
    first `num_prompt_slots` slots (masked ones at -inf), then the allowed later slots in order. scores,
    allowed [B, T, S]; the T queries are the last T slots. A row with no hole before its query sorts its
    first columns as they are, so such rows go through one top-k per query position together (the per-row
    arrays of a batched top-k are sorted as each alone); rows with holes take their own array."""
    selected = torch.zeros_like(allowed)
    batch_size, num_tokens, num_slots = scores.shape
    slots = torch.arange(num_slots, device=scores.device)
    for t in range(num_tokens):
        length = num_slots - num_tokens + t + 1  # the query's own slot and every slot before it
        whole = allowed[:, t, num_prompt_slots:length].all(dim=-1)  # [B] no hole after the prompt
        rows = whole.nonzero().squeeze(1)
        if rows.numel():
            values = scores[rows, t, :length].masked_fill(~allowed[rows, t, :length], float("-inf"))  # [R, length]
            top = values.topk(min(index_topk, length), dim=-1).indices  # [R, k]
            picked = torch.zeros(rows.numel(), num_slots, dtype=torch.bool, device=scores.device)
            selected[rows, t] = picked.scatter_(1, top, True)
        for row in (~whole).nonzero().squeeze(1).tolist():
            keep = allowed[row, t] | (slots < num_prompt_slots)
            columns = slots[keep]
            values = scores[row, t, columns].masked_fill(~allowed[row, t, columns], float("-inf"))
            top = values.topk(min(index_topk, columns.numel())).indices
            selected[row, t, columns[top]] = True
    return selected & allowed


def mla_projections(attn, x: torch.Tensor, position_embeddings):
    """`GlmMoeDsaAttention`'s projections of x [B, T, H] (the normed layer input), RoPE applied:
    (q_resid [B, T, q_lora], queries [B, heads, T, D], latent k_pass [B, 1, T, kv_lora], k_rot [B, 1, T, rope])."""
    batch_size, num_tokens, _ = x.shape
    q_resid = attn.q_a_layernorm(attn.q_a_proj(x))
    q_states = attn.q_b_proj(q_resid).view(batch_size, num_tokens, -1, attn.qk_head_dim).transpose(1, 2)
    q_pass, q_rot = torch.split(q_states, [attn.qk_nope_head_dim, attn.qk_rope_head_dim], dim=-1)
    kv_pass, k_rot = torch.split(attn.kv_a_proj_with_mqa(x), [attn.kv_lora_rank, attn.qk_rope_head_dim], dim=-1)
    k_pass = attn.kv_a_layernorm(kv_pass).view(batch_size, 1, num_tokens, attn.kv_lora_rank)
    k_rot = k_rot.view(batch_size, 1, num_tokens, attn.qk_rope_head_dim)
    q_rot, k_rot = apply_rotary_pos_emb_interleave(q_rot, k_rot, *position_embeddings)
    return q_resid, torch.cat((q_pass, q_rot), dim=-1), k_pass, k_rot


def dsa_layer(
    layer,
    hidden: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor],
    cache,
    allowed: torch.Tensor,
    selection: torch.Tensor | None = None,
    num_prompt_slots: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One `GlmMoeDsaDecoderLayer` appended to `cache`: hidden [B, T, H] → (hidden [B, T, H], selected [B, T, S]).

    allowed [B, T, S] bool: the keys each new row may attend to (causal, real slots). selection [B, T, S']
    (S' ≤ S): the selection of the first S' key columns, given (IndexShare, or a "shared" indexer layer's
    previous selection); later columns follow `allowed`. None: the layer's indexer selects, by
    `decode_selection` with `num_prompt_slots` when given, else `topk_selection`."""
    attn = layer.self_attn
    batch_size, num_tokens, _ = hidden.shape
    residual = hidden
    x = layer.input_layernorm(hidden)
    q_resid, query_states, k_pass, k_rot = mla_projections(attn, x, position_embeddings)
    k_pass, k_rot = cache.update(k_pass, k_rot, attn.layer_idx)
    key_states, value_states = attn.expand_kv(k_pass, k_rot)

    if attn.indexer is not None and selection is None:
        scores = indexer_scores(attn.indexer, x, q_resid, position_embeddings, cache, attn.layer_idx)
        if num_prompt_slots is None:
            selected = topk_selection(scores, allowed, attn.indexer.index_topk)
        else:
            selected = decode_selection(scores, allowed, attn.indexer.index_topk, num_prompt_slots)
    else:
        if selection is None:
            raise ValueError("selection: a layer without its own indexer needs the previous layer's selection")
        if attn.indexer is not None:  # IndexShare: the keys are written, the indexer does not select
            cache.update_indexer(indexer_keys(attn.indexer, x, position_embeddings), attn.layer_idx)
        tail = allowed[..., selection.shape[-1] :]
        selected = torch.cat([selection & allowed[..., : selection.shape[-1]], tail], dim=-1)

    attention = ALL_ATTENTION_FUNCTIONS.get_interface(attn.config._attn_implementation, eager_attention_forward)
    mask = selected[:, None]  # [B, 1, T, S]
    if attn.config._attn_implementation == "eager":
        mask = torch.zeros(mask.shape, dtype=hidden.dtype, device=hidden.device).masked_fill(
            ~mask, torch.finfo(hidden.dtype).min
        )
    out, _ = attention(attn, query_states, key_states, value_states, mask, dropout=0.0, scaling=attn.scaling)
    hidden = residual + attn.o_proj(out.reshape(batch_size, num_tokens, -1))
    return hidden + layer.mlp(layer.post_attention_layernorm(hidden)), selected


def indexer_kl_loss(attn, hidden: torch.Tensor, position_embeddings) -> torch.Tensor:
    """The DSA indexer's training loss (DeepSeek-V3.2's lightning-indexer objective, dense form): KL from the
    main attention's distribution over the causal keys (softmax probabilities summed over heads, renormalised)
    to the indexer's softmax over the same keys, averaged over queries. hidden [B, T, H]: the layer's normed
    input (`input_layernorm` output), every query attending to its own and earlier rows. The attention side and
    the inputs are detached: gradients reach the indexer's own weights only (the selection itself is top-k,
    not differentiable, so nothing else trains the indexer)."""
    hidden = hidden.detach()
    num_tokens = hidden.shape[1]
    causal = torch.ones(num_tokens, num_tokens, dtype=torch.bool, device=hidden.device).tril()
    with torch.no_grad():
        q_resid, queries, k_pass, k_rot = mla_projections(attn, hidden, position_embeddings)
        keys, _ = attn.expand_kv(k_pass, k_rot)
        scores = torch.matmul(queries, keys.transpose(-1, -2)) * attn.scaling  # [B, heads, T, T]
        probs = scores.masked_fill(~causal, float("-inf")).softmax(-1).sum(1)
        target = probs / probs.sum(-1, keepdim=True)  # [B, T, T]
    logits = indexer_logits(attn.indexer, hidden, q_resid, position_embeddings)  # [B, T, T]
    log_q = logits.masked_fill(~causal, float("-inf")).log_softmax(-1)
    return (target * (target.clamp_min(1e-12).log() - log_q).masked_fill(~causal, 0.0)).sum(-1).mean()
