"""benchmarks/tts_realtime.py, benchmarks/quantized_quality.py --quick, benchmarks/omni_codec.py,
benchmarks/speech_decoder.py, benchmarks/served_step.py, benchmarks/chat_first_audio.py,
benchmarks/decode_attention.py, benchmarks/decode_step_parts.py, benchmarks/many_row_attention.py,
benchmarks/moe_experts.py, benchmarks/many_row_linear.py,
benchmarks/encoder_conv.py, benchmarks/fused_w8a8.py, benchmarks/admission_bound.py and
benchmarks/omni_realsize.py at tiny sizes, so the
scripts cannot rot: every mode, two batch sizes, the profile and (where `qwen_tts` is installed) the reference; every
quality figure, with fp32 agreeing with itself nowhere but where it must."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from omnimtp.runtime.ops import many_row_mode_reason

ROOT = Path(__file__).resolve().parent.parent


def _run(command: list[str]) -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    process = subprocess.run([sys.executable, *command], cwd=ROOT, env=env, capture_output=True, text=True,
                             timeout=600)
    assert process.returncode == 0, process.stderr[-3000:]


def test_realtime_quick_run_reports_every_part(tmp_path):
    out = tmp_path / "realtime.json"
    has_reference = importlib.util.find_spec("qwen_tts") is not None
    command = ["benchmarks/tts_realtime.py", "--size", "tiny", "--quick", "--batch-sizes", "1", "2",
               "--threads", "1", "--in-process", "--profile", "--cache-dir", str(tmp_path / "cache"), "--out", str(out)]
    if not has_reference:
        command.append("--no-reference")
    _run(command)
    results = json.loads(out.read_text())
    machine = results["machine"]
    assert machine["read_gb_s"] > 0 and machine["copy_gb_s"] > 0 and machine["fp32_matmul_gflop_s"] > 0
    assert [entry["mode"] for entry in results["modes"]] == ["fp32", "bf16", "int8", "int4", "w4a8"]
    for entry in results["modes"]:
        assert "unsupported" not in entry and "failed" not in entry, entry
        assert entry["ttfa_s"] > 0 and entry["peak_rss_mb"] >= entry["rss_loaded_mb"] > 0
        assert entry["peak_rss_mb"] >= entry["load_peak_rss_mb"] > 0
        for batch_size in (1, 2):
            batch = entry[f"batch_{batch_size}"]
            assert len(batch["frames"]) == batch_size and batch["audio_s"] > 0 and batch["rtf"] > 0
            parts = batch["ms_per_frame"]
            assert all(parts[name] >= 0 for name in ("talker", "code_predictor", "decoder"))
            assert abs(sum(parts[n] for n in ("talker", "code_predictor", "decoder", "rest")) - parts["total"]) < 1e-6
            floor = batch["floor"]
            assert floor["talker_ms"] > 0 and floor["code_predictor_ms"] > 0 and floor["decoder_ms"] > 0
            assert 0 < floor["rtf"] <= batch["rtf"]  # the parts at their floors, nothing else
    fp32, int8, int4, w4a8 = (results["modes"][i]["batch_1"]["floor"] for i in (0, 2, 3, 4))
    # the floors read the weights the engine holds (the layers' quantized as stored; the codec head stays float)
    assert int4["talker_weight_bytes"] < int8["talker_weight_bytes"] < fp32["talker_weight_bytes"]
    assert w4a8["talker_weight_bytes"] == int4["talker_weight_bytes"]  # the same int4 weights
    profile = results["modes"][0]["profile"]
    assert profile["ops_per_frame"] > 0 and profile["top_ops"]
    if has_reference:
        assert results["reference"]["batch_1"]["rtf"] > 0 and results["reference"]["batch_2"]["rtf"] > 0
        assert results["modes"][0]["batch_1"]["speedup_vs_reference"] > 0


def test_quality_quick_run_reports_every_part(tmp_path):
    out = tmp_path / "quality.json"
    _run(["benchmarks/quantized_quality.py", "--quick", "--threads", "1", "--cache-dir", str(tmp_path / "cache"),
          "--out", str(out)])
    results = json.loads(out.read_text())
    for key in ("demo_lm", "demo_omni_thinker", "demo_glm5_experts"):
        entry = results[key]
        assert entry["fp32_perplexity"] > 1
        for mode in ("int8", "int4", "w4a8"):
            assert 0 <= entry[mode]["greedy_agreement"] <= 1 and entry[mode]["perplexity"] > 1
    talker = results["tts_talker"]
    for mode in ("int8", "int4", "w4a8"):
        assert 0 <= talker[mode]["codebook0_top1_agreement"] <= 1
    # int8 keeps 8 bits a weight, int4 4: the logits move, and int8's less than int4's; w4a8 rounds its inputs too
    assert 0 < talker["int8"]["logits_relative_error"] < talker["int4"]["logits_relative_error"]
    assert talker["w4a8"]["logits_relative_error"] != talker["int4"]["logits_relative_error"]
    assert 0 < talker["text_projection_int8_relative_error"] < 0.05
    predictor = results["tts_code_predictor"]
    assert set(predictor["int8"]) == {"heads_int8"} and set(predictor["int4"]) == {"heads_int8", "heads_int4"}
    assert set(predictor["w4a8"]) == {"heads_int8", "heads_w4a8"}
    for figures in (*predictor["int8"].values(), *predictor["int4"].values(), *predictor["w4a8"].values()):
        assert 0 <= figures["top1_agreement"] <= 1 and figures["logits_relative_error"] > 0
    codec = results["tts_codec"]  # the bf16 conv stack changes the audio, within what docs/tts.md states
    assert 20 <= codec["bf16_one_shot_snr_db"] < 60 and 20 <= codec["bf16_streamed_snr_db"] < 60


def test_realtime_quick_run_with_the_codec_in_bf16(tmp_path):
    """--codec-dtypes: each mode once per codec dtype; the bf16 decoder's floor is its FLOPs over the bf16 peak.
    --prequantized: each again from `omnimtp quantize`'s copy."""
    out = tmp_path / "realtime.json"
    _run(["benchmarks/tts_realtime.py", "--size", "tiny", "--quick", "--batch-sizes", "1", "--threads", "1",
          "--in-process", "--no-reference", "--modes", "w4a8", "--codec-dtypes", "float32", "bfloat16",
          "--prequantized", "--cache-dir", str(tmp_path / "cache"), "--out", str(out)])
    results = json.loads(out.read_text())
    machine = results["machine"]
    assert [entry["mode"] for entry in results["modes"]] == [
        "w4a8", "w4a8 bfloat16 codec", "w4a8 pre-quantized", "w4a8 bfloat16 codec pre-quantized"]
    assert results["conversions"]["w4a8"]["peak_rss_mb"] > 0  # `omnimtp quantize` ran, and said what it cost
    assert (tmp_path / "cache" / "qwen3-tts-tiny-w4a8" / "quantized-00001.safetensors").is_file()
    fp32, bf16 = (entry["batch_1"]["floor"] for entry in results["modes"][:2])
    assert fp32["decoder_gflop_per_frame"] == pytest.approx(bf16["decoder_gflop_per_frame"], rel=1e-6)
    ratio = machine["fp32_matmul_gflop_s"] / machine["bf16_matmul_gflop_s"]
    assert bf16["decoder_ms"] == pytest.approx(fp32["decoder_ms"] * ratio, rel=1e-6)


def test_omni_codec_quick_run_reports_every_part(tmp_path):
    """benchmarks/omni_codec.py --tiny: every decoder at each batch size, the floors from the FLOP count (the bf16
    one lower: its conv stack over the bf16 peak), and bf16's audio within what docs/speech.md states."""
    out = tmp_path / "omni_codec.json"
    _run(["benchmarks/omni_codec.py", "--tiny", "--frames", "27", "--rounds", "1", "--batch-sizes", "1", "2",
          "--threads", "1", "--out", str(out)])
    results = json.loads(out.read_text())
    assert results["bounds"] == [0, 1, 26, 27] and results["gflop_per_frame"] > 0
    assert 0 < results["conv_stack_share"] <= 1
    floors = results["floor_ms_per_frame"]
    assert 0 < floors["bf16"] <= floors["fp32"]
    for batch_size in ("1", "2"):
        entry = results["batches"][batch_size]
        assert set(entry["ms_per_frame"]) == {"reference", "fp32", "bf16"} and min(entry["ms_per_frame"].values()) > 0
        assert 20 <= entry["bf16_snr_db"] < 60 and entry["fp32_rms"] > 0.01


def test_served_step_quick_run_counts_each_schedules_decoder_calls(tmp_path):
    """benchmarks/served_step.py --quick: every schedule timed with its phases; the same seeded frames in each, and
    the decoder called once a chunk of the schedule (`chunk_frames_after`), once in all without streaming."""
    from omnimtp.engine.playback import chunk_frames_after

    out = tmp_path / "served_step.json"
    _run(["benchmarks/served_step.py", "--quick", "--streams", "1", "--threads", "1", "--out", str(out)])
    results = json.loads(out.read_text())["results"]
    assert set(results) == {"one-shot x1", "served x1", "chunks x1"}
    (frames,) = results["served x1"]["frames"]
    assert frames >= 2 and all(entry["frames"] == [frames] for entry in results.values())
    for entry in results.values():
        assert entry["steps"] >= 1 and entry["mean_ms"] > 0 and entry["phase_ms_per_step"]["talk"] > 0

    def num_chunks(playout_rtf):
        done, count = 1, 1  # the first chunk: one frame
        while done < frames:
            done, count = done + chunk_frames_after(done, 25, playout_rtf), count + 1
        return count

    assert results["one-shot x1"]["decode_calls"] == 1
    assert results["served x1"]["decode_calls"] == num_chunks(0.9) > results["chunks x1"]["decode_calls"]
    assert results["chunks x1"]["decode_calls"] == num_chunks(None)

def test_chat_first_audio_quick_run_reports_both_thinkers_and_a_first_audio_in_the_first_step(tmp_path):
    """benchmarks/chat_first_audio.py --quick (the demo Qwen3-Omni, plain and `auto`): every measurement for both
    thinkers; a request into an idle core gets its first audio in the core's first step with either."""
    out = tmp_path / "chat_first_audio.json"
    _run(["benchmarks/chat_first_audio.py", "--quick", "--out", str(out)])
    report = json.loads(out.read_text())
    assert set(report) == {"burst 1", "start 1", "newcomer after 2"}
    for medians in report.values():
        assert set(medians) == {"plain", "auto"} and all(v > 0 for m in medians.values() for v in m.values())
    for name in ("plain", "auto"):
        burst = report["burst 1"][name]
        assert burst["steps"] == 1 and burst["cpu_last"] <= burst["last"] + 1e-3
        assert {"think", "talker_admit", "talk", "code2wav"} <= set(burst)


def test_speech_decoder_quick_run_compares_two_trees(tmp_path):
    """benchmarks/speech_decoder.py --quick on a tiny decoder, this checkout against itself as the previous tree:
    every chunk size timed in both, the same audio bit for bit, within streaming rounding of the one-shot decode,
    and (the stateful conv stack) as many FLOPs a frame in 1-frame chunks as in 3-frame ones, within 2 %."""
    from omnimtp.codec.speech_tokenizer import tiny_speech_tokenizer

    tiny_speech_tokenizer(0).save_pretrained(tmp_path / "model" / "speech_tokenizer")
    out = tmp_path / "speech_decoder.json"
    _run(["benchmarks/speech_decoder.py", "--model", str(tmp_path / "model"), "--quick", "--chunks", "1", "3",
          "--threads", "1", "--previous-tree", str(ROOT), "--out", str(out)])
    results = json.loads(out.read_text())
    assert results["decoder_gflop_per_frame"] > 0
    rows = {row["chunk_frames"]: row for row in results["results"]}
    assert set(rows) == {1, 3}
    for row in rows.values():
        assert row["floor_ms_per_frame"] > 0
        assert row["current"]["ms_per_frame"] > 0 and row["previous"]["ms_per_frame"] > 0
        assert row["current"]["cpu_ms_per_frame"] > 0 and row["previous"]["cpu_ms_per_frame"] > 0
        assert row["current"]["max_rel_diff_vs_previous"] == 0
        assert row["current"]["max_rel_diff_vs_one_shot"] < 1e-4
        assert row["current"]["gflop_per_frame"] == row["previous"]["gflop_per_frame"]
    assert rows[3]["current"]["gflop_per_frame"] <= rows[1]["current"]["gflop_per_frame"] <= (
        1.02 * rows[3]["current"]["gflop_per_frame"])
    # --codec-dtype bfloat16: the decoder as a server under load runs it; its audio is not the fp32 decoder's
    _run(["benchmarks/speech_decoder.py", "--model", str(tmp_path / "model"), "--quick", "--chunks", "1",
          "--threads", "1", "--no-flops", "--codec-dtype", "bfloat16", "--previous-tree", str(ROOT), "--out", str(out)])
    results = json.loads(out.read_text())
    assert results["config"]["codec_dtype"] == "bfloat16"
    (row,) = results["results"]
    assert row["current"]["max_rel_diff_vs_previous"] == 0
    assert 1e-4 < row["current"]["max_rel_diff_vs_one_shot"] < 0.5  # bf16's rounding, carried (the stack's audio)


def test_decode_attention_quick_run_reports_every_length(tmp_path):
    """benchmarks/decode_attention.py --quick: both sides cold and warm at each length, the floor from the read
    bandwidth, the kernel within fp32 rounding of SDPA (bf16: within a bf16 step of fp32 SDPA)."""
    from omnimtp.runtime.kernels import small_batch_linear

    if not small_batch_linear.available():
        pytest.skip(f"kernel unavailable: {small_batch_linear.unavailable_reason()}")
    # a batch-1 step, a batched one whose rows the mask keeps to their lengths, a bf16 cache (within its rounding)
    for rows, dtype in ((1, "float32"), (3, "float32"), (1, "bfloat16")):
        out = tmp_path / f"decode_attention_{rows}_{dtype}.json"
        _run(["benchmarks/decode_attention.py", "--quick", "--lengths", "1", "40", "--layers", "3", "--rounds", "3",
              "--rows", str(rows), "--threads", "1", "--dtype", dtype, "--out", str(out)])
        results = json.loads(out.read_text())
        assert results["heads"] == [16, 8, 128] and results["rows"] == rows and set(results["lengths"]) == {"1", "40"}
        assert results["dtype"] == dtype
        for entry in results["lengths"].values():
            assert entry["max_rel_error"] < (1e-5 if dtype == "float32" else 2**-7) and entry["floor_us"] > 0
            assert min(entry[f"{name}_{state}_us"] for name in ("sdpa", "ours") for state in ("cold", "warm")) > 0


def test_many_row_attention_quick_run_reports_both_masks_and_the_aligners_error(tmp_path):
    """benchmarks/many_row_attention.py --quick: the bf16 kernel and SDPA alternated (causal and full), within bf16
    rounding of SDPA; the tiny aligner's timestamps with int8_compute on SDPA and on the kernel against fp32."""
    from omnimtp.runtime.kernels import bf16_attention

    if not bf16_attention.available() or many_row_mode_reason("cpu") is not None:
        pytest.skip("the bf16 attention kernel or int8_compute does not run here")
    out = tmp_path / "many_row_attention.json"
    _run(["benchmarks/many_row_attention.py", "--quick", "--threads", "1", "--aligner-error", "--out", str(out)])
    results = json.loads(out.read_text())
    entry = results["positions"]["100"]
    for mask in ("causal", "full"):
        assert 1e-5 < entry[mask]["rel_error"] < 1e-2 and entry[mask]["ratio"] > 0 and entry[mask]["ours_ms"] > 0
    errors = results["aligner_error"]
    assert errors["timestamp_slots"] > 0 and errors["positions"] > errors["timestamp_slots"]
    for name in ("int8_compute_sdpa", "int8_compute"):
        assert 0 < errors[name]["rows_rel_error"] < 0.5 and 0 <= errors[name]["bins_equal"] <= 1
    assert errors["int8_compute"] != errors["int8_compute_sdpa"]  # the kernel ran in the second


def test_decode_step_parts_quick_run_reports_every_part(tmp_path):
    """benchmarks/decode_step_parts.py at tiny widths: every part timed with its floor, and the native step alternated
    with a second build of this checkout's source, whose outputs on the same cache are the same bits."""
    from omnimtp.runtime.kernels import small_batch_linear

    if not small_batch_linear.available():
        pytest.skip(f"kernel unavailable: {small_batch_linear.unavailable_reason()}")
    out = tmp_path / "parts.json"
    _run(["benchmarks/decode_step_parts.py", "--quick", "--layers", "2", "--hidden", "128", "--heads", "4",
          "--kv-heads", "2", "--head-dim", "64", "--intermediate", "256", "--vocab", "300", "--keys", "21",
          "--capacity", "32", "--rounds", "3", "--threads", "1", "--cpu-time", "--agreement-rows", "64",
          "--baseline", "omnimtp/runtime/kernels/small_batch_linear.c", "--out", str(out)])
    results = json.loads(out.read_text())
    assert results["clock"] == "process_time"
    assert set(results["parts"]) == {"w4a8 qkv x2", "w4a8 o x2", "w4a8 gate_up x2", "w4a8 down x2", "attention x2",
                                     "native step", "head (int8)", "argmax", "head (screened)"}
    screened = results["parts"]["head (screened)"]
    assert screened["rows"] == 64 and screened["equal_to_int8"] == 64
    assert all(part["ms"] > 0 and part["floor_ms"] > 0 for part in results["parts"].values())
    alternated = results["native_step_alternated"]
    assert alternated["ratio"] > 0 and alternated["max_abs_difference"] == 0.0


def test_floors_count_every_multiply_add_of_a_quantized_matrix():
    """A quantized matrix does as many multiply-adds a row as its float form (int4 packs 8 inputs to a word)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import torch
    from tts_realtime import _matrix_macs

    from omnimtp.runtime.kernels import small_batch_linear
    from omnimtp.runtime.ops import quantize_weight

    if not small_batch_linear.available():
        pytest.skip(f"kernel unavailable: {small_batch_linear.unavailable_reason()}")
    weight = torch.randn(48, 256)
    assert [_matrix_macs(quantize_weight(weight, mode)) for mode in ("int8", "int4", "w4a8")] == [weight.numel()] * 3


def test_moe_experts_quick_run_times_every_variant_against_its_floor(tmp_path):
    out = tmp_path / "moe.json"
    _run(["benchmarks/moe_experts.py", "--quick", "--threads", "1", "--out", str(out)])
    results = json.loads(out.read_text())
    assert [row["tokens"] for row in results["rows"]] == [1, 3]
    for row in results["rows"]:
        assert set(row["ms"]) == {"bf16", "fp32", "int8", "int4", "w4a8", "w4a8-loop"}
        assert all(ms > 0 for ms in row["ms"].values())
        floors = row["floor_ms"]  # bytes read: fp32 twice bf16's, int8 past int4's, w4a8 reading int4's weights
        assert floors["fp32"] > floors["bf16"] > floors["int8"] > floors["int4"] == floors["w4a8"] > 0


def test_omni_realsize_quick_run_builds_loads_and_measures_against_the_floors(tmp_path):
    out = tmp_path / "realsize.json"
    _run(["benchmarks/omni_realsize.py", "--quick", "--threads", "1", "--cache-dir", str(tmp_path / "cache"),
          "--out", str(out)])
    results = json.loads(out.read_text())
    assert results["build"]["bytes"] > 0 and results["load_s"] > 0
    assert results["peak_rss_gb"] >= results["rss_after_load_gb"] > 0
    thinker = results["thinker"]
    assert thinker["tokens_per_s_batch_1"] > 0 and thinker["tokens_per_s_batch_4"] > 0
    assert thinker["floor_tokens_per_s"] > thinker["tokens_per_s_batch_1"]  # nothing beats reading the bytes
    assert all(thinker[f"verify_k{k}_vs_step"] > 0 for k in (1, 2, 3))
    speech = results["speech"]
    assert speech["frames"] == 8 and speech["first_audio_s"] > 0 and speech["rtf"] > 0
    assert set(speech["ms_per_frame"]) == {"talker", "code_predictor", "code2wav"}
    assert results["warm_up"]["reply_s"] > 0 and results["warm_up"]["prefetch"]["is_done"]
    assert results["warm_up_s"] >= results["warm_up"]["reply_s"] and results["load_counts"]["minor_faults"] > 0
    for reply in (speech, results["speech_again"]):  # per stage of the reply: seconds, page faults, bytes read
        stages = reply["stages"]
        assert set(stages["to_first_audio"]) == {"thinker_prefill", "thinker_decode", "talker_prefill", "talker",
                                                 "code_predictor", "code2wav"}
        assert stages["to_first_audio"]["thinker_prefill"]["s"] > 0 and stages["to_first_audio"]["code2wav"]["s"] > 0
        assert stages["after_first_audio"]["code_predictor"]["s"] > 0
        assert all(c["major_faults"] >= 0 and c["minor_faults"] >= 0 and c["read_bytes"] >= 0
                   for part in stages.values() for c in part.values())


def test_omni_realsize_quick_run_of_the_qwen2_5_omni_config_builds_its_family(tmp_path):
    """--quick with a Qwen2.5-Omni config builds the tiny Qwen2.5-Omni (speakers, token2wav) and measures it: no
    code predictor, token2wav's share per frame, frames of 20 ms of audio (its DiT's 2 mel frames x BigVGAN's 240)."""
    out = tmp_path / "realsize.json"
    _run(["benchmarks/omni_realsize.py", "--quick", "--config", "benchmarks/configs/qwen2.5-omni-3b.json",
          "--threads", "1", "--cache-dir", str(tmp_path / "cache"), "--out", str(out)])
    results = json.loads(out.read_text())
    assert results["config"] == "quick-qwen2_5_omni" and results["build"]["bytes"] > 0
    assert results["thinker"]["floor_tokens_per_s"] > results["thinker"]["tokens_per_s_batch_1"] > 0
    speech = results["speech"]
    assert speech["frames"] == 8 and speech["frame_ms_of_audio"] == 20.0 and speech["rtf"] > 0
    assert speech["audio_s"] == pytest.approx(8 * 0.02)
    assert set(speech["ms_per_frame"]) == {"talker", "token2wav"}


def test_playback_quick_run_reports_every_load(tmp_path):
    """benchmarks/serve_playback.py --quick on the tiny Qwen3-TTS, this checkout's server with admission and
    without: every load's streams played, each with its first audio, underruns and continuity, and where first audio
    went by stage."""
    out = tmp_path / "playback.json"
    _run(["benchmarks/serve_playback.py", "--quick", "--workloads", "speech", "--compare", "--threads", "1",
          "--out", str(out)])
    results = json.loads(out.read_text())["results"]["speech"]
    assert set(results) == {"ours", "no_admit"}
    for levels in results.values():
        assert [level["load"][0] for level in levels] == ["alone", "burst", "poisson", "closed"]
        for level in levels:
            assert level["failed"] == 0 and level["streams"] + level["refused_429"] == level["requests"] > 0
            assert level["first_audio_p50_s"] > 0 and level["audio_s_per_s"] > 0
            assert 0 < level["continuity_min"] <= level["continuity_all"] <= 1
            stages = level["first_audio_stages_ms"]  # the server's own histograms, per load
            assert set(stages) == {"queue", "thinker", "talker", "code2wav"} and all(ms >= 0 for ms in stages.values())
            for stream in level["streams_detail"]:
                assert stream["audio_s"] > 0 and stream["underruns"] >= 0 and stream["queue_position"] is not None
            assert sum(n for n, _ in level["first_audio_by_group"].values()) == level["streams"]


def test_asr_speed_quick_run_reports_every_part(tmp_path):
    """benchmarks/asr_speed.py --quick: our modes and (where `qwen_asr` is installed) the reference, each part
    timed and next to its floor."""
    out = tmp_path / "asr.json"
    has_reference = importlib.util.find_spec("qwen_asr") is not None
    modes = ["fp32", "w4a8", "w4a8+w8a8+bf16kv" if many_row_mode_reason("cpu") is None else "w4a8+bf16kv"]
    command = ["benchmarks/asr_speed.py", "--quick", "--threads", "1", "--modes", *modes, "--out", str(out)]
    if not has_reference:
        command.append("--no-reference")
    _run(command)
    results = json.loads(out.read_text())
    assert results["workload"]["size"] == "tiny" and results["machine"]["read_gb_s"] > 0
    assert [entry["mode"] for entry in results["modes"]] == modes
    for entry in results["modes"]:
        assert "failed" not in entry, entry
        assert entry["reply_tokens"] == 8 and entry["prompt_tokens"] > 8
        assert entry["first_step_s"] > 0 and entry["encoder_s"] > 0 and entry["decode_ms_per_token"] > 0
        assert entry["rtf"] > 0 and entry["first_partial_s"] > 0 and entry["aligner"]["words"] == 8
        floor = entry["floor"]
        assert 0 < floor["decode_ms_per_token"] and 0 < floor["first_step_s"] < floor["transcribe_s"]
        assert entry["prefill_s"] >= 0 and floor["encoder_s"] > 0 and floor["prefill_s"] > 0
        assert floor["first_step_s"] == pytest.approx(floor["encoder_s"] + floor["prefill_s"])
        stages = entry["first_partial_stages"]
        assert stages["encoder_s"] > 0 and stages["first_step_s"] > 0 and stages["decode_steps"] >= 0
        for aligner in (entry["aligner"], entry["aligner_bytes"]):
            assert aligner["positions"] > 8 and aligner["encoder_s"] > 0 and aligner["forward_s"] > 0
            assert aligner["align_again_s"] > 0
            assert aligner["floor"]["encoder_s"] > 0 and aligner["floor"]["forward_s"] > 0
        # the transcript in BPE tokens (about the released tokenizer's count) is shorter than in bytes
        assert 1 <= entry["aligner"]["tokens_per_word"] < entry["aligner_bytes"]["tokens_per_word"]
        assert entry["aligner"]["positions"] < entry["aligner_bytes"]["positions"]
        assert entry["peak_rss_mb"] > 0
    if has_reference:
        reference = results["reference"]
        assert "failed" not in reference, reference
        assert reference["reply_tokens"] == 8
        assert reference["aligner"]["words"] == reference["aligner_bytes"]["words"] == 8
        assert results["modes"][0]["speedup_vs_reference"] > 0


@pytest.mark.skipif(many_row_mode_reason("cpu") is not None, reason="no w8a8 kernel here")
def test_encoder_conv_quick_run_reports_both_paths(tmp_path):
    out = tmp_path / "encoder_conv.json"
    _run(["benchmarks/encoder_conv.py", "--quick", "--threads", "1", "--out", str(out)])
    results = json.loads(out.read_text())
    assert set(results["ratios"]) == {"conv2d1 + GELU", "conv2d2 + GELU", "conv2d3 + GELU", "conv stack", "attention",
                                      "layers", "encoder"}
    assert all(ratio["wall"] > 0 for ratio in results["ratios"].values())
    for path in ("unfused", "fused"):
        errors = results["errors"][path]
        assert 0 < errors["conv stack"]["relative"] < 0.05 and errors["encoder"]["min_row_cosine"] > 0.99
    assert 0 < results["fused_vs_unfused"]["relative"] < 0.05


def test_many_row_linear_quick_run_reports_every_path(tmp_path):
    out = tmp_path / "many_rows.json"
    _run(["benchmarks/many_row_linear.py", "--quick", "--threads", "1", "--out", str(out)])
    results = json.loads(out.read_text())
    paths = results["shapes"][0]["paths"]
    expected = {"fp32", "bf16 (oneDNN, packed)", "w4a8 (omnimtp)"}
    if many_row_mode_reason("cpu") is None:
        expected |= {"w8a8 (oneDNN int8)", "w8a8: its row quantization alone", "torch._int_mm (int8 → int32)"}
    assert set(paths) == expected and all(figures["gflop_s"] > 0 for figures in paths.values())


def test_fused_w8a8_quick_run_compares_the_fused_forwards_with_the_torch_ops(tmp_path):
    """benchmarks/fused_w8a8.py --quick: the prefill and the aligner's forward, fused and on torch ops, alternated in
    one process, their outputs within int8 rounding of each other."""
    from omnimtp.runtime.kernels import w8a8_epilogues

    if many_row_mode_reason("cpu") is not None or not w8a8_epilogues.available():
        pytest.skip("int8_compute or the fused passes do not run here")
    out = tmp_path / "fused_w8a8.json"
    _run(["benchmarks/fused_w8a8.py", "--quick", "--threads", "1", "--rounds", "2", "--out", str(out)])
    results = json.loads(out.read_text())
    assert results["fused_runs"]
    assert set(results["prefill"]) == {"torch_ops", "fused"}
    assert set(results["aligner"]) == {"cache_torch_ops", "no_cache_torch_ops", "no_cache_fused"}
    for forward in ("prefill", "aligner"):
        for entry in results[forward].values():
            assert entry["cpu_s"] > 0 and entry["wall_ratio"] > 0 and entry["rel_difference"] < 1e-3
    assert results["aligner"]["no_cache_torch_ops"]["rel_difference"] == 0  # the same ops: the same bits


def test_admission_bound_quick_run_measures_the_costs_and_runs_every_policy(tmp_path):
    """benchmarks/admission_bound.py on the tiny Qwen3-TTS: the step and codec costs measured and fitted, then off,
    admission and every cap on the simulated machine of those costs, with the bound and the ratios."""
    out = tmp_path / "bound.json"
    _run(["benchmarks/admission_bound.py", "--size", "tiny", "--cache-dir", str(tmp_path / "cache"), "--clients", "2",
          "--max-frames", "16", "--max-batch-size", "2", "--duration", "0.5", "--calls", "1", "--threads", "1",
          "--quick", "--out", str(out)])
    report = json.loads(out.read_text())
    assert set(report["policies"]) == {"off", "admission", "cap 1", "cap 2"}
    assert set(report["measured"]["step_ms_by_batch"]) == {"1", "2"} and len(report["measured"]["codec_ms"]) == 12
    assert all(value >= 0 for value in report["costs_s"].values()) and report["costs_s"]["step_s"] > 0
    for row in report["policies"].values():
        assert row["audio_s_per_s"] > 0 and 0 < row["min_continuity"] <= 1 and row["requests"] >= 2
    assert report["summary"]["admission_over_off"] > 0
