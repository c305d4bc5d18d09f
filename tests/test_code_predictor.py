"""The code predictor paths against transformers' reference on tiny seeded predictors.

Every path (re-prefill, DynamicCache loop, CodePredictorRunner) must give exactly the codes of
`cp.generate(..., do_sample=False)`. The seed's pitfalls are written out below as mutants and run
through the same checks, to show each of them would fail.
"""

from __future__ import annotations

import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import DynamicCache
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
    Qwen3OmniMoeTalkerCodePredictorModelForConditionalGeneration,
)

from omnimtp.models.tiny import tiny_code_predictor_config, tiny_qwen3_omni
from omnimtp.runtime.ops import packed_gemm_available, packed_gemm_kind, packed_gemm_kinds
from omnimtp.sampling import QWEN3_OMNI_CODE_PREDICTOR_SAMPLING, SamplingParams, make_generators
from omnimtp.talker.code_predictor import (
    CodePredictorRunner,
    ResidualCodes,
    next_talker_input,
    predict_residual_codes,
    predict_residual_codes_kv,
)

MAX_BATCH = 8


def make_cp(num_code_groups: int, attn: str = "sdpa", seed: int = 0, **kwargs):
    config = tiny_code_predictor_config(num_code_groups=num_code_groups, attn_implementation=attn, **kwargs)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        cp = Qwen3OmniMoeTalkerCodePredictorModelForConditionalGeneration(config)
    return cp.eval()


def frame_inputs(cp, batch_size: int, seed: int = 1, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(batch_size, cp.config.hidden_size, generator=g).to(dtype)  # [B, H]
    cb0 = torch.randn(batch_size, cp.config.hidden_size, generator=g).to(dtype)  # [B, H]
    return hidden, cb0


@torch.no_grad()
def hf_codes(cp, hidden, cb0):
    """The reference: transformers' generate on [h, E0(cb0)], greedy."""
    inputs_embeds = torch.cat([hidden[:, None], cb0[:, None]], dim=1)  # [B, 2, H]
    return cp.generate(
        inputs_embeds=inputs_embeds, max_new_tokens=cp.config.num_code_groups - 1, do_sample=False,
        return_dict_in_generate=True,
    ).sequences


_CPS: dict = {}
_RUNNERS: dict = {}


def cached_cp(num_code_groups: int, attn: str):
    key = (num_code_groups, attn)
    if key not in _CPS:
        _CPS[key] = make_cp(num_code_groups, attn)
    return _CPS[key]


def cached_runner(num_code_groups: int, attn: str):
    key = (num_code_groups, attn)
    if key not in _RUNNERS:
        _RUNNERS[key] = CodePredictorRunner(cached_cp(num_code_groups, attn), MAX_BATCH)
    return _RUNNERS[key]


def runner_codes(cp, hidden, cb0):
    runner = cached_runner(cp.config.num_code_groups, cp.config._attn_implementation)
    return runner.run(hidden, cb0).codes


PATHS = {
    "re_prefill": predict_residual_codes,
    "dynamic_cache": predict_residual_codes_kv,
    "runner": runner_codes,
}


def reference_mismatches(path, num_code_groups: int, attn: str) -> list[str]:
    """Runs `path` on the reference grid for one predictor; returns what differs from generate."""
    cp = cached_cp(num_code_groups, attn)
    problems = []
    for batch_size in (1, 2, 8):
        hidden, cb0 = frame_inputs(cp, batch_size, seed=batch_size)
        expected = hf_codes(cp, hidden, cb0)
        try:
            got = path(cp, hidden, cb0)
        except Exception as error:  # a mutant may crash; that counts as a failed check
            problems.append(f"B={batch_size}: raised {type(error).__name__}: {error}")
            continue
        if got.shape != expected.shape or not torch.equal(got, expected):
            problems.append(f"B={batch_size}: got {got.tolist()} expected {expected.tolist()}")
    return problems


GRID = [(g, attn) for g in (4, 16) for attn in ("sdpa", "eager")]


@pytest.mark.parametrize("num_code_groups,attn", GRID)
@pytest.mark.parametrize("path", sorted(PATHS))
def test_every_path_equals_hf_generate(path, num_code_groups, attn):
    assert reference_mismatches(PATHS[path], num_code_groups, attn) == []


@pytest.mark.parametrize("num_code_groups,attn", GRID)
def test_reference_codes_are_not_degenerate(num_code_groups, attn):
    """The equality checks above only have teeth if the reference codes vary across steps and rows."""
    cp = cached_cp(num_code_groups, attn)
    codes = hf_codes(cp, *frame_inputs(cp, 8, seed=8))
    assert len(set(codes.flatten().tolist())) > codes.shape[1]
    assert all(len(set(codes[:, j].tolist())) > 1 for j in range(codes.shape[1]))


@pytest.mark.parametrize("path", sorted(PATHS))
def test_row_alone_equals_row_in_batch(path):
    cp = cached_cp(16, "sdpa")
    hidden, cb0 = frame_inputs(cp, 8, seed=3)
    batched = PATHS[path](cp, hidden, cb0)
    for b in range(8):
        alone = PATHS[path](cp, hidden[b : b + 1], cb0[b : b + 1])
        assert torch.equal(alone[0], batched[b]), b


def _spy_on_model(cp, monkeypatch):
    """Records (new positions fed, cache length after the call) for every call of cp.model."""
    calls = []
    forward = cp.model.forward

    def spy(*args, **kwargs):
        out = forward(*args, **kwargs)
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        calls.append((kwargs["inputs_embeds"].shape[1], None if cache is None else cache.get_seq_length()))
        return out

    monkeypatch.setattr(cp.model, "forward", spy)
    return calls


@pytest.mark.parametrize("num_code_groups", [4, 16])
def test_dynamic_cache_grows_by_one_position_per_step(num_code_groups, monkeypatch):
    cp = make_cp(num_code_groups)
    calls = _spy_on_model(cp, monkeypatch)
    predict_residual_codes_kv(cp, *frame_inputs(cp, 2))
    assert [fed for fed, _ in calls] == [2] + [1] * (num_code_groups - 2)
    assert [length for _, length in calls] == list(range(2, num_code_groups + 1))


def test_re_prefill_feeds_the_whole_sequence_without_cache(monkeypatch):
    cp = make_cp(4)
    calls = _spy_on_model(cp, monkeypatch)
    predict_residual_codes(cp, *frame_inputs(cp, 2))
    assert calls == [(2, None), (3, None), (4, None)]


def test_runner_embed_sum_is_the_sum_of_residual_embeddings():
    cp = cached_cp(16, "sdpa")
    hidden, cb0 = frame_inputs(cp, 4)
    out = cached_runner(16, "sdpa").run(hidden, cb0)
    assert isinstance(out, ResidualCodes)
    codes, embed_sum = out  # unpacks like a tuple
    assert codes.dtype == torch.long and codes.shape == (4, 15)
    with torch.no_grad():
        expected = sum(cp.model.codec_embedding[j](codes[:, j]) for j in range(15))
    assert embed_sum.shape == (4, cp.config.hidden_size) and embed_sum.dtype == hidden.dtype
    torch.testing.assert_close(embed_sum, expected, rtol=0, atol=1e-5)
    with pytest.raises(AttributeError):
        out.codes = codes  # frozen


def test_runner_is_reusable_across_batch_sizes_and_frames():
    """The static KV buffer keeps stale slots from earlier, larger frames: they must never leak."""
    cp = cached_cp(16, "eager")
    runner = CodePredictorRunner(cp, MAX_BATCH)
    for batch_size, seed in [(8, 11), (1, 12), (5, 13), (8, 14), (2, 15)]:
        hidden, cb0 = frame_inputs(cp, batch_size, seed=seed)
        assert torch.equal(runner.run(hidden, cb0).codes, hf_codes(cp, hidden, cb0))


def test_inputs_are_not_modified():
    cp = cached_cp(4, "sdpa")
    hidden, cb0 = frame_inputs(cp, 2)
    text_step = torch.randn(2, cp.config.hidden_size)
    saved = [t.clone() for t in (hidden, cb0, text_step)]
    codes = predict_residual_codes(cp, hidden, cb0)
    predict_residual_codes_kv(cp, hidden, cb0)
    cached_runner(4, "sdpa").run(hidden, cb0, QWEN3_OMNI_CODE_PREDICTOR_SAMPLING, make_generators([1, 2]))
    saved_codes = codes.clone()
    next_talker_input(cp, cb0, codes, text_step)
    for before, after in zip(saved + [saved_codes], (hidden, cb0, text_step, codes), strict=True):
        assert torch.equal(before, after)


def test_next_talker_input_equals_hf_talker_construction():
    """transformers' talker builds its next input inside prepare_inputs_for_generation: code 0 from its
    own table, residual codes from its code predictor, their embeddings summed, plus the text row."""
    model = tiny_qwen3_omni(0)
    talker = model.talker
    cp = talker.code_predictor
    cp.generation_config.do_sample = False
    batch_size, hidden_size = 3, talker.config.text_config.hidden_size
    g = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, 128, (batch_size, 5), generator=g)  # last column: this step's code 0
    last_layer_hidden = torch.randn(batch_size, 5, hidden_size, generator=g)
    trailing_text_hidden = torch.randn(batch_size, 4, hidden_size, generator=g)
    tts_pad_embed = torch.randn(1, 1, hidden_size, generator=g)
    cache = DynamicCache(config=talker.config.text_config)
    cache.update(torch.zeros(batch_size, 2, 4, 16), torch.zeros(batch_size, 2, 4, 16), 0)
    for step, text_step in [(1, trailing_text_hidden[:, 1]), (4, tts_pad_embed[:, 0].expand(batch_size, -1))]:
        with torch.no_grad():
            hf = talker.prepare_inputs_for_generation(
                input_ids, cache=cache, attention_mask=torch.ones(batch_size, 5, dtype=torch.long),
                is_first_iteration=False, hidden_states=((last_layer_hidden,), None), generation_step=step,
                trailing_text_hidden=trailing_text_hidden, tts_pad_embed=tts_pad_embed, use_cache=True,
            )
            cb0_embed = talker.get_input_embeddings()(input_ids[:, -1])  # [B, H]
        codes = predict_residual_codes(cp, last_layer_hidden[:, -1], cb0_embed)
        assert torch.equal(codes, hf["residual_codes"][:, 1:])
        ours = next_talker_input(cp, cb0_embed, codes, text_step)
        assert torch.equal(ours, hf["inputs_embeds"][:, 0])
        # The runner's embed_sum plugs into the same sum (not bit-identical: different summation order).
        runner_out = CodePredictorRunner(cp, 4).run(last_layer_hidden[:, -1], cb0_embed)
        assert torch.equal(runner_out.codes, codes)
        torch.testing.assert_close(cb0_embed + runner_out.embed_sum + text_step, ours, rtol=0, atol=1e-5)


# --- sampling through the runner ---------------------------------------------------------------


def test_sampling_is_deterministic_per_seed():
    cp = cached_cp(16, "sdpa")
    runner = cached_runner(16, "sdpa")
    hidden, cb0 = frame_inputs(cp, 4)
    params = QWEN3_OMNI_CODE_PREDICTOR_SAMPLING
    first = runner.run(hidden, cb0, params, make_generators([1, 2, 3, 4])).codes
    again = runner.run(hidden, cb0, params, make_generators([1, 2, 3, 4])).codes
    other = runner.run(hidden, cb0, params, make_generators([5, 6, 7, 8])).codes
    assert torch.equal(first, again)
    assert not torch.equal(first, other)
    torch.manual_seed(7)
    default_rng = runner.run(hidden, cb0, params).codes
    torch.manual_seed(7)
    assert torch.equal(runner.run(hidden, cb0, params).codes, default_rng)


def test_greedy_sampling_params_mean_argmax():
    cp = cached_cp(16, "sdpa")
    runner = cached_runner(16, "sdpa")
    hidden, cb0 = frame_inputs(cp, 2)
    greedy = runner.run(hidden, cb0, SamplingParams.greedy(), make_generators([1, 2])).codes
    assert torch.equal(greedy, hf_codes(cp, hidden, cb0))


_BATCH_SEEDS = [101, 202, 303, 404, 505, 606, 707, 808]


@settings(max_examples=6, deadline=None)
@given(order=st.permutations(range(8)))
def test_seeded_row_alone_equals_same_row_in_any_batch(order):
    cp = cached_cp(16, "sdpa")
    runner = cached_runner(16, "sdpa")
    hidden, cb0 = frame_inputs(cp, 8, seed=21)
    params = QWEN3_OMNI_CODE_PREDICTOR_SAMPLING
    alone = [runner.run(hidden[b : b + 1], cb0[b : b + 1], params, make_generators([_BATCH_SEEDS[b]])).codes[0]
             for b in range(8)]
    index = torch.tensor(order)
    batched = runner.run(hidden[index], cb0[index], params, make_generators([_BATCH_SEEDS[b] for b in order])).codes
    for row, b in enumerate(order):
        assert torch.equal(batched[row], alone[b]), (row, b)


# --- compile -----------------------------------------------------------------------------------


def test_compiled_runner_equals_hf_generate():
    cp = make_cp(4, hidden_size=32, num_hidden_layers=1, intermediate_size=64, head_dim=8)
    runner = CodePredictorRunner(cp, 2, compile=True)
    assert runner.compile_mode == "step"
    hidden, cb0 = frame_inputs(cp, 2)
    out = runner.run(hidden, cb0)
    assert torch.equal(out.codes, hf_codes(cp, hidden, cb0))
    assert torch.equal(out.codes, CodePredictorRunner(cp, 2).run(hidden, cb0).codes)


def test_frame_compiled_runner_equals_eager_runner_greedy_and_sampled():
    """The whole frame as one graph: HF's greedy codes; seeded sampled codes equal the eager runner's. A
    batch of 3 runs on the 4-row bucket graph (zero rows padded, dropped)."""
    cp = make_cp(4, hidden_size=32, num_hidden_layers=1, intermediate_size=64, head_dim=8)
    runner = CodePredictorRunner(cp, 4, compile="frame", packed_gemm=False)
    eager = CodePredictorRunner(cp, 4, packed_gemm=False)
    assert [runner.bucket_rows(b) for b in (1, 2, 3, 4)] == [1, 2, 4, 4] and runner.num_graphs == 6
    hidden, cb0 = frame_inputs(cp, 3)
    out = runner.run(hidden, cb0)
    assert torch.equal(out.codes, hf_codes(cp, hidden, cb0))
    assert torch.allclose(out.embed_sum, eager.run(hidden, cb0).embed_sum, atol=1e-5)
    params = QWEN3_OMNI_CODE_PREDICTOR_SAMPLING
    sampled = runner.run(hidden, cb0, params, make_generators([3, 4, 5])).codes
    assert torch.equal(sampled, eager.run(hidden, cb0, params, make_generators([3, 4, 5])).codes)


def test_background_warm_up_compiles_every_bucket_while_serving_stays_exact(monkeypatch):
    """warm_up in a thread while this one serves every batch size: each frame equals the eager runner's,
    bit for bit, before, during and after the switch to the compiled graphs; every bucket gets its own
    graphs (5 buckets × greedy/sampled = 10, past torch.compile's default limit of 8 per function) and
    serving a warm bucket builds no further one. Compiled with dynamo's eager backend: the graph capture,
    guards and caches are what is tested here, not inductor's code (see the test above)."""
    import functools
    import threading

    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
    cp = make_cp(3, hidden_size=32, num_hidden_layers=1, intermediate_size=64, head_dim=8)
    runner = CodePredictorRunner(cp, 16, compile="frame", packed_gemm=False)
    eager = CodePredictorRunner(cp, 16, packed_gemm=False)
    params = QWEN3_OMNI_CODE_PREDICTOR_SAMPLING
    progress = []
    thread = threading.Thread(target=lambda: progress.append(runner.warm_up(lambda *a: progress.append(a[:3]))))
    thread.start()

    def check(batch_size):
        hidden, cb0 = frame_inputs(cp, batch_size, seed=batch_size)
        for got, want in [(runner.run(hidden, cb0), eager.run(hidden, cb0)),
                          (runner.run(hidden, cb0, params, make_generators(list(range(batch_size)))),
                           eager.run(hidden, cb0, params, make_generators(list(range(batch_size)))))]:
            assert torch.equal(got.codes, want.codes) and torch.equal(got.embed_sum, want.embed_sum)

    while thread.is_alive():
        for batch_size in range(1, 17):
            check(batch_size)
    thread.join()
    assert progress == [(1, 5, 1), (2, 5, 2), (3, 5, 4), (4, 5, 8), (5, 5, 16), True]
    assert runner.num_compiled_graphs == runner.num_graphs == 10
    for batch_size in range(1, 17):  # now on the compiled graphs
        check(batch_size)
    assert runner.num_compiled_graphs == 10


def test_warm_up_stops_between_buckets_and_an_eager_runner_has_none():
    import threading

    cp = make_cp(4, hidden_size=32, num_hidden_layers=1, intermediate_size=64, head_dim=8)
    stop = threading.Event()
    stop.set()
    runner = CodePredictorRunner(cp, 4, compile="frame", packed_gemm=False)
    assert runner.warm_up(stop=stop) is False and runner.num_compiled_graphs == 0
    assert CodePredictorRunner(cp, 4).warm_up() is False


def test_warm_up_builds_a_graph_only_while_idle(monkeypatch):
    """With `idle` clear (a request in flight) the warm-up starts no graph and the runner serves eagerly,
    without calling torch.compile (its first call imports dynamo: seconds); once it is set the warm-up builds
    every bucket (dynamo's eager backend: the scheduling is tested)."""
    import threading
    import time

    real_compile, compiled = torch.compile, []

    def counting_compile(fn, **kwargs):
        compiled.append(fn)
        return real_compile(fn, backend="eager", **kwargs)

    monkeypatch.setattr(torch, "compile", counting_compile)
    cp = make_cp(3, hidden_size=32, num_hidden_layers=1, intermediate_size=64, head_dim=8)
    runner = CodePredictorRunner(cp, 2, compile="frame", packed_gemm=False)
    idle, result = threading.Event(), []
    thread = threading.Thread(target=lambda: result.append(runner.warm_up(idle=idle)))
    thread.start()
    hidden, cb0 = frame_inputs(cp, 2)
    want = CodePredictorRunner(cp, 2, packed_gemm=False).run(hidden, cb0)
    time.sleep(0.5)
    got = runner.run(hidden, cb0)
    assert runner.num_compiled_graphs == 0 and thread.is_alive() and torch.equal(got.codes, want.codes)
    assert compiled == []
    idle.set()
    thread.join(60)
    assert result == [True] and runner.num_compiled_graphs == runner.num_graphs == len(compiled) == 4
    assert torch.equal(runner.run(hidden, cb0).codes, want.codes)


def _group_states(pgid: int) -> set[str]:
    """The states (R, S, T...) of the live processes in process group `pgid`, from /proc."""
    from pathlib import Path

    states = set()
    for entry in Path("/proc").iterdir():
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if entry.name.isdigit() and int(fields[2]) == pgid:
            states.add(fields[0])
    return states - {"Z"}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads process states from /proc")
def test_the_cache_filling_child_is_stopped_while_busy_and_killed_on_stop(tmp_path, monkeypatch):
    """The child compiling the graphs is stopped (its whole process group) while `idle` is clear, continues
    when it is set, and is killed at once when the warm-up stops."""
    import threading
    import time

    from omnimtp.talker.compile_cache import CacheFiller

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    cp = make_cp(3, hidden_size=32, num_hidden_layers=1, intermediate_size=64, head_dim=8)
    runner = CodePredictorRunner(cp, 1, compile="frame", packed_gemm=False)
    idle, stop = threading.Event(), threading.Event()

    def wait_for(condition, timeout=10.0):
        deadline = time.monotonic() + timeout
        while not condition() and time.monotonic() < deadline:
            time.sleep(0.02)
        return condition()

    filler = CacheFiller(runner, QWEN3_OMNI_CODE_PREDICTOR_SAMPLING, idle=idle, stop=stop)
    try:
        pgid = filler.process.pid
        assert wait_for(lambda: _group_states(pgid) == {"T"})
        idle.set()
        assert wait_for(lambda: _group_states(pgid) and "T" not in _group_states(pgid))
        idle.clear()
        assert wait_for(lambda: _group_states(pgid) == {"T"})
        stop.set()
        assert wait_for(lambda: not filler.is_running and not _group_states(pgid))
        assert filler.wait_built(1, False) is False
    finally:
        filler.close()


def test_the_cache_filling_child_makes_the_warm_up_a_cache_hit(tmp_path, monkeypatch):
    """warm_up(fill_cache_in_child=True): a child compiles every graph of a twin (the same modules, other
    weights) into inductor's on-disk cache; the runner's own compile of each is then an FX graph cache hit,
    and its frames equal the eager runner's, bit for bit."""
    from torch._dynamo.utils import counters

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    cp = make_cp(2, hidden_size=32, num_hidden_layers=1, intermediate_size=64, head_dim=8)
    runner = CodePredictorRunner(cp, 1, compile="frame", packed_gemm=False)
    hits, misses = counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_miss"]
    assert runner.warm_up(fill_cache_in_child=True) is True
    assert counters["inductor"]["fxgraph_cache_hit"] - hits == runner.num_graphs == 2
    assert counters["inductor"]["fxgraph_cache_miss"] == misses
    eager = CodePredictorRunner(cp, 1, packed_gemm=False)
    hidden, cb0 = frame_inputs(cp, 1)
    params = QWEN3_OMNI_CODE_PREDICTOR_SAMPLING
    for got, want in [(runner.run(hidden, cb0), eager.run(hidden, cb0)),
                      (runner.run(hidden, cb0, params, make_generators([7])),
                       eager.run(hidden, cb0, params, make_generators([7])))]:
        assert torch.equal(got.codes, want.codes) and torch.equal(got.embed_sum, want.embed_sum)
    assert runner.num_compiled_graphs == 2


def test_compile_argument_is_validated():
    cp = cached_cp(4, "sdpa")
    for bad in ("graph", 1, "True"):
        with pytest.raises(ValueError, match="compile"):
            CodePredictorRunner(cp, 2, compile=bad)
    assert CodePredictorRunner(cp, 2).compile_mode is None


# --- MKL-packed GEMM (fp32 CPU batches of 4+ rows, padded to a power-of-two bucket) --------------

needs_packed_gemm = pytest.mark.skipif(
    "mkl" not in packed_gemm_kinds(torch.device("cpu"), torch.float32), reason="this torch build has no MKL packed GEMM"
)
needs_row_kernel = pytest.mark.skipif(
    "row" not in packed_gemm_kinds(torch.device("cpu"), torch.float32),
    reason="omnimtp's row kernel does not run here",
)


def _assert_sampled_packed_equals_unpacked_and_rows_alone(packed, unpacked, hidden, cb0, first_seed: int) -> None:
    """Sampled with one seed per row: the packed runner == the unpacked one, and each row alone (one
    row: no packed matmul after the first step) == its row in the batch."""
    batch_size = hidden.shape[0]
    seeds = [first_seed + b for b in range(batch_size)]
    params = QWEN3_OMNI_CODE_PREDICTOR_SAMPLING
    sampled = packed.run(hidden, cb0, params, make_generators(seeds)).codes
    assert torch.equal(sampled, unpacked.run(hidden, cb0, params, make_generators(seeds)).codes)
    for b in range(batch_size):
        alone = packed.run(hidden[b : b + 1], cb0[b : b + 1], params, make_generators([seeds[b]])).codes
        assert torch.equal(sampled[b], alone[0]), b


@needs_packed_gemm
@pytest.mark.parametrize("batch_size", [4, 5, 8])
def test_packed_gemm_runner_equals_hf_generate_and_unpacked_rows(batch_size):
    """Greedy: the packed path (B=5 is padded to 8) gives HF's codes; sampled: each row equals the
    same row run alone (one row never uses packing) with its own seed, and the unpacked batch."""
    cp = make_cp(16)
    packed = CodePredictorRunner(cp, 8, packed_gemm="mkl")
    unpacked = CodePredictorRunner(cp, 8, packed_gemm=False)
    assert packed.packed_gemm and packed.packed_gemm_kind == "mkl" and not unpacked.packed_gemm
    hidden, cb0 = frame_inputs(cp, batch_size, seed=batch_size)
    out = packed.run(hidden, cb0)
    assert sorted(packed._gemms) == [8 if batch_size > 4 else 4]
    assert torch.equal(out.codes, hf_codes(cp, hidden, cb0))
    assert torch.allclose(out.embed_sum, unpacked.run(hidden, cb0).embed_sum, atol=1e-5)
    _assert_sampled_packed_equals_unpacked_and_rows_alone(packed, unpacked, hidden, cb0, first_seed=100)


@needs_packed_gemm
def test_packed_gemm_buckets_stop_at_max_batch_size():
    cp = make_cp(4)
    runner = CodePredictorRunner(cp, 6, packed_gemm="mkl")
    hidden, cb0 = frame_inputs(cp, 5)
    assert torch.equal(runner.run(hidden, cb0).codes, hf_codes(cp, hidden, cb0))
    assert sorted(runner._gemms) == [6]
    hidden, cb0 = frame_inputs(cp, 3)
    runner.run(hidden, cb0)
    assert sorted(runner._gemms) == [6]  # below PACKED_GEMM_MIN_ROWS: plain kernels, nothing packed


@pytest.mark.parametrize("kind, batch_size", [("mkl", 4), ("row", 3)])
def test_compiled_runner_with_packed_gemm_equals_hf_generate(kind, batch_size):
    """The row kernel with 3 rows: the first step (6 rows) runs the kernel, later steps plain kernels."""
    if kind not in packed_gemm_kinds(torch.device("cpu"), torch.float32):
        pytest.skip(f"{kind} does not run here")
    cp = make_cp(4, hidden_size=32, num_hidden_layers=1, intermediate_size=64, head_dim=8)
    runner = CodePredictorRunner(cp, 4, compile=True, packed_gemm=kind)
    hidden, cb0 = frame_inputs(cp, batch_size)
    assert torch.equal(runner.run(hidden, cb0).codes, hf_codes(cp, hidden, cb0))
    assert runner._gemms  # the compiled graph ran on the packed weights


# --- omnimtp's small-batch row kernel (fp32 CPU, every batch size, one packed copy) ----------


def test_default_fp32_kind_is_the_row_kernel_where_it_runs():
    from omnimtp.runtime.kernels import small_batch_linear

    kinds = packed_gemm_kinds(torch.device("cpu"), torch.float32)
    # wherever the kernel builds, AVX2 as AVX-512: the 0.6B Qwen3-TTS predictor's fp32 frame on a 2-core AVX2 box
    # took 2.0x (1 row) to 2.6x (8 rows) the time on MKL / F.linear
    assert (kinds[:1] == ["row"]) == small_batch_linear.available()
    assert packed_gemm_kind(torch.device("cpu"), torch.float32) == (kinds[0] if kinds else None)
    assert CodePredictorRunner(cached_cp(4, "sdpa"), 2).packed_gemm_kind == (kinds[0] if kinds else None)
    assert packed_gemm_available(torch.device("cpu"), torch.float32) == bool(kinds)
    assert packed_gemm_kinds(torch.device("cpu"), torch.float16) == []


@needs_row_kernel
@pytest.mark.parametrize("batch_size", [2, 3, 8])
def test_row_kernel_runner_equals_hf_generate_and_unpacked_rows(batch_size):
    """Greedy: HF's codes (the first step's 2 positions per row run as 2B rows in one call), and each
    row alone gives the same codes and embedding sum bit for bit; sampled: each row equals the same
    row alone with its own seed, and the unpacked batch."""
    cp = make_cp(16)
    packed = CodePredictorRunner(cp, 8, packed_gemm="row")
    unpacked = CodePredictorRunner(cp, 8, packed_gemm=False)
    hidden, cb0 = frame_inputs(cp, batch_size, seed=10 + batch_size)
    out = packed.run(hidden, cb0)
    assert sorted(packed._gemms) == [8]  # one packed copy for every batch size
    assert torch.equal(out.codes, hf_codes(cp, hidden, cb0))
    assert torch.allclose(out.embed_sum, unpacked.run(hidden, cb0).embed_sum, atol=1e-5)
    for b in range(batch_size):  # the kernel computes each row on its own: bit for bit in any batch
        alone = packed.run(hidden[b : b + 1], cb0[b : b + 1])
        assert torch.equal(alone.codes[0], out.codes[b]) and torch.equal(alone.embed_sum[0], out.embed_sum[b]), b
    _assert_sampled_packed_equals_unpacked_and_rows_alone(packed, unpacked, hidden, cb0, first_seed=300)


@needs_row_kernel
def test_row_kernel_runner_equals_hf_generate_at_odd_dims_and_16_rows():
    """Dims that are not multiples of the kernel's 16-float panels, and a batch of 9 (18 rows in the
    first step: a pass of 16 and a pass of 2)."""
    cp = make_cp(16, hidden_size=40, intermediate_size=72, head_dim=12, vocab_size=100)
    runner = CodePredictorRunner(cp, 9, packed_gemm="row")
    hidden, cb0 = frame_inputs(cp, 9, seed=4)
    assert torch.equal(runner.run(hidden, cb0).codes, hf_codes(cp, hidden, cb0))


@needs_row_kernel
def test_compiled_runner_runs_large_matrices_on_the_kernel_even_for_one_row(monkeypatch):
    """Under torch.compile one row of a matrix of 1M+ weights still runs the kernel (its custom op's
    dispatch cost is small next to reading 4 MB); smaller ones stay on torch.mv."""
    from omnimtp.runtime.kernels import small_batch_linear

    cp = make_cp(4, hidden_size=512, num_hidden_layers=1, intermediate_size=1024, head_dim=64)
    runner = CodePredictorRunner(cp, 2, compile=True, packed_gemm="row")
    rows_seen = []
    run = small_batch_linear._run
    monkeypatch.setattr(
        small_batch_linear, "_run", lambda x, p, n, *tiling: rows_seen.append((x.shape[0], n)) or run(x, p, n, *tiling)
    )
    hidden, cb0 = frame_inputs(cp, 1, seed=7)
    assert torch.equal(runner.run(hidden, cb0).codes, hf_codes(cp, hidden, cb0))
    assert (1, 2048) in rows_seen  # gate_up, 2048 x 512, one row
    assert all(n == 2048 for rows, n in rows_seen if rows == 1)  # the smaller matrices: torch.mv


def test_packed_gemm_argument_is_validated():
    cp = cached_cp(4, "sdpa")
    with pytest.raises(ValueError, match="packed_gemm"):
        CodePredictorRunner(cp, 4, packed_gemm="yes")
    with pytest.raises(ValueError, match="packed_gemm"):
        CodePredictorRunner(cp, 4, dtype=torch.float16, packed_gemm=True)
    with pytest.raises(ValueError, match="packed_gemm"):
        CodePredictorRunner(cp, 4, dtype=torch.bfloat16, packed_gemm="row")  # an fp32 kernel
    with pytest.raises(ValueError, match="packed_gemm"):
        CodePredictorRunner(cp, 4, packed_gemm="onednn")  # a bf16 kernel
    assert not CodePredictorRunner(cp, 4, dtype=torch.float16).packed_gemm


# --- bf16 ----------------------------------------------------------------------------------------


def test_bf16_runner_is_as_faithful_as_transformers_in_bf16():
    """bf16 codes drift from the fp32 ones (one flipped code changes the rest of the row), for
    transformers too: its sdpa and eager bf16 loops disagree on about a quarter of the rows of this
    tiny model. The runner's bf16 codes must match the fp32 reference about as often as transformers'
    bf16 codes do."""
    cp32 = make_cp(16)
    cp16 = make_cp(16).to(torch.bfloat16)
    runner = CodePredictorRunner(cp16, 8)
    ours, theirs = [], []
    for seed in range(1, 4):
        hidden, cb0 = frame_inputs(cp32, 8, seed=seed)
        truth = predict_residual_codes_kv(cp32, hidden, cb0)
        out = runner.run(hidden.bfloat16(), cb0.bfloat16())
        assert out.codes.dtype == torch.long and out.embed_sum.dtype == torch.bfloat16
        ours.append((out.codes == truth).float().mean().item())
        theirs.append(
            (predict_residual_codes_kv(cp16, hidden.bfloat16(), cb0.bfloat16()) == truth).float().mean().item()
        )
    assert sum(ours) / 3 >= sum(theirs) / 3 - 0.1, (ours, theirs)
    assert min(ours) > 0.5, ours


needs_onednn_bf16 = pytest.mark.skipif(
    packed_gemm_kind(torch.device("cpu"), torch.bfloat16) != "onednn", reason="no oneDNN bf16 on this CPU"
)


@needs_onednn_bf16
@pytest.mark.parametrize("batch_size", [1, 3, 8])
def test_bf16_onednn_packed_runner_equals_unpacked_and_rows_alone(batch_size):
    """bf16 matmuls on oneDNN-reordered weights give the same codes and embeddings as plain bf16
    kernels, greedy and sampled, and a seeded row alone equals its row in the batch."""
    cp = make_cp(16).to(torch.bfloat16)
    packed = CodePredictorRunner(cp, 8)
    unpacked = CodePredictorRunner(cp, 8, packed_gemm=False)
    assert packed.packed_gemm_kind == "onednn" and packed.packed_gemm and not unpacked.packed_gemm
    hidden, cb0 = frame_inputs(cp, batch_size, seed=batch_size, dtype=torch.bfloat16)
    out, plain = packed.run(hidden, cb0), unpacked.run(hidden, cb0)
    assert sorted(packed._gemms) == [8]  # one reordered copy for every batch size
    assert torch.equal(out.codes, plain.codes)
    assert torch.equal(out.embed_sum, plain.embed_sum)
    _assert_sampled_packed_equals_unpacked_and_rows_alone(packed, unpacked, hidden, cb0, first_seed=200)


@needs_onednn_bf16
def test_compiled_bf16_runner_with_onednn_packing_equals_eager():
    cp = make_cp(4, hidden_size=32, num_hidden_layers=1, intermediate_size=64, head_dim=8).to(torch.bfloat16)
    compiled = CodePredictorRunner(cp, 4, compile=True)
    eager = CodePredictorRunner(cp, 4, packed_gemm=False)
    hidden, cb0 = frame_inputs(cp, 3, dtype=torch.bfloat16)
    out = compiled.run(hidden, cb0)
    assert compiled._gemms  # the compiled graph ran on the reordered weights
    assert torch.equal(out.codes, eager.run(hidden, cb0).codes)


# --- the seed's pitfalls, each caught by the checks above --------------------------------------


@torch.no_grad()
def _mutant_lm_head0_every_step(cp, hidden, cb0):
    seq, codes = torch.stack([hidden, cb0], dim=1), []
    for j in range(cp.config.num_code_groups - 1):
        code = cp.lm_head[0](cp.model(inputs_embeds=seq).last_hidden_state[:, -1]).argmax(-1)
        codes.append(code)
        seq = torch.cat([seq, cp.model.codec_embedding[j](code)[:, None]], dim=1)
    return torch.stack(codes, dim=1)


@torch.no_grad()
def _mutant_kv_feeds_whole_sequence(cp, hidden, cb0):
    cache, seq, codes = DynamicCache(config=cp.config), torch.stack([hidden, cb0], dim=1), []
    for j in range(cp.config.num_code_groups - 1):
        out = cp.model(inputs_embeds=seq, cache=cache, use_cache=True).last_hidden_state
        code = cp.lm_head[j](out)[:, -1].argmax(-1)
        codes.append(code)
        seq = torch.cat([seq, cp.model.codec_embedding[j](code)[:, None]], dim=1)
    return torch.stack(codes, dim=1)


def _mutant_range(num_steps):
    @torch.no_grad()
    def mutant(cp, hidden, cb0):
        seq, codes = torch.stack([hidden, cb0], dim=1), []
        for j in range(num_steps(cp.config.num_code_groups)):
            code = cp.lm_head[j](cp.model(inputs_embeds=seq).last_hidden_state[:, -1]).argmax(-1)
            codes.append(code)
            seq = torch.cat([seq, cp.model.codec_embedding[j](code)[:, None]], dim=1)
        return torch.stack(codes, dim=1)

    return mutant


@torch.no_grad()
def _mutant_cat_instead_of_stack(cp, hidden, cb0):
    seq, codes = torch.cat([hidden, cb0], dim=0), []
    for j in range(cp.config.num_code_groups - 1):
        code = cp.lm_head[j](cp.model(inputs_embeds=seq).last_hidden_state[:, -1]).argmax(-1)
        codes.append(code)
        seq = torch.cat([seq, cp.model.codec_embedding[j](code)[:, None]], dim=1)
    return torch.stack(codes, dim=1)


MUTANTS = {
    "lm_head[0] every step": _mutant_lm_head0_every_step,
    "KV loop feeds the whole sequence": _mutant_kv_feeds_whole_sequence,
    "range(G)": _mutant_range(lambda g: g),
    "range(G-2)": _mutant_range(lambda g: g - 2),
    "cat instead of stack": _mutant_cat_instead_of_stack,
}


@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_each_pitfall_fails_the_reference_checks(name):
    failures = [reference_mismatches(MUTANTS[name], g, attn) for g, attn in GRID]
    assert any(failures), f"pitfall '{name}' slipped through the reference checks"


def test_in_place_pitfall_fails_the_unmodified_inputs_check():
    cp = cached_cp(4, "sdpa")
    cb0 = torch.randn(2, cp.config.hidden_size)
    text_step = torch.randn(2, cp.config.hidden_size)
    codes = torch.tensor([[1, 2, 3], [4, 5, 6]])
    before = cb0.clone()

    @torch.no_grad()
    def mutant_in_place(cp, cb0_embed, residual_codes, text_step):
        for j in range(cp.config.num_code_groups - 1):
            cb0_embed += cp.model.codec_embedding[j](residual_codes[:, j])
        return cb0_embed + text_step

    expected = next_talker_input(cp, cb0, codes, text_step)
    assert torch.equal(cb0, before)
    torch.testing.assert_close(mutant_in_place(cp, cb0, codes, text_step), expected)  # same value ...
    assert not torch.equal(cb0, before)  # ... but the caller's tensor was changed: caught


def test_one_table_for_all_columns_pitfall_is_caught():
    cp = cached_cp(4, "sdpa")
    cb0, text_step = torch.randn(2, cp.config.hidden_size), torch.randn(2, cp.config.hidden_size)
    codes = torch.tensor([[1, 2, 3], [4, 5, 6]])
    with torch.no_grad():
        wrong = cb0 + cp.model.codec_embedding[0](codes).sum(1) + text_step
    assert not torch.allclose(wrong, next_talker_input(cp, cb0, codes, text_step))


# --- bad input -------------------------------------------------------------------------------------


def _bad_frame_cases(hidden_size):
    h, e = torch.randn(2, hidden_size), torch.randn(2, hidden_size)
    return [
        ("last_talker_hidden", h[0], e),  # wrong rank
        ("cb0_embed", h, e[:, None]),
        ("cb0_embed", h, e[:1]),  # batch mismatch
        ("last_talker_hidden", torch.randn(2, hidden_size + 1), e),  # hidden size
        ("cb0_embed", h, e.double()),  # dtype
        ("last_talker_hidden", h.long(), e.long()),
        ("last_talker_hidden", [[0.0] * hidden_size], e),
    ]


@pytest.mark.parametrize("path", sorted(PATHS))
def test_bad_frame_inputs_raise_value_error_naming_the_argument(path):
    cp = cached_cp(4, "sdpa")
    for name, h, e in _bad_frame_cases(cp.config.hidden_size):
        with pytest.raises(ValueError, match=name):
            PATHS[path](cp, h, e)


def test_runner_rejects_bad_arguments():
    cp = cached_cp(4, "sdpa")
    runner = CodePredictorRunner(cp, 2)
    h, e = frame_inputs(cp, 3)
    with pytest.raises(ValueError, match="max_batch_size"):
        runner.run(h, e)
    h, e = frame_inputs(cp, 2)
    with pytest.raises(ValueError, match="sampling"):
        runner.run(h, e, sampling={"top_k": 50})
    with pytest.raises(ValueError, match="generators"):
        runner.run(h, e, QWEN3_OMNI_CODE_PREDICTOR_SAMPLING, make_generators([1]))
    with pytest.raises(ValueError, match="generators"):
        runner.run(h, e, QWEN3_OMNI_CODE_PREDICTOR_SAMPLING, [1, 2])
    with pytest.raises(ValueError, match="top_p"):
        runner.run(h, e, SamplingParams(top_p=0.0))
    with pytest.raises(ValueError, match="top_k"):
        runner.run(h, e, SamplingParams(top_k=-1))
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="max_batch_size"):
            CodePredictorRunner(cp, bad)
    with pytest.raises(ValueError, match="dtype"):
        CodePredictorRunner(cp, 2, dtype=torch.int64)
    with pytest.raises(ValueError, match="cb0_embed"):
        CodePredictorRunner(cp, 2, dtype=torch.bfloat16).run(h.bfloat16(), e)


def test_next_talker_input_rejects_bad_arguments():
    cp = cached_cp(4, "sdpa")
    hidden_size = cp.config.hidden_size
    e, t = torch.randn(2, hidden_size), torch.randn(2, hidden_size)
    codes = torch.zeros(2, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="residual_codes"):
        next_talker_input(cp, e, codes[:, :2], t)
    with pytest.raises(ValueError, match="residual_codes"):
        next_talker_input(cp, e, codes.float(), t)
    with pytest.raises(ValueError, match="residual_codes"):
        next_talker_input(cp, e, codes[0], t)
    with pytest.raises(ValueError, match="text_step"):
        next_talker_input(cp, e, codes, t[:1])
    with pytest.raises(ValueError, match="text_step"):
        next_talker_input(cp, e, codes, t[:, :-1])
    with pytest.raises(ValueError, match="cb0_embed"):
        next_talker_input(cp, e[0], codes, t)
