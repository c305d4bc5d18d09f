"""A conversation kept warm between turns (`omnimtp.engine.prefix_cache`) on the tiny Qwen3-Omni: a turn that
starts from the cached prefix replies with the same tokens, codes and PCM as the same conversation sent as one
request without a cache key, greedy and seeded, with text and audio turns; a changed earlier item
reuses only the blocks before the change; two audios behind the same placeholder ids never match; the cache
stays within its budget, least recently used out."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from audio_checks import assert_audio_equal
from spec_drafters import RecomputingDraft

from omnimtp.engine.core import EngineConfig, EngineCore
from omnimtp.engine.prefix_cache import PrefixCache
from omnimtp.engine.request import Request
from omnimtp.families.qwen2_5_omni import Qwen2_5OmniFamily
from omnimtp.media import MediaLimits
from omnimtp.pipeline import OmniPipeline
from omnimtp.runtime.kv_cache import SavedSlot
from omnimtp.sampling import SamplingParams
from omnimtp.server.metrics import ServerMetrics
from omnimtp.spec_decode.thinker_spec import ThinkerSpeculation
from omnimtp.talker.loop import TalkerPrefix
from omnimtp.thinker import PrefixRows, ThinkerRun

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BLOCK = 16


@pytest.fixture(scope="module")
def family():
    return OmniPipeline.tiny(seed=0).family


def _config(cache_bytes: int) -> EngineConfig:
    return EngineConfig(max_new_tokens=8, max_frames=6, prefix_cache_bytes=cache_bytes, prefill_block=BLOCK)


def _speech(seed: int, seconds: float = 0.4) -> np.ndarray:
    """A seeded noise burst at 16 kHz (the processor's rate): its features differ from any other seed's."""
    rng = np.random.default_rng(seed)
    return (0.3 * rng.standard_normal(int(16_000 * seconds))).astype(np.float32)


def _user(turn: int, is_audio: bool, audio_seed: int | None = None) -> dict:
    if not is_audio:
        return {"role": "user", "content": f"Turn {turn}: tell me something about the number {turn}."}
    return {"role": "user", "content": [{"type": "audio", "audio": _speech(turn if audio_seed is None else audio_seed)},
                                        {"type": "text", "text": "Answer this."}]}


def _request(family, messages: list[dict], request_id, sampling: SamplingParams | None, seed: int | None,
             cache_key: str | None = "session") -> Request:
    ids, media = family.chat_inputs(messages, MediaLimits())
    return Request(request_id, ids, max_new_tokens=8, max_frames=6, speaker=family.default_speaker, media=media,
                   thinker_sampling=sampling, talker_sampling=family.sampled_talker(sampling), seed=seed,
                   cache_key=cache_key)


def _finish(core: EngineCore, request: Request):
    core.add(request)
    output = None
    while core.has_work():
        for event in core.step():
            if event.is_finished:
                output = core.output(event.request)
    return output


def _assert_same(actual, expected) -> None:
    assert actual.text_ids == expected.text_ids
    assert torch.equal(actual.codes, expected.codes)
    assert_audio_equal(actual.audio, expected.audio)


@pytest.mark.parametrize("sampling, seed", [(None, None), (SamplingParams(temperature=0.9, top_p=0.95), 11)],
                         ids=["greedy", "seeded"])
def test_warm_turns_equal_the_conversation_sent_as_one_request(family, sampling, seed):
    """Five turns (text, audio, text, audio, text) on one warm engine: from turn 2 on each reuses cached rows,
    and each reply equals the same conversation sent as one request without a cache key (and no cache)."""
    warm = EngineCore(family, _config(64 << 20))
    messages = [{"role": "system", "content": "You are a helpful voice assistant."}]
    for turn in range(1, 6):
        messages.append(_user(turn, is_audio=turn % 2 == 0))
        request = _request(family, messages, turn, sampling, seed)
        output = _finish(warm, request)
        assert (request.num_reused_rows > 0) == (turn > 1), (turn, request.num_reused_rows)
        assert (request.num_talker_reused_rows > 0) == (turn > 1), (turn, request.num_talker_reused_rows)
        assert request.num_reused_rows % BLOCK == 0 and request.num_talker_reused_rows % BLOCK == 0
        cold = EngineCore(family, _config(0))
        expected = _finish(cold, _request(family, messages, turn, sampling, seed, cache_key=None))
        _assert_same(output, expected)
        messages.append({"role": "assistant", "content": output.text})
    stats = warm.prefix_cache.stats
    assert stats.hits == 4 and stats.misses == 1 and stats.reused_rows > 0 and stats.talker_reused_rows > 0
    assert len(cold.prefix_cache) == 0


def test_qwen2_5_omni_warm_turn_equals_the_uncached_request():
    """Qwen2.5-Omni (its talker reads the thinker's last layer): a second text turn that reuses the first
    turn's blocks replies as the uncached request does (seeded: its token2wav draws noise)."""
    family = Qwen2_5OmniFamily.tiny(0)
    warm = EngineCore(family, _config(64 << 20))
    messages = [_user(1, is_audio=False)]
    output = _finish(warm, _request(family, messages, 1, None, 3))
    messages += [{"role": "assistant", "content": output.text}, _user(2, is_audio=False)]
    request = _request(family, messages, 2, None, 3)
    output = _finish(warm, request)
    assert request.num_reused_rows > 0 and request.num_talker_reused_rows > 0
    _assert_same(output, _finish(EngineCore(family, _config(0)), _request(family, messages, 2, None, 3, None)))


def _three_text_turns(warm: EngineCore, family, empty_reply: str) -> list[dict]:
    """Three text turns on the warm engine's session: the messages, each reply's text after its turn (or
    empty_reply where a reply has none)."""
    messages = []
    for turn in range(1, 4):
        messages.append(_user(turn, is_audio=False))
        output = _finish(warm, _request(family, messages, turn, None, None))
        messages.append({"role": "assistant", "content": output.text or empty_reply})
    return messages


def test_a_changed_earlier_item_reuses_only_the_blocks_before_it(family):
    """Three turns, then the first reply cut short (what `conversation.item.truncate` does to the prompt): the
    next turn reuses whole blocks up to the first changed id only, and replies as the uncached request does."""
    warm = EngineCore(family, _config(64 << 20))
    messages = _three_text_turns(warm, family, "Something long enough to cut.")
    cached = warm.prefix_cache.get("session")
    messages[1] = {"role": "assistant", "content": messages[1]["content"][:2]}
    messages.append(_user(4, is_audio=False))
    request = _request(family, messages, 4, None, None)
    changed = next(p for p, (a, b) in enumerate(zip(request.prompt_ids, cached.ids, strict=False)) if a != b)
    output = _finish(warm, request)
    assert request.num_reused_rows == changed // BLOCK * BLOCK
    assert 0 < request.num_reused_rows < cached.num_rows
    _assert_same(output, _finish(EngineCore(family, _config(0)), _request(family, messages, 4, None, None, None)))


def _user_ids(family, request: Request) -> list[int]:
    """The prompt ids of the rows the Qwen3-Omni talker prefill starts with (its user turns)."""
    builder = family.talker_builder(request.prompt_ids, family.default_speaker)
    return [request.prompt_ids[p] for p in builder.user_positions]


def test_the_talker_reuses_only_its_equal_user_rows(family):
    """The talker prefill holds the user turns, then the turn's assistant rows (with the speaker): a new speaker
    still reuses every whole block of the earlier user rows; a changed earlier user turn reuses the talker
    blocks before the change only (an earlier assistant reply is not in the talker prefill); each reply equals
    the uncached request's."""
    other = next(s for s in family.speakers if s.lower() != family.default_speaker.lower())
    warm = EngineCore(family, _config(64 << 20))
    messages = _three_text_turns(warm, family, "Something.")
    previous = _user_ids(family, _request(family, messages, 0, None, None))
    messages.append(_user(4, is_audio=False))
    request = _request(family, messages, 4, None, None)
    request.speaker = other
    output = _finish(warm, request)
    assert request.num_talker_reused_rows == len(previous) // BLOCK * BLOCK > 0
    expected = _request(family, messages, 4, None, None, cache_key=None)
    expected.speaker = other
    _assert_same(output, _finish(EngineCore(family, _config(0)), expected))

    messages.append({"role": "assistant", "content": output.text or "Something."})
    previous = _user_ids(family, _request(family, messages, 0, None, None))
    messages[2] = {"role": "user", "content": "Turn 2 said otherwise, with other words in it."}
    messages.append(_user(5, is_audio=False))
    request = _request(family, messages, 5, None, None)
    changed = next(p for p, (a, b) in enumerate(zip(_user_ids(family, request), previous, strict=False)) if a != b)
    output = _finish(warm, request)
    assert request.num_talker_reused_rows == changed // BLOCK * BLOCK > 0
    assert request.num_talker_reused_rows < len(previous) // BLOCK * BLOCK
    _assert_same(output, _finish(EngineCore(family, _config(0)), _request(family, messages, 5, None, None, None)))


def test_a_long_talker_prefill_projects_its_user_rows_in_whole_blocks(family):
    """Longer than a block, the user rows are projected one block of user rows per call from the first (a
    matmul's rows may depend in the last bits on how many rows share the call, on other hardware than this),
    to the same rows as the projection of each block alone; shorter, in one call as transformers does."""
    messages = [_user(turn, is_audio=False) for turn in range(1, 3)]
    ids = family.chat_ids(messages)
    talker = family.model.talker
    with torch.no_grad():
        embeds = family.model.thinker.get_input_embeddings()(torch.tensor(ids))  # [P, D]
    calls = []
    hook = talker.text_projection.register_forward_hook(lambda module, args, out: calls.append(args[0].shape[-2]))
    try:
        builder = family.talker_builder(ids, family.default_speaker, None, BLOCK)
        calls.clear()  # the builder's own special rows
        rows = builder._user_rows(embeds, embeds)
        num_user = len(builder.user_positions)
        assert num_user + 9 > BLOCK
        assert calls == [BLOCK] * (num_user // BLOCK) + [num_user % BLOCK] * (num_user % BLOCK > 0)
        with torch.no_grad():
            alone = talker.text_projection(embeds[builder.user_positions[BLOCK : 2 * BLOCK]])
        assert torch.equal(rows[BLOCK : 2 * BLOCK], alone)
        builder = family.talker_builder(ids, family.default_speaker, None, num_user + 9)
        calls.clear()
        builder._user_rows(embeds, embeds)
        assert calls == [len(ids)]  # not longer than a block: every prompt row in one call, then the user rows
    finally:
        hook.remove()


def test_other_audio_behind_the_same_placeholders_is_not_reused(family):
    """The same conversation with the first turn's audio replaced by another of the same length (the same ids):
    the reuse stops at the audio's first row, and the reply is the uncached one."""
    warm = EngineCore(family, _config(64 << 20))
    messages = [_user(1, is_audio=True, audio_seed=5)]
    output = _finish(warm, _request(family, messages, 1, None, None))
    messages += [{"role": "assistant", "content": output.text}, _user(2, is_audio=False)]
    first = _request(family, messages, 2, None, None)
    changed = [_user(1, is_audio=True, audio_seed=6), *messages[1:]]
    second = _request(family, changed, 3, None, None)
    assert first.prompt_ids == second.prompt_ids
    audio_start = second.prompt_ids.index(family.model.config.thinker_config.audio_token_id)
    output = _finish(warm, second)
    assert second.num_reused_rows == audio_start // BLOCK * BLOCK
    _assert_same(output, _finish(EngineCore(family, _config(0)), _request(family, changed, 3, None, None, None)))


def test_under_pressure_the_least_recently_used_session_is_evicted_and_prefills_again(family):
    """A budget that holds one session's prefix: a second session evicts the first, whose next turn then
    prefills everything (a miss) and still replies as the uncached request does."""
    turns = {key: [_user(1, is_audio=False), {"role": "assistant", "content": "Sure."}] for key in "ab"}
    probe = EngineCore(family, _config(64 << 20))
    _finish(probe, _request(family, turns["a"][:1], "probe", None, None, cache_key="a"))
    warm = EngineCore(family, _config(probe.prefix_cache.num_bytes * 3 // 2))  # both sessions' entries are alike
    for key in "ab":
        _finish(warm, _request(family, turns[key][:1], f"{key}1", None, None, cache_key=key))
    assert warm.prefix_cache.get("a") is None and warm.prefix_cache.get("b") is not None
    assert warm.prefix_cache.stats.evictions == 1
    messages = [*turns["a"], _user(2, is_audio=False)]
    request = _request(family, messages, "a2", None, None, cache_key="a")
    output = _finish(warm, request)
    assert request.num_reused_rows == 0 and warm.prefix_cache.stats.misses == 3
    _assert_same(output, _finish(EngineCore(family, _config(0)), _request(family, messages, "a2", None, None, None)))


def test_bad_budgets_are_errors_naming_the_setting():
    with pytest.raises(ValueError, match="prefix_cache_bytes"):
        EngineConfig(prefix_cache_bytes=-1)
    with pytest.raises(ValueError, match="prefill_block"):
        EngineConfig(prefill_block=0)


def test_serve_session_cache_mb_flag(capsys):
    from omnimtp.cli import build_parser

    assert build_parser().parse_args(["serve", "--session-cache-mb", "0"]).session_cache_mb == 0
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--session-cache-mb", "-1"])
    assert "--session-cache-mb" in capsys.readouterr().err


def _thinker_rows(family, prompt: list[int], prefix: PrefixRows | None,
                  speculation: ThinkerSpeculation | None = None) -> tuple[ThinkerRun, torch.Tensor]:
    """Four greedy thinker steps with prefill blocks → the run and every row it handed out at
    accept_hidden_layer."""
    run = ThinkerRun(family.model.thinker, [prompt], accept_hidden_layer=family.accept_hidden_layer,
                     eos_token_ids=set(), max_new_tokens=8, decoder=family.thinker_decoder, prefill_block=BLOCK,
                     prefixes=[prefix], keeps_prefix=[True], speculation=speculation)
    rows = [event.hidden for _ in range(4) for event in run.step()]
    return run, torch.cat(rows)


def test_a_reused_prefix_gives_the_same_rows_bit_for_bit(family):
    """The thinker's rows of a prompt that starts from the previous prompt's blocks equal, bit for bit, those of
    the same prompt prefilled from scratch: the rows the talker reads, not only the tokens (a prefix reused up
    to a position inside a block computes that block's rows in other forwards, whose last bits differ)."""
    first = family.chat_ids([_user(1, is_audio=False), {"role": "assistant", "content": "Fine, and you?"},
                             _user(2, is_audio=False)])
    second = family.chat_ids([_user(1, is_audio=False), {"role": "assistant", "content": "Fine."},
                              _user(3, is_audio=False)])
    changed = next(p for p, (a, b) in enumerate(zip(first, second, strict=False)) if a != b)
    assert changed % BLOCK != 0  # the reuse ends inside a block
    kept = _thinker_rows(family, first, None)[0].kept_prefixes[0]
    assert kept.num_rows == len(first) // BLOCK * BLOCK > changed
    warm, warm_rows = _thinker_rows(family, second, kept)
    cold, cold_rows = _thinker_rows(family, second, None)
    assert warm.reused_rows == [changed // BLOCK * BLOCK] != [0] and cold.reused_rows == [0]
    assert warm.output_ids == cold.output_ids
    assert torch.equal(warm_rows, cold_rows)


def test_a_speculative_thinker_reuses_its_prefix_with_the_drafters_rows(family):
    """With speculative steps the prefix also keeps the rows after the final norm (what the drafter reads): a
    warm run's tokens, handed-out rows and kept final rows equal a cold run's."""
    first = family.chat_ids([_user(1, is_audio=False)])
    second = family.chat_ids([_user(1, is_audio=False), {"role": "assistant", "content": "Fine."},
                              _user(2, is_audio=False)])

    def speculation():
        return ThinkerSpeculation(RecomputingDraft(family.model.thinker, corrupt_rate=0.3), 2)

    kept = _thinker_rows(family, first, None, speculation())[0].kept_prefixes[0]
    assert kept.final is not None and kept.final.shape == kept.hidden.shape
    warm, warm_rows = _thinker_rows(family, second, kept, speculation())
    cold, cold_rows = _thinker_rows(family, second, None, speculation())
    assert warm.reused_rows[0] == kept.num_rows > 0
    assert warm.output_ids == cold.output_ids and torch.equal(warm_rows, cold_rows)
    assert torch.equal(warm.kept_prefixes[0].final, cold.kept_prefixes[0].final)
    without_final = PrefixRows(kept.ids, kept.kv, kept.embeds, kept.hidden, None, kept.block)
    assert _thinker_rows(family, second, without_final, speculation())[0].reused_rows == [0]


def _prefix(num_rows: int) -> PrefixRows:
    kv = torch.zeros(1, 2, 1, num_rows, 4)
    return PrefixRows(tuple(range(num_rows)), SavedSlot(kv, num_rows, 0), torch.zeros(num_rows, 4),
                      torch.zeros(num_rows, 4), None, 4)


def test_the_cache_stays_within_its_budget_least_recently_used_out():
    one = _prefix(8).num_bytes
    cache = PrefixCache(max_bytes=2 * one)
    cache.put("a", _prefix(8))
    cache.put("b", _prefix(8), reused_rows=8)
    assert cache.get("a") is not None  # "b" is now the least recently used
    cache.put("c", _prefix(8))
    assert cache.get("b") is None and cache.get("a") is not None and cache.get("c") is not None
    assert cache.num_bytes == 2 * one and cache.stats.evictions == 1
    assert cache.stats.hits == 1 and cache.stats.misses == 2 and cache.stats.reused_rows == 8
    cache.put("d", _prefix(24))  # larger than the whole budget: not kept, nothing else evicted
    assert cache.get("d") is None and len(cache) == 2
    cache.drop("a")
    assert cache.get("a") is None and cache.stats.drops == 1 and cache.num_bytes == one
    off = PrefixCache(0)
    off.put("a", _prefix(8))
    assert off.get("a") is None and off.num_bytes == 0
    with pytest.raises(ValueError, match="max_bytes"):
        PrefixCache(-1)


def _talker_prefix(num_rows: int) -> TalkerPrefix:
    return TalkerPrefix(torch.zeros(num_rows, 4), SavedSlot(torch.zeros(1, 2, 1, num_rows, 4), num_rows, 0), 4)


def test_talker_prefixes_count_in_the_budget_and_the_gauge():
    """A session's entry weighs its thinker and its talker prefix: two whole entries over the budget evict the
    older one (their thinker parts alone would fit), and the server's gauge reports both parts' bytes."""
    whole = _prefix(8).num_bytes + _talker_prefix(8).num_bytes
    cache = PrefixCache(max_bytes=2 * whole - 1)
    assert 2 * _prefix(8).num_bytes <= cache.max_bytes
    for key in ("a", "b"):
        cache.put(key, _prefix(8))
        cache.put_talker(key, _talker_prefix(8))
    assert cache.get("a") is None and cache.get_talker("b") is not None and cache.stats.evictions == 1
    assert cache.num_bytes == whole
    metrics = ServerMetrics()
    metrics.observe_session_cache(cache)
    assert metrics.registry.get_sample_value("omnimtp_session_cache_bytes") == whole
    assert metrics.registry.get_sample_value("omnimtp_session_cache_sessions") == 1


def test_matching_rows_stops_at_the_first_differing_id_or_row():
    prefix = _prefix(12)
    embeds = torch.zeros(20, 4)
    assert prefix.matching_rows(list(range(20)), embeds, max_rows=19) == 12 // 4 * 4
    assert prefix.matching_rows([0, 1, 2, 3, 4, 99, *range(6, 20)], embeds, max_rows=19) == 4
    changed = embeds.clone()
    changed[9, 1] = 1.0
    assert prefix.matching_rows(list(range(20)), changed, max_rows=19) == 8
    assert prefix.matching_rows(list(range(20)), embeds, max_rows=7) == 4
