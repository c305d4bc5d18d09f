"""`SpeechSession`: one text spoken while it is written, on an engine core of its own
(`OmniPipeline.speech_session` makes one)."""

from __future__ import annotations

import time

import numpy as np

from omnimtp.engine.core import EngineCore
from omnimtp.engine.request import OmniOutput, Request


class SpeechSession:
    """One text spoken while it is written, from `OmniPipeline.speech_session`:

        with pipe.speech_session(voice="aiden", seed=1) as session:
            for piece in llm_reply_pieces:
                play(session.push(piece))     # the audio chunks the text so far lets the talker make
            play(session.finish())            # the rest; session.output: the OmniOutput

    `push` commits the ids no later text can change, cut into segments as a whole text is
    (`omnimtp.families.text.StreamedSpeechSegments`), and steps the engine until the talker waits for more
    text; `finish` ends the text and runs the request to its end. A segment whose talker ends early (codec EOS
    or max_frames) skips the rest of its text, as in `speech`; the request ends once the last segment's does
    (then `is_finished`, and further pushes make no audio). `close` (or leaving the `with`) drops an unfinished
    request; so does a `push` or `finish` after the talker waited more than text_idle_timeout seconds for text
    (it raises TimeoutError)."""

    def __init__(self, core: EngineCore, request: Request, text, text_idle_timeout: float):
        self._core = core
        self._request = request
        self._text = text  # a StreamedSpeechSegments
        self._is_closed = False
        self.text_idle_timeout = text_idle_timeout
        self.output: OmniOutput | None = None
        core.add(request)

    @property
    def is_finished(self) -> bool:
        return self.output is not None

    @property
    def text(self) -> str:
        """The text pushed so far."""
        return self._text.text

    def push(self, text: str) -> list[np.ndarray]:
        """More text → the float32 audio chunks made meanwhile (often none: the talker speaks a row per frame)."""
        self._check_open()
        pieces = self._text.push(text)
        if self.output is None:  # even with no settled ids yet: text came, so the wait for text starts again
            self._core.push_speech_text(self._request.request_id, pieces, is_finished=False)
        return self._run()

    def finish(self) -> list[np.ndarray]:
        """The end of the text → the rest of the audio chunks; `output` holds the whole result."""
        self._check_open()
        if not self._text.text.strip():
            raise ValueError("text: empty text")
        self._is_closed = True
        pieces = self._text.finish()
        if self.output is None:
            self._core.push_speech_text(self._request.request_id, pieces, is_finished=True)
        return self._run()

    def close(self) -> None:
        """Drop the request if it has not finished (its slot and talker row are freed)."""
        self._core.abort(self._request.request_id)
        self._is_closed = True

    def __enter__(self) -> SpeechSession:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._is_closed:
            raise ValueError("text: the session's text is finished (or the session is closed)")
        since = self._request.waits_for_text_since
        if self.output is None and since is not None and time.perf_counter() - since > self.text_idle_timeout:
            self.close()
            raise TimeoutError(f"text_idle_timeout: no text came for {self.text_idle_timeout:g} s; the session's "
                               "request is ended")

    def _run(self) -> list[np.ndarray]:
        chunks = []
        while self._core.has_ready_work():
            for event in self._core.step():
                if event.is_finished:
                    self.output = self._core.output(event.request)
                elif event.audio is not None:
                    chunks.append(event.audio)
        return chunks
