"""The shipped demo LM + trained MTP head on held-out prompts: τ, per-position acceptance, tokens/s.

    python benchmarks/mtp_demo.py [--model DIR] [--other-head DIR] [--max-new-tokens 96] [--repeats 3]
        [--ks 1 2 3] [--no-sampled] [--target-backend auto|packed|transformers] [--out FILE]

Batch 1, every held-out prompt of the checkpoint (`heldout_prompts.json`), in one process: plain greedy
`generate`, transformers `generate(use_mtp=True)` (greedy; it drafts one token per step with one MTP
layer), our plain greedy decoding on the packed target (`plain_generate`, one token per forward: the
honest baseline on the same forward), ours for k = 1..5 greedy and at temperature 1 (plain sampled
`generate` as its baseline) with --target-backend (default auto = packed on this model).
Timing is interleaved: for each of --repeats repeats and each prompt every method runs back to back, so
load from other processes hits all of them alike; tokens/s are medians over repeats; a speed-up is the
median over repeats of the same-repeat ratio of total times (per-repeat ratios are printed too, and the
median over (repeat, prompt) of back-to-back per-prompt ratios as `speedup_pairwise_median`).
τ and per-position acceptance are pooled over prompts (accepted / verify steps). EOS is disabled so
every run emits exactly --max-new-tokens tokens. `--other-head DIR` also measures a second head on the
same target (e.g. a CE-only head) for the acceptance comparison.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
from transformers import DynamicCache

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from omnimtp import SamplingParams, plain_generate, speculative_generate  # noqa: E402
from omnimtp.mtp.demo import demo_model_dir  # noqa: E402
from omnimtp.mtp.head import MTPHead  # noqa: E402
from omnimtp.mtp.load import load_target_and_head  # noqa: E402


def _pooled(stats_list, k: int) -> dict:
    row_steps = sum(s.num_row_steps for s in stats_list)
    accepted = [sum(s.accepted_per_position[i] for s in stats_list) for i in range(k)]
    return {
        "tau": 1.0 + sum(accepted) / row_steps,
        "acceptance_per_position": [a / row_steps for a in accepted],
        "draft_time_s": sum(s.draft_time_s for s in stats_list),
        "verify_time_s": sum(s.verify_time_s for s in stats_list),
        "num_steps": sum(s.num_steps for s in stats_list),
    }


def _median(values: list[float]) -> float:
    return statistics.median(values)


class Method:
    """One way of generating: run(i) decodes prompt i once and returns (sequences, stats or None)."""

    def __init__(self, name: str, run, baseline: str | None):
        self.name, self.run, self.baseline = name, run, baseline
        self.seconds: list[float] = []  # one total per repeat (all prompts)
        self.prompt_seconds: list[float] = []  # one per (repeat, prompt), in run order
        self.outputs: list[torch.Tensor] = []  # first repeat
        self.stats: list = []  # first repeat


def run_interleaved(methods: list[Method], num_prompts: int, repeats: int) -> None:
    """For each repeat and prompt, run every method back to back (so load changes hit them alike)."""
    for repeat in range(repeats):
        totals = {m.name: 0.0 for m in methods}
        for i in range(num_prompts):
            for m in methods:
                start = time.perf_counter()
                sequences, stats = m.run(i)
                seconds = time.perf_counter() - start
                totals[m.name] += seconds
                m.prompt_seconds.append(seconds)
                if repeat == 0:
                    m.outputs.append(sequences)
                    if stats is not None:
                        m.stats.append(stats)
        for m in methods:
            m.seconds.append(totals[m.name])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="checkpoint dir (default: the shipped demo model)")
    parser.add_argument("--other-head", default=None, help="dir with a second head for the same target")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 2, 3, 4, 5])
    parser.add_argument("--repeats", type=int, default=3, help="interleaved repeats; medians are reported")
    parser.add_argument("--no-sampled", action="store_true", help="skip the temperature-1 runs")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu", help="where target and head run (cpu, cuda, cuda:N)")
    parser.add_argument("--target-backend", default="auto", choices=["auto", "packed", "transformers"])
    parser.add_argument("--out", default="benchmarks/results/mtp_demo.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    model_dir = args.model or str(demo_model_dir())
    target, head = load_target_and_head(model_dir)
    target, head = target.to(args.device), head.to(args.device)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    with open(os.path.join(model_dir, "heldout_prompts.json")) as f:
        texts = json.load(f)[: args.num_prompts]
    prompts = [tokenizer(t, return_tensors="pt").input_ids.to(args.device) for t in texts]
    max_new = args.max_new_tokens
    gen_kw = dict(max_new_tokens=max_new, eos_token_id=-1, pad_token_id=tokenizer.pad_token_id)
    greedy, sampled = SamplingParams.greedy(), SamplingParams(temperature=1.0)
    from transformers.utils import logging

    logging.set_verbosity_error()  # eos_token_id=-1 (no EOS, fixed lengths) warns on every generate call

    with torch.no_grad():  # warm-up
        target.generate(prompts[0], do_sample=False, max_new_tokens=4, eos_token_id=-1)
        speculative_generate(target, head, prompts[0], max_new_tokens=4, num_draft_tokens=2, eos_token_id=-1,
                             target_backend=args.target_backend)
        plain_generate(target, prompts[0], max_new_tokens=4, eos_token_id=-1)

    def plain(**kw):
        def run(i):
            torch.manual_seed(i)
            with torch.no_grad():
                return target.generate(prompts[i], **gen_kw, **kw), None
        return run

    def plain_lean(i):
        """Greedy decoding with the same lean loop as ours (decoder + lm_head, DynamicCache, argmax, no
        generate() machinery, inference_mode): the baseline that isolates what speculation itself buys."""
        with torch.inference_mode():
            cache = DynamicCache(config=target.config)
            decoder, lm_head = target.get_decoder(), target.get_output_embeddings()
            ids, tokens = prompts[i], []
            for _ in range(max_new):
                hidden = decoder(input_ids=ids, cache=cache, use_cache=True).last_hidden_state
                ids = lm_head(hidden[:, -1:]).argmax(dim=-1)  # [1, 1]
                tokens.append(ids)
            return torch.cat([prompts[i]] + tokens, dim=1).clone(), None

    def plain_packed(i):
        return plain_generate(target, prompts[i], max_new_tokens=max_new, eos_token_id=-1), None

    def ours(drafter, k, sampling):
        def run(i):
            out = speculative_generate(target, drafter, prompts[i], max_new_tokens=max_new, num_draft_tokens=k,
                                       sampling=sampling, seed=i, eos_token_id=-1, target_backend=args.target_backend)
            return out.sequences, out.stats
        return run

    methods = [
        Method("plain_greedy", plain(do_sample=False), None),
        Method("plain_lean", plain_lean, "plain_greedy"),
        Method("hf_use_mtp", plain(do_sample=False, use_mtp=True), "plain_greedy"),
        Method("plain_packed", plain_packed, "plain_greedy"),
    ]
    methods += [Method(f"greedy_k{k}", ours(head, k, greedy), "plain_greedy") for k in args.ks]
    if not args.no_sampled:
        methods.append(Method("plain_sampled", plain(do_sample=True, temperature=1.0, top_k=0, top_p=1.0), None))
        methods += [Method(f"t1_k{k}", ours(head, k, sampled), "plain_sampled") for k in args.ks]
    other = None
    if args.other_head:
        other = MTPHead.from_pretrained(args.other_head, target).float().eval()
        methods.append(Method("other_greedy_k3", ours(other, 3, greedy), "plain_greedy"))
        if not args.no_sampled:
            methods.append(Method("other_t1_k3", ours(other, 3, sampled), "plain_sampled"))
    run_interleaved(methods, len(prompts), args.repeats)

    by_name = {m.name: m for m in methods}
    num_tokens = len(prompts) * max_new

    def summary(m: Method) -> dict:
        entry = {
            "tokens_per_s": num_tokens / _median(m.seconds),
            "tokens_per_s_per_repeat": [num_tokens / s for s in m.seconds],
        }
        if m.baseline is not None:
            base = by_name[m.baseline]
            ratios = [b / s for s, b in zip(m.seconds, base.seconds, strict=True)]  # same-repeat ratios
            # also: median over (repeat, prompt) of the ratio of two runs seconds apart (finer, less conservative)
            pair_ratios = [b / s for s, b in zip(m.prompt_seconds, base.prompt_seconds, strict=True)]
            entry["speedup_vs_" + m.baseline] = _median(ratios)
            entry["speedup_per_repeat"] = ratios
            entry["speedup_pairwise_median"] = _median(pair_ratios)
        if m.baseline == "plain_greedy":
            entry["matches_plain"] = all(torch.equal(a, b) for a, b in zip(m.outputs, base.outputs, strict=True))
        if m.stats:
            k = m.stats[0].num_draft_tokens
            entry.update({"k": k, **_pooled(m.stats, k)})
        return entry

    results = {
        "model": model_dir, "num_prompts": len(prompts), "max_new_tokens": max_new, "threads": args.threads,
        "repeats": args.repeats, "target_backend": args.target_backend,
        "note": "tokens_per_s: median over interleaved repeats; speed-ups: median over "
        "repeats of same-repeat total-time ratios; plain = transformers generate (greedy / do_sample); "
        "plain_lean = the same lean decoder loop as ours, one token per forward; plain_packed = our packed "
        "target (plain_generate), one token per forward",
        "methods": {m.name: summary(m) for m in methods},
    }
    res = results["methods"]
    plain_tps = res["plain_greedy"]["tokens_per_s"]
    print(f"plain greedy (transformers generate) {plain_tps:.1f} tok/s "
          f"(repeats: {' '.join(f'{x:.1f}' for x in res['plain_greedy']['tokens_per_s_per_repeat'])})")
    hf = res["hf_use_mtp"]
    print(f"transformers use_mtp {hf['tokens_per_s']:.1f} tok/s = {hf['speedup_vs_plain_greedy']:.2f}x plain, "
          f"match {hf['matches_plain']}")
    lean = res["plain_lean"]
    print(f"plain lean loop {lean['tokens_per_s']:.1f} tok/s = {lean['speedup_vs_plain_greedy']:.2f}x generate, "
          f"match {lean['matches_plain']}")
    packed = res["plain_packed"]
    print(f"plain packed loop {packed['tokens_per_s']:.1f} tok/s = {packed['speedup_vs_plain_greedy']:.2f}x generate, "
          f"match {packed['matches_plain']}")
    print(f"ours: target_backend={args.target_backend}")
    for m in methods[4:]:
        if not m.stats:
            print(f"{m.name}: {res[m.name]['tokens_per_s']:.1f} tok/s")
            continue
        e = res[m.name]
        speedup = e["speedup_vs_" + m.baseline]
        line = (f"{m.name}: tau {e['tau']:.2f} per-pos " + " ".join(f"{a:.2f}" for a in e["acceptance_per_position"])
                + f"  {e['tokens_per_s']:.1f} tok/s = {speedup:.2f}x {m.baseline} (repeats "
                + " ".join(f"{r:.2f}" for r in e["speedup_per_repeat"])
                + f"; pairwise median {e['speedup_pairwise_median']:.2f})")
        if m.baseline == "plain_greedy":
            vs_lean = _median([b / s for s, b in zip(m.seconds, by_name["plain_lean"].seconds, strict=True)])
            e["speedup_vs_plain_lean"] = vs_lean
            vs_packed = _median([b / s for s, b in zip(m.seconds, by_name["plain_packed"].seconds, strict=True)])
            e["speedup_vs_plain_packed"] = vs_packed
            line += (f" {vs_lean:.2f}x plain_lean {vs_packed:.2f}x plain_packed"
                     f" {e['tokens_per_s'] / hf['tokens_per_s']:.2f}x use_mtp"
                     f"  match {e['matches_plain']}"
                     f"  per step: draft {e['draft_time_s'] / e['num_steps'] * 1e3:.2f} ms verify "
                     f"{e['verify_time_s'] / e['num_steps'] * 1e3:.2f} ms (first repeat)")
        print(line)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
