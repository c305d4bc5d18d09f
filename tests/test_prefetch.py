"""Reading a memory-mapped checkpoint's weights before the first reply (`omnimtp.runtime.prefetch`,
`OmniPipeline(prefetch=)`, `OmniPipeline.warm_up`): the pages are read and mapped in the background, only the
weights every reply reads (not the thinker's routed experts), opt-out, and the replies are the same."""

from __future__ import annotations

import ctypes
import json
import os
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from omnimtp import OmniPipeline
from omnimtp.quantized_checkpoint import random_quantized_checkpoint
from omnimtp.runtime import prefetch as prefetch_module
from omnimtp.runtime.kernels import small_batch_linear as sbl
from omnimtp.runtime.prefetch import PAGE_BYTES, _without, mapped_ranges, prefetch


def _mapping_rss_bytes(path: Path) -> int:
    """Bytes of `path`'s mappings that this process has mapped in (/proc/self/smaps Rss)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5 and ":" in fields[3]:  # a mapping's header line
                inside = len(fields) == 6 and fields[5] == str(path)
            elif inside and fields[0] == "Rss:":
                total += int(fields[1]) * 1024
    return total


@pytest.fixture
def mapped(tmp_path):
    """A 16 MiB tensor and a small one, memory-mapped from a safetensors file, and the file's path."""
    path = tmp_path / "weights.safetensors"
    save_file({"big": torch.arange(4 << 20, dtype=torch.float32), "small": torch.ones(3)}, str(path))
    with safe_open(str(path), "pt") as handle:
        return handle.get_tensor("big"), handle.get_tensor("small"), path


def test_mapped_ranges_are_the_page_spans_of_mapped_tensors_only(mapped):
    big, small, path = mapped
    placeholder = torch.zeros((), dtype=torch.bfloat16).expand(64, 64)  # (a quantized checkpoint's stand-in)
    ranges = mapped_ranges([big, small, torch.ones(1 << 20), placeholder, big[10:20]])
    assert list(ranges) == [str(path)]  # the anonymous tensor and the placeholder are left out
    ((start, end),) = ranges[str(path)]  # merged: the file's two tensors lie side by side
    assert start % PAGE_BYTES == 0 and end % PAGE_BYTES == 0
    assert start <= min(big.data_ptr(), small.data_ptr()) and end >= big.data_ptr() + big.nbytes
    assert end - start < big.nbytes + 3 * PAGE_BYTES


def test_prefetch_maps_the_pages_in_the_background(mapped):
    big, _, path = mapped
    assert _mapping_rss_bytes(path) < big.nbytes // 4  # nothing read yet but the header
    handle = prefetch([big])
    assert handle.wait(30) and handle.error is None
    summary = handle.summary()
    assert summary["is_done"] and summary["bytes"] >= big.nbytes and summary["files"] == {path.name: summary["bytes"]}
    assert _mapping_rss_bytes(path) >= big.nbytes  # mapped into the process, not only read into the page cache
    assert float(big[-1]) == (4 << 20) - 1


def test_prefetch_stops_between_chunks(mapped):
    big, _, _ = mapped
    handle = prefetch([big])
    handle.stop()
    assert handle.is_done and handle.wait(0)


def test_a_running_prefetch_is_stopped_before_the_interpreter_exits(mapped):
    """The exit hook stops every prefetch still reading (a daemon thread returning from its foreign call into a
    finalizing interpreter would abort the process) and forgets the finished ones."""
    big, _, _ = mapped
    handle = prefetch([big])
    assert handle in prefetch_module._RUNNING or handle.is_done
    prefetch_module._stop_running()
    assert handle.is_done and handle not in prefetch_module._RUNNING


@pytest.fixture(scope="module")
def quantized_dir(tmp_path_factory):
    """The tiny Qwen3-Omni as a quantized checkpoint (memory-mapped when loaded), with its tokenizer."""
    if not sbl.available():
        pytest.skip(f"kernel unavailable: {sbl.unavailable_reason()}")
    root = tmp_path_factory.mktemp("prefetch")
    source = OmniPipeline.tiny()
    source.save_pretrained(root / "float")
    config = json.loads((root / "float" / "config.json").read_text())
    random_quantized_checkpoint(config, root / "q", "w4a8", seed=5)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (root / "q" / name).write_bytes((root / "float" / name).read_bytes())
    return root / "q"


def _data_ptrs(tensors) -> set[int]:
    return {t.data_ptr() for t in tensors}


def test_a_quantized_checkpoint_prefetches_what_every_reply_reads_but_the_thinkers_routed_experts(quantized_dir):
    pipe = OmniPipeline.from_pretrained(quantized_dir)
    assert pipe.prefetch is not None
    summary = pipe.warm_up()["prefetch"]
    assert summary["is_done"] and summary["error"] is None and summary["advice"] in ("populate_read", "willneed")
    family = pipe.family
    wanted = _data_ptrs(family.per_request_tensors())
    thinker_experts = [t for layer in family.thinker_decoder.quantized_layers for q in layer if q is not None
                       for t in (q.packed, q.scales)]
    routed = [t for layer in family.thinker_decoder.layers if layer.quantized_experts is not None
              for q in layer.quantized_experts for t in (q.packed, q.scales)]
    talker_routed = [t for layer in family.talker_decoder.layers if layer.quantized_experts is not None
                     for q in layer.quantized_experts for t in (q.packed, q.scales)]
    assert routed and talker_routed and thinker_experts
    assert not _data_ptrs(routed) & wanted  # the thinker's routed experts: read as tokens route to them,
    assert _data_ptrs(routed) <= _data_ptrs(family.routed_expert_tensors())  # or ahead where memory holds them
    assert summary["if_room_bytes"] > 0 and summary["if_room_read"] in (True, False)
    assert _data_ptrs(talker_routed) <= wanted and _data_ptrs(thinker_experts) <= wanted
    code2wav = next(iter(pipe.model.code2wav.parameters()))
    assert code2wav.data_ptr() in wanted
    # the bytes read: every mapped file the wanted tensors lie in, and no more than those tensors span
    ranges = mapped_ranges(family.per_request_tensors())
    assert summary["bytes"] == sum(end - start for spans in ranges.values() for start, end in spans) > 0
    routed_bytes = sum(t.nbytes for t in routed)
    total = sum(size for size in json.loads((quantized_dir / "config.json").read_text())
                ["omnimtp_quantization"]["files"].values())
    assert summary["bytes"] <= total - routed_bytes + len(routed) * 2 * PAGE_BYTES


def test_prefetch_is_opt_out_and_changes_no_reply(quantized_dir):
    plain = OmniPipeline.from_pretrained(quantized_dir, prefetch=False)
    assert plain.prefetch is None and plain.warm_up()["prefetch"] is None
    fetched = OmniPipeline.from_pretrained(quantized_dir)
    fetched.warm_up()
    first, second = (pipe.generate("Hello", max_new_tokens=4, max_frames=6) for pipe in (plain, fetched))
    assert first.text_ids == second.text_ids and torch.equal(first.codes, second.codes)
    assert np.abs(first.audio).max() > 0 and np.array_equal(first.audio, second.audio)


def test_prefetch_must_be_a_bool():
    with pytest.raises(ValueError, match="prefetch"):
        OmniPipeline.tiny(prefetch="yes")


def test_a_model_made_in_memory_has_nothing_mapped_to_prefetch():
    pipe = OmniPipeline.tiny()
    summary = pipe.warm_up()["prefetch"]
    assert summary["is_done"] and summary["bytes"] == 0


def test_a_quantized_qwen2_5_omni_prefetches_its_thinker_talker_and_token2wav(tmp_path):
    if not sbl.available():
        pytest.skip(f"kernel unavailable: {sbl.unavailable_reason()}")
    from omnimtp.models.tiny_qwen2_5_omni import tiny_qwen2_5_omni_config

    random_quantized_checkpoint(tiny_qwen2_5_omni_config().to_dict(), tmp_path / "q", "int8", seed=3)
    pipe = OmniPipeline.from_pretrained(tmp_path / "q")
    pipe.prefetch.wait(60)
    summary = pipe.prefetch.summary()
    family = pipe.family
    wanted = _data_ptrs(family.per_request_tensors())
    assert next(iter(pipe.model.token2wav.parameters())).data_ptr() in wanted
    stored = [t for layer in family.thinker_decoder.quantized_layers for q in layer if q is not None
              for t in (q.packed, q.scales)]
    assert stored and _data_ptrs(stored) <= wanted  # a dense thinker: every layer, every reply
    assert summary["is_done"] and summary["bytes"] > 0
    assert any(name.startswith("quantized-") for name in summary["files"])


def _resident_fraction(tensor: torch.Tensor) -> float:
    """The fraction of the tensor's pages in the page cache (mincore)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p)
    start = tensor.data_ptr() - tensor.data_ptr() % PAGE_BYTES
    length = tensor.data_ptr() + tensor.nbytes - start
    pages = -(-length // PAGE_BYTES)
    vector = ctypes.create_string_buffer(pages)
    assert libc.mincore(start, length, vector) == 0, os.strerror(ctypes.get_errno())
    return sum(byte & 1 for byte in vector.raw) / pages


def _evicted(path) -> None:
    """`path`'s clean pages dropped from the page cache (those no process maps)."""
    with open(path, "rb+") as f:
        os.fsync(f.fileno())
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def test_the_if_room_weights_are_read_into_the_page_cache_only_where_memory_holds_them(mapped, monkeypatch):
    big, small, path = mapped
    _evicted(path)
    if _resident_fraction(big) > 0.5:
        pytest.skip("the file system keeps the file's pages (no eviction to observe)")
    monkeypatch.setattr(prefetch_module, "ROOM_RESERVE", 1.0)  # no room: the whole memory must stay available
    handle = prefetch([small], if_room=[big])
    assert handle.wait(30) and handle.is_room_read is False and handle.num_room_bytes >= big.nbytes
    assert handle.summary()["if_room_read"] is False and _resident_fraction(big) < 0.5
    monkeypatch.setattr(prefetch_module, "ROOM_RESERVE", 0.0)
    handle = prefetch([small], if_room=[big])
    assert handle.wait(30) and handle.is_room_read is True
    deadline = time.monotonic() + 30  # (the reads the hint starts finish on their own)
    while _resident_fraction(big) < 0.9 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _resident_fraction(big) >= 0.9
    assert _mapping_rss_bytes(path) < big.nbytes // 4  # in the page cache, not mapped into the process


def test_the_if_room_ranges_leave_out_what_the_first_read_covers():
    assert _without([(0, 100)], [(10, 20), (50, 60)]) == [(0, 10), (20, 50), (60, 100)]
    assert _without([(0, 100)], [(0, 100)]) == [] and _without([(0, 10)], []) == [(0, 10)]
    assert _without([(0, 10), (30, 40)], [(5, 35)]) == [(0, 5), (35, 40)]
