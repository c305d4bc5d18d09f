"""`omnimtp train-mtp`: train an MTP head for a causal LM checkpoint on text files (self-distillation)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import time
from pathlib import Path


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "train-mtp",
        help="train an MTP (NextN) head for a causal LM by self-distillation",
        description="Train an MTP head: the target is frozen; the head learns the target's own next-token "
        "distributions from its hidden rows, unrolled k steps as at inference (loss = CE + tv_weight * TV).",
    )
    parser.add_argument("--model", required=True,
                        help="transformers checkpoint dir (weights + tokenizer); a Qwen3-Omni checkpoint trains a head "
                        "for its thinker")
    parser.add_argument("--data", nargs="+", required=True, help="text files or directories (.py .txt .md .rst)")
    parser.add_argument("--eval-data", nargs="+", default=None,
                        help="held-out text (default: one file in --heldout-every of --data)")
    parser.add_argument("--heldout-every", type=int, default=16,
                        help="every N-th --data file is held out for evaluation")
    parser.add_argument("--suffixes", nargs="+", default=None,
                        help="file endings read from directories (default .py .txt .md .rst)")
    parser.add_argument("--out", required=True, help="output dir: the head (model-mtp.safetensors) + training state")
    parser.add_argument("--with-target", action="store_true",
                        help="also copy the target's files into --out, making it a complete checkpoint")
    parser.add_argument("--init", default=None, help="start from the MTP head stored in this checkpoint dir")
    parser.add_argument("-k", "--num-draft-tokens", type=int, default=3,
                        help="draft steps the head is unrolled and trained for")
    parser.add_argument("--steps", type=int, default=1000, help="optimizer steps")
    parser.add_argument("--batch-size", type=int, default=8, help="windows per step")
    parser.add_argument("--seq-len", type=int, default=256, help="tokens per window")
    parser.add_argument("--lr", type=float, default=1e-3,
                        help="peak learning rate (AdamW: linear warm-up, then cosine decay to a tenth)")
    parser.add_argument("--warmup-steps", type=int, default=20, help="linear learning-rate warm-up steps")
    parser.add_argument("--tv-weight", type=float, default=1.0, help="weight of the total-variation term of the loss")
    parser.add_argument("--tv-weight-start", type=float, default=None,
                        help="TV weight at step 0, moving linearly to --tv-weight at the last step (default: constant)")
    parser.add_argument("--indexer-weight", type=float, default=1.0,
                        help="GLM-5 heads: weight of the DSA indexer's KL loss to the head's attention")
    parser.add_argument("--step-weights", type=float, nargs="+", default=None,
                        help="loss weight of each draft step (default 0.8 ** (i - 1))")
    parser.add_argument("--eval-every", type=int, default=100, help="steps between held-out evaluations (acceptance τ)")
    parser.add_argument("--num-eval-windows", type=int, default=16, help="held-out windows per evaluation")
    parser.add_argument("--checkpoint-every", type=int, default=100,
                        help="steps between saved training states (--resume)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the head's init and the data order")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--device", default="cpu", help="where the target and the head train (cpu, cuda, cuda:N)")
    parser.add_argument("--resume", action="store_true", help="continue from the training state in --out")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar (the summary lines still print)")
    parser.add_argument("--distill-data", default=None,
                        help="train on these self-distillation rows (a file `omnimtp gen-distill-data` wrote) instead "
                        "of windows of the --data files; --data still gives the held-out evaluation text")
    parser.add_argument("--distill-fraction", type=float, default=1.0,
                        help="with --distill-data: share of each batch taken from its rows, the rest are windows "
                        "of the --data training files (default 1: rows only)")
    parser.set_defaults(handler=run)

    gen = subparsers.add_parser(
        "gen-distill-data",
        help="write self-distillation data for train-mtp: training-text prompts + the target's own continuations",
        description="Rows of --seq-len tokens: --prompt-len tokens of a training file window (held-out files are "
        "never used) followed by the target's own continuation (packed plain decoding; greedy, or sampled at "
        "--temperature with per-row seeds). Train on them with `omnimtp train-mtp --distill-data FILE`.",
    )
    gen.add_argument("--model", required=True, help="transformers checkpoint dir (weights + tokenizer)")
    gen.add_argument("--data", nargs="+", required=True, help="text files or directories (.py .txt .md .rst)")
    gen.add_argument("--heldout-every", type=int, default=16, help="the held-out split of train-mtp (same value)")
    gen.add_argument("--suffixes", nargs="+", default=None,
                     help="file endings read from directories (default .py .txt .md .rst)")
    gen.add_argument("--out", required=True, help="output file (safetensors: input_ids [rows, seq_len] int32)")
    gen.add_argument("--num-tokens", type=int, required=True,
                     help="generated tokens in all (rounded up to whole rows of seq_len - prompt_len)")
    gen.add_argument("--seq-len", type=int, default=256, help="row length; train-mtp --seq-len must match")
    gen.add_argument("--prompt-len", type=int, default=64, help="tokens of training text that start each row")
    gen.add_argument("--temperature", type=float, default=0.0,
                     help="sampling temperature of the continuations; 0: greedy")
    gen.add_argument("--batch-size", type=int, default=32, help="rows decoded together")
    gen.add_argument("--seed", type=int, default=0, help="seed of the window choice and the sampled rows")
    gen.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    gen.add_argument("--no-progress", action="store_true", help="no progress bar (the summary line still prints)")
    gen.set_defaults(handler=run_gen_distill_data)


def copy_target_files(model_dir: Path, out_dir: Path) -> None:
    """Copy the target checkpoint's files (not an MTP layer or index already there) into `out_dir`."""
    from omnimtp.mtp.head import MTP_WEIGHTS_NAME, SAFE_INDEX_NAME

    out_dir.mkdir(parents=True, exist_ok=True)
    for path in sorted(model_dir.iterdir()):
        if path.is_file() and path.name not in (MTP_WEIGHTS_NAME, SAFE_INDEX_NAME):
            shutil.copy2(path, out_dir / path.name)
    index = model_dir / SAFE_INDEX_NAME
    if index.exists():  # a sharded target: keep its weight map, minus a previous MTP layer
        weight_map = json.loads(index.read_text())
        weight_map["weight_map"] = {k: v for k, v in weight_map["weight_map"].items() if v != MTP_WEIGHTS_NAME}
        (out_dir / SAFE_INDEX_NAME).write_text(json.dumps(weight_map, indent=2))


def load_target(model_dir: Path):
    """The causal LM of a checkpoint dir in fp32, eval mode; for a Qwen3-Omni checkpoint (model_type
    "qwen3_omni_moe") its thinker, the LM an MTP head drafts for."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3OmniMoeForConditionalGeneration

    config = json.loads((model_dir / "config.json").read_text()) if (model_dir / "config.json").is_file() else {}
    if config.get("model_type") == "qwen3_omni_moe":
        return Qwen3OmniMoeForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).thinker.eval()
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def _load_model_and_data_args(args: argparse.Namespace):
    """--model (a checkpoint dir: tokenizer + causal LM in fp32, eval mode; a Qwen3-Omni's thinker) and --suffixes →
    (model_dir, tokenizer, target, suffixes)."""
    from transformers import AutoTokenizer

    from omnimtp.mtp.train import DATA_SUFFIXES

    model_dir = Path(args.model)
    if not model_dir.is_dir():
        raise ValueError(f"--model: {args.model!r} is not a directory")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    target = load_target(model_dir)
    suffixes = tuple(args.suffixes) if args.suffixes else DATA_SUFFIXES
    return model_dir, tokenizer, target, suffixes


def run(args: argparse.Namespace) -> int:
    import torch

    from omnimtp.mtp.head import MTPHead
    from omnimtp.mtp.train import MTPTrainConfig, collect_text_files, encode_files, train_mtp_head
    from omnimtp.runtime.device import resolve_device

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    config = MTPTrainConfig(
        num_draft_tokens=args.num_draft_tokens, steps=args.steps, batch_size=args.batch_size,
        seq_len=args.seq_len, lr=args.lr, warmup_steps=args.warmup_steps, tv_weight=args.tv_weight,
        tv_weight_start=args.tv_weight_start, indexer_weight=args.indexer_weight,
        step_weights=tuple(args.step_weights) if args.step_weights else None, eval_every=args.eval_every,
        num_eval_windows=args.num_eval_windows, checkpoint_every=args.checkpoint_every, seed=args.seed,
        distill_fraction=args.distill_fraction,
    )
    out_dir = Path(args.out)
    device = resolve_device(args.device, "--device")
    model_dir, tokenizer, target, suffixes = _load_model_and_data_args(args)
    target = target.to(device)  # the head is made on the target's device
    train_files, heldout_files = collect_text_files(args.data, args.heldout_every, suffixes)
    if args.eval_data:
        heldout_files = collect_text_files(args.eval_data, 10**9, suffixes)[0]
    if not heldout_files:
        raise ValueError("--data: no held-out files (pass --eval-data or a lower --heldout-every)")
    train_stream = encode_files(tokenizer, train_files)
    eval_stream = encode_files(tokenizer, heldout_files)
    print(f"train: {len(train_files)} files, {train_stream.numel()} tokens; "
          f"held out: {len(heldout_files)} files, {eval_stream.numel()} tokens", flush=True)
    distill_rows = None
    if args.distill_data is not None:
        distill_rows = load_distill_rows(args.distill_data)
        if distill_rows.shape[1] != config.seq_len:
            raise ValueError(f"--distill-data: rows of {distill_rows.shape[1]} tokens, --seq-len is {config.seq_len}")
        print(f"self-distillation rows: {tuple(distill_rows.shape)} from {args.distill_data}, "
              f"{config.distill_fraction:g} of each batch", flush=True)

    torch.manual_seed(args.seed)
    head = MTPHead.from_pretrained(args.init, target) if args.init else MTPHead.from_config(target)
    head.float()
    start = time.perf_counter()
    result = train_mtp_head(target, head, train_stream, eval_stream, config, checkpoint_dir=out_dir,
                            resume=args.resume, progress=not args.no_progress, distill_rows=distill_rows)
    if args.with_target:
        copy_target_files(model_dir, out_dir)
    head.save_pretrained(out_dir)
    summary = {"out": str(out_dir), "steps": config.steps, "tv_weight": config.tv_weight,
               "tv_weight_start": config.tv_weight_start, "indexer_weight": config.indexer_weight,
               "num_draft_tokens": config.num_draft_tokens,
               "config": dataclasses.asdict(config), "train_files": len(train_files),
               "heldout_files": len(heldout_files), "distill_data": args.distill_data, "evals": result.evals}
    (out_dir / "mtp_train_log.json").write_text(json.dumps(summary, indent=1))
    last = result.evals[-1]
    resumed = f"resumed at step {result.start_step}, " if result.start_step else ""
    print(f"train-mtp: {resumed}steps {result.start_step}→{len(result.losses)} of {config.steps} in "
          f"{time.perf_counter() - start:.1f} s; held-out τ {last['tau_greedy']:.2f} greedy, "
          f"{last['tau_sampled']:.2f} sampled at step {last['step']}; head written to {out_dir}", flush=True)
    print(json.dumps({"step": last["step"], "tau_greedy": round(last["tau_greedy"], 3),
                      "tau_sampled": round(last["tau_sampled"], 3), "ce": round(last["ce"], 4),
                      "tv": round(last["tv"], 4)}))
    return 0


DISTILL_ROWS_KEY = "input_ids"


def load_distill_rows(path: str | Path):
    """The rows [N, L] int32 of a file `omnimtp gen-distill-data` wrote."""
    from safetensors.torch import load_file

    path = Path(path)
    if not path.is_file():
        raise ValueError(f"--distill-data: {str(path)!r} is not a file")
    tensors = load_file(path)
    rows = tensors.get(DISTILL_ROWS_KEY)
    if rows is None or rows.dim() != 2:
        raise ValueError(f"--distill-data: {str(path)!r} holds no 2-D {DISTILL_ROWS_KEY!r} tensor")
    return rows


def run_gen_distill_data(args: argparse.Namespace) -> int:
    import torch
    from safetensors.torch import save_file

    from omnimtp.mtp.train import collect_text_files, encode_files, generate_distill_rows

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.num_tokens < 1:
        raise ValueError(f"--num-tokens must be >= 1, got {args.num_tokens}")
    if args.prompt_len < 1 or args.seq_len <= args.prompt_len:
        raise ValueError(f"--seq-len must exceed --prompt-len >= 1, got {args.seq_len} and {args.prompt_len}")
    model_dir, tokenizer, target, suffixes = _load_model_and_data_args(args)
    train_files, _ = collect_text_files(args.data, args.heldout_every, suffixes)
    train_stream = encode_files(tokenizer, train_files)
    continuation_len = args.seq_len - args.prompt_len
    num_rows = -(-args.num_tokens // continuation_len)
    start = time.perf_counter()
    rows = generate_distill_rows(target, train_stream, num_rows, seq_len=args.seq_len, prompt_len=args.prompt_len,
                                 temperature=args.temperature, seed=args.seed, batch_size=args.batch_size,
                                 progress=not args.no_progress)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    metadata = {"model": str(model_dir), "train_files": str(len(train_files)), "heldout_every": str(args.heldout_every),
                "seq_len": str(args.seq_len), "prompt_len": str(args.prompt_len),
                "temperature": str(args.temperature), "seed": str(args.seed)}
    save_file({DISTILL_ROWS_KEY: rows.contiguous()}, str(out), metadata=metadata)
    print(f"gen-distill-data: {rows.shape[0]} rows of {args.seq_len} tokens ({rows.shape[0] * continuation_len} "
          f"generated) from {len(train_files)} files in {time.perf_counter() - start:.1f} s; written to {out}",
          flush=True)
    print(json.dumps({**metadata, "out": str(out), "rows": rows.shape[0],
                      "generated_tokens": rows.shape[0] * continuation_len}))
    return 0
