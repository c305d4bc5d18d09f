"""Train the demo causal LM that ships with omnimtp (seeded, reproducible, resumable).

Corpus: the Python standard library's own ``.py`` files shipped with the interpreter
(``sysconfig.get_paths()["stdlib"]``, without test directories and site-packages). Files are split
deterministically by a hash of their relative path: one in ``--heldout-every`` is held out for
evaluation and never seen in training (neither by the tokenizer nor by the LM or its MTP head).

Model: a Glm4Moe config with every target layer dense (``first_k_dense_replace`` > ``num_hidden_layers``)
and ``num_nextn_predict_layers=1``: the architecture transformers' ``generate(use_mtp=True)`` decodes.
transformers always builds the MTP layer ``model.layers.{N}`` as a MoE block, so the config's MoE fields
(two always-active routed experts + one shared, each a quarter of the dense width) describe that layer only.
Deep and narrow on purpose: drafting costs one layer plus the lm_head, verifying costs N layers plus the
lm_head, so the head's share is small.

Usage (the shipped model used the first line: 300 steps, ~20 min on one free CPU thread, ~40 on a busy one)::

    python scripts/train_demo_lm.py --work runs/demo_lm --out runs/demo_lm/lm --steps 300
    python scripts/train_demo_lm.py --work runs/demo_lm --out runs/demo_lm/lm --steps 300 --resume

Then the MTP head (``--tv-weight 0`` gives the CE-only comparison head, same seed, data, steps and learning
rate; ~12-16 min on one thread of a busy 2-core machine)::

    STDLIB="$(python -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')"
    omnimtp train-mtp --model runs/demo_lm/lm --data "$STDLIB" \
        --suffixes .py --out runs/demo_lm/head --with-target -k 3 --steps 200 --batch-size 8 --seq-len 256 \
        --lr 2e-3 --tv-weight 6.0 --eval-every 50 --checkpoint-every 50 --threads 1

The shipped head continues from that one on the LM's own greedy continuations of training text
(self-distillation, what it drafts for at inference; ~45 min in all on one thread), three stages of the same
command with ``--init`` the previous stage's output, ``--lr 1e-3`` and, in order: 150 steps on 300 k tokens of
``gen-distill-data`` (seed 0) at ``--distill-fraction 0.5``; 300 steps on the same rows at 0.8; 400 steps on
those rows and 300 k more (``gen-distill-data --seed 1``, the two files' ``input_ids`` concatenated) at 0.8::

    omnimtp gen-distill-data --model runs/demo_lm/lm --data "$STDLIB" --suffixes .py --out distill.safetensors \
        --num-tokens 300000 --threads 1
    omnimtp train-mtp ... --init runs/demo_lm/head --out runs/demo_lm/head_d1 --steps 150 --lr 1e-3 \
        --distill-data distill.safetensors --distill-fraction 0.5

and copy the last stage's output without ``mtp_train_state.pt`` to ``omnimtp/data/demo_lm``. Compare heads
(held-out acceptance with standard errors, paired vs the first head)::

    python benchmarks/compare_heads.py --model runs/demo_lm/lm --heads runs/demo_lm/head_ce runs/demo_lm/head \
        --names ce cetv6 --num-prompts 96 --max-new-tokens 96
"""

from __future__ import annotations

import argparse
import json
import math
import sysconfig
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import Glm4MoeConfig, Glm4MoeForCausalLM, PreTrainedTokenizerFast

from omnimtp.mtp.train import collect_text_files, encode_files

EOS_TOKEN = "<|endoftext|>"


def stdlib_files(heldout_every: int) -> tuple[list[Path], list[Path]]:
    """(train, heldout) lists of the stdlib's .py files; `omnimtp train-mtp --data <stdlib> --suffixes .py`
    makes the same split, so the MTP head never sees the LM's held-out files either."""
    return collect_text_files([sysconfig.get_paths()["stdlib"]], heldout_every, suffixes=(".py",))


def read_text(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


def heldout_prompts(files: list[Path], num_prompts: int, num_chars: int = 300) -> list[str]:
    """Prompts cut at a line start in the middle of the first `num_prompts` held-out files with enough text."""
    prompts = []
    for path in files:
        text = read_text(path)
        start = text.find("\n", len(text) // 2) + 1
        if start == 0 or len(text) - start < num_chars:
            continue
        chunk = text[start : start + num_chars]
        prompts.append(chunk[: chunk.rfind("\n") + 1])  # whole lines only
        if len(prompts) == num_prompts:
            break
    return prompts


def train_tokenizer(files: list[Path], vocab_size: int) -> PreTrainedTokenizerFast:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator((read_text(p) for p in files), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token=EOS_TOKEN, bos_token=EOS_TOKEN, pad_token=EOS_TOKEN
    )


def demo_config(vocab_size: int, eos_token_id: int, args: argparse.Namespace) -> Glm4MoeConfig:
    num_layers = args.num_layers
    return Glm4MoeConfig(
        vocab_size=vocab_size,
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=args.hidden_size // 64,
        num_key_value_heads=max(1, args.hidden_size // 128),
        head_dim=64,
        max_position_embeddings=2048,
        first_k_dense_replace=num_layers + 1,  # every layer dense, the MTP layer N included
        num_nextn_predict_layers=1,
        # transformers builds every MTP layer as a MoE block (`get_mtp_config` sets first_k_dense_replace=0):
        # two routed experts, both always active (the router's group scoring needs >= 2), plus one shared
        # expert, each a quarter of the dense width. Only the MTP layer uses these fields.
        n_routed_experts=2,
        n_shared_experts=1,
        num_experts_per_tok=2,
        moe_intermediate_size=args.intermediate_size // 4,
        tie_word_embeddings=False,
        initializer_range=0.02,
        rope_parameters={"rope_type": "default", "rope_theta": 10_000.0, "partial_rotary_factor": 0.5},
        bos_token_id=eos_token_id,
        eos_token_id=eos_token_id,
        pad_token_id=eos_token_id,
    )


def batch_at(stream: torch.Tensor, step: int, batch_size: int, seq_len: int, seed: int) -> torch.Tensor:
    """Random windows of the stream; a function of (seed, step) only, so resuming replays exactly."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, stream.numel() - seq_len - 1, (batch_size,), generator=generator)
    return torch.stack([stream[s : s + seq_len + 1] for s in starts.tolist()]).long()  # [B, T+1]


def learning_rate(step: int, args: argparse.Namespace) -> float:
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


@torch.no_grad()
def heldout_loss(model: Glm4MoeForCausalLM, stream: torch.Tensor, seq_len: int, num_windows: int) -> float:
    model.eval()
    stride = max(1, (stream.numel() - seq_len - 1) // num_windows)
    losses = []
    for i in range(num_windows):
        window = stream[i * stride : i * stride + seq_len + 1].long()[None]  # [1, T+1]
        logits = model(input_ids=window[:, :-1]).logits  # [1, T, V]
        losses.append(torch.nn.functional.cross_entropy(logits[0], window[0, 1:]).item())
    model.train()
    return sum(losses) / len(losses)


def training_parser(description: str, *, num_layers: int, seq_len: int, batch_size: int, steps: int,
                    checkpoint_every: int) -> argparse.ArgumentParser:
    """The arguments both demo LMs' training scripts take (model width, data, schedule, resuming)."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, required=True, help="scratch dir: token streams, checkpoints, log")
    parser.add_argument("--out", type=Path, required=True, help="final model dir (save_pretrained + tokenizer)")
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--heldout-every", type=int, default=16)
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--intermediate-size", type=int, default=512)
    parser.add_argument("--num-layers", type=int, default=num_layers)
    parser.add_argument("--seq-len", type=int, default=seq_len)
    parser.add_argument("--batch-size", type=int, default=batch_size)
    parser.add_argument("--steps", type=int, default=steps, help="length of the learning-rate schedule")
    parser.add_argument("--stop-at", type=int, default=None,
                        help="end training at this step (the schedule still spans --steps)")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--checkpoint-every", type=int, default=checkpoint_every)
    parser.add_argument("--threads", type=int, default=1)
    return parser


def token_streams(work: Path, tokenizer, train_files: list[Path], heldout_files: list[Path]) -> dict[str, torch.Tensor]:
    """{"train", "heldout"} token streams of the files, cached in `work`/streams.pt."""
    streams_path = work / "streams.pt"
    if not streams_path.exists():
        torch.save({"train": encode_files(tokenizer, train_files), "heldout": encode_files(tokenizer, heldout_files)},
                   streams_path)
    streams = torch.load(streams_path)
    print(f"files train={len(train_files)} heldout={len(heldout_files)} "
          f"tokens train={streams['train'].numel()} heldout={streams['heldout'].numel()}", flush=True)
    return streams


def resume(model, optimizer, checkpoint_path: Path) -> int:
    """Load the training state saved at `checkpoint_path` when there is one; returns the step to start at."""
    if not checkpoint_path.exists():
        return 0
    state = torch.load(checkpoint_path)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    print(f"resumed at step {state['step']}", flush=True)
    return state["step"]


def save_model(model, tokenizer, out: Path, prompts: list[str], dtype: torch.dtype) -> None:
    """`save_pretrained` in `dtype` with the tokenizer and `heldout_prompts.json`; the config says float32, so
    `from_pretrained` casts back (weights stored in bfloat16 fit the size budget)."""
    model.to(dtype)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    config_path = out / "config.json"
    config_json = json.loads(config_path.read_text())
    config_json["dtype"] = "float32"
    config_path.write_text(json.dumps(config_json, indent=2, sort_keys=True) + "\n")
    tokenizer.save_pretrained(out)
    (out / "heldout_prompts.json").write_text(json.dumps(prompts, indent=1))


def main() -> None:
    parser = training_parser(__doc__, num_layers=12, seq_len=256, batch_size=16, steps=300, checkpoint_every=50)
    parser.add_argument("--vocab-size", type=int, default=2048)
    parser.add_argument("--save-dtype", choices=["float32", "bfloat16"], default="bfloat16")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    args.work.mkdir(parents=True, exist_ok=True)
    tokenizer_dir = args.work / "tokenizer"
    train_files, heldout_files = stdlib_files(args.heldout_every)
    (args.work / "heldout_files.json").write_text(json.dumps([str(p) for p in heldout_files], indent=1))
    if not (tokenizer_dir / "tokenizer.json").exists():
        train_tokenizer(train_files, args.vocab_size).save_pretrained(tokenizer_dir)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(tokenizer_dir)
    streams = token_streams(args.work, tokenizer, train_files, heldout_files)

    torch.manual_seed(args.seed)
    config = demo_config(len(tokenizer), tokenizer.eos_token_id, args)
    model = Glm4MoeForCausalLM(config)
    print(f"parameters: {sum(p.numel() for p in model.parameters()) / 1e6:.2f} M", flush=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    checkpoint_path = args.work / "checkpoint.pt"
    start_step = resume(model, optimizer, checkpoint_path) if args.resume else 0

    model.train()
    started = time.time()
    end_step = args.steps if args.stop_at is None else min(args.steps, args.stop_at)
    for step in range(start_step, end_step):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, args)
        batch = batch_at(streams["train"], step, args.batch_size, args.seq_len, args.seed)  # [B, T+1]
        logits = model(input_ids=batch[:, :-1]).logits  # [B, T, V]
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if step % 10 == 0:
            elapsed = time.time() - started
            print(f"step {step} loss {loss.item():.4f} lr {learning_rate(step, args):.2e} {elapsed:.0f}s", flush=True)
        if (step + 1) % args.checkpoint_every == 0 or step + 1 == end_step:
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step + 1},
                       checkpoint_path)
    print(f"heldout loss {heldout_loss(model, streams['heldout'], args.seq_len, 16):.4f}", flush=True)

    model.eval()
    save_model(model, tokenizer, args.out, heldout_prompts(heldout_files, 16), getattr(torch, args.save_dtype))
    print(f"saved to {args.out}", flush=True)


if __name__ == "__main__":
    main()
