"""Train the demo Qwen3-Omni that ships with omnimtp (`omnimtp speak --demo`, `OmniPipeline.demo()`): the tiny
Qwen3-Omni whose thinker is a trained small byte-level LM with a trained MTP head; the audio and vision
encoders, the talker, its code predictor and code2wav stay the seeded random ones of `omnimtp.models.tiny`.

Corpus: the Python standard library's ``.py`` files shipped with the interpreter, split as
``scripts/train_demo_lm.py`` splits them (one file in ``--heldout-every`` held out by a hash of its path).
Each training row is one chat turn in the byte tokenizer's template: a user turn holding a few lines of a
file, and the assistant's reply continuing the file, closed by ``<|im_end|>``::

    <|im_start|>user\\n{lines a}<|im_end|>\\n<|im_start|>assistant\\n{the lines after a}<|im_end|>

so a chat prompt holding code gets the code's continuation, and replies end. Thinker: every layer dense
(``mlp_only_layers``), deep and narrow (drafting costs one layer and the lm_head, verifying all of them),
M-RoPE as the real model. Then the thinker's MTP head trains on the same rows with the thinker frozen
(`omnimtp.mtp.train.train_mtp_head`, CE + TV, k = 3), half of each batch text windows and half the
thinker's own replies to training prompts (self-distillation: what it drafts for at inference), greedy and,
with ``--distill-sampled-fraction``, sampled with the thinker's sampled defaults.
Lines lose their indentation (`dedented`). Seeded; about 12 minutes on one
core of a busy 2-core box for the thinker, and as long again for the head below::

    python scripts/train_demo_omni.py --out omnimtp/data/demo_omni

The shipped head was retrained on that thinker (same seed) with twice the replies, half of them sampled, and
800 steps; copy ``model-mtp.safetensors`` from the output into ``omnimtp/data/demo_omni``::

    python scripts/train_demo_omni.py --out runs/demo_omni_s --thinker-from omnimtp/data/demo_omni \
        --distill-rows 2048 --distill-sampled-fraction 0.5 --head-steps 800
"""

from __future__ import annotations

import argparse
import json
import math
import sysconfig
import time
from pathlib import Path

import torch

from omnimtp.models.tiny import THINKER_SPECIAL_TOKENS as T
from omnimtp.models.tiny import _init_talker_experts, scale_code2wav_to_speech_level, tiny_qwen3_omni_config
from omnimtp.mtp.head import MTPHead
from omnimtp.mtp.train import MTPTrainConfig, collect_text_files, train_mtp_head

USER_HEADER = [T["<|im_start|>"], T["user"], 10]
ASSISTANT_HEADER = [T["<|im_end|>"], 10, T["<|im_start|>"], T["assistant"], 10]
END = [T["<|im_end|>"]]


def demo_thinker_text(args: argparse.Namespace) -> dict:
    head_dim = 64
    quarter = head_dim // 2
    return dict(
        hidden_size=args.hidden_size, intermediate_size=args.intermediate_size, num_hidden_layers=args.num_layers,
        num_attention_heads=args.hidden_size // head_dim, num_key_value_heads=1, head_dim=head_dim,
        mlp_only_layers=list(range(args.num_layers)), initializer_range=0.02,
        rope_parameters={"rope_type": "default", "rope_theta": 10_000.0,
                         "mrope_section": [quarter - 2 * (quarter // 3), quarter // 3, quarter // 3],
                         "interleaved": True},
    )


def dedented(data: bytes) -> bytes:
    """Every line without its leading whitespace, runs of blank lines as one: a small byte-level LM cannot
    count indentation, and its greedy replies then stay stuck in runs of spaces or tabs."""
    lines = [line.lstrip(b" \t") for line in data.split(b"\n")]
    kept = [line for i, line in enumerate(lines) if line or (i > 0 and lines[i - 1])]
    return b"\n".join(kept)


def chat_rows(files: list[Path], seq_len: int, seed: int) -> torch.Tensor:
    """One row of `seq_len` ids per window of the files: user lines + the assistant's continuation + <|im_end|>
    (shorter turns are padded with <|im_end|> repeats, which the loss skips)."""
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for path in files:
        data = dedented(path.read_bytes())
        budget = seq_len - len(USER_HEADER) - len(ASSISTANT_HEADER) - len(END)
        for start in range(0, max(1, len(data) - budget), budget):
            chunk = data[start : start + budget]
            split = int(torch.randint(32, 128, (), generator=generator))
            newline = chunk.find(b"\n", split)
            split = newline + 1 if 0 < newline < budget // 2 else split
            ids = USER_HEADER + list(chunk[:split]) + ASSISTANT_HEADER + list(chunk[split:]) + END
            rows.append(ids + END * (seq_len - len(ids)))
    return torch.tensor(rows, dtype=torch.long)


def learning_rate(step: int, args) -> float:
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def thinker_logits(thinker, input_ids: torch.Tensor) -> torch.Tensor:
    return thinker.lm_head(thinker.get_decoder()(input_ids=input_ids).last_hidden_state)


def train_thinker(thinker, rows: torch.Tensor, args) -> None:
    parameters = [
        p for name, p in thinker.named_parameters() if not name.startswith(("model.audio_tower", "model.visual"))
    ]
    optimizer = torch.optim.AdamW(parameters, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    thinker.train()
    started = time.time()
    for step in range(args.steps):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, args)
        generator = torch.Generator().manual_seed(args.seed * 1_000_003 + step)
        batch = rows[torch.randint(0, rows.shape[0], (args.batch_size,), generator=generator)]  # [B, L]
        targets = batch[:, 1:].masked_fill((batch[:, 1:] == END[0]) & (batch[:, :-1] == END[0]), -100)  # padding
        logits = thinker_logits(thinker, batch[:, :-1])  # [B, L-1, V]
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(parameters, 1.0)
        optimizer.step()
        if step % 10 == 0 or step + 1 == args.steps:
            print(f"thinker step {step} loss {loss.item():.4f} {time.time() - started:.0f}s", flush=True)
    thinker.eval()


def distill_rows(
    model, rows: torch.Tensor, num_rows: int, seq_len: int, reply_len: int, seed: int, sampled_fraction: float = 0.0
) -> torch.Tensor:
    """Self-distillation rows for the head: user turns of `num_rows` training rows followed by the trained
    thinker's own reply (`ThinkerRun`, what the head drafts for at inference), padded with <|im_end|>: greedy,
    or for the last `sampled_fraction` of the rows sampled with Qwen3-Omni's thinker defaults (T 0.7, top-k 20,
    top-p 0.8; seeded), the text a sampled request drafts on."""
    from omnimtp.sampling import SamplingParams, make_generators
    from omnimtp.thinker import ThinkerRun

    generator = torch.Generator().manual_seed(seed)
    picked = rows[torch.randperm(rows.shape[0], generator=generator)[:num_rows]].tolist()
    prompts = []
    for row in picked:
        end = next(i for i in range(len(row)) if row[i : i + len(ASSISTANT_HEADER)] == ASSISTANT_HEADER)
        prompts.append(row[: end + len(ASSISTANT_HEADER)])
    out = []
    num_greedy = len(prompts) - round(sampled_fraction * len(prompts))
    sampled = SamplingParams(temperature=0.7, top_k=20, top_p=0.8)
    for start in range(0, len(prompts), 64):
        batch = prompts[start : start + 64]
        sampling = [None if start + b < num_greedy else sampled for b in range(len(batch))]
        run = ThinkerRun(model.thinker, batch, accept_hidden_layer=model.config.talker_config.accept_hidden_layer,
                         eos_token_ids={END[0]}, max_new_tokens=reply_len, sampling=sampling,
                         generators=make_generators([seed + start + b for b in range(len(batch))]))
        with torch.inference_mode():
            while not run.is_finished:
                run.step()
        for prompt, reply in zip(batch, run.output_ids, strict=True):
            ids = (prompt + reply)[:seq_len]
            out.append(ids + END * (seq_len - len(ids)))
    return torch.tensor(out, dtype=torch.int32)


def heldout_prompts(files: list[Path], num_prompts: int, num_bytes: int = 96) -> list[str]:
    """User turns cut at line starts from held-out files (never trained on)."""
    prompts = []
    for path in files:
        text = dedented(path.read_bytes()).decode("utf-8", errors="replace")
        start = text.find("\n", len(text) // 2) + 1
        chunk = text[start : start + num_bytes]
        if start == 0 or not chunk.isascii() or chunk.count("\n") < 2:
            continue
        prompts.append(chunk[: chunk.rfind("\n") + 1])
        if len(prompts) == num_prompts:
            break
    return prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--heldout-every", type=int, default=16)
    parser.add_argument("--hidden-size", type=int, default=128)
    parser.add_argument("--intermediate-size", type=int, default=384)
    parser.add_argument("--num-layers", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--lr", type=float, default=4e-3)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--head-steps", type=int, default=120)
    parser.add_argument("--distill-rows", type=int, default=512,
                        help="rows of the thinker's own greedy replies the head also trains on (half of each batch)")
    parser.add_argument("--distill-sampled-fraction", type=float, default=0.0,
                        help="the share of those replies sampled with the thinker's sampled defaults (else greedy)")
    parser.add_argument(
        "--thinker-from", type=Path, default=None,
        help="skip the thinker's training: take the omni checkpoint this script wrote there (same seed)",
    )
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()

    from transformers import Qwen3OmniMoeForConditionalGeneration

    from omnimtp.media import tiny_processor
    from omnimtp.pipeline import OmniPipeline
    from omnimtp.tokenizer import byte_tokenizer

    torch.set_num_threads(args.threads)
    train_files, heldout_files = collect_text_files([sysconfig.get_paths()["stdlib"]], args.heldout_every, (".py",))
    train_rows = chat_rows(train_files, args.seq_len, args.seed)
    heldout_rows = chat_rows(heldout_files, args.seq_len, args.seed + 1)
    print(f"files train={len(train_files)} heldout={len(heldout_files)} rows train={len(train_rows)} "
          f"heldout={len(heldout_rows)}", flush=True)

    if args.thinker_from is not None:
        model = Qwen3OmniMoeForConditionalGeneration.from_pretrained(args.thinker_from, dtype=torch.float32).eval()
        thinker = model.thinker
    else:
        config = tiny_qwen3_omni_config(accept_hidden_layer=args.num_layers // 2, thinker_text=demo_thinker_text(args))
        # the shipped demo's one-block tower (its thinker learns text only)
        vision = config.thinker_config.vision_config
        vision.depth, vision.deepstack_visual_indexes = 1, [0]
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(args.seed)
            model = Qwen3OmniMoeForConditionalGeneration(config)
            _init_talker_experts(model)
            with torch.no_grad():  # the thinker's own init scale (the tiny config's 0.2 is the random talker's)
                model.thinker.get_input_embeddings().weight.normal_(0.0, 0.02)
                model.thinker.lm_head.weight.normal_(0.0, 0.02)
        model.eval()
        scale_code2wav_to_speech_level(model.code2wav)
        thinker = model.thinker
        num_text_params = sum(p.numel() for p in thinker.model.language_model.parameters())
        print(f"thinker text parameters: {num_text_params / 1e6:.2f} M", flush=True)
        torch.manual_seed(args.seed)
        train_thinker(thinker, train_rows, args)
    for p in model.parameters():
        p.requires_grad_(False)

    distilled = distill_rows(model, train_rows, args.distill_rows, args.seq_len, 128, args.seed,
                             args.distill_sampled_fraction) if args.distill_rows else None
    torch.manual_seed(args.seed)
    head = MTPHead.from_config(thinker).float()
    head_config = MTPTrainConfig(
        num_draft_tokens=3, steps=args.head_steps, batch_size=8, seq_len=args.seq_len, lr=2e-3, warmup_steps=8,
        tv_weight=6.0, eval_every=args.head_steps, num_eval_windows=8, checkpoint_every=10**9, seed=args.seed,
        distill_fraction=0.5,
    )
    work = args.out.parent / (args.out.name + "_work")
    result = train_mtp_head(thinker, head, train_rows.flatten(), heldout_rows.flatten(), head_config,
                            checkpoint_dir=work, progress=False, distill_rows=distilled)
    print(json.dumps({k: v for k, v in result.evals[-1].items() if not isinstance(v, list)}), flush=True)

    tokenizer = byte_tokenizer()
    processor = tiny_processor(tokenizer, model.config.thinker_config)
    OmniPipeline(model, tokenizer, processor=processor).save_pretrained(args.out)
    head.save_pretrained(args.out)
    (args.out / "heldout_prompts.json").write_text(json.dumps(heldout_prompts(heldout_files, 16), indent=1))
    print(f"saved to {args.out}", flush=True)


if __name__ == "__main__":
    main()
