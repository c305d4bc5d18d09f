"""The shipped demo LM + trained MTP head on held-out prompts: τ, per-position acceptance, tokens/s.

    python benchmarks/mtp_demo.py [--model DIR] [--other-head DIR] [--max-new-tokens 96] [--out FILE]

Batch 1, every held-out prompt of the checkpoint (`heldout_prompts.json`), in one process: plain greedy
`generate`, transformers `generate(use_mtp=True)` (greedy; it drafts one token per step with one MTP
layer), ours for k = 1..5 greedy and at temperature 1 (plain sampled `generate` as its baseline).
τ and per-position acceptance are pooled over prompts (accepted / verify steps). EOS is disabled so
every run emits exactly --max-new-tokens tokens. `--other-head DIR` also measures a second head on the
same target (e.g. a CE-only head) for the acceptance comparison.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from omnimtp import SamplingParams, speculative_generate  # noqa: E402
from omnimtp.spec.demo import demo_model_dir  # noqa: E402
from omnimtp.spec.head import MTPHead, load_target_and_head  # noqa: E402


def _timed(fn):
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def _pooled(stats_list, k: int) -> dict:
    row_steps = sum(s.num_row_steps for s in stats_list)
    accepted = [sum(s.accepted_per_position[i] for s in stats_list) for i in range(k)]
    return {
        "tau": 1.0 + sum(accepted) / row_steps,
        "acceptance_per_position": [a / row_steps for a in accepted],
        "draft_time_s": sum(s.draft_time_s for s in stats_list),
        "verify_time_s": sum(s.verify_time_s for s in stats_list),
    }


def run_ours(target, head, prompts, k, sampling, max_new, plain_outputs=None) -> dict:
    stats, total_s, matches = [], 0.0, []
    for i, prompt in enumerate(prompts):
        out, seconds = _timed(lambda: speculative_generate(
            target, head, prompt, max_new_tokens=max_new, num_draft_tokens=k, sampling=sampling, seed=i,
            eos_token_id=-1))
        stats.append(out.stats)
        total_s += seconds
        if plain_outputs is not None:
            matches.append(torch.equal(out.sequences, plain_outputs[i]))
    entry = {"k": k, "tokens_per_s": len(prompts) * max_new / total_s, **_pooled(stats, k)}
    if plain_outputs is not None:
        entry["matches_plain"] = all(matches)
    return entry


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="checkpoint dir (default: the shipped demo model)")
    parser.add_argument("--other-head", default=None, help="dir with a second head for the same target")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 2, 3, 4, 5])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default="benchmarks/results/mtp_demo.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    model_dir = args.model or str(demo_model_dir())
    target, head = load_target_and_head(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    with open(os.path.join(model_dir, "heldout_prompts.json")) as f:
        texts = json.load(f)[: args.num_prompts]
    prompts = [tokenizer(t, return_tensors="pt").input_ids for t in texts]
    max_new = args.max_new_tokens
    gen_kw = dict(max_new_tokens=max_new, eos_token_id=-1, pad_token_id=tokenizer.pad_token_id)
    greedy, sampled = SamplingParams.greedy(), SamplingParams(temperature=1.0)

    with torch.no_grad():  # warm-up
        target.generate(prompts[0], do_sample=False, max_new_tokens=4, eos_token_id=-1)
        speculative_generate(target, head, prompts[0], max_new_tokens=4, num_draft_tokens=2, eos_token_id=-1)

    def plain_run(**kw):
        outputs, total = [], 0.0
        for i, prompt in enumerate(prompts):
            torch.manual_seed(i)
            with torch.no_grad():
                out, seconds = _timed(lambda: target.generate(prompt, **gen_kw, **kw))
            outputs.append(out)
            total += seconds
        return outputs, len(prompts) * max_new / total

    plain_greedy, plain_greedy_tps = plain_run(do_sample=False)
    hf_mtp, hf_mtp_tps = plain_run(do_sample=False, use_mtp=True)
    _, plain_sampled_tps = plain_run(do_sample=True, temperature=1.0, top_k=0, top_p=1.0)
    results = {
        "model": model_dir, "num_prompts": len(prompts), "max_new_tokens": max_new, "threads": args.threads,
        "plain_greedy_tokens_per_s": plain_greedy_tps,
        "hf_use_mtp_tokens_per_s": hf_mtp_tps,
        "hf_use_mtp_matches_plain": all(torch.equal(a, b) for a, b in zip(hf_mtp, plain_greedy)),
        "plain_sampled_tokens_per_s": plain_sampled_tps,
        "greedy": [], "temperature_1": [],
    }
    print(f"plain greedy {plain_greedy_tps:.1f} tok/s; transformers use_mtp {hf_mtp_tps:.1f} tok/s "
          f"({hf_mtp_tps / plain_greedy_tps:.2f}x, match {results['hf_use_mtp_matches_plain']}); "
          f"plain sampled {plain_sampled_tps:.1f} tok/s")
    for k in args.ks:
        entry = run_ours(target, head, prompts, k, greedy, max_new, plain_greedy)
        entry["speedup_vs_plain"] = entry["tokens_per_s"] / plain_greedy_tps
        entry["speedup_vs_hf_use_mtp"] = entry["tokens_per_s"] / hf_mtp_tps
        results["greedy"].append(entry)
        print(f"greedy k={k}: tau {entry['tau']:.2f} per-pos "
              + " ".join(f"{a:.2f}" for a in entry["acceptance_per_position"])
              + f"  {entry['tokens_per_s']:.1f} tok/s = {entry['speedup_vs_plain']:.2f}x plain, "
              f"{entry['speedup_vs_hf_use_mtp']:.2f}x use_mtp  match {entry['matches_plain']}  "
              f"draft {entry['draft_time_s']:.2f}s verify {entry['verify_time_s']:.2f}s")
    for k in args.ks:
        entry = run_ours(target, head, prompts, k, sampled, max_new)
        entry["speedup_vs_plain_sampled"] = entry["tokens_per_s"] / plain_sampled_tps
        results["temperature_1"].append(entry)
        print(f"T=1 k={k}: tau {entry['tau']:.2f} per-pos "
              + " ".join(f"{a:.2f}" for a in entry["acceptance_per_position"])
              + f"  {entry['tokens_per_s']:.1f} tok/s = {entry['speedup_vs_plain_sampled']:.2f}x plain sampled")
    if args.other_head:
        other = MTPHead.from_pretrained(args.other_head, target).float().eval()
        results["other_head"] = {"dir": args.other_head}
        for name, sampling in (("greedy", greedy), ("temperature_1", sampled)):
            entry = run_ours(target, other, prompts, 3, sampling, max_new)
            results["other_head"][name] = entry
            mine = next(e for e in results[name] if e["k"] == 3) if 3 in args.ks else None
            print(f"other head {name} k=3: tau {entry['tau']:.2f}"
                  + (f" (this head {mine['tau']:.2f})" if mine else ""))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
