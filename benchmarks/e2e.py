"""End-to-end speech: OmniPipeline vs transformers' `generate(return_audio=True)` on the same weights.

Both sides run greedy with the same caps (thinker tokens, talker frames) and produce the same tokens and
codes (checked here). Reported per config: total wall time of each (ours: `generate`) and the ratio, our
time to the first audio chunk (`stream`) and its share of the reference's total, and real-time factors (wall time / audio time).
CPU time of the process (`time.process_time`) is reported next to wall time: on a shared, loaded machine
it is the steadier of the two for comparing ours with the reference (both run with the same thread count).
Our code predictor is compiled during the untimed warm-up: the whole frame as one graph by default
(`compile_predictor="frame"`; its first compile takes a minute or two per config on a CPU, later runs hit
inductor's disk cache), `--compile step` for one graph per predictor step, `--compile none` for eager.

`--input audio` asks a spoken question instead (5 s of log-mel features through transformers' audio encoder,
65 audio rows in the prompt), `--input image` shows a 224×224-sized image (14 × 14 patches): the time to the first
audio then includes the encoder. The features are random (the encoders' work does not depend on them).

    python benchmarks/e2e.py [--quick] [--threads 1] [--compile frame|step|none] [--config mid] [--input text|audio|image]
        [--out benchmarks/results/e2e.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import torch

from omnimtp.models.tiny import THINKER_SPECIAL_TOKENS, tiny_qwen3_omni
from omnimtp.pipeline import OmniPipeline
from omnimtp.tokenizer import byte_tokenizer

CONFIGS = {
    "tiny": dict(),
    "mid": dict(hidden_size=1024, num_thinker_layers=4, num_talker_layers=4),
}


def _reference(model, prompt, max_new_tokens, max_frames, media):
    sequences, wav = model.generate(
        input_ids=torch.tensor([prompt], device=model.device),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=model.device), return_audio=True,
        speaker="Ethan", thinker_max_new_tokens=max_new_tokens, thinker_eos_token_id=model.config.im_end_token_id,
        thinker_do_sample=False, talker_do_sample=False, talker_max_new_tokens=max_frames + 1, **media,
    )
    return sequences[0, len(prompt):].tolist(), wav[0, 0].cpu().numpy()


def _question(tokenizer, model, kind: str) -> tuple[list[int], dict]:
    """The prompt ids and media tensors of a question in `kind` (text, audio or image)."""
    text = {"text": "Tell me about the weather today.", "audio": "Answer the question.", "image": "What is this?"}[kind]
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, return_dict=False)
    if kind == "text":
        return ids, {}
    tokens, generator = THINKER_SPECIAL_TOKENS, torch.Generator().manual_seed(0)
    thinker_config = model.config.thinker_config
    if kind == "audio":
        frames = 500  # 5 s at the feature extractor's 100 frames per second
        mel = thinker_config.audio_config.num_mel_bins
        media = dict(input_features=torch.randn(1, mel, frames, generator=generator),
                     feature_attention_mask=torch.ones(1, frames, dtype=torch.long))
        run = [tokens["<|audio_start|>"]] + [tokens["<|audio_pad|>"]] * 65 + [tokens["<|audio_end|>"]]
    else:
        vision = thinker_config.vision_config
        grid = torch.tensor([[1, 14, 14]])
        patch = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
        media = dict(pixel_values=torch.randn(196, patch, generator=generator), image_grid_thw=grid)
        rows = 196 // vision.spatial_merge_size**2
        run = [tokens["<|vision_start|>"]] + [tokens["<|image_pad|>"]] * rows + [tokens["<|vision_end|>"]]
    return ids[:3] + run + ids[3:], media


def bench(name, config_kwargs, max_new_tokens, max_frames, repeats, compile_predictor, kind="text", device="cpu"):
    model = tiny_qwen3_omni(0, **config_kwargs).to(device)
    num_params = sum(p.numel() for p in model.parameters())
    pipe = OmniPipeline(model, byte_tokenizer(), max_batch_size=1, compile_predictor=compile_predictor)
    prompt, media = _question(pipe.tokenizer, model, kind)
    media = {name: value.to(device) for name, value in media.items()}
    _reference(model, prompt, 2, 2, media)  # warm up both paths (and compile ours: not timed)
    pipe.generate(input_ids=prompt, max_new_tokens=2, max_frames=2, **media)
    ref_times, our_times, ref_cpu, our_cpu, first_audio = [], [], [], [], []
    for _ in range(repeats):
        start, start_cpu = time.perf_counter(), time.process_time()
        ref_ids, ref_audio = _reference(model, prompt, max_new_tokens, max_frames, media)
        ref_times.append(time.perf_counter() - start)
        ref_cpu.append(time.process_time() - start_cpu)
        start, start_cpu = time.perf_counter(), time.process_time()
        out = pipe.generate(input_ids=prompt, max_new_tokens=max_new_tokens, max_frames=max_frames, **media)
        our_times.append(time.perf_counter() - start)
        our_cpu.append(time.process_time() - start_cpu)
        start = time.perf_counter()
        for event in pipe.stream(input_ids=prompt, max_new_tokens=max_new_tokens, max_frames=max_frames, **media):
            if event.audio is not None:
                first_audio.append(time.perf_counter() - start)
                break
    same = out.text_ids == ref_ids and out.audio.shape == ref_audio.shape and abs(out.audio - ref_audio).max() < 1e-5
    audio_seconds = len(out.audio) / out.sample_rate
    ref_total, our_total, ttfa = min(ref_times), min(our_times), min(first_audio)
    result = dict(
        config=name, input=kind, device=str(device), prompt_tokens=len(prompt), compile_predictor=compile_predictor, params_millions=round(num_params / 1e6, 1), size_mb=round(num_params * 4 / 2**20),
        thinker_tokens=len(out.text_ids), frames=int(out.codes.shape[1]), audio_seconds=round(audio_seconds, 3),
        identical_to_reference=bool(same),
        reference_total_s=round(ref_total, 3), ours_total_s=round(our_total, 3),
        speedup_total=round(ref_total / our_total, 2),
        reference_cpu_s=round(min(ref_cpu), 3), ours_cpu_s=round(min(our_cpu), 3),
        speedup_cpu=round(min(ref_cpu) / min(our_cpu), 2),
        ours_time_to_first_audio_s=round(ttfa, 3), first_audio_share_of_reference_total=round(ttfa / ref_total, 3),
        reference_rtf=round(ref_total / audio_seconds, 3), ours_rtf=round(our_total / audio_seconds, 3),
    )
    print(json.dumps(result))
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer tokens / frames / repeats")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--compile", choices=["frame", "step", "none"], default="frame",
        help="how our code predictor is compiled (CodePredictorRunner compile=...)",
    )
    parser.add_argument("--config", choices=sorted(CONFIGS), action="append", help="run only these configs (repeatable)")
    parser.add_argument("--device", default="cpu", help="where both sides run (cpu, cuda, cuda:N)")
    parser.add_argument("--input", choices=["text", "audio", "image"], default="text", help="what the question is")
    parser.add_argument("--repeats", type=int, default=None, help="timed repeats per config (default 3, 1 with --quick)")
    parser.add_argument("--out", default="benchmarks/results/e2e.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    max_new_tokens, max_frames, repeats = (16, 40, 1) if args.quick else (32, 100, 3)
    repeats = args.repeats or repeats
    compile_predictor = False if args.compile == "none" else args.compile
    results = [bench(name, kwargs, max_new_tokens, max_frames, repeats, compile_predictor, args.input, args.device)
               for name, kwargs in CONFIGS.items()
               if not args.config or name in args.config]
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(dict(machine=platform.processor() or platform.machine(), threads=args.threads, input=args.input,
                       max_new_tokens=max_new_tokens, max_frames=max_frames, results=results), f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
