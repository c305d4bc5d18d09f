"""MTP speculative decoding per family on tiny seeded targets: τ and speed-up over plain decoding, one run.

For each family a tiny seeded target (`omnimtp.models.tiny_lm`) gets an MTP head trained by
`train_mtp_head` (self-distillation: the target as teacher on its own greedy text, as `train-mtp
--distill-data` does), then greedy speculative decoding at k = 3 runs side by side with plain decoding
on the same forward (`plain_generate`) and with transformers' `generate`, on held-out prompts of the
target's own text. Outputs are checked equal. GLM-5 (`glm_moe_dsa`) runs twice, a head trained and
drafting with IndexShare on and one with it off (`index_share_for_mtp_iteration`), with `index_topk` below
the sequence length so that the selection matters.

    python benchmarks/mtp_families.py [--steps 300] [--threads 1] [--out benchmarks/results/mtp_families.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from omnimtp.models.tiny_lm import tiny_lm  # noqa: E402
from omnimtp.mtp.head import MTPHead  # noqa: E402
from omnimtp.mtp.train import MTPTrainConfig, generate_distill_rows, train_mtp_head  # noqa: E402
from omnimtp.spec_decode.generate import plain_generate, speculative_generate  # noqa: E402

CASES = [
    ("glm4_moe", {}),
    ("deepseek_v3", {}),
    ("qwen3_next", {}),
    ("qwen3_5", {}),
    ("qwen3_5_moe", {}),
    ("glm_moe_dsa", {"index_share_for_mtp_iteration": True}),
    ("glm_moe_dsa", {"index_share_for_mtp_iteration": False}),
]


def _timed(fn, repeats: int) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), out


def bench(family: str, config_kwargs: dict, args) -> dict:
    target = tiny_lm(family, seed=0, **config_kwargs).eval()
    vocab = target.config.vocab_size
    generator = torch.Generator().manual_seed(1)
    stream = torch.randint(3, vocab, (4096,), generator=generator, dtype=torch.int32)
    rows = generate_distill_rows(target, stream, args.train_rows + args.num_prompts, seq_len=args.seq_len,
                                 prompt_len=8, seed=0, progress=False)  # the target's own greedy text
    train_rows, held_out = rows[: args.train_rows], rows[args.train_rows :]
    config = MTPTrainConfig(num_draft_tokens=args.k, steps=args.steps, batch_size=8, seq_len=args.seq_len,
                            lr=3e-3, warmup_steps=20, eval_every=args.steps, num_eval_windows=4, seed=0)
    torch.manual_seed(0)
    head = MTPHead.from_config(target).float()
    started = time.perf_counter()
    trained = train_mtp_head(target, head, train_rows, held_out.reshape(-1), config, progress=False)
    train_s = time.perf_counter() - started
    prompts = held_out[:, : args.prompt_len].long()  # [N, P]: same length, no padding
    common = dict(max_new_tokens=args.max_new_tokens, eos_token_id=-1)
    spec_s, spec = _timed(lambda: speculative_generate(target, head, prompts, num_draft_tokens=args.k, **common),
                          args.repeats)
    plain_s, plain = _timed(lambda: plain_generate(target, prompts, **common), args.repeats)
    with torch.no_grad():
        hf_s, hf = _timed(lambda: target.generate(prompts, do_sample=False, max_new_tokens=args.max_new_tokens,
                                                  eos_token_id=-1, pad_token_id=0), args.repeats)
    stats = spec.stats.to_dict()
    tokens = prompts.shape[0] * args.max_new_tokens
    result = dict(
        family=family, **{k: v for k, v in config_kwargs.items()}, k=args.k, batch_size=prompts.shape[0],
        train_steps=args.steps, train_s=round(train_s, 1),
        held_out_tau_after_training=round(trained.evals[-1]["tau_greedy"], 3),
        tau=round(stats["mean_acceptance_length"], 3),
        acceptance_per_position=[round(a, 3) for a in stats["acceptance_per_position"]],
        spec_tokens_per_s=round(tokens / spec_s, 1), plain_tokens_per_s=round(tokens / plain_s, 1),
        hf_tokens_per_s=round(tokens / hf_s, 1), speedup_vs_plain=round(plain_s / spec_s, 2),
        speedup_vs_hf=round(hf_s / spec_s, 2),
        identical=bool(torch.equal(spec.sequences, plain) and torch.equal(spec.sequences, hf)),
    )
    print(json.dumps(result), flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300, help="head training steps per family")
    parser.add_argument("--train-rows", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--num-prompts", type=int, default=4, help="held-out prompts, decoded as one batch")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("-k", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--family", action="append", help="only these families (repeatable)")
    parser.add_argument("--out", default="benchmarks/results/mtp_families.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    results = [bench(family, kwargs, args) for family, kwargs in CASES if not args.family or family in args.family]
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(dict(machine=platform.processor() or platform.machine(), threads=args.threads, args=vars(args),
                       results=results), f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
