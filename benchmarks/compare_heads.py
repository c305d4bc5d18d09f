"""Several MTP heads of one target side by side: held-out acceptance with standard errors (paired vs the first).

    python benchmarks/compare_heads.py --heads DIR_A DIR_B [...] [--names A B ...] [--model DIR]
        [--num-windows 0] [--num-prompts 48] [--max-new-tokens 96] [--ks 3] [--threads 1] [--out FILE]

--model: the target checkpoint (default: the shipped demo model); each --heads DIR holds an MTP layer for it
(`model-mtp.safetensors`, as `omnimtp train-mtp --out` writes). The first head is the reference of the
paired differences (e.g. the CE-only head). Two measures, both on text the LM, its tokenizer and the heads
never saw (the stdlib files `omnimtp train-mtp --data <stdlib> --suffixes .py` holds out):

(a) teacher-forced: the held-out stream cut into non-overlapping windows of --seq-len tokens (all of them
    with --num-windows 0); in each window every k-token chain is drafted by the head unrolled on the text
    (`omnimtp.mtp.train.window_acceptance`): greedy τ = 1 + Σ_i P(drafts 1..i equal the target's argmax),
    sampled τ = 1 + Σ_i Π_{j≤i} Σ min(p_j, q_j). Mean over windows ± standard error over windows, and the
    paired difference to the first head ± its standard error (same windows, so the window-to-window
    spread cancels), also over means of --se-block consecutive windows (neighbouring windows come from
    the same file; the blocked SE does not assume they are independent).
(b) real speculative decoding (`speculative_generate`, batch 1, EOS disabled, --max-new-tokens each) on
    --num-prompts held-out prompts (cut at line starts at 1/2, then 1/4, 3/4, 1/8, ... of each held-out file):
    τ pooled over prompts (accepted / verify steps), greedy and temperature 1 (seed = prompt index), and
    the paired per-prompt τ difference to the first head ± standard error over prompts. Greedy outputs are
    checked against plain greedy decoding (`matches_plain`).
(c) teacher-forced on the target's own greedy continuations of those prompts (the text greedy decoding
    drafts on): (a)'s estimate over every chain starting in the generated part, mean ± SE over prompts and
    the paired difference to the first head.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import sysconfig
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from omnimtp import SamplingParams, speculative_generate  # noqa: E402
from omnimtp.mtp.demo import demo_model_dir  # noqa: E402
from omnimtp.mtp.head import MTPHead  # noqa: E402
from omnimtp.mtp.load import load_target_and_head  # noqa: E402
from omnimtp.mtp.train import (  # noqa: E402
    collect_text_files,
    distillation_losses,
    encode_files,
    teacher_outputs,
    unrolled_draft_logits,
    window_acceptance,
)


def mean_and_se(values: list[float]) -> tuple[float, float]:
    """Mean and standard error of the mean (sample standard deviation / sqrt(n))."""
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return mean, float("nan")
    variance = sum((v - mean) ** 2 for v in values) / (n - 1)
    return mean, math.sqrt(variance / n)


def heldout_prompt_texts(files, num_prompts: int, num_chars: int = 300) -> list[str]:
    """Prompts of whole lines cut at a line start at 1/2 of each held-out file, then 1/4, 3/4, 1/8, 3/8, 5/8,
    7/8 (the first pass equals the checkpoint's `heldout_prompts.json`)."""
    prompts = []
    for fraction in (0.5, 0.25, 0.75, 0.125, 0.375, 0.625, 0.875):
        for path in files:
            text = path.read_text(encoding="utf-8", errors="replace")
            start = text.find("\n", int(len(text) * fraction)) + 1
            if start == 0 or len(text) - start < num_chars:
                continue
            chunk = text[start : start + num_chars]
            prompts.append(chunk[: chunk.rfind("\n") + 1])
            if len(prompts) == num_prompts:
                return prompts
    return prompts


@torch.no_grad()
def teacher_forced(target, heads: list[MTPHead], windows: torch.Tensor, k: int, batch_size: int) -> list[dict]:
    """Per head: per-window greedy / sampled τ lists and mean CE / TV over all windows."""
    per_head = [{"tau_greedy": [], "tau_sampled": [], "ce": 0.0, "tv": 0.0} for _ in heads]
    for start in range(0, windows.shape[0], batch_size):
        batch = windows[start : start + batch_size]  # [b, L]
        hidden, target_logits = teacher_outputs(target, batch)
        for head, acc in zip(heads, per_head, strict=True):
            draft_logits = unrolled_draft_logits(head, batch, hidden, k)
            rates = window_acceptance(target_logits, draft_logits)  # {"greedy", "sampled"}: [b, k]
            acc["tau_greedy"] += (1.0 + rates["greedy"].sum(dim=1)).tolist()
            acc["tau_sampled"] += (1.0 + rates["sampled"].sum(dim=1)).tolist()
            ce, tv = distillation_losses(target_logits, draft_logits)
            acc["ce"] += sum(c.item() for c in ce) / k * batch.shape[0]
            acc["tv"] += sum(t.item() for t in tv) / k * batch.shape[0]
            acc.setdefault("per_position_greedy", []).append(rates["greedy"].sum(dim=0))  # [k]
            acc.setdefault("per_position_sampled", []).append(rates["sampled"].sum(dim=0))  # [k]
    num_windows = windows.shape[0]
    for acc in per_head:
        acc["ce"] /= num_windows
        acc["tv"] /= num_windows
        for mode in ("greedy", "sampled"):
            total = torch.stack(acc.pop(f"per_position_{mode}")).sum(dim=0) / num_windows  # [k]
            acc[f"acceptance_per_position_{mode}"] = total.tolist()
    return per_head


def block_means(values: list[float], block: int) -> list[float]:
    """Means of consecutive blocks of `block` values (a last partial block dropped)."""
    return [sum(values[i : i + block]) / block for i in range(0, len(values) - block + 1, block)]


def summarize(values_by_head: list[list[float]], block: int = 0) -> list[dict]:
    """Mean ± SE per head and the paired difference to head 0 ± SE. With `block` > 1 the difference's SE is
    also computed over means of `block` consecutive values (`diff_se_blocked`: robust to neighbouring
    windows of one file being alike)."""
    out = []
    for values in values_by_head:
        mean, se = mean_and_se(values)
        entry = {"mean": mean, "se": se}
        if out:
            diffs = [a - b for a, b in zip(values, values_by_head[0], strict=True)]
            diff, diff_se = mean_and_se(diffs)
            entry.update({"diff_vs_first": diff, "diff_se": diff_se})
            if block > 1 and len(diffs) >= 2 * block:
                entry["diff_se_blocked"] = mean_and_se(block_means(diffs, block))[1]
        out.append(entry)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="target checkpoint dir (default: the shipped demo model)")
    parser.add_argument(
        "--heads", nargs="+", required=True, help="dirs holding an MTP layer; the first is the reference"
    )
    parser.add_argument("--names", nargs="+", default=None)
    parser.add_argument("--data", default=sysconfig.get_paths()["stdlib"], help="the text the heads were trained on")
    parser.add_argument("--heldout-every", type=int, default=16)
    parser.add_argument("--suffixes", nargs="+", default=[".py"])
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--num-windows", type=int, default=0, help="0: every non-overlapping held-out window")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--se-block", type=int, default=16,
                        help="also give the paired difference's SE over means of this many consecutive windows")
    parser.add_argument("--num-prompts", type=int, default=48, help="0: skip the decoding runs")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--ks", type=int, nargs="+", default=[3])
    parser.add_argument("--no-sampled", action="store_true")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default="benchmarks/results/compare_heads.json")
    args = parser.parse_args()
    names = args.names or [os.path.basename(os.path.normpath(h)) for h in args.heads]
    if len(names) != len(args.heads):
        raise ValueError("--names: give one name per --heads dir")
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer
    from transformers.utils import logging

    logging.set_verbosity_error()
    model_dir = args.model or str(demo_model_dir())
    target, _ = load_target_and_head(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    heads = [MTPHead.from_pretrained(h, target).float().eval() for h in args.heads]
    _, heldout_files = collect_text_files([args.data], args.heldout_every, tuple(args.suffixes))
    results = {"model": model_dir, "heads": dict(zip(names, args.heads, strict=True)), "reference": names[0],
               "heldout_files": len(heldout_files), "threads": args.threads}

    # (a) teacher-forced, every non-overlapping held-out window, at the largest k
    k_max = max(args.ks)
    stream = encode_files(tokenizer, heldout_files)
    num_windows = stream.numel() // args.seq_len
    if args.num_windows:
        num_windows = min(num_windows, args.num_windows)
    windows = stream[: num_windows * args.seq_len].view(num_windows, args.seq_len).long()  # [W, L]
    start = time.perf_counter()
    tf = teacher_forced(target, heads, windows, k_max, args.batch_size)
    print(f"teacher-forced: {num_windows} windows x {args.seq_len} tokens, k={k_max} "
          f"({time.perf_counter() - start:.0f} s); mean ± SE over windows, paired diff vs {names[0]}")
    results["teacher_forced"] = {"k": k_max, "num_windows": num_windows, "seq_len": args.seq_len, "heads": {}}
    for mode in ("greedy", "sampled"):
        stats = summarize([acc[f"tau_{mode}"] for acc in tf], block=args.se_block)
        for name, acc, s in zip(names, tf, stats, strict=True):
            entry = results["teacher_forced"]["heads"].setdefault(
                name, {"ce": acc["ce"], "tv": acc["tv"]})
            entry[f"tau_{mode}"] = s
            entry[f"acceptance_per_position_{mode}"] = acc[f"acceptance_per_position_{mode}"]
    for name in names:
        e = results["teacher_forced"]["heads"][name]
        line = f"  {name:>16}: ce {e['ce']:.4f} tv {e['tv']:.4f}"
        for mode in ("greedy", "sampled"):
            s = e[f"tau_{mode}"]
            line += f"  tau_{mode} {s['mean']:.4f} ± {s['se']:.4f}"
            if "diff_vs_first" in s:
                line += f" (diff {s['diff_vs_first']:+.4f} ± {s['diff_se']:.4f}"
                line += f", blocked ± {s['diff_se_blocked']:.4f})" if "diff_se_blocked" in s else ")"
        print(line)

    # (b) real speculative decoding on held-out prompts
    if args.num_prompts:
        texts = heldout_prompt_texts(heldout_files, args.num_prompts)
        prompts = [tokenizer(t, return_tensors="pt").input_ids for t in texts]
        max_new = args.max_new_tokens
        plain = []
        with torch.inference_mode():
            for ids in prompts:
                plain.append(target.generate(ids, do_sample=False, max_new_tokens=max_new, eos_token_id=-1,
                                             pad_token_id=tokenizer.pad_token_id))
        # (c) teacher-forced on the target's own greedy continuations: every chain starting in the generated
        # part (what greedy decoding drafts on), per prompt; paired differences over prompts.
        own_text = [{"greedy": [], "sampled": []} for _ in heads]
        with torch.inference_mode():
            for ids, sequence in zip(prompts, plain, strict=True):
                hidden, target_logits = teacher_outputs(target, sequence)
                first_row = ids.shape[1] - 1  # row predicting the first generated token
                for head, acc in zip(heads, own_text, strict=True):
                    draft_logits = unrolled_draft_logits(head, sequence, hidden, k_max)
                    rates = window_acceptance(target_logits[:, first_row:], [d[:, first_row:] for d in draft_logits])
                    acc["greedy"].append(1.0 + rates["greedy"].sum().item())
                    acc["sampled"].append(1.0 + rates["sampled"].sum().item())
        results["teacher_forced_on_greedy_output"] = {"k": k_max, "num_prompts": len(prompts), "heads": {}}
        print(f"teacher-forced on the target's greedy continuations: {len(prompts)} prompts x {max_new} tokens, "
              f"k={k_max}; mean ± SE over prompts, paired diff vs {names[0]}")
        for mode in ("greedy", "sampled"):
            stats = summarize([acc[mode] for acc in own_text])
            for name, s in zip(names, stats, strict=True):
                results["teacher_forced_on_greedy_output"]["heads"].setdefault(name, {})[f"tau_{mode}"] = s
        for name in names:
            e = results["teacher_forced_on_greedy_output"]["heads"][name]
            line = f"  {name:>16}:"
            for mode in ("greedy", "sampled"):
                s = e[f"tau_{mode}"]
                line += f"  tau_{mode} {s['mean']:.4f} ± {s['se']:.4f}"
                if "diff_vs_first" in s:
                    line += f" (diff {s['diff_vs_first']:+.4f} ± {s['diff_se']:.4f})"
            print(line, flush=True)

        modes = [("greedy", SamplingParams.greedy())]
        if not args.no_sampled:
            modes.append(("t1", SamplingParams(temperature=1.0)))
        decoding = {}
        print(f"speculative decoding: {len(prompts)} held-out prompts x {max_new} new tokens; "
              f"pooled tau, per-prompt paired diff vs {names[0]} ± SE over prompts")
        for k in args.ks:
            for mode, sampling in modes:
                per_head_taus, per_head_pooled, matches = [], [], []
                for head in heads:
                    taus, accepted, row_steps, match = [], 0, 0, True
                    for i, ids in enumerate(prompts):
                        out = speculative_generate(target, head, ids, max_new_tokens=max_new, num_draft_tokens=k,
                                                   sampling=sampling, seed=i, eos_token_id=-1)
                        taus.append(out.stats.mean_acceptance_length)
                        accepted += out.stats.num_accepted
                        row_steps += out.stats.num_row_steps
                        if mode == "greedy":
                            match = match and torch.equal(out.sequences, plain[i])
                    per_head_taus.append(taus)
                    per_head_pooled.append(1.0 + accepted / row_steps)
                    matches.append(match)
                stats = summarize(per_head_taus)
                taus_of = dict(zip(names, per_head_taus, strict=True))
                line = f"  k={k} {mode:>6}:"
                for name, pooled, s, match in zip(names, per_head_pooled, stats, matches, strict=True):
                    entry = {"tau_pooled": pooled, "tau_per_prompt": s, "tau_per_prompt_values": taus_of[name]}
                    if mode == "greedy":
                        entry["matches_plain"] = match
                    decoding.setdefault(f"k{k}_{mode}", {})[name] = entry
                    line += f"  {name} {pooled:.3f}"
                    if "diff_vs_first" in s:
                        line += f" (diff {s['diff_vs_first']:+.3f} ± {s['diff_se']:.3f})"
                if mode == "greedy":
                    line += f"  match plain {all(matches)}"
                print(line, flush=True)
                for a in range(1, len(names)):  # every other pair (the first head's pairs are above)
                    for b in range(a + 1, len(names)):
                        diff, diff_se = mean_and_se(
                            [x - y for x, y in zip(per_head_taus[b], per_head_taus[a], strict=True)]
                        )
                        decoding[f"k{k}_{mode}"].setdefault("pairs", {})[f"{names[b]}-{names[a]}"] = {
                            "diff": diff, "diff_se": diff_se}
                        print(f"      {names[b]} - {names[a]}: {diff:+.3f} ± {diff_se:.3f}", flush=True)
        results["decoding"] = {"num_prompts": len(prompts), "max_new_tokens": max_new, "runs": decoding}

    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
