"""The verify forward of a GLM-5 (`glm_moe_dsa`) target: each of the k+1 rows selects its DSA keys as
one-token decoding would (`omnimtp.mtp.dsa.decode_selection`), so greedy verification reproduces
`generate`. The prefill and plain decoding use transformers' own forward, which is what `generate` runs.
The cache is transformers' `DynamicCache` of `DynamicIndexedLayer`s: cropping it drops the indexer's keys
with the MLA latents."""

from __future__ import annotations

import torch

from omnimtp.mtp.dsa import dsa_layer


def is_dsa_target(target) -> bool:
    return target.config.get_text_config(decoder=True).model_type == "glm_moe_dsa"


def dsa_verify_forward(target, input_ids, position_ids, kv_mask, cache, num_prompt_slots: int) -> torch.Tensor:
    """input_ids, position_ids [B, T]; kv_mask [B, cache length + T] (1 = real slot); the first
    `num_prompt_slots` slots are the prompt's (left padding included) → post-norm hidden [B, T, H]."""
    decoder = target.get_decoder()
    num_tokens = input_ids.shape[1]
    num_slots = kv_mask.shape[1]
    hidden = decoder.embed_tokens(input_ids)  # [B, T, H]
    position_embeddings = decoder.rotary_emb(hidden, position_ids=position_ids)
    slots = torch.arange(num_slots, device=input_ids.device)
    query_slots = num_slots - num_tokens + torch.arange(num_tokens, device=input_ids.device)
    allowed = kv_mask.bool()[:, None, :] & (slots[None, :] <= query_slots[:, None])[None]  # [B, T, S]
    selection = None
    for layer in decoder.layers[: decoder.config.num_hidden_layers]:
        own = layer.self_attn.indexer is not None
        hidden, selection = dsa_layer(
            layer, hidden, position_embeddings, cache, allowed, selection=None if own else selection,
            num_prompt_slots=num_prompt_slots,
        )
    return decoder.norm(hidden)
