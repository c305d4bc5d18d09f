"""Train the GLM-5 demo LM that ships with omnimtp (`glm_moe_dsa`; seeded, reproducible, resumable).

Data and tokenizer are the demo LM's (`scripts/train_demo_lm.py`): the standard library's ``.py`` sources,
the same hash split (held-out files never seen by the tokenizer, the LM or its MTP head) and the shipped
demo LM's BPE tokenizer (trained on the same training files), so both demos read the same token streams.

Model: transformers' GlmMoeDsa: MLA attention, a DSA indexer per layer choosing ``index_topk`` keys (below
the training and decoding context, so the selection matters), MoE layers after the first dense one, one MTP
layer and ``index_share_for_mtp_iteration: true``.

The indexer: transformers' `GlmMoeDsaIndexer.forward` runs under ``no_grad`` (top-k is not differentiable),
so the LM loss never reaches it and a random indexer would pick random keys. It is trained as DeepSeek-V3.2's
DSA trains its lightning indexer: a KL loss pulling the indexer's softmax over the causal keys towards the
main attention's distribution (probabilities summed over heads, renormalised), with the attention side and
the indexer's inputs detached, so the indexer loss changes the indexer only (DSA's dense warm-up objective,
here alongside the LM loss from step 0; the LM itself always trains with the sparse selection it decodes with).

Usage (the shipped model: the schedule of 400 steps cut at 250, ~18 min at ~4.4 s a step on one thread of a
busy 2-core machine; 3.6 M parameters, held-out loss 4.57; run from the repository root)::

    python scripts/train_demo_glm5.py --work runs/demo_glm5 --out runs/demo_glm5/lm --stop-at 250

then the MTP heads of the ablation's arms, and the best one installed with the target (see
``benchmarks/mtp_ablation.py``)::

    python benchmarks/mtp_ablation.py --model runs/demo_glm5/lm --work runs/demo_glm5/ablation \
        --install omnimtp/data/demo_glm5
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM, PreTrainedTokenizerFast

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]  # this tree's omnimtp
from train_demo_lm import (  # noqa: E402
    batch_at,
    heldout_loss,
    heldout_prompts,
    learning_rate,
    resume,
    save_model,
    stdlib_files,
    token_streams,
    training_parser,
)

from omnimtp.mtp.demo import DEMO_MODEL_DIR  # noqa: E402
from omnimtp.mtp.dsa import indexer_kl_loss  # noqa: E402


def demo_glm5_config(vocab_size: int, eos_token_id: int, args: argparse.Namespace) -> GlmMoeDsaConfig:
    hidden = args.hidden_size
    config = GlmMoeDsaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=args.intermediate_size,
        moe_intermediate_size=args.intermediate_size // 4,
        num_hidden_layers=args.num_layers,
        first_k_dense_replace=1,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        n_group=1,
        topk_group=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=128,
        kv_lora_rank=64,
        qk_rope_head_dim=16,
        qk_nope_head_dim=32,
        v_head_dim=48,
        index_topk=args.index_topk,
        index_head_dim=32,
        index_n_heads=4,
        num_nextn_predict_layers=1,
        index_share_for_mtp_iteration=True,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        initializer_range=0.02,
        rope_parameters={"rope_type": "default", "rope_theta": 10_000.0},
        bos_token_id=eos_token_id,
        eos_token_id=eos_token_id,
        pad_token_id=eos_token_id,
    )
    config._attn_implementation = "sdpa"
    return config


class IndexerLoss:
    """Collects, during a training forward, each DSA layer's indexer KL loss against its main attention
    (see the module docstring). Hooks on every `GlmMoeDsaAttention`; `pop()` returns the mean and resets."""

    def __init__(self, model: GlmMoeDsaForCausalLM):
        self.losses: list[torch.Tensor] = []
        self.handles = [
            layer.self_attn.register_forward_pre_hook(self._hook, with_kwargs=True)
            for layer in model.model.layers
            if layer.self_attn.indexer is not None
        ]

    def _hook(self, attn, args, kwargs):
        if attn.training:
            self.losses.append(indexer_kl_loss(attn, kwargs["hidden_states"], kwargs["position_embeddings"]))

    def pop(self) -> torch.Tensor:
        loss = torch.stack(self.losses).mean()
        self.losses = []
        return loss


def main() -> None:
    parser = training_parser(__doc__, num_layers=4, seq_len=128, batch_size=8, steps=400, checkpoint_every=25)
    parser.add_argument("--index-topk", type=int, default=32)
    parser.add_argument("--indexer-weight", type=float, default=1.0)
    parser.add_argument("--num-prompts", type=int, default=48)
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    args.work.mkdir(parents=True, exist_ok=True)
    train_files, heldout_files = stdlib_files(args.heldout_every)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(DEMO_MODEL_DIR)
    streams = token_streams(args.work, tokenizer, train_files, heldout_files)

    torch.manual_seed(args.seed)
    config = demo_glm5_config(len(tokenizer), tokenizer.eos_token_id, args)
    model = GlmMoeDsaForCausalLM(config)
    print(f"parameters: {sum(p.numel() for p in model.parameters()) / 1e6:.2f} M", flush=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    checkpoint_path = args.work / "checkpoint.pt"
    start_step = resume(model, optimizer, checkpoint_path) if args.resume else 0

    indexer_loss = IndexerLoss(model)
    model.train()
    started = time.time()
    end_step = args.steps if args.stop_at is None else min(args.steps, args.stop_at)
    for step in range(start_step, end_step):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, args)
        batch = batch_at(streams["train"], step, args.batch_size, args.seq_len, args.seed)  # [B, T+1]
        logits = model(input_ids=batch[:, :-1]).logits  # [B, T, V]
        lm_loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        kl = indexer_loss.pop()
        optimizer.zero_grad(set_to_none=True)
        (lm_loss + args.indexer_weight * kl).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if step % 10 == 0:
            print(f"step {step} loss {lm_loss.item():.4f} indexer_kl {kl.item():.4f} "
                  f"lr {learning_rate(step, args):.2e} {time.time() - started:.0f}s", flush=True)
        if (step + 1) % args.checkpoint_every == 0 or step + 1 == end_step:
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step + 1},
                       checkpoint_path)
    model.eval()
    print(f"heldout loss {heldout_loss(model, streams['heldout'], args.seq_len, 16):.4f}", flush=True)

    prompts = heldout_prompts(heldout_files, args.num_prompts)
    save_model(model, tokenizer, args.out, prompts, torch.bfloat16)
    print(f"saved to {args.out} ({len(prompts)} held-out prompts) in {time.time() - started:.0f}s", flush=True)


if __name__ == "__main__":
    main()
