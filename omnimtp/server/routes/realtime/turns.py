"""Server VAD: turns found in the session's input audio as it is appended, committed as user items."""

from __future__ import annotations

import numpy as np
from starlette.concurrency import run_in_threadpool

from omnimtp.server.audio import G711_CODECS
from omnimtp.server.routes.realtime.conversation import commit_audio
from omnimtp.server.routes.realtime.events import ResponseFields
from omnimtp.server.routes.realtime.formats import pcm_bytes
from omnimtp.server.routes.realtime.live import live_feed, take_live
from omnimtp.server.routes.realtime.responses import cancel_idle, start_response
from omnimtp.server.routes.realtime.state import RealtimeSession
from omnimtp.server.vad import SpeechDetector
from omnimtp.server.websocket import EventError, new_id


async def append_audio(state: RealtimeSession, data: str) -> None:
    max_seconds = state.context.engine.media_limits.max_audio_seconds
    rate = state.settings.input_rate
    max_bytes = 2 * int(max_seconds * rate)
    # the PCM16 bytes valid base64 decodes to, from its length: an append over the limit is never decoded
    num_bytes = (len(data) * 3 // 4 - data[-2:].count("=")) * (2 if state.settings.input_format in G711_CODECS else 1)
    if len(state.audio_buffer) + num_bytes > max_bytes:
        raise EventError(f"audio: the input audio buffer would hold more than the limit of {max_seconds:g} s of "
                         "audio per turn; commit or clear it first", param="audio", code="input_audio_buffer_full")
    pcm = pcm_bytes(data, state.settings.input_format, "audio")
    turns = state.turns
    if state.settings.turn_detection is not None and turns.detector is None:
        turns.restart(SpeechDetector(state.settings.turn_detection, rate))
    state.audio_buffer += pcm
    turns.num_appended += len(pcm) // 2
    turns.appended_ms += len(pcm) // 2 * 1000 / rate
    if turns.detector is not None:
        await _detect_turns(state, pcm)
    live_feed(state)  # a transcription session's turn in progress, heard as it comes (live.py)


async def _detect_turns(state: RealtimeSession, pcm: bytes) -> None:
    """Server VAD on newly appended audio (off the event loop): speech_started (barge-in: the active response
    is cancelled), speech_stopped → the turn's audio committed as a user item (→ a response). Between turns the
    buffer keeps only what a turn's prefix padding may need."""
    turns, session, rate = state.turns, state.session, state.settings.input_rate
    config = turns.detector.config
    samples = np.frombuffer(pcm, dtype="<i2").astype(np.float32) / 32768.0
    for event in await run_in_threadpool(turns.detector.feed, samples):
        if event.kind == "speech_started":
            start = max(turns.buffer_start, turns.sample(event.sample, rate) - config.prefix_padding_ms * rate // 1000)
            turns.speech_start, turns.item_id = start, new_id("item")
            cancel_idle(state)
            await session.send({"type": "input_audio_buffer.speech_started", "item_id": turns.item_id,
                                "audio_start_ms": turns.ms(start, rate)})
            if config.interrupt_response:
                state.stop_response("turn_detected")
            continue
        end = min(turns.num_appended, turns.sample(event.sample, rate) + config.silence_duration_ms * rate // 1000)
        if state.live is not None:  # the turn ends where its live recognition has heard to (a few ms of silence)
            end = max(end, state.live.next_sample)
        item_id = turns.item_id
        await session.send({"type": "input_audio_buffer.speech_stopped", "item_id": item_id,
                            "audio_end_ms": turns.ms(end, rate)})
        begin = 2 * (turns.speech_start - turns.buffer_start)
        cut = 2 * (end - turns.buffer_start)
        turn_pcm, rest = bytes(state.audio_buffer[begin:cut]), state.audio_buffer[cut:]
        state.audio_buffer = bytearray(rest)
        live_feed(state, until=end)
        live = take_live(state)
        turns.buffer_start, turns.speech_start, turns.item_id = end, None, None
        await commit_audio(state, turn_pcm, item_id, live)
        if config.create_response and state.response is None and state.settings.type == "realtime":
            await start_response(state, ResponseFields())
    if not turns.detector.is_speaking:  # keep the prefix padding (and a window of slack) of the silence
        keep = (config.prefix_padding_ms + 100) * rate // 1000
        drop = max(0, turns.num_appended - keep - turns.buffer_start)
        if drop:
            del state.audio_buffer[:2 * drop]
            turns.buffer_start += drop
