"""Plain greedy vs our MTP speculative decoding vs transformers `generate(use_mtp=True)`, same checkpoint.

    python benchmarks/spec_decode.py [--model DIR] [--quick] [--target-backend auto|packed|transformers]
        [--out benchmarks/results/spec_decode.json]

Without --model a tiny random Glm4Moe (+ random MTP head) is built and saved to a temp dir. A random head
gives τ ≈ 1 (almost every draft rejected), so speculative decoding is *slower* there; the numbers that
matter come with a trained head (`--model`). transformers' use_mtp is batch-1 only and drafts
num_mtp_layers (= 1) token per step, so it appears once per batch-1 row, independent of k.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from omnimtp import MTPHead, load_target_and_head, speculative_generate  # noqa: E402
from omnimtp.models.tiny_lm import tiny_lm  # noqa: E402


def _timed(fn):
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="checkpoint dir with an MTP layer (default: tiny random)")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--max-new-tokens", type=int, default=None)
    parser.add_argument("--target-backend", default="auto", choices=["auto", "packed", "transformers"])
    parser.add_argument("--out", default="benchmarks/results/spec_decode.json")
    args = parser.parse_args()
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    max_new = args.max_new_tokens or (16 if args.quick else 64)
    ks = [1, 3] if args.quick else [1, 2, 3, 4, 5]

    model_dir = args.model
    if model_dir is None:
        model_dir = tempfile.mkdtemp(prefix="spec_bench_")
        target = tiny_lm("glm4_moe", seed=0)
        torch.manual_seed(0)
        target.save_pretrained(model_dir)
        MTPHead.from_config(target).save_pretrained(model_dir)
    target, head = load_target_and_head(model_dir)
    vocab = target.config.vocab_size
    g = torch.Generator().manual_seed(0)
    results = {"model": args.model or "tiny random glm4_moe", "max_new_tokens": max_new,
               "target_backend": args.target_backend, "runs": []}
    for batch in (1, 4):
        prompt = torch.randint(3, vocab, (batch, 16), generator=g)
        kw = dict(max_new_tokens=max_new, eos_token_id=-1)
        with torch.no_grad():
            speculative_generate(target, head, prompt[:, :4], max_new_tokens=2, num_draft_tokens=1)  # warm-up
            plain, plain_s = _timed(lambda prompt=prompt, kw=kw: target.generate(prompt, do_sample=False, **kw))
        plain_tps = batch * max_new / plain_s
        row = {"batch": batch, "plain_tokens_per_s": plain_tps}
        if batch == 1:
            with torch.no_grad():
                hf, hf_s = _timed(
                    lambda prompt=prompt, kw=kw: target.generate(prompt, do_sample=False, use_mtp=True, **kw)
                )
            row["hf_use_mtp_tokens_per_s"] = max_new / hf_s
            row["hf_use_mtp_speedup"] = row["hf_use_mtp_tokens_per_s"] / plain_tps
            row["hf_use_mtp_matches_plain"] = torch.equal(hf, plain)
        row["ours"] = []
        for k in ks:
            out, ours_s = _timed(lambda prompt=prompt, k=k, kw=kw: speculative_generate(
                target, head, prompt, num_draft_tokens=k, target_backend=args.target_backend, **kw))
            stats = out.stats
            entry = {
                "k": k,
                "tokens_per_s": batch * max_new / ours_s,
                "speedup_vs_plain": batch * max_new / ours_s / plain_tps,
                "tau": stats.mean_acceptance_length,
                "acceptance_per_position": stats.acceptance_per_position,
                "draft_time_s": stats.draft_time_s,
                "verify_time_s": stats.verify_time_s,
                "matches_plain": torch.equal(out.sequences, plain),
            }
            if "hf_use_mtp_tokens_per_s" in row:
                entry["speedup_vs_hf_use_mtp"] = entry["tokens_per_s"] / row["hf_use_mtp_tokens_per_s"]
            row["ours"].append(entry)
            print(
                f"batch {batch} k {k}: ours {entry['tokens_per_s']:.1f} tok/s ({entry['speedup_vs_plain']:.2f}x plain"
                + (f", {entry['speedup_vs_hf_use_mtp']:.2f}x hf use_mtp" if "speedup_vs_hf_use_mtp" in entry else "")
                + f")  tau {entry['tau']:.2f}  per-pos "
                + " ".join(f"{a:.2f}" for a in entry["acceptance_per_position"])
                + f"  match {entry['matches_plain']}"
            )
        print(
            f"batch {batch}: plain {plain_tps:.1f} tok/s"
            + (f", hf use_mtp {row['hf_use_mtp_tokens_per_s']:.1f} tok/s (match {row['hf_use_mtp_matches_plain']})"
               if batch == 1 else "")
        )
        results["runs"].append(row)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
