"""What every API module shares (vLLM's `serving_engine.py`): the one engine handle and the model checks
every route makes (`ServingContext`; a request's voice is routes/voices.py's), and the request plumbing:
the whole result of a request while watching its client (`collect`), SSE framing, PCM deltas, sampling
fields."""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np
from fastapi import Request
from pydantic import BaseModel, ValidationError
from starlette.concurrency import run_in_threadpool

from omnimtp.families.qwen3_aligner import Qwen3ForcedAligner
from omnimtp.limits import MAX_REF_AUDIO_SECONDS
from omnimtp.media import MediaError, decode_base64, decode_data_url
from omnimtp.sampling import SamplingParams
from omnimtp.server.audio import to_pcm16
from omnimtp.server.errors import CLIENT_CLOSED, APIError, queue_full, validation_error
from omnimtp.server.guard import RefusalPace, read_json
from omnimtp.server.requests import EngineRequest, PromptTooLongError, QueueFullError
from omnimtp.server.scheduler import Engine
from omnimtp.server.voice_store import VoiceStore
from omnimtp.tokenizer import token_bytes

# A response's header: the requests that had to start before it when it came (0: it started at the next step);
# a stream the server could not yet keep in real time waits behind them (`omnimtp.server.admission`).
QUEUE_POSITION_HEADER = "X-Queue-Position"

Body = TypeVar("Body", bound=BaseModel)

@dataclass(frozen=True)
class ServingContext:
    """The engine handle every route uses, and the server's limits. model_names: the names `model` may
    take (the engine's model id first), all listed by /v1/models. voices: the saved voices (None: the server
    saves none); max_ref_seconds: the longest voice-clone reference recording; aligner: the forced aligner that
    gives transcripts word timestamps (`serve --aligner-model`; None: word timestamps are refused);
    voice_aliases: other names of the model's speakers (`omnimtp.server.aliases`); asr: the speech recognizer's
    context (`hearing`)."""

    engine: Engine
    model_names: Sequence[str]
    max_body_bytes: int
    max_tokens_limit: int
    voices: VoiceStore | None = None
    max_ref_seconds: float = MAX_REF_AUDIO_SECONDS
    aligner: Qwen3ForcedAligner | None = None
    voice_aliases: Mapping[str, str] = field(default_factory=dict)  # lower-case alias → the model's speaker
    # the speech recognizer served beside the model (`serve --asr-model`): its own context, or None
    asr: ServingContext | None = None
    refusal_pace: RefusalPace = field(default_factory=RefusalPace)  # when a full server's refusals are answered

    def hearing(self, model: str | None) -> ServingContext:
        """The context whose model transcribes for a request naming `model`: the speech recognizer served beside
        this model for its names (and for no name); else this one (APIError 404 for a name neither serves)."""
        if self.asr is not None and (model is None or model in self.asr.model_names):
            return self.asr
        self.check_model(model)
        return self

    async def read_body(self, request: Request, schema: type[Body]) -> Body:
        """The request's JSON body validated by `schema` (on a worker thread: the parsed body may still be
        large); APIError 400 naming the field."""
        value = await read_json(request, self.max_body_bytes)
        if isinstance(value, dict) and schema.model_config.get("extra") == "forbid":
            # the first unknown key at once: the schema's errors for 100,000 of them take most of a second to
            # build, in one call that holds the GIL
            unknown = next((key for key in value if key not in schema.model_fields), None)
            if unknown is not None:
                raise APIError(400, f"Unrecognized request argument supplied: {unknown}", param=unknown,
                               code="unknown_parameter")
        try:
            return await run_in_threadpool(schema.model_validate, value)
        except ValidationError as exc:
            raise validation_error(exc) from None

    def check_model(self, model: str | None) -> str:
        """The name the response reports: the requested one, or the engine's model id."""
        if model is None:
            return self.engine.model_id
        if model not in self.model_names:
            served = ", ".join(self.model_names)
            raise APIError(404, f"The model {model!r} does not exist; this server serves: {served}",
                           param="model", code="model_not_found")
        return model

    def check_chat(self) -> None:
        """APIError 400 unless the model answers chat (a Qwen3-TTS model only speaks text)."""
        if not self.engine.has_chat:
            raise APIError(400, f"the model {self.engine.model_id!r} is a speech-only model (text to speech) and has "
                           "no chat; speak text with /v1/audio/speech", param="model",
                           code="model_not_supported")

    def speech_sampling(self, body) -> SamplingParams:
        """A speech request's sampling (`Engine.speech_sampling`). A model with a thinker samples its talker with
        the family's own settings, as transformers' `generate` does: such a request chooses greedy (temperature 0)
        or those (temperature left out, or 1), and any other temperature, top_p or top_k is a 400 naming it
        rather than a value silently ignored."""
        if self.engine.has_chat:
            for name in ("top_p", "top_k"):
                if getattr(body, name) is not None:
                    raise APIError(400, f"{name}: the model {self.engine.model_id!r} speaks with its talker's own "
                                   f"sampling settings; leave {name} out", param=name, code="invalid_value")
            temperature = body.temperature
            if temperature is not None and temperature != 1.0 and not SamplingParams(temperature=temperature).is_greedy:
                raise APIError(400, f"temperature: the model {self.engine.model_id!r} speaks greedily (temperature "
                               "0) or with its talker's own sampling (1, the default), not at another temperature",
                               param="temperature", code="invalid_value")
        return self.engine.speech_sampling(body.temperature, body.top_p, body.top_k)

    async def submit(self, request: EngineRequest, prompt=None):
        """Queue `request` in the engine: its `RequestHandle`. prompt: its (prompt ids, media), made beforehand
        (default: `Engine.prompt_ids` of its messages). APIError for a prompt over the limit (400), bad media
        (400), a full queue (429) or a stopping server (503)."""
        engine = self.engine
        if not engine.is_running:
            raise APIError(503, "the server is shutting down", type="server_error", code="server_shutting_down")
        try:
            # Tokenizing and the processor (feature extraction, image resizing) run off the event loop: other
            # requests' streams and /health go on meanwhile. A request whose client leaves meanwhile is not queued.
            if request.messages is None:  # a speech request: its text cut into the segments it is spoken in
                segments = await run_in_threadpool(engine.speech_segments, request)
                return engine.submit(request, loop=asyncio.get_running_loop(), segments=segments)
            if prompt is None:
                prompt = await run_in_threadpool(engine.prompt_ids, request)
            return engine.submit(request, loop=asyncio.get_running_loop(), prompt=prompt)
        except PromptTooLongError as exc:
            raise APIError(400, str(exc), param=exc.param, code="context_length_exceeded") from None
        except MediaError as exc:
            raise APIError(400, str(exc), param=exc.param, code="invalid_value") from None
        except QueueFullError as exc:
            raise queue_full(exc) from None

    async def check_room(self) -> None:
        """APIError 429 while the engine's queue is full (`Engine.check_room`), once `refusal_pace` lets it go out:
        asked before a request is built, so a full server refuses cheaply."""
        try:
            self.engine.check_room()
        except QueueFullError as exc:
            await self.refusal_pace.wait()
            raise queue_full(exc) from None


def serving(request: Request) -> ServingContext:
    """The app's `ServingContext` (set by `create_app`)."""
    return request.app.state.serving


def audio_bytes(data: str | bytes, param: str) -> bytes:
    """Encoded audio sent as base64 or a data:audio/... URL (or already bytes: an upload); APIError 400 naming
    `param` for neither."""
    if isinstance(data, bytes):
        return data
    try:
        return decode_data_url(data, param, "audio") if data.startswith("data:") else decode_base64(data, param)
    except MediaError as exc:
        raise APIError(400, str(exc), param=param, code="invalid_value") from None


def sampling_params(temperature: float, top_p: float, top_k: int | None) -> SamplingParams:
    return SamplingParams(temperature=float(temperature), top_k=top_k or None, top_p=float(top_p))


def sse(payload: dict | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


def b64_pcm16(samples: np.ndarray) -> str:
    return base64.b64encode(to_pcm16(samples).tobytes()).decode("ascii")


def stream_error(event) -> dict:
    """The OpenAI error object of an engine error event in a stream."""
    return {"message": event.error, "type": "server_error", "param": None, "code": event.error_code}


def response_error(event) -> APIError:
    """An engine error event as the error of a whole response: 503 when the server ended it (shutting down)."""
    status = 503 if event.error_code == "server_shutting_down" else 500
    return APIError(status, event.error, type="server_error", code=event.error_code)


async def collect(handle, request: Request, events=None, logprobs: list | None = None):
    """Wait for a whole request: (text, float32 samples, final event), while watching the client (`watched`).
    events: the handle's events still to read (default all of them). logprobs: a list the events' token logprobs
    are added to (a request that asked for them). Raises APIError on engine errors."""
    return await watched(_gather(handle.events() if events is None else events, logprobs), handle, request)


async def watched(work, handle, request: Request):
    """The result of the coroutine `work` on `handle`'s events, while watching the client: a disconnect
    cancels the engine request at once (its slot frees up at the next frame boundary) and is an APIError
    499; an error `work` raises cancels the request too, and is raised."""
    result = asyncio.ensure_future(work)
    disconnect = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait((result, disconnect), return_when=asyncio.FIRST_COMPLETED)
        if result.done():
            return result.result()
        raise APIError(CLIENT_CLOSED, "the client closed the connection", code="client_disconnected")
    except BaseException:
        handle.cancel()
        raise
    finally:
        result.cancel()
        disconnect.cancel()


async def first_event(handle, request: Request, events):
    """The first of `events` (an audio chunk, or the end of a request that made no audio), watching the client;
    APIError 500 for an engine error: nothing has been sent yet, so it leaves as an error body."""
    event = await watched(anext(events), handle, request)
    if event.error is not None:
        handle.cancel()
        raise response_error(event)
    return event


async def prepended(event, events):
    """`event`, then the rest of `events`."""
    yield event
    async for later in events:
        yield later


async def _gather(events, logprobs: list | None):
    texts, chunks = [], []
    async for event in events:
        if event.error is not None:
            raise response_error(event)
        texts.append(event.text)
        if logprobs is not None:
            logprobs.extend(event.logprobs)
        if event.audio is not None:
            chunks.append(event.audio)
        if event.finish_reason is not None:
            samples = np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.float32)
            return "".join(texts), samples, event
    raise APIError(500, "request ended without a result", type="server_error")


async def _wait_for_disconnect(request: Request) -> None:
    """Returns once the client has gone (the body has been read: `receive` only reports that now)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def logprob_items(tokenizer, logprobs, *, with_top: bool = False) -> list[dict]:
    """`omnimtp.sampling.TokenLogprob`s as OpenAI lists them: {token, logprob, bytes} (the token's own UTF-8 bytes;
    its text, a piece of a character shown as U+FFFD); with_top: and `top_logprobs`, the alternatives the same
    way (a chat completion's `logprobs.content`)."""
    ids = [lp.token_id for lp in logprobs]
    if with_top:
        ids += [token for lp in logprobs for token, _ in lp.top]
    texts = dict(zip(ids, token_bytes(tokenizer, ids), strict=True))

    def item(token_id: int, logprob: float) -> dict:
        piece = texts[token_id]
        return {"token": piece.decode("utf-8", errors="replace"), "logprob": logprob, "bytes": list(piece)}

    if not with_top:
        return [item(lp.token_id, lp.logprob) for lp in logprobs]
    return [{**item(lp.token_id, lp.logprob), "top_logprobs": [item(token, value) for token, value in lp.top]}
            for lp in logprobs]
