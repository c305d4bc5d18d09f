"""`/v1/realtime`: OpenAI's Realtime API over a WebSocket (GA event names), for a model with a thinker
(Qwen3-Omni, Qwen2.5-Omni): speech or text in, speech (with its transcript) or text out.

A session holds its conversation: user turns as text or audio (the committed input audio buffer, heard by
the thinker as audio), assistant turns as text (a reply's transcript), and the session's `instructions` as
the system turn. `response.create` answers the whole conversation as one chat request of the one engine
(continuous batching with every other request; the chat path): its text and audio deltas go out as the
engine makes them, so the first audio leaves while the thinker is still writing. `response.cancel`, or the
client leaving, cancels the request at the next frame boundary and frees its slot. The session's id is the
request's cache key: the engine keeps the thinker's KV of the conversation's last prompt (`serve
--session-cache-mb`), so a turn prefills only what changed since (`omnimtp.engine.prefix_cache`), with the same
reply bit for bit; the session's entry goes when its WebSocket closes.

    client                                   server
    session.update                           session.updated
    input_audio_buffer.append / .commit      input_audio_buffer.committed, conversation.item.added / .done
    conversation.item.create                 conversation.item.added, conversation.item.done
    conversation.item.retrieve / .delete     conversation.item.retrieved / .deleted
    response.create                          response.created, response.output_item.added,
                                             conversation.item.added, ...,
                                             response.output_audio.delta | response.output_text.delta,
                                             response.output_audio_transcript.delta, ..., response.done (usage)
    response.cancel                          response.done (status "cancelled")
    conversation.item.truncate               conversation.item.truncated
    output_audio_buffer.clear                output_audio_buffer.cleared

Audio is PCM16 mono, little-endian, base64 in the events. Output is at the model's 24 kHz; input is 24 kHz by
default and any rate `session.audio.input.format.rate` names is resampled (soxr).

Turns are found by server VAD unless the session sets `audio.input.turn_detection` to null (then the client
commits the buffer): Silero VAD (server/vad.py) on the session's own audio as it is appended, with OpenAI's
`server_vad` settings and defaults (threshold 0.5, prefix_padding_ms 300, silence_duration_ms 500,
create_response and interrupt_response true). Speech sends `input_audio_buffer.speech_started`
(`audio_start_ms`: where the committed audio begins, prefix padding included) and, with interrupt_response,
cancels the active response at its next frame (response.done: cancelled, reason "turn_detected"); the
silence after it sends `speech_stopped` (`audio_end_ms`: where it ends, the silence duration included),
`committed`, `conversation.item.added` / `.done` and, with create_response, a response. `semantic_vad` is the same
detector with its eagerness as the silence that ends a turn (low 1000 ms, medium and auto 500, high 250:
`vad.EAGERNESS_SILENCE_MS`). With `idle_timeout_ms` (either type), a response's audio played and that long more
without speech commit the buffered silence as a turn (`input_audio_buffer.timeout_triggered`) and answer it.

`conversation.item.truncate` cuts a spoken assistant item to the audio the user heard (`audio_end_ms`) and its
transcript with it (the talker reads one reply token per frame: the frames heard keep that many tokens), so
the next turns hold only what was heard. A reply's item is in the conversation from
`response.output_item.added` on: truncating (or deleting) it while its response streams cuts it at what it has
sent and cancels the response. Where the server loads a forced aligner (`serve --aligner-model`), a spoken reply's
`response.output_audio_transcript.done` carries its word timestamps (`words: [{word, start, end}]`, an
extension; responses.py), and a truncation cuts the transcript after the last word heard whole instead.
`output_audio_buffer.clear` cancels the active response at its next
frame and answers `output_audio_buffer.cleared`. Tools are not served, and asking for them is an `error` event
naming the field.

`session.audio.input.transcription` (`{"model", "language", "prompt"}`, the served model) transcribes each
committed audio item as a low-priority request of the same engine (routes/transcriptions.py's prompt; it
never delays a response's first audio): `conversation.item.input_audio_transcription.delta` events, then
`.completed` with the transcript, which the item keeps, or `.failed`.

A transcription session (`?intent=transcription`, or `session.type: "transcription"`) commits and transcribes
turns as above and makes no responses; its recognizer is transcription.py's `Recognizer` (the thinker today).

Extensions (not in OpenAI's API): `session.seed` (each response of the session is seeded with it: the same
conversation gives the same reply), `session.temperature` / `top_p` / `top_k` (chat's defaults: T 1, top-p 1,
no top-k).

Every bad client event is answered with an `error` event naming the field (`session.audio.output.voice`,
`item.content.0.audio`) and the session goes on.

Modules, by concern: events (client event schemas), formats (audio in and out), state (what a session holds),
settings (`session.update`), conversation (items), transcription (input transcripts), turns (server VAD),
responses, route (the WebSocket's event loop).
"""

from omnimtp.server.routes.realtime.route import ROUTE, router

__all__ = ["ROUTE", "router"]
