"""Qwen3-TTS end to end: `OmniPipeline.speech` vs the `qwen_tts` reference's `generate` + its speech tokenizer's
decode, on the same checkpoint directory (released layout, random weights), greedy, in one run.

Per config and batch size (1 and 8): wall and CPU time of each side and the ratio (reference / ours), after a
warm-up of each; batch 1 also checks that the codes are the same. Then our time to the first audio chunk
(`stream_speech`, a 1-frame first chunk) next to the reference's total, and, with `--real-dims`, one talker
frame at Qwen3-TTS-12Hz-0.6B's widths (28-layer talker, 5-layer predictor; its text vocabulary shrunk, the
text embedding plays no part in a frame): ms per frame of each side over the same frames. The codec is the
tiny speech tokenizer decoder in every config (`tiny_speech_tokenizer`).

The reference is imported from the tests (`tests/qwen_tts_reference.py`: `qwen_tts` installed --no-deps, with
its transformers-5.24 patches), so run from the repository root:

    python benchmarks/tts_e2e.py [--quick] [--threads 1] [--configs tiny mid] [--real-dims] [--out tts_e2e.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

import qwen_tts_reference  # noqa: E402

from omnimtp.codec.speech_tokenizer import tiny_speech_tokenizer  # noqa: E402
from omnimtp.models.qwen3_tts import (  # noqa: E402
    QWEN3_TTS_0_6B_PREDICTOR,
    QWEN3_TTS_0_6B_TALKER,
    Qwen3TTSModel,
    tiny_config,
    tiny_qwen3_tts,
)
from omnimtp.pipeline import OmniPipeline  # noqa: E402
from omnimtp.tokenizer import byte_tokenizer  # noqa: E402

CONFIGS = {
    "tiny": dict(),
    "mid": dict(talker_hidden_size=512, predictor_hidden_size=256, num_layers=4),
}
TEXTS = [
    "Hello there, this is a benchmark.", "Another sentence to speak.", "Short.", "A little longer one, with a comma."
]
VOICES = ["aiden", "vivian"]


def _timed(fn):
    wall, cpu = time.perf_counter(), time.process_time()
    result = fn()
    return result, time.perf_counter() - wall, time.process_time() - cpu


def _save(path: str, model: Qwen3TTSModel) -> str:
    model.save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    tiny_speech_tokenizer(0).save_pretrained(os.path.join(path, "speech_tokenizer"))
    return path


class Reference:
    """The reference's generate + decode on a checkpoint directory."""

    def __init__(self, path: str):
        self.model = qwen_tts_reference.talker_model(path)
        self.tokenizer = qwen_tts_reference.load_speech_tokenizer(os.path.join(path, "speech_tokenizer"))

    def codes(self, ids_rows, speakers, frames):
        codes, _ = self.model.generate(
            input_ids=[torch.tensor([ids]) for ids in ids_rows], languages=["auto"] * len(ids_rows), speakers=speakers,
            do_sample=False, subtalker_dosample=False, max_new_tokens=frames + 1,
        )
        return codes

    def speak(self, ids_rows, speakers, frames):
        codes = self.codes(ids_rows, speakers, frames)
        with torch.no_grad():
            audio = self.tokenizer.decode(
                audio_codes=torch.nn.utils.rnn.pad_sequence(codes, batch_first=True, padding_value=-1)
            )
        return codes, audio.audio_values


def bench_config(name: str, options: dict, frames: int, repeats: int) -> dict:
    with tempfile.TemporaryDirectory() as path:
        _save(path, tiny_qwen3_tts(0, **options))
        pipe = OmniPipeline.from_pretrained(path, max_frames=frames, max_batch_size=8)
        reference = Reference(path)
        result = {"config": name, "frames": frames}
        for batch_size in (1, 8):
            texts = [TEXTS[i % len(TEXTS)] for i in range(batch_size)]
            voices = [VOICES[i % len(VOICES)] for i in range(batch_size)]
            ids_rows = [pipe.family.speech_ids(text) for text in texts]
            ours = lambda texts=texts, voices=voices: pipe.speech(texts, voice=voices)  # noqa: E731
            theirs = lambda ids_rows=ids_rows, voices=voices: reference.speak(ids_rows, voices, frames)  # noqa: E731
            ours(), theirs()  # warm-up
            ours_wall = ours_cpu = ref_wall = ref_cpu = 0.0
            for _ in range(repeats):
                outputs, wall, cpu = _timed(ours)
                ours_wall, ours_cpu = ours_wall + wall / repeats, ours_cpu + cpu / repeats
                (ref_codes, _), wall, cpu = _timed(theirs)
                ref_wall, ref_cpu = ref_wall + wall / repeats, ref_cpu + cpu / repeats
            entry = {"ours_s": ours_wall, "ours_cpu_s": ours_cpu, "reference_s": ref_wall, "reference_cpu_s": ref_cpu,
                     "ratio": ref_wall / ours_wall, "cpu_ratio": ref_cpu / ours_cpu,
                     "audio_s": sum(len(o.audio) for o in outputs) / 24_000}
            if batch_size == 1:
                entry["codes_equal"] = bool(torch.equal(outputs[0].codes, ref_codes[0].T))
            result[f"batch_{batch_size}"] = entry
        started = time.perf_counter()
        next(iter(pipe.stream_speech(TEXTS[0], voice=VOICES[0])))
        result["ttfa_s"] = time.perf_counter() - started
        result["ttfa_share_of_reference"] = result["ttfa_s"] / result["batch_1"]["reference_s"]
    return result


def bench_real_frame(frames: int) -> dict:
    """ms per frame at Qwen3-TTS-0.6B's widths, each side over `frames` frames after its prefill (the prefill's
    time, from a 1-frame run, subtracted)."""
    config = tiny_config(talker=dict(QWEN3_TTS_0_6B_TALKER, text_vocab_size=320, vocab_size=3072),
                         predictor=dict(QWEN3_TTS_0_6B_PREDICTOR, vocab_size=2048), initializer_range=0.02)
    torch.manual_seed(0)
    model = Qwen3TTSModel(config)
    with tempfile.TemporaryDirectory() as path:
        _save(path, model)
        pipe = OmniPipeline.from_pretrained(path, max_frames=frames)
        reference = Reference(path)
        ids = pipe.family.speech_ids(TEXTS[0])
        result = {"frames": frames}
        for side, run in (("ours", lambda n: pipe.speech(TEXTS[0], voice="aiden", max_frames=n)),
                          ("reference", lambda n: reference.codes([ids], ["aiden"], n))):
            run(1)
            _, one, _ = _timed(lambda run=run: run(1))
            _, many, _ = _timed(lambda run=run: run(frames))
            result[f"{side}_ms_per_frame"] = 1000 * (many - one) / (frames - 1)
        result["ratio"] = result["reference_ms_per_frame"] / result["ours_ms_per_frame"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="8 frames, 1 repeat (a check that it runs)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--frames", type=int, default=None, help="frames per request (default 50; --quick 8)")
    parser.add_argument("--real-dims", action="store_true", help="also one frame at Qwen3-TTS-0.6B's widths")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    frames = args.frames or (8 if args.quick else 50)
    repeats = 1 if args.quick else 3
    results = {"machine": platform.processor() or platform.machine(), "threads": args.threads,
               "torch": torch.__version__, "configs": []}
    for name in args.configs:
        entry = bench_config(name, CONFIGS[name], frames, repeats)
        results["configs"].append(entry)
        for batch in ("batch_1", "batch_8"):
            e = entry[batch]
            print(f"{name:5s} {batch}: ours {e['ours_s']:.2f} s (cpu {e['ours_cpu_s']:.2f}), reference "
                  f"{e['reference_s']:.2f} s (cpu {e['reference_cpu_s']:.2f}) -> {e['ratio']:.1f}x wall, "
                  f"{e['cpu_ratio']:.1f}x cpu" + (f", codes equal: {e['codes_equal']}" if "codes_equal" in e else ""))
        print(f"{name:5s} time to first audio (streamed): {entry['ttfa_s'] * 1000:.0f} ms "
              f"({100 * entry['ttfa_share_of_reference']:.1f}% of the reference's batch-1 total)")
    if args.real_dims:
        frame = bench_real_frame(4 if args.quick else 12)
        results["real_dims_frame"] = frame
        print(f"0.6B dims, one frame: ours {frame['ours_ms_per_frame']:.0f} ms, reference "
              f"{frame['reference_ms_per_frame']:.0f} ms -> {frame['ratio']:.1f}x")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
