"""End-to-end speech: OmniPipeline vs transformers' `generate(return_audio=True)` on the same weights.

Both sides run greedy with the same caps (thinker tokens, talker frames) and produce the same tokens and
codes (checked here). Reported per config: total wall time of each (ours: `generate`) and the ratio, our
time to the first audio chunk (`stream`) and its share of the reference's total, and real-time factors
(wall time / audio time).
CPU time of the process (`time.process_time`) is reported next to wall time: on a shared, loaded machine
it is the steadier of the two for comparing ours with the reference (both run with the same thread count).
Our code predictor is compiled during the untimed warm-up: the whole frame as one graph by default
(`compile_predictor="frame"`; its first compile takes a minute or two per config on a CPU, later runs hit
inductor's disk cache), `--compile step` for one graph per predictor step, `--compile none` for eager.

`--family qwen2_5` runs Qwen2.5-Omni instead (thinker → single-codebook talker → token2wav, text questions):
both sides greedy with `torch.manual_seed` set identically before each, so the audio is the same bits (token2wav's
DiT noise comes from the global RNG); token2wav decodes once at the end, so the first audio is the whole audio.
`--real-dims` builds its thinker and talker at the real Qwen2.5-Omni-3B widths with 2 layers each (tiny
vocabularies and token2wav).

`--input audio` asks a spoken question instead (5 s of log-mel features through transformers' audio encoder,
65 audio rows in the prompt), `--input image` shows a 224×224-sized image (14 × 14 patches): the time to the first
audio then includes the encoder. The features are random (the encoders' work does not depend on them).

    python benchmarks/e2e.py [--quick] [--threads 1] [--compile frame|step|none] [--config mid]
        [--input text|audio|image] [--family qwen3|qwen2_5] [--real-dims] [--out benchmarks/results/e2e.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))  # this checkout, not an installed copy

from omnimtp.models.tiny import THINKER_SPECIAL_TOKENS, tiny_qwen3_omni  # noqa: E402
from omnimtp.models.tiny_qwen2_5_omni import (  # noqa: E402
    QWEN2_5_OMNI_3B_TALKER,
    QWEN2_5_OMNI_3B_THINKER,
    TINY_QWEN2_5_CODEC,
    qwen2_5_byte_tokenizer,
    tiny_qwen2_5_omni,
)
from omnimtp.pipeline import OmniPipeline  # noqa: E402
from omnimtp.tokenizer import byte_tokenizer  # noqa: E402

CONFIGS = {
    "tiny": dict(),
    "mid": dict(hidden_size=1024, num_thinker_layers=4, num_talker_layers=4),
}
QWEN2_5_CONFIGS = {
    "tiny": dict(),
    "real-dims": dict(thinker_widths=QWEN2_5_OMNI_3B_THINKER, talker_widths=QWEN2_5_OMNI_3B_TALKER),
}


def _reference(model, prompt, max_new_tokens, max_frames, media):
    sequences, wav = model.generate(
        input_ids=torch.tensor([prompt], device=model.device),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=model.device), return_audio=True,
        speaker="Ethan", thinker_max_new_tokens=max_new_tokens, thinker_eos_token_id=model.config.im_end_token_id,
        thinker_do_sample=False, talker_do_sample=False, talker_max_new_tokens=max_frames + 1, **media,
    )
    return sequences[0, len(prompt):].tolist(), wav[0, 0].cpu().numpy()


def _reference_qwen2_5(model, prompt, max_new_tokens, max_frames, media):
    """transformers' Qwen2.5-Omni generate, greedy, talker EOS = the config's codec end and pad ids."""
    torch.manual_seed(0)
    sequences, wav = model.generate(
        input_ids=torch.tensor([prompt], device=model.device), speaker="Chelsie",
        thinker_max_new_tokens=max_new_tokens, thinker_eos_token_id=QWEN2_5_EOS, thinker_do_sample=False,
        talker_do_sample=False, talker_max_new_tokens=max_frames,
        talker_eos_token_id=[TINY_QWEN2_5_CODEC["eos"], TINY_QWEN2_5_CODEC["pad"]],
    )
    return sequences[0, len(prompt):].tolist(), wav.cpu().numpy()


QWEN2_5_EOS = 257  # <|im_end|> of the tiny vocab


def _question(tokenizer, model, kind: str) -> tuple[list[int], dict]:
    """The prompt ids and media tensors of a question in `kind` (text, audio or image)."""
    text = {"text": "Tell me about the weather today.", "audio": "Answer the question.", "image": "What is this?"}[kind]
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, return_dict=False
    )
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


def bench(name, config_kwargs, max_new_tokens, max_frames, repeats, compile_predictor, kind="text", device="cpu",
          family="qwen3"):
    if family == "qwen2_5":
        model = tiny_qwen2_5_omni(0, **config_kwargs).to(device)
        pipe = OmniPipeline(model, qwen2_5_byte_tokenizer(), max_batch_size=1)
        reference = _reference_qwen2_5
    else:
        model = tiny_qwen3_omni(0, **config_kwargs).to(device)
        pipe = OmniPipeline(model, byte_tokenizer(), max_batch_size=1, compile_predictor=compile_predictor)
        reference = _reference
    num_params = sum(p.numel() for p in model.parameters())
    prompt, media = _question(pipe.tokenizer, model, kind)
    media = {name: value.to(device) for name, value in media.items()}
    reference(model, prompt, 2, 2, media)  # warm up both paths (and compile ours: not timed)
    pipe.generate(input_ids=prompt, max_new_tokens=2, max_frames=2, **media)
    ref_times, our_times, ref_cpu, our_cpu, first_audio = [], [], [], [], []
    for _ in range(repeats):
        start, start_cpu = time.perf_counter(), time.process_time()
        ref_ids, ref_audio = reference(model, prompt, max_new_tokens, max_frames, media)
        ref_times.append(time.perf_counter() - start)
        ref_cpu.append(time.process_time() - start_cpu)
        torch.manual_seed(0)
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
        family=family, config=name, input=kind, device=str(device), prompt_tokens=len(prompt),
        compile_predictor=compile_predictor if family == "qwen3" else None,
        params_millions=round(num_params / 1e6, 1), size_mb=round(num_params * 4 / 2**20),
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
    parser.add_argument(
        "--config", choices=sorted(CONFIGS), action="append", help="run only these configs (repeatable)"
    )
    parser.add_argument("--device", default="cpu", help="where both sides run (cpu, cuda, cuda:N)")
    parser.add_argument("--input", choices=["text", "audio", "image"], default="text", help="what the question is")
    parser.add_argument(
        "--repeats", type=int, default=None, help="timed repeats per config (default 3, 1 with --quick)"
    )
    parser.add_argument("--family", choices=["qwen3", "qwen2_5"], default="qwen3", help="which omni model family")
    parser.add_argument("--real-dims", action="store_true",
                        help="qwen2_5: also the config at the real 3B thinker / talker widths (2 layers each)")
    parser.add_argument("--out", default="benchmarks/results/e2e.json")
    args = parser.parse_args()
    if args.family == "qwen2_5" and args.input != "text":
        parser.error("--family qwen2_5 takes text questions only (--input text)")
    if args.real_dims and args.family != "qwen2_5":
        parser.error("--real-dims is for --family qwen2_5 (Qwen3 has --config mid)")
    torch.set_num_threads(args.threads)
    max_new_tokens, max_frames, repeats = (16, 40, 1) if args.quick else (32, 100, 3)
    repeats = args.repeats or repeats
    compile_predictor = False if args.compile == "none" else args.compile
    if args.family == "qwen2_5":
        configs = {name: kwargs for name, kwargs in QWEN2_5_CONFIGS.items() if name == "tiny" or args.real_dims}
    else:
        configs = {name: kwargs for name, kwargs in CONFIGS.items() if not args.config or name in args.config}
    results = [bench(name, kwargs, max_new_tokens, max_frames, repeats, compile_predictor, args.input, args.device,
                     args.family) for name, kwargs in configs.items()]
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(dict(machine=platform.processor() or platform.machine(), threads=args.threads, family=args.family,
                       input=args.input,
                       max_new_tokens=max_new_tokens, max_frames=max_frames, results=results), f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
