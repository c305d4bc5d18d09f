"""Cost of one verify step of a hybrid target (Gated DeltaNet + full attention) under each exact way of
leaving no trace of rejected drafts in the recurrent state.

    python benchmarks/hybrid_rollback.py [--family qwen3_next] [--num-layers 2] [--batch-size 1] [--threads 1]
        [--widths tiny|qwen3_next]

A prompt of 32 tokens is prefilled, then a k + 1 = 4 token block is verified (and undone, so every repeat
sees the same cache). Rows keep `--kept` tokens of the block. Strategies:
  verify only            the forward alone: the all-accepted case, nothing to undo (transformers' chunked
                         rule for the linear layers, and the recurrent one that omnimtp's verify takes)
  omnimtp rollback       snapshot, forward (recurrent rule, layer inputs recorded), restore + the linear
                         layers' token mixers re-run on the kept tokens one token at a time
                         (`omnimtp.spec_decode.hybrid.rollback`)
  re-feed the prefix     snapshot, forward, restore, then the whole target again on the kept tokens
  per-token layers       our own layer loop: linear layers one token at a time inside every verify, each
                         token's state kept (whole decoder layer per token, or only its token mixer)

`--widths qwen3_next` gives the layers Qwen3-Next-80B-A3B's widths (hidden 2048; linear attention 16 key
heads and 32 value heads of 128; attention 16 heads, 2 KV heads of 256; 10 routed experts of 512 and a
shared one a token) with 16 experts in the pool instead of 512 (the same work a token, random weights).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
from transformers import DynamicCache
from transformers.masking_utils import create_causal_mask

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from omnimtp.models.tiny_lm import tiny_lm, tiny_lm_config  # noqa: E402
from omnimtp.spec_decode.hybrid import (  # noqa: E402
    crop_attention,
    linear_layer_indices,
    rollback,
    snapshot,
    verify_blocks,
)

QWEN3_NEXT_WIDTHS = dict(
    hidden_size=2048, num_attention_heads=16, num_key_value_heads=2, head_dim=256, linear_num_key_heads=16,
    linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128, moe_intermediate_size=512,
    shared_expert_intermediate_size=512, num_experts=16, num_experts_per_tok=10, intermediate_size=5120,
)


def _restore(cache, saved):
    for i, (conv, recurrent) in saved.items():
        cache.layers[i].conv_states[0].copy_(conv)
        cache.layers[i].recurrent_states[0].copy_(recurrent)


def _per_token_layers(target, ids, positions, cache, mixer_only: bool):
    decoder = target.get_decoder()
    config = decoder.config
    hidden = decoder.embed_tokens(ids)
    mask = create_causal_mask(
        config=config, inputs_embeds=hidden, attention_mask=None, cache=cache, position_ids=positions
    )
    position_embeddings = decoder.rotary_emb(hidden, positions)
    states = []
    for i, layer in enumerate(decoder.layers[: config.num_hidden_layers]):
        if config.layer_types[i] != "linear_attention":
            hidden = layer(hidden, position_embeddings=position_embeddings, attention_mask=mask, position_ids=positions,
                           cache=cache)
            continue
        rows = []
        source = layer.input_layernorm(hidden) if mixer_only else hidden
        for t in range(ids.shape[1]):
            if mixer_only:
                rows.append(layer.linear_attn(hidden_states=source[:, t : t + 1], cache=cache, attention_mask=None))
            else:
                rows.append(layer(source[:, t : t + 1], position_embeddings=position_embeddings, cache=cache))
            states.append((cache.layers[i].conv_states[0].clone(), cache.layers[i].recurrent_states[0].clone()))
        if mixer_only:
            hidden = hidden + torch.cat(rows, dim=1)
            residual = hidden
            mlp_out = layer.mlp(layer.post_attention_layernorm(hidden))
            hidden = residual + (mlp_out[0] if isinstance(mlp_out, tuple) else mlp_out)
        else:
            hidden = torch.cat(rows, dim=1)
    return decoder.norm(hidden), states


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", default="qwen3_next", choices=["qwen3_next", "qwen3_5", "qwen3_5_moe"])
    parser.add_argument(
        "--num-layers", type=int, default=2, help="decoder layers (every 4th full attention; 2: one of each)"
    )
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--kept", type=int, default=2, help="tokens of the 4-token block the rows keep")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--widths", default="tiny", choices=["tiny", "qwen3_next"])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    config = tiny_lm_config(args.family)
    if args.widths == "qwen3_next":
        for name, value in QWEN3_NEXT_WIDTHS.items():
            setattr(config, name, value)
    if args.num_layers != 2:
        config.num_hidden_layers = args.num_layers
        config.layer_types = [
            "full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(args.num_layers)
        ]
    target = type(tiny_lm(args.family))(config).eval()
    decoder = target.get_decoder()
    layers = linear_layer_indices(target)
    batch, width, kept = args.batch_size, 4, args.kept
    prompt = torch.randint(3, 64, (batch, 32), generator=torch.Generator().manual_seed(0))
    block = torch.randint(3, 64, (batch, width), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(32, 32 + width)[None].expand(batch, -1)
    num_kept = torch.full((batch,), kept)

    with torch.inference_mode():
        cache = DynamicCache(config=target.config)
        decoder(input_ids=prompt, cache=cache, use_cache=True)
        base = snapshot(cache, layers)

        def verify_only():
            decoder(input_ids=block, position_ids=positions, cache=cache, use_cache=True)

        def verify_recurrent():
            with verify_blocks(target):
                verify_only()

        def omnimtp_rollback():
            saved = snapshot(cache, layers)
            with verify_blocks(target):
                out = decoder(
                    input_ids=block, position_ids=positions, cache=cache, use_cache=True, output_hidden_states=True
                )
            crop_attention(cache, width - kept)
            rollback(target, cache, saved, out.hidden_states, num_kept)

        def refeed():
            saved = snapshot(cache, layers)
            decoder(input_ids=block, position_ids=positions, cache=cache, use_cache=True)
            crop_attention(cache, width)
            _restore(cache, saved)
            decoder(input_ids=block[:, :kept], position_ids=positions[:, :kept], cache=cache, use_cache=True)

        def per_token(mixer_only):
            return lambda: _per_token_layers(target, block, positions, cache, mixer_only)

        def one_token_step():
            decoder(input_ids=block[:, :1], position_ids=positions[:, :1], cache=cache, use_cache=True)

        print(f"{args.family} at {args.widths} widths, {config.num_hidden_layers} layers ({len(layers)} linear), "
              f"batch {batch}, block {width}, rows keep {kept}, {args.threads} thread(s)")
        cases = [("verify only (all accepted)", verify_only, width),
                 ("verify only, recurrent rule", verify_recurrent, width), ("omnimtp rollback", omnimtp_rollback, kept),
                 ("re-feed the kept prefix", refeed, kept), ("per-token layers in verify", per_token(False), width),
                 ("per-token mixers in verify", per_token(True), width), ("plain one-token step", one_token_step, 1)]
        for name, step, _appended in cases:
            times = []
            for repeat in range(args.repeats + 3):
                start = time.perf_counter()
                step()
                if repeat >= 3:
                    times.append(time.perf_counter() - start)
                crop_attention(cache, cache.get_seq_length() - 32)  # back to the prompt
                _restore(cache, base)
            times.sort()
            print(f"  {name:30s} {1e3 * times[len(times) // 2]:7.2f} ms (median of {args.repeats})")


if __name__ == "__main__":
    main()
