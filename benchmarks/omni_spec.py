"""Speculative thinker steps on the shipped demo Qwen3-Omni (`OmniPipeline.demo()`), spec vs plain, k = 1..4,
one run, side by side:

- thinker alone (`ThinkerRun`, batch 1, greedy, each held-out prompt of `demo_omni_prompts()` in turn):
  thinker tokens/s, τ, per-position acceptance; the speculative token ids are checked equal to plain's;
- end to end (`OmniPipeline.stream`: thinker → talker → code2wav, streamed): time to first audio and total
  time per prompt (the talker is the random tiny one, one frame per engine step, so the total is mostly its);
- a profile of one prompt: mean plain step vs speculative draft and verify time, and torch.profiler's top
  ops by self CPU time for plain and k = 3.

    python benchmarks/omni_spec.py [--max-new-tokens 64] [--max-frames 40] [--threads 1] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from omnimtp.mtp.demo import demo_omni_dir, demo_omni_prompts  # noqa: E402
from omnimtp.mtp.head import MTPHead  # noqa: E402
from omnimtp.pipeline import OmniPipeline  # noqa: E402
from omnimtp.sampling import SamplingParams, make_generators  # noqa: E402
from omnimtp.spec_decode.thinker_spec import ThinkerSpeculation  # noqa: E402
from omnimtp.thinker import ThinkerRun  # noqa: E402

KS = (1, 2, 3, 4)
SAMPLED = SamplingParams(temperature=0.7, top_k=20, top_p=0.8)  # Qwen3-Omni's thinker defaults (speak --seed)


def thinker_run(pipe: OmniPipeline, prompt_ids: list[int], max_new_tokens: int, speculation,
                sampling: SamplingParams | None = None, seed: int = 0) -> tuple[list[int], float, ThinkerRun]:
    run = ThinkerRun(pipe.model.thinker, [prompt_ids], accept_hidden_layer=pipe.accept_hidden_layer,
                     eos_token_ids=pipe.eos_token_ids, max_new_tokens=max_new_tokens, decoder=pipe.thinker_decoder,
                     speculation=speculation, sampling=[sampling], generators=make_generators([seed]))
    start = time.perf_counter()
    with torch.inference_mode():
        while not run.is_finished:
            run.step()
    return run.output_ids[0], time.perf_counter() - start, run


def thinker_side(pipe, head, prompts, max_new_tokens, sampling=None) -> dict:
    """sampling None: greedy (speculative ids checked equal to plain's); else seeded sampling (seed = prompt index)."""
    results = {}
    reference = None
    for k in (0, *KS):
        speculation = None if k == 0 else ThinkerSpeculation(head, k)
        thinker_run(pipe, prompts[0], max_new_tokens, speculation, sampling)  # warm-up
        ids, seconds, stats = [], 0.0, []
        for seed, prompt in enumerate(prompts):
            out, elapsed, run = thinker_run(pipe, prompt, max_new_tokens, speculation, sampling, seed)
            ids.append(out)
            seconds += elapsed
            if run.spec_stats:
                stats.append(run.spec_stats[0])
        num_tokens = sum(len(row) for row in ids)
        entry = {"tokens": num_tokens, "seconds": seconds, "tokens_per_s": num_tokens / seconds}
        if k == 0:
            reference = ids
        else:
            row_steps = sum(s.num_row_steps for s in stats)
            entry.update(
                outputs_match=ids == reference if sampling is None else None,
                tau=1 + sum(s.num_accepted for s in stats) / row_steps,
                acceptance_per_position=[sum(s.accepted_per_position[i] for s in stats) / row_steps for i in range(k)],
                draft_ms_per_step=1e3 * sum(s.draft_time_s for s in stats) / row_steps,
                verify_ms_per_step=1e3 * sum(s.verify_time_s for s in stats) / row_steps,
                speedup=entry["tokens_per_s"] / results["plain"]["tokens_per_s"],
            )
        results["plain" if k == 0 else f"k{k}"] = entry
    results["plain"]["ms_per_step"] = 1e3 * results["plain"]["seconds"] / results["plain"]["tokens"]
    return results


def end_to_end(pipes: dict[str, OmniPipeline], texts: list[str], max_new_tokens: int, max_frames: int) -> dict:
    results = {}
    for name, pipe in pipes.items():
        list(pipe.stream(texts[0], max_new_tokens=max_new_tokens, max_frames=max_frames))  # warm-up
        first, total, outputs = [], [], []
        for text in texts:
            start = time.perf_counter()
            first_audio = None
            for event in pipe.stream(text, max_new_tokens=max_new_tokens, max_frames=max_frames):
                if event.audio is not None and first_audio is None:
                    first_audio = time.perf_counter() - start
                if event.output is not None:
                    outputs.append(event.output)
            total.append(time.perf_counter() - start)
            first.append(first_audio)
        results[name] = {
            "time_to_first_audio_s": sum(first) / len(first), "total_s": sum(total) / len(total),
            "frames": sum(o.codes.shape[1] for o in outputs) / len(outputs),
            "text_ids": [o.text_ids for o in outputs], "codes": [o.codes.tolist() for o in outputs],
        }
    reference = results["plain"]
    for entry in results.values():
        entry["outputs_match"] = entry["text_ids"] == reference["text_ids"] and entry["codes"] == reference["codes"]
    for entry in results.values():
        del entry["text_ids"], entry["codes"]
    return results


def top_ops(pipe, prompt, max_new_tokens, speculation, count: int = 12) -> list[dict]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        thinker_run(pipe, prompt, max_new_tokens, speculation)
    rows = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:count]
    return [{"op": e.key, "calls": e.count, "self_ms": e.self_cpu_time_total / 1e3} for e in rows]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--max-frames", type=int, default=40)
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    plain = OmniPipeline.demo(thinker_mtp=None)
    head = MTPHead.from_pretrained(demo_omni_dir(), plain.model.thinker).eval()
    texts = demo_omni_prompts()[: args.num_prompts]
    prompts = [plain.family.chat_ids([{"role": "user", "content": text}]) for text in texts]

    thinker = thinker_side(plain, head, prompts, args.max_new_tokens)
    sampled = thinker_side(plain, head, prompts, args.max_new_tokens, SAMPLED)
    pipes = {"plain": plain}
    for k in KS:
        pipes[f"k{k}"] = OmniPipeline(plain.model, plain.tokenizer, processor=plain.processor, thinker_mtp=head,
                                      num_draft_tokens=k, max_new_tokens=args.max_new_tokens,
                                      max_frames=args.max_frames)
    e2e = end_to_end(pipes, texts, args.max_new_tokens, args.max_frames)
    profile = {"plain": top_ops(plain, prompts[0], args.max_new_tokens, None),
               "k3": top_ops(plain, prompts[0], args.max_new_tokens, ThinkerSpeculation(head, 3))}

    print(f"demo Qwen3-Omni ({demo_omni_dir()}), {len(prompts)} held-out prompts, greedy, max_new_tokens "
          f"{args.max_new_tokens}, max_frames {args.max_frames}, {args.threads} thread(s), "
          f"torch {torch.__version__}")
    print(f"{'':6} {'thinker tok/s':>13} {'speed-up':>8} {'tau':>5} {'per-position acceptance':>28} "
          f"{'draft/verify ms':>16} {'TTFA s':>7} {'total s':>7} {'match':>5}")
    for name in ("plain", *[f"k{k}" for k in KS]):
        t, e = thinker[name], e2e[name]
        position = " ".join(f"{a:.2f}" for a in t.get("acceptance_per_position", []))
        timing = (
            f"{t['draft_ms_per_step']:.2f}/{t['verify_ms_per_step']:.2f}"
            if name != "plain"
            else f"{t['ms_per_step']:.2f}/step"
        )
        match = t.get("outputs_match", True) and e["outputs_match"]
        print(f"{name:6} {t['tokens_per_s']:13.1f} {t.get('speedup', 1.0):8.2f} {t.get('tau', 1.0):5.2f} "
              f"{position:>28} {timing:>16} {e['time_to_first_audio_s']:7.3f} {e['total_s']:7.3f} {str(match):>5}")
    print(f"thinker alone, sampled {SAMPLED}:")
    for name in ("plain", *[f"k{k}" for k in KS]):
        t = sampled[name]
        position = " ".join(f"{a:.2f}" for a in t.get("acceptance_per_position", []))
        print(f"{name:6} {t['tokens_per_s']:13.1f} {t.get('speedup', 1.0):8.2f} {t.get('tau', 1.0):5.2f} "
              f"{position:>28}")
    for name, rows in profile.items():
        print(f"top ops by self CPU time, {name}, one prompt:")
        for row in rows:
            print(f"  {row['op']:40} {row['calls']:6d} calls {row['self_ms']:8.2f} ms")
    if args.out:
        result = {"machine": platform.processor() or platform.machine(), "torch": torch.__version__, "args": vars(args),
                  "thinker": thinker, "thinker_sampled": sampled, "end_to_end": e2e, "profile": profile}
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
